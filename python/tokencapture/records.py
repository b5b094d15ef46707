"""The captured-token record (`TokenEntry`), its token digest and lineage stamping.

The record shape, defaults and validation rules follow NeMo Gym's `token_id_capture.records`
so that entries are interchangeable field for field. The token digest runs in the Rust core
(`tokencapture._core.compute_digest`); it accepts a list of ints or any buffer of integers
(`array('Q')`, a numpy array) without boxing every id as a Python int.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from tokencapture import _core

__all__ = [
    "DIGEST_VERSION",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "ParentResolutionStatus",
    "TokenEntry",
    "as_status",
    "check_entry_invariants",
    "compute_digest",
    "cumulative_tokens",
    "encode_token_ids",
    "extract_token_fields",
    "response_to_output_items",
    "stamp_lineage",
    "strip_token_fields",
]

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1
TOKEN_ENTRY_MIN_SCHEMA_VERSION = 1
TOKEN_FIELDS = (
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "routed_experts",
)
UNRESOLVED_PARENT_REASON = "unresolved_parent"
UNCOMMITTED_CALL_REASON = "request_finished_without_staged_coordinates"
LEDGER_ROW_MISSING_RESPONSE_ID_REASON = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH_REASON = "ledger_row_missing_chain_hash"
# The framing version `compute_digest` hashes (the first byte of `encode_token_ids`).
DIGEST_VERSION = 1


class ParentResolutionStatus(StrEnum):
    """How a call's parent was decided at request time."""

    ROOT = "root"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"


class TokenEntry(BaseModel):
    """One model call's exact prompt tokens, generated tokens and log-probs.

    Unknown fields are kept and round-trip byte for byte through the store. Non-finite floats
    are accepted here (as the reference model does) but refused by `put`, before any byte is
    written, because JSON cannot carry them back.
    """

    model_config = ConfigDict(extra="allow")

    schema_version: int = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any | None = None
    output_items: list[dict[Any, Any]] = []
    token_item_index: int | None = None
    response_id: str | None = None
    created_at: float = 0.0
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: ParentResolutionStatus | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False

    @model_validator(mode="after")
    def _check_invariants(self) -> TokenEntry:
        check_entry_invariants(self)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignment is not validated, and NeMo Gym's `stamp_lineage` (so its `commit_entry`)
        # assigns the status it is given: its own enum's member, or a plain string. A status
        # value is held as our member, so dumps do not warn and comparisons by identity hold;
        # anything else is left as it is, for `put` to refuse.
        if name == "parent_resolution" and isinstance(value, str):
            value = ParentResolutionStatus._value2member_map_.get(value, value)
        super().__setattr__(name, value)


# TokenEntry's scalar fields grouped by the JSON type they must hold.
TEXT_FIELDS = (
    "rollout_id",
    "model_call_id",
    "model",
    "continuation_fingerprint",
    "continuation_context_digest",
    "parent_resolution_reason",
)
OPTIONAL_TEXT_FIELDS = ("response_id", "parent_call_id", "digest")
INT_FIELDS = ("schema_version", "continuation_context_len")
OPTIONAL_INT_FIELDS = ("token_item_index", "cum_len", "fingerprint_version")
BOOL_FIELDS = ("prompt_is_delta", "prefix_requested", "prefix_supplied")
STATUS_VALUES = frozenset(status.value for status in ParentResolutionStatus)


REQUIRED_FIELDS = tuple(
    name for name, field in TokenEntry.model_fields.items() if field.is_required()
)


def check_field_types(values: dict[str, Any]) -> None:
    """Refuse field values that would not read back as a valid `TokenEntry` (`ValueError`).

    Both directions apply these rules: `put` to an entry's current values (pydantic does not
    validate assignment, and `model_construct` skips validation), readers to each decoded
    record before building it without a second full validation. This is the pure-Python form
    the reference store uses; the Rust-backed store runs the same rules natively
    (`_core.EntryFields`, built from the field lists above). Token arrays' items are checked
    where they are walked.
    """
    missing = [name for name in REQUIRED_FIELDS if name not in values]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")

    def wrong(name: str, expected: str) -> ValueError:
        return ValueError(f"{name} must be {expected}, got {type(values[name]).__name__}")

    def present(names: tuple[str, ...]) -> list[str]:
        return [name for name in names if name in values]

    for name in present(TEXT_FIELDS):
        if not isinstance(values[name], str):
            raise wrong(name, "a str")
    for name in present(OPTIONAL_TEXT_FIELDS):
        if values[name] is not None and not isinstance(values[name], str):
            raise wrong(name, "a str or None")
    for name in present((*INT_FIELDS, *OPTIONAL_INT_FIELDS)):
        value = values[name]
        if value is None and name in OPTIONAL_INT_FIELDS:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong(name, "an int")
    for name in present(BOOL_FIELDS):
        if not isinstance(values[name], bool):
            raise wrong(name, "a bool")
    created_at = values.get("created_at", 0.0)
    if not isinstance(created_at, int | float) or isinstance(created_at, bool):
        raise wrong("created_at", "a float")
    status = values.get("parent_resolution")
    if status is not None and status not in STATUS_VALUES:
        raise ValueError(f"parent_resolution {status!r} is not one of {sorted(STATUS_VALUES)}")
    output_items = values.get("output_items", [])
    if not isinstance(output_items, list) or not all(isinstance(i, dict) for i in output_items):
        raise ValueError("output_items must be a list of dicts")


