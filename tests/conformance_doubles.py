"""Deliberately broken token-capture clients for the conformance suite's own tests.

Each double wraps a real `TokenCaptureStore` over a shared directory and breaks exactly one
contract, the way a plausible transport bug would. `BROKEN` maps each double to the check that
must catch it. State that a real backend would hold (what was put, which version was first seen)
lives in a `Backend` shared by every client made over the same directory, so fresh clients see
the same broken behaviour.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokencapture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from tokencapture.protocols import (
    LineageMatch,
    LineageResolution,
    LineageResolver,
    RolloutRemovalPayload,
    RolloutRetiredError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from tokencapture.records import ParentResolutionStatus, TokenEntry
from tokencapture.staging.records import CaptureLedgerCommit
from tokencapture.store import TokenCaptureStore, validate_rollout_id, validate_rollout_ids


@dataclass
class Backend:
    """One shared directory plus the extra state a broken transport keeps beside it."""

    root: str
    made: int = 0
    closed: int = 0
    put_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    first_versions: dict[str, int] = field(default_factory=dict)
    saved_entries: dict[str, list[TokenEntry]] = field(default_factory=dict)
    resolved_by_fingerprint: dict[tuple[str, str], LineageResolution] = field(default_factory=dict)


_BACKENDS: dict[str, Backend] = {}


def backend_for(root: str | os.PathLike[str]) -> Backend:
    """The backend of a directory (one per directory per process)."""
    key = os.fspath(root)
    return _BACKENDS.setdefault(key, Backend(key))


class StoreClient:
    """A faithful client: every call goes to the real store. Subclasses break one contract."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.store = TokenCaptureStore(backend.root)
        backend.made += 1
        self._closed = False

    async def put(self, entry: TokenEntry) -> None:
        await self.store.put(entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self.store.begin_call(rollout_id, model_call_id)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self.store.mark_incomplete(rollout_id, model_call_id)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return await self.store.freeze(rollout_id)

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        return await self.store.drop(rollout_id, snapshot_id, version)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return await self.store.retire(rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return await self.store.delete(rollout_ids)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.backend.closed += 1
        await self.store.close()


class LosesPut(StoreClient):
    """Acknowledges a put without storing it."""

    async def put(self, entry: TokenEntry) -> None:
        return None


class DuplicatesEntries(StoreClient):
    """An at-least-once transport that never dedupes: each acknowledged put is one more copy."""

    async def put(self, entry: TokenEntry) -> None:
        await self.store.put(entry)
        key = (entry.rollout_id, entry.model_call_id)
        self.backend.put_counts[key] = self.backend.put_counts.get(key, 0) + 1

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        snapshot = await self.store.freeze(rollout_id)
        copies = [
            entry
            for entry in snapshot.entries
            for _ in range(self.backend.put_counts.get((rollout_id, entry.model_call_id), 1))
        ]
        return dataclasses.replace(snapshot, entries=tuple(copies))


class IgnoresFreeze(StoreClient):
    """Acknowledges a write after freeze without storing it or bumping the version."""

    async def put(self, entry: TokenEntry) -> None:
        try:
            await self.store.put(entry)
        except TokenCaptureFrozenError as exc:
            if type(exc) is not TokenCaptureFrozenError:  # still honours the retire fence
                raise


class NeverBumpsOnMark(StoreClient):
    """Reports the version of the first freeze forever, so a mark after freeze is invisible."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        snapshot = await self.store.freeze(rollout_id)
        first = self.backend.first_versions.setdefault(rollout_id, snapshot.version)
        return dataclasses.replace(snapshot, version=first)

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        if version == self.backend.first_versions.get(rollout_id):
            version = (await self.store.freeze(rollout_id)).version
        return await self.store.drop(rollout_id, snapshot_id, version)


class DropIgnoresVersion(StoreClient):
    """Drops any snapshot with the right id, whatever changed since it was frozen."""

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        current = await self.store.freeze(rollout_id)
        return await self.store.drop(rollout_id, snapshot_id, current.version)


class NoFenceAfterRetire(StoreClient):
    """Retires by deleting: the records go, but so does the fence against late writes."""

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return await self.store.delete(rollout_ids)


class DeleteLeavesOldEntries(StoreClient):
    """Delete removes the fence but the old attempt's entries come back into the reused id."""

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        if not isinstance(rollout_ids, str):
            for rollout_id in rollout_ids:
                self.backend.saved_entries[rollout_id] = self.store.read_entries(rollout_id)
        return await self.store.retire(rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        payload = await self.store.delete(rollout_ids)
        for rollout_id in payload["removed"]:
            for entry in self.backend.saved_entries.pop(rollout_id, []):
                await self.store.put(entry)
        return payload


class ResolvesByFingerprintOnly:
    """A resolver cache keyed by the assistant fingerprint alone, ignoring the recorded context:
    once a fingerprint resolved, any request with that fingerprint gets the same parent."""

    def __init__(self, inner: LineageResolver, backend: Backend) -> None:
        self.inner = inner
        self.backend = backend

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        key = (rollout_id, assistant_fingerprint(request_items))
        resolution = await self.inner.resolve(rollout_id, request_items)
        if resolution.status is ParentResolutionStatus.RESOLVED:
            self.backend.resolved_by_fingerprint[key] = resolution
            return resolution
        return self.backend.resolved_by_fingerprint.get(key, resolution)

    def is_process_shared(self) -> bool:
        return self.inner.is_process_shared()

    async def close(self) -> None:
        await self.inner.close()


BROKEN: dict[str, tuple[Callable[[Backend], StoreClient], str]] = {
    "loses_put": (LosesPut, "put_then_freeze"),
    "duplicates_entries": (DuplicatesEntries, "idempotent_reput"),
    "ignores_freeze": (IgnoresFreeze, "write_after_freeze"),
    "never_bumps_on_mark": (NeverBumpsOnMark, "mark_incomplete_durable"),
    "no_fence_after_retire": (NoFenceAfterRetire, "retire_fences"),
    "drop_ignores_version": (DropIgnoresVersion, "conditional_drop"),
    "delete_leaves_old_entries": (DeleteLeavesOldEntries, "delete_allows_reuse"),
}
"""Each store double, and the check that must fail on it."""


def lossy_store(root: str) -> StoreClient:
    """A `module:factory` for the command line: a client over `root` that loses every put."""
    return LosesPut(backend_for(root))


# --- Capture ledgers ---------------------------------------------------------------------------


@dataclass
class LedgerBackend:
    """What a shared ledger service holds: rows per rollout and the fences of retired ones."""

    records: dict[str, dict[str, CaptureLedgerCommit]] = field(default_factory=dict)
    failures: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    fenced: set[str] = field(default_factory=set)
    record_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    made: int = 0
    closed: int = 0


class MemoryLedger:
    """A small, correct `CaptureLedger` client over a `LedgerBackend` (a test oracle for the
    ledger checks; the file ledger is the real implementation). Subclasses break one contract."""

    def __init__(self, backend: LedgerBackend) -> None:
        self.backend = backend
        backend.made += 1

    async def record(self, commit: CaptureLedgerCommit) -> None:
        rollout_id = validate_rollout_id(commit.rollout_id)
        if rollout_id in self.backend.fenced:
            return  # a late write of a retired rollout is discarded
        rows = self.backend.records.setdefault(rollout_id, {})
        existing = rows.get(commit.record.model_call_id)
        if existing is not None and existing != commit:
            raise ValueError(f"{commit.record.model_call_id!r} is recorded with other data")
        rows[commit.record.model_call_id] = commit

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        if validate_rollout_id(rollout_id) in self.backend.fenced:
            return
        rows = self.backend.failures.setdefault(rollout_id, [])
        if (model_call_id, reason) not in rows:
            rows.append((model_call_id, reason))

    def _readable(self, rollout_id: str) -> None:
        if validate_rollout_id(rollout_id) in self.backend.fenced:
            raise RolloutRetiredError(rollout_id)

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        self._readable(rollout_id)
        commits = self.backend.records.get(rollout_id, {}).values()
        failures = self.backend.failures.get(rollout_id, [])
        return {
            "schema_version": 2,
            "rollout_id": rollout_id,
            "records": [commit.record.model_dump(mode="json") for commit in commits],
            "failures": [
                {"schema_version": 2, "model_call_id": call_id, "reason": reason}
                for call_id, reason in failures
            ],
        }

    async def has_rows(self, rollout_id: str) -> bool:
        self._readable(rollout_id)
        return bool(self.backend.records.get(rollout_id) or self.backend.failures.get(rollout_id))

    def _remove(self, rollout_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        removed: list[str] = []
        absent: list[str] = []
        for rollout_id in validate_rollout_ids(rollout_ids):
            records = self.backend.records.pop(rollout_id, {})
            failures = self.backend.failures.pop(rollout_id, [])
            (removed if records or failures else absent).append(rollout_id)
        return removed, absent

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        removed, absent = self._remove(rollout_ids)
        self.backend.fenced.update(removed + absent)
        return {"removed": removed, "absent": absent}

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        ids = validate_rollout_ids(rollout_ids)
        fences = {rollout_id for rollout_id in ids if rollout_id in self.backend.fenced}
        removed, absent = self._remove(ids)
        self.backend.fenced.difference_update(ids)
        moved = [rollout_id for rollout_id in absent if rollout_id in fences]
        return {
            "removed": removed + moved,
            "absent": [rollout_id for rollout_id in absent if rollout_id not in fences],
        }

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        candidates = [
            commit
            for commit in self.backend.records.get(rollout_id, {}).values()
            if commit.record.fingerprint_version == FINGERPRINT_VERSION
            and assistant_fingerprint([*commit.request_items, *commit.response_items])
            == fingerprint
        ]
        context = candidates[0].request_items if len(candidates) == 1 else None
        if (
            context is None
            or len(context) > len(request_items)
            or conversation_digest(request_items[: len(context)]) != conversation_digest(context)
        ):
            return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="no_match")
        record = candidates[0].record
        match = LineageMatch(
            record.model_call_id,
            (),
            record.cumulative_hash,
            candidates[0].staging_chain,
            record.cum_len,
            record.chain_hash,
        )
        return LineageResolution(ParentResolutionStatus.RESOLVED, match)

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        self.backend.closed += 1


class LedgerLeaksTokens(MemoryLedger):
    """Puts the cumulative token ids into the manifest."""

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        manifest = await super().manifest(rollout_id)
        for record in manifest["records"]:
            record["cumulative_token_ids"] = list(range(record["cum_len"]))
        return manifest


class LedgerDuplicatesReplays(MemoryLedger):
    """Appends every record, so a replayed commit is listed twice."""

    async def record(self, commit: CaptureLedgerCommit) -> None:
        await super().record(commit)
        key = (commit.rollout_id, commit.record.model_call_id)
        self.backend.record_counts[key] = self.backend.record_counts.get(key, 0) + 1

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        manifest = await super().manifest(rollout_id)
        manifest["records"] = [
            record
            for record in manifest["records"]
            for _ in range(self.backend.record_counts.get((rollout_id, record["model_call_id"]), 1))
        ]
        return manifest


class LedgerDropsFailures(MemoryLedger):
    """Loses failure rows: finalization would accept a rollout with a missing call."""

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        return None


class LedgerWithoutFence(MemoryLedger):
    """Retires without a fence: a late record starts a new ledger for the retired rollout."""

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        removed, absent = self._remove(rollout_ids)
        return {"removed": removed, "absent": absent}


class LedgerDeleteKeepsFence(MemoryLedger):
    """Delete removes rows but leaves the fence, so the id can never be reused."""

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        removed, absent = self._remove(rollout_ids)
        return {"removed": removed, "absent": absent}


BROKEN_LEDGERS: dict[str, tuple[Callable[[LedgerBackend], MemoryLedger], str]] = {
    "leaks_tokens": (LedgerLeaksTokens, "ledger_round_trip"),
    "duplicates_replays": (LedgerDuplicatesReplays, "ledger_replay_and_conflict"),
    "drops_failures": (LedgerDropsFailures, "ledger_failure_rows"),
    "without_fence": (LedgerWithoutFence, "ledger_fence_after_retire"),
    "delete_keeps_fence": (LedgerDeleteKeepsFence, "ledger_reuse_after_delete"),
}
"""Each ledger double, and the check that must fail on it."""


# --- Doubles for the gaps a review found -----------------------------------------------------


class ProcessLocalStore(StoreClient):
    """Correct in one process, invisible to every other: its data lives where only this
    process looks (a per-process directory standing in for process memory)."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.store = TokenCaptureStore(os.path.join(backend.root, f"pid-{os.getpid()}"))


class AcceptsRebuiltEntries(StoreClient):
    """Judges "same payload" by the token ids only: a re-put with other log-probs is taken
    for a retry and acknowledged, the first payload kept and the rollout left complete."""

    async def put(self, entry: TokenEntry) -> None:
        for held in self.store.read_entries(entry.rollout_id):
            if held.model_call_id == entry.model_call_id and (
                list(held.prompt_token_ids),
                list(held.generation_token_ids),
            ) == (list(entry.prompt_token_ids), list(entry.generation_token_ids)):
                return
        await self.store.put(entry)


class FreezeIgnoresRetire(StoreClient):
    """Freezing a retired rollout answers an empty snapshot instead of the retired error."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        try:
            return await self.store.freeze(rollout_id)
        except TokenCaptureRetiredError:
            return TokenCaptureSnapshot(rollout_id, (), False, "retired", 0)


class MarkAfterRetireSwallowed(StoreClient):
    """A failure mark into a retired rollout reports success (and stores nothing)."""

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        try:
            await self.store.mark_incomplete(rollout_id, model_call_id)
        except TokenCaptureRetiredError:
            return None


class BareRuntimeErrorWhenFrozen(StoreClient):
    """Refuses a write after freeze with a bare RuntimeError, as NeMo Gym 0.7.0's file store
    does, not with TokenCaptureFrozenError."""

    async def put(self, entry: TokenEntry) -> None:
        try:
            await self.store.put(entry)
        except TokenCaptureFrozenError as exc:
            raise RuntimeError(str(exc)) from None


class KeywordOnlyDrop(StoreClient):
    """Correct, with ``drop``'s snapshot arguments keyword-only (NeMo Gym 0.7.0's signature)."""

    async def drop(  # type: ignore[override]
        self, rollout_id: str, *, snapshot_id: str, version: int
    ) -> bool:
        return await self.store.drop(rollout_id, snapshot_id, version)


class WithoutRemoval:
    """Correct sink and source without the optional retire and delete (a transport written to
    NeMo Gym 0.7.0's TokenSource, which has neither)."""

    def __init__(self, backend: Backend) -> None:
        client = StoreClient(backend)
        self.put, self.begin_call = client.put, client.begin_call
        self.mark_incomplete, self.freeze = client.mark_incomplete, client.freeze
        self.drop, self.close = client.drop, client.close


class ResolvesAcrossRollouts:
    """A resolver that, finding nothing in the rollout asked, looks in every other rollout of
    the directory and returns a parent from there."""

    def __init__(self, root: str) -> None:
        from tokencapture.lineage import FileLineageStore

        self.root = root
        self.inner = FileLineageStore(root)

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        resolution = await self.inner.resolve(rollout_id, request_items)
        if resolution.status is not ParentResolutionStatus.UNRESOLVED:
            return resolution
        rollouts = {name.removesuffix(".tokens.jsonl") for name in os.listdir(self.root)}
        for other in sorted(rollouts - {rollout_id}):
            if validate_rollout_id_or_none(other):
                found = await self.inner.resolve(other, request_items)
                if found.status is ParentResolutionStatus.RESOLVED:
                    return found
        return resolution

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        await self.inner.close()


def validate_rollout_id_or_none(name: str) -> bool:
    try:
        validate_rollout_id(name)
    except ValueError:
        return False
    return True


BROKEN.update(
    {
        "process_local": (ProcessLocalStore, "visible_across_processes"),
        "accepts_rebuilt_entries": (AcceptsRebuiltEntries, "conflicting_reput_fails_closed"),
        "freeze_ignores_retire": (FreezeIgnoresRetire, "retire_fences"),
        "mark_after_retire_swallowed": (MarkAfterRetireSwallowed, "retire_fences"),
    }
)


def double_client(name: str, root: str) -> Any:
    """A `process_factory`: the double `name` of `BROKEN` (or "faithful") over `root`."""
    make = StoreClient if name == "faithful" else BROKEN[name][0]
    return make(backend_for(root))


class KeepsOnlyLastRecord(MemoryLedger):
    """Each record replaces the rollout's rows (a put-not-append bug): earlier calls vanish."""

    async def record(self, commit: CaptureLedgerCommit) -> None:
        await super().record(commit)
        rows = self.backend.records[commit.rollout_id]
        for call_id in [key for key in rows if key != commit.record.model_call_id]:
            del rows[call_id]


class LedgerResolvesAcrossRollouts(MemoryLedger):
    """Resolves in any rollout when the one asked has no parent."""

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        resolution = await super().resolve(rollout_id, request_items)
        if resolution.status is ParentResolutionStatus.UNRESOLVED:
            for other in list(self.backend.records):
                found = await super().resolve(other, request_items)
                if found.status is ParentResolutionStatus.RESOLVED:
                    return found
        return resolution


class LedgerWithoutRemoval(MemoryLedger):
    """A correct ledger without the optional retire and delete (NeMo Gym's in-memory store)."""

    retire = None  # type: ignore[assignment]
    delete = None  # type: ignore[assignment]


BROKEN_LEDGERS.update(
    {
        "keeps_only_last_record": (KeepsOnlyLastRecord, "ledger_round_trip"),
        "resolves_across_rollouts": (LedgerResolvesAcrossRollouts, "ledger_round_trip"),
    }
)
