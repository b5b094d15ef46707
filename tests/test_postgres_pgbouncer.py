"""The PostgreSQL backend behind PgBouncer in transaction mode, configured as docs/postgres.md
says: two server connections shared by every client, startup parameters PgBouncer cannot
pass on ignored, no prepared statements kept (PgBouncer 1.18 cannot track them)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.pg_server import PgBouncer, PgServer, PgServerUnavailable
from tests.postgres_fixture import execute, fetch, pg_dsn, pg_server, unavailable
from tests.staging_backends import chain
from tests.test_conformance import CHECKS

from tokencapture.conformance import run_conformance
from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresDurabilityError,
    PostgresLineageStore,
    PostgresStagingStore,
    PostgresTokenCaptureStore,
    PostgresUnavailableError,
    install_schema_sync,
)
from tokencapture.protocols import TokenCaptureRetiredError

__all__ = ["pg_dsn", "pg_server"]  # the fixtures, imported for pytest

# What PgBouncer before 1.21 needs from the client: no named prepared statements.
BEHIND_PGBOUNCER = {"statement_cache_size": 0}


@pytest.fixture(scope="module")
def bouncer(pg_server: PgServer) -> Iterator[PgBouncer]:
    try:
        pool = PgBouncer(pg_server, pool_size=2)
        pool.start()
    except (PgServerUnavailable, OSError) as exc:
        unavailable(str(exc))
        raise
    try:
        yield pool
    finally:
        pool.stop()


def through(bouncer: PgBouncer, dsn: str) -> str:
    """The DSN of `dsn`'s database through PgBouncer."""
    return bouncer.dsn_for(dsn.rsplit("/", 1)[1])


def test_store_lineage_and_ledger_pass_conformance_through_pgbouncer(
    bouncer: PgBouncer, pg_dsn: str
) -> None:
    install_schema_sync(pg_dsn)
    dsn = through(bouncer, pg_dsn)

    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(dsn, **BEHIND_PGBOUNCER),
            lambda: PostgresTokenCaptureStore(dsn, **BEHIND_PGBOUNCER),
            lambda: PostgresLineageStore(dsn, **BEHIND_PGBOUNCER),
            lambda: PostgresCaptureLedger(dsn, **BEHIND_PGBOUNCER),
            process_factory=functools.partial(PostgresTokenCaptureStore, dsn, **BEHIND_PGBOUNCER),
        )

    assert asyncio.run(run()) == list(CHECKS)


def test_many_clients_on_two_server_connections_keep_every_put_and_the_fence(
    bouncer: PgBouncer, pg_dsn: str
) -> None:
    """120 concurrent puts from three stores share PgBouncer's two server sessions; every put
    that returned is in its snapshot, and after retire returns no put lands."""
    install_schema_sync(pg_dsn)
    dsn = through(bouncer, pg_dsn)
    entries = [
        make_entry(rollout_id=f"r{i % 4}", model_call_id=f"c{i}", prompt_token_ids=[i] * 50)
        for i in range(120)
    ]
    late = make_entry(rollout_id="fenced", model_call_id="late")

    async def run() -> None:
        stores = [PostgresTokenCaptureStore(dsn, **BEHIND_PGBOUNCER) for _ in range(3)]
        await asyncio.gather(*(stores[i % 3].put(entry) for i, entry in enumerate(entries)))
        for r in range(4):
            snapshot = await stores[r % 3].freeze(f"r{r}")
            expected = {e.model_call_id for e in entries if e.rollout_id == f"r{r}"}
            assert {e.model_call_id for e in snapshot.entries} == expected
        await stores[0].put(make_entry(rollout_id="fenced", model_call_id="early"))
        assert (await stores[1].retire(["fenced"]))["removed"] == ["fenced"]
        results = await asyncio.gather(*(s.put(late) for s in stores), return_exceptions=True)
        assert all(isinstance(result, TokenCaptureRetiredError) for result in results), results
        for store in stores:
            await store.close()

    asyncio.run(run())
    count = "SELECT count(*) AS n FROM tokencapture.entries WHERE rollout_id = 'fenced'"
    assert fetch(pg_dsn, count)[0]["n"] == 0


def test_the_session_check_reads_the_database_setting_through_pgbouncer(
    bouncer: PgBouncer, pg_dsn: str
) -> None:
    """PgBouncer drops the store's `synchronous_commit` startup parameter; the session check
    still refuses a server session that would acknowledge unflushed commits."""
    install_schema_sync(pg_dsn)
    database = pg_dsn.rsplit("/", 1)[1]
    execute(pg_dsn, f"ALTER DATABASE {database} SET synchronous_commit = off")
    store = PostgresTokenCaptureStore(through(bouncer, pg_dsn), **BEHIND_PGBOUNCER)
    with pytest.raises(PostgresDurabilityError, match="synchronous_commit=off"):
        store.append(make_entry())
    store.close_sync()
    assert fetch(pg_dsn, "SELECT count(*) AS n FROM tokencapture.entries")[0]["n"] == 0


def test_a_pgbouncer_that_refuses_the_startup_parameters_is_named_with_the_fix(
    pg_server: PgServer, pg_dsn: str
) -> None:
    install_schema_sync(pg_dsn)
    strict = PgBouncer(pg_server, ignore_startup_parameters=False)
    strict.start()
    try:
        store = PostgresTokenCaptureStore(
            strict.dsn_for(pg_dsn.rsplit("/", 1)[1]), connect_timeout=2, **BEHIND_PGBOUNCER
        )
        with pytest.raises(PostgresUnavailableError) as refused:
            store.append(make_entry())
        store.close_sync()
    finally:
        strict.stop()
    message = str(refused.value)
    assert "unsupported startup parameter" in message
    assert "ignore_startup_parameters = statement_timeout,synchronous_commit" in message


def test_native_staging_through_pgbouncer_in_transaction_mode(
    bouncer: PgBouncer,
    pg_dsn: str,
) -> None:
    """The native group commit's sessions through PgBouncer (two server connections shared in
    transaction mode): it refuses the `options` startup parameter, so the session settings are
    the role's (checked); each batch is one unnamed statement, nothing prepared is kept."""
    install_schema_sync(pg_dsn)
    dsn = through(bouncer, pg_dsn)
    stores = [
        PostgresStagingStore(dsn, native_group_commit=True, stage_flushes=2, **BEHIND_PGBOUNCER)
        for _ in range(2)
    ]
    records = [chain(f"b{t}", 15, size=32) for t in range(12)]
    results: list[list[Any]] = [[] for _ in records]

    def stage(t: int) -> None:
        results[t] = [stores[t % 2].stage(r) for r in records[t]]

    try:
        threads = [threading.Thread(target=stage, args=(t,)) for t in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(r.ok for per in results for r in per), [
            r.error for per in results for r in per if not r.ok
        ][:3]
        for store in stores:
            assert store.native_group_commit, store.native_fallback_reason
        assert sum(store._native.stats()[1] for store in stores if store._native) == 180
        keys = [r.staging_key for per in records for r in per]
        assert len(stores[0].fetch(keys)) == 180
    finally:
        for store in stores:
            store.close()
