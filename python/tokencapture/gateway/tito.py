"""Token-in-token-out continuations (`tokencapture gateway --tito`), with PyPI's `renderers`.

An engine's chat endpoint re-renders the whole conversation from text on every turn, and a
model's sampled tokens rarely survive that round trip (a random or young policy samples
non-canonical tokenizations; templates strip or rewrite what was said), so the next prompt no
longer begins with what was sampled and the trajectory cannot be trained as one sequence.

With `--tito`, a chat call whose parent resolved is sent as a completion instead: the parent's
exact prompt + generation tokens, plus only the new turn rendered by the chat format's
`bridge_to_next_turn` (which refuses, returning None, when it cannot prove the prefix holds),
as a token-id `prompt` to the engine's `/v1/completions`. The completion's tokens are parsed
back into an assistant message (`parse_response`), answered in the chat format, and captured
with `prefix_requested` set (and `prefix_supplied` when the engine's reported prompt proves it).
A call without a resolved parent, a stream, or a turn the bridge refuses goes to the chat
endpoint as usual, and its entry records why (`tito_fallback_reason`).

The tokenizer is read offline from a directory (`tokenizer.json`, and `tokenizer_config.json`
for the EOS token) with the `tokenizers` library; no download, no `transformers`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

try:
    import renderers  # type: ignore[import-untyped, unused-ignore]
    import tokenizers
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        f"the gateway's --tito needs the 'renderers' and 'tokenizers' packages ({exc.name} is "
        "missing): pip install 'tokencapture[gateway]'"
    ) from exc

from tokencapture.gateway.capture import (
    Generation,
    assistant_item,
    generation_from_completion,
)
from tokencapture.gateway.errors import HttpError
from tokencapture.protocols import LineageResolution
from tokencapture.records import ParentResolutionStatus

if TYPE_CHECKING:
    from starlette.responses import Response

__all__ = [
    "FALLBACK_FIELD",
    "Bridge",
    "TokenizerAdapter",
    "run_tito",
]

# The extra field of an entry that went to the chat endpoint although --tito was on.
FALLBACK_FIELD: Final[str] = "tito_fallback_reason"

# Parameters carried from a chat request to the completion that replaces it: vLLM's
# completions endpoint takes each with the chat endpoint's meaning (sampling, penalties, stop
# strings, logit bias, structured outputs over the generated text).
_SAMPLING: Final[tuple[str, ...]] = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "stop",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "include_stop_str_in_output",
    "structured_outputs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "user",
    "priority",
)

# Chat parameters a token-in completion cannot honour: the call goes to the chat endpoint
# instead (`tito_fallback_reason` names the parameter). A forced tool choice is a grammar the
# chat endpoint builds from the tools; the template's arguments and a continued or echoed
# final message change what is rendered, which the bridge does not render.
_CHAT_ONLY: Final[tuple[str, ...]] = (
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "echo",
)


def _chat_only_parameter(body: Mapping[str, Any]) -> str | None:
    """The first parameter of `body` that makes a token-in completion answer differently."""
    choice = body.get("tool_choice")
    if choice is not None and choice != "auto":
        return "tool_choice"
    if body.get("add_generation_prompt", True) is not True:
        return "add_generation_prompt"
    for key in _CHAT_ONLY:
        if body.get(key):
            return key
    return None


class TokenizerAdapter:
    """A `tokenizers.Tokenizer` with the surface `renderers` asks of a tokenizer."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, name: str, eos_token: str | None) -> None:
        self._tokenizer = tokenizer
        self.name_or_path = name
        self.unk_token_id: int | None = None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None

    @classmethod
    def from_dir(cls, path: str | Path) -> TokenizerAdapter:
        root = Path(path)
        tokenizer = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        eos: Any = None
        config = root / "tokenizer_config.json"
        if config.exists():
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, Mapping):
                eos = eos.get("content")
        return cls(tokenizer, str(root), eos if isinstance(eos, str) else None)

    def encode(
        self, text: str, *args: Any, add_special_tokens: bool = False, **kw: Any
    ) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(
        self, token_ids: Any, *args: Any, skip_special_tokens: bool = False, **kw: Any
    ) -> str:
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    @property
    def vocab_size(self) -> int:
        """The number of token ids (added tokens included)."""
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._tokenizer.token_to_id(tokens)
        return [self._tokenizer.token_to_id(token) for token in tokens]


