"""A child forked while other threads of its parent are inside the native core never hangs.

Each test keeps threads of the parent calling one native object in a loop (each call leaves
the interpreter to enter the core, which is exactly when the forking thread gets to run, so
most forks land while a thread holds one of the core's short-held mutexes), forks many
times, and has every child use the same (inherited) object for a few real operations within
a deadline. A child that does not finish in time is killed and the test fails; what the
children wrote is then checked from the parent. Before the native objects became
per-process (`rust/src/fork.rs`), most runs of each test hung a child within its first few
forks.

The busy threads call the native objects themselves (`_native`), the children the public
wrappers. The wrappers' own Python locks (metrics, OpenTelemetry recorders, the lazily made
thread pool and capture ledger) are renewed in a child (`tokencapture.forking`); the last
test holds each of them in another thread at the fork, deterministically.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import gc
import multiprocessing
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.staging_backends import make_record
from tests.test_ledger import make_commit

from tokencapture import FileCaptureLedger, FileStagingStore, TokenCaptureCorruptionError, _core
from tokencapture.descriptors import set_budget
from tokencapture.jobs import native_job
from tokencapture.ledger_rows import commit_line
from tokencapture.lineage import FileLineageStore, stamp_continuation
from tokencapture.records import ParentResolutionStatus, stamp_lineage
from tokencapture.store import TokenCaptureStore, canonical_line

# Enough forks that a child copying a locked mutex is near certain without the fix (a quarter
# or more of forks beside a busy thread hung then), few enough to keep each test short.
FORKS = 48
# A child's few operations take milliseconds; this only bounds a hang (the machine is shared).
CHILD_DEADLINE = 20.0
# Stop forking at the first hung child: the test has failed already.
MAX_HUNG = 1
HAMMERS = 2
# Calls the native workers have queued at once: enough that they are still inside the core
# (without the GIL) when the main thread forks, more rollouts than a store caches (so their
# puts also evict, through the descriptor budget's lists).
NATIVE_BATCH = 256


@contextmanager
def forking_allowed() -> Iterator[None]:
    """Python 3.12+ warns (DeprecationWarning) on fork in a multi-threaded process, because a
    child can copy locks held by other threads: the very hazard these tests exercise, on
    purpose. CI's pytest runs with -W error, so the warning is silenced around the fork only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


@contextmanager
def hammering(*calls: Callable[[str, int], object]) -> Iterator[list[BaseException]]:
    """Threads calling `call(thread_name, n)` for n = 0, 1, ... until the block ends; the
    errors they raised are in the yielded list (checked by the caller)."""
    stop = threading.Event()
    errors: list[BaseException] = []
    started = threading.Barrier(len(calls) * HAMMERS + 1)

    def loop(call: Callable[[str, int], object], name: str) -> None:
        started.wait()
        n = 0
        try:
            while not stop.is_set():
                call(name, n)
                n += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(call, f"h{c}{t}"), daemon=True)
        for c, call in enumerate(calls)
        for t in range(HAMMERS)
    ]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(0.05)  # well inside their loops
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


@contextmanager
def native_hammering(
    batch: Callable[[int], list[Awaitable[object]]],
) -> Iterator[list[BaseException]]:
    """An event loop in a thread awaiting `batch(n)` (coroutines run on the native worker pool,
    which needs no GIL: its threads are inside the core whenever the main thread forks) for
    n = 0, 1, ... until the block ends; errors in the yielded list."""
    stop = threading.Event()
    errors: list[BaseException] = []
    running = threading.Event()

    async def loop() -> None:
        n = 0
        while not stop.is_set():
            await asyncio.gather(*batch(n))
            running.set()
            n += 1

    def run() -> None:
        try:
            asyncio.run(loop())
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            running.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    running.wait(60)
    try:
        yield errors
    finally:
        stop.set()
        thread.join(60)


SMALL_BUDGET = 16


@pytest.fixture
def small_budget() -> Iterator[int]:
    """A small process descriptor budget: the busy threads' calls then also evict and trim, so
    the budget's lists and the caches' LRUs change hands all the time."""
    set_budget(SMALL_BUDGET)
    try:
        yield SMALL_BUDGET
    finally:
        set_budget(None)


