"""The PostgreSQL classes in a forked child: its first call opens its own connections, loop
thread, group-commit loops and locks, and the parent's are left alone (docs/postgres.md,
"Forked processes").

Each test forks while other threads of the parent are in the middle of calls: one holds a
lock of the object (deterministically, a helper thread holds it across the fork), others wait
on the server for a row another transaction holds (`RowLocks`), so their connections are busy
and the group commit's only leader is inside its batch. The child then uses the inherited
objects for real calls within a deadline (`run_forked`: a hung child is killed and reported),
on sessions of its own, closes them and exits; the parent's stuck calls then finish, the
parent keeps calling on its own connections, and what both processes wrote is there.

A short statement timeout bounds a parent's call on a connection the child damaged (a closed
session, or a socket unregistered from the parent's epoll instance) instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
from tests.conftest import make_entry
from tests.postgres_fixture import dsn, fetch, pg_dsn, pg_server  # noqa: F401
from tests.staging_backends import make_record
from tests.test_fork_safety import run_forked, stamped
from tests.test_ledger import make_commit

from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresLineageStore,
    PostgresStagingStore,
    PostgresTokenCaptureStore,
)
from tokencapture.postgres._client import Client

# Bounds a call that waits on a broken connection (a healthy one answers in milliseconds).
STATEMENT_TIMEOUT = 15.0

# The keys a staging store holds after the forked-beside-a-stuck-leader scenario: the parent's
# two before the fork and one after, the stuck stage, and the child's three.
FORKED_KEYS = [
    "busy/c0",
    "busy/c1",
    "child-0/c0",
    "child-0/c1",
    "child-0/c2",
    "parent/p0",
    "parent/p1",
]


class RowLocks:
    """Rows held FOR UPDATE by a transaction of its own (its own connection, thread and loop)
    until the block ends: the parent's calls that need one of them wait on the server."""

    def __init__(self, database: str, *statements: str) -> None:
        self.dsn = database
        self.statements = statements
        self.held = threading.Event()
        self.release = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def hold() -> None:
            connection = await asyncpg.connect(self.dsn)
            try:
                async with connection.transaction():
                    for sql in self.statements:
                        await connection.execute(sql)
                    self.held.set()
                    await asyncio.to_thread(self.release.wait, 60)
            finally:
                await connection.close()

        try:
            asyncio.run(hold())
        except BaseException as exc:  # reported by __exit__
            self.errors.append(exc)
            self.held.set()

    def __enter__(self) -> RowLocks:
        self.thread.start()
        assert self.held.wait(30) and not self.errors, self.errors
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(30)
        assert not self.errors, self.errors


def wait_for_lock_waiters(database: str, count: int) -> None:
    """Until `count` sessions of the stores wait on a row lock (their calls are mid-way)."""
    deadline = time.monotonic() + 30
    while True:
        [row] = fetch(
            database,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND application_name = 'tokencapture' AND datname = current_database()",
        )
        if row["n"] >= count:
            return
        assert time.monotonic() < deadline, f"{row['n']} of {count} calls wait on the server"
        time.sleep(0.02)


@contextlib.contextmanager
def holding(*locks: Any) -> Iterator[None]:
    """`locks` held by another thread of this process until the block ends."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            taken.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


class Calls:
    """Calls running in threads of their own; their results (or errors) once joined."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: dict[str, Any] = {}

    def start(self, name: str, call: Any, *args: Any) -> None:
        def run() -> None:
            try:
                self.results[name] = call(*args)
            except BaseException as exc:  # checked by the test
                self.results[name] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> dict[str, Any]:
        for thread in self.threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self.threads), "a parent's call hung"
        return self.results


def session_pids(client: Client) -> set[int]:
    """The server process ids of the connections `client` has open in this process."""
    return {
        connection.get_server_pid()
        for pool in list(client._pools.values())
        for connection in pool._open
    }


def own_session(client: Client) -> int:
    """The server process id of a session `client` gives this process (synchronously)."""
    pid = client.run_sync(client.fetch("val", "SELECT pg_backend_pid()"))
    assert isinstance(pid, int)
    return pid


