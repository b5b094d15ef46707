"""The gateway's reading of engine bodies (tokencapture.gateway.capture), on bodies in the shapes
a real vLLM 0.32 answered with (copied from its answers; no server here)."""

from __future__ import annotations

from typing import Any

from tokencapture.gateway.capture import (
    COMPLETIONS,
    StreamAccumulator,
    generation_from_completion,
    prepare_upstream_body,
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