# The messages below start with NeMo Gym 0.7.0's wording for the same failure (so a caller
# matching on its text keeps working) and add what the reader needs to act on it.


def check_entry_invariants(entry: TokenEntry) -> None:
    """The cross-field rules of a `TokenEntry`, on its current values.

    Run by validation, and again by `put`: an entry mutated after validation (or built with
    `model_construct`) must not be stored in a shape that will not read back. The rules and
    their order are NeMo Gym 0.7.0's, so the first failure reported is the same.
    """
    version = entry.schema_version
    if version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
        raise ValueError(
            f"token record is schema_version {version}, but this reader understands up to "
            f"{TOKEN_ENTRY_RECORD_SCHEMA_VERSION}. Upgrade the reader, or point it at records "
            "written by a writer it matches. (A newer record may change what its fields mean; "
            "tokencapture refuses to guess.)"
        )
    if version < TOKEN_ENTRY_MIN_SCHEMA_VERSION:
        raise ValueError(
            f"token record is schema_version {version}, below the supported minimum "
            f"{TOKEN_ENTRY_MIN_SCHEMA_VERSION}. Pre-lineage records were never written in "
            "production; regenerate the rollout with a current writer."
        )
    generated, log_probs = len(entry.generation_token_ids), len(entry.generation_log_probs)
    if generated != log_probs:
        raise ValueError(
            "generation_token_ids and generation_log_probs must have the same length "
            f"(got {generated} and {log_probs}): one log-prob per generated token"
        )
    index = entry.token_item_index
    if index is not None and not 0 <= index < len(entry.output_items):
        raise ValueError(
            f"token_item_index {index} is outside output_items of length "
            f"{len(entry.output_items)}: it must index the item that carried the token arrays"
        )
    _check_parent(entry.parent_resolution, entry.parent_call_id, entry.prompt_is_delta)


def as_status(value: object) -> ParentResolutionStatus:
    """`value` as our `ParentResolutionStatus`, compared by value.

    Accepts our members, NeMo Gym's `ParentResolutionStatus` members (or any other `str`
    enum with the same values) and the plain strings `"root"`, `"resolved"` and
    `"unresolved"`. Anything else is refused: a `str` that is no status is a `ValueError`,
    any other type a `TypeError`.
    """
    if isinstance(value, ParentResolutionStatus):
        return value
    if isinstance(value, str):
        try:
            return ParentResolutionStatus(str.__str__(value))
        except ValueError:
            pass
        raise ValueError(
            f"{value!r} is not a ParentResolutionStatus; expected one of "
            f"{[status.value for status in ParentResolutionStatus]}"
        )
    raise TypeError(
        f"a parent resolution status must be a ParentResolutionStatus or its str value, not "
        f"{type(value).__name__}"
    )


def _check_parent(status: object, parent_call_id: str | None, prompt_is_delta: bool) -> None:
    """NeMo Gym 0.7.0's parent rules; `status` is compared by value (any `str` enum works)."""
    if status is not None and not isinstance(status, ParentResolutionStatus):
        status = as_status(status)
    if status == ParentResolutionStatus.RESOLVED and not parent_call_id:
        raise ValueError(
            "resolved parent metadata requires parent_call_id (the id of the call it continues)"
        )
    if (
        status in (ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED)
        and parent_call_id is not None
    ):
        assert isinstance(status, ParentResolutionStatus)
        raise ValueError(
            f"{status.value} parent metadata cannot carry parent_call_id "
            f"(got {parent_call_id!r}); only a resolved call names its parent"
        )
    if prompt_is_delta and (parent_call_id is None or status != ParentResolutionStatus.RESOLVED):
        raise ValueError(
            "a delta prompt requires a RESOLVED parent_call_id to reconstruct from "
            "(prompt_is_delta is set, but the parent is not resolved)"
        )


def compute_digest(token_ids: Sequence[int] | Any) -> str:
    """Lowercase hex SHA-256 of a token-id sequence in the reference's framing.

    `token_ids` is a sequence of ints or a buffer of integers. A negative id or one above
    2**64-1 raises `ValueError` (for a negative id, in NeMo Gym's words). `None` digests as
    the empty sequence, as in NeMo Gym (whose `compute_digest` treats every falsy argument as
    empty); other non-sequences raise `TypeError`.
    """
    if token_ids is None:
        return _core.compute_digest(())
    try:
        return _core.compute_digest(token_ids)
    except ValueError as exc:
        negative = _first_negative(token_ids)
        if negative is None:
            raise
        raise ValueError(f"token ids must be non-negative, got {negative} ({exc})") from None


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """The bytes `compute_digest` hashes (after its domain tag): `DIGEST_VERSION` as one byte,
    the count as a big-endian u64, then each id as a big-endian u64."""
    ids = list(token_ids)
    try:
        return struct.pack(f">BQ{len(ids)}Q", DIGEST_VERSION, len(ids), *ids)
    except struct.error:
        negative = _first_negative(ids)
        if negative is None:
            raise ValueError("token ids must be integers below 2**64") from None
        raise ValueError(f"token ids must be non-negative, got {negative}") from None


