"""The descriptor budget and running out of descriptors (issue 24, docs/reliability.md).

Each scenario runs in a fresh interpreter whose soft `RLIMIT_NOFILE` is set to 256 before
tokencapture is imported (the budget is a share of the limit the process has when its stores
are made), and reports what it saw as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry

from tokencapture import (
    FileCaptureLedger,
    FileLineageStore,
    FileStagingStore,
    InMemoryLineageStore,
    TokenCaptureStore,
)
from tokencapture.descriptors import budget, check_max_open_files, set_budget

REPO = Path(__file__).resolve().parent.parent

PRELUDE = """
import resource, sys
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, _hard))
import asyncio, errno, json, os, socket
from pathlib import Path
from tests.conftest import make_entry
from tokencapture import (
    FileCaptureLedger,
    FileLineageStore,
    InMemoryLineageStore,
    TokenCaptureStore,
)
from tokencapture.descriptors import budget
ROOT = Path(sys.argv[1])

def open_fds():
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
"""


def run_limited(tmp_path: Path, body: str, *, limit: int = 256, timeout: float = 600) -> Any:
    """Run `body` (after PRELUDE) under a soft descriptor limit; its last stdout line as JSON."""
    script = PRELUDE.format(limit=limit) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    env.pop("TOKENCAPTURE_MAX_OPEN_FILES", None)
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


WORKLOAD = """
ROLLOUTS, CONCURRENT, CALLS = {rollouts}, 64, 4

async def main():
    baseline = open_fds()
    store = TokenCaptureStore(ROOT)
    errors = []
    gate = asyncio.Semaphore(CONCURRENT)

    async def rollout(r):
        async with gate:
            for c in range(CALLS):
                entry = make_entry(f"r{{r:05d}}", call=c)
                try:
                    await store.begin_call(entry.rollout_id, entry.model_call_id)
                    await store.put(entry)
                except OSError as exc:
                    errors.append(repr(exc))

    await asyncio.gather(*(rollout(r) for r in range(ROLLOUTS)))

    async def freeze(r):
        try:
            return await store.freeze(f"r{{r:05d}}")
        except OSError as exc:
            errors.append(repr(exc))
            return None

    snapshots = await asyncio.gather(*(freeze(r) for r in range(ROLLOUTS)))
    whole = sum(
        1 for s in snapshots
        if s is not None and len(s.entries) == CALLS and not s.incomplete
    )
    stats = store.stats()["descriptors"]
    print(json.dumps({{
        "errors": errors[:5], "error_count": len(errors), "whole": whole,
        "store_open": stats["open_files"], "process_held": stats["process_held"],
        "limit": stats["process_limit"], "at_rest_over_baseline": open_fds() - baseline,
        "evicted": stats["process_evicted"],
    }}))

asyncio.run(main())
"""


def test_the_256_descriptor_workload_completes_whole_within_the_budget(tmp_path: Path) -> None:
    """2,000 rollouts, 64 at a time, 4 calls each (intent, then put), then every one frozen
    concurrently: with the soft limit at 256 nothing fails, every rollout is whole, and at
    rest the store keeps no more than its budget (a sixteenth of the limit)."""
    seen = run_limited(tmp_path, WORKLOAD.format(rollouts=2000))
    assert seen["error_count"] == 0, seen["errors"]
    assert seen["whole"] == 2000
    assert seen["limit"] == 16
    assert 0 < seen["store_open"] <= 16
    assert seen["process_held"] == seen["store_open"]
    # The whole process: the kept descriptors, the event loop's doorbell, the thread pool.
    assert seen["at_rest_over_baseline"] <= 16 + 4
    assert seen["evicted"] > 0  # the cache really was smaller than the working set


def test_under_a_64_limit_operations_in_flight_leave_room_for_each_other(tmp_path: Path) -> None:
    """Under 256 the budget's floor (16) is more than a sixteenth of the limit: the gate must
    still admit only a sixteenth (4 at 64), or 16 operations holding up to five descriptors
    each exhaust the process themselves and closing the caches cannot help them."""
    seen = run_limited(tmp_path, WORKLOAD.format(rollouts=300), limit=64)
    assert seen["error_count"] == 0, seen["errors"]
    assert seen["whole"] == 300
    assert seen["limit"] == 16


LOWERED = """
async def main():
    store = TokenCaptureStore(ROOT)
    gate = asyncio.Semaphore(64)
    errors = {{"a": [], "b": [], "c": []}}

    async def rollout(prefix, r):
        async with gate:
            for c in range(4):
                try:
                    await store.put(make_entry(f"{{prefix}}{{r}}", call=c))
                except OSError as exc:
                    errors[prefix].append(repr(exc))

    async def whole(prefix, count):
        snapshots = [await store.freeze(f"{{prefix}}{{r}}") for r in range(count)]
        return sum(len(snapshot.entries) == 4 for snapshot in snapshots)

    await asyncio.gather(*(rollout("a", r) for r in range(200)))
    before = budget()["limit"]
    # The server lowers its limit after the store was made (and filled its cache), while 64
    # rollouts' puts keep coming: the ones already running when it runs out may fail.
    resource.setrlimit(resource.RLIMIT_NOFILE, (96, _hard))
    await asyncio.gather(*(rollout("b", r) for r in range(600)))
    after = budget()["limit"]
    # From then on the budget and the gate fit the lower limit: nothing fails.
    await asyncio.gather(*(rollout("c", r) for r in range(600)))
    print(json.dumps({{"before": before, "after": after,
                      "errors": {{k: v[:3] for k, v in errors.items()}},
                      "error_count": {{k: len(v) for k, v in errors.items()}},
                      "whole": {{"b": await whole("b", 600), "c": await whole("c", 600)}}}}))

