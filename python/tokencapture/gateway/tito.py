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
A call without a resolved parent, a stream, a parameter the completion cannot honour as the
chat endpoint would (an allowlist), tools or template arguments other than its parent's, no
limit the gateway can know, or a turn the bridge refuses goes to the chat endpoint as usual,
and its entry records why (`tito_fallback_reason`).

The tokenizer is read offline from a directory (`tokenizer.json`, and `tokenizer_config.json`
for the EOS token) with the `tokenizers` library; no download, no `transformers`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import aiohttp
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

    from tokencapture.records import TokenEntry

__all__ = [
    "FALLBACK_FIELD",
    "RENDER_FIELD",
    "Bridge",
    "TokenizerAdapter",
    "run_tito",
]

# The extra field of an entry that went to the chat endpoint although --tito was on.
FALLBACK_FIELD: Final[str] = "tito_fallback_reason"
# The extra field of every chat entry a --tito gateway stores: the digest of what its prompt
# was rendered with besides the messages (`render_digest`). A continuation is bridged only
# when its own digest equals its parent's: the bridge renders the new messages alone, so a
# tool list (or template argument) that changed would never reach the model's prompt.
RENDER_FIELD: Final[str] = "tito_render_digest"

# Parameters carried from a chat request to the completion that replaces it: vLLM's
# completions endpoint takes each with the chat endpoint's meaning (sampling, penalties, logit
# bias, structured outputs over the generated text). `stop` is here for an empty one only: a
# call with stop strings goes to chat (`_unbridged_parameter`).
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
_FORWARDED: Final[frozenset[str]] = frozenset(_SAMPLING)

# Parameters `run_tito` honours itself: the conversation and its tools (rendered by the
# bridge; `tool_choice` "auto" only), the limits (`max_tokens`...), `parallel_tool_calls`
# (a false one keeps the first parsed call, as vLLM's chat endpoint does), the answer's form
# (`logprobs`, `top_logprobs` 0, `return_token_ids`, `n` 1, `stream` false), `stop_token_ids`
# (added to the format's own) and `stop` when empty.
_HANDLED: Final[frozenset[str]] = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "return_token_ids",
        "stop_token_ids",
        "stop",
    }
)

# Parameters that change nothing at vLLM's default value (given so, they are bridged) and
# would change what is rendered, generated or answered at any other (then the call goes to
# chat). None is no default here: vLLM refuses it for these fields, and chat says so.
_AT_DEFAULT: Final[dict[str, object]] = {
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
    "use_beam_search": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_reasoning": True,
}
# Template parameters that change nothing when empty.
_EMPTY_OK: Final[frozenset[str]] = frozenset({"chat_template", "chat_template_kwargs"})

