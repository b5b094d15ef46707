"""What the capture gateway relies on, asserted against the real engine (vLLM on CPU, the tiny
model): where the token ids and log-probs are in chat, completions and streaming answers, that
the prompt ids are the chat template's rendering (computed outside the engine), that a
token-id prompt is taken as is, that greedy output is deterministic, how tools and tool calls
are rendered, and the error statuses.

CPU inference is slow: each test makes few requests, with few generated tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from tests.vllm_engine import TOOLS, VllmEngine, post_json, post_stream

SAMPLES = Path(__file__).resolve().parent / "engine" / "samples"
MAX_TOKENS = 6

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]
# A tool loop: an assistant tool call (its arguments a compact JSON string, as a client may send
# back what it received), its result, the assistant's answer, a new question.
TOOL_HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20 degrees"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "And in Berlin?"},
]


def chat(engine: VllmEngine, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {
        "model": engine.model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        **fields,
    }
    answer = post_json(f"{engine.v1}/chat/completions", body)
    assert answer.status == 200, answer
    result: dict[str, Any] = answer.json()
    return result


@pytest.fixture(scope="module")
def greedy_chat(vllm_engine: VllmEngine) -> dict[str, Any]:
    """One greedy chat answer with token ids and log-probs (shared by several tests)."""
    return chat(vllm_engine, MESSAGES, top_logprobs=2)


def test_chat_answer_carries_prompt_ids_top_level_and_token_ids_per_choice(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    expected_prompt = vllm_engine.render([{"messages": MESSAGES, "add_generation_prompt": True}])[0]
    assert greedy_chat["prompt_token_ids"] == expected_prompt
    (choice,) = greedy_chat["choices"]
    assert "prompt_token_ids" not in choice
    generated = choice["token_ids"]
    assert len(generated) == greedy_chat["usage"]["completion_tokens"]
    assert greedy_chat["usage"]["prompt_tokens"] == len(expected_prompt)
    # One log-prob per generated token, each the greedy choice: the best of its top two.
    content = choice["logprobs"]["content"]
    assert len(content) == len(generated)
    for item in content:
        assert item["logprob"] <= 0.0
        assert item["logprob"] == max(top["logprob"] for top in item["top_logprobs"])


def test_a_token_id_prompt_is_taken_as_is_and_generates_what_the_chat_generated(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    prompt = greedy_chat["prompt_token_ids"]
    body = {
        "model": vllm_engine.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    answer = post_json(f"{vllm_engine.v1}/completions", body)
    assert answer.status == 200, answer
    result = answer.json()
    assert "prompt_token_ids" not in result
    (choice,) = result["choices"]
    # Completions carry both id lists per choice.
    assert choice["prompt_token_ids"] == prompt
    # The same prompt, greedy: the same tokens as the chat answer, with the same log-probs.
    (chat_choice,) = greedy_chat["choices"]
    assert choice["token_ids"] == chat_choice["token_ids"]
    chat_logprobs = [item["logprob"] for item in chat_choice["logprobs"]["content"]]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    for mine, theirs in zip(choice["logprobs"]["token_logprobs"], chat_logprobs, strict=True):
        assert math.isclose(mine, theirs, rel_tol=1e-4, abs_tol=1e-5)


def test_greedy_output_is_deterministic(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    again = chat(vllm_engine, MESSAGES, top_logprobs=2)
    (first,), (second,) = greedy_chat["choices"], again["choices"]
    assert second["token_ids"] == first["token_ids"]
    assert second["logprobs"] == first["logprobs"]


def test_streaming_chat_puts_prompt_ids_in_the_first_chunk_and_token_ids_in_each_delta(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    body = {
        "model": vllm_engine.model,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        "stream": True,
    }
    status, events = post_stream(f"{vllm_engine.v1}/chat/completions", body)
    assert status == 200, events
    assert events[-1] == "[DONE]"
    first, *rest = events[:-1]
    # The first chunk: the role, the prompt ids (top level), no generated token.
    assert first["prompt_token_ids"] == greedy_chat["prompt_token_ids"]
    (choice,) = first["choices"]
    assert choice["delta"] == {"role": "assistant", "content": ""}
    assert "token_ids" not in choice
    # Then the generated tokens (usually one a chunk) with their log-probs, no prompt ids.
    assert all("prompt_token_ids" not in chunk for chunk in rest)
    streamed = [tid for chunk in rest for tid in chunk["choices"][0]["token_ids"]]
    logprobs = [
        item["logprob"] for chunk in rest for item in chunk["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == greedy_chat["choices"][0]["token_ids"]
    assert logprobs == [
        item["logprob"] for item in greedy_chat["choices"][0]["logprobs"]["content"]
    ]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_streaming_completions_put_both_id_lists_per_choice_prompt_ids_first_only(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    prompt = greedy_chat["prompt_token_ids"]
    body = {
        "model": vllm_engine.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "stream": True,
    }
    status, events = post_stream(f"{vllm_engine.v1}/completions", body)
    assert status == 200, events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # No role chunk here: the first chunk already carries the first generated token.
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks] == [prompt] + [None] * (
        len(chunks) - 1
    )
    streamed = [tid for chunk in chunks for tid in chunk["choices"][0]["token_ids"]]
    assert streamed == greedy_chat["choices"][0]["token_ids"]
    # Each chunk's log-probs match its ids one for one. A chunk usually holds one token, but
    # vLLM's server sends what the engine produced since its last send, so on an idle, fast
    # machine two tokens can share a chunk (seen here): the count is not pinned to 1.
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) >= 1


def test_tools_and_tool_calls_are_rendered_by_the_template_with_arguments_reserialised(
    vllm_engine: VllmEngine,
) -> None:
    result = chat(vllm_engine, TOOL_HISTORY, tools=TOOLS, max_tokens=2)
    # vLLM parses a tool call's `arguments` string into an object before the template writes
    # it back with `tojson`: '{"city":"Paris"}' is rendered '{"city": "Paris"}'.
    parsed = json.loads(json.dumps(TOOL_HISTORY))
    parsed[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    as_parsed, verbatim = vllm_engine.render(
        [
            {"messages": parsed, "tools": TOOLS, "add_generation_prompt": True},
            {"messages": TOOL_HISTORY, "tools": TOOLS, "add_generation_prompt": True},
        ]
    )
    assert result["prompt_token_ids"] == as_parsed
    assert as_parsed != verbatim
    text = vllm_engine.decode(result["prompt_token_ids"])
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny, 20 degrees\n</tool_response>" in text
    system_block = text.split("<|im_end|>")[0]
    assert '{"type": "function", "function": {"name": "get_weather"' in system_block


def test_renderers_qwen3_renderer_renders_as_the_engine_does(
    vllm_engine: VllmEngine, greedy_chat: dict[str, Any]
) -> None:
    """The `renderers` package's Qwen3 renderer (what token-in-token-out bridges with) gives
    the engine's own prompt ids for the tiny model's tokenizer."""
    tools_answer = chat(vllm_engine, TOOL_HISTORY, tools=TOOLS, max_tokens=1)
    parsed = json.loads(json.dumps(TOOL_HISTORY))
    parsed[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    rendered = vllm_engine.render(
        [
            {"messages": MESSAGES, "add_generation_prompt": True},
            {"messages": parsed, "tools": TOOLS, "add_generation_prompt": True},
        ],
        with_renderers=True,
    )
    assert rendered["renderers"] == [
        greedy_chat["prompt_token_ids"],
        tools_answer["prompt_token_ids"],
    ]


def test_too_long_prompt_is_a_400(vllm_engine: VllmEngine) -> None:
    body = {"model": vllm_engine.model, "prompt": [5] * 2100, "max_tokens": 1}
    answer = post_json(f"{vllm_engine.v1}/completions", body)
    assert answer.status == 400, answer
    error = answer.json()["error"]
    assert error["code"] == 400
    assert error["type"] == "BadRequestError"
    assert "2048" in error["message"]


def test_unknown_model_is_a_404(vllm_engine: VllmEngine) -> None:
    body = {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 1}
    answer = post_json(f"{vllm_engine.v1}/chat/completions", body)
    assert answer.status == 404, answer
    assert answer.json()["error"]["code"] == 404


def _shape(value: Any) -> Any:
    """A JSON value's structure: the keys of objects, the shape of a list's first item."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_recorded_samples_have_the_live_engine_shapes(greedy_chat: dict[str, Any]) -> None:
    sample = json.loads((SAMPLES / "chat.json").read_text())
    assert _shape(sample["response"]) == _shape(greedy_chat)