asyncio.run(main())
"""


def test_a_limit_lowered_after_the_store_was_made_shrinks_the_budget(tmp_path: Path) -> None:
    """The first open that runs out re-reads the soft limit: the budget and the in-flight
    gate shrink to it. Puts already running then (64 at most, admitted under the old limit)
    may fail with EMFILE; from then on the workload goes on without errors."""
    seen = run_limited(tmp_path, LOWERED.format(), limit=1024)
    counts = seen["error_count"]
    assert counts["a"] == 0 and counts["c"] == 0, seen["errors"]
    assert counts["b"] <= 64, seen["errors"]
    assert seen["whole"]["c"] == 600
    assert seen["whole"]["b"] >= 600 - counts["b"]  # a failed put leaves its rollout short
    assert seen["before"] == 64
    assert seen["after"] == 16


def test_at_a_1024_limit_the_store_keeps_a_sixteenth(tmp_path: Path) -> None:
    seen = run_limited(tmp_path, WORKLOAD.format(rollouts=300), limit=1024)
    assert seen["error_count"] == 0 and seen["whole"] == 300
    assert seen["limit"] == 64
    assert 0 < seen["store_open"] <= 64


BUSY_SERVER = (
    """
# The server's own sockets, held for the whole run: 56 of the 256 descriptors are left.
sockets = [socket.socket() for _ in range(256 - 56 - open_fds())]
"""
    + WORKLOAD
)


def test_a_busy_server_leaving_few_descriptors_fails_almost_nothing(tmp_path: Path) -> None:
    """The server holds 200 of the 256 descriptors all along; 64 rollouts at a time each put
    four calls. The store learns from its first exhaustion how many operations the rest
    holds (the ones running, less one) and admits no more, growing back one at a time only
    when the descriptors for one more are free: a few operations of the first wave may fail,
    then none. (Admitting its usual sixteen, 1,352 of 8,000 operations failed and 225
    sockets failed 6,585; NeMo Gym's store, six threads, failed none.)"""
    seen = run_limited(tmp_path, BUSY_SERVER.format(rollouts=600), limit=256)
    assert seen["error_count"] <= 16, (seen["error_count"], seen["errors"])
    assert all("Too many open files" in error for error in seen["errors"])
    assert seen["whole"] >= 600 - seen["error_count"]


# A server's sockets in the same process: `exhaust()` opens them until the process is out of
# descriptors, `release()` closes them.
SOCKET_NEIGHBOUR = """
held = []

def exhaust():
    while True:
        try:
            held.append(socket.socket())
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            return

def release():
    while held:
        held.pop().close()
"""


NEIGHBOUR = (
    SOCKET_NEIGHBOUR
    + """
store = TokenCaptureStore(ROOT)
for r in range(20):
    for c in range(2):
        store.append(make_entry(f"warm{{r}}", call=c))
cached_before = store.stats()["descriptors"]["open_files"]

# 1. Exhausted by the neighbour, with cached descriptors to give back: puts succeed.
exhaust()
store.append(make_entry("fresh1", call=0))       # a new rollout: opens lock, log, state
store.append(make_entry("warm0", call=5))        # an evicted one: reopens its files
survived = [len(store.freeze_now("fresh1").entries), len(store.read_entries("warm0"))]
after_eviction = budget()

# 2. Literally nothing to give back: the caches are empty, the neighbour holds every
# descriptor. The operation fails cleanly with EMFILE and leaves no file behind.
store._native.clear()
exhaust()
failure = None
try:
    store.append(make_entry("fresh2", call=0))
except OSError as exc:
    failure = [exc.errno, str(exc)]
# (stat needs no descriptor; listing the directory would)
suffixes = ("jsonl", "state.json", "state.json.tmp", "intents", "incomplete", "lock")
fresh2_files = [s for s in suffixes if (ROOT / f"fresh2.tokens.{{s}}").exists()]

# 3. The neighbour lets go: everything works again, in this process, without a restart.
release()
async def later():
    await store.put(make_entry("fresh2", call=0))
    await store.put(make_entry("fresh3", call=0))
    for r in range(20):
        await store.put(make_entry(f"warm{{r}}", call=9))
    snaps = [await store.freeze(f"warm{{r}}") for r in range(20)]
    return [len(s.entries) for s in snaps], len((await store.freeze("fresh2")).entries)
warm, fresh2 = asyncio.run(later())
print(json.dumps({{
    "cached_before": cached_before, "survived": survived,
    "exhausted": after_eviction["exhausted"], "failure": failure,
    "fresh2_files": fresh2_files, "warm": warm, "fresh2": fresh2,
    "failed": budget()["failed"],
}}))
"""
)


FIRST_ASYNC_CALL = (
    SOCKET_NEIGHBOUR
    + """
store = TokenCaptureStore(ROOT)
async def first():
    exhaust()  # before the loop's first native job: its completion queue cannot be made
    try:
        await store.put(make_entry("r", call=0))
    except OSError as exc:
        return [exc.errno, str(exc)]
    finally:
        release()
failure = asyncio.run(first())
release()
async def again():
    await store.put(make_entry("r", call=0))
    return len((await store.freeze("r")).entries)
print(json.dumps({{"failure": failure, "again": asyncio.run(again())}}))
"""
)


def test_a_loop_whose_completion_queue_cannot_be_made_says_errno_24(tmp_path: Path) -> None:
    """An event loop's first async call makes its completion queue (an eventfd): with every
    descriptor taken it raises OSError with errno 24 and the store's words, as every open does
    (it was an OSError without an errno, its message the bare system error)."""
    seen = run_limited(tmp_path, FIRST_ASYNC_CALL.format())
    errno_, message = seen["failure"]
    assert errno_ == 24
    assert "make the completion queue failed" in message and "retrying" in message
    assert seen["again"] == 1


def test_a_socket_hungry_neighbour_exhausting_the_limit(tmp_path: Path) -> None:
    """A neighbour in the same process opens sockets until EMFILE. While the store's caches
    hold descriptors, its operations succeed by closing them (evict, retry once); with
    literally none to give back an operation raises OSError(EMFILE) and creates nothing; once
    the neighbour lets go, every operation succeeds again without a restart."""
    seen = run_limited(tmp_path, NEIGHBOUR.format())
    assert seen["cached_before"] > 0
    assert seen["survived"] == [1, 3]
    assert seen["exhausted"] >= 1
    errno_, message = seen["failure"]
    assert errno_ == 24
    assert "Too many open files" in message and "retrying" in message
    assert seen["fresh2_files"] == []
    assert seen["failed"] == 1
    assert seen["warm"] == [4] + [3] * 19  # warm0 also took call 5 while exhausted
    assert seen["fresh2"] == 1


POOL_THREADS = """
def pool_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{task}}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # a thread that exited meanwhile
            pass
    return sum(1 for name in names if name.startswith("tokencapture-io"))

async def main():
    store = TokenCaptureStore(ROOT)
    async def rollout(r):
        for c in range(3):
            await store.put(make_entry(f"r{{r:03d}}", call=c))
    # 64 rollouts at once: as many jobs as the pool's old size, queued together.
    await asyncio.gather(*(rollout(r) for r in range(64)))
    whole = sum([len((await store.freeze(f"r{{r:03d}}")).entries) == 3 for r in range(64)])
    return pool_threads(), whole

threads, whole = asyncio.run(main())
print(json.dumps({{"threads": threads, "whole": whole}}))
"""


def test_the_worker_pool_keeps_no_more_threads_than_the_gate_admits(tmp_path: Path) -> None:
    """At a soft limit of 128 the in-flight gate admits 8 file operations at once: the native
    worker pool runs at most 8 threads for 64 concurrent rollouts (it kept 64, 56 of them only
    ever waiting at the gate), counted in ``/proc/self/task`` by their names."""
    seen = run_limited(tmp_path, POOL_THREADS.format(), limit=128)
    assert seen["whole"] == 64
    assert 1 <= seen["threads"] <= 8, seen


EXHAUSTION_WORDS = (
    SOCKET_NEIGHBOUR
    + """
from tests.staging_backends import make_record
from tokencapture import FileStagingStore

# A staging fetch's segment open retries after closing every cached descriptor of the
# process, the segment its own store writes included (max_open_files=1 keeps only that one):
# it once closed only its store's kept lock, found none here, and failed.
staging = FileStagingStore(ROOT / "staging", max_open_files=1)
assert staging.stage(make_record()).ok
assert len(staging.fetch(["r/c1"])) == 1
exhausted = budget()["exhausted"]
exhaust()
try:
    local = len(staging.fetch(["r/c1"]))
except OSError as exc:
    local = [exc.errno, str(exc)]
release()
local_exhausted = budget()["exhausted"] - exhausted

# A token store's open retries after closing every cached descriptor of the process.
store = TokenCaptureStore(ROOT / "tokens")
store._native.clear()
exhaust()
try:
    store.append(make_entry("r", call=0))
    everything = None
except OSError as exc:
    everything = [exc.errno, str(exc)]
release()
print(json.dumps({{"local": local, "local_exhausted": local_exhausted, "everything": everything}}))
"""
)


def test_an_exhaustion_says_whether_every_descriptor_was_closed(tmp_path: Path) -> None:
    """Only an open that closed every descriptor tokencapture kept and retried
    (`descriptors::retry`) says so (an exhaustion met anywhere else says only that the limit
    was reached: the core's unit tests check those words, no open of the core is left
    outside the retry). A staging fetch is one of them now: it once closed only its own
    store's kept lock, and failed where the segment its store writes could be closed."""
    seen = run_limited(tmp_path, EXHAUSTION_WORDS.format())
    assert seen["local"] == 1, seen["local"]
    assert seen["local_exhausted"] == 1
    errno_, words = seen["everything"]
    assert errno_ == 24 and "even after closing every descriptor" in words, words


EVERY_OPERATION = (
    SOCKET_NEIGHBOUR
    + """
store = TokenCaptureStore(ROOT)
resolver = FileLineageStore(ROOT)
ledger = FileCaptureLedger(ROOT)
loop = asyncio.new_event_loop()  # made before the exhaustion (its own self-pipe)
run = loop.run_until_complete
asked = [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "a"}}]
operations = {{
    "append": lambda r: store.append(make_entry(r, call=1)),
    "begin_call": lambda r: store._begin_call(r, "call-9"),
    "mark_incomplete": lambda r: store._mark_incomplete(r, "call-9"),
    "freeze_now": lambda r: store.freeze_now(r),
    "freeze_columns_now": lambda r: store.freeze_columns_now(r),
    "read_columns": lambda r: store.read_columns(r),
    "read_entries": lambda r: store.read_entries(r),
    "is_incomplete": lambda r: store.is_incomplete(r),
    "inspect": lambda r: store.inspect(r),
    "retire_now": lambda r: store.retire_now([r]),
    "delete_now": lambda r: store.delete_now([r]),
    "sweep_retired": lambda r: store.sweep_retired(0),  # r retired beforehand
    "put": lambda r: run(store.put(make_entry(r, call=2))),
    "freeze": lambda r: run(store.freeze(r)),
    "resolve": lambda r: run(resolver.resolve(r, asked)),
    "record_failure": lambda r: run(ledger.record_failure(r, "call-5", "why")),
    "manifest": lambda r: run(ledger.manifest(r)),
    "ledger_retire": lambda r: ledger.retire_now([r]),
}}
failed = {{}}
for n, (name, operation) in enumerate(operations.items()):
    for w in range(6):  # something cached to give back, in every cache
        store.append(make_entry(f"warm{{w}}", call=n))
        run(resolver.resolve(f"warm{{w}}", asked))
        ledger.record_failure_now(f"warm{{w}}", f"call-{{n}}", "why")
    rollout = f"r{{n}}"
    store.append(make_entry(rollout, call=0))
    if name == "sweep_retired":
        store.retire_now([rollout])
    exhaust()  # after the last open, so that only the caches hold descriptors to give back
    try:
        operation(rollout)
    except OSError as exc:
        failed[name] = str(exc)
    release()
print(json.dumps({{"failed": failed, "exhausted": budget()["exhausted"]}}))
"""
)


def test_with_cached_descriptors_to_give_back_every_operation_survives_exhaustion(
    tmp_path: Path,
) -> None:
    """Each operation of the store, the resolver and the ledger, run while a neighbour holds
    every free descriptor and the caches hold some: each succeeds by closing cached ones
    (the sweep's directory listing once did not go through the retry)."""
    seen = run_limited(tmp_path, EVERY_OPERATION.format())
    assert seen["failed"] == {}
    assert seen["exhausted"] >= 10


LINEAGE_AND_LEDGER = """
from tests.test_ledger import make_commit

ROLLOUTS = 600

async def main():
    baseline = open_fds()
    store = TokenCaptureStore(ROOT)
    resolver = FileLineageStore(ROOT)
    ledger = FileCaptureLedger(ROOT / "ledger")
    gate = asyncio.Semaphore(64)
    errors = []
    items = [
        {{"role": "user", "content": "q"}},
        {{"role": "assistant", "content": "an answer nobody stored"}},
        {{"role": "user", "content": "more"}},
    ]

    async def one(r):
        async with gate:
            rid = f"r{{r:04d}}"
            try:
                await store.put(make_entry(rid, call=0))
                resolution = await resolver.resolve(rid, items)
                await ledger.record(make_commit("c1", rid))
                await ledger.record(make_commit("c2", rid))
                manifest = await ledger.manifest(rid)
                return resolution.status.value, len(manifest["records"])
            except OSError as exc:
                errors.append(repr(exc))
                return None

    answers = await asyncio.gather(*(one(r) for r in range(ROLLOUTS)))
    print(json.dumps({{
        "errors": errors[:5], "error_count": len(errors),
        "answers": sorted({{json.dumps(a) for a in answers}}),
        "resolver_open": resolver.stats()["descriptors"]["open_files"],
        "ledger_open": ledger.stats()["descriptors"]["open_files"],
        "process_held": budget()["held"], "limit": budget()["limit"],
        "at_rest_over_baseline": open_fds() - baseline,
    }}))

asyncio.run(main())
"""


def test_the_resolver_and_the_ledger_under_the_256_limit(tmp_path: Path) -> None:
    seen = run_limited(tmp_path, LINEAGE_AND_LEDGER.format())
    assert seen["error_count"] == 0, seen["errors"]
    assert seen["answers"] == [json.dumps(["unresolved", 2])]
    assert seen["limit"] == 16
    assert seen["process_held"] <= 16
    assert seen["resolver_open"] + seen["ledger_open"] <= seen["process_held"]
    assert seen["at_rest_over_baseline"] <= 16 + 4


def test_max_open_files_caps_one_store_and_stats_report_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path / "capped", max_open_files=4)
    for r in range(10):
        store.append(make_entry(f"r{r}", call=0))
    stats = store.stats()["descriptors"]
    assert stats["max_open_files"] == 4
    assert 0 < stats["open_files"] <= 4
    none = TokenCaptureStore(tmp_path / "none", max_open_files=0)
    none.append(make_entry("r", call=0))
    none.append(make_entry("r", call=1))
    assert none.stats()["descriptors"]["open_files"] == 0
    assert [e.model_call_id for e in none.freeze_now("r").entries] == ["call-0", "call-1"]
    uncapped = TokenCaptureStore(tmp_path / "uncapped")
    assert uncapped.stats()["descriptors"]["max_open_files"] is None
    resolver = FileLineageStore(tmp_path / "capped", max_open_files=0)
    assert resolver.stats()["descriptors"]["max_open_files"] == 0
    ledger = FileCaptureLedger(tmp_path / "ledger", max_open_files=2)
    assert ledger.stats()["descriptors"]["max_open_files"] == 2


