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

The byte format is fixed by the reference implementation; ``golden/fingerprints.json`` holds its
vectors, which pin every rule they exercise. Where they are silent (malformed tool calls, a
non-string identifier), this module raises ``ValueError`` rather than guess, and says so inline.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import orjson

__all__ = [
    "FINGERPRINT_VERSION",
    "assistant_fingerprint",
    "canonical_json",
    "canonicalize_tool_arguments",
    "conversation_digest",
]

FINGERPRINT_VERSION: Final = 2

_FINGERPRINT_DOMAIN: Final = b"nemo-gym-lineage"
_CONTEXT_DOMAIN: Final = b"nemo-gym-lineage-context"

# One header per field: the tag byte, then the UTF-8 byte length as a big-endian u64.
_pack_header: Final = struct.Struct(">BQ").pack

# Block types whose ``text`` is plain text; "" also covers a block with no ``type`` at all.
_TEXT_BLOCK_TYPES: Final = frozenset({"", "text", "input_text", "output_text"})
# Blocks that carry tool traffic: hashed as tool calls / results, never as content parts.
_TOOL_BLOCK_TYPES: Final = frozenset({"tool_use", "tool_result"})

_Part = tuple[str, str]  # (kind, payload)
_Call = tuple[str, str, str]  # (call id, tool name, canonical arguments)
_Result = tuple[str, str]  # (call id, output)
_Update = Callable[[bytes], None]


def canonical_json(value: object) -> str:
    """Return ``value`` as compact JSON with sorted keys.

    Raises ``ValueError`` for a value JSON cannot represent (orjson raises a ``TypeError``, which
    callers of a hash function would not expect to catch).
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"value is not JSON serializable: {exc}") from exc


def canonicalize_tool_arguments(value: object) -> str:
    """Return the canonical text of tool-call arguments.

    ``None`` is ``""``; a string holding JSON is re-serialized canonically, so key order and
    whitespace chosen by an engine or a harness do not matter; a string that is not JSON is
    compared stripped; any other value is serialized canonically.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        # orjson's parser (the SPEC's JSON library) decides what "parses as JSON": it refuses
        # NaN/Infinity literals and lone surrogate escapes, which therefore count as plain text.
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError:
            return value.strip()
        return canonical_json(parsed)
    return canonical_json(value)


def assistant_fingerprint(messages: Iterable[object]) -> str:
    """Return the fingerprint of the model-authored items of ``messages``.

    Model-authored items are those with ``role == "assistant"`` and ``function_call`` items.
    Returns ``""`` when there is none: such a request is a root, it continues no call.
    Raises ``ValueError`` for a non-dict item or for content that cannot be hashed.
    """
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    update = digest.update
    authored = False
    for item in messages:
        message = _as_item(item)
        if message.get("role") != "assistant" and message.get("type") != "function_call":
            continue
        # An authored item counts even when it contributes no field (an empty reply).
        authored = True
        parts, tool_uses, _ = _scan_content(message.get("content"))
        for part in parts:
            _feed(update, 0x00, part)
        for call in _tool_calls(message, tool_uses):
            _feed(update, 0x02, call)
    return digest.hexdigest() if authored else ""


def conversation_digest(messages: Iterable[object]) -> str:
    """Return the digest of every item of ``messages``: roles, content, tool calls and results.

    Raises ``ValueError`` for a non-dict item or for content that cannot be hashed.
    """
    digest = hashlib.sha256(_CONTEXT_DOMAIN)
    update = digest.update
    for item in messages:
        message = _as_item(item)
        _feed(update, 0x00, (_text_of(message.get("role") or message.get("type"), "role/type"),))
        # A role == "tool" message is hashed twice: its content as content parts here and again
        # as a tool result below. The SPEC lists both rules without saying whether they overlap;
        # the golden chat tool vectors (chat_tool_calls_*, chat_tool_result_list_content) match
        # only when both apply.
        parts, tool_uses, tool_results = _scan_content(message.get("content"))
        for part in parts:
            _feed(update, 0x01, part)
        for call in _tool_calls(message, tool_uses):
            _feed(update, 0x03, call)
        for result in _tool_results(message, tool_results):
            _feed(update, 0x06, result)
    return digest.hexdigest()


def _feed(update: _Update, first_tag: int, texts: tuple[str, ...]) -> None:
    """Feed a group of fields, tagged ``first_tag``, ``first_tag + 1``, ... in order.

    Each group (a content part, a tool call, a tool result) uses consecutive tags, so one call
    per group keeps the per-field Python overhead low.
    """
    tag = first_tag
    for text in texts:
        try:
            data = text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate has no UTF-8 form
            raise ValueError(f"text cannot be encoded as UTF-8: {exc}") from exc
        update(_pack_header(tag, len(data)) + data)
        tag += 1


