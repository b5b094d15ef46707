"""What the gateway reads from and writes into OpenAI-compatible bodies (no HTTP here).

vLLM's answers with `return_token_ids: true` (checked against a real vLLM on CPU):

* chat completions carry `prompt_token_ids` at the top level and `token_ids` on each choice;
  log-probs are `choices[i].logprobs.content[j].logprob`;
* completions carry both `prompt_token_ids` and `token_ids` on each choice; log-probs are
  `choices[i].logprobs.token_logprobs`;
* a stream's first chunk carries the prompt ids (chat: top level; completions: on the choice)
  and no generated ids; every later chunk carries its delta's `token_ids` and log-probs.

"The client asked for log-probs" follows the OpenAI semantics: chat `logprobs: true`;
completions `logprobs` set to any integer, 0 included. Token fields the client did not ask for
are removed from what it receives, not nulled.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from tokencapture.records import TokenEntry

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DIVERGED_REASON",
    "CaptureError",
    "Generation",
    "Requested",
    "StreamAccumulator",
    "assistant_item",
    "echoed_text",
    "generation_from_chat",
    "generation_from_completion",
    "generation_from_entry",
    "prepare_upstream_body",
    "replay_body",
    "replay_chunks",
    "strip_chat",
    "strip_completion",
]

CHAT: Final[str] = "chat"
COMPLETIONS: Final[str] = "completions"

# The resolver found the parent, but the engine's prompt does not begin with the parent's exact
# prompt + generation tokens (it re-rendered the conversation differently from what it sampled).
DIVERGED_REASON: Final[str] = "prompt_diverged_from_parent_tokens"


class CaptureError(ValueError):
    """The upstream's answer lacks what a capture needs (token ids, log-probs, one choice)."""


@dataclass(frozen=True, slots=True)
class Requested:
    """Which token fields the client itself asked for, and whether it streams."""

    token_ids: bool
    logprobs: bool
    stream: bool
    prompt_logprobs: bool = False


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(token) is int and token >= 0 for token in value):
        raise CaptureError(f"the upstream's answer has no {what} (a list of token ids)")
    return value


# The strings pydantic's lax mode reads as true, as vLLM's request models read a boolean field.
_TRUE_WORDS: Final[frozenset[str]] = frozenset({"1", "on", "t", "true", "y", "yes"})


def _engine_reads_true(value: object) -> bool:
    """Whether the engine takes `value` of a boolean field as true: vLLM's request models are
    pydantic's, whose lax booleans take `1`, `1.0` and words like `"true"` or `"yes"` too. A
    client that sent `"logprobs": 1` asked for them, and is given them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    if isinstance(value, str):
        return value.lower() in _TRUE_WORDS
    return False


def prepare_upstream_body(kind: str, body: dict[str, Any]) -> tuple[dict[str, Any], Requested]:
    """The body to send upstream (token ids and log-probs injected) and what the client asked.

    Raises `ValueError` for a request the gateway cannot capture (`n > 1`, a bad `stream`).
    """
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        raise ValueError(
            f"n={n!r}: the capture gateway records one generation per call; send n=1 (or "
            "omit it) and make several calls, each with its own X-Model-Call-Id"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ValueError("stream must be a boolean")
    if kind == COMPLETIONS and _batched(body.get("prompt")):
        raise ValueError(
            "prompt is a batch of several prompts: the capture gateway records one generation "
            "per call; send one prompt (a string or a list of token ids) per call, each with "
            "its own X-Model-Call-Id"
        )
    asked_ids = _engine_reads_true(body.get("return_token_ids"))
    upstream = dict(body)
    upstream["return_token_ids"] = True
    if kind == CHAT:
        asked_logprobs = _engine_reads_true(body.get("logprobs"))
        upstream["logprobs"] = True
    else:
        logprobs = body.get("logprobs")
        asked_logprobs = logprobs is not None and logprobs is not False
        if not asked_logprobs:
            upstream["logprobs"] = 0
    asked_prompt_logprobs = body.get("prompt_logprobs") is not None
    return upstream, Requested(asked_ids, asked_logprobs, bool(stream), asked_prompt_logprobs)


def _batched(prompt: object) -> bool:
    """Whether a completions `prompt` is a batch (several strings or token lists): the engine
    would answer one choice per prompt, which one call's entry cannot hold."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and any(isinstance(item, str | list) for item in prompt)
    )