@pytest.mark.parametrize(
    ("value", "warned"), [("abc", True), ("-1", True), ("5_000", True), (" 64 ", False)]
)
def test_a_malformed_env_budget_is_reported_not_silently_ignored(value: str, warned: bool) -> None:
    """The core ignores a TOKENCAPTURE_MAX_OPEN_FILES that is not a count: importing the
    package says so (a RuntimeWarning naming the value), and a count is taken quietly."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tokencapture.descriptors import budget; print(budget()['limit'])",
        ],
        env={**os.environ, "TOKENCAPTURE_MAX_OPEN_FILES": value},
        capture_output=True,
        text=True,
        check=True,
    )
    assert ("RuntimeWarning" in done.stderr and repr(value) in done.stderr) is warned, done.stderr
    if not warned:
        assert done.stdout.strip() == "64"


def test_max_open_files_is_checked() -> None:
    for bad in (True, 1.5, "3"):
        with pytest.raises(TypeError):
            check_max_open_files(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        check_max_open_files(-1)
    with pytest.raises(ValueError):
        TokenCaptureStore("/nonexistent-never-created", max_open_files=-1)
    with pytest.raises(ValueError, match="cached_rollouts"):
        TokenCaptureStore("/nonexistent-never-created", cached_rollouts=-1)
    # 0 is refused by the store as by the ledger and the resolver (the store took it as 1).
    for make in (
        lambda: TokenCaptureStore("/nonexistent-never-created", cached_rollouts=0),
        lambda: FileCaptureLedger("/nonexistent-never-created", cached_rollouts=0),
        lambda: FileLineageStore("/nonexistent-never-created", max_cached_rollouts=0),
    ):
        with pytest.raises(ValueError, match="cached_rollouts must be at least 1"):
            make()
    assert not Path("/nonexistent-never-created").exists()
    with pytest.raises(TypeError, match="cached_rollouts"):
        TokenCaptureStore("/nonexistent-never-created", cached_rollouts="8")  # type: ignore[arg-type]


def test_huge_caps_and_cache_sizes_mean_unbounded(tmp_path: Path) -> None:
    """A cap or cache size past what the core counts in is no cap (not an OverflowError), and
    a cache's size is a bound, not an allocation made up front (which panicked or took
    gigabytes)."""
    huge = 10**30
    for size in (2**62, huge):
        store = TokenCaptureStore(tmp_path, cached_rollouts=size, max_open_files=huge)
        store.append(make_entry("r", call=0))
        assert len(store.freeze_now("r").entries) == 1
        assert store.stats()["descriptors"]["max_open_files"] == sys.maxsize
        store.delete_now(["r"])
        ledger = FileCaptureLedger(tmp_path, cached_rollouts=size, max_open_files=huge)
        assert ledger.record_failure_now("r", "call-0", "test")
        resolver = FileLineageStore(tmp_path, max_cached_rollouts=size, max_open_files=huge)
        assert resolver.stats()["descriptors"]["max_open_files"] == sys.maxsize
        InMemoryLineageStore(max_rollouts=size, max_tokens=huge)
    staging = FileStagingStore(tmp_path / "staging", max_open_files=huge)
    assert staging.stats()["descriptors"]["max_open_files"] == sys.maxsize
    try:
        set_budget(huge)
        assert budget()["limit"] == sys.maxsize
    finally:
        set_budget(None)


def test_lowering_the_process_budget_closes_what_is_over_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    for r in range(6):
        store.append(make_entry(f"r{r}", call=0))
    assert store.stats()["descriptors"]["open_files"] >= 6
    before = budget()["limit"]
    try:
        set_budget(3)
        assert budget()["limit"] == 3
        assert budget()["held"] <= 3
        assert store.stats()["descriptors"]["open_files"] <= 3
    finally:
        set_budget(None)
    assert budget()["limit"] == before


KEPT_LOCKS = """
from tokencapture.descriptors import set_budget

