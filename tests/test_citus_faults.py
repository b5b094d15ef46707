"""Faults of a real Citus cluster (a coordinator and two workers) under the store's workload:
a worker SIGKILLed in the middle of a multi-process workload and restarted, the coordinator
killed and restarted, and a retire batch spanning both workers racing writers on both. Every
acknowledged put, mark and fence is checked on the worker that owns its rollout (found in
Citus's catalog), in the shard itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.citus_fixture import citus_cluster, citus_db, citus_dsn
from tests.conftest import make_entry
from tests.pg_server import CitusCluster, PgServer

from tokencapture.cli import main
from tokencapture.postgres import (
    PostgresStagingStore,
    PostgresTokenCaptureStore,
    PostgresUnavailableError,
    install_schema_sync,
)

__all__ = ["citus_cluster", "citus_db", "citus_dsn"]

ROOT = Path(__file__).resolve().parents[1]

# One writer process: puts (retried until acknowledged: a put is idempotent), a mark every
# few puts (not retried: it is not idempotent), then a fence (retire, retried). Every attempt
# and outcome is logged with its duration, so the test can tell a clear error from a hang.
_WRITER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tests.conftest import make_entry
from tokencapture.postgres import PostgresTokenCaptureStore
from tokencapture.protocols import TokenCaptureRetiredError
dsn, index, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rollouts = sys.argv[4].split(",")
count = int(sys.argv[5])
store = PostgresTokenCaptureStore(dsn, connect_timeout=2, statement_timeout=10)
with open(log, "a") as out:
    def note(**fields):
        out.write(json.dumps(fields) + "\\n"); out.flush(); os.fsync(out.fileno())
    for n in range(count):
        rollout = rollouts[n % len(rollouts)]
        tokens = list(range(n, n + 40))
        entry = make_entry(rollout, call=f"w{{index}}-c{{n}}", prompt_token_ids=tokens)
        while True:
            started = time.monotonic()
            try:
                store.append(entry)
            except TokenCaptureRetiredError:
                note(event="retired", rollout=rollout, call=entry.model_call_id)
                break
            except OSError as exc:
                note(event="error", rollout=rollout, call=entry.model_call_id, error=str(exc),
                     type=type(exc).__name__, took=time.monotonic() - started, at=time.time())
                time.sleep(0.1)
                continue
            note(event="ack", rollout=rollout, call=entry.model_call_id,
                 took=time.monotonic() - started, at=time.time())
            break
        if n % 7 == 6:
            note(event="mark-try", rollout=rollout)
            try:
                store._mark_incomplete(rollout, f"lost-{{n}}")
                note(event="mark-ack", rollout=rollout)
            except OSError as exc:
                note(event="mark-error", rollout=rollout, error=str(exc))
    fence = f"fence-{{index}}"
    while True:
        try:
            store.retire_now([fence])
            note(event="fence-ack", rollout=fence)
            break
        except OSError:
            time.sleep(0.1)
store.close_sync()
"""


def _events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _ids_on(
    cluster: CitusCluster, database: str, worker: PgServer, prefix: str, n: int
) -> list[str]:
    """`n` rollout ids whose rows the catalog places on `worker`."""
    found: list[str] = []
    i = 0
    while len(found) < n:
        rollout = f"{prefix}{i}"
        if cluster.node_of(database, "tokencapture.rollouts", rollout) is worker:
            found.append(rollout)
        i += 1
    return found


def _on_owner(cluster: CitusCluster, database: str, table: str, rollout: str, sql: str) -> str:
    """`sql` (with `{shard}` for the shard table's name) run on the worker owning `rollout`,
    against its shard of `table` directly."""
    shard = cluster.coordinator.psql(
        f"SELECT get_shard_id_for_distribution_column('tokencapture.{table}', '{rollout}')",
        database,
    ).strip()
    owner = cluster.node_of(database, f"tokencapture.{table}", rollout)
    return owner.psql(sql.format(shard=f"tokencapture.{table}_{shard}"), database).strip()