def _as_item(item: object) -> Mapping[str, Any]:
    if not isinstance(item, dict):
        raise ValueError(f"a message item must be a dict, not {type(item).__name__}")
    return item


def _text_of(value: object, what: str) -> str:
    """Return an identifier-like field as text: missing, None or empty is ``""``.

    The SPEC's ``x or ""`` leaves a non-string id or name undefined; refusing it beats hashing an
    arbitrary rendering of it.
    """
    if not value:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    return value


def _output_text(value: object) -> str:
    """Tool output as text: a string as is, anything else canonically serialized."""
    return value if isinstance(value, str) else canonical_json(value)


def _scan_content(
    content: object,
) -> tuple[list[_Part], list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """Split ``content`` into content parts, ``tool_use`` blocks and ``tool_result`` blocks.

    One pass serves both hashes; tool blocks are returned raw because only the digest needs the
    results, and only when the item has them.
    """
    parts: list[_Part] = []
    tool_uses: list[Mapping[str, Any]] = []
    tool_results: list[Mapping[str, Any]] = []
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
        # A missing (or null) type reads as "": a bare {"text": ...} block is text, a bare
        # {"data": ...} is not a block at all (golden rejection "block_without_type").
        block_type = block.get("type")
        if block_type is None:
            block_type = ""
        if not isinstance(block_type, str):
            raise ValueError(
                f"a content block type must be a string, not {type(block_type).__name__}"
            )
        if block_type in _TOOL_BLOCK_TYPES:
            (tool_uses if block_type == "tool_use" else tool_results).append(block)
            continue
        text = block.get("text")
        if block_type in _TEXT_BLOCK_TYPES and isinstance(text, str):
            if text:
                parts.append(("text", text))
        elif block_type:
            # Images, refusals, reasoning and the like: the whole block is the payload.
            parts.append((block_type, canonical_json(block)))
        else:
            raise ValueError("a content block without a type must carry a string 'text'")
    return parts, tool_uses, tool_results


def _tool_calls(message: Mapping[str, Any], tool_uses: list[Mapping[str, Any]]) -> list[_Call]:
    """Tool calls of one item: Responses ``function_call``, ``tool_use`` blocks, ``tool_calls``."""
    calls: list[_Call] = []
    if message.get("type") == "function_call":
        name = _text_of(message.get("name"), "function_call name")
        namespace = _text_of(message.get("namespace"), "function_call namespace")
        if namespace:
            name = f"{namespace}__{name}"
        call_id = _text_of(message.get("call_id") or message.get("id"), "function_call call_id")
        calls.append((call_id, name, canonicalize_tool_arguments(message.get("arguments"))))
    for block in tool_uses:
        calls.append(
            (
                _text_of(block.get("id"), "tool_use id"),
                _text_of(block.get("name"), "tool_use name"),
                canonicalize_tool_arguments(block.get("input")),
            )
        )
    tool_calls = message.get("tool_calls")
    if tool_calls is None:
        return calls
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls must be a list, not {type(tool_calls).__name__}")
    for call in tool_calls:
        if not isinstance(call, dict):
            raise ValueError(f"a tool call must be a dict, not {type(call).__name__}")
        function = call.get("function")
        if function is None:
            function = {}
        elif not isinstance(function, dict):
            raise ValueError(f"a tool call function must be a dict, not {type(function).__name__}")
        calls.append(
            (
                _text_of(call.get("id"), "tool call id"),
                _text_of(function.get("name"), "tool call function name"),
                canonicalize_tool_arguments(function.get("arguments")),
            )
        )
    return calls


def _tool_results(
    message: Mapping[str, Any], tool_results: list[Mapping[str, Any]]
) -> list[_Result]:
    """Tool results of one item: a Responses output, a chat tool message, ``tool_result`` blocks."""
    results: list[_Result] = []
    if message.get("type") == "function_call_output":
        call_id = _text_of(
            message.get("call_id") or message.get("id"), "function_call_output call_id"
        )
        results.append((call_id, _output_text(message.get("output"))))
    if message.get("role") == "tool":
        call_id = _text_of(message.get("tool_call_id"), "tool_call_id")
        results.append((call_id, _output_text(message.get("content"))))
    for block in tool_results:
        call_id = _text_of(block.get("tool_use_id") or block.get("id"), "tool_result tool_use_id")
        results.append((call_id, _output_text(block.get("content"))))
    return results