def fds_on(path):
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return count

async def main():
    store = TokenCaptureStore(ROOT, max_open_files=0)  # keeps nothing of its own
    for r in range(3):
        await store.put(make_entry(f"r{r}", call=0))
    items = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "an answer nobody stored"},
    ]
    lock0 = ROOT / "r0.tokens.lock"
    seen = {"before": [budget()["held"], fds_on(lock0)]}
    resolver = FileLineageStore(ROOT)
    for r in range(3):
        assert (await resolver.resolve(f"r{r}", items)).status.value == "unresolved"
    stats = resolver.stats()["descriptors"]
    seen["three"] = [stats["open_files"], stats["process_held"], fds_on(lock0)]
    await resolver.resolve("r0", items)
    seen["again"] = [resolver.stats()["descriptors"]["open_files"], fds_on(lock0)]
    evicted = budget()["evicted"]
    set_budget(2)  # r0 was used last: r1 and r2 go, each with its log and lock file
    seen["budget_2"] = [
        resolver.stats()["descriptors"]["open_files"], budget()["held"],
        budget()["evicted"] - evicted,
        [fds_on(ROOT / f"r{r}.tokens.lock") for r in range(3)],
    ]
    set_budget(None)
    capped = FileLineageStore(ROOT, max_open_files=3)
    for r in range(3):
        await capped.resolve(f"r{r}", items)
    seen["capped"] = [
        capped.stats()["descriptors"]["open_files"],
        [fds_on(ROOT / f"r{r}.tokens.lock") for r in range(3)],
    ]
    await resolver.close()
    await capped.close()
    seen["closed"] = [
        budget()["held"], [fds_on(ROOT / f"r{r}.tokens.lock") for r in range(3)],
    ]
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_a_resolver_keeps_each_rollouts_lock_file_counted_and_evictable(tmp_path: Path) -> None:
    """Between resolves a resolver keeps a rollout's log and its lock file open (2 each): both
    count in `stats()` and towards the process budget, are reused, and go when evicted."""
    seen = run_limited(tmp_path, KEPT_LOCKS)
    assert seen["before"] == [0, 0]
    assert seen["three"] == [6, 6, 1]
    assert seen["again"] == [6, 1]
    assert seen["budget_2"] == [2, 2, 2, [1, 0, 0]]
    # Cap 3: one rollout's pair fits; the last one resolved (r2) is kept.
    assert seen["capped"] == [2, [1, 0, 1]]
    assert seen["closed"] == [0, [0, 0, 0]]


