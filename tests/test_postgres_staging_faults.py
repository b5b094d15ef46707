"""PostgresStagingStore under faults: the server SIGKILLed and restarted in the middle of a staging
load from many threads (every acknowledged key is there and verifies afterwards; nothing else
is half-written), and several processes racing `retire` against processes that stage (after a
retire returns, no stage of its rollout lands, from any process)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tests.pg_server import PgServer
from tests.postgres_fixture import dsn, fetch, own_server, pg_dsn, pg_server  # noqa: F401
from tests.staging_backends import chain

from tokencapture.postgres import PostgresStagingStore, install_schema_sync

__all__ = ["dsn", "pg_dsn", "pg_server"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("native", [False, True], ids=["asyncpg", "native"])
def test_every_acknowledged_stage_survives_a_server_crash(
    own_server: PgServer,  # noqa: F811
    native: bool,
) -> None:
    install_schema_sync(own_server.dsn)
    threads_n, per_thread = 16, 60
    records = {t: chain(f"t{t}", per_thread, size=320) for t in range(threads_n)}
    acknowledged: list[str] = []
    failed: list[str] = []
    lock = threading.Lock()
    store = PostgresStagingStore(
        own_server.dsn, connect_timeout=2, statement_timeout=5, native_group_commit=native
    )
    killed = threading.Event()
    restarted = threading.Event()

    def stage(t: int) -> None:
        for record in records[t]:
            while True:
                result = store.stage(record)
                if result.ok:
                    with lock:
                        acknowledged.append(record.staging_key)
                    break
                with lock:
                    failed.append(str(result.error))
                assert "PostgresUnavailableError" in str(result.error), result.error
                restarted.wait(30)
                time.sleep(0.05)

    def crash() -> None:
        while len(acknowledged) < 200:
            time.sleep(0.005)
        own_server.kill()
        killed.set()
        time.sleep(0.5)
        own_server.start()
        restarted.set()

    workers = [threading.Thread(target=stage, args=(t,)) for t in range(threads_n)]
    crasher = threading.Thread(target=crash)
    crasher.start()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    crasher.join(60)
    try:
        assert killed.is_set() and restarted.is_set()
        assert failed, "the kill came too late to interrupt any stage"
        # Every call was eventually acknowledged (a retry after an unknown outcome is
        # idempotent), and every acknowledged key is there, verified, after the crash.
        assert len(acknowledged) == threads_n * per_thread
        assert store.native_group_commit is native
        survivor = PostgresStagingStore(own_server.dsn)
        try:
            keys = survivor.keys()
            assert set(acknowledged) == set(keys)
            fetched = survivor.fetch_records(keys)  # every stored row verifies
            wanted = {r.staging_key: r for rs in records.values() for r in rs}
            assert all(f.model_dump() == wanted[f.staging_key].model_dump() for f in fetched)
        finally:
            survivor.close_sync()
    finally:
        store.close_sync()


_RACER = """
import json, sys, time
from tests.staging_backends import make_record
from tokencapture.postgres import PostgresStagingStore

dsn, role, rollouts, start = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
store = PostgresStagingStore(dsn)
while time.time() < start:
    time.sleep(0.001)
out = []
if role == "stage":
    n = 0
    deadline = time.time() + 3
    while time.time() < deadline:
        for rollout_id in rollouts:
            began = time.time()
            result = store.stage(make_record(rollout_id, f"{sys.argv[5]}-{n}", [n % 1000, 1]))
            out.append([rollout_id, began, time.time(), result.ok, result.error])
        n += 1
else:
    time.sleep(float(sys.argv[5]))
    began = time.time()
    payload = store.retire(rollouts)
    out.append([began, time.time(), payload])
store.close_sync()
print(json.dumps(out))
"""


def test_processes_racing_retire_leave_no_stage_behind(dsn: str) -> None:
    import json

    rollouts = [f"race{i}" for i in range(6)]
    start = time.time() + 4  # every process connected and waiting
    joined = ",".join(rollouts)

    def spawn(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _RACER, dsn, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )

    stagers = [spawn("stage", joined, str(start), f"p{i}") for i in range(3)]
    # Three retirers over overlapping batches, at different moments of the stagers' run.
    retirers = [
        spawn("retire", ",".join(rollouts[:4]), str(start), "0.8"),
        spawn("retire", ",".join(rollouts[2:]), str(start), "1.2"),
        spawn("retire", ",".join(reversed(rollouts)), str(start), "1.6"),
    ]
    stage_rows = [row for p in stagers for row in json.loads(p.communicate(timeout=120)[0])]
    retire_rows = [json.loads(p.communicate(timeout=120)[0])[0] for p in retirers]
    assert all(p.returncode == 0 for p in [*stagers, *retirers])
    # When each rollout's first retire returned.
    fenced_at = {
        rollout_id: min(
            done
            for _, done, payload in retire_rows
            if rollout_id in [*payload["removed"], *payload["absent"]]
        )
        for rollout_id in rollouts
    }
    assert sum(1 for row in stage_rows if row[3]) > 0  # stages landed before the fences
    late = [row for row in stage_rows if row[1] > fenced_at[row[0]]]
    assert late, "no stage started after a retire returned: the race did not happen"
    assert not any(row[3] for row in late), [row for row in late if row[3]][:3]
    assert all("is retired" in row[4] for row in late)
    # The fences hold: nothing of any rollout is stored, whatever landed before the retires.
    assert fetch(dsn, "SELECT count(*) AS n FROM tokencapture.staged_calls")[0]["n"] == 0
    # Each rollout was removed by exactly one retire (the others found it absent).
    for rollout_id in rollouts:
        removed_by = [p for _, _, p in retire_rows if rollout_id in p["removed"]]
        assert len(removed_by) <= 1


def test_batches_of_the_same_keys_in_opposite_orders_never_deadlock(dsn: str) -> None:
    """Two workers restaging the same calls of one rollout at once (a retry racing the
    original), their batches holding the keys in opposite orders: `stage_batch` inserts a
    rollout's keys in key order, so neither batch waits on a key the other is about to wait
    for (PostgreSQL would abort one after `deadlock_timeout`, a second's stall and a retry)."""
    import asyncio

    import asyncpg

    keys = [f"r/call-{i:03d}" for i in range(64)]

    def args(order: list[str]) -> tuple[list[Any], ...]:
        return (
            ["r"] * len(order),
            order,
            ["d" * 64] * len(order),
            [key.encode() for key in order],
            [None] * len(order),
        )

    async def race(round_: int) -> list[Any]:
        rollout_keys = [f"{key}-{round_}" for key in keys]
        one, two = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            await asyncio.gather(
                one.execute("SET deadlock_timeout = '50ms'"),
                two.execute("SET deadlock_timeout = '50ms'"),
            )
            return list(
                await asyncio.gather(
                    one.fetchval(_STAGE_BATCH_SQL, *args(rollout_keys)),
                    two.fetchval(_STAGE_BATCH_SQL, *args(rollout_keys[::-1])),
                    return_exceptions=True,
                )
            )
        finally:
            await asyncio.gather(one.close(), two.close())

    for round_ in range(10):
        outcomes = asyncio.run(race(round_))
        assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
        first, second = outcomes
        # Each key stored by exactly one batch (status 0), a duplicate (1) in the other.
        assert all(a + b == 1 for a, b in zip(first, reversed(second), strict=True))


_STAGE_BATCH_SQL = "SELECT tokencapture.stage_batch($1, $2, $3, $4, $5)"
