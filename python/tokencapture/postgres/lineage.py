"""`PostgresLineageStore`: request-time lineage over the entries a `PostgresTokenCaptureStore`
committed, in any process on any host.

The matcher is the one every resolver here shares (`tokencapture._core.MemoryLineage`, as
`InMemoryLineageStore` uses it): each resolve first fetches the rollout's lines committed past
this resolver's cursor (one function call; nothing when nothing is new) and indexes them, so a
put that has returned anywhere is visible to the next resolve, then resolves natively. A
retired rollout, or a deleted one whose id was reused, starts over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from tokencapture import _core
from tokencapture.forking import ProcessOwner, leak, renew_after_fork
from tokencapture.metrics import instrumented
from tokencapture.postgres._client import Client
from tokencapture.protocols import LineageResolution
from tokencapture.resolution import (
    DEFAULT_CACHED_ROLLOUTS,
    DEFAULT_CACHED_TOKENS,
    Prepared,
    prepare,
    resolve_prepared,
)
from tokencapture.validation import check_cache_limits, check_resolve_args

__all__ = ["PostgresLineageStore"]

# The new lines as rows, sent as they are read (see sql/004_lineage_rows.sql).
_NEW_LINES = "SELECT * FROM tokencapture.lineage_lines($1, $2, $3)"
# The native index never evicts on its own (this class evicts whole rollouts, LRU, and resets
# their cursors with them): an eviction the cursor did not see would hide committed calls.
_UNBOUNDED_TOKENS = 2**62


@instrumented("lineage", "postgres", {"resolve_now": "resolve", "resolve": "resolve"})
class PostgresLineageStore:
    """A `LineageResolver` over a PostgreSQL token capture database.

    Memory is bounded by `max_cached_rollouts` indexed rollouts (LRU) and `max_cached_tokens`
    tokens of materialized cumulative sequences. Connection options as for
    `PostgresTokenCaptureStore` (pool_size, connect_timeout, statement_timeout, ...).
    """

    def __init__(
        self,
        dsn: str,
        *,
        max_cached_rollouts: int = DEFAULT_CACHED_ROLLOUTS,
        max_cached_tokens: int = DEFAULT_CACHED_TOKENS,
        **options: Any,
    ) -> None:
        check_cache_limits(max_cached_rollouts, max_cached_tokens)
        self._client = Client(dsn, **options)
        self._max_rollouts = max_cached_rollouts
        self._max_tokens = max_cached_tokens
        self._native = self._new_index()
        # rollout id -> (incarnation, last seq indexed); LRU order.
        self._cursors: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")
        self._owner = ProcessOwner()

    def _new_index(self) -> _core.MemoryLineage:
        return _core.MemoryLineage(self._max_rollouts + 1, _UNBOUNDED_TOKENS, self._max_tokens)

    def _this_process(self) -> None:
        """In a forked child, on its first call: start over with an empty index of its own (the
        parent's, which another thread may have been updating at the fork, is leaked)."""
        self._owner.start_over_in_child(self._lock, self._start_over)

    def _start_over(self) -> None:
        leak(self._native, self._cursors)
        self._native = self._new_index()
        self._cursors = OrderedDict()

    def __repr__(self) -> str:
        return f"PostgresLineageStore({self._client.where!r})"

    async def _refresh(self, rollout_id: str) -> None:
        """Index the rollout's lines committed since the last refresh."""
        self._this_process()
        with self._lock:
            incarnation, after = self._cursors.get(rollout_id, (0, 0))
        rows = await self._client.fetch("rows", _NEW_LINES, rollout_id, incarnation, after)
        with self._lock:
            known = self._cursors.get(rollout_id)
            if not rows or rows[0]["retired"]:
                # Gone or fenced: nothing of it resolves (a fenced rollout has no entries).
                self._forget(rollout_id)
                return
            fresh = rows[0]["incarnation"]
            if known is not None and known[0] > fresh:
                return  # an older answer than one already applied
            lines = [row["line"] for row in rows if row["line"] is not None]
            if known is None or known[0] != fresh:
                self._forget(rollout_id)
            elif not lines or rows[-1]["seq"] <= known[1]:
                self._cursors.move_to_end(rollout_id)
                return  # nothing new (or a concurrent refresh applied it already)
            for line in lines:
                self._native.put(rollout_id, line)
            last_seq = rows[-1]["seq"] if lines else 0
            self._cursors[rollout_id] = (fresh, last_seq)
            self._cursors.move_to_end(rollout_id)
            while len(self._cursors) > self._max_rollouts:
                oldest, _ = self._cursors.popitem(last=False)
                self._native.delete([oldest])

    def _forget(self, rollout_id: str) -> None:
        self._cursors.pop(rollout_id, None)
        self._native.delete([rollout_id])

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """Return ROOT, RESOLVED with the verified parent, or UNRESOLVED with a reason. The
        arguments are checked, and the request items copied and fingerprinted (content the
        fingerprint refuses raises), when this is called (`TypeError` / `ValueError`)."""
        items = check_resolve_args(rollout_id, request_items)
        # A prepared job holds no index state: it resolves on whichever index `_refresh`
        # leaves (a forked child's own).
        return self._resolve(rollout_id, prepare(self._native, rollout_id, items))

    async def _resolve(self, rollout_id: str, prepared: Prepared) -> LineageResolution:
        await self._refresh(rollout_id)
        return resolve_prepared(self._native, rollout_id, prepared)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """Synchronous `resolve`."""
        return self._client.run_sync(self.resolve(rollout_id, request_items))

    def is_process_shared(self) -> bool:
        return True

    def cached_rollouts(self) -> int:
        self._this_process()
        return len(self._cursors)

    def cached_tokens(self) -> int:
        self._this_process()
        return self._native.cached_tokens()

    async def close(self) -> None:
        """Close the connections and drop the caches (idempotent)."""
        await self._client.close()
        self._this_process()
        with self._lock:
            self._cursors.clear()
            self._native.clear()

    def close_sync(self) -> None:
        self._client.close_sync()
        self._this_process()
        with self._lock:
            self._cursors.clear()
            self._native.clear()
