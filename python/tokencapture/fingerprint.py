"""Continuation fingerprints and conversation digests (fingerprint version 2).

A model call's entry is stamped with the fingerprint of everything the model authored up to and
including its own output, plus a digest of the request context it saw. A later request whose
model-authored turns hash to the same fingerprint, and whose prefix digests to the recorded
context, continues that call. Both hashes are SHA-256 over tagged, length-delimited UTF-8 fields
(``tag byte + u64 big-endian byte length + bytes``), so no concatenation of texts can collide with
another split of the same bytes.

Three message dialects are understood, item by item:

* Chat Completions: ``{"role": ..., "content": ...}``, assistant ``tool_calls``, ``role == "tool"``
  results.
* Responses: typed items, ``function_call`` (with an optional ``namespace``) and
  ``function_call_output``.
* Anthropic Messages: content blocks, ``tool_use`` and ``tool_result``.

A fingerprint is a key shared with NeMo Gym 0.7.0 processes, so this module reproduces
``nemo_gym.token_id_capture.fingerprint`` value for value, including its odd corners (see
``docs/compat-fingerprints.md``): identifiers are rendered with Python's ``str()`` (a ``null``
tool name hashes as ``"None"``, an integer id as its digits), tool-argument strings are parsed by
the standard library's ``json`` module (so ``NaN``, ``Infinity`` and ``1e400`` parse, to floats
that orjson writes as ``null``) and written by orjson (so a lone surrogate or an integer beyond
64 bits is refused). Wherever NeMo Gym raises, this module raises ``ValueError`` or
``TypeError``: its own ``ValueError``/``TypeError`` (``UnicodeEncodeError`` included) unchanged,
a ``TypeError`` where it would fail on a missing ``.get`` (``AttributeError``), and a
``ValueError`` where its JSON parser runs out of stack (``RecursionError``).

``tokencapture._core`` ports the common case (plain JSON items) to Rust and defers everything
else to this module, which is the definition.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from typing import Any, Final

import orjson

__all__ = [
    "FINGERPRINT_VERSION",
    "assistant_fingerprint",
    "canonical_json",
    "canonicalize_tool_arguments",
    "conversation_digest",
]

FINGERPRINT_VERSION: Final[int] = 2

_FINGERPRINT_DOMAIN: Final[bytes] = b"nemo-gym-lineage"
_CONTEXT_DOMAIN: Final[bytes] = b"nemo-gym-lineage-context"

# One header per field: the tag byte, then the UTF-8 byte length as a big-endian u64.
_pack_header: Final[Callable[..., bytes]] = struct.Struct(">BQ").pack

# Block types whose string ``text`` is plain text; "" also covers a block with no (or a falsy)
# ``type``.
_TEXT_BLOCK_TYPES: Final[frozenset[str]] = frozenset({"", "text", "input_text", "output_text"})
# Blocks that carry tool traffic: hashed as tool calls / results, never as content parts.
_TOOL_BLOCK_TYPES: Final[frozenset[str]] = frozenset({"tool_use", "tool_result"})

_Part = tuple[str, str]  # (kind, payload)
_Call = tuple[str, str, str]  # (call id, tool name, canonical arguments)
_Result = tuple[str, str]  # (call id, output)
_Update = Callable[[bytes], None]


def canonical_json(value: object) -> str:
    """Return ``value`` as orjson's compact JSON with sorted keys.

    Raises ``ValueError`` for a value orjson refuses: a non-string key, an integer outside the
    signed/unsigned 64-bit range, a string with a lone surrogate, nesting deeper than orjson's
    limit, or a type it does not know.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise ValueError(
            f"unsupported prompt content: {type(value).__name__} is not JSON serializable ({exc})"
        ) from exc


