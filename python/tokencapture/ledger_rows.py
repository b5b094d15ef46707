"""Capture-ledger row logic every ledger shares (a neutral module below the backends).

A ledger row is what NeMo Gym 0.7.0's `FileLineageStore` writes per committed call (see
`tokencapture.ledger` and docs/compat-ledger.md). The file ledger, the file and in-memory
lineage stores (which present the ledger surface) and the PostgreSQL ledger all build, compare,
read and match rows with these:

* `as_commit`, `commit_row`, `commit_row_of`, `commit_line`, `row_bytes`: a commit (ours, NeMo
  Gym's model or a dict), validated, as its row and its stored bytes.
* `conflict_error(rollout_id, call_id)`: the `CaptureLedgerConflictError` of a second, different
  row for a call id (NeMo Gym's words first).
* `manifest_entry`, `manifest_from_rows`: rows as a `RolloutManifest`, by NeMo Gym's rules;
  `corrupt_row` for a row NeMo Gym could not read (`ROW_ERRORS` are what reading one raises).
* `match_of(row, items)`: the token-free `LineageMatch` a candidate row makes of a request;
  `stored_match` for a stored row's bytes, which raises `corrupt_row` for a row it cannot read
  and the request's own error (unwrapped) for request content the context digest refuses.

See docs/architecture.md for the layer map.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel

from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.protocols import LineageMatch, RolloutRetiredError, TokenCaptureCorruptionError
from tokencapture.staging_records import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
)
from tokencapture.validation import validate_rollout_id

__all__ = [
    "ROW_ERRORS",
    "CaptureLedgerConflictError",
    "as_commit",
    "commit_line",
    "commit_row",
    "commit_row_of",
    "conflict_error",
    "context_len_of",
    "corrupt_row",
    "custody_columns",
    "manifest_entry",
    "manifest_from_rows",
    "match_by_digest",
    "match_of",
    "retired_error",
    "row_bytes",
    "stored_match",
]

# What reading a row the way NeMo Gym reads it can raise on a row it cannot use.
ROW_ERRORS: Final[tuple[type[Exception], ...]] = (KeyError, TypeError, ValueError, ArithmeticError)


class CaptureLedgerConflictError(ValueError):
    """A model_call_id was recorded again with a different row; ledger rows are written once.

    Nothing was written. Unlike the token store's conflict, the ledger is not changed: the
    caller records a failure row if the call must poison its rollout.
    """


# Its public home is `tokencapture.ledger` (re-exported there and from `tokencapture`): the
# name OpenTelemetry's `error.type`, reprs and pickles have always used.
CaptureLedgerConflictError.__module__ = "tokencapture.ledger"


def conflict_error(rollout_id: str, model_call_id: str) -> CaptureLedgerConflictError:
    # NeMo Gym's words first ("conflicting lineage record for model call ..."), then ours.
    return CaptureLedgerConflictError(
        f"conflicting lineage record for model call {model_call_id}: model_call_id "
        f"{model_call_id!r} of rollout {rollout_id!r} is already recorded with a different "
        "row; ledger rows are written once"
    )


def retired_error(rollout_id: str) -> RolloutRetiredError:
    """What reading a retired rollout's ledger raises (the file ledger's words, which its
    native core writes)."""
    return RolloutRetiredError(
        f'rollout "{rollout_id}" was retired: its ledger is gone, not empty (delete the rollout '
        "to reuse its id)"
    )


def as_commit(commit: object) -> CaptureLedgerCommit:
    """Our `CaptureLedgerCommit`, revalidated (models are mutable, so an instance may have been
    changed since it was validated); NeMo Gym's model and a dict are accepted alike."""
    if isinstance(commit, BaseModel):
        return CaptureLedgerCommit.model_validate(commit.model_dump())
    if isinstance(commit, Mapping):
        return CaptureLedgerCommit.model_validate(dict(commit))
    raise TypeError(
        "expected a CaptureLedgerCommit, a pydantic model with its fields, or a dict; "
        f"got {type(commit).__name__}"
    )