def as_deployed(work: Callable[[int], None]) -> Callable[[int], None]:
    """`work` run in the child as in a deployed process: ResourceWarning ignored (the default
    filters), then a collection. Nothing of the parent's may be collected there: an asyncpg
    connection collected unclosed says goodbye on its session and unregisters its socket from
    the (shared) epoll instance of its loop, both the parent's. Under the tests' -W error its
    ResourceWarning would be raised in its finalizer before that, and hide it."""

    def run(index: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            work(index)
            gc.collect()

    return run


def entry(rollout_id: str, call: str) -> Any:
    return make_entry(rollout_id, call=call, prompt_token_ids=list(range(20)))


def test_staging_child_forked_beside_a_stuck_leader_and_a_held_group_lock(
    dsn: str,  # noqa: F811
) -> None:
    """The group commit's only leader (`stage_flushes=1`) is inside its batch, waiting on the
    server, and another thread holds the group's lock: the child's stages lead batches of
    its own on a session of its own (inheriting the lock held or the leader count, it would
    queue forever)."""
    staging = PostgresStagingStore(
        dsn,
        models="tokencapture",
        native_group_commit=False,  # the asyncpg group commit (the native one: its own test)
        stage_flushes=1,
        statement_timeout=STATEMENT_TIMEOUT,
    )
    assert staging.stage(make_record("busy", "c0", [1, 2, 3])).ok  # its fence row exists
    assert staging.stage(make_record("parent", "p0", [4, 5, 6])).ok
    calls = Calls()

    def child(index: int) -> None:
        keys = []
        for k in range(3):
            outcome = staging.stage(make_record(f"child-{index}", f"c{k}", [index, k, 7]))
            assert outcome.ok, outcome
            keys.append(outcome.staging_key)
        fetched = staging.fetch(keys)
        assert [s.token_ids_delta for s in fetched] == [[index, k, 7] for k in range(3)]
        assert own_session(staging._client) not in parent_sessions
        staging.close()

    busy = "SELECT 1 FROM tokencapture.staging_rollouts WHERE rollout_id = 'busy' FOR UPDATE"
    with RowLocks(dsn, busy):
        calls.start("stuck", staging.stage, make_record("busy", "c1", [7, 8, 9]))
        wait_for_lock_waiters(dsn, 1)
        parent_sessions = session_pids(staging._client)
        assert parent_sessions
        with holding(staging._group._lock):
            code = run_forked(as_deployed(child), 0)
    assert code == 0, "the child hung (killed)" if code is None else f"the child failed: {code}"
    assert calls.join()["stuck"].ok
    # The parent goes on, on its own sessions.
    assert staging.stage(make_record("parent", "p1", [4, 5, 6, 7])).ok
    assert session_pids(staging._client) <= parent_sessions
    assert staging.keys() == FORKED_KEYS
    staging.close()


def test_store_lineage_and_ledger_in_a_child_forked_beside_stuck_calls(
    dsn: str,  # noqa: F811
) -> None:
    """A put and a ledger record of the parent wait on the server (their loop threads'
    connections busy), the resolver's and the clients' locks are held by another thread, and
    each class has an idle connection of the parent's: the child puts, resolves, records and
    reads on sessions of its own, closes its objects and exits; then the parent's calls finish
    and it keeps using its connections (a child that closed or collected them would have
    unregistered them from the parent's epoll instances: its next call would time out)."""
    options: dict[str, Any] = {"pool_size": 4, "statement_timeout": STATEMENT_TIMEOUT}
    store = PostgresTokenCaptureStore(dsn, **options)
    lineage = PostgresLineageStore(dsn, **options)
    ledger = PostgresCaptureLedger(dsn, **options)
    request = [{"role": "user", "content": "question"}]
    follow = [
        *request,
        {"role": "assistant", "content": "answer c0"},
        {"role": "user", "content": "and then?"},
    ]

    def resolved(rollout_id: str) -> tuple[str, str]:
        resolution = lineage.resolve_now(rollout_id, follow)
        match = resolution.match
        return resolution.status.value, match.model_call_id if match else ""

    store.append(stamped("parent", "c0", request))
    store.append(entry("busy", "b0"))  # the rollout rows the RowLocks hold
    assert ledger.record_now(make_commit("b0", "busy"))
    assert ledger.record_now(make_commit("p0", "parent"))
    assert resolved("parent") == ("resolved", "c0")
    calls = Calls()

    def child(index: int) -> None:
        rollout = f"child-{index}"
        store.append(stamped(rollout, "c0", request))
        store.append(entry(rollout, "c1"))
        assert [e.model_call_id for e in store.read_entries(rollout)] == ["c0", "c1"]
        assert resolved(rollout) == ("resolved", "c0")
        assert resolved("parent") == ("resolved", "c0")
        # An index of its own: the parent's may have been in use by another thread at the fork
        # (its copy then refuses every call: test_fork_safety's in-memory index test).
        assert lineage._native is not parent_index
        assert ledger.record_now(make_commit("c0", rollout))
        assert ledger.has_rows_now(rollout)
        for client in (store._client, lineage._client, ledger._client):
            assert own_session(client) not in parent_sessions
        store.close_sync()
        lineage.close_sync()
        ledger.close_sync()

    locks = (
        "SELECT 1 FROM tokencapture.rollouts WHERE rollout_id = 'busy' FOR UPDATE",
        "SELECT 1 FROM tokencapture.ledger_rollouts WHERE rollout_id = 'busy' FOR UPDATE",
    )
    with RowLocks(dsn, *locks):
        calls.start("put", store.append, entry("busy", "b1"))
        calls.start("record", ledger.record_now, make_commit("b1", "busy"))
        wait_for_lock_waiters(dsn, 2)
        parent_sessions = set().union(
            *(session_pids(c) for c in (store._client, lineage._client, ledger._client))
        )
        clients = (store._client, lineage._client, ledger._client)
        parent_index = lineage._native
        with holding(lineage._lock, *(client._thread_lock for client in clients)):
            code = run_forked(as_deployed(child), 0)
    assert code == 0, "the child hung (killed)" if code is None else f"the child failed: {code}"
    results = calls.join()
    assert results == {"put": None, "record": True}
    # The parent goes on with what it had (its idle connections included).
    for k in range(3):
        store.append(entry("parent", f"p{k}"))
        assert ledger.record_now(make_commit(f"p{k + 1}", "parent"))
        assert resolved("parent") == ("resolved", "c0")
    assert resolved("child-0") == ("resolved", "c0")
    assert [e.model_call_id for e in store.read_entries("child-0")] == ["c0", "c1"]
    assert [e.model_call_id for e in store.read_entries("busy")] == ["b0", "b1"]
    assert len(store.read_entries("parent")) == 4
    assert ledger.has_rows_now("child-0")
    assert len(ledger.manifest_now("parent")["records"]) == 4
    assert len(ledger.manifest_now("busy")["records"]) == 2
    for closing in (store, lineage, ledger):
        closing.close_sync()


def test_a_child_that_only_closes_what_it_inherited_leaves_the_parent_working(
    dsn: str,  # noqa: F811
) -> None:
    """A child whose first call is `close` (a worker that shuts down the objects it was handed)
    closes nothing of the parent's: it does not wait for the parent's loop thread (not in
    the child) nor close the parent's sessions."""
    staging = PostgresStagingStore(
        dsn,
        models="tokencapture",
        native_group_commit=False,  # the asyncpg group commit, whose loop thread is the parent's
        statement_timeout=STATEMENT_TIMEOUT,
    )
    store = PostgresTokenCaptureStore(dsn, statement_timeout=STATEMENT_TIMEOUT)
    # The first stage learns the schema (on the loop thread), the second is group-committed.
    assert staging.stage(make_record("parent", "p0", [1, 2])).ok
    assert staging.stage(make_record("parent", "p1", [1, 2, 3])).ok
    store.append(entry("parent", "p0"))
    before = session_pids(staging._client) | session_pids(store._client)

    def child(index: int) -> None:
        staging.close()
        store.close_sync()

    code = run_forked(as_deployed(child), 0)
    assert code == 0, "the child hung (killed)" if code is None else f"the child failed: {code}"
    assert staging.stage(make_record("parent", "p2", [1, 2, 3, 4])).ok
    assert staging.keys() == ["parent/p0", "parent/p1", "parent/p2"]
    store.append(entry("parent", "p1"))
    assert len(store.read_entries("parent")) == 2
    assert session_pids(staging._client) | session_pids(store._client) == before
    staging.close()
    store.close_sync()