def wait_or_kill(pid: int, deadline: float) -> int | None:
    """The child's exit code, or None if it had not exited by `deadline` (it is killed)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_forked(work: Callable[[int], None], index: int) -> int | None:
    """Fork one child that runs `work(index)` and exits (0 on success, 1 on an exception, or
    the code it exits with itself); its exit code, or None if it hung (killed at the
    deadline)."""
    with forking_allowed():
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            work(index)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    return wait_or_kill(pid, CHILD_DEADLINE)


def fork_children(work: Callable[[int], None], forks: int = FORKS) -> list[int]:
    """Fork up to `forks` children, one at a time, each running `work(index)`; the indexes of
    the children that succeeded. Fails if any hung or failed."""
    succeeded: list[int] = []
    hung: list[int] = []
    failed: list[tuple[int, int]] = []
    for index in range(forks):
        code = run_forked(work, index)
        if code is None:
            hung.append(index)
            if len(hung) >= MAX_HUNG:
                break
        elif code != 0:
            failed.append((index, code))
        else:
            succeeded.append(index)
    assert not hung, f"{len(hung)} of {index + 1} forked children hung (killed): {hung}"
    assert not failed, f"children failed (index, exit code): {failed}"
    return succeeded


def native_puts(store: TokenCaptureStore, entries: list[Any]) -> list[Callable[[], Any]]:
    """Starters of the native async puts of `entries` (no Python lock on the way)."""
    lines = [(e.rollout_id, e.model_call_id, canonical_line(e)) for e in entries]
    return [functools.partial(native_job, store._native.submit_put, *line) for line in lines]


def entry_line(rollout_id: str, call: str) -> Any:
    return make_entry(rollout_id, call=call, prompt_token_ids=list(range(40)))


def test_store_puts_and_freezes_in_children_forked_beside_busy_threads(
    tmp_path: Path, small_budget: int
) -> None:
    store = TokenCaptureStore(tmp_path)

    def put(name: str, n: int) -> None:
        # Mostly short calls (each through the descriptor gate and the rollout cache's LRU,
        # no fsync): a fork lands inside one of their mutexes far more often than during a
        # put's fsync.
        if n % 16 == 0:
            entry = entry_line(f"busy-{name}", f"{name}-{n}")
            store._native.put(entry.rollout_id, entry.model_call_id, canonical_line(entry))
        else:
            store._native.is_incomplete(f"busy-{name}")

    def child(index: int) -> None:
        rollout = f"child-{index}"
        for k in range(3):
            store.append(entry_line(rollout, f"c{k}"))
        store.append(entry_line("shared-by-children", f"child-{index}"))
        snapshot = store.freeze_now(rollout)
        assert [e.model_call_id for e in snapshot.entries] == ["c0", "c1", "c2"]
        # The child's descriptor budget is its own: it counts what this child's store keeps,
        # not what the parent's caches held at the fork.
        descriptors = store.stats()["descriptors"]
        assert descriptors["process_held"] == descriptors["open_files"] > 0
        # ... under the limit the parent fixed.
        assert descriptors["process_limit"] == small_budget
        assert descriptors["process_held"] <= small_budget

    retries = native_puts(store, [entry_line(f"native-{k}", "p0") for k in range(NATIVE_BATCH)])

    def repeats(n: int) -> list[Awaitable[object]]:
        # Identical retries: no fsync, just the gate, the cache and the rollout's lock.
        return [retry() for retry in retries]

    with native_hammering(repeats) as native_errors, hammering(put) as errors:
        children = fork_children(child)
    assert not errors and not native_errors, (errors, native_errors)
    check = TokenCaptureStore(tmp_path)
    for index in children:
        snapshot = check.freeze_now(f"child-{index}")
        assert [e.model_call_id for e in snapshot.entries] == ["c0", "c1", "c2"]
        assert not snapshot.incomplete
    shared = check.freeze_now("shared-by-children")
    assert sorted(e.model_call_id for e in shared.entries) == sorted(
        f"child-{index}" for index in children
    )
    # The parent's own object still works after all this (and the busy rollouts are whole).
    store.append(entry_line("after", "a0"))
    assert [e.model_call_id for e in store.freeze_now("after").entries] == ["a0"]


def test_async_puts_in_children_forked_beside_a_busy_event_loop(
    tmp_path: Path, small_budget: int
) -> None:
    """The parent's puts run on the native worker pool behind an event loop in a thread; each
    child runs its own loop on the same store object (a worker pool of its own)."""
    store = TokenCaptureStore(tmp_path)

    retries = native_puts(store, [entry_line(f"busy-{k}", "p0") for k in range(NATIVE_BATCH)])

    def busy(n: int) -> list[Awaitable[object]]:
        # New puts (fsync'ed) beside identical retries (the gate, the cache, the lock only).
        fresh = native_puts(store, [entry_line(f"busy-{k}", f"p{n}") for k in range(4)])
        return [put() for put in [*fresh, *retries]]

    async def child_puts(index: int) -> None:
        rollout = f"child-{index}"
        await asyncio.gather(*(store.put(entry_line(rollout, f"c{k}")) for k in range(4)))
        snapshot = await store.freeze(rollout)
        assert sorted(e.model_call_id for e in snapshot.entries) == ["c0", "c1", "c2", "c3"]

    with native_hammering(busy) as errors:
        children = fork_children(lambda index: asyncio.run(child_puts(index)))
    assert not errors, errors
    check = TokenCaptureStore(tmp_path)
    for index in children:
        lines = check.path_for(f"child-{index}").read_bytes().splitlines()
        assert sorted(lines) == sorted(
            canonical_line(entry_line(f"child-{index}", f"c{k}")) for k in range(4)
        )


def stamped(rollout_id: str, call: str, request: list[dict[str, Any]]) -> Any:
    entry = make_entry(
        rollout_id,
        call=call,
        prompt_token_ids=[1, 2],
        generation_token_ids=[3],
        generation_log_probs=[0.0],
        output_items=[{"role": "assistant", "content": f"answer {call}"}],
    )
    return stamp_lineage(
        stamp_continuation(entry, request), None, parent_resolution=ParentResolutionStatus.ROOT
    )


def test_lineage_resolves_in_children_forked_beside_busy_resolves(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    resolver = FileLineageStore(tmp_path)
    request = [{"role": "user", "content": "question"}]
    store.append(stamped("r", "c0", request))
    follow = [
        *request,
        {"role": "assistant", "content": "answer c0"},
        {"role": "user", "content": "and then?"},
    ]

    def resolved(rollout_id: str) -> tuple[str, str]:
        resolution = resolver.resolve_now(rollout_id, follow)
        match = resolution.match
        return (resolution.status.value, match.model_call_id if match else "")

    assert resolved("r") == ("resolved", "c0")

    def busy(name: str, n: int) -> None:
        answer = resolver._native.resolve("r", follow)
        assert answer is not None and answer[:2] == ("resolved", "c0")

    def child(index: int) -> None:
        assert resolved("r") == ("resolved", "c0")
        # A rollout this child writes, resolved through the inherited resolver.
        store.append(stamped(f"child-{index}", "c0", request))
        assert resolved(f"child-{index}") == ("resolved", "c0")

    with hammering(busy) as errors:
        children = fork_children(child)
    assert not errors, errors
    assert children


def test_ledger_records_in_children_forked_beside_busy_records(
    tmp_path: Path, small_budget: int
) -> None:
    ledger = FileCaptureLedger(tmp_path)

    def busy(name: str, n: int) -> None:
        rollout_id, _, line = commit_line(make_commit(f"{name}-{n}", f"busy-{name}"))
        assert ledger._native.record(rollout_id, line)

    def child(index: int) -> None:
        for k in range(3):
            assert ledger.record_now(make_commit(f"c{k}", f"child-{index}"))
        assert ledger.has_rows_now(f"child-{index}")

    # Built once: the loop's thread then spends its time handing rows to the native workers.
    native_rows = [commit_line(make_commit("c0", f"native-{k}")) for k in range(NATIVE_BATCH)]

    def repeats(n: int) -> list[Awaitable[object]]:
        return [
            native_job(ledger._native.submit_record, rollout_id, line)
            for rollout_id, _, line in native_rows
        ]

    with native_hammering(repeats) as native_errors, hammering(busy) as errors:
        children = fork_children(child)
    assert not errors and not native_errors, (errors, native_errors)
    check = FileCaptureLedger(tmp_path)
    for index in children:
        records = check.manifest_now(f"child-{index}")["records"]
        assert len(records) == 3


def test_staging_stages_and_fetches_in_children_forked_beside_busy_stages(
    tmp_path: Path,
) -> None:
    staging = FileStagingStore(tmp_path, models="tokencapture")

    def busy(name: str, n: int) -> None:
        staging._native.stage(make_record(f"busy-{name}", f"c{n}", [n % 50_000, 1, 2]), None)
        if n % 4 == 0:
            staging._native.fetch([f"busy-{name}/c{n}"])

    def child(index: int) -> None:
        keys = []
        for k in range(3):
            outcome = staging.stage(make_record(f"child-{index}", f"c{k}", [index, k, 7]))
            assert outcome.ok
            keys.append(outcome.staging_key)
        fetched = staging.fetch(keys)
        assert [s.token_ids_delta for s in fetched] == [[index, k, 7] for k in range(3)]

    with hammering(busy) as errors:
        children = fork_children(child)
    assert not errors, errors
    check = FileStagingStore(tmp_path, models="tokencapture")
    for index in children:
        keys = [f"child-{index}/c{k}" for k in range(3)]
        assert [s.token_ids_delta for s in check.fetch(keys)] == [[index, k, 7] for k in range(3)]


def test_an_in_memory_index_inherited_busy_refuses_instead_of_hanging() -> None:
    """The in-memory index has no root to reopen: a child uses its copy of the parent's if no
    thread held it at the fork, and otherwise raises RuntimeError; never hangs."""
    index = _core.MemoryLineage(256, 1 << 30, 1 << 20)
    seed = canonical_line(make_entry("seed", call="c0"))
    assert index.put("seed", seed)

    def busy(name: str, n: int) -> None:
        index.put(f"busy-{n % 32}", canonical_line(make_entry(f"busy-{n % 32}", call=n)))

    outcomes: list[str] = []

    def child(number: int) -> None:
        if not index_usable():
            # Every call refuses (its state stays unknown), without waiting.
            with pytest.raises(RuntimeError, match="in use by another thread when the process"):
                index.put("child", canonical_line(make_entry("child", call="c0")))
            os._exit(3)
        assert index.put("child", canonical_line(make_entry("child", call="c0")))
        assert not index.put("seed", seed)  # the parent's data is there

    def index_usable() -> bool:
        try:
            index.rollout_count()
        except RuntimeError:
            return False
        return True

    def work(number: int) -> None:
        child(number)

    with hammering(busy) as errors:
        for number in range(FORKS):
            code = run_forked(work, number)
            assert code is not None, f"child {number} hung"
            assert code in (0, 3), f"child {number} failed ({code})"
            outcomes.append("used" if code == 0 else "refused")
    assert not errors, errors
    assert "used" in outcomes or "refused" in outcomes


# ---- multiprocessing ------------------------------------------------------------------------

_POOL_STORE: TokenCaptureStore | None = None


def _pool_worker(index: int) -> list[str]:
    """Runs in a forked pool worker, on the store object it inherited."""
    assert _POOL_STORE is not None
    calls = [f"w{index}-{k}" for k in range(3)]
    for call in calls:
        _POOL_STORE.append(entry_line(f"pool-{index}", call))
    return calls


def test_a_fork_pool_created_beside_a_busy_thread_works(tmp_path: Path, small_budget: int) -> None:
    """DataLoader-style workers: a `fork` multiprocessing pool started while another thread is
    putting, its workers then using the store object they inherited."""
    global _POOL_STORE
    _POOL_STORE = store = TokenCaptureStore(tmp_path)

    def busy(name: str, n: int) -> None:
        entry = entry_line(f"busy-{name}", f"{name}-{n}")
        store._native.put(entry.rollout_id, entry.model_call_id, canonical_line(entry))

    retries = native_puts(store, [entry_line(f"native-{k}", "p0") for k in range(NATIVE_BATCH)])

    def repeats(n: int) -> list[Awaitable[object]]:
        return [retry() for retry in retries]

    try:
        with native_hammering(repeats) as native_errors, hammering(busy) as errors:
            for _ in range(3):  # each pool forks its workers anew
                context = multiprocessing.get_context("fork")
                with forking_allowed():
                    pool = context.Pool(4)
                try:
                    result = pool.map_async(_pool_worker, range(8))
                    try:
                        written = result.get(timeout=60)
                    except multiprocessing.TimeoutError:
                        pytest.fail("a forked pool worker hung")
                finally:
                    pool.terminate()
                    pool.join()
        assert not errors and not native_errors, (errors, native_errors)
    finally:
        _POOL_STORE = None
    check = TokenCaptureStore(tmp_path)
    for index, calls in enumerate(written):
        assert [e.model_call_id for e in check.freeze_now(f"pool-{index}").entries] == calls


def test_python_locks_held_by_another_thread_at_the_fork_are_renewed_in_the_child(
    tmp_path: Path,
) -> None:
    """Every Python lock the package keeps, held by another thread while the main thread
    forks: the child's calls that take them finish (without `tokencapture.forking` each
    waits forever for a lock copied held)."""
    from tokencapture import _otel, jobs, metrics

    store = TokenCaptureStore(tmp_path / "store")
    lineage = FileLineageStore(tmp_path / "store")
    store.append(entry_line("warm", "w0"))  # the recorders exist before the fork
    recorder = store._metrics._otel
    assert recorder is not None, "opentelemetry-api is a test dependency"
    holders = {
        "store metrics": lambda: store._metrics._lock,
        "metrics OpenTelemetry loader": lambda: metrics._otel_lock,
        "OpenTelemetry instruments": lambda: _otel._lock,
        "OpenTelemetry recorder": lambda: recorder._lock,
        "thread pool": lambda: jobs._executor_lock,
        "lineage's capture ledger": lambda: lineage._ledger_lock,
    }

    def child(held: int, index: int) -> None:
        rollout = f"child-{held}-{index}"
        store.append(entry_line(rollout, "c0"))  # metrics + recorder locks
        store.freeze_now(rollout)
        assert store.stats()["put"]["count"] >= 2
        jobs.io_executor().submit(int).result(10)  # the pool is made anew in the child
        lineage._capture_ledger()

    for held, (name, lock_of) in enumerate(holders.items()):
        lock = lock_of()
        taken, release = threading.Event(), threading.Event()

        def hold(
            lock: Any = lock, taken: threading.Event = taken, release: threading.Event = release
        ) -> None:
            with lock:
                taken.set()
                release.wait(60)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert taken.wait(10), name
        try:
            fork_children(functools.partial(child, held), forks=1)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        finally:
            release.set()
            holder.join(10)


# A forked child holds a copy of every descriptor its parent had open, the kept lock files of
# the store and the resolver among them, and a copy shares its open file description and so
# its flock. When an operation of the parent locks such a descriptor and then fails, it must
# release the lock: closing its descriptor alone would leave the lock held by the child's copy
# for as long as the child lives, and every reader and writer of that rollout, in every
# process, would wait for the child to exit.


@contextmanager
def idle_child() -> Iterator[int]:
    """A forked child that only sleeps, holding what it inherited, until the block ends."""
    with forking_allowed():
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        time.sleep(60)
        os._exit(0)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def lock_is_free(lock_path: Path) -> bool:
    """Whether another process could lock the rollout exclusively now (without waiting)."""
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_put_that_fails_after_a_fork_leaves_the_rollout_unlocked(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(entry_line("r", "c0"))
    store.append(entry_line("r", "c1"))  # the store keeps r's lock file open
    with idle_child():
        os.truncate(store.path_for("r"), 10)  # the log cut below its index
        with pytest.raises(TokenCaptureCorruptionError):
            store.append(entry_line("r", "c2"))
        assert lock_is_free(tmp_path / "r.tokens.lock"), "r stays locked by the child"


def test_a_resolve_that_fails_after_a_fork_leaves_the_rollout_unlocked(tmp_path: Path) -> None:
    request: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    output = [{"role": "assistant", "content": "answer c0"}]
    store = TokenCaptureStore(tmp_path)
    store.append(stamped("r", "c0", request))
    resolver = FileLineageStore(tmp_path)
    continuation = [*request, *output, {"role": "user", "content": "more"}]
    assert resolver.resolve_now("r", continuation).status is ParentResolutionStatus.RESOLVED
    with idle_child():
        with open(store.path_for("r"), "ab") as log:
            log.write(b"not json\n")
        with pytest.raises(TokenCaptureCorruptionError):
            resolver.resolve_now("r", continuation)
        assert lock_is_free(tmp_path / "r.tokens.lock"), "r stays locked by the child"


# A parent that dies while it holds a rollout's lock (SIGKILL mid-put) runs no unlock: a
# child's copy of that lock descriptor would keep the lock held for as long as the child
# lives. So a forked child gives up its copies of the parent's lock file descriptors first
# thing (tokencapture.forking's after-fork hook puts /dev/null in their place).


def descriptors_naming(paths: set[Path]) -> list[int]:
    """This process's descriptors that refer to any of `paths`."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the listing's own descriptor, gone already
            continue
        if Path(target) in paths:
            found.append(int(name))
    return found