def _tool_specs(tools: object) -> list[dict[str, Any]] | None:
    """OpenAI `tools` ({"type": "function", "function": {...}}) as renderers' `ToolSpec`s."""
    if not isinstance(tools, list) or not tools:
        return None
    specs = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise ValueError("a tool is not an OpenAI function tool")
        specs.append(
            {
                "name": function.get("name", ""),
                "description": function.get("description", ""),
                "parameters": function.get("parameters") or {},
            }
        )
    return specs


class Bridge:
    """A chat format (`renderers`) over the engine's tokenizer, for `--tito`."""

    def __init__(self, renderer: Any, tokenizer: Any) -> None:
        self.renderer = renderer
        self.tokenizer = tokenizer

    @classmethod
    def from_tokenizer_dir(
        cls, path: str | Path, renderer: str = "qwen3", *, thinking_retention: str = "all"
    ) -> Bridge:
        """A bridge for the chat format `renderer` over the tokenizer in `path`.

        `thinking_retention="all"` lets the bridge extend across a new user query too (the
        sampled tokens are kept verbatim wherever the format allows it); "tool_cycle" or
        "template" make it re-render there, as the format's own template would.
        """
        from renderers.configs import (  # type: ignore[import-untyped, unused-ignore]
            config_from_name,
        )

        tokenizer = TokenizerAdapter.from_dir(path)
        config = config_from_name(renderer)
        if config is None:
            raise ValueError("--renderer auto needs a tokenizer name renderers knows; name one")
        config = type(config)(thinking_retention=thinking_retention)
        return cls(renderers.create_renderer(tokenizer, config), tokenizer)

    def bridge(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> list[int] | None:
        rendered = self.renderer.bridge_to_next_turn(
            list(prompt_ids), list(completion_ids), new_messages, tools=tools
        )
        if rendered is None:
            return None
        return list(rendered.token_ids)

    async def run(self, call: Any, upstream_body: dict[str, Any]) -> Response:
        """Answer one chat call (a gateway `_Call`) token-in-token-out when it can."""
        return await run_tito(call, upstream_body)

    def stop_token_ids(self) -> list[int]:
        return list(self.renderer.get_stop_token_ids())

    def message(
        self, token_ids: list[int], prompt_ids: list[int], tools: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        """The assistant message the completion's tokens say (tool calls with fresh ids)."""
        parsed = self.renderer.parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        calls = []
        for call in parsed.tool_calls:
            if call.status != renderers.ToolCallParseStatus.OK or not call.name:
                continue
            arguments = call.arguments
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments if arguments is not None else {})
            calls.append(
                {
                    "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            )
        if calls:
            message["tool_calls"] = calls
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        return message


async def _parent_shape(call: Any, parent_call_id: str) -> tuple[int, int] | None:
    """(prompt length, request context length) of the parent entry, or None if unknown."""
    gateway = call.gateway
    known: tuple[int, int] | None = gateway.recent_shape(call.rollout_id, parent_call_id)
    if known is not None:
        return known
    entries, _ = await gateway.backend.entries(call.rollout_id)
    for entry in entries:
        if entry.model_call_id == parent_call_id and not entry.prompt_is_delta:
            return len(entry.prompt_token_ids), entry.continuation_context_len
    return None


async def _bridged_prompt(
    call: Any, resolution: LineageResolution, tools: list[dict[str, Any]] | None
) -> tuple[list[int] | None, str]:
    """The token prompt of the continuation, or None and why there is none."""
    if resolution.status is not ParentResolutionStatus.RESOLVED or resolution.match is None:
        return None, f"parent_{resolution.status.value}: {resolution.reason or 'root'}"
    parent = resolution.match
    shape = await _parent_shape(call, parent.model_call_id)
    if shape is None:
        return None, "parent_entry_not_found"
    prompt_len, context_len = shape
    cumulative = list(parent.cumulative_token_ids)
    messages = call.messages
    if context_len >= len(messages) or messages[context_len].get("role") != "assistant":
        return None, "parent_turn_not_in_request"
    new_messages = messages[context_len + 1 :]
    try:
        bridged = call.gateway.config.tito.bridge(
            cumulative[:prompt_len], cumulative[prompt_len:], new_messages, tools
        )
    except Exception as exc:
        return None, f"bridge_error: {type(exc).__name__}: {exc}"
    if bridged is None:
        return None, "no_bridge"
    if bridged[: len(cumulative)] != cumulative:  # the contract, checked rather than trusted
        return None, "bridge_broke_prefix"
    return bridged, ""


async def _chat(call: Any, upstream_body: dict[str, Any]) -> Response:
    response: Response = await call.run(upstream_body)
    return response


async def run_tito(call: Any, upstream_body: dict[str, Any]) -> Response:
    """Answer a chat call token-in-token-out when its parent resolved, else through chat."""
    from starlette.responses import Response

    call.start_resolution()
    resolution = await call.resolved()
    assert resolution is not None
    if resolution.status is ParentResolutionStatus.ROOT:
        return await _chat(call, upstream_body)
    if call.requested.stream:
        call.extra[FALLBACK_FIELD] = "stream_not_bridged"
        return await _chat(call, upstream_body)
    unbridged = _chat_only_parameter(upstream_body)
    if unbridged is not None:
        call.extra[FALLBACK_FIELD] = f"parameter_not_bridged: {unbridged}"
        return await _chat(call, upstream_body)
    try:
        tools = _tool_specs(upstream_body.get("tools"))
    except ValueError as exc:
        call.extra[FALLBACK_FIELD] = f"tools_not_bridged: {exc}"
        return await _chat(call, upstream_body)
    prompt, reason = await _bridged_prompt(call, resolution, tools)
    if prompt is None:
        call.extra[FALLBACK_FIELD] = reason
        return await _chat(call, upstream_body)
    bridge: Bridge = call.gateway.config.tito
    body: dict[str, Any] = {key: upstream_body[key] for key in _SAMPLING if key in upstream_body}
    max_tokens = upstream_body.get("max_completion_tokens") or upstream_body.get("max_tokens")
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    top = upstream_body.get("top_logprobs")
    stop_ids = bridge.stop_token_ids()
    asked_stop_ids = upstream_body.get("stop_token_ids")
    if isinstance(asked_stop_ids, list):
        stop_ids += [t for t in asked_stop_ids if t not in stop_ids]
    body.update(
        prompt=prompt,
        return_token_ids=True,
        logprobs=top if isinstance(top, int) and not isinstance(top, bool) else 0,
        skip_special_tokens=False,
        stop_token_ids=stop_ids,
    )
    call.prefix_requested = True
    answer = await call.send(body, "/v1/completions")
    if answer.status != 200:
        refused: Response = await call.refused(answer)
        return refused
    content = await call.read(answer)
    try:
        data = orjson.loads(content)
        completion = generation_from_completion(data)
        message = bridge.message(completion.generation_token_ids, prompt, tools)
    except Exception as exc:  # another shape than the engine's (TypeError...): its failure
        await call.fail(f"capture_failed: {exc}")
        raise HttpError(
            502, f"the upstream's completion cannot be captured: {exc}", "upstream_error"
        ) from None
    finish = "tool_calls" if message.get("tool_calls") else completion.finish_reason
    # The id the client receives is the id the entry keeps (a trace's response id finds it).
    response_id = f"chatcmpl-{completion.response_id or uuid.uuid4().hex}"
    generation = Generation(
        completion.prompt_token_ids,
        completion.generation_token_ids,
        completion.generation_log_probs,
        [assistant_item(message)],
        completion.model,
        response_id,
        finish,
    )
    await call.store_if_client_waits(generation)
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    if call.requested.logprobs:
        tokens = [bridge.tokenizer.decode([t]) for t in completion.generation_token_ids]
        choice["logprobs"] = {
            "content": [
                {"token": text, "logprob": lp, "top_logprobs": []}
                for text, lp in zip(tokens, completion.generation_log_probs, strict=True)
            ]
        }
    if call.requested.token_ids:
        choice["token_ids"] = completion.generation_token_ids
    reply: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": int(data.get("created") or time.time()),
        "model": completion.model,
        "choices": [choice],
        "usage": data.get("usage"),
    }
    if call.requested.token_ids:
        reply["prompt_token_ids"] = completion.prompt_token_ids
    return Response(orjson.dumps(reply), 200, headers=call.headers, media_type="application/json")