def custody_columns(record: CallRecord, staging_chain: Sequence[str]) -> dict[str, Any]:
    """The record's columns of a commit row (``staging_digest`` is the record's ``digest``)."""
    return {
        "parent_call_id": record.parent_call_id,
        "staging_key": record.staging_key,
        "weight_version": record.weight_version,
        "prev_len": record.prev_len,
        "delta_len": record.delta_len,
        "cum_len": record.cum_len,
        "staging_digest": record.digest,
        "extras_digest": record.extras_digest,
        "mode": record.mode,
        "admitted_at": record.admitted_at,
        "staging_chain": list(staging_chain),
        "chain_hash": record.chain_hash,
        "cumulative_hash": record.cumulative_hash,
        "response_id": record.response_id,
        "output_fingerprint": record.output_fingerprint or None,
        "continuation_fingerprint": record.continuation_fingerprint or None,
        "fingerprint_version": record.fingerprint_version,
    }


def commit_row(commit: CaptureLedgerCommit) -> dict[str, Any]:
    """The ledger row of a validated commit, as NeMo Gym 0.7.0's `FileLineageStore` builds it.

    ``fingerprint_version`` is the record's own field (0 unless the framework set it), and only
    rows of version 2 ever resolve: NeMo Gym's rule, kept so both read a row alike.
    """
    request = list(commit.request_items)
    return {
        "model_call_id": commit.record.model_call_id,
        "fingerprint": assistant_fingerprint([*request, *commit.response_items]),
        "context_len": len(request),
        "context_digest": conversation_digest(request),
        "digest": commit.record.cumulative_hash,
        **custody_columns(commit.record, commit.staging_chain),
    }


def commit_row_of(commit: object) -> tuple[str, dict[str, Any]]:
    """Validate a commit (ours, NeMo Gym's or a dict) and build its row: `(rollout_id, row)`.
    Raises `TypeError` / `ValueError` as `FileCaptureLedger.record` does when called."""
    checked = as_commit(commit)
    return validate_rollout_id(checked.rollout_id), commit_row(checked)


def row_bytes(row: Mapping[str, Any]) -> bytes:
    return json.dumps(row, sort_keys=True, separators=(",", ":")).encode()


def commit_line(commit: object) -> tuple[str, str, bytes]:
    """Validate a commit and build its row: `(rollout_id, model_call_id, line)`.

    Raises before anything is written: `TypeError` for a wrong type, `ValueError` (pydantic's
    `ValidationError` included) for a malformed commit or one whose text cannot be stored.
    """
    checked = as_commit(commit)
    rollout_id = validate_rollout_id(checked.rollout_id)
    row = commit_row(checked)
    # Every text of the row passed a strict-str check, which refuses lone surrogates, so the
    # row encodes as UTF-8 and reads back.
    call_id = checked.record.model_call_id
    return rollout_id, call_id, row_bytes(row)


def corrupt_row(path: Path, offset: int, exc: BaseException) -> TokenCaptureCorruptionError:
    detail = " ".join(str(exc).split())  # one line, like every corruption message
    return TokenCaptureCorruptionError(
        f"{path}: ledger row cannot be read as NeMo Gym reads it ({type(exc).__name__}: "
        f"{detail}) (byte offset {offset})"
    )


def manifest_entry(row: dict[str, Any]) -> CallRecord | ManifestFailure | None:
    """What one row contributes to the manifest, by NeMo Gym's rules (None: nothing)."""
    if row.get("failure_reason") is not None:
        return ManifestFailure(
            model_call_id=str(row["model_call_id"]), reason=str(row["failure_reason"])
        )
    if row.get("staging_key") is None:
        return None  # a lineage-only row: not part of a capture manifest
    if not row.get("response_id"):
        return ManifestFailure(
            model_call_id=str(row["model_call_id"]), reason=LEDGER_ROW_MISSING_RESPONSE_ID_REASON
        )
    if not row.get("chain_hash") or not row.get("cumulative_hash"):
        return ManifestFailure(
            model_call_id=str(row["model_call_id"]), reason=LEDGER_ROW_MISSING_CHAIN_HASH_REASON
        )
    return CallRecord(
        model_call_id=str(row["model_call_id"]),
        parent_call_id=row.get("parent_call_id"),
        prev_len=int(row["prev_len"]),
        delta_len=int(row["delta_len"]),
        cum_len=int(row["cum_len"]),
        weight_version=int(row["weight_version"]),
        digest=str(row["staging_digest"]),
        extras_digest=str(row["extras_digest"]),
        staging_key=str(row["staging_key"]),
        mode=str(row["mode"]),
        chain_hash=str(row["chain_hash"]),
        cumulative_hash=str(row["cumulative_hash"]),
        response_id=str(row["response_id"]),
        admitted_at=row.get("admitted_at"),
        output_fingerprint=row.get("output_fingerprint") or None,
        continuation_fingerprint=row.get("continuation_fingerprint") or None,
        fingerprint_version=int(row.get("fingerprint_version") or 0),
    )


