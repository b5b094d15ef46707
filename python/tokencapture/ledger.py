"""`FileCaptureLedger`: a file-backed `CaptureLedger` whose files are NeMo Gym 0.7.0's.

A training framework that stages token arrays itself publishes each call's token-free
`CallRecord` here (`record`), or a poison row for a call that did not commit (`record_failure`);
serving workers resolve a new request's parent over the committed rows (`resolve`), and the
trajectory builder reads the rollout's `manifest`, then `retire`s it.

The rows are exactly those of NeMo Gym 0.7.0's `FileLineageStore` (its `CaptureLedger`), so
both implementations can share one directory, each reading what the other writes with the same
answers. Per rollout id ``R``, beside the token store's files:

``R.lineage.jsonl``
    One row per line, ``\\n``-terminated, written as Python's
    ``json.dumps(row, sort_keys=True, separators=(",", ":"))`` writes it (non-ASCII escaped).
    A commit row holds the call id, the assistant ``fingerprint`` of its request and response
    items, ``context_len`` and ``context_digest`` of the request, the record's
    ``cumulative_hash`` as ``digest``, and the record's custody columns (``staging_digest`` is
    the record's ``digest``; ``staging_chain`` the commit's). A failure row is
    ``{"failure_reason":T,"model_call_id":C}``. See ``docs/compat-ledger.md``.
``R.lineage.retired``
    **The fence** (ours; NeMo Gym ignores it): an empty file whose existence means "retired".
``R.tokens.lock``
    The token store's per-rollout ``flock`` target: writers hold it exclusively, readers shared.

Rules:

* **Write once**, decided as NeMo Gym decides it: a commit row is compared with the first row of
  its call id (by value): equal is a no-op, different raises `CaptureLedgerConflictError` (a
  `ValueError`) and writes nothing, so a commit after a failure row of the same call conflicts.
  A failure row is a no-op when the identical failure row exists.
* **Durable and visible before returning.** The row and its newline are written in one call and
  ``fdatasync``ed (creating the file also fsyncs the directory).
* **Recovery.** A final line without its newline was never acknowledged: readers ignore it, the
  next writer truncates it. A complete line that is not a JSON object with a ``model_call_id``
  raises `TokenCaptureCorruptionError` with the file and byte offset, and so does a row the
  manifest or resolution cannot read the way NeMo Gym reads it (where NeMo Gym would raise).
* **Manifest and resolution** follow NeMo Gym: failure rows and rows with a ``staging_key`` are
  listed (a custody row without a response id or chain hashes as a failure with NeMo Gym's
  reason); a request resolves only when exactly one row carries its fingerprint (version 2)
  and that row's recorded context matches.
* **Retire** fences durably, then removes the rows; a fenced rollout discards later writes,
  resolves nothing, and `manifest`/`has_rows` raise `RolloutRetiredError`. **Delete** removes
  rows and fence.

Every async method checks its arguments when it is called, not when it is awaited: a misuse
raises at once instead of inside a coroutine nobody awaits.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokencapture import _core
from tokencapture.descriptors import check_max_open_files, descriptor_stats
from tokencapture.jobs import native_job, off_loop
from tokencapture.ledger_rows import CaptureLedgerConflictError as CaptureLedgerConflictError
from tokencapture.ledger_rows import (
    commit_line,
    conflict_error,
    stored_match,
)
from tokencapture.ledger_rows import commit_row as commit_row
from tokencapture.ledger_rows import commit_row_of as commit_row_of
from tokencapture.ledger_rows import manifest_from_rows as manifest_from_rows
from tokencapture.metrics import instrumented
from tokencapture.protocols import (
    LineageResolution,
    RolloutRemovalPayload,
    TokenCaptureConflictError,
)
from tokencapture.records import ParentResolutionStatus
from tokencapture.resolution import fingerprint_of, request_copy
from tokencapture.staging_records import CaptureLedgerCommit
from tokencapture.validation import (
    check_failure_args,
    check_resolve_args,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = [
    "DEFAULT_LEDGER_CACHED_ROLLOUTS",
    "CaptureLedgerConflictError",
    "FileCaptureLedger",
    "commit_row",
    "manifest_from_rows",
]

logger = logging.getLogger(__name__)

DEFAULT_LEDGER_CACHED_ROLLOUTS: Final[int] = 256
"""Rollouts whose folded rows a `FileCaptureLedger` keeps in memory (one descriptor each)."""

_ROOT: Final[LineageResolution] = LineageResolution(ParentResolutionStatus.ROOT)
_NO_MATCH: Final[LineageResolution] = LineageResolution(
    ParentResolutionStatus.UNRESOLVED, reason="no_match"
)


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
        # Timed itself: its executor runs `_resolve_fingerprinted`, not the timed twin.
        "resolve": "resolve",
        "retire_now": "retire",
        "delete_now": "delete",
    },
    refusals={
        "manifest": "manifest",
        "has_rows": "has_rows",
        "retire": "retire",
        "delete": "delete",
    },
)
class FileCaptureLedger:
    """A `CaptureLedger` over one directory, shared by every process that opens it (and by
    NeMo Gym 0.7.0's `FileLineageStore` over the same directory).

    Safe to share between threads. Each instance keeps the folded rows of at most
    `cached_rollouts` rollouts (LRU; one descriptor each, within the process's descriptor
    budget and, if given, `max_open_files`); every operation first folds whatever other processes
    appended, so nothing cached is ever stale.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        cached_rollouts: int = DEFAULT_LEDGER_CACHED_ROLLOUTS,
        max_open_files: int | None = None,
    ) -> None:
        if isinstance(cached_rollouts, bool) or not isinstance(cached_rollouts, int):
            raise TypeError("cached_rollouts must be an int")
        if cached_rollouts < 1:
            raise ValueError("cached_rollouts must be at least 1")
        self._root = Path(root)
        self._native = _core.Ledger(
            os.fspath(self._root),
            min(cached_rollouts, sys.maxsize),
            check_max_open_files(max_open_files),
        )

    def stats(self) -> dict[str, dict[str, Any]]:
        """Under `"descriptors"`, what this ledger keeps open beside the process budget
        (`tokencapture.descriptors.descriptor_stats`)."""
        return {"descriptors": descriptor_stats(self._native)}

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
        rollout_id, _, line = commit_line(commit)
        return self._native.record(rollout_id, line)

    def record(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> Coroutine[Any, Any, None]:
        """Publish a completed call; the awaited result returns once every process can read it.

        The commit is validated and its row built when this is called. The same row again is a
        no-op; a different row for the same model_call_id raises `CaptureLedgerConflictError`.
        A retired rollout discards the row.
        """
        rollout_id, call_id, line = commit_line(commit)
        return self._record(rollout_id, call_id, line)

    async def _record(self, rollout_id: str, call_id: str, line: bytes) -> None:
        try:
            stored = await native_job(self._native.submit_record, rollout_id, line)
        except TokenCaptureConflictError:
            # The worker pool reports core errors only; a ledger conflict arrives as the
            # store's conflict and is re-raised as the ledger's own (nothing was written).
            raise conflict_error(rollout_id, call_id) from None
        if not stored:
            logger.debug("record of %r discarded: rollout %r is retired", call_id, rollout_id)

    def record_failure_now(self, rollout_id: str, model_call_id: str, reason: str) -> bool:
        """Synchronous `record_failure`; False when the retired rollout discarded the row."""
        check_failure_args(rollout_id, model_call_id, reason)
        return self._native.record_failure(rollout_id, model_call_id, reason)

    def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str
    ) -> Coroutine[Any, Any, None]:
        """Durably record a call whose capture did not complete (it poisons the manifest).

        The arguments are checked when this is called.
        """
        check_failure_args(rollout_id, model_call_id, reason)
        return self._record_failure(rollout_id, model_call_id, reason)

    async def _record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        stored = await native_job(
            self._native.submit_record_failure, rollout_id, model_call_id, reason
        )
        if not stored:
            logger.debug(
                "failure row of %r discarded: rollout %r is retired", model_call_id, rollout_id
            )

    # Reads -------------------------------------------------------------------------------

    def manifest_now(self, rollout_id: str) -> dict[str, Any]:
        """Synchronous `manifest`."""
        path = self.path_for(rollout_id)
        return manifest_from_rows(rollout_id, self._native.manifest_rows(rollout_id), path)

    def manifest(self, rollout_id: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The rollout's token-free ledger as plain wire data (validates as `RolloutManifest`).

        Committed rows are under ``records``, poison rows under ``failures``; no token arrays.
        A retired rollout raises `RolloutRetiredError` instead of looking empty.
        """
        validate_rollout_id(rollout_id)
        return off_loop(self.manifest_now, rollout_id)

    def has_rows_now(self, rollout_id: str) -> bool:
        """Synchronous `has_rows`."""
        validate_rollout_id(rollout_id)
        return self._native.has_rows(rollout_id)

    def has_rows(self, rollout_id: str) -> Coroutine[Any, Any, bool]:
        """Whether any row exists (any JSON object row, as NeMo Gym counts them); a retired
        rollout raises `RolloutRetiredError`."""
        validate_rollout_id(rollout_id)
        return off_loop(self.has_rows_now, rollout_id)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """Synchronous `resolve`."""
        items = check_resolve_args(rollout_id, request_items)
        return self._resolve_fingerprinted(rollout_id, items, fingerprint_of(items))

    def _resolve_fingerprinted(
        self, rollout_id: str, items: list[Any], fingerprint: str
    ) -> LineageResolution:
        """`resolve_now` of checked items whose fingerprint is known (not timed: its callers
        are)."""
        if not fingerprint:
            return _ROOT
        found = self._native.candidate(rollout_id, fingerprint)
        if found is None:
            return _NO_MATCH
        offset, line = found
        # A row it cannot read is corruption; request content the context digest refuses is
        # the request's own error, raised as `conversation_digest` raises it.
        match = stored_match(line, items, self.path_for(rollout_id), offset)
        if match is None:
            return _NO_MATCH
        return LineageResolution(ParentResolutionStatus.RESOLVED, match=match)

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """ROOT, RESOLVED with a token-free `LineageMatch`, or UNRESOLVED ``"no_match"``.

        The match carries the row's ``digest`` (the call's cumulative hash), ``chain_hash``,
        its ``cum_len`` as ``prev_len`` and the commit's ``staging_chain``;
        ``cumulative_token_ids`` is empty (the tokens live in the framework's staging). A
        retired rollout resolves no parent.

        The arguments are checked, and the request's fingerprint computed, when this is
        called: content the fingerprint refuses raises then (`ValueError` / `TypeError`).
        """
        # Copied now: the context digest, computed when awaited, reads the request as called.
        items = request_copy(check_resolve_args(rollout_id, request_items))
        fingerprint = fingerprint_of(items)
        return off_loop(self._resolve_fingerprinted, rollout_id, items, fingerprint)

    def is_process_shared(self) -> bool:
        return True

    # Removal -----------------------------------------------------------------------------

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `retire`."""
        ids = validate_rollout_ids(rollout_ids)
        removed, absent = self._native.retire(ids)
        return {"removed": removed, "absent": absent}

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Fence rollouts durably, then remove their rows. Retiring again is a no-op.

        The whole batch is validated when this is called (a bare string is a `TypeError`, an
        invalid id a `ValueError`) and nothing changes if any id is refused.
        """
        ids = validate_rollout_ids(rollout_ids)
        return off_loop(self.retire_now, ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `delete`."""
        ids = validate_rollout_ids(rollout_ids)
        removed, absent = self._native.delete(ids)
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' rows and fences, so a reused id starts empty. Idempotent.

        The batch is validated when this is called: a bare string is a `TypeError` at once.
        """
        ids = validate_rollout_ids(rollout_ids)
        return off_loop(self.delete_now, ids)

    async def close(self) -> None:
        """Drop the cached rows and their descriptors. Idempotent; nothing is ever pending
        (every write was durable before it returned) and the ledger stays usable."""
        self._native.clear()
