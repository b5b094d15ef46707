"""The gateway's reading of engine bodies (tokencapture.gateway.capture), on bodies in the shapes
a real vLLM 0.32 answered with (copied from its answers; no server here)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tokencapture.gateway.capture import (
    CHAT,
    COMPLETIONS,
    Generation,
    StreamAccumulator,
    echoed_text,
    generation_from_chat,
    generation_from_completion,
    prepare_upstream_body,
    replay_body,
    replay_chunks,
    strip_completion,
)

PROMPT = [260, 304, 81, 283, 274]
PROMPT_LOGPROBS: list[Any] = [None, -68.94, -18.2, -37.25, -46.02]


def _echo_answer() -> dict[str, Any]:
    """vLLM's completions answer to `echo: true, logprobs: 0, return_token_ids: true`: the
    log-probs cover the prompt's positions (the first `null`) and then the generated tokens;
    `token_ids` holds the generated tokens only."""
    return {
        "id": "cmpl-echo",
        "model": "tiny-qwen3",
        "choices": [
            {
                "index": 0,
                "text": " or or or",
                "logprobs": {"token_logprobs": [*PROMPT_LOGPROBS, -0.0146, -0.0017, -0.0054]},
                "finish_reason": "length",
                "token_ids": [452, 452, 452],
                "prompt_logprobs": [None, {"304": {"logprob": -68.94}}],
                "prompt_token_ids": PROMPT,
            }
        ],
    }


def test_echo_answer_keeps_only_the_generated_tokens_log_probs() -> None:
    generation = generation_from_completion(_echo_answer())
    assert generation.prompt_token_ids == PROMPT
    assert generation.generation_token_ids == [452, 452, 452]
    assert generation.generation_log_probs == [-0.0146, -0.0017, -0.0054]


def test_echo_stream_keeps_only_the_generated_tokens_log_probs() -> None:
    """In a stream, the chunk that carries `prompt_token_ids` also carries the prompt's
    log-probs before its own token's."""
    first = {
        "id": "cmpl-echo",
        "model": "tiny-qwen3",
        "choices": [
            {
                "index": 0,
                "text": " or",
                "logprobs": {"token_logprobs": [*PROMPT_LOGPROBS, -0.0146]},
                "prompt_token_ids": PROMPT,
                "token_ids": [452],
            }
        ],
    }
    rest = [
        {
            "choices": [
                {
                    "index": 0,
                    "text": " or",
                    "logprobs": {"token_logprobs": [logprob]},
                    "prompt_token_ids": None,
                    "token_ids": [452],
                    "finish_reason": finish,
                }
            ]
        }
        for logprob, finish in ((-0.0017, None), (-0.0054, "length"))
    ]
    accumulator = StreamAccumulator(COMPLETIONS)
    for chunk in [first, *rest]:
        accumulator.add(chunk)
    generation = accumulator.generation()
    assert generation.generation_token_ids == [452, 452, 452]
    assert generation.generation_log_probs == [-0.0146, -0.0017, -0.0054]
    assert generation.prompt_token_ids == PROMPT


def _chat_echo_answer(content: str) -> dict[str, Any]:
    """vLLM's chat answer to `echo: true` after a final assistant message "It is": the message's
    content is that text followed by the generated text; `token_ids` the generated tokens."""
    return {
        "id": "chatcmpl-echo",
        "model": "tiny-qwen3",
        "prompt_token_ids": PROMPT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
                "token_ids": [726, 726],
                "finish_reason": "length",
            }
        ],
    }


@pytest.mark.parametrize(
    ("request_fields", "echoed"),
    [
        ({"echo": True}, "It is"),
        ({"echo": "true"}, "It is"),
        ({"echo": False}, ""),
        ({}, ""),
        ({"echo": True, "last_role": "user"}, ""),
        ({"echo": True, "last_role": "user", "add_generation_prompt": False}, "It is"),
        ({"echo": True, "parts": True}, "It\nis"),
    ],
)
def test_a_chat_echo_is_taken_off_the_stored_content(
    request_fields: dict[str, Any], echoed: str
) -> None:
    fields = dict(request_fields)
    role = fields.pop("last_role", "assistant")
    content: Any = [{"type": "text", "text": "It"}, {"type": "text", "text": "is"}]
    if not fields.pop("parts", False):
        content = "It is"
    request = {"messages": [{"role": "user", "content": "Say"}, {"role": role, "content": content}]}
    request.update(fields)
    assert echoed_text(request) == echoed
    answer = _chat_echo_answer(echoed + "pacepace")
    generation = generation_from_chat(answer, echoed_text(request))
    assert generation.output_items[0]["content"] == "pacepace"
    assert generation.generation_token_ids == [726, 726]
    assert answer["choices"][0]["message"]["content"] == echoed + "pacepace"  # the client's


def test_prompt_log_probs_the_gateway_caused_are_removed() -> None:
    """`echo` with the log-probs the gateway injects makes vLLM add `prompt_logprobs`: removed
    for a client that asked for neither, kept for one that asked for them."""
    _, plain = prepare_upstream_body(COMPLETIONS, {"prompt": "x", "echo": True})
    stripped = strip_completion(_echo_answer(), plain)
    assert "prompt_logprobs" not in stripped["choices"][0]
    assert "logprobs" not in stripped["choices"][0]
    _, asked = prepare_upstream_body(
        COMPLETIONS, {"prompt": "x", "echo": True, "prompt_logprobs": 1}
    )
    kept = strip_completion(_echo_answer(), asked)
    assert kept["choices"][0]["prompt_logprobs"]


_TOOL_CALL = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("kind", "item"),
    [
        (CHAT, {"role": "assistant", "content": "hi there"}),
        (CHAT, {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]}),
        (CHAT, {"role": "assistant", "content": "x", "reasoning_content": "because"}),
        (COMPLETIONS, {"role": "assistant", "content": " or or"}),
    ],
)
def test_a_replay_reads_back_as_the_generation_it_was_built_from(
    kind: str, item: dict[str, Any]
) -> None:
    """A replayed answer, whole or streamed, is the inverse of the gateway's reading of an
    engine's answer: read back, it is the same generation (the finish reason computed)."""
    generation = Generation(PROMPT, [452, 453, 2], [-0.5, -0.25, -0.125], [item], "m", "rid")
    body = replay_body(kind, generation, {}, 0)
    read = generation_from_chat if kind == CHAT else generation_from_completion
    expected = "tool_calls" if item.get("tool_calls") else "stop"
    assert read(body) == dataclasses.replace(generation, finish_reason=expected)
    accumulator = StreamAccumulator(kind)
    for chunk in replay_chunks(kind, generation, {"max_tokens": 3}, 0):
        accumulator.add(chunk)
    assert accumulator.generation() == dataclasses.replace(generation, finish_reason="length")
