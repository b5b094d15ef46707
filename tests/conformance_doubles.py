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
