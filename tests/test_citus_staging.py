"""PostgresStagingStore on the Citus cluster (a coordinator and two workers): staged calls live on
the worker that owns their rollout, stages are delegated there, a retire batch across workers is
all or nothing; the workers' synchronous_commit is checked; the token store's sweep_retired
(which locks many rollouts) works distributed."""

from __future__ import annotations

import functools
import secrets
import threading
from typing import Any

import pytest
from tests.citus_fixture import citus_cluster, citus_db, citus_dsn, fresh_citus_database
from tests.conftest import make_entry
from tests.pg_server import CitusCluster
from tests.postgres_fixture import fetch
from tests.staging_backends import chain, make_record

from tokencapture import StagingKeyError, StagingKeyRetiredError
from tokencapture.postgres import (
    PostgresDurabilityError,
    PostgresStagingStore,
    PostgresTokenCaptureStore,
    install_schema_sync,
)
from tokencapture.postgres import staging as pg_staging

__all__ = ["citus_cluster", "citus_db", "citus_dsn"]


def rollouts_on_each_worker(cluster: CitusCluster, database: str, count: int) -> list[str]:
    """`count` rollout ids per worker (by Citus's own placement of the staging table)."""
    found: dict[int, list[str]] = {worker.port: [] for worker in cluster.workers}
    n = 0
    while any(len(ids) < count for ids in found.values()):
        rollout_id = f"r{n}"
        node = cluster.node_of(database, "tokencapture.staged_calls", rollout_id)
        if len(found[node.port]) < count:
            found[node.port].append(rollout_id)
        n += 1
    return [rollout_id for ids in found.values() for rollout_id in ids]


