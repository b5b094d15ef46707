"""The store, resolver and failure ledger behind a gateway: a directory or a PostgreSQL DSN.

The gateway writes only through the project's stores (`TokenCaptureStore` or
`PostgresTokenCaptureStore` for entries and intents, `FileLineageStore` or
`PostgresLineageStore` to resolve parents, `FileCaptureLedger` or `PostgresCaptureLedger` for
the reason of a call that did not capture); durability is theirs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from tokencapture.lineage import FileLineageStore
from tokencapture.protocols import LineageResolution
from tokencapture.records import TokenEntry
from tokencapture.rollout_files import complete_lines
from tokencapture.store import TokenCaptureStore

__all__ = ["Backend", "open_backend"]

logger = logging.getLogger("tokencapture.gateway")


class _Store(Protocol):
    def begin_call(self, rollout_id: str, model_call_id: str) -> Any: ...
    def put(self, entry: TokenEntry) -> Any: ...
    def put_unless_stored(self, entry: TokenEntry) -> Any: ...
    def mark_incomplete_if_open(self, rollout_id: str, model_call_id: str = "") -> Any: ...
    async def close(self) -> None: ...


class _Resolver(Protocol):
    def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any: ...
    async def close(self) -> None: ...


class _Ledger(Protocol):
    def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> Any: ...
    async def close(self) -> None: ...


@dataclass
class Backend:
    """One store, its resolver and its capture ledger, over one directory or database."""

    store: _Store
    resolver: _Resolver
    ledger: _Ledger
    kind: str  # "file" or "postgres"
    location: str

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, unless_stored: bool = False
    ) -> bool:
        """The call's durable intent; with `unless_stored`, none when the store already holds
        the call's entry (then True). A directory store checks and writes in one step under
        the rollout's lock; over PostgreSQL one primary-key lookup comes first."""
        store: Any = self.store
        if not unless_stored:
            await store.begin_call(rollout_id, model_call_id)
            return False
        if self.kind == "postgres":
            if await store.read_entry_async(rollout_id, model_call_id) is not None:
                return True
            await store.begin_call(rollout_id, model_call_id)
            return False
        stored: bool = await store.begin_call_unless_stored(rollout_id, model_call_id)
        return stored

    async def put(self, entry: TokenEntry, *, unless_stored: bool = False) -> bool:
        """Store the entry; with `unless_stored`, not when the store already holds another
        entry under its call id (another attempt of the call, through another gateway
        process, stored first): then True, and nothing is written or marked (the check and the
        write one step, under the rollout's lock, or its row lock)."""
        store: Any = self.store
        if unless_stored:
            kept: bool = await store.put_unless_stored(entry)
            return kept
        await store.put(entry)
        return False

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        resolution: LineageResolution = await self.resolver.resolve(rollout_id, request_items)
        return resolution

    async def stored_entry(self, rollout_id: str, model_call_id: str) -> TokenEntry | None:
        """The entry the store holds for this call id (a retry of a call whose answer was
        lost), or None: over PostgreSQL one primary-key lookup, over a directory the rollout's
        entries read in a thread (asked only once `begin_call(unless_stored=True)` found it)."""
        store: Any = self.store
        if self.kind == "postgres":
            entry: TokenEntry | None = await store.read_entry_async(rollout_id, model_call_id)
            return entry
        try:
            entries = await asyncio.to_thread(store.read_entries, rollout_id)
        except LookupError:  # retired meanwhile: nothing to answer from
            return None
        return next((e for e in entries if e.model_call_id == model_call_id), None)

    async def fail(
        self, rollout_id: str, model_call_id: str, reason: str, *, mark: bool = True
    ) -> None:
        """Mark the call incomplete (the rollout is masked at freeze) and record why; with
        `mark=False` only record why (the ledger's failure row).

        Never raises: it runs on error paths, where the caller answers with the first error.
        """
        if mark:
            try:
                # Unless the rollout is frozen or retired: then the call was in flight when the
                # trainer froze it, and the freeze already judged it (its intent has no entry,
                # so the snapshot is incomplete); a mark now would only move the snapshot's
                # version, and the trainer's `drop` of it would fail. Both stores check and
                # mark at once (under the rollout's lock, or its row lock).
                await self.store.mark_incomplete_if_open(rollout_id, model_call_id)
            except OSError as exc:  # the store's own words say what and why: no traceback
                logger.warning(
                    "could not mark call %r of %r incomplete: %s", model_call_id, rollout_id, exc
                )
            except Exception:
                logger.exception(
                    "could not mark call %r of %r incomplete", model_call_id, rollout_id
                )
        try:
            await self.ledger.record_failure(rollout_id, model_call_id, reason)
        except OSError as exc:
            logger.warning(
                "could not record the failure of call %r of %r: %s", model_call_id, rollout_id, exc
            )
        except Exception:
            logger.exception(
                "could not record the failure of call %r of %r", model_call_id, rollout_id
            )

    async def entries(self, rollout_id: str) -> tuple[list[TokenEntry], bool]:
        """The rollout's committed entries and its incomplete flag (for the operator summary)."""
        store: Any = self.store
        if self.kind == "file":
            entries = await asyncio.to_thread(store.read_entries, rollout_id)
            incomplete = await asyncio.to_thread(store.is_incomplete, rollout_id)
        else:
            entries = await store.read_entries_async(rollout_id)
            incomplete = await store.is_incomplete_async(rollout_id)
        return list(entries), bool(incomplete)

    async def state(self, rollout_id: str) -> dict[str, Any]:
        """For the operator summary: `{"state": "open" | "frozen" | "retired" | "empty",
        "intents": [call ids with a durable intent]}` (over PostgreSQL only those without an
        entry: the database leaves the others out)."""
        store: Any = self.store
        if self.kind == "postgres":
            found = await store.call_state_async(rollout_id)
            if found is None:
                return {"state": "empty", "intents": []}
            return {
                "state": _state_name(found["frozen"], found["retired"]),
                "intents": found["calls_without_entry"],
            }

        def read() -> dict[str, Any]:
            found = store.inspect(rollout_id)
            if found is None:
                return {"state": "empty", "intents": []}
            lines = complete_lines(store.intents_path_for(rollout_id))
            intents = [line.decode("utf-8", "replace") for line in lines if line]
            return {"state": _state_name(found["frozen"], found["retired"]), "intents": intents}

        return await asyncio.to_thread(read)

    async def close(self) -> None:
        for part in (self.store, self.resolver, self.ledger):
            try:
                await part.close()
            except Exception:  # pragma: no cover - closing is best effort
                logger.exception("closing %r failed", part)


def _state_name(frozen: object, retired: object) -> str:
    return "retired" if retired else "frozen" if frozen else "open"


def open_backend(
    *, store_dir: str | os.PathLike[str] | None = None, dsn: str | None = None, **pg_options: Any
) -> Backend:
    """A `Backend` over a store directory or a `postgresql://` DSN (exactly one of them)."""
    if (store_dir is None) == (dsn is None):
        raise ValueError("give exactly one of store_dir (a directory) or dsn (postgresql://...)")
    if store_dir is not None:
        from tokencapture.ledger import FileCaptureLedger

        root = os.fspath(store_dir)
        return Backend(
            TokenCaptureStore(root), FileLineageStore(root), FileCaptureLedger(root), "file", root
        )
    from tokencapture.postgres import (
        PostgresCaptureLedger,
        PostgresLineageStore,
        PostgresTokenCaptureStore,
    )

    assert dsn is not None
    return Backend(
        PostgresTokenCaptureStore(dsn, **pg_options),
        PostgresLineageStore(dsn, **pg_options),
        PostgresCaptureLedger(dsn, **pg_options),
        "postgres",
        dsn,
    )