def test_a_forked_child_holds_no_lock_file_of_its_parent(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path / "tokens")
    store.append(stamped("r", "c0", [{"role": "user", "content": "go"}]))
    store.append(entry_line("r", "c1"))  # the store keeps r's lock file open
    resolver = FileLineageStore(tmp_path / "tokens")
    continuation = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "answer c0"},
        {"role": "user", "content": "more"},
    ]
    resolver.resolve_now("r", continuation)  # and so does the resolver
    staging = FileStagingStore(tmp_path / "staging")
    # And the staging store its store.lock and, locked for its life, the segment it writes.
    assert staging.stage(make_record("s", "c0")).ok
    segments = set((tmp_path / "staging").glob("seg-*.tcs"))
    assert len(segments) == 1
    locks = {tmp_path / "tokens" / "r.tokens.lock", tmp_path / "staging" / "store.lock"}
    locks |= segments
    assert len(descriptors_naming(locks)) >= 4, "the parent keeps its lock files open"

    def child(_: int) -> None:
        if descriptors_naming(locks):
            os._exit(3)  # a copy of a parent's lock descriptor survived the fork
        # The child's own objects lock and keep their own descriptors as usual.
        TokenCaptureStore(tmp_path / "tokens").append(entry_line("r", "child"))
        assert FileStagingStore(tmp_path / "staging").stage(make_record("s", "child")).ok

    assert run_forked(child, 0) == 0
    # The parent's descriptors are untouched: it goes on locking through them.
    store.append(entry_line("r", "c2"))
    assert staging.stage(make_record("s", "c1")).ok
    assert len(descriptors_naming(locks)) >= 4