def _finite(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CaptureError("the upstream's answer has a log-prob that is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise CaptureError(f"the upstream's answer has a log-prob of {number}")
    return number


def _chat_logprobs(logprobs: object) -> list[float]:
    if not isinstance(logprobs, Mapping):
        return []
    content = logprobs.get("content")
    if not isinstance(content, list):
        return []
    return [_finite(item.get("logprob") if isinstance(item, Mapping) else None) for item in content]


def _completion_logprobs(logprobs: object, prompt_len: int = 0, generated: int = 0) -> list[float]:
    """The generated tokens' log-probs of a completions choice (or stream chunk).

    With `echo`, vLLM's `token_logprobs` begins with the prompt's positions (the first of them
    `null`) in the answer, or the stream chunk, that carries `prompt_token_ids`: when there are
    exactly `prompt_len` more values than `generated` tokens, those leading values are the
    prompt's and are skipped.
    """
    if not isinstance(logprobs, Mapping):
        return []
    values = logprobs.get("token_logprobs")
    if not isinstance(values, list):
        return []
    if prompt_len and len(values) == prompt_len + generated:
        values = values[prompt_len:]
    return [_finite(value) for value in values]


def assistant_item(message: Mapping[str, Any]) -> dict[str, Any]:
    """The output item of an assistant message: role, content, tool calls, reasoning."""
    item: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    tool_calls = message.get("tool_calls")
    if tool_calls:
        item["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": dict(call.get("function") or {}),
            }
            for call in tool_calls
            if isinstance(call, Mapping)
        ]
    for key in ("reasoning_content", "reasoning"):
        if message.get(key):
            item[key] = message[key]
    return item


@dataclass(slots=True)
class Generation:
    """One captured generation, as the engine reported it."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    output_items: list[dict[str, Any]]
    model: str
    response_id: str | None
    finish_reason: str | None = None


def _one_choice(body: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise CaptureError("the upstream's answer does not have exactly one choice")
    return choices[0]


def _checked(generation: Generation) -> Generation:
    if len(generation.generation_log_probs) != len(generation.generation_token_ids):
        raise CaptureError(
            f"the upstream's answer has {len(generation.generation_log_probs)} log-probs for "
            f"{len(generation.generation_token_ids)} generated tokens"
        )
    return generation


def echoed_text(request: Mapping[str, Any]) -> str:
    """The text vLLM puts before a chat answer's content when the request asks for `echo`:
    the last message's content, when that message is in the answer's role (the assistant's,
    or with `add_generation_prompt: false` the last message's own); "" otherwise."""
    messages = request.get("messages")
    if not _engine_reads_true(request.get("echo")) or not isinstance(messages, list):
        return ""
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping):
        return ""
    role = "assistant" if request.get("add_generation_prompt", True) is not False else None
    if role is not None and last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):  # parts: the engine joins their texts with newlines
        content = "\n".join(
            str(part.get("text", "")) for part in content if isinstance(part, Mapping)
        )
    return content if isinstance(content, str) else ""


def generation_from_chat(body: Mapping[str, Any], echoed: str = "") -> Generation:
    """The generation of a chat completion answered with `return_token_ids` and log-probs.

    `echoed` (see `echoed_text`) is taken off the front of the answer's content: the entry's
    output is what the engine generated, as its token ids are."""
    choice = _one_choice(body)
    message = choice.get("message")
    if not isinstance(message, Mapping):
        raise CaptureError("the upstream's chat answer has no message")
    content = message.get("content")
    if echoed and isinstance(content, str) and content.startswith(echoed):
        message = {**message, "content": content[len(echoed) :]}
    return _checked(
        Generation(
            _int_list(body.get("prompt_token_ids"), "prompt_token_ids"),
            _int_list(choice.get("token_ids"), "token_ids"),
            _chat_logprobs(choice.get("logprobs")),
            [assistant_item(message)],
            str(body.get("model") or ""),
            body.get("id") if isinstance(body.get("id"), str) else None,
            choice.get("finish_reason"),
        )
    )


def generation_from_completion(body: Mapping[str, Any]) -> Generation:
    """The generation of a completion answered with `return_token_ids` and log-probs."""
    choice = _one_choice(body)
    text = choice.get("text")
    prompt = _int_list(choice.get("prompt_token_ids"), "prompt_token_ids")
    generated = _int_list(choice.get("token_ids"), "token_ids")
    return _checked(
        Generation(
            prompt,
            generated,
            _completion_logprobs(choice.get("logprobs"), len(prompt), len(generated)),
            [{"role": "assistant", "content": text if isinstance(text, str) else ""}],
            str(body.get("model") or ""),
            body.get("id") if isinstance(body.get("id"), str) else None,
            choice.get("finish_reason"),
        )
    )


