"""`FileCaptureLedger`: a file-backed `CaptureLedger`, backed by the Rust core.

A training framework that stages token arrays itself publishes each call's token-free
`CallRecord` here (`record`), or a poison row for a call that did not commit (`record_failure`);
serving workers resolve a new request's parent over the committed rows (`resolve`), and the
trajectory builder reads the rollout's `manifest`, then `retire`s it.

On disk, beside the token store's files (one directory, shareable by many processes), per rollout
id ``R``:

``R.lineage.jsonl``
    One row per line, ``\\n``-terminated, JSON with sorted keys and ``(",", ":")`` separators.
    A commit row is ``{"kind":"commit","record":{...},"rollout_id":R,"schema_version":2,
    "staging_chain":[...]}`` (``record`` is the `CallRecord` payload, whose ``model_call_id``
    keys the row); a failure row is ``{"kind":"failure","model_call_id":C,"reason":T,
    "rollout_id":R,"schema_version":2}``. The request and response items are not stored: the
    record's ``continuation_*`` hashes, checked against them at `record` time, are what
    resolution needs.
``R.lineage.retired``
    **The fence**: an empty file whose existence means "retired". It is a separate file rather
    than a row so that removing the rows never touches it and so that checking it is one
    ``stat`` under the lock.
``R.tokens.lock``
    The token store's per-rollout ``flock`` target, shared: writers hold it exclusively,
    readers shared, and every acquisition verifies that the path still names the locked inode.

Rules:

* **Write once.** A commit row is written at most once per ``model_call_id``: the identical row
  again is a no-op, a different one raises `CaptureLedgerConflictError` (a `ValueError`) and
  writes nothing. Failure rows never conflict; an identical ``(model_call_id, reason)`` is a
  no-op.
* **Durable and visible before returning.** `record` and `record_failure` return after the row
  and its newline are written in one call and ``fdatasync``ed (creating the file also fsyncs
  the directory). Every reader, in any process, folds the bytes appended since its last look
  under the shared lock, so the row is seen by the next `resolve`, `manifest` or `has_rows`.
* **Recovery.** A final line without its newline was never acknowledged: readers ignore it, the
  next writer truncates it. A complete line that is not a ledger row raises
  `TokenCaptureCorruptionError` with the file and byte offset; nothing is skipped.
* **Poison rows.** A commit row whose record has no response id, no ``digest`` or
  ``chain_hash``, or is otherwise not a valid `CallRecord` (an older or foreign writer), is
  listed under ``failures`` with ``missing_response_id``, ``missing_chain_digest`` or
  ``invalid_call_record``; two different commit rows for one call id (a writer without this
  ledger's check) are listed as ``conflicting_call_record``. None of them ever resolves, and
  neither does a committed call that also has a failure row.
* **Retire** is two phases, each ending in one directory fsync: create (and fsync) every
  missing fence, then remove the rows. The fence is therefore durable before any removal is, and
  a crash in between leaves a fenced rollout with rows, which still reads as retired. Later
  `record` / `record_failure` calls for a fenced rollout are discarded silently (the seed's
  contract); `manifest` and `has_rows` raise `RolloutRetiredError`; `resolve` finds no parent.
* **Delete** removes the rows and the fence (and the shared lock file when no token-store file of
  the rollout remains), then fsyncs the directory: the id reads as unused again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import orjson
from pydantic import BaseModel, ValidationError

from tokencapture import _core
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.lineage import check_resolve_args
from tokencapture.metrics import instrumented
from tokencapture.protocols import (
    LineageMatch,
    LineageResolution,
    RolloutRemovalPayload,
    TokenCaptureConflictError,
)
from tokencapture.records import ParentResolutionStatus
from tokencapture.staging.records import (
    INVALID_CALL_RECORD_REASON,
    LEDGER_SCHEMA_VERSION,
    CallRecord,
    CaptureLedgerCommit,
)
from tokencapture.store import (
    _native_job,
    _off_loop,
    checked_when_called,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = [
    "DEFAULT_LEDGER_CACHED_ROLLOUTS",
    "CaptureLedgerConflictError",
    "FileCaptureLedger",
]

logger = logging.getLogger(__name__)

DEFAULT_LEDGER_CACHED_ROLLOUTS: Final = 256
"""Rollouts whose folded rows a `FileCaptureLedger` keeps in memory (one descriptor each)."""

_ROOT: Final = LineageResolution(ParentResolutionStatus.ROOT)


class CaptureLedgerConflictError(ValueError):
    """A model_call_id was recorded again with a different row; ledger rows are written once.

    Nothing was written. Unlike the token store's conflict, the ledger is not changed: the
    caller records a failure row if the call must poison its rollout.
    """


def _conflict(rollout_id: str, model_call_id: str) -> CaptureLedgerConflictError:
    return CaptureLedgerConflictError(
        f"model_call_id {model_call_id!r} of rollout {rollout_id!r} is already recorded with a "
        "different row; ledger rows are written once"
    )


def _as_commit(commit: object) -> CaptureLedgerCommit:
    if isinstance(commit, CaptureLedgerCommit) and isinstance(commit.record, CallRecord):
        return commit
    if isinstance(commit, BaseModel):
        # A foreign model with the same fields (NeMo Gym's own commit): revalidate its values.
        return CaptureLedgerCommit.model_validate(commit.model_dump())
    if isinstance(commit, Mapping):
        return CaptureLedgerCommit.model_validate(dict(commit))
    raise TypeError(
        "expected a CaptureLedgerCommit, a pydantic model with its fields, or a dict; "
        f"got {type(commit).__name__}"
    )


def _hashes(items: list[Any], context_len: int) -> tuple[str, str]:
    """`(assistant_fingerprint(items), conversation_digest(items[:context_len]))`: natively for
    plain JSON items, by `tokencapture.fingerprint` (their definition) otherwise."""
    hashes = _core.continuation_hashes(items, context_len)
    if hashes is not None:
        return hashes
    return assistant_fingerprint(items), conversation_digest(items[:context_len])


def _commit_line(commit: object) -> tuple[str, str, bytes]:
    """Validate a commit and build its row: `(rollout_id, model_call_id, line)`.

    Raises before anything is written: `TypeError` for a wrong type, `ValueError` (pydantic's
    `ValidationError` included) for a malformed commit or a record whose continuation hashes do
    not match the commit's request and response items.
    """
    checked = _as_commit(commit)
    rollout_id = validate_rollout_id(checked.rollout_id)
    record = checked.record
    request = list(checked.request_items)
    fingerprint, context_digest = _hashes([*request, *checked.response_items], len(request))
    expected = {
        "continuation_fingerprint": fingerprint,
        "continuation_context_len": len(request),
        "continuation_context_digest": context_digest,
    }
    wrong = [name for name, value in expected.items() if getattr(record, name) != value]
    if wrong:
        fields = ", ".join(f"record.{name}" for name in wrong)
        raise ValueError(
            f"commit of {record.model_call_id!r} (rollout {rollout_id!r}): {fields} "
            f"{'does' if len(wrong) == 1 else 'do'} not match the hashes of its request_items "
            "and response_items (as stamp_continuation computes them), so no request could "
            "ever be matched to it"
        )
    row = {
        "kind": "commit",
        "record": record.model_dump(mode="json"),
        "rollout_id": rollout_id,
        "schema_version": LEDGER_SCHEMA_VERSION,
        "staging_chain": list(checked.staging_chain),
    }
    try:
        line = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError) as exc:
        raise ValueError(
            f"commit of {record.model_call_id!r} (rollout {rollout_id!r}) cannot be stored as "
            f"JSON that reads back: {exc}"
        ) from exc
    return rollout_id, record.model_call_id, line


def _check_failure(rollout_id: str, model_call_id: str, reason: str) -> None:
    validate_rollout_id(rollout_id)
    for name, value in (("model_call_id", model_call_id), ("reason", reason)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not value:
            raise ValueError(f"{name} must not be empty")


def _failure(model_call_id: str, reason: str) -> dict[str, Any]:
    return {
        "schema_version": LEDGER_SCHEMA_VERSION,
        "model_call_id": model_call_id,
        "reason": reason,
    }


_Step = tuple[str, str | None, str, tuple[str, ...], int, str, str]


def _resolution(step: _Step) -> LineageResolution:
    status, call_id, digest, staging_chain, prev_len, chain_hash, reason = step
    if status == "resolved":
        assert call_id is not None
        match = LineageMatch(call_id, (), digest, staging_chain, prev_len, chain_hash)
        return LineageResolution(ParentResolutionStatus.RESOLVED, match)
    if status == "root":
        return _ROOT
    return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)


@instrumented(
    "ledger",
    "file",
    {
        "record_now": "record",
        "record": "record",
        "record_failure_now": "record_failure",
        "record_failure": "record_failure",
        "manifest_now": "manifest",
        "has_rows_now": "has_rows",
        "resolve_now": "resolve",
        "retire_now": "retire",
        "delete_now": "delete",
    },
)
class FileCaptureLedger:
    """A `CaptureLedger` over one directory, shared by every process that opens it.

    Safe to share between threads. Each instance keeps the folded rows of at most
    `cached_rollouts` rollouts (LRU); every operation first folds whatever other processes
    appended, so nothing cached is ever stale.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        cached_rollouts: int = DEFAULT_LEDGER_CACHED_ROLLOUTS,
    ) -> None:
        if isinstance(cached_rollouts, bool) or not isinstance(cached_rollouts, int):
            raise TypeError("cached_rollouts must be an int")
        if cached_rollouts < 1:
            raise ValueError("cached_rollouts must be at least 1")
        self._root = Path(root)
        self._native = _core.Ledger(os.fspath(self._root), cached_rollouts)

    def __repr__(self) -> str:
        return f"FileCaptureLedger({os.fspath(self._root)!r})"

    @property
    def root(self) -> Path:
        return self._root

    def path_for(self, rollout_id: str) -> Path:
        """The rollout's rows, `R.lineage.jsonl`."""
        return self._root / f"{validate_rollout_id(rollout_id)}.lineage.jsonl"

    def fence_path_for(self, rollout_id: str) -> Path:
        """The rollout's fence, `R.lineage.retired` (present once retired, until deleted)."""
        return self._root / f"{validate_rollout_id(rollout_id)}.lineage.retired"

    def lock_path_for(self, rollout_id: str) -> Path:
        """The per-rollout lock shared with the token store, `R.tokens.lock`."""
        return self._root / f"{validate_rollout_id(rollout_id)}.tokens.lock"

    # Writes ------------------------------------------------------------------------------

    def record_now(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> bool:
        """Synchronous `record`. True when the row is stored (now or already), False when the
        rollout is retired and the row was discarded."""
        rollout_id, _, line = _commit_line(commit)
        return self._native.record(rollout_id, line)

    @checked_when_called(_as_commit)  # arguments are checked when called
    async def record(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> None:
        """Publish a completed call; returns once every process can read it.

        The same row again is a no-op; a different row for the same model_call_id raises
        `CaptureLedgerConflictError`. A retired rollout discards the row.
        """
        rollout_id, call_id, line = _commit_line(commit)
        try:
            stored = await _native_job(self._native.submit_record, rollout_id, line)
        except TokenCaptureConflictError:
            # The worker pool reports core errors only; a ledger conflict arrives as the
            # store's conflict and is re-raised as the ledger's own (nothing was written).
            raise _conflict(rollout_id, call_id) from None
        if not stored:
            logger.debug("record of %r discarded: rollout %r is retired", call_id, rollout_id)

    def record_failure_now(self, rollout_id: str, model_call_id: str, reason: str) -> bool:
        """Synchronous `record_failure`; False when the retired rollout discarded the row."""
        _check_failure(rollout_id, model_call_id, reason)
        return self._native.record_failure(rollout_id, model_call_id, reason)

    @checked_when_called(_check_failure)  # arguments are checked when called
    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Durably record a call whose capture did not complete (it poisons the manifest)."""
        _check_failure(rollout_id, model_call_id, reason)
        stored = await _native_job(
            self._native.submit_record_failure, rollout_id, model_call_id, reason
        )
        if not stored:
            logger.debug(
                "failure row of %r discarded: rollout %r is retired", model_call_id, rollout_id
            )

    # Reads -------------------------------------------------------------------------------

    def manifest_now(self, rollout_id: str) -> dict[str, Any]:
        """Synchronous `manifest`."""
        validate_rollout_id(rollout_id)
        commits, failures = self._native.manifest(rollout_id)
        records: list[dict[str, Any]] = []
        failure_rows = [_failure(call_id, reason) for call_id, reason in failures]
        for call_id, raw in commits:
            try:
                records.append(CallRecord.model_validate_json(raw).model_dump(mode="json"))
            except ValidationError as exc:  # pragma: no cover - the native check is stricter
                logger.warning("ledger row of %r in %r is invalid: %s", call_id, rollout_id, exc)
                failure_rows.append(_failure(call_id, INVALID_CALL_RECORD_REASON))
        return {
            "schema_version": LEDGER_SCHEMA_VERSION,
            "rollout_id": rollout_id,
            "records": records,
            "failures": failure_rows,
        }

    @checked_when_called(validate_rollout_id)  # arguments are checked when called
    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's token-free ledger as plain wire data (validates as `RolloutManifest`).

        Committed rows are under ``records``, poison rows under ``failures``; no token arrays.
        A retired rollout raises `RolloutRetiredError` instead of looking empty.
        """
        return await _off_loop(self.manifest_now, rollout_id)

    def has_rows_now(self, rollout_id: str) -> bool:
        """Synchronous `has_rows`."""
        validate_rollout_id(rollout_id)
        return self._native.has_rows(rollout_id)

    @checked_when_called(validate_rollout_id)  # arguments are checked when called
    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any row (committed or failed) exists; retired -> `RolloutRetiredError`."""
        return await _off_loop(self.has_rows_now, rollout_id)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """Synchronous `resolve`."""
        validate_rollout_id(rollout_id)
        items = request_items if isinstance(request_items, list) else list(request_items)
        fingerprint, _ = _hashes(items, 0)
        if not fingerprint:
            return _ROOT
        digests: dict[int, str] = {}
        while True:
            step = self._native.resolve_hashed(rollout_id, fingerprint, len(items), digests)
            if isinstance(step, tuple):
                return _resolution(step)
            if not step:  # pragma: no cover - caller-supplied hashes never need a fallback
                raise RuntimeError("the native ledger asked for no digests")
            for length in step:
                digests[length] = _hashes(items[:length], length)[1]

    @checked_when_called(check_resolve_args)  # arguments are checked when called
    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """ROOT, RESOLVED with a token-free `LineageMatch`, or UNRESOLVED with a reason.

        The match carries the parent's ``digest``, ``chain_hash``, its ``cum_len`` as
        ``prev_len`` and its commit's ``staging_chain``; ``cumulative_token_ids`` is empty (the
        tokens live in the framework's staging). A retired rollout resolves no parent.
        """
        return await _off_loop(self.resolve_now, rollout_id, request_items)

    def is_process_shared(self) -> bool:
        return True

    # Removal -----------------------------------------------------------------------------

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `retire`."""
        ids = validate_rollout_ids(rollout_ids)
        removed, absent = self._native.retire(ids)
        return {"removed": removed, "absent": absent}

    @checked_when_called(validate_rollout_ids)  # arguments are checked when called
    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Fence rollouts durably, then remove their rows. Retiring again is a no-op.

        The whole batch is validated first (a bare string is a `TypeError`, an invalid id a
        `ValueError`) and nothing changes if any id is refused.
        """
        ids = validate_rollout_ids(rollout_ids)
        return await _off_loop(self.retire_now, ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `delete`."""
        ids = validate_rollout_ids(rollout_ids)
        removed, absent = self._native.delete(ids)
        return {"removed": removed, "absent": absent}

    @checked_when_called(validate_rollout_ids)  # arguments are checked when called
    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' rows and fences, so a reused id starts empty. Idempotent."""
        ids = validate_rollout_ids(rollout_ids)
        return await _off_loop(self.delete_now, ids)

    async def close(self) -> None:
        """Drop the cached rows and their descriptors. Idempotent; nothing is ever pending
        (every write was durable before it returned) and the ledger stays usable."""
        self._native.clear()
