"""`TokenCaptureStore`: the durable, rollout-keyed JSONL store, backed by the Rust core.

The Python side turns an entry into its canonical line (orjson, sorted keys) once; the native
store does everything else with the GIL released: per-rollout flock, tail reconciliation,
payload digests, append + fdatasync, the state index, fences. The hot async writes (put,
begin_call, mark_incomplete) run on the native worker pool and complete through a batched
event-loop reader; the rest (freeze, drop, retire, delete), which build Python objects, run on
a thread pool. Either way the event loop never waits on a disk.

What this store shares with the other backends (argument checks, entry conversion and the
canonical line, the async bridge, operation logging) lives in the core modules below them
(`tokencapture.validation`, `.entries`, `.jobs`, `.operations`; see docs/architecture.md); the
names this module has always exported (`canonical_line`, `validate_rollout_id`, ...) are
re-exported from there.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from time import perf_counter
from time import time as wall_time
from typing import Any

import orjson

from tokencapture import _core
from tokencapture import columnar as _columnar
from tokencapture.capture_settings import TokenIdCaptureConfig
from tokencapture.descriptors import check_max_open_files, descriptor_stats
from tokencapture.entries import as_token_entry, marker_line
from tokencapture.entries import canonical_line as canonical_line
from tokencapture.entries import entries_from_records as entries_from_records
from tokencapture.jobs import checked_when_called as checked_when_called
from tokencapture.jobs import native_job, off_loop
from tokencapture.metrics import Metrics
from tokencapture.operations import Operation, Refusals, log_failure
from tokencapture.protocols import (
    RolloutRemovalPayload,
    TokenCaptureSnapshot,
)
from tokencapture.records import TokenEntry
from tokencapture.rollout_files import RolloutFiles
from tokencapture.validation import check_age, check_flag
from tokencapture.validation import check_call_id as check_call_id
from tokencapture.validation import check_snapshot_id as check_snapshot_id
from tokencapture.validation import validate_rollout_id as validate_rollout_id
from tokencapture.validation import validate_rollout_ids as validate_rollout_ids
from tokencapture.validation import validated_batch as validated_batch

__all__ = [
    "TokenCaptureStore",
    "canonical_line",
    "make_token_store",
    "validate_rollout_id",
    "validate_rollout_ids",
]

# NeMo Gym's module-level name; `tokencapture.operations` logs the stores' failures to it.
logger = logging.getLogger(__name__)


class TokenCaptureStore(RolloutFiles):
    """Durable, rollout-keyed JSONL sink and source for `TokenEntry` records.

    Safe to share between threads, and between processes that open the same directory.

    Between operations the store keeps up to three descriptors for each of at most
    `cached_rollouts` (at least 1) recently used rollouts, within the process's descriptor
    budget (a sixteenth of the soft `RLIMIT_NOFILE` by default, shared by every store of the
    process; `TOKENCAPTURE_MAX_OPEN_FILES` sets it) and, if given, at most `max_open_files` of
    its own (0 keeps none). See docs/reliability.md, "Descriptor budget".
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        cached_rollouts: int = 128,
        max_open_files: int | None = None,
    ) -> None:
        if isinstance(cached_rollouts, bool) or not isinstance(cached_rollouts, int):
            raise TypeError("cached_rollouts must be an int")
        if cached_rollouts < 1:
            # As FileCaptureLedger and FileLineageStore refuse it: a cache of no rollouts is
            # not what this bounds (0 was taken as 1); `max_open_files=0` keeps no descriptors.
            raise ValueError("cached_rollouts must be at least 1")
        self._root = Path(root)
        self._native = _core.Store(
            os.fspath(self._root),
            min(cached_rollouts, sys.maxsize),
            check_max_open_files(max_open_files),
        )
        self._metrics = Metrics()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-operation counts, failures and latency histograms (see `tokencapture.metrics`),
        and under `"descriptors"` the descriptors this store keeps open (`open_files`), its
        own cap (`max_open_files`, None without one) and the process-wide budget's counters
        (`process_*`: see `descriptor_stats`)."""
        stats = self._metrics.snapshot()
        stats["descriptors"] = descriptor_stats(self._native)
        return stats

    def _operation(self, name: str, rollout_id: object) -> Operation:
        """Time one operation and log the failures an operator must see."""
        return Operation(self._metrics, name, rollout_id)

    def __repr__(self) -> str:
        return f"TokenCaptureStore({os.fspath(self._root)!r})"

    @property
    def root(self) -> Path:
        return self._root

    # Paths: path_for, state_path_for and the rest come from RolloutFiles.

    # Writes ------------------------------------------------------------------------------

    # The two puts time themselves inline rather than through `_operation`: a context manager
    # costs ~5 us of Python calls per put, the inline form ~1.5 us (same figures, same logs).

    def append(self, entry: TokenEntry) -> None:
        """Idempotently append one entry and fsync it before returning."""
        started = perf_counter()
        try:
            token_entry = as_token_entry(entry)
            line = canonical_line(token_entry)
            self._native.put(token_entry.rollout_id, token_entry.model_call_id, line)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Store an entry durably without blocking the event loop (`await store.put(entry)`).

        The entry is checked and its canonical line built when `put` is called, so a bad
        entry raises then, awaited or not. When the returned coroutine is awaited the line is
        queued for the rollout's one writer in this store, which runs natively on the worker
        pool: it commits every put queued for the rollout under one lock, with one write and
        one fdatasync (group commit), and the await returns once its own line is durable.
        """
        started = perf_counter()
        token_entry, line = self._checked_line(entry, started)
        if type(self).append is not TokenCaptureStore.append:
            # A subclass that overrides `append` (NeMo Gym's store awaits `append` in a thread
            # from `put`, and subclasses rely on that) gets its own `append` here too.
            return off_loop(self.append, token_entry)
        return self._put_line(token_entry, line, started)

    def _checked_line(self, entry: object, started: float) -> tuple[TokenEntry, bytes]:
        """The entry and its canonical line, checked as a put checks them (a refusal counted
        and logged as a failed put)."""
        try:
            token_entry = as_token_entry(entry)
            line = canonical_line(token_entry)  # the field types, rollout_id a str included
            _core.validate_rollout_id(token_entry.rollout_id)
            check_call_id(token_entry.model_call_id)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        return token_entry, line

    async def _put_line(self, entry: TokenEntry, line: bytes, started: float) -> None:
        try:
            await native_job(self._native.submit_put, entry.rollout_id, entry.model_call_id, line)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)

    def put_unless_stored(self, entry: TokenEntry) -> Coroutine[Any, Any, bool]:
        """`put`, unless the rollout already holds another entry under the entry's call id:
        then nothing is written or marked, and the awaited result is True (the stored entry
        stands). False once this entry is durable (or was already stored, byte for byte).

        For a second attempt of one call racing the first through another process (a client's
        retry through another gateway worker): `put`'s rule for that case (SPEC: mark the
        rollout incomplete and raise `TokenCaptureConflictError`) would cost the whole rollout,
        where the caller can answer with the stored entry instead. The check and the write are
        one step under the rollout's lock. Checked and refused as `put` is.
        """
        started = perf_counter()
        token_entry, line = self._checked_line(entry, started)
        return self._put_unless_stored_line(token_entry, line, started)

    async def _put_unless_stored_line(self, entry: TokenEntry, line: bytes, started: float) -> bool:
        try:
            kept: bool = await native_job(
                self._native.submit_put, entry.rollout_id, entry.model_call_id, line, True
            )
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)
        return kept

    def _refusals(self, name: str, rollout_id: object) -> Refusals:
        return Refusals(self._metrics, name, rollout_id)

    def _put_failed(self, entry: object, exc: BaseException, started: float) -> None:
        self._metrics.observe("put", perf_counter() - started, failed=True)
        log_failure("put", getattr(entry, "rollout_id", None), exc)

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Synchronous `begin_call` (the reference's name)."""
        with self._operation("begin_call", rollout_id):
            self._native.begin_call(rollout_id, model_call_id)

    def _check_intent(self, rollout_id: str, model_call_id: str) -> None:
        """The ids of a `begin_call`, checked when it is called (refusals counted as its)."""
        with self._refusals("begin_call", rollout_id):
            validate_rollout_id(rollout_id)
            check_call_id(model_call_id)

    def begin_call(self, rollout_id: str, model_call_id: str) -> Coroutine[Any, Any, None]:
        """Durably record that a captured call is about to be dispatched.

        An intent with no entry at freeze masks the rollout. The ids are checked when this is
        called (`TypeError` / `ValueError`), the intent is written when it is awaited.
        """
        self._check_intent(rollout_id, model_call_id)
        return self._begin_call_job(rollout_id, model_call_id)

    async def _begin_call_job(self, rollout_id: str, model_call_id: str) -> None:
        with self._operation("begin_call", rollout_id):
            await native_job(self._native.submit_begin_call, rollout_id, model_call_id, False)

    def begin_call_unless_stored(
        self, rollout_id: str, model_call_id: str
    ) -> Coroutine[Any, Any, bool]:
        """`begin_call`, unless the rollout already holds an entry of this call id: then
        nothing is written and the awaited result is True (also once the rollout is frozen).

        For a retry of a call whose answer was lost (the capture gateway's replays): the check
        and the intent are one step under the rollout's lock, so the caller reads nothing
        before deciding whether to dispatch. Checked and refused as `begin_call` is.
        """
        self._check_intent(rollout_id, model_call_id)
        return self._begin_call_unless_stored_job(rollout_id, model_call_id)

    async def _begin_call_unless_stored_job(self, rollout_id: str, model_call_id: str) -> bool:
        with self._operation("begin_call", rollout_id):
            stored: bool = await native_job(
                self._native.submit_begin_call, rollout_id, model_call_id, True
            )
            return stored

    def _mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Synchronous `mark_incomplete` (the reference's name)."""
        with self._operation("mark_incomplete", rollout_id):
            self._native.mark_incomplete(rollout_id, marker_line(model_call_id))

    def mark_incomplete(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, None]:
        """Durably record that a call was lost (allowed after freeze, refused after retire).

        The rollout id is checked when this is called; any call id is accepted.
        """
        with self._refusals("mark_incomplete", rollout_id):
            validate_rollout_id(rollout_id)
        return self._mark_incomplete_job(rollout_id, marker_line(model_call_id))

    async def _mark_incomplete_job(self, rollout_id: str, line: bytes) -> None:
        with self._operation("mark_incomplete", rollout_id):
            await native_job(self._native.submit_mark_incomplete, rollout_id, line, False)

    def mark_incomplete_if_open(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, bool]:
        """`mark_incomplete`, unless the rollout is frozen or retired: then nothing is marked
        and False is returned. Atomic (the check and the mark under the rollout's lock): for a
        call that failed while its rollout was being frozen, a mark after the freeze would
        move the snapshot's version, and the trainer's `drop` of that snapshot would fail.
        """
        with self._refusals("mark_incomplete", rollout_id):
            validate_rollout_id(rollout_id)
        return self._mark_incomplete_if_open_job(rollout_id, marker_line(model_call_id))

    async def _mark_incomplete_if_open_job(self, rollout_id: str, line: bytes) -> bool:
        with self._operation("mark_incomplete", rollout_id):
            marked = await native_job(self._native.submit_mark_incomplete, rollout_id, line, True)
        return bool(marked)

    # Reads and lifecycle -----------------------------------------------------------------

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Synchronously freeze one rollout and return its stable snapshot."""
        with self._operation("freeze", rollout_id):
            records, incomplete, snapshot_id, version = self._native.freeze(rollout_id)
            entries = self._entries(rollout_id, *records)
            return TokenCaptureSnapshot(rollout_id, entries, incomplete, snapshot_id, version)

    def _entries(
        self, rollout_id: str, records: list[dict[str, Any]], offsets: list[int]
    ) -> tuple[TokenEntry, ...]:
        return entries_from_records(records, offsets, str(self.path_for(rollout_id)))

    def freeze(self, rollout_id: str) -> Coroutine[Any, Any, TokenCaptureSnapshot]:
        """Freeze the rollout off the event loop (the id is checked when this is called)."""
        with self._refusals("freeze", rollout_id):
            validate_rollout_id(rollout_id)
        return off_loop(self.freeze_now, rollout_id)

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """The stored entries (a torn tail is ignored; nothing is created or changed)."""
        return list(self._entries(rollout_id, *self._native.read_lines(rollout_id)))

    def is_incomplete(self, rollout_id: str) -> bool:
        return self._native.is_incomplete(rollout_id)

    # Columnar reads (tokencapture.columnar) -----------------------------------------------

    def freeze_columns_now(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> _columnar.ColumnarSnapshot:
        """`freeze_now`, with the entries as Arrow columns instead of `TokenEntry` objects.

        `shared_prefixes=True` makes `prompt_token_ids` a `list_view<int64>` whose entries
        share the ids of repeated prompt prefixes (docs/columnar.md); the values are the same.
        """
        with self._operation("freeze_columns", rollout_id):
            try:
                entries, incomplete, snapshot_id, version = _core.freeze_columns(
                    self._native, rollout_id, shared_prefixes
                )
            except _core.ColumnarRecordError as exc:
                raise _columnar.columnar_refusal(
                    exc,
                    self.path_for(rollout_id),
                    lambda: self._entries(rollout_id, *self._native.freeze(rollout_id)[0]),
                ) from None
            return _columnar.ColumnarSnapshot(rollout_id, entries, incomplete, snapshot_id, version)

    def freeze_columns(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> Coroutine[Any, Any, _columnar.ColumnarSnapshot]:
        """`freeze`, with the entries as Arrow columns (validates `rollout_id` when called);
        `shared_prefixes` as for `freeze_columns_now`."""
        with self._refusals("freeze_columns", rollout_id):
            validate_rollout_id(rollout_id)
            check_flag(shared_prefixes, "shared_prefixes")
        return off_loop(self.freeze_columns_now, rollout_id, shared_prefixes=shared_prefixes)

    def read_columns(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> _columnar.ColumnarEntries:
        """`read_entries` as Arrow columns (a torn tail is ignored; nothing changes);
        `shared_prefixes` as for `freeze_columns_now`."""
        try:
            return _core.read_columns(self._native, rollout_id, shared_prefixes)
        except _core.ColumnarRecordError as exc:
            raise _columnar.columnar_refusal(
                exc, self.path_for(rollout_id), lambda: self.read_entries(rollout_id)
            ) from None

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Synchronous `drop` (the reference's name)."""
        with self._operation("drop", rollout_id):
            bad = isinstance(version, bool) or not isinstance(version, int)
            if bad or not 0 <= version < 2**64:
                return False  # no stored version can equal it
            return self._native.drop_snapshot(rollout_id, snapshot_id, version)

    def drop(self, rollout_id: str, snapshot_id: str, version: int) -> Coroutine[Any, Any, bool]:
        """Delete the consumed snapshot's records and keep its fence, if nothing changed.

        The rollout id and the snapshot id's type are checked when this is called.
        """
        with self._refusals("drop", rollout_id):
            validate_rollout_id(rollout_id)
            check_snapshot_id(snapshot_id)
        return off_loop(self._drop, rollout_id, snapshot_id, version)

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `retire`: fence every rollout durably, then remove their records."""
        with self._operation("retire", rollout_ids):
            removed, absent = self._native.retire(validate_rollout_ids(rollout_ids))
        return {"removed": removed, "absent": absent}

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and keep a fence, whatever their state.

        The batch is validated when this is called (a bare string is a `TypeError`).
        """
        with self._refusals("retire", rollout_ids):
            ids = validate_rollout_ids(rollout_ids)
        return off_loop(self.retire_now, ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `delete`: remove records, fences and lock files."""
        with self._operation("delete", rollout_ids):
            removed, absent = self._native.delete(validate_rollout_ids(rollout_ids))
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and fences, so a reused id starts empty.

        The batch is validated when this is called. NeMo Gym 0.7.0's `delete(rollout_id)` was
        synchronous and took one id; called that way here it raises `TypeError` at once (a
        bare string), instead of building a coroutine that never runs: use
        `delete_now([rollout_id])`.
        """
        with self._refusals("delete", rollout_ids):
            ids = validate_rollout_ids(rollout_ids)
        return off_loop(self.delete_now, ids)

    def sweep_retired(self, older_than_seconds: float) -> int:
        """NeMo Gym 0.7.0's `sweep_retired`: remove the fences (state, lock, intents and
        incomplete files) of rollouts retired at least `older_than_seconds` ago, and return how
        many were removed. Synchronous, as NeMo Gym's is. See `sweep_retired_ids`."""
        return len(self.sweep_retired_ids(older_than_seconds))

    def sweep_retired_ids(self, older_than_seconds: float, *, dry_run: bool = False) -> list[str]:
        """The rollouts `sweep_retired` removes, sorted (with `dry_run`, only listed).

        A rollout is swept when its state says retired and the state file was last modified at
        least `older_than_seconds` ago (`mtime <= now - older_than_seconds`, NeMo Gym's
        cutoff; a negative age reaches into the future, so every retired rollout goes). The
        check and the removal run under the rollout's exclusive lock, so a rollout deleted
        and reused meanwhile is never touched; rollouts that are not retired never are.
        `older_than_seconds` must be a real number (`TypeError`), not NaN (`ValueError`).
        """
        with self._operation("sweep_retired", None):
            cutoff = wall_time() - check_age(older_than_seconds)
            return self._native.sweep_retired(cutoff, dry_run)

    def inspect(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's state as a reader sees it, or None when it has no files.

        Read-only: every indexed line is checked against its payload digest (a mismatch raises
        `TokenCaptureCorruptionError`) and the unindexed tail is folded in, as freeze would.
        The state index's keys plus `entry_count` (unique records in the log).
        """
        found = self._native.inspect(rollout_id)
        if found is None:
            return None
        raw, entry_count = found
        return {**orjson.loads(raw), "entry_count": entry_count}

    async def close(self) -> None:
        """Close the descriptors the store keeps between operations (nothing to flush; the
        store stays usable and reopens what it needs)."""
        self._native.clear()


def make_token_store(global_config_dict: Any) -> TokenCaptureStore | None:
    """Build the training-token file store from a NeMo Gym global config (None: an empty one).

    The `token_id_capture` block is validated as NeMo Gym validates it
    (`tokencapture.capture_settings.TokenIdCaptureConfig`). Returns None when capture is
    disabled, when a custom sink owns the records, or when no directory resolves.
    """
    config = TokenIdCaptureConfig.model_validate(
        {} if global_config_dict is None else global_config_dict
    )
    if not config.enabled or config.token_id_capture.sink is not None:
        return None
    directory = config.resolved_dir()
    return TokenCaptureStore(directory) if directory is not None else None