def strip_chat(body: dict[str, Any], requested: Requested) -> dict[str, Any]:
    """Remove (in place) the token fields of a chat body or chunk the client did not ask for."""
    if not requested.token_ids:
        body.pop("prompt_token_ids", None)
    for choice in body.get("choices") or ():
        if isinstance(choice, dict):
            if not requested.token_ids:
                choice.pop("token_ids", None)
            if not requested.logprobs:
                choice.pop("logprobs", None)
    return body


def strip_completion(body: dict[str, Any], requested: Requested) -> dict[str, Any]:
    """Remove (in place) the token fields of a completion body or chunk not asked for."""
    if not requested.token_ids:
        body.pop("prompt_token_ids", None)
    for choice in body.get("choices") or ():
        if isinstance(choice, dict):
            if not requested.token_ids:
                choice.pop("prompt_token_ids", None)
                choice.pop("token_ids", None)
            if not requested.logprobs:
                choice.pop("logprobs", None)
                if not requested.prompt_logprobs:
                    # `echo` with the injected log-probs makes vLLM add the prompt's too.
                    choice.pop("prompt_logprobs", None)
    return body


@dataclass(slots=True)
class _ToolCallParts:
    id: str | None = None
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAccumulator:
    """Folds a stream's chunks into the `Generation` the whole answer would have been."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.prompt_token_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, _ToolCallParts] = {}
        self.model = ""
        self.response_id: str | None = None
        self.finish_reason: str | None = None

    def add(self, chunk: Mapping[str, Any]) -> None:
        if not self.model and isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        if self.response_id is None and isinstance(chunk.get("id"), str):
            self.response_id = chunk["id"]
        if self.kind == CHAT and chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = _int_list(chunk["prompt_token_ids"], "prompt_token_ids")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            if choice.get("index", 0) != 0:
                raise CaptureError("the upstream's stream has more than one choice")
            prompt_len = 0
            if self.kind == COMPLETIONS and choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids = _int_list(choice["prompt_token_ids"], "prompt_token_ids")
                prompt_len = len(self.prompt_token_ids)
            generated: list[int] = []
            if choice.get("token_ids") is not None:
                generated = _int_list(choice["token_ids"], "token_ids")
                self.token_ids.extend(generated)
            if self.kind == CHAT:
                self.logprobs.extend(_chat_logprobs(choice.get("logprobs")))
                self._delta(choice.get("delta"))
            else:
                self.logprobs.extend(
                    _completion_logprobs(choice.get("logprobs"), prompt_len, len(generated))
                )
                if isinstance(choice.get("text"), str):
                    self.content.append(choice["text"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def _delta(self, delta: object) -> None:
        if not isinstance(delta, Mapping):
            return
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self.reasoning.append(delta[key])
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, Mapping):
                continue
            index = call.get("index", 0)
            parts = self.tool_calls.setdefault(
                index if isinstance(index, int) else 0, _ToolCallParts()
            )
            if isinstance(call.get("id"), str):
                parts.id = call["id"]
            if isinstance(call.get("type"), str):
                parts.type = call["type"]
            function = call.get("function")
            if isinstance(function, Mapping):
                if isinstance(function.get("name"), str):
                    parts.name += function["name"]
                if isinstance(function.get("arguments"), str):
                    parts.arguments.append(function["arguments"])

    def generation(self) -> Generation:
        if self.prompt_token_ids is None:
            raise CaptureError("the upstream's stream carried no prompt_token_ids")
        content = "".join(self.content)
        item: dict[str, Any]
        if self.kind == CHAT:
            message: dict[str, Any] = {"content": content or None}
            if self.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": parts.id,
                        "type": parts.type,
                        "function": {"name": parts.name, "arguments": "".join(parts.arguments)},
                    }
                    for _, parts in sorted(self.tool_calls.items())
                ]
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            item = assistant_item(message)
        else:
            item = {"role": "assistant", "content": content}
        return _checked(
            Generation(
                self.prompt_token_ids,
                self.token_ids,
                self.logprobs,
                [item],
                self.model,
                self.response_id,
                self.finish_reason,
            )
        )


# Replay: the answer rebuilt from a stored entry (a retry of a call whose answer was lost). Each
# body below is the inverse of the reading above (`generation_from_chat` /
# `generation_from_completion` / `StreamAccumulator` read back the same `Generation`), in vLLM's
# shapes with every token field; the caller strips what the client did not ask for with
# `strip_chat` / `strip_completion`, as for an engine's answer.


def generation_from_entry(entry: TokenEntry) -> Generation:
    """The `Generation` a stored entry was made from (its finish reason was not stored)."""
    return Generation(
        list(entry.prompt_token_ids),
        list(entry.generation_token_ids),
        list(entry.generation_log_probs),
        [dict(item) for item in entry.output_items],
        entry.model,
        entry.response_id,
    )


def _finish_reason(generation: Generation, body: Mapping[str, Any]) -> str:
    """Not stored, so computed: "length" when the request's token limit was reached,
    "tool_calls" when the message calls tools, else "stop"."""
    generated = len(generation.generation_token_ids)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if type(limit) is int and generated >= limit:
            return "length"
    return "tool_calls" if generation.output_items[0].get("tool_calls") else "stop"


def _usage(generation: Generation) -> dict[str, int]:
    prompt, generated = len(generation.prompt_token_ids), len(generation.generation_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def _token_names(generation: Generation) -> list[str]:
    # Token strings are not stored: named as vLLM's `return_tokens_as_token_ids` names them.
    return [f"token_id:{token}" for token in generation.generation_token_ids]


def _chat_logprobs_of(generation: Generation) -> dict[str, Any]:
    return {
        "content": [
            {"token": name, "logprob": logprob, "bytes": None, "top_logprobs": []}
            for name, logprob in zip(
                _token_names(generation), generation.generation_log_probs, strict=True
            )
        ]
    }


def _completion_logprobs_of(generation: Generation) -> dict[str, Any]:
    return {
        "tokens": _token_names(generation),
        "token_logprobs": list(generation.generation_log_probs),
        "top_logprobs": None,
    }


def _message_of(item: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message whose `assistant_item` is `item` (vLLM's empty tool call list
    when it calls none)."""
    return {**item, "role": "assistant", "tool_calls": list(item.get("tool_calls") or [])}


