"""Request-time lineage: which committed model call does a new request continue?

A model call's entry is stamped (`stamp_continuation`) with the fingerprint of everything the
model authored up to and including its own output, and with the length and digest of the request
context it saw. A later request whose model-authored turns hash to that fingerprint, and whose
prefix of that length digests to the recorded context, continues the call: the resolver returns
the call's verified cumulative tokens (prompt + generation, rebuilt through delta entries), so the
next prompt can be checked or encoded against them (`encode_delta`).

Resolvers (`tokencapture.protocols.LineageResolver`):

* `FileLineageStore` reads the JSONL files that `tokencapture.store.TokenCaptureStore` writes, in
  any process: a put that has returned is visible to the next resolve, even in a resolver built
  before the put. Reading is incremental and memory is bounded (an LRU over rollouts and a token
  budget for materialized sequences).
* `InMemoryLineageStore` is the bounded single-process variant, fed by its own `put`.

Like NeMo Gym 0.7.0's, both are also capture ledgers (`record`, `record_failure`, `manifest`,
`has_rows`): `FileLineageStore` over the directory's `R.lineage.jsonl` (a `FileCaptureLedger`),
`InMemoryLineageStore` in memory. Committed ledger rows resolve continuations too: in the
file store those its token entries leave unresolved, in memory as candidates beside the put
entries (both as NeMo Gym 0.7.0 resolves them).

Both run the same native matcher (`tokencapture._core`): candidate rules, never a guess, and a
digest check of every answer. The request hashes run natively for plain JSON items and fall back
to `tokencapture.fingerprint` for anything else, which is the definition of both hashes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tokencapture import _core
from tokencapture.descriptors import check_max_open_files, descriptor_stats
from tokencapture.entries import as_token_entry, canonical_line
from tokencapture.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    conversation_digest,
)
from tokencapture.forking import renew_after_fork
from tokencapture.jobs import native_job, off_loop
from tokencapture.ledger import FileCaptureLedger
from tokencapture.ledger_rows import (
    commit_row_of,
    conflict_error,
    manifest_from_rows,
    match_of,
    retired_error,
)
from tokencapture.metrics import instrumented, untimed
from tokencapture.protocols import LineageMatch, LineageResolution, RolloutRemovalPayload
from tokencapture.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokencapture.resolution import DEFAULT_CACHED_ROLLOUTS as DEFAULT_CACHED_ROLLOUTS
from tokencapture.resolution import DEFAULT_CACHED_TOKENS as DEFAULT_CACHED_TOKENS
from tokencapture.resolution import (
    ROOT,
    Prepared,
    prepare,
    resolution_of,
    resolve_in_python,
    resolve_native,
    resolve_prepared,
)
from tokencapture.staging_records import CaptureLedgerCommit
from tokencapture.validation import check_cache_limits as check_cache_limits
from tokencapture.validation import check_failure_args, validate_rollout_id, validate_rollout_ids
from tokencapture.validation import check_resolve_args as check_resolve_args
from tokencapture.validation import request_list as request_list

__all__ = [
    "AMBIGUOUS_REASON",
    "DEFAULT_CACHED_ROLLOUTS",
    "DEFAULT_CACHED_TOKENS",
    "DELTA_REFUSED",
    "NO_MATCH_REASON",
    "FileLineageStore",
    "InMemoryLineageStore",
    "LineageIntegrityError",
    "check_resolve_args",
    "encode_delta",
    "request_list",
    "stamp_continuation",
]

NO_MATCH_REASON: Final[str] = "no_match"
DELTA_REFUSED: Final[str] = "delta records require a durable-log-backed lineage store"
"""`InMemoryLineageStore.put`'s refusal of a delta entry (NeMo Gym 0.7.0's words)."""
_NO_MATCH: Final[LineageResolution] = LineageResolution(
    ParentResolutionStatus.UNRESOLVED, reason=NO_MATCH_REASON
)
AMBIGUOUS_REASON: Final[str] = "ambiguous"


class LineageIntegrityError(ValueError):
    """A resolved call's stored chain does not rebuild to its recorded tokens.

    Raised instead of ever returning wrong tokens: the chain's `cum_len` or token digest does not
    match the winner's record, the chain has a cycle or a missing parent, or a token array is not
    a list of token ids.
    """


def stamp_continuation(entry: TokenEntry, request_items: Sequence[Mapping[str, Any]]) -> TokenEntry:
    """Stamp `entry` (in place, and return it) with its continuation lookup metadata.

    Sets `continuation_fingerprint = assistant_fingerprint(request_items + output_items)`,
    `continuation_context_len = len(request_items)`, `continuation_context_digest =
    conversation_digest(request_items)` and `fingerprint_version = 2`. Unstamped entries are
    invisible to resolution.
    """
    items = list(request_items)
    combined = [*items, *entry.output_items]
    hashes = _core.continuation_hashes(combined, len(items))
    if hashes is None:
        fingerprint, digest = assistant_fingerprint(combined), conversation_digest(items)
    else:
        fingerprint, digest = hashes
    entry.continuation_fingerprint = fingerprint
    entry.continuation_context_len = len(items)
    entry.continuation_context_digest = digest
    entry.fingerprint_version = FINGERPRINT_VERSION
    return entry


@instrumented("lineage", "file", {"resolve_now": "resolve", "resolve": "resolve"})
class FileLineageStore:
    """A `LineageResolver` over the JSONL files of a `TokenCaptureStore` directory.

    Every resolve looks for bytes appended since the last one (under the rollout's shared lock;
    nothing is created), so a put that has returned in any process is visible. A replaced,
    truncated or deleted file resets that rollout's index: a retired or deleted rollout resolves
    nothing, and a reused rollout id resolves against its new entries only.

    Memory is bounded: the metadata indexes of at most `max_cached_rollouts` rollouts (LRU; two
    open descriptors each, the log and the lock file, within the process's descriptor budget
    and, if given, `max_open_files`), at most `max_cached_tokens` tokens of verified
    cumulative sequences (8 bytes a token, LRU), and at most `max_cached_tokens` tokens of
    answer tuples (the last answer per rollout, from which the next one is extended, sharing
    its ints).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_cached_rollouts: int = DEFAULT_CACHED_ROLLOUTS,
        max_cached_tokens: int = DEFAULT_CACHED_TOKENS,
        max_open_files: int | None = None,
    ) -> None:
        check_cache_limits(max_cached_rollouts, max_cached_tokens)
        self._root = os.fspath(root)
        self._max_open_files = check_max_open_files(max_open_files)
        self._native = _core.FileLineage(
            self._root,
            min(max_cached_rollouts, sys.maxsize),
            min(max_cached_tokens, sys.maxsize),
            self._max_open_files,
        )
        self._ledger: FileCaptureLedger | None = None
        self._ledger_lock = threading.Lock()
        renew_after_fork(self, "_ledger_lock")

    def __repr__(self) -> str:
        return f"FileLineageStore({self._root!r})"

    @property
    def root(self) -> str:
        return self._root

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """Synchronous `resolve` (blocks on the rollout's shared lock and file reads)."""
        items = check_resolve_args(rollout_id, request_items)
        resolution = resolve_native(self._native, rollout_id, items)
        if self._ledger_may_answer(rollout_id, resolution):
            return self._from_ledger(rollout_id, items, resolution)
        return self._fenced(rollout_id, resolution)

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """Return ROOT, RESOLVED with the verified parent, or UNRESOLVED with a reason.

        The arguments are checked when this is called (`TypeError` / `ValueError`), and the
        request items are copied and fingerprinted then, so content the fingerprint refuses
        raises at the call (`tokencapture.resolution.prepare`). When it is awaited, the
        digests, the file check and materialization run on the native worker pool (no GIL, no
        thread hop), and only the answer is built on the loop, while the worker checks its
        digest: it is returned once that passed. The answer is the request's as it was when
        called (the items the port does not cover are copied then for Python's hashes).
        """
        items = check_resolve_args(rollout_id, request_items)
        return self._resolve_job(rollout_id, prepare(self._native, rollout_id, items))

    async def _resolve_job(self, rollout_id: str, prepared: Prepared) -> LineageResolution:
        job, fingerprint, items = prepared  # the items as they were when called
        resolution: LineageResolution | None = ROOT if not fingerprint else None
        if resolution is None and job is not None:
            await native_job(self._native.submit, job)
            raw = self._native.finish(job)
            if raw is not None:
                resolution = resolution_of(raw)
        if resolution is None:
            resolution = await off_loop(
                resolve_in_python, self._native, rollout_id, items, fingerprint
            )
        if self._ledger_may_answer(rollout_id, resolution):
            return await off_loop(self._from_ledger, rollout_id, items, resolution, fingerprint)
        return self._fenced(rollout_id, resolution)

    def is_process_shared(self) -> bool:
        return True

    # The capture-ledger surface. NeMo Gym 0.7.0's `FileLineageStore` is a `CaptureLedger` too:
    # its ledger rows (`R.lineage.jsonl`, beside the token files) are our `FileCaptureLedger`'s,
    # byte for byte, so these delegate to one over the same directory (made on first use; a
    # resolver that never meets a ledger creates nothing). A continuation the token entries
    # leave UNRESOLVED is then looked up among the ledger's committed rows, as NeMo Gym does.

    def _fenced(self, rollout_id: str, resolution: LineageResolution) -> LineageResolution:
        """A parent found among token entries of a rollout whose ledger is retired is not
        answered: a retired rollout resolves nothing (`FileCaptureLedger`'s rule)."""
        if resolution.status is ParentResolutionStatus.RESOLVED and _exists(
            os.path.join(self._root, f"{rollout_id}.lineage.retired")
        ):
            return _NO_MATCH
        return resolution

    def _capture_ledger(self) -> FileCaptureLedger:
        with self._ledger_lock:
            if self._ledger is None:
                self._ledger = FileCaptureLedger(self._root, max_open_files=self._max_open_files)
            return self._ledger

    def _ledger_may_answer(self, rollout_id: str, resolution: LineageResolution) -> bool:
        return resolution.status is ParentResolutionStatus.UNRESOLVED and _exists(
            os.path.join(self._root, f"{rollout_id}.lineage.jsonl")
        )

    def _from_ledger(
        self,
        rollout_id: str,
        items: list[Any],
        resolution: LineageResolution,
        fingerprint: str | None = None,
    ) -> LineageResolution:
        ledger = self._capture_ledger()
        with untimed(ledger):  # part of this resolve, counted once as this store's
            if fingerprint is None:
                found = ledger.resolve_now(rollout_id, items)
            else:  # the request's fingerprint, computed when the resolve was called
                found = ledger._resolve_fingerprinted(rollout_id, items, fingerprint)
        return found if found.status is ParentResolutionStatus.RESOLVED else resolution

    def record_now(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> bool:
        """`FileCaptureLedger.record_now` over this directory."""
        return self._capture_ledger().record_now(commit)

    def record(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> Coroutine[Any, Any, None]:
        """`FileCaptureLedger.record` over this directory (checked when called)."""
        return self._capture_ledger().record(commit)

    def record_failure_now(self, rollout_id: str, model_call_id: str, reason: str) -> bool:
        """`FileCaptureLedger.record_failure_now` over this directory."""
        return self._capture_ledger().record_failure_now(rollout_id, model_call_id, reason)

    def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str
    ) -> Coroutine[Any, Any, None]:
        """`FileCaptureLedger.record_failure` over this directory (checked when called)."""
        return self._capture_ledger().record_failure(rollout_id, model_call_id, reason)

    def manifest_now(self, rollout_id: str) -> dict[str, Any]:
        """`FileCaptureLedger.manifest_now` over this directory."""
        return self._capture_ledger().manifest_now(rollout_id)

    def manifest(self, rollout_id: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """`FileCaptureLedger.manifest` over this directory."""
        return self._capture_ledger().manifest(rollout_id)

    def has_rows_now(self, rollout_id: str) -> bool:
        """`FileCaptureLedger.has_rows_now` over this directory."""
        return self._capture_ledger().has_rows_now(rollout_id)

    def has_rows(self, rollout_id: str) -> Coroutine[Any, Any, bool]:
        """`FileCaptureLedger.has_rows` over this directory (ledger rows, not token entries,
        as NeMo Gym's `FileLineageStore` counts them)."""
        return self._capture_ledger().has_rows(rollout_id)

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """`FileCaptureLedger.retire_now` over this directory."""
        return self._capture_ledger().retire_now(rollout_ids)

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`FileCaptureLedger.retire` over this directory: fence the rollouts' ledgers durably,
        then remove their rows (`removed`: the rollouts that had rows). A retired rollout
        discards later ledger writes, its `manifest` and `has_rows` raise `RolloutRetiredError`
        and it resolves nothing, from its token entries neither, until it is deleted. The token
        store's files are not touched: retiring those is its source's `retire`. The batch is
        validated when this is called."""
        return self._capture_ledger().retire(rollout_ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """`FileCaptureLedger.delete_now` over this directory."""
        return self._capture_ledger().delete_now(rollout_ids)

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`FileCaptureLedger.delete` over this directory: remove the rollouts' ledger rows and
        fences, so a reused id starts empty (the token store's files are its source's to
        delete). The batch is validated when this is called."""
        return self._capture_ledger().delete(rollout_ids)

    def cached_tokens(self) -> int:
        """Tokens held by the materialized-sequence cache."""
        return self._native.cached_tokens()

    def cached_rollouts(self) -> int:
        return self._native.cached_rollouts()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Under `"descriptors"`, what this resolver keeps open beside the process budget
        (`tokencapture.descriptors.descriptor_stats`; its ledger, once made, reports its own)."""
        return {"descriptors": descriptor_stats(self._native)}

    async def close(self) -> None:
        """Drop the caches and their descriptors. Idempotent; the store stays usable."""
        self._native.clear()
        with self._ledger_lock:
            ledger, self._ledger = self._ledger, None
        if ledger is not None:
            await ledger.close()


# The columns of a ledger row that only resolution reads; NeMo Gym's in-memory rows omit them.
_LOOKUP_COLUMNS: Final[frozenset[str]] = frozenset(
    {"fingerprint", "context_len", "context_digest", "digest"}
)


def _exists(path: str) -> bool:
    """Whether `path` names a file (following links), as `os.path.exists` answers for the
    paths built here, without the `FileNotFoundError` that `os.path.exists` makes and discards
    when it does not (a resolve asks this of an absent fence on every answer: 0.6 against
    1.4 us)."""
    return os.access(path, os.F_OK)


def _indexed_by_nemo(entry: TokenEntry) -> bool:
    """Whether NeMo Gym's in-memory index takes this entry (a fingerprint of version 2 or
    none); it ignores the others."""
    return bool(entry.continuation_fingerprint) and entry.fingerprint_version in (
        None,
        FINGERPRINT_VERSION,
    )


def _with_parent_length(resolution: LineageResolution) -> LineageResolution:
    """NeMo Gym's in-memory resolver reports the parent's cumulative length as the match's
    `prev_len` (its file resolver leaves it 0, and so does ours): match it, as a drop-in."""
    match = resolution.match
    if match is None:
        return resolution
    return LineageResolution(
        resolution.status,
        match=dataclasses.replace(match, prev_len=len(match.cumulative_token_ids)),
        reason=resolution.reason,
    )


@instrumented(
    "lineage",
    "memory",
    {
        "put_now": "put",
        "put": "put",
        "resolve_now": "resolve",
        "resolve": "resolve",
        "retire_now": "retire",
        "retire": "retire",
        "delete_now": "delete",
        "delete": "delete",
    },
)
class InMemoryLineageStore:
    """A bounded, single-process `LineageResolver` fed by `put`.

    At most `max_rollouts` rollouts (LRU) and `max_tokens` tokens of stored entries; eviction
    never removes the most recently used rollout, so a single rollout larger than the budget is
    kept. Materialized cumulative sequences are cached separately, up to `max_cached_tokens`
    (default: a quarter of `max_tokens`). Reusing a model_call_id with a different payload raises
    `TokenCaptureConflictError` and removes that call from resolution.

    It is also a capture ledger kept in memory (the whole `CaptureLedger` protocol: `record`,
    `record_failure`, `manifest`, `has_rows`, `retire`, `delete`), by NeMo Gym 0.7.0's
    in-memory rules: a call id is a put entry or a committed ledger row, not both (the second
    raises `CaptureLedgerConflictError`), and `resolve` takes put entries and committed calls
    as one candidate set. `retire` fences a rollout as `FileCaptureLedger` does: its rows and
    entries are forgotten, later writes (ledger rows and puts) are discarded, it resolves
    nothing and `manifest`/`has_rows` raise `RolloutRetiredError`, until `delete`. Fences are
    kept outside the LRU (a forgotten fence would let a retired rollout come back), one id
    each, until `delete` or `close`.

    As NeMo Gym's, it keeps no token log, so `put` refuses every delta entry it would index
    (`prompt_is_delta` with a continuation fingerprint of version 2 or none) with NeMo Gym's
    `ValueError`: a delta's parent could be evicted, and its tokens never rebuilt.
    """

    def __init__(
        self,
        max_rollouts: int = 512,
        max_tokens: int = 8_000_000,
        *,
        max_cached_tokens: int | None = None,
    ) -> None:
        if max_rollouts < 1:
            raise ValueError("max_rollouts must be at least 1")
        if max_tokens < 0:
            raise ValueError("max_tokens must not be negative")
        cached = max_tokens // 4 if max_cached_tokens is None else max_cached_tokens
        if cached < 0:
            raise ValueError("max_cached_tokens must not be negative")
        self._native = _core.MemoryLineage(
            min(max_rollouts, sys.maxsize), min(max_tokens, 2**64 - 1), min(cached, sys.maxsize)
        )
        # The rollouts put to, LRU: the bound of `_indexed` below. Kept for up to 4x the native
        # LRU's rollouts, touched on every put and resolve, so it holds at least every rollout
        # the native index still holds.
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_rollouts = 4 * max_rollouts
        # Capture-ledger rows per rollout (NeMo Gym's in-memory store has this surface for
        # tests and single-process development): unbounded, outside the LRU, as NeMo Gym's.
        self._ledgers: dict[str, list[dict[str, Any]]] = {}
        # The committed rows with a fingerprint, whole (lookup columns included), for resolve.
        self._ledger_lookup: dict[str, list[dict[str, Any]]] = {}
        # The call ids of put entries NeMo Gym's in-memory index would hold (stamped with a
        # fingerprint of version 2 or none), per rollout in `_seen`: they count for `has_rows`,
        # and a call id is either put or committed to the ledger, never both.
        self._indexed: dict[str, set[str]] = {}
        # Retired rollouts (the fence): unbounded, outside the LRU, until delete or close.
        self._retired: set[str] = set()

    def _check_put(self, entry: object) -> tuple[TokenEntry, bytes]:
        """Check an entry for `put`: its type, fields, canonical line, and NeMo Gym's refusals
        (a delta entry it would index; a call id already committed to the ledger)."""
        token_entry = as_token_entry(entry)
        rollout_id = validate_rollout_id(token_entry.rollout_id)
        line = canonical_line(token_entry)
        if _indexed_by_nemo(token_entry):
            if token_entry.prompt_is_delta:
                raise ValueError(DELTA_REFUSED)
            if token_entry.model_call_id in self._committed(rollout_id):
                raise conflict_error(rollout_id, token_entry.model_call_id)
        return token_entry, line

    def _committed(self, rollout_id: str) -> set[str]:
        """The call ids of the rollout's committed ledger rows (failure rows excluded)."""
        return {
            row["model_call_id"]
            for row in self._ledgers.get(rollout_id, ())
            if "failure_reason" not in row
        }

    def _index(self, entry: TokenEntry, line: bytes) -> bool:
        rollout_id = entry.rollout_id
        if entry.prompt_is_delta and not _indexed_by_nemo(entry):
            return False  # invisible to resolution, and NeMo Gym's index ignores it too
        if rollout_id in self._retired:
            return False  # the fence discards it, as the ledger's discards a late row
        added = self._native.put(rollout_id, line)
        if rollout_id not in self._seen:
            self._seen[rollout_id] = None
            while len(self._seen) > self._seen_rollouts:
                evicted, _ = self._seen.popitem(last=False)
                self._indexed.pop(evicted, None)
        else:
            self._seen.move_to_end(rollout_id)
        if _indexed_by_nemo(entry):
            self._indexed.setdefault(rollout_id, set()).add(entry.model_call_id)
        return added

    def _touch(self, rollout_id: str) -> None:
        if rollout_id in self._seen:
            self._seen.move_to_end(rollout_id)

    def put_now(self, entry: TokenEntry) -> bool:
        """Index one entry; False when it was not added (already indexed, an unstamped delta
        entry, which nothing resolves to, or a retired rollout).

        A delta entry it would index (`prompt_is_delta`, stamped) is refused with NeMo Gym's
        `ValueError` ("delta records require a durable-log-backed lineage store").
        """
        return self._index(*self._check_put(entry))

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Index one entry (the `TokenSink.put` shape). The entry is checked when this is
        called (`TypeError` / `ValueError`), indexed when it is awaited."""
        return self._put_job(*self._check_put(entry))

    async def _put_job(self, entry: TokenEntry, line: bytes) -> None:
        self._index(entry, line)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        items = check_resolve_args(rollout_id, request_items)
        return self._resolve_checked(rollout_id, prepare(self._native, rollout_id, items))

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """`resolve_now` when awaited, of the request as it was when called. The arguments
        are checked, and the request items copied and fingerprinted (content the fingerprint
        refuses raises), when this is called."""
        items = check_resolve_args(rollout_id, request_items)
        return self._resolve_job(rollout_id, prepare(self._native, rollout_id, items))

    async def _resolve_job(self, rollout_id: str, prepared: Prepared) -> LineageResolution:
        return self._resolve_checked(rollout_id, prepared)

    def _resolve_checked(self, rollout_id: str, prepared: Prepared) -> LineageResolution:
        _, fingerprint, items = prepared  # the items as they were when called
        if rollout_id in self._retired:
            return ROOT if not fingerprint else _NO_MATCH
        resolved = resolve_prepared(self._native, rollout_id, prepared)
        resolution = _with_parent_length(resolved)
        self._touch(rollout_id)
        return self._or_ledger(rollout_id, items, resolution, fingerprint)

    # The capture-ledger surface, as NeMo Gym 0.7.0's `InMemoryLineageStore` has it. Its rows
    # are the custody rows only (``model_call_id`` and the record's columns, no fingerprint or
    # context), write-once against the first row of the call id, a failure row included; a
    # committed call joins resolution whatever its record's `fingerprint_version`, by the
    # in-memory rules: candidates whose recorded context the request extends, several that
    # share one (digest, cum_len) collapse to the smallest call id, otherwise "ambiguous".
    # A match is token-free: the cumulative hash as `digest`, `cum_len` as `prev_len`, the
    # commit's `staging_chain` and the record's `chain_hash`. Entries and committed calls are
    # one candidate set (as NeMo Gym's single index): a resolved entry is one more candidate,
    # and an answer the entries already found ambiguous stays so.

    def _or_ledger(
        self, rollout_id: str, items: list[Any], resolution: LineageResolution, fingerprint: str
    ) -> LineageResolution:
        rows = self._ledger_lookup.get(rollout_id)
        if not rows or resolution.status is ParentResolutionStatus.ROOT:
            return resolution
        if resolution.reason == AMBIGUOUS_REASON:
            return resolution  # more candidates never make distinct ones agree
        matches = [
            match
            for row in rows
            if row["fingerprint"] == fingerprint and (match := match_of(row, items)) is not None
        ]
        if not matches:
            return resolution
        # NeMo Gym keeps entries and committed calls in one index: a resolved entry is one
        # more candidate.
        if resolution.match is not None:
            matches.append(resolution.match)
        keys = {(match.digest, match.prev_len) for match in matches}
        if len(matches) > 1 and len(keys) == 1 and matches[0].digest:
            matches = [min(matches, key=lambda match: match.model_call_id)]
        if len(matches) > 1:
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=AMBIGUOUS_REASON)
        return LineageResolution(ParentResolutionStatus.RESOLVED, match=matches[0])

    def record(self, commit: CaptureLedgerCommit | Mapping[str, Any]) -> Coroutine[Any, Any, None]:
        """Keep a committed call's ledger row. Validated when called; the same row again is a
        no-op, another row for the same call (a failure row too) raises
        `CaptureLedgerConflictError`."""
        rollout_id, row = commit_row_of(commit)
        return self._record_job(rollout_id, row)

    async def _record_job(self, rollout_id: str, row: dict[str, Any]) -> None:
        if rollout_id in self._retired:
            return  # the fence discards it
        custody = {key: value for key, value in row.items() if key not in _LOOKUP_COLUMNS}
        rows = self._ledgers.setdefault(rollout_id, [])
        call_id = row["model_call_id"]
        existing = next((kept for kept in rows if kept.get("model_call_id") == call_id), None)
        if existing is not None:
            if existing != custody:
                raise conflict_error(rollout_id, call_id)
            return
        if call_id in self._indexed.get(rollout_id, ()):
            raise conflict_error(rollout_id, call_id)  # put as an entry already
        if row["fingerprint"]:
            self._ledger_lookup.setdefault(rollout_id, []).append(row)
        rows.append(custody)

    def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str
    ) -> Coroutine[Any, Any, None]:
        """Keep a failure row (once per identical row); the arguments are checked when called."""
        check_failure_args(rollout_id, model_call_id, reason)
        return self._record_failure_job(rollout_id, model_call_id, reason)

    async def _record_failure_job(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        if rollout_id in self._retired:
            return  # the fence discards it
        row = {"model_call_id": model_call_id, "failure_reason": reason}
        rows = self._ledgers.setdefault(rollout_id, [])
        if row not in rows:
            rows.append(row)

    def manifest(self, rollout_id: str) -> Coroutine[Any, Any, dict[str, Any]]:
        """The rollout's ledger as `RolloutManifest` wire data (records and failures)."""
        validate_rollout_id(rollout_id)
        return self._manifest_job(rollout_id)

    async def _manifest_job(self, rollout_id: str) -> dict[str, Any]:
        if rollout_id in self._retired:
            raise retired_error(rollout_id)
        rows = [
            (index, json.dumps(row).encode())
            for index, row in enumerate(self._ledgers.get(rollout_id, ()))
        ]
        return manifest_from_rows(rollout_id, rows, Path(f"<memory>/{rollout_id}.lineage"))

    def has_rows(self, rollout_id: str) -> Coroutine[Any, Any, bool]:
        """Whether the rollout has ledger rows or indexed entries (NeMo Gym's rule)."""
        validate_rollout_id(rollout_id)
        return self._has_rows_job(rollout_id)

    async def _has_rows_job(self, rollout_id: str) -> bool:
        if rollout_id in self._retired:
            raise retired_error(rollout_id)
        return bool(self._ledgers.get(rollout_id)) or bool(self._indexed.get(rollout_id))

    def _forget(self, rollout_ids: list[str]) -> list[str]:
        """Forget the rollouts' entries and rows; the ids that had any."""
        removed, _ = self._native.delete(rollout_ids)
        had = set(removed)
        for rollout_id in rollout_ids:
            self._seen.pop(rollout_id, None)
            self._ledger_lookup.pop(rollout_id, None)
            self._indexed.pop(rollout_id, None)
            if self._ledgers.pop(rollout_id, None):
                had.add(rollout_id)
        return [rollout_id for rollout_id in rollout_ids if rollout_id in had]

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Fence rollouts, then forget their rows and entries (`FileCaptureLedger.retire`'s
        rules: `removed` lists the rollouts that held rows or entries, `absent` the others;
        retiring again is a no-op reporting every id as absent)."""
        ids = validate_rollout_ids(rollout_ids)
        self._retired.update(ids)
        had = set(self._forget(ids))
        return {
            "removed": [rollout_id for rollout_id in ids if rollout_id in had],
            "absent": [rollout_id for rollout_id in ids if rollout_id not in had],
        }

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`retire_now` when awaited; the batch is validated when this is called."""
        return self._retire_job(validate_rollout_ids(rollout_ids))

    async def _retire_job(self, rollout_ids: list[str]) -> RolloutRemovalPayload:
        return self.retire_now(rollout_ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Forget rollouts and their fences, so a reused id starts empty (`removed`: the
        rollouts that held rows, entries or a fence)."""
        ids = validate_rollout_ids(rollout_ids)
        had = set(self._forget(ids))
        for rollout_id in ids:
            if rollout_id in self._retired:
                self._retired.discard(rollout_id)
                had.add(rollout_id)
        return {
            "removed": [rollout_id for rollout_id in ids if rollout_id in had],
            "absent": [rollout_id for rollout_id in ids if rollout_id not in had],
        }

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`delete_now` when awaited; the batch is validated when this is called."""
        return self._delete_job(validate_rollout_ids(rollout_ids))

    async def _delete_job(self, rollout_ids: list[str]) -> RolloutRemovalPayload:
        return self.delete_now(rollout_ids)

    def is_process_shared(self) -> bool:
        return False

    def stored_tokens(self) -> int:
        return self._native.stored_tokens()

    def rollout_count(self) -> int:
        return self._native.rollout_count()

    def cached_tokens(self) -> int:
        return self._native.cached_tokens()

    async def close(self) -> None:
        """Forget everything. Idempotent."""
        self._native.clear()
        self._seen.clear()
        self._ledgers.clear()
        self._ledger_lookup.clear()
        self._indexed.clear()
        self._retired.clear()


def encode_delta(entry: TokenEntry, parent: LineageResolution | LineageMatch) -> TokenEntry:
    """Return a copy of `entry` stamped with its RESOLVED parent, its prompt stored as a delta.

    When the prompt extends the parent's cumulative tokens exactly, the copy keeps only the
    suffix past them (`prompt_is_delta=True`); otherwise it keeps the full prompt. Either way
    `cum_len` and `digest` describe the full cumulative sequence (parent + suffix + generation, or
    prompt + generation), which is what a resolver rebuilds and verifies.
    """
    match = parent.match if isinstance(parent, LineageResolution) else parent
    if match is None:
        status = parent.status.value if isinstance(parent, LineageResolution) else "?"
        raise ValueError(f"encode_delta needs a RESOLVED lineage decision, got {status!r}")
    if entry.prompt_is_delta:
        raise ValueError(f"entry {entry.model_call_id!r} already stores its prompt as a delta")
    prefix = match.cumulative_token_ids
    prompt = entry.prompt_token_ids
    copy = entry.model_copy()
    if _core.tokens_extend(prefix, prompt):
        full = [*prompt, *entry.generation_token_ids]
        copy.prompt_token_ids = list(prompt[len(prefix) :])
        copy.prompt_is_delta = True
        return stamp_lineage(
            copy,
            match.model_call_id,
            parent_resolution=ParentResolutionStatus.RESOLVED,
            cumulative=full,
        )
    return stamp_lineage(
        copy, match.model_call_id, parent_resolution=ParentResolutionStatus.RESOLVED
    )