# The worker-owned staging store under the same rule: its kept descriptors (the segment it
# writes, its store lock) are a cache of the process budget, closed like any other when an
# open runs out, and every open of its reads, folds, stages and removals goes through
# `descriptors::retry`.
STAGING_PRELUDE = (
    SOCKET_NEIGHBOUR
    + """
from tests.staging_backends import make_record
from tokencapture import FileStagingStore

calls = iter(range(10**6))

def stage_one(store, rollout="w"):
    result = store.stage(make_record(rollout, f"c{{next(calls)}}"), attachments={{"raw": b"\\x01"}})
    assert result.ok, result.error
    return result.staging_key

def attempt(operation):
    try:
        return ["ok", operation()]
    except OSError as exc:
        return ["err", exc.errno, str(exc)]
"""
)

STAGING_EVERY_OPERATION = (
    STAGING_PRELUDE
    + """
store = FileStagingStore(ROOT / "staging")
other = FileStagingStore(ROOT / "other")  # another staging store of the same process
key = stage_one(store, "r")
operations = {{
    "fetch": lambda fresh: len(store.fetch([key])),
    "fetch_records": lambda fresh: len(store.fetch_records([key])),
    "fetch_attachments": lambda fresh: sorted(store.fetch_attachments(key)),
    # A reader that never folded: its fetch locks, reads the control log and the tails.
    "fresh_fetch": lambda fresh: len(fresh.fetch([key])),
    "fresh_fetch_records": lambda fresh: len(fresh.fetch_records([key])),
    "fresh_fetch_attachments": lambda fresh: sorted(fresh.fetch_attachments(key)),
    "open_and_fetch": lambda fresh: len(FileStagingStore(ROOT / "staging").fetch([key])),
    "keys": lambda fresh: len(store.keys()),
    "retired": lambda fresh: store.retired(),
    "retire": lambda fresh: store.retire([f"gone{{next(calls)}}"])["absent"] != [],
    "delete": lambda fresh: store.delete([f"gone{{next(calls)}}"])["absent"] != [],
}}
failed = {{}}
for name, operation in operations.items():
    stage_one(store)  # the store keeps its segment and its store lock: 2 to give back
    assert store.stats()["descriptors"]["open_files"] == 2
    fresh = FileStagingStore(ROOT / "staging")  # keeps nothing until it stages
    exhaust()
    outcome = attempt(lambda: operation(fresh))
    release()
    if outcome[0] != "ok":
        failed[name] = outcome
# A stage holds its own segment and lock while it runs: it needs one more descriptor, given
# back by the other staging store's cache.
stage_one(store)
stage_one(other)
exhaust()
staged = store.stage(make_record("r", "late"))
release()
if not staged.ok:
    failed["stage"] = staged.error
stats = budget()
print(json.dumps({{
    "failed": failed, "exhausted": stats["exhausted"], "evicted": stats["evicted"],
    "keys": store.keys("r"), "segments": len(store._native.segment_names()),
}}))
"""
)