def canonicalize_tool_arguments(value: object) -> str:
    """Return the canonical text of tool-call arguments.

    ``None`` is ``""``; a string that Python's ``json.loads`` accepts is re-serialized
    canonically, so key order and whitespace chosen by an engine or a harness do not matter; a
    string it refuses is compared stripped (``str.strip``); any other value is serialized
    canonically. Note what ``json.loads`` accepts: ``NaN``, ``Infinity``, ``-Infinity`` and
    out-of-range numbers such as ``1e400`` become floats that serialize as ``null``; a string that
    decodes to a lone surrogate, or an integer beyond 64 bits, parses but cannot be serialized,
    which is a ``ValueError`` (so is nesting too deep to parse); an integer literal longer than
    Python's integer-string limit (4300 digits by default) does not parse and is compared as text.
    """
    if value is None:
        return ""
    if not isinstance(value, str):
        return canonical_json(value)
    try:
        parsed = json.loads(value)
    except RecursionError as exc:
        raise ValueError("tool arguments are nested too deeply to parse") from exc
    except (TypeError, ValueError):
        return value.strip()
    return canonical_json(parsed)


def assistant_fingerprint(messages: Iterable[object] | None) -> str:
    """Return the fingerprint of the model-authored items of ``messages``.

    Model-authored items are those with ``role == "assistant"`` and ``function_call`` items.
    Returns ``""`` when there is none (an empty or ``None`` ``messages`` included): such a request
    is a root, it continues no call. Raises ``ValueError`` for a non-dict item or for content
    that cannot be hashed, ``TypeError`` for a malformed ``tool_calls``.
    """
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    update = digest.update
    authored = False
    try:
        for item in messages or ():
            message = _as_item(item)
            if not (message.get("role") == "assistant" or message.get("type") == "function_call"):
                continue
            # An authored item counts even when it contributes no field (an empty reply).
            authored = True
            parts, tool_uses, _ = _scan_content(message.get("content"))
            for part in parts:
                _feed(update, 0x00, part)
            for call in _tool_calls(message, tool_uses):
                _feed(update, 0x02, call)
    except RecursionError as exc:
        raise ValueError("request items are nested too deeply to fingerprint") from exc
    return digest.hexdigest() if authored else ""


def conversation_digest(messages: Iterable[object] | None) -> str:
    """Return the digest of every item of ``messages``: roles, content, tool calls and results.

    Raises ``ValueError`` for a non-dict item or for content that cannot be hashed, ``TypeError``
    for a malformed ``tool_calls``.
    """
    digest = hashlib.sha256(_CONTEXT_DOMAIN)
    update = digest.update
    try:
        for item in messages or ():
            message = _as_item(item)
            _feed(update, 0x00, (_id_text(message.get("role") or message.get("type")),))
            # A role == "tool" message's content is hashed twice: as content parts here and as
            # its tool result below.
            parts, tool_uses, tool_results = _scan_content(message.get("content"))
            for part in parts:
                _feed(update, 0x01, part)
            for call in _tool_calls(message, tool_uses):
                _feed(update, 0x03, call)
            for result in _tool_results(message, tool_results):
                _feed(update, 0x06, result)
    except RecursionError as exc:
        raise ValueError("request items are nested too deeply to digest") from exc
    return digest.hexdigest()


def _feed(update: _Update, first_tag: int, texts: tuple[str, ...]) -> None:
    """Feed a group of fields, tagged ``first_tag``, ``first_tag + 1``, ... in order.

    A text with a lone surrogate has no UTF-8 form: ``str.encode`` raises
    ``UnicodeEncodeError``, a ``ValueError``, exactly as NeMo Gym's hash does.
    """
    tag = first_tag
    for text in texts:
        data = text.encode()
        update(_pack_header(tag, len(data)) + data)
        tag += 1


def _as_item(item: object) -> dict[Any, Any]:
    if not isinstance(item, dict):
        raise ValueError(f"a message item must be a dict, not {type(item).__name__}")
    return item


def _id_text(value: object) -> str:
    """An id, role or type: falsy (missing, None, "", 0, False, empty) is "", else ``str()``."""
    return str(value) if value else ""


def _name_text(holder: dict[Any, Any]) -> str:
    """A tool name: missing is "", anything else is ``str()`` of it (``None`` is ``"None"``)."""
    return str(holder.get("name", ""))


