"""Entries and their canonical line, shared by every backend (a neutral module below them).

* `as_token_entry(value)`: our `TokenEntry` from ours, from a foreign pydantic model with the
  same fields (NeMo Gym's) or from a dict, revalidated.
* `canonical_line(entry)`: the stored bytes of an entry, `orjson.dumps(model_dump(mode="json"),
  OPT_SORT_KEYS)`, refusing (`ValueError`) an entry that would not read back.
* `entries_from_records(records, offsets, where)`: entries from natively decoded,
  digest-verified records, a record that is not a valid entry being corruption.
* `marker_line(model_call_id)`: one line of the incomplete file, whatever the call id holds.

`ENTRY_FIELDS` holds `TokenEntry`'s field type rules, checked natively. See
docs/architecture.md for the layer map.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from pydantic import BaseModel

from tokencapture import _core
from tokencapture.model_building import construct
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.records import (
    BOOL_FIELDS,
    INT_FIELDS,
    OPTIONAL_INT_FIELDS,
    OPTIONAL_TEXT_FIELDS,
    REQUIRED_FIELDS,
    STATUS_VALUES,
    TEXT_FIELDS,
    ParentResolutionStatus,
    TokenEntry,
    check_entry_invariants,
)

__all__ = [
    "ENTRY_FIELDS",
    "as_token_entry",
    "canonical_line",
    "entries_from_records",
    "entry_from_record",
    "marker_line",
]


def as_token_entry(entry: object) -> TokenEntry:
    if isinstance(entry, TokenEntry):
        return entry
    if isinstance(entry, BaseModel):
        # A foreign model with the same fields (NeMo Gym's own TokenEntry): revalidate its
        # Python-mode values so nothing (NaN included) is converted before our checks. Its
        # serializer is not asked to judge the values (`warnings=False`): NeMo Gym's
        # `commit_entry` stamps a resolver's status onto its entry unvalidated, so with our
        # resolver its enum field holds our `ParentResolutionStatus`, which its dump would warn
        # about; the validation below checks every value anyway.
        return TokenEntry.model_validate(entry.model_dump(warnings=False))
    if isinstance(entry, Mapping):
        return TokenEntry.model_validate(dict(entry))
    raise TypeError(
        "expected a TokenEntry, a pydantic model with TokenEntry's fields, or a dict; "
        f"got {type(entry).__name__}"
    )


# The type rules of TokenEntry's fields, checked natively (see `records.check_field_types`).
ENTRY_FIELDS = _core.EntryFields(
    required=REQUIRED_FIELDS,
    text=TEXT_FIELDS,
    optional_text=OPTIONAL_TEXT_FIELDS,
    ints=INT_FIELDS,
    optional_ints=OPTIONAL_INT_FIELDS,
    bools=BOOL_FIELDS,
    statuses=sorted(STATUS_VALUES),
)


def entry_from_record(record: dict[str, Any]) -> TokenEntry:
    """Build an entry from a decoded, digest-verified record without a second full validation
    (the field type checks and the model's invariants still run; the decoder already checked
    the token arrays)."""
    ENTRY_FIELDS.check(record)
    status = record.get("parent_resolution")
    if status is not None:
        record["parent_resolution"] = ParentResolutionStatus(status)
    # Not a second validation, nor model_construct's per-field lookups (`model_building`).
    entry = construct(TokenEntry, record)
    check_entry_invariants(entry)
    return entry


def entries_from_records(
    records: Sequence[dict[str, Any]], offsets: Sequence[int], where: str
) -> tuple[TokenEntry, ...]:
    """Entries from natively decoded records (any backend); a record that is not a valid entry
    is corruption, reported with `where` (the log) and the line's byte offset."""
    entries = []
    for record, offset in zip(records, offsets, strict=True):
        try:
            entries.append(entry_from_record(record))
        except ValueError as exc:
            raise TokenCaptureCorruptionError(
                f"{where}: the line is not a valid entry: {exc} (byte offset {offset})"
            ) from exc
    return tuple(entries)


def canonical_line(entry: TokenEntry) -> bytes:
    """The stored form of an entry: `orjson.dumps(model_dump(mode="json"), OPT_SORT_KEYS)`.

    Raises `ValueError`, before anything is written, for an entry that would not read back
    (a value of the wrong type, a non-finite float, an integer beyond 64 bits, a non-string
    key, nesting deeper than readers accept).
    """
    values = dict(entry.__dict__)
    if entry.__pydantic_extra__:
        values.update(entry.__pydantic_extra__)
    status = values.get("parent_resolution")
    if status is not None:
        values["parent_resolution"] = str(status.value if hasattr(status, "value") else status)
    try:
        # One native call: the field types, then a walk for non-finite floats, nesting and
        # token-array item types. It also says whether every value is plain JSON, which orjson
        # serializes exactly as pydantic's JSON mode would, without a second copy of the arrays.
        plain = ENTRY_FIELDS.check(values, deep=True)
        check_entry_invariants(entry)
    except ValueError as exc:
        raise ValueError(f"entry {values.get('model_call_id')!r} cannot be stored: {exc}") from exc
    try:
        payload = values if plain else entry.model_dump(mode="json")
        return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError) as exc:
        raise ValueError(
            f"entry {entry.model_call_id!r} of rollout {entry.rollout_id!r} cannot be stored as "
            f"JSON that reads back: {exc}"
        ) from exc


def marker_line(model_call_id: object) -> bytes:
    """One line for the incomplete file, whatever the call id holds (it must never fail)."""
    text = model_call_id if isinstance(model_call_id, str) else str(model_call_id)
    if "\n" not in text and "\r" not in text:
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            pass
    return json.dumps(text).encode("ascii")