def _first_negative(token_ids: Any) -> int | None:
    """The first negative id of a sequence that failed to digest (None if there is none)."""
    try:
        return next((int(t) for t in token_ids if t < 0), None)
    except (TypeError, ValueError):
        return None


def cumulative_tokens(entry: TokenEntry) -> list[int]:
    """The full token sequence after this call: prompt followed by generation."""
    if entry.prompt_is_delta:
        raise ValueError(
            f"model call {entry.model_call_id} stores a delta prompt; reconstruct through its "
            "parent chain (its cumulative tokens are the parent's followed by this call's)"
        )
    return [*entry.prompt_token_ids, *entry.generation_token_ids]


def stamp_lineage(
    entry: TokenEntry,
    parent_call_id: str | None,
    *,
    parent_resolution: ParentResolutionStatus | None = None,
    cumulative: Sequence[int] | None = None,
) -> TokenEntry:
    """Set parent, status, `cum_len` and `digest` on `entry` (in place) and return it."""
    if cumulative is None:
        cumulative = cumulative_tokens(entry)
    elif not entry.prompt_is_delta and list(cumulative) != cumulative_tokens(entry):
        raise ValueError(
            f"provided cumulative tokens disagree with the entry's own arrays (model call "
            f"{entry.model_call_id!r}: they differ from its prompt + generation)"
        )
    if parent_resolution is not None:
        parent_resolution = as_status(parent_resolution)
    _check_parent(parent_resolution, parent_call_id, entry.prompt_is_delta)
    entry.cum_len = len(cumulative)
    entry.digest = compute_digest(cumulative)
    entry.parent_call_id = parent_call_id
    entry.parent_resolution = parent_resolution
    return entry


# ---- served responses (NeMo Gym's helpers for the token fields a server returns) -----------

_REQUIRED_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def response_to_output_items(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A served response as Responses output items: its `output` as it is (dict items), an
    Anthropic Messages answer as reasoning items (one per thinking block) then one assistant
    message of its other content, or each Chat Completions choice's message as an assistant
    `message` item."""
    output = payload.get("output")
    if isinstance(output, list) and output:
        return [item for item in output if isinstance(item, dict)]
    if payload.get("type") == "message" and payload.get("role") == "assistant":
        return _anthropic_items(payload.get("content") or [])
    items = []
    for choice in payload.get("choices") or []:
        message = (choice or {}).get("message") or {}
        if isinstance(message, dict):
            item = dict(message)
            item.setdefault("type", "message")
            item.setdefault("role", "assistant")
            items.append(item)
    return items


def _anthropic_items(blocks: list[Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    content: list[Any] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _THINKING_BLOCKS:
            content.append(block)
            continue
        reasoning: dict[str, Any] = {"type": "reasoning", "summary": []}
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning["summary"] = [{"type": "summary_text", "text": block["thinking"]}]
        elif kind == "redacted_thinking" and block.get("data") is not None:
            reasoning["encrypted_content"] = block["data"]
        items.append(reasoning)
    if content:
        items.append({"type": "message", "role": "assistant", "content": content})
    return items


def strip_token_fields(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """The items without their token fields, and the index of the one item that carried
    generated token ids (None if none did; more than one is a `ValueError`)."""
    carriers = [i for i, item in enumerate(items) if item.get("generation_token_ids") is not None]
    if len(carriers) > 1:
        raise ValueError("multiple output items carry token metadata")
    stripped = [{k: v for k, v in item.items() if k not in TOKEN_FIELDS} for item in items]
    return stripped, carriers[0] if carriers else None


def extract_token_fields(response_json: dict[str, Any]) -> dict[str, Any] | None:
    """The token fields of a served response (Responses output items or Chat Completions
    messages): None when no item carries any; a `ValueError` when more than one does, or when
    the one that does lacks prompt ids, generated ids or log-probs."""
    messages = [
        (choice or {}).get("message") or {} for choice in response_json.get("choices") or []
    ]
    candidates = [
        item
        for item in [*(response_json.get("output") or []), *messages]
        if isinstance(item, dict) and any(item.get(f) is not None for f in _REQUIRED_TOKEN_FIELDS)
    ]
    if not candidates:
        return None
    if len(candidates) > 1:
        raise ValueError("multiple response items carry token metadata")
    (source,) = candidates
    missing = [f for f in _REQUIRED_TOKEN_FIELDS if source.get(f) is None]
    if missing:
        raise ValueError(f"partial token metadata is missing: {', '.join(missing)}")
    return {field: source.get(field) for field in TOKEN_FIELDS}