def _get(value: object, key: str, what: str) -> Any:
    """``value.get(key)`` for anything with a ``get``; a ``TypeError`` for anything else."""
    getter = getattr(value, "get", None)
    if getter is None:
        raise TypeError(f"{what} must be a dict, not {type(value).__name__}")
    return getter(key)


def _output_text(value: object) -> str:
    """Tool output as text: a string as is, anything else canonically serialized."""
    return value if isinstance(value, str) else canonical_json(value)


def _scan_content(
    content: object,
) -> tuple[list[_Part], list[dict[Any, Any]], list[dict[Any, Any]]]:
    """Split ``content`` into content parts, ``tool_use`` blocks and ``tool_result`` blocks.

    One pass serves both hashes; tool blocks are returned raw because only the digest needs the
    results, and only when the item has them.
    """
    parts: list[_Part] = []
    tool_uses: list[dict[Any, Any]] = []
    tool_results: list[dict[Any, Any]] = []
    if content is None:
        return parts, tool_uses, tool_results
    if isinstance(content, str):
        if content:
            parts.append(("text", content))
        return parts, tool_uses, tool_results
    if not isinstance(content, list):
        raise ValueError(f"content must be a string, a list or None, not {type(content).__name__}")
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, dict):
            raise ValueError(
                f"a content block must be a string or a dict, not {type(block).__name__}"
            )
        raw_type = block.get("type")
        if raw_type == "tool_use":
            tool_uses.append(block)
        elif raw_type == "tool_result":
            tool_results.append(block)
        # The block's kind is str() of a truthy type, "" otherwise (a missing, null, false, 0
        # or empty type alike).
        kind = _id_text(raw_type)
        if kind in _TOOL_BLOCK_TYPES:
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_BLOCK_TYPES:
            if text:
                parts.append(("text", text))
        elif kind:
            # Images, refusals, reasoning and the like: the whole block is the payload.
            parts.append((kind, canonical_json(block)))
        else:
            raise ValueError("a content block without a type must carry a string 'text'")
    return parts, tool_uses, tool_results


def _tool_calls(message: dict[Any, Any], tool_uses: list[dict[Any, Any]]) -> list[_Call]:
    """Tool calls of one item: Responses ``function_call``, ``tool_use`` blocks, ``tool_calls``."""
    calls: list[_Call] = []
    if message.get("type") == "function_call":
        name = _name_text(message)
        namespace = message.get("namespace")
        if namespace:
            name = f"{namespace}__{name}"
        call_id = _id_text(message.get("call_id") or message.get("id"))
        calls.append((call_id, name, canonicalize_tool_arguments(message.get("arguments"))))
    for block in tool_uses:
        call_id = _id_text(block.get("id"))
        calls.append((call_id, _name_text(block), canonicalize_tool_arguments(block.get("input"))))
    # A falsy tool_calls (null, [], "", ...) is no calls, and so is a falsy call or function:
    # each reads as empty, giving ("", "", "").
    for call in message.get("tool_calls") or ():
        call = call or {}
        function = _get(call, "function", "a tool call") or {}
        call_id = _id_text(_get(call, "id", "a tool call"))
        getter = getattr(function, "get", None)
        if getter is None:
            raise TypeError(f"a tool call function must be a dict, not {type(function).__name__}")
        name = str(getter("name", ""))
        calls.append((call_id, name, canonicalize_tool_arguments(getter("arguments"))))
    return calls


def _tool_results(message: dict[Any, Any], tool_results: list[dict[Any, Any]]) -> list[_Result]:
    """Tool results of one item: a Responses output or else a chat tool message's content, then
    ``tool_result`` blocks."""
    results: list[_Result] = []
    if message.get("type") == "function_call_output":
        call_id = _id_text(message.get("call_id") or message.get("id"))
        results.append((call_id, _output_text(message.get("output"))))
    elif message.get("role") == "tool":
        # A function_call_output item with role "tool" is a Responses output only.
        call_id = _id_text(message.get("tool_call_id"))
        results.append((call_id, _output_text(message.get("content"))))
    for block in tool_results:
        payload = _output_text(block.get("content"))
        results.append((_id_text(block.get("tool_use_id") or block.get("id")), payload))
    return results