def test_staging_operations_survive_exhaustion_by_closing_cached_descriptors(
    tmp_path: Path,
) -> None:
    """Each staging read, fold, removal and stage, run while a neighbour holds every free
    descriptor and the staging stores hold some between calls: each succeeds by closing
    them (evict, retry once). The segment it closes is sealed: the next stage starts
    another, and every call staged stays fetchable."""
    seen = run_limited(tmp_path, STAGING_EVERY_OPERATION.format())
    assert seen["failed"] == {}
    assert seen["exhausted"] >= 12
    assert seen["evicted"] >= 12
    assert seen["keys"] == ["r/c0", "r/late"]
    assert seen["segments"] > 1  # sealed by the evictions, a new one each time


STAGING_NOTHING_TO_GIVE_BACK = (
    STAGING_PRELUDE
    + """
store = FileStagingStore(ROOT / "staging")
key = stage_one(store, "r")
reader = FileStagingStore(ROOT / "staging")
# The first exhaustion closes every cached descriptor (the staging store's two) and the
# fetch succeeds with them; the neighbour then takes those too: nothing is left to give back.
exhaust()
first = attempt(lambda: len(store.fetch([key])))
exhaust()
kept = [budget()["held"], store.stats()["descriptors"]["open_files"]]
failures = {{
    "fetch": attempt(lambda: reader.fetch([key])),
    "fetch_records": attempt(lambda: reader.fetch_records([key])),
    "fetch_attachments": attempt(lambda: reader.fetch_attachments(key)),
    "retire": attempt(lambda: store.retire(["r"])),
}}
staged = store.stage(make_record("r", "c9"))
failed_count = budget()["failed"]
# The neighbour lets go: everything works again, without a restart.
release()
again = {{
    "stage": store.stage(make_record("r", "c10")).ok,
    "fetch": len(reader.fetch([key, "r/c10"])),
    "fetch_records": len(reader.fetch_records([key])),
    "fetch_attachments": sorted(reader.fetch_attachments(key)),
    "keys": store.keys("r"),
    "retire": store.retire(["r"]),
    "retired": reader.retired(),
}}
print(json.dumps({{
    "first": first, "kept": kept, "failures": failures,
    "staged": [staged.ok, staged.error], "failed": failed_count, "again": again,
}}))
"""
)