def _head(kind: str, generation: Generation, created: int, chunk: bool) -> dict[str, Any]:
    if kind == CHAT:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl-"
    else:
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": generation.response_id or prefix + uuid.uuid4().hex,
        "object": obj,
        "created": created,
        "model": generation.model,
    }


def replay_body(
    kind: str, generation: Generation, body: Mapping[str, Any], created: int
) -> dict[str, Any]:
    """The whole answer (with every token field) of `generation` to the request `body`."""
    answer = _head(kind, generation, created, chunk=False)
    choice: dict[str, Any] = {"index": 0}
    if kind == CHAT:
        answer["prompt_token_ids"] = generation.prompt_token_ids
        choice["message"] = _message_of(generation.output_items[0])
        choice["logprobs"] = _chat_logprobs_of(generation)
    else:
        choice["text"] = generation.output_items[0].get("content") or ""
        choice["logprobs"] = _completion_logprobs_of(generation)
        choice["prompt_token_ids"] = generation.prompt_token_ids
    choice["token_ids"] = generation.generation_token_ids
    choice["finish_reason"] = _finish_reason(generation, body)
    answer["choices"] = [choice]
    answer["usage"] = _usage(generation)
    return answer


def replay_chunks(
    kind: str, generation: Generation, body: Mapping[str, Any], created: int
) -> list[dict[str, Any]]:
    """The answer as stream chunks: one with the whole generation, one with the finish
    reason, and one with the usage when `stream_options.include_usage` asks for it."""
    head = _head(kind, generation, created, chunk=True)
    item = generation.output_items[0]
    choice: dict[str, Any] = {"index": 0}
    first = {**head, "choices": [choice]}
    if kind == CHAT:
        first["prompt_token_ids"] = generation.prompt_token_ids
        delta: dict[str, Any] = {"role": "assistant", "content": item.get("content") or ""}
        tool_calls = item.get("tool_calls") or []
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        for key in ("reasoning_content", "reasoning"):
            if item.get(key):
                delta[key] = item[key]
        choice["delta"] = delta
        choice["logprobs"] = _chat_logprobs_of(generation)
        last: dict[str, Any] = {"index": 0, "delta": {}}
    else:
        choice["text"] = item.get("content") or ""
        choice["logprobs"] = _completion_logprobs_of(generation)
        choice["prompt_token_ids"] = generation.prompt_token_ids
        last = {"index": 0, "text": ""}
    choice["token_ids"] = generation.generation_token_ids
    choice["finish_reason"] = None
    last["finish_reason"] = _finish_reason(generation, body)
    chunks = [first, {**head, "choices": [last]}]
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage") is True:
        chunks.append({**head, "choices": [], "usage": _usage(generation)})
    return chunks