def _check_acknowledged(cluster: CitusCluster, database: str, events: list[dict[str, Any]]) -> None:
    """Every acknowledged put, mark and fence is in the shard of the worker that owns it."""
    acked: dict[str, set[str]] = {}
    for event in events:
        if event["event"] == "ack":
            acked.setdefault(event["rollout"], set()).add(event["call"])
    assert acked
    for rollout, calls in acked.items():
        stored = _on_owner(
            cluster,
            database,
            "entries",
            rollout,
            "SELECT convert_from(model_call_id, 'UTF8') FROM {shard} WHERE rollout_id = '"
            + rollout
            + "'",
        ).split("\n")
        assert calls <= set(stored), rollout
        marks = int(
            _on_owner(
                cluster,
                database,
                "incomplete_marks",
                rollout,
                "SELECT count(*) FROM {shard} WHERE rollout_id = '" + rollout + "'",
            )
        )
        tried = sum(1 for e in events if e["event"] == "mark-try" and e["rollout"] == rollout)
        done = sum(1 for e in events if e["event"] == "mark-ack" and e["rollout"] == rollout)
        assert done <= marks <= tried, rollout
    fences = {e["rollout"] for e in events if e["event"] == "fence-ack"}
    for fence in fences:
        flag = _on_owner(
            cluster,
            database,
            "rollouts",
            fence,
            "SELECT retired FROM {shard} WHERE rollout_id = '" + fence + "'",
        )
        assert flag == "t", fence


def _writers(
    tmp_path: Path, dsn: str, groups: list[list[str]], count: int
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(root=str(ROOT)))
    logs = [tmp_path / f"writer-{i}.log" for i in range(len(groups))]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), dsn, str(i), str(log), ",".join(group), str(count)]
        )
        for i, (group, log) in enumerate(zip(groups, logs, strict=True))
    ]
    return procs, logs


def _wait_acks(logs: list[Path], at_least: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for log in logs for e in _events(log) if e["event"] == "ack") >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} puts acknowledged in {timeout}s")