def test_staging_fails_cleanly_with_nothing_to_give_back_and_recovers(tmp_path: Path) -> None:
    """With every cached descriptor already closed and a neighbour holding every free one,
    a staging fetch or removal raises OSError(EMFILE) saying it closed everything and
    retried, a stage answers ``StageResult(ok=False)`` with that reason, and nothing is half
    done: once the neighbour releases, every call works again in the same process."""
    seen = run_limited(tmp_path, STAGING_NOTHING_TO_GIVE_BACK.format())
    assert seen["first"] == ["ok", 1]
    assert seen["kept"] == [0, 0]
    for name, failure in seen["failures"].items():
        assert failure[:2] == ["err", 24], (name, failure)
        assert "even after closing every descriptor" in failure[2], (name, failure)
    ok, error = seen["staged"]
    assert not ok and "Too many open files" in error, error
    assert seen["failed"] >= 5
    assert seen["again"] == {
        "stage": True,
        "fetch": 2,
        "fetch_records": 1,
        "fetch_attachments": ["raw"],
        "keys": ["r/c0", "r/c10"],  # the failed stage of c9 left nothing
        "retire": {"removed": ["r"], "absent": []},
        "retired": ["r"],
    }


STAGING_BUDGET = (
    STAGING_PRELUDE
    + """
from tokencapture.descriptors import set_budget

store = FileStagingStore(ROOT)
first = stage_one(store, "r")
seen = {{"kept": store.stats()["descriptors"]["open_files"], "held": budget()["held"]}}
set_budget(1)
seen["budget_1"] = store.stats()["descriptors"]["open_files"]  # the store lock went
set_budget(0)
seen["budget_0"] = store.stats()["descriptors"]["open_files"]  # the segment too
set_budget(None)
seen["evicted"] = budget()["evicted"]
second = stage_one(store, "r")
seen["segments"] = len(store._native.segment_names())
seen["fetched"] = [s.model_call_id for s in store.fetch([first, second])]
seen["kept_again"] = store.stats()["descriptors"]["open_files"]
print(json.dumps(seen))
"""
)


def test_the_budget_closes_a_staging_stores_kept_descriptors(tmp_path: Path) -> None:
    """The staging store's kept descriptors are a cache of the process budget like the
    token store's: lowering the budget closes them (the store lock first, then the segment,
    which is sealed), and the store goes on in a new segment."""
    seen = run_limited(tmp_path, STAGING_BUDGET.format())
    assert (seen["kept"], seen["held"]) == (2, 2)
    assert (seen["budget_1"], seen["budget_0"]) == (1, 0)
    assert seen["evicted"] == 2
    assert seen["segments"] == 2
    assert seen["fetched"] == ["c0", "c1"]
    assert seen["kept_again"] == 2
