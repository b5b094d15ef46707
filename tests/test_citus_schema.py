"""`tokencapture db init` on a Citus coordinator (a real coordinator and two workers): every
table distributed by rollout id and co-located, the version table a reference table, the
per-operation functions delegated to the worker that owns the rollout, one rollout's rows on
one worker (read from Citus's catalog and from the shards on the workers themselves), upgrades
of a distributed schema, and a schema installed before Citus distributed afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.citus_fixture import citus_cluster, citus_db, citus_dsn, fresh_citus_database
from tests.conftest import make_entry
from tests.pg_server import CitusCluster
from tests.postgres_fixture import fetch, pg_dsn, pg_server

from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresCitusError,
    PostgresLineageStore,
    PostgresTokenCaptureStore,
    install_schema_sync,
)
from tokencapture.protocols import TokenCaptureRetiredError

__all__ = ["citus_cluster", "citus_db", "citus_dsn", "pg_dsn", "pg_server"]

# What the design says (docs/citus.md), written out here rather than read from the code.
ROLLOUT_TABLES = {
    "rollouts",
    "entries",
    "intents",
    "incomplete_marks",
    "ledger_rollouts",
    "ledger_rows",
    "staging_rollouts",
    "staged_calls",
}
DELEGATED = {
    "put",
    "begin_call",
    "mark_incomplete",
    "freeze_lines",
    "read_lines",
    "is_incomplete",
    "drop_snapshot",
    "export_rollout",
    "import_rollout",
    "lineage_tail",
    "lineage_lines",
    "record_ledger_row",
    "ledger_manifest",
    "ledger_candidate",
    "stage_call",
}


def db_init(dsn: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokencapture", "db", "init", dsn, "--json", *extra],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _debug_psql(cluster: CitusCluster, dsn: str, sql: str) -> subprocess.CompletedProcess[str]:
    """`sql` alone (one statement: no implicit transaction block) through psql on the
    coordinator, with Citus's DEBUG1 messages on stderr."""
    command = [str(cluster.coordinator.bindir / "psql"), "-qAtX", "-v", "ON_ERROR_STOP=1"]
    command += ["-d", dsn, "-c", sql]
    env = {**os.environ, "PGOPTIONS": "-c client_min_messages=debug1"}
    return subprocess.run(command, capture_output=True, text=True, check=False, env=env)


def test_db_init_distributes_every_table_by_rollout_id_co_located(
    citus_cluster: CitusCluster,
) -> None:
    name, dsn = fresh_citus_database(citus_cluster)
    done = db_init(dsn)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["applied"][0] == "001_store.sql" and report["citus"]["citus"] is True
    assert db_init(dsn).returncode == 0  # idempotent
    rows = fetch(
        dsn,
        "SELECT c.relname, p.partmethod::text AS partmethod, p.colocationid, "
        "column_to_column_name(p.logicalrelid, p.partkey) AS col FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_dist_partition p ON p.logicalrelid = c.oid "
        "WHERE n.nspname = 'tokencapture' AND c.relkind = 'r'",
    )
    tables = {row["relname"]: row for row in rows}
    assert set(tables) == ROLLOUT_TABLES | {"schema_migrations"}
    assert tables["schema_migrations"]["partmethod"] == "n"  # a reference table
    for table in ROLLOUT_TABLES:
        assert (tables[table]["partmethod"], tables[table]["col"]) == ("h", "rollout_id"), table
    assert len({tables[t]["colocationid"] for t in ROLLOUT_TABLES}) == 1  # co-located
    delegated = fetch(
        dsn,
        "SELECT p.proname, p.proargnames[d.distribution_argument_index + 1] AS arg, "
        "d.colocationid FROM pg_dist_object d JOIN pg_proc p ON p.oid = d.objid "
        "WHERE d.classid = 'pg_proc'::regclass AND d.distribution_argument_index IS NOT NULL",
    )
    assert {row["proname"] for row in delegated} == DELEGATED
    assert {row["arg"] for row in delegated} == {"p_rollout"}
    assert {row["colocationid"] for row in delegated} == {tables["rollouts"]["colocationid"]}
    # Every function of the schema exists on every worker (the delegated ones call them there).
    count = fetch(
        dsn, "SELECT count(*) FROM pg_proc WHERE pronamespace = 'tokencapture'::regnamespace"
    )
    for worker in citus_cluster.workers:
        on_worker = worker.psql(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'tokencapture'::regnamespace", name
        )
        assert int(on_worker) == count[0][0]
    citus_cluster.drop_database(name)