def test_staging_tables_are_distributed_with_the_store(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    name, _ = citus_db
    rows = fetch(
        citus_dsn,
        "SELECT logicalrelid::text AS t, colocationid, "
        "column_to_column_name(logicalrelid, partkey) AS col FROM pg_dist_partition "
        "WHERE logicalrelid::text IN ('tokencapture.staged_calls', "
        "'tokencapture.staging_rollouts', 'tokencapture.rollouts')",
    )
    assert {row["t"]: row["col"] for row in rows} == {
        "tokencapture.staged_calls": "rollout_id",
        "tokencapture.staging_rollouts": "rollout_id",
        "tokencapture.rollouts": "rollout_id",
    }
    assert len({row["colocationid"] for row in rows}) == 1
    delegated = fetch(
        citus_dsn,
        "SELECT p.proargnames[d.distribution_argument_index + 1] AS arg FROM pg_dist_object d "
        "JOIN pg_proc p ON p.oid = d.objid WHERE p.proname = 'stage_call'",
    )
    assert [row["arg"] for row in delegated] == ["p_rollout"]
    # A staged call's row is on the worker Citus places its rollout on, and only there.
    store = PostgresStagingStore(citus_dsn)
    try:
        ids = rollouts_on_each_worker(citus_cluster, name, 1)
        for rollout_id in ids:
            assert store.stage(make_record(rollout_id)).ok
        for rollout_id in ids:
            owner = citus_cluster.node_of(name, "tokencapture.staged_calls", rollout_id)
            shard = citus_cluster.coordinator.psql(
                "SELECT get_shard_id_for_distribution_column('tokencapture.staged_calls', "
                f"'{rollout_id}')",
                name,
            ).strip()
            for worker in citus_cluster.workers:
                # The shard's own table (the distributed one would route the query anywhere).
                local = f"tokencapture.staged_calls_{shard}"
                found = worker.psql(f"SELECT to_regclass('{local}') IS NOT NULL", name).strip()
                if worker is not owner:
                    assert found == "f"
                    continue
                count = worker.psql(
                    f"SELECT count(*) FROM {local} WHERE rollout_id = '{rollout_id}'", name
                )
                assert count.strip() == "1"
    finally:
        store.close_sync()


def test_stage_fetch_retire_delete_across_workers(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    name, _ = citus_db
    ids = rollouts_on_each_worker(citus_cluster, name, 2)
    records = {rollout_id: chain(rollout_id, 3) for rollout_id in ids}
    store = PostgresStagingStore(citus_dsn)
    results: list[Any] = []

    def stage(rollout_id: str) -> None:
        results.extend(store.stage(record) for record in records[rollout_id])

    try:
        threads = [threading.Thread(target=stage, args=(r,)) for r in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results) == 3 * len(ids) and all(r.ok for r in results)
        keys = [
            record.staging_key for rollout_id in reversed(ids) for record in records[rollout_id]
        ]
        assert [s.staging_key for s in store.fetch(keys)] == keys
        fetched = store.fetch_records(keys[:1])[0]
        assert fetched.model_dump() == records[ids[-1]][0].model_dump()
        assert store.stage(records[ids[0]][0]).ok  # idempotent
        conflict = store.stage(make_record(ids[0], "c0", [9, 9]))
        assert not conflict.ok and "already staged with different content" in str(conflict.error)
        # One batch over both workers: every rollout fenced, all or nothing.
        batch = [ids[0], ids[-1], "absent-one"]
        assert store.retire(batch) == {"removed": [ids[0], ids[-1]], "absent": ["absent-one"]}
        for rollout_id in (ids[0], ids[-1]):
            refused = store.stage(make_record(rollout_id, "late"))
            assert not refused.ok and "is retired" in str(refused.error)
            with pytest.raises(StagingKeyRetiredError):
                store.fetch([records[rollout_id][0].staging_key])
        assert store.fetch([records[ids[1]][0].staging_key])[0].rollout_id == ids[1]
        assert store.delete([ids[0], ids[1]]) == {"removed": [ids[0], ids[1]], "absent": []}
        with pytest.raises(StagingKeyError):
            store.fetch([records[ids[0]][0].staging_key])
        assert store.stage(records[ids[0]][0]).ok
        assert sorted(store.keys()) == store.keys()
    finally:
        store.close_sync()


def test_a_worker_without_flushed_commits_is_refused(citus_cluster: CitusCluster) -> None:
    """Citus runs a delegated call under the worker's synchronous_commit, not the client's:
    the clients read the workers' setting and refuse one that is off."""
    name, dsn = fresh_citus_database(citus_cluster)
    install_schema_sync(dsn)
    worker = citus_cluster.workers[1]
    # On the worker's copy of the database (the test servers set it on the command line,
    # which ALTER SYSTEM does not override; a database setting does, for new sessions).
    worker.psql(f"ALTER DATABASE {name} SET synchronous_commit = off")
    try:
        staging = PostgresStagingStore(dsn)
        result = staging.stage(make_record())
        staging.close_sync()
        assert not result.ok
        assert result.error is not None
        assert result.error.startswith("PostgresDurabilityError: the Citus worker ")
        assert f":{worker.port} " in result.error
        tokens = PostgresTokenCaptureStore(dsn)
        with pytest.raises(PostgresDurabilityError, match="synchronous_commit=off"):
            tokens.append(make_entry("r"))
        tokens.close_sync()
        # Accepted when asked for.
        lax = PostgresStagingStore(dsn, allow_unflushed_commits=True)
        assert lax.stage(make_record()).ok
        lax.close_sync()
    finally:
        citus_cluster.drop_database(name)


def test_sweep_retired_on_the_cluster(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """The token store's sweep locks and deletes many rollouts' fences: on Citus too, across
    both workers, and only those old enough."""
    name, _ = citus_db
    ids = rollouts_on_each_worker(citus_cluster, name, 2)
    store = PostgresTokenCaptureStore(citus_dsn)
    try:
        for rollout_id in ids:
            store.append(make_entry(rollout_id))
        assert store.retire_now(ids)["removed"] == ids
        fetch(
            citus_dsn,
            "UPDATE tokencapture.rollouts SET retired_at = now() - interval '1 hour' "
            "WHERE rollout_id = ANY($1)",
            ids[:3],
        )
        assert store.sweep_retired_ids(600, dry_run=True) == sorted(ids[:3])
        assert store.sweep_retired(600) == 3
        assert store.sweep_retired_ids(0, dry_run=True) == [ids[3]]
        store.append(make_entry(ids[0], "again"))  # swept: the id is free again
        assert store.sweep_retired(-1) == 1
    finally:
        store.close_sync()


def test_staging_conformance_on_the_cluster(citus_dsn: str) -> None:
    from tokencapture.conformance import STAGING_CHECKS, run_staging_conformance

    factory = functools.partial(PostgresStagingStore, citus_dsn)
    assert tuple(run_staging_conformance(factory, process_factory=factory)) == STAGING_CHECKS


def test_an_in_doubt_transaction_on_a_worker_stalls_its_rollout_boundedly(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """What a worker crash between the two phases of a commit leaves: a prepared transaction
    holding a rollout's fence row, unknown to the coordinator's commit log. Made here by hand
    (a prepared transaction named as Citus names its own, with no coordinator record), so the
    state is exact rather than timed. A stage of that rollout waits for the coordinator's
    recovery pass (every 2 s on the test cluster; every minute by default), which aborts it,
    and then lands; with a statement timeout shorter than that, the stage fails in that time
    with the reason; other rollouts are not held up."""
    import asyncio
    import time

    import asyncpg

    name, _ = citus_db
    held, free = rollouts_on_each_worker(citus_cluster, name, 1)
    store = PostgresStagingStore(citus_dsn)
    impatient = PostgresStagingStore(citus_dsn, statement_timeout=0.5)
    try:
        assert store.stage(make_record(held, "c0")).ok
        worker = citus_cluster.node_of(name, "tokencapture.staging_rollouts", held)
        shard = citus_cluster.coordinator.psql(
            "SELECT get_shard_id_for_distribution_column('tokencapture.staging_rollouts', "
            f"'{held}')",
            name,
        ).strip()

        async def prepare(gid: str) -> None:
            connection = await asyncpg.connect(worker.dsn_for(name))
            try:
                await connection.execute("BEGIN")
                await connection.execute(
                    f"SELECT 1 FROM tokencapture.staging_rollouts_{shard} "
                    "WHERE rollout_id = $1 FOR UPDATE",
                    held,
                )
                await connection.execute(f"PREPARE TRANSACTION '{gid}'")
            finally:
                await connection.close()

        asyncio.run(prepare("citus_0_999999_1_1"))
        began = time.monotonic()
        timed_out = impatient.stage(make_record(held, "c1"))
        waited = time.monotonic() - began
        if timed_out.ok:  # the recovery pass ran first: make the state again
            asyncio.run(prepare("citus_0_999999_2_1"))
            began = time.monotonic()
            timed_out = impatient.stage(make_record(held, "c2"))
            waited = time.monotonic() - began
        assert not timed_out.ok
        assert str(timed_out.error).startswith("PostgresUnavailableError: ")
        assert waited < 5
        assert store.stage(make_record(free, "other")).ok  # the other worker is not held
        began = time.monotonic()
        assert store.stage(make_record(held, "c3")).ok
        assert time.monotonic() - began < 20  # at most a recovery interval or two
        prepared = worker.psql("SELECT count(*) FROM pg_prepared_xacts", name).strip()
        assert prepared == "0"
    finally:
        store.close()
        impatient.close()


def test_the_native_group_commit_leaves_a_citus_cluster_to_the_delegated_path(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """`native_group_commit=True` on Citus: each stage is still its own call delegated to its
    rollout's worker (a batch on the coordinator would tie its stages to every worker it
    spans); the store says why the native client is not used, and it closed it."""
    name, _ = citus_db
    store = PostgresStagingStore(citus_dsn, native_group_commit=True)
    try:
        ids = rollouts_on_each_worker(citus_cluster, name, 2)
        for rollout_id in ids:
            assert store.stage(make_record(rollout_id)).ok
        assert not store.native_group_commit
        assert store.native_fallback_reason is not None
        assert "Citus" in store.native_fallback_reason
        assert store.keys() == sorted(f"{rollout_id}/c1" for rollout_id in ids)
    finally:
        store.close()


def test_a_stage_over_the_citus_size_limit_is_refused_before_it_is_sent(citus_dsn: str) -> None:
    """On Citus the call reaches the worker as hex literals in a statement, and the worker's
    parser cannot hold a literal of 256 MiB of bytes: such a stage passed the single-server
    check (1 GiB - 1 MiB) and failed late on the worker ("invalid memory alloc request size").
    The Citus limit keeps 256 KiB below that; a stage over it is refused before it is sent,
    naming the limit (one real stage just over it: zero bytes, whose pages are never
    touched when it is refused)."""
    limit = pg_staging.stage_byte_limit(True)
    assert limit == pg_staging.stage_byte_limit(False) // 4 == 268_173_312
    assert pg_staging.stage_byte_limit(None) == pg_staging.stage_byte_limit(False)
    store = PostgresStagingStore(citus_dsn)
    try:
        assert store.stage(make_record("small", "c0")).ok  # the store knows it is on Citus
        result = store.stage(make_record("big", "c0"), attachments={"a": bytes(limit + 1)})
        assert not result.ok
        assert result.error.startswith("ValueError: "), result.error
        assert f"at most {limit} bytes" in result.error and "Citus" in result.error
        assert "Unavailable" not in result.error and "alloc" not in result.error
        assert store.keys("big") == []
    finally:
        store.close()


def test_the_first_stage_of_a_citus_store_is_held_to_the_citus_limit(
    citus_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's first stage, sent before it knows it is on Citus (the single-server limit
    passed it), is refused once the connection says so, before the stage is sent (sync and
    async; the limits lowered: 4 MiB, so 1 MiB on Citus)."""
    import asyncio

    monkeypatch.setattr(pg_staging, "_MAX_STAGE_BYTES", 4 << 20)
    limit = pg_staging.stage_byte_limit(True)
    assert limit == 1 << 20
    attachments = {"a": secrets.token_bytes(2 << 20)}
    store = PostgresStagingStore(citus_dsn)
    try:
        result = store.stage(make_record("first", "c0"), attachments=attachments)
        assert not result.ok and result.error.startswith("ValueError: "), result.error
        assert f"at most {limit} bytes" in result.error and "Citus" in result.error
        assert store.keys("first") == []
        assert store.stage(make_record("first", "c1"), attachments={"a": b"x" * 1000}).ok
    finally:
        store.close()

    async def first_async() -> Any:
        other = PostgresStagingStore(citus_dsn)
        try:
            return await other.astage(make_record("firsta", "c0"), attachments=attachments)
        finally:
            await other.aclose()

    result = asyncio.run(first_async())
    assert not result.ok and f"at most {limit} bytes" in result.error, result.error


def test_a_key_plus_rollout_id_over_the_citus_index_limit_is_refused_by_the_server(
    citus_dsn: str,
) -> None:
    """On Citus the primary key is (staging_key, rollout_id): both share one btree entry of at
    most 2,704 bytes, so a key the client takes (at most 2,692 bytes) may be refused there:
    at most 2,691 bytes of key plus rollout id for a rollout id of at most 126 bytes; for a
    longer one 2,685 always fit and over 2,688 never do (alignment; docs/citus.md).
    Incompressible keys (the server compresses an index entry when it can)."""
    store = PostgresStagingStore(citus_dsn)
    try:
        for rollout_id, fits, too_long in (
            ("k", 2691, 2692),
            (secrets.token_urlsafe(200)[:200], 2685, 2689),
        ):
            calls = []
            for total in (fits, too_long):
                call = secrets.token_urlsafe(3000)[: total - 2 * len(rollout_id) - 1]
                assert len(f"{rollout_id}/{call}") + len(rollout_id) == total
                calls.append(call)
            assert store.stage(make_record(rollout_id, calls[0])).ok
            refused = store.stage(make_record(rollout_id, calls[1]))
            assert not refused.ok
            assert "index row size" in refused.error and "2704" in refused.error, refused.error
            assert store.keys(rollout_id) == [f"{rollout_id}/{calls[0]}"]
    finally:
        store.close()