# What vLLM's chat endpoint renders into the prompt besides the messages and the tools (or
# uses to render it): each of them, unless at its default, is in an entry's `RENDER_FIELD`.
_RENDERED: Final[tuple[str, ...]] = (
    "chat_template",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def _unbridged_parameter(body: Mapping[str, Any]) -> str | None:
    """The first parameter of `body` a token-in completion cannot honour as the chat endpoint
    would, or None. An allowlist: a parameter the bridge does not know sends the call to chat
    (`prompt_logprobs`, `use_beam_search: true`, `truncate_prompt_tokens`, `reasoning_effort`,
    engine extensions...). A null value is vLLM's default for every field not in
    `_AT_DEFAULT`, so it is no parameter."""
    for key, value in body.items():
        if key == "tool_choice":
            if value is not None and value != "auto":
                return key  # a forced tool call is a grammar chat builds from the tools
        elif key == "stop":
            if value:
                return key  # matched on chat's detokenized text, not on the tokens
        elif key == "top_logprobs":
            if value is not None and value != 0:
                return key  # the completion names alternatives by text only
        elif key in _AT_DEFAULT:
            default = _AT_DEFAULT[key]
            if type(value) is not type(default) or value != default:
                return key
        elif key in _EMPTY_OK:
            if value:
                return key
        elif value is None or key in _HANDLED or key in _FORWARDED:
            continue
        else:
            return key
    return None


def _digest(value: object, *, sort_keys: bool = False) -> str:
    data = orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def render_digest(body: Mapping[str, Any]) -> str:
    """What a chat request's prompt is rendered with besides its messages, as
    `TOOLS.OTHERS`: the digest of its `tools` as sent (their order and keys' order too: a
    template writes them out as JSON; none and an empty list alike), and of the other
    parameters rendered into the prompt (`_RENDERED`, and a `tool_choice` of "none", which
    may leave the tools out) at other than their defaults."""
    tools = body.get("tools") or None
    others: dict[str, Any] = {}
    for key in _RENDERED:
        value = body.get(key)
        if value is None or (key in _EMPTY_OK and not value):
            continue
        default = _AT_DEFAULT.get(key)
        if default is not None and type(value) is type(default) and value == default:
            continue
        others[key] = value
    if tools is not None and body.get("tool_choice") == "none":
        others["tool_choice"] = "none"
    return f"{_digest(tools)}.{_digest(others, sort_keys=True)}"


def _render_changed(parent: str | None, digest: str) -> str | None:
    """Why a continuation rendered as `digest` cannot extend a parent rendered as `parent`."""
    if parent is None:
        return "parent_render_unknown"
    if parent == digest:
        return None
    if parent.partition(".")[0] != digest.partition(".")[0]:
        return "tools_changed"
    return "render_parameters_changed"


# Statuses of an engine without a models route (not vLLM): its context length is never known.
_NO_MODELS_ROUTE: Final[frozenset[int]] = frozenset({404, 405, 501})
# How long a models answer that said nothing (an error, a model not listed yet) stands.
_ASK_AGAIN_SECONDS: Final[float] = 30.0


# How much of an engine's 400 body `_about_context_length` looks at (vLLM's message opens its
# error object; the body itself was already read, for the client).
_REFUSAL_SCAN_BYTES: Final[int] = 64 * 1024
# What vLLM's refusals of a request past the context length say (lowercased): its OpenAI
# server's "This model's maximum context length is N tokens. However, your request has M
# input tokens ..." and "'max_tokens' or 'max_completion_tokens' is too large: T. This
# model's maximum context length is N tokens ..." (`_validate_input`; older versions "...
# However, you requested ..."), its engine's "The decoder prompt (length L) is longer than
# the maximum model length of N. Make sure that `max_model_len` is ..." (`InputProcessor.
# _validate_prompt_len`).
_CONTEXT_LENGTH_WORDS: Final[tuple[bytes, ...]] = (
    b"context length",
    b"maximum model length",
    b"max_model_len",
)


def _about_context_length(body: bytes | memoryview) -> bool:
    """Whether an engine's 400 (its body, as read for the client) may be about the context
    length: its first `_REFUSAL_SCAN_BYTES` name it as vLLM does (`_CONTEXT_LENGTH_WORDS`, in
    any case), or it is empty (a body that could not be read, or an engine that says nothing:
    nothing tells it is not). Another refusal (a client's own bad parameter) is not."""
    head = bytes(body[:_REFUSAL_SCAN_BYTES])
    if not head.strip():
        return True
    head = head.lower()
    return any(words in head for words in _CONTEXT_LENGTH_WORDS)


def _card_length(models: object, model: object) -> tuple[bool, int | None]:
    """(whether `model` has a card, its context length) in a `GET /v1/models` answer: vLLM's
    cards carry `max_model_len`; an adapter's card names its base model as `parent`. No
    model named: the first card, as vLLM serves it."""
    cards = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(cards, list):
        return False, None
    by_id = {c.get("id"): c for c in cards if isinstance(c, Mapping)}
    card = (cards[0] if cards else None) if model is None else by_id.get(model)
    if not isinstance(card, Mapping):
        return False, None
    for _ in range(2):  # the card, then its base model's
        length = card.get("max_model_len")
        if type(length) is int and length > 0:
            return True, length
        base = by_id.get(card.get("parent"))
        if not isinstance(base, Mapping):
            break
        card = base
    return True, None


def _length_key(call: Any, model: object) -> tuple[str, str | None]:
    """What a context length is kept under: (upstream, model named by the call or None)."""
    return (str(call.gateway.config.upstream), model if isinstance(model, str) else None)


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


def _max_new_tokens(root: Path) -> int | None:
    """The `max_new_tokens` of the model's `generation_config.json` beside its tokenizer."""
    config = root / "generation_config.json"
    if not config.exists():
        return None
    value = json.loads(config.read_text()).get("max_new_tokens")
    return value if type(value) is int else None


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

    def __init__(
        self, renderer: Any, tokenizer: Any, *, default_max_new_tokens: int | None = None
    ) -> None:
        self.renderer = renderer
        self.tokenizer = tokenizer
        # The model's `generation_config.json` `max_new_tokens`, which vLLM (with its default
        # `--generation-config auto`) makes the chat endpoint's default limit: then a call
        # without a limit goes to chat (`_max_tokens`).
        self.default_max_new_tokens = default_max_new_tokens
        # The engine's context length by (upstream, model), from its `GET /v1/models`; and
        # until when an answer that said nothing is not asked again.
        self._context_lengths: dict[tuple[str, str | None], int | None] = {}
        self._unknown_until: dict[tuple[str, str | None], float] = {}

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
        return cls(
            renderers.create_renderer(tokenizer, config),
            tokenizer,
            default_max_new_tokens=_max_new_tokens(Path(path)),
        )

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

    def shape(self, entry: TokenEntry) -> tuple[int, int, str | None]:
        """What a continuation of `entry` needs of it: its prompt's length, its request's
        number of messages, and what its prompt was rendered with (`RENDER_FIELD`; None for
        an entry stored without it)."""
        digest = (entry.model_extra or {}).get(RENDER_FIELD)
        return (
            len(entry.prompt_token_ids),
            entry.continuation_context_len,
            sys.intern(digest) if isinstance(digest, str) else None,
        )

    async def context_length(self, call: Any, model: object) -> int | None:
        """The engine's context length for `model` (vLLM's `max_model_len`, read once from
        its `GET /v1/models`), or None when the engine does not say (another engine)."""
        gateway = call.gateway
        key = _length_key(call, model)
        if key in self._context_lengths:
            return self._context_lengths[key]
        if self._unknown_until.get(key, 0.0) > time.monotonic():
            return None  # asked a moment ago, in vain: not asked on every call
        try:
            answer = await gateway.request_upstream(
                "GET", gateway.url("/v1/models"), headers=gateway._upstream_headers(call.request)
            )
            try:
                if answer.status in _NO_MODELS_ROUTE:
                    self._context_lengths[key] = None  # another engine: it will not say
                    return None
                if answer.status != 200:
                    self._ask_later(key)
                    return None
                models = orjson.loads(await answer.read())
            finally:
                answer.release()
        except orjson.JSONDecodeError:
            self._context_lengths[key] = None  # a models route that is not vLLM's
            return None
        except (aiohttp.ClientError, TimeoutError):
            self._ask_later(key)
            return None
        listed, length = _card_length(models, key[1])
        if not listed:  # an adapter loaded later is listed later: only a listed model is kept
            self._ask_later(key)
            return None
        self._context_lengths[key] = length
        return length

    def forget_context_length(self, call: Any, model: object) -> None:
        """Drop what is kept of the engine's context length for `model`: the next call asks
        `GET /v1/models` again. After the engine refused a completion (400) about the context
        length (`_about_context_length`): it may have been restarted behind the same address
        with a smaller `--max-model-len`, and the kept length would make every later call's
        `max_tokens` too large."""
        self._context_lengths.pop(_length_key(call, model), None)

    def _ask_later(self, key: tuple[str, str | None]) -> None:
        """No context length for `key` yet (the engine failed to answer, or does not list the
        model): asked again after `_ASK_AGAIN_SECONDS`, not on every call before."""
        self._unknown_until[key] = time.monotonic() + _ASK_AGAIN_SECONDS

    def message(
        self,
        token_ids: list[int],
        prompt_ids: list[int],
        tools: list[dict[str, Any]] | None,
        *,
        parallel_tool_calls: bool = True,
    ) -> dict[str, Any]:
        """The assistant message the completion's tokens say (tool calls with fresh ids; only
        the first without `parallel_tool_calls`, as vLLM's chat endpoint answers)."""
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
            message["tool_calls"] = calls if parallel_tool_calls else calls[:1]
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        return message


async def _parent_shape(call: Any, parent_call_id: str) -> tuple[int, int, str | None] | None:
    """(prompt length, request context length, render digest) of the parent entry, or None
    if it is not found. Kept in memory for the entries this gateway stored; after a restart
    read from the store (the digest with the entry)."""
    gateway = call.gateway
    known: tuple[int, int, str | None] | None = gateway.recent_shape(
        call.rollout_id, parent_call_id
    )
    if known is not None:
        return known
    bridge: Bridge = gateway.config.tito
    entries, _ = await gateway.backend.entries(call.rollout_id)
    for entry in entries:
        if entry.model_call_id == parent_call_id and not entry.prompt_is_delta:
            return bridge.shape(entry)
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
    prompt_len, context_len, rendered = shape
    changed = _render_changed(rendered, call.extra[RENDER_FIELD])
    if changed is not None:
        return None, changed
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


async def _max_tokens(
    call: Any, body: Mapping[str, Any], prompt_len: int
) -> tuple[object | None, str]:
    """The completion's `max_tokens` (the chat endpoint's own limit for this call), or None
    and why it is not known.

    vLLM's chat endpoint limits a call without one to the rest of the context
    (`max_model_len` less the prompt; `get_max_tokens` in vLLM's `serve/utils/api_utils.py`),
    its completions endpoint to 16 tokens. The engine's server-side caps (an
    `--override-generation-config` `max_new_tokens`, the platform's) apply to both alike; a
    model's own `generation_config.json` `max_new_tokens` (the default under `--generation-
    config auto`) applies only to a request without a limit, so with it the call goes to chat.
    """
    given = body.get("max_completion_tokens")
    if given is None:
        given = body.get("max_tokens")
    if given is not None:
        return given, ""
    bridge: Bridge = call.gateway.config.tito
    if bridge.default_max_new_tokens is not None:
        return None, "max_tokens_unknown: the model's generation_config sets max_new_tokens"
    length = await bridge.context_length(call, body.get("model"))
    if length is None:
        return None, "max_tokens_unknown"
    # A prompt that fills the context: the engine refuses it as chat would (at least 1 here).
    return max(1, length - prompt_len), ""


async def _chat(call: Any, upstream_body: dict[str, Any]) -> Response:
    response: Response = await call.run(upstream_body)
    return response


async def _fallback(call: Any, upstream_body: dict[str, Any], reason: str) -> Response:
    call.extra[FALLBACK_FIELD] = reason
    return await _chat(call, upstream_body)


def _logprobs_content(
    data: Mapping[str, Any], generated: list[int], logprobs: list[float], bridge: Bridge
) -> list[dict[str, Any]]:
    """A chat answer's `logprobs.content` from the completion's: the engine's own token
    strings (vLLM's chat and completions endpoints name a token alike) with their UTF-8
    `bytes`, as vLLM's chat answers them, and no alternatives (`top_logprobs` 0). A token the
    engine names `token_id:N` (its `--return-tokens-as-token-ids`) has `bytes: null`, where
    vLLM's chat gives the decoded token's."""
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    completion = choice.get("logprobs") if isinstance(choice, Mapping) else None
    tokens = completion.get("tokens") if isinstance(completion, Mapping) else None
    if not (
        isinstance(tokens, list)
        and len(tokens) == len(generated)
        and all(isinstance(t, str) for t in tokens)
    ):
        tokens = [bridge.tokenizer.decode([t]) for t in generated]
    return [
        {
            "token": text,
            "logprob": lp,
            "bytes": None
            if text == f"token_id:{token_id}"
            else list(text.encode("utf-8", errors="replace")),
            "top_logprobs": [],
        }
        for text, token_id, lp in zip(tokens, generated, logprobs, strict=True)
    ]


def _chat_id(completion_id: str | None) -> str:
    """The chat id of a completion's answer: vLLM names one request `cmpl-X` on its
    completions endpoint and `chatcmpl-X` on its chat endpoint."""
    if not completion_id:
        return f"chatcmpl-{uuid.uuid4().hex}"
    return f"chatcmpl-{completion_id.removeprefix('cmpl-')}"


async def run_tito(call: Any, upstream_body: dict[str, Any]) -> Response:
    """Answer a chat call token-in-token-out when its parent resolved, else through chat."""
    from starlette.responses import Response

    # Every chat entry of a --tito gateway says what its prompt was rendered with, for its
    # continuations to compare theirs with (`_render_changed`).
    call.extra[RENDER_FIELD] = render_digest(upstream_body)
    call.start_resolution()
    resolution = await call.resolved()
    assert resolution is not None
    if resolution.status is ParentResolutionStatus.ROOT:
        return await _chat(call, upstream_body)
    if call.requested.stream:
        return await _fallback(call, upstream_body, "stream_not_bridged")
    unbridged = _unbridged_parameter(upstream_body)
    if unbridged is not None:
        return await _fallback(call, upstream_body, f"parameter_not_bridged: {unbridged}")
    try:
        tools = _tool_specs(upstream_body.get("tools"))
    except ValueError as exc:
        return await _fallback(call, upstream_body, f"tools_not_bridged: {exc}")
    prompt, reason = await _bridged_prompt(call, resolution, tools)
    if prompt is None:
        return await _fallback(call, upstream_body, reason)
    max_tokens, reason = await _max_tokens(call, upstream_body, len(prompt))
    if max_tokens is None:
        return await _fallback(call, upstream_body, reason)
    bridge: Bridge = call.gateway.config.tito
    body: dict[str, Any] = {key: upstream_body[key] for key in _SAMPLING if key in upstream_body}
    body["max_tokens"] = max_tokens
    stop_ids = bridge.stop_token_ids()
    asked_stop_ids = upstream_body.get("stop_token_ids")
    if isinstance(asked_stop_ids, list):
        stop_ids += [t for t in asked_stop_ids if t not in stop_ids]
    body.update(
        prompt=prompt,
        return_token_ids=True,
        logprobs=0,
        skip_special_tokens=False,
        stop_token_ids=stop_ids,
    )
    call.prefix_requested = True
    answer = await call.send(body, "/v1/completions")
    if answer.status != 200:
        refused: Response = await call.refused(answer)
        if answer.status == 400 and _about_context_length(refused.body):
            # Refused about the context length, maybe for a `max_tokens` from a length the
            # engine no longer has (restarted with a smaller `--max-model-len`): the next
            # call asks for it again. A 400 about anything else (the client's own bad
            # parameter) keeps it: no `GET /v1/models` per client error. This call is not
            # retried; its 400 is passed through.
            bridge.forget_context_length(call, upstream_body.get("model"))
        return refused
    content = await call.read(answer)
    try:
        data = orjson.loads(content)
        completion = generation_from_completion(data)
        message = bridge.message(
            completion.generation_token_ids,
            prompt,
            tools,
            parallel_tool_calls=upstream_body.get("parallel_tool_calls") is not False,
        )
    except Exception as exc:  # another shape than the engine's (TypeError...): its failure
        await call.fail(f"capture_failed: {exc}")
        raise HttpError(
            502, f"the upstream's completion cannot be captured: {exc}", "upstream_error"
        ) from None
    finish = "tool_calls" if message.get("tool_calls") else completion.finish_reason
    # The id the client receives is the id the entry keeps (a trace's response id finds it).
    response_id = _chat_id(completion.response_id)
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
        choice["logprobs"] = {
            "content": _logprobs_content(
                data, completion.generation_token_ids, completion.generation_log_probs, bridge
            )
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
