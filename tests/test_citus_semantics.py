"""Semantics unchanged on the Citus cluster: the conformance suite of every PostgreSQL class
(store, lineage resolver, ledger) and the differential state machine against the file store
(tests/test_postgres_store.py's `StoresAgree`, the same rules) run on the coordinator of a real
coordinator + two workers cluster, with the schema distributed by `tokencapture db init`."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, settings
from tests.citus_fixture import citus_cluster, citus_db, citus_dsn
from tests.conftest import make_entry
from tests.test_conformance import LEDGER_CHECKS, LINEAGE_CHECKS, STORE_CHECKS
from tests.test_postgres_store import StoresAgree, _Shared

from tokencapture.conformance import run_conformance
from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresLineageStore,
    PostgresTokenCaptureStore,
)

__all__ = ["citus_cluster", "citus_db", "citus_dsn"]


def test_store_and_ledger_conformance_on_the_cluster(citus_dsn: str) -> None:
    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(citus_dsn),
            lambda: PostgresTokenCaptureStore(citus_dsn),
            ledger_factory=lambda: PostgresCaptureLedger(citus_dsn),
        )

    assert asyncio.run(run()) == STORE_CHECKS + LEDGER_CHECKS


def test_lineage_conformance_on_the_cluster(citus_dsn: str) -> None:
    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(citus_dsn),
            lambda: PostgresTokenCaptureStore(citus_dsn),
            lambda: PostgresLineageStore(citus_dsn),
        )

    assert asyncio.run(run()) == STORE_CHECKS + LINEAGE_CHECKS


def test_file_and_distributed_stores_agree(citus_dsn: str) -> None:
    _Shared.store = PostgresTokenCaptureStore(citus_dsn)
    _Shared.loop = asyncio.new_event_loop()
    try:
        StoresAgree.TestCase.settings = settings(
            max_examples=int(os.environ.get("TOKENCAPTURE_CITUS_SM_EXAMPLES", "25")),
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        StoresAgree.TestCase().runTest()
    finally:
        _Shared.loop.run_until_complete(_Shared.store.close())
        _Shared.loop.close()
        _Shared.store = _Shared.loop = None


def test_puts_are_sent_alone_on_a_distributed_schema(citus_dsn: str) -> None:
    """Concurrent puts on the cluster each take their own delegated call (no put_batch, which
    would run on the coordinator and span workers); their outcomes are the file store's."""
    store = PostgresTokenCaptureStore(citus_dsn)
    try:
        entries = [make_entry(f"alone-{r}", call=c) for r in range(4) for c in range(3)]

        async def run() -> None:
            await asyncio.gather(*(store.put(e) for e in entries))

        store._client.run_sync(run())
        assert store._client.distributed is True
        for r in range(4):
            assert store.freeze_now(f"alone-{r}").version == 4
    finally:
        store.close_sync()


def test_the_gateways_reads_and_conditional_mark_on_the_cluster(citus_dsn: str) -> None:
    """What the gateway asks of the store besides the contract (`mark_incomplete_if_open`,
    `call_state_async`, `read_entry_async`, `put_unless_stored`: a transaction on the
    coordinator) runs with the same outcomes as on one server."""
    store = PostgresTokenCaptureStore(citus_dsn)

    async def run() -> None:
        entry = make_entry("gw")
        await store.begin_call("gw", entry.model_call_id)
        await store.begin_call("gw", "lost")
        assert await store.put_unless_stored(entry) is False
        other = make_entry("gw", generation_log_probs=[-9.0, -9.0])
        assert await store.put_unless_stored(other) is True  # kept, nothing marked
        assert await store.put_unless_stored(entry) is False
        assert await store.read_entry_async("gw", entry.model_call_id) == entry
        assert await store.read_entry_async("gw", "lost") is None
        state = await store.call_state_async("gw")
        assert state == {"frozen": False, "retired": False, "calls_without_entry": ["lost"]}
        assert await store.call_state_async("nowhere") is None
        assert await store.mark_incomplete_if_open("gw", "lost") is True
        snapshot = await store.freeze("gw")
        assert await store.mark_incomplete_if_open("gw", "late") is False
        assert (await store.freeze("gw")).version == snapshot.version == 3
        assert await store.drop("gw", snapshot.snapshot_id, snapshot.version)

    try:
        store._client.run_sync(run())
        assert store._client.distributed is True
    finally:
        store.close_sync()


def test_a_put_over_the_citus_size_limit_is_refused_before_it_is_sent(citus_dsn: str) -> None:
    """On Citus a put reaches its worker as hex literals in a statement, and the worker's
    parser cannot hold a literal of 256 MiB of bytes: a put of a 257 MiB line failed there
    late ("invalid memory alloc request size"), after ~20 s. Once the store knows it is on
    Citus, a line over the Citus limit is refused when put is called, naming it (one real
    entry just over it)."""
    from tokencapture.postgres._client import argument_byte_limit

    limit = argument_byte_limit(True)
    assert limit == 268_173_312
    store = PostgresTokenCaptureStore(citus_dsn)
    try:
        store.append(make_entry("small"))  # the store knows it is on Citus
        big = make_entry("big", blob="x" * (limit + 1))
        with pytest.raises(
            ValueError, match=f"on a Citus cluster PostgreSQL takes at most {limit}"
        ):
            store.put(big)
        del big
        assert store.freeze_now("big").entries == ()
        assert len(store.freeze_now("small").entries) == 1
    finally:
        store.close_sync()


def test_the_first_put_of_a_citus_store_is_held_to_the_citus_limit(
    citus_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's first put, called before it knows it is on Citus (the single-server limit
    passed it), is refused once its connection says so, before it is sent (sync and async;
    the limits lowered: 4 MiB, so 1 MiB on Citus)."""
    import tokencapture.postgres.store as pg_store

    monkeypatch.setattr(pg_store, "_MAX_LINE_BYTES", 4 << 20)
    blob = "x" * (2 << 20)
    store = PostgresTokenCaptureStore(citus_dsn)
    try:
        with pytest.raises(
            ValueError, match=f"on a Citus cluster PostgreSQL takes at most {1 << 20}"
        ):
            store.append(make_entry("first", blob=blob))
        store.append(make_entry("first", call=2))
        assert [e.model_call_id for e in store.freeze_now("first").entries] == ["call-2"]
    finally:
        store.close_sync()

    async def first_async() -> None:
        other = PostgresTokenCaptureStore(citus_dsn)
        try:
            await other.put(make_entry("firsta", blob=blob))
        finally:
            await other.close()

    with pytest.raises(ValueError, match=f"on a Citus cluster PostgreSQL takes at most {1 << 20}"):
        asyncio.run(first_async())