def test_one_rollouts_rows_live_on_the_worker_the_catalog_names(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    name = citus_db[0]
    store = PostgresTokenCaptureStore(citus_dsn)
    ledger = PostgresCaptureLedger(citus_dsn)
    rollouts = [f"place-{i}" for i in range(12)]
    try:
        for rollout in rollouts:
            store.append(make_entry(rollout, call=1))
            store._begin_call(rollout, "call-2")
            store._mark_incomplete(rollout, "lost")
        owners = {r: citus_cluster.node_of(name, "tokencapture.rollouts", r) for r in rollouts}
        assert {owners[r].port for r in rollouts} == {w.port for w in citus_cluster.workers}
        for rollout in rollouts:
            owner = owners[rollout]
            for table in ("rollouts", "entries", "intents", "incomplete_marks"):
                assert citus_cluster.node_of(name, f"tokencapture.{table}", rollout) is owner
                shard = citus_cluster.coordinator.psql(
                    "SELECT get_shard_id_for_distribution_column("
                    f"'tokencapture.{table}', '{rollout}')",
                    name,
                ).strip()
                # The shard itself, on the worker (not through Citus's router).
                here = owner.psql(
                    f"SELECT count(*) FROM tokencapture.{table}_{shard} "
                    f"WHERE rollout_id = '{rollout}'",
                    name,
                )
                assert int(here) == 1, (table, rollout)
                for other in citus_cluster.workers:
                    if other is not owner:
                        missing = other.psql(
                            f"SELECT to_regclass('tokencapture.{table}_{shard}')", name
                        )
                        assert missing.strip() == ""
        assert ledger is not None
    finally:
        store.close_sync()
        ledger.close_sync()


def test_the_operations_are_delegated_to_the_owning_worker(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """The calls the clients make, as they make them, are pushed down to the worker (Citus
    says so at DEBUG1); a batch (retire) runs on the coordinator."""
    name = citus_db[0]
    store = PostgresTokenCaptureStore(citus_dsn)
    store.append(make_entry("delegated", call=1))
    store.close_sync()
    calls = [
        "SELECT tokencapture.put('d2', '\\x61'::bytea, 'x', '\\x62'::bytea)",
        "SELECT tokencapture.begin_call('d2', '\\x63'::bytea)",
        "SELECT tokencapture.mark_incomplete('d2', '\\x64'::bytea)",
        "SELECT tokencapture.is_incomplete('d2')",
        "SELECT line, digest FROM tokencapture.read_lines('delegated')",
        "SELECT * FROM tokencapture.freeze_lines('delegated', 's')",
        "SELECT tokencapture.drop_snapshot('delegated', 's', 1)",
        "SELECT * FROM tokencapture.lineage_lines('delegated', 0, 0)",
        "SELECT tokencapture.record_ledger_row('d2', 'c', false, true, NULL, '\\x65'::bytea)",
        "SELECT * FROM tokencapture.ledger_manifest('d2')",
        "SELECT tokencapture.ledger_candidate('d2', 'f')",
        "SELECT * FROM tokencapture.export_rollout('d2')",
    ]
    for call in calls:
        result = _debug_psql(citus_cluster, citus_dsn, call)
        assert result.returncode == 0, (call, result.stderr)
        assert "pushing down the function call" in result.stderr, (call, result.stderr)
    batch = _debug_psql(
        citus_cluster, citus_dsn, "SELECT * FROM tokencapture.retire(ARRAY['d2', 'delegated'])"
    )
    assert batch.returncode == 0 and "pushing down the function call" not in batch.stderr
    assert name


def test_an_older_distributed_schema_is_upgraded_in_place(citus_cluster: CitusCluster) -> None:
    name, dsn = fresh_citus_database(citus_cluster)
    assert install_schema_sync(dsn, upto=2) == ["001_store.sql", "002_lineage.sql"]
    old = PostgresTokenCaptureStore(dsn)
    with pytest.raises(RuntimeError, match="schema version 2, this client needs"):
        old.append(make_entry("kept"))
    old.close_sync()
    # Write through the version-2 functions, then upgrade.
    fetch(dsn, "SELECT tokencapture.put('kept', '\\x31'::bytea, 'd', '\\x7b7d'::bytea)")
    done = db_init(dsn)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["applied"] == [
        "003_ledger.sql",
        "004_lineage_rows.sql",
        "005_staging.sql",
        "006_staging_key_order.sql",
        "007_staging_fence_insert.sql",
    ]
    tables = fetch(
        dsn,
        "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid::text LIKE 'tokencapture.%'",
    )
    assert tables[0][0] == len(ROLLOUT_TABLES) + 1
    rows = fetch(dsn, "SELECT line FROM tokencapture.read_lines('kept')")
    assert [row["line"] for row in rows] == [b"{}"]
    store, ledger = PostgresTokenCaptureStore(dsn), PostgresCaptureLedger(dsn)
    resolver = PostgresLineageStore(dsn)
    try:
        store.append(make_entry("new"))
        assert store.freeze_now("new").version == 2
        assert ledger is not None and resolver is not None
    finally:
        store.close_sync()
        ledger.close_sync()
        resolver.close_sync()
    citus_cluster.drop_database(name)


def test_a_schema_installed_before_citus_is_distributed_by_db_init(
    citus_cluster: CitusCluster,
) -> None:
    name, dsn = fresh_citus_database(citus_cluster)
    install_schema_sync(dsn, citus=False)  # plain tables on the coordinator
    local = PostgresTokenCaptureStore(dsn)
    local.append(make_entry("early", call=1))
    local.retire_now(["fenced"])
    local.close_sync()
    assert fetch(dsn, "SELECT count(*) FROM pg_dist_partition")[0][0] == 0
    done = db_init(dsn, "--citus")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["applied"] == []  # nothing to apply, all to distribute
    assert citus_cluster.node_of(name, "tokencapture.entries", "early") in citus_cluster.workers
    store = PostgresTokenCaptureStore(dsn)
    try:
        assert [e.model_call_id for e in store.freeze_now("early").entries] == ["call-1"]
        with pytest.raises(TokenCaptureRetiredError):
            store.append(make_entry("fenced"))
    finally:
        store.close_sync()
    citus_cluster.drop_database(name)


def test_a_table_without_a_distribution_is_refused(citus_cluster: CitusCluster) -> None:
    """A new table of the schema must say how it is distributed (the staging store's will)."""
    name, dsn = fresh_citus_database(citus_cluster)
    install_schema_sync(dsn)
    fetch(dsn, "CREATE TABLE tokencapture.unlisted (rollout_id text PRIMARY KEY)")
    with pytest.raises(PostgresCitusError, match=r"tokencapture\.unlisted have no distribution"):
        install_schema_sync(dsn)
    citus_cluster.drop_database(name)


def test_db_init_citus_on_a_server_without_citus_is_a_clear_error(pg_dsn: str) -> None:
    done = db_init(pg_dsn, "--citus")
    assert done.returncode != 0
    assert "no Citus extension" in done.stderr
    assert "Traceback" not in done.stderr
    plain = db_init(pg_dsn)  # without the flag: a plain install, nothing distributed
    assert plain.returncode == 0 and "citus" not in json.loads(plain.stdout)
