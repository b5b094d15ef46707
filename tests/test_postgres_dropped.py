"""PostgreSQL stores dropped without `close()`: their loop thread, descriptors and server
sessions are let go (the client's finalizer), with nothing printed.

Before, every dropped store that had used its synchronous methods left its
`tokencapture-postgres` thread running with its loop's descriptors and its pooled sockets; a
ledger's or resolver's stayed alive for five minutes in the driver's statement-cache timers
(which copied the timed method's context variable, the store itself); and now and then a
connection freed by the garbage collector off its loop printed an asyncio traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.postgres_fixture import dsn, pg_dsn, pg_server

__all__ = ["dsn", "pg_dsn", "pg_server"]

REPO = Path(__file__).resolve().parent.parent

DROPPING = """
import asyncio, gc, json, os, sys, threading, time
import asyncpg
from tests.conftest import make_entry
from tests.staging_backends import make_record
from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresLineageStore,
    PostgresStagingStore,
    PostgresTokenCaptureStore,
)

DSN = sys.argv[1]
ROUNDS = 12


def sessions():
    async def count():
        connection = await asyncpg.connect(DSN)
        try:
            return await connection.fetchval(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = 'tokencapture' AND datname = current_database()"
            )
        finally:
            await connection.close()

    return asyncio.run(count())


def postgres_threads():
    return sum(1 for t in threading.enumerate() if t.name == "tokencapture-postgres")


def settle():
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (postgres_threads() or sessions()):
        time.sleep(0.05)
        gc.collect()


def stage_from_threads(store, i):
    records = [make_record(f"s{i}-{j}", "c1") for j in range(6)]
    threads = [threading.Thread(target=store.stage, args=(r,)) for r in records]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.keys(f"s{i}-0") == [f"s{i}-0/c1"]


def use(kind, i):
    if kind == "staging":
        store = PostgresStagingStore(DSN)
        stage_from_threads(store, i)
        store.fetch([f"s{i}-1/c1"])
    elif kind == "staging-asyncpg":
        store = PostgresStagingStore(DSN, native_group_commit=False)
        stage_from_threads(store, 1000 + i)
    elif kind == "tokens":
        store = PostgresTokenCaptureStore(DSN)
        store.append(make_entry(f"t{i}", call=0))
        assert len(store.freeze_now(f"t{i}").entries) == 1
    elif kind == "ledger":
        store = PostgresCaptureLedger(DSN)
        store.has_rows_now("nothing")
    else:
        store = PostgresLineageStore(DSN)
        try:
            store.resolve_now("nothing", [{"role": "user", "content": "hi"}])
        except Exception:
            pass  # a resolution of nothing either way: only the connection matters here
    # dropped here, unclosed


settle()
baseline = len(os.listdir("/proc/self/fd"))
seen = {}
for kind in ("staging", "staging-asyncpg", "tokens", "ledger", "lineage"):
    for i in range(ROUNDS):
        use(kind, i)
        if i % 3 == 0:
            gc.collect()  # some freed by the collector, some by reference counts
    settle()
    seen[kind] = {
        "threads": postgres_threads(),
        "sessions": sessions(),
        "fds_over_baseline": len(os.listdir("/proc/self/fd")) - baseline,
    }
print(json.dumps(seen))
"""


def test_stores_dropped_unclosed_let_go_of_threads_descriptors_and_sessions(dsn: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", DROPPING, dsn],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for kind, after in seen.items():
        assert after["threads"] == 0, (kind, after)
        assert after["sessions"] == 0, (kind, after)
        assert after["fds_over_baseline"] <= 4, (kind, after)
    # Nothing printed: no asyncio callback traceback, no "Exception ignored" from a connection.
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, textwrap.shorten(
        done.stderr, 3000
    )
