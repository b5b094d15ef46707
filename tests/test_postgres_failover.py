"""Failover as docs/postgres.md prescribes it: a synchronous standby, promoted after the primary
is SIGKILLed in the middle of a workload, has every put the store acknowledged.

The check is not vacuous: with an asynchronous standby whose WAL receiver was stopped for the
workload, the same test finds acknowledged puts missing after the promotion (tried by hand).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from tests.conftest import make_entry
from tests.pg_server import PgServer, PgServerUnavailable
from tests.postgres_fixture import fetch, unavailable

from tokencapture.postgres import (
    PostgresTokenCaptureStore,
    PostgresUnavailableError,
    install_schema_sync,
)


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[PgServer, PgServer]]:
    """A primary and a streaming standby it waits for on every commit."""
    servers: list[PgServer] = []
    try:
        primary = PgServer()
        servers.append(primary)
        primary.start()
        standby = PgServer(standby_of=primary, name="standby1")
        servers.append(standby)
        standby.start()
        fetch(primary.dsn, "ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
        fetch(primary.dsn, "SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        query = "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'"
        while [row["sync_state"] for row in fetch(primary.dsn, query)] != ["sync"]:
            if time.monotonic() > deadline:
                raise PgServerUnavailable("the standby did not become synchronous in 30 s")
            time.sleep(0.1)
    except (PgServerUnavailable, OSError) as exc:
        for server in servers:
            server.cleanup()
        unavailable(str(exc))
        raise
    try:
        yield primary, standby
    finally:
        for server in servers:
            server.cleanup()


def test_a_promoted_synchronous_standby_has_every_acknowledged_put(
    primary_and_standby: tuple[PgServer, PgServer],
) -> None:
    primary, standby = primary_and_standby
    install_schema_sync(primary.dsn)
    entries = [
        make_entry(rollout_id=f"r{i % 8}", model_call_id=f"c{i}", prompt_token_ids=[i] * 200)
        for i in range(2000)
    ]
    acknowledged: list[int] = []

    async def write() -> None:
        store = PostgresTokenCaptureStore(primary.dsn, connect_timeout=2, statement_timeout=5)
        loop = asyncio.get_running_loop()
        killed: asyncio.Future[None] | None = None

        async def put(i: int) -> None:
            nonlocal killed
            try:
                await store.put(entries[i])
            except PostgresUnavailableError:
                return  # maybe committed: whole or absent on the standby
            acknowledged.append(i)
            if len(acknowledged) == 300 and killed is None:
                killed = loop.run_in_executor(None, primary.kill)

        for start in range(0, len(entries), 50):
            await asyncio.gather(*(put(i) for i in range(start, start + 50)))
            if killed is not None and killed.done():
                break
        assert killed is not None
        await killed
        await store.close()

    asyncio.run(write())
    assert len(acknowledged) >= 300
    standby.promote()
    survivor = PostgresTokenCaptureStore(standby.dsn)
    try:
        stored = {
            entry.model_call_id: entry for r in range(8) for entry in survivor.read_entries(f"r{r}")
        }
        assert {entries[i].model_call_id for i in acknowledged} <= stored.keys()
        for call_id, entry in stored.items():  # acknowledged or not: whole, byte for byte
            assert entry == entries[int(call_id[1:])]
        survivor.append(make_entry(rollout_id="after", model_call_id="promoted"))
        assert len(survivor.freeze_now("after").entries) == 1
    finally:
        survivor.close_sync()