def manifest_from_rows(
    rollout_id: str, rows: Sequence[tuple[int, bytes]], path: Path
) -> dict[str, Any]:
    """The manifest payload of `(offset, row bytes)` rows, as NeMo Gym builds it.

    Where NeMo Gym's manifest would raise on a row (a missing column, a value its model
    refuses), this raises `TokenCaptureCorruptionError` naming the row's file and offset.
    """
    records: list[CallRecord] = []
    failures: list[ManifestFailure] = []
    for offset, line in rows:
        try:
            entry = manifest_entry(json.loads(line))
        except ROW_ERRORS as exc:
            raise corrupt_row(path, offset, exc) from exc
        if isinstance(entry, CallRecord):
            records.append(entry)
        elif entry is not None:
            failures.append(entry)
    manifest = RolloutManifest(rollout_id=rollout_id, records=records, failures=failures)
    return manifest.model_dump(mode="json")


def match_of(row: dict[str, Any], items: list[Any]) -> LineageMatch | None:
    """The parent a candidate row makes of this request, or None when its context differs.

    Raises what reading the row raises (`ROW_ERRORS`) and what digesting the request's context
    raises (`conversation_digest`'s `ValueError` / `TypeError`) alike; a stored row is matched
    by `stored_match`, which tells the two apart.
    """
    context_len = context_len_of(row)
    if len(items) < context_len:
        return None
    return match_by_digest(row, conversation_digest(items[:context_len]))


def context_len_of(row: dict[str, Any]) -> int:
    """A candidate row's recorded ``context_len`` (raises one of `ROW_ERRORS` if unreadable)."""
    return int(row["context_len"])


def match_by_digest(row: dict[str, Any], request_digest: str) -> LineageMatch | None:
    """The match a candidate row makes of a request whose context (the row's ``context_len``
    first items) digests to `request_digest`; None when the row's ``context_digest`` differs."""
    if request_digest != row["context_digest"]:
        return None
    return LineageMatch(
        model_call_id=str(row["model_call_id"]),
        cumulative_token_ids=tuple(int(token) for token in row.get("cumulative_token_ids") or ()),
        digest=str(row["digest"]),
        staging_chain=tuple(row.get("staging_chain") or []),
        prev_len=int(row.get("cum_len") or 0),
        chain_hash=str(row.get("chain_hash") or ""),
    )


def stored_match(
    line: str | bytes, items: list[Any], path: Path, offset: int
) -> LineageMatch | None:
    """`match_of` of a stored candidate row (its bytes, at `offset` of `path`).

    A row that cannot be read as NeMo Gym reads it raises `TokenCaptureCorruptionError`
    (`corrupt_row`); content of the request that its context digest refuses raises
    `conversation_digest`'s own error, unwrapped: the request's fault, not the row's. The
    digest is computed between reading the row's ``context_len`` and the rest of it, the order
    `match_of` reads them in.
    """
    try:
        row = json.loads(line)
        context_len = context_len_of(row)
    except ROW_ERRORS as exc:
        raise corrupt_row(path, offset, exc) from exc
    if len(items) < context_len:
        return None
    request_digest = conversation_digest(items[:context_len])  # the request's errors, as is
    try:
        return match_by_digest(row, request_digest)
    except ROW_ERRORS as exc:
        raise corrupt_row(path, offset, exc) from exc