def test_a_parent_killed_mid_put_leaves_no_lock_held_through_its_child(tmp_path: Path) -> None:
    for attempt in range(3):  # without the hook, a kill lands while the lock is held ~4 in 5
        root = tmp_path / f"attempt-{attempt}"
        read_end, write_end = os.pipe()
        with forking_allowed():
            writer = os.fork()
        if writer == 0:  # the writer: never returns into pytest
            try:
                os.close(read_end)
                store = TokenCaptureStore(root)
                store.append(entry_line("r", "first"))  # r's lock file kept from here on
                with forking_allowed():
                    idle = os.fork()
                if idle == 0:
                    time.sleep(60)
                    os._exit(0)
                os.write(write_end, f"{idle}\n".encode())
                n = 0
                while True:
                    store.append(entry_line("r", f"c{n}"))
                    n += 1
            finally:
                os._exit(1)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            idle = int(pipe.readline())
        try:
            time.sleep(0.3)
            os.kill(writer, signal.SIGKILL)
            os.waitpid(writer, 0)
            deadline = time.monotonic() + 5
            while not lock_is_free(root / "r.tokens.lock"):
                assert time.monotonic() < deadline, "r stays locked by the dead writer's child"
                time.sleep(0.05)
        finally:
            os.kill(idle, signal.SIGKILL)
            with suppress(ChildProcessError):  # not ours: the writer's child
                os.waitpid(idle, 0)


def test_a_forked_child_keeps_what_reused_the_number_of_a_closed_lock_file(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "tokens" / "r.tokens.lock"
    store = TokenCaptureStore(tmp_path / "tokens")
    store.append(entry_line("r", "c0"))
    store.append(entry_line("r", "c1"))
    numbers = set(descriptors_naming({lock}))
    assert numbers, "the store keeps r's lock file open"
    del store
    gc.collect()
    assert not descriptors_naming({lock}), "the store's lock descriptor is closed"
    # Files opened now take the lowest free numbers, the lock file's among them.
    others = [open(tmp_path / f"other-{i}", "w") for i in range(64)]  # noqa: SIM115
    try:
        assert numbers & {f.fileno() for f in others}, "a lock file's number was reused"
        expected = {f.fileno(): Path(f.name) for f in others}

        def child(_: int) -> None:
            for fd, path in expected.items():
                if Path(os.readlink(f"/proc/self/fd/{fd}")) != path:
                    os._exit(3)  # the hook replaced a descriptor that is no lock file

        assert run_forked(child, 0) == 0
    finally:
        for f in others:
            f.close()