def _finish(procs: list[subprocess.Popen[bytes]], timeout: float = 180) -> None:
    try:
        for proc in procs:
            assert proc.wait(timeout=timeout) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_a_worker_sigkilled_mid_workload_loses_nothing_and_the_other_keeps_working(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str, tmp_path: Path
) -> None:
    name = citus_db[0]
    victim, survivor = citus_cluster.workers
    on_victim = _ids_on(citus_cluster, name, victim, "kv-", 3)
    on_survivor = _ids_on(citus_cluster, name, survivor, "ks-", 3)
    # Two writers per worker's rollouts, one writing to both.
    groups = [on_victim, on_survivor, on_victim[:1] + on_survivor[:1], on_survivor[1:]]
    procs, logs = _writers(tmp_path, citus_dsn, groups, count=70)
    try:
        _wait_acks(logs, 60)
        victim.kill()
        down_at = time.time()
        time.sleep(3)
        victim.start()
        up_at = time.time()
        _finish(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    events = [e for log in logs for e in _events(log)]
    errors = [e for e in events if e["event"] == "error"]
    assert any(e["rollout"] in on_victim for e in errors), "no put met the dead worker"
    # Errors are PostgresUnavailableError (an OSError) naming the server, and come back in
    # time: none waited for the statement timeout (10 s) or longer.
    for error in errors:
        assert error["type"] == "PostgresUnavailableError", error
        assert "unavailable" in error["error"], error
        assert error["took"] < 9, error
    # The survivor's rollouts kept working while the victim was down.
    survivor_acks = [
        e
        for e in events
        if e["event"] == "ack" and e["rollout"] in on_survivor and down_at < e["at"] < up_at
    ]
    assert survivor_acks, "no put on the surviving worker's rollouts while the other was down"
    assert max(e["took"] for e in events if e["event"] == "ack") < 9
    _check_acknowledged(citus_cluster, name, events)
    acked = {(e["rollout"], e["call"]) for e in events if e["event"] == "ack"}
    assert len(acked) == 4 * 70  # every put was eventually acknowledged


def test_the_coordinator_killed_and_restarted_loses_nothing(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str, tmp_path: Path
) -> None:
    name = citus_db[0]
    first, second = citus_cluster.workers
    groups = [
        _ids_on(citus_cluster, name, first, "ca-", 2),
        _ids_on(citus_cluster, name, second, "cb-", 2),
    ]
    procs, logs = _writers(tmp_path, citus_dsn, groups, count=60)
    try:
        _wait_acks(logs, 40)
        citus_cluster.coordinator.kill()
        time.sleep(1)
        citus_cluster.coordinator.start()
        _finish(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    events = [e for log in logs for e in _events(log)]
    assert any(e["event"] == "error" for e in events), "no put was in flight at the kill"
    _check_acknowledged(citus_cluster, name, events)
    acked = {(e["rollout"], e["call"]) for e in events if e["event"] == "ack"}
    assert len(acked) == 2 * 60


_RACER = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from tests.conftest import make_entry
from tokencapture.postgres import PostgresTokenCaptureStore
from tokencapture.protocols import TokenCaptureRetiredError
dsn, rollout, log = sys.argv[1], sys.argv[2], sys.argv[3]
store = PostgresTokenCaptureStore(dsn)
with open(log, "a") as out:
    n = 0
    while True:
        entry = make_entry(rollout, call=f"{{rollout}}-c{{n}}")
        try:
            store.append(entry)
        except TokenCaptureRetiredError:
            out.write(json.dumps({{"event": "retired", "at": time.time()}}) + "\\n")
            break
        event = {{"event": "ack", "call": entry.model_call_id, "at": time.time()}}
        out.write(json.dumps(event) + "\\n")
        out.flush()
        n += 1
store.close_sync()
"""


def test_a_retire_batch_spanning_both_workers_races_writers_on_both(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str, tmp_path: Path
) -> None:
    name = citus_db[0]
    first, second = citus_cluster.workers
    batch = _ids_on(citus_cluster, name, first, "ra-", 2) + _ids_on(
        citus_cluster, name, second, "rb-", 2
    )
    script = tmp_path / "racer.py"
    script.write_text(_RACER.format(root=str(ROOT)))
    logs = [tmp_path / f"racer-{r}.log" for r in batch]
    procs = [
        subprocess.Popen([sys.executable, str(script), citus_dsn, rollout, str(log)])
        for rollout, log in zip(batch, logs, strict=True)
    ]
    store = PostgresTokenCaptureStore(citus_dsn)
    try:
        for log in logs:  # every writer is writing (so every rollout has records to remove)
            _wait_acks([log], 10)
        result = store.retire_now(batch)
        assert result == {"removed": batch, "absent": []}
        for rollout in batch:  # nothing landed after it returned, on either worker
            assert store.read_entries(rollout) == []
        _finish(procs, timeout=60)
        for rollout, log in zip(batch, logs, strict=True):
            events = _events(log)
            assert events[-1]["event"] == "retired"
            # Since nothing removes entries of a fenced rollout, none landed after the retire.
            assert store.read_entries(rollout) == []
            count = _on_owner(
                citus_cluster,
                name,
                "entries",
                rollout,
                "SELECT count(*) FROM {shard} WHERE rollout_id = '" + rollout + "'",
            )
            assert count == "0"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        store.close_sync()


def test_a_retire_spanning_a_dead_worker_changes_nothing_anywhere(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """All or nothing: with one worker down a batch spanning both fails with a clear error
    and the live worker's rollout is untouched."""
    name = citus_db[0]
    live, dead = citus_cluster.workers
    kept = _ids_on(citus_cluster, name, live, "an-", 1)[0]
    lost = _ids_on(citus_cluster, name, dead, "ad-", 1)[0]
    store = PostgresTokenCaptureStore(citus_dsn, connect_timeout=2, statement_timeout=10)
    try:
        store.append(make_entry(kept, call=1))
        store.append(make_entry(lost, call=1))
        dead.kill()
        started = time.monotonic()
        with pytest.raises(PostgresUnavailableError, match="unavailable"):
            store.retire_now([kept, lost])
        assert time.monotonic() - started < 9
        store.append(make_entry(kept, call=2))  # the live worker's rollout: not fenced
        dead.start()
        assert [e.model_call_id for e in store.read_entries(kept)] == ["call-1", "call-2"]
        assert [e.model_call_id for e in store.read_entries(lost)] == ["call-1"]
    finally:
        if not dead.running:
            dead.start()
        store.close_sync()


def test_a_new_install_schema_client_writes_to_the_live_worker_while_another_is_down(
    citus_cluster: CitusCluster,
    citus_db: tuple[str, str],
    citus_dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A schema already installed is found with reads alone: no DDL, which Citus propagates to
    every worker and which failed with one down, so a client with `install_schema=True` (the
    demo's, the documented one) could write nowhere. And the CLI says the dead worker in one
    line, as every command says an unavailable server."""
    from tests.staging_backends import make_record

    name = citus_db[0]
    live, dead = citus_cluster.workers
    kept = _ids_on(citus_cluster, name, live, "is-", 1)[0]
    lost = _ids_on(citus_cluster, name, dead, "isd-", 1)[0]
    dead.kill()
    try:
        store = PostgresTokenCaptureStore(
            citus_dsn, install_schema=True, connect_timeout=2, statement_timeout=10
        )
        staging = PostgresStagingStore(
            citus_dsn, install_schema=True, connect_timeout=2, statement_timeout=10
        )
        try:
            store.append(make_entry(kept, call=1))
            assert [e.model_call_id for e in store.read_entries(kept)] == ["call-1"]
            with pytest.raises(PostgresUnavailableError, match="unavailable"):
                store.append(make_entry(lost, call=1))
            assert staging.stage(make_record(kept, "c0")).ok
        finally:
            store.close_sync()
            staging.close()
        assert install_schema_sync(citus_dsn) == []  # nothing to do: nothing sent to workers

        for args in (["ls", citus_dsn], ["verify", citus_dsn], ["ls", citus_dsn, "--staging"]):
            assert main(args) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err  # the server's two lines, joined
            assert err.startswith(
                f"tokencapture: error: PostgreSQL at 127.0.0.1:{citus_cluster.coordinator.port}/"
                f"{name} is unavailable: "
            ), err
            assert "Is the server running" in err and f":{dead.port}" in err, err
    finally:
        dead.start()


def test_a_terminated_worker_backend_is_a_clear_error_or_a_safe_retry(
    citus_cluster: CitusCluster, citus_db: tuple[str, str], citus_dsn: str
) -> None:
    """A delegated call whose backend on the worker is terminated (SQLSTATE 57P01 there)
    while it waits for the rollout's lock: a mark (not idempotent) is PostgresUnavailableError;
    a put (idempotent) is retried once and lands once."""
    import asyncio

    import asyncpg

    name = citus_db[0]
    owner = citus_cluster.workers[0]
    rollout = _ids_on(citus_cluster, name, owner, "term-", 1)[0]
    store = PostgresTokenCaptureStore(citus_dsn, statement_timeout=20)
    store.append(make_entry(rollout, call=1))

    def terminate_waiter() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done = owner.psql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE '%tokencapture.%'",
                name,
            )
            if int(done) > 0:
                return
            time.sleep(0.05)
        raise AssertionError("no delegated call waited for the lock")

    async def run() -> None:
        holder = await asyncpg.connect(citus_dsn)
        try:
            for call, expect_error in ((store.mark_incomplete, True), (store.begin_call, False)):
                transaction = holder.transaction()
                await transaction.start()
                # Locks the rollout's row on its worker (a call inside a transaction block
                # runs on the coordinator, not delegated).
                await holder.execute(
                    "SELECT 1 FROM tokencapture.rollouts WHERE rollout_id = $1 FOR UPDATE",
                    rollout,
                )
                waiting = asyncio.ensure_future(call(rollout, "call-2"))
                await asyncio.to_thread(terminate_waiter)
                await asyncio.sleep(0.3)
                await transaction.rollback()
                if expect_error:
                    with pytest.raises(PostgresUnavailableError, match="unavailable"):
                        await asyncio.wait_for(waiting, 15)
                else:
                    await asyncio.wait_for(waiting, 15)  # retried: lands once
        finally:
            await holder.close()
            await store.close()

    asyncio.run(run())
    intents = _on_owner(
        citus_cluster,
        name,
        "intents",
        rollout,
        "SELECT count(*) FROM {shard} WHERE rollout_id = '" + rollout + "'",
    )
    assert intents == "1"
