"""Put latency tail: percentiles of one put against puts in flight and rollouts, beside NeMo
Gym 0.7.0's own file store, in three conditions of the machine.

    python benches/bench_tail.py [--quick] [--repeats N] [--conditions quiet cpu disk]
                                 [--json PATH] [--scratch DIR]

A point is (rollouts, calls per rollout, puts in flight). Every put of the point is a task;
the tasks are created call-major (call 0 of every rollout, then call 1, ...) and each waits
for a slot of an `asyncio.Semaphore(in_flight)`, so with more slots than rollouts several
calls of one rollout are in flight together. A put's latency is from the `put` call (slot
held) to the end of its `await`; throughput is puts / wall time of the whole point.

Each (condition, repeat, point, store) runs in a fresh subprocess; within a repeat the stores
alternate at every point (their order rotated between repeats), so load from elsewhere hits
both alike. The conditions:

* `quiet`: nothing else started by the benchmark.
* `cpu`: two busy-loop processes (one per core of this 2-core machine).
* `disk`: one process that writes a 64 MiB file and fsyncs it, in a loop, in the same
  directory tree as the stores (the same filesystem).

NeMo Gym's store puts through `asyncio.to_thread`; the worker sets the default executor to
`in_flight` threads (as benches/compare.py does), so it really has that many puts in flight.
The JSON file (`benches/results/tail.json` by default) keeps every sample; the table shows
the median of the repeats and the range. See benches/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parent
for _path in (BENCHES.parent, BENCHES):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# NeMo Gym's capture modules, as tests/nemo_oracle.py finds them (scripts/nemo-gym-oracle.sh).
_ORACLE = os.environ.get("TOKENCAPTURE_NEMO_GYM") or os.fspath(
    BENCHES.parent / ".cache" / "nemo-gym-0.7.0" / "shim"
)
if Path(_ORACLE, "nemo_gym").is_dir() and _ORACLE not in sys.path:
    sys.path.append(_ORACLE)

from bench_data import SmallShape, small_rollouts  # noqa: E402
from bench_worker import print_result, run_worker  # noqa: E402

OURS = "tokencapture"
NEMO_GYM = "nemo-gym"
NEMO_GYM_MODULE = "nemo_gym.token_id_capture.store"
# `--baseline DIR`: another build of ours (e.g. today's main), run beside the others.
BASELINE = "tokencapture-baseline"
# `--raw`: the disk's own floor at the same concurrency: each put one write + fdatasync of its
# rollout's file (kept open) in a thread, no lock, no index, no directory sync.
RAW = "raw-fdatasync"
CONDITIONS = ("quiet", "cpu", "disk")
DEFAULT_JSON = BENCHES / "results" / "tail.json"
DEFAULT_SCRATCH = BENCHES / ".scratch"
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
# (rollouts, calls, in flight): W1-sized calls (256 prompt + 64 generated tokens).
FULL_POINTS: tuple[tuple[int, int, int], ...] = (
    (64, 16, 1),
    (64, 16, 16),
    (64, 16, 128),
    (64, 16, 512),
    (4096, 1, 16),
    (4096, 1, 512),
)
QUICK_POINTS: tuple[tuple[int, int, int], ...] = ((8, 4, 1), (8, 4, 16), (64, 1, 32))
DISK_CHUNK = 64 << 20  # bytes the disk neighbour writes (then fsyncs) per file


def point_name(point: Sequence[int]) -> str:
    rollouts, calls, in_flight = point
    return f"r{rollouts}x{calls}@{in_flight}"


# The worker (one store, one point, in a fresh process) ----------------------------------------


class RawStore:
    """See `RAW`: not a store (no durability of names, no duplicate check), a yardstick."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._fds: dict[str, int] = {}

    def _append(self, rollout_id: str, line: bytes) -> None:
        fd = self._fds.get(rollout_id)
        if fd is None:
            path = self._root / f"{rollout_id}.raw"
            fd = self._fds[rollout_id] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, line)
        os.fdatasync(fd)

    async def put(self, entry: Any) -> None:
        from tokencapture.store import canonical_line

        line = canonical_line(entry) + b"\n"
        await asyncio.to_thread(self._append, entry.rollout_id, line)


def open_store(name: str, root: Path) -> Any:
    if name == RAW:
        return RawStore(root)
    if name in (OURS, BASELINE):
        from tokencapture.store import TokenCaptureStore

        return TokenCaptureStore(root)
    if name == NEMO_GYM:
        return importlib.import_module(NEMO_GYM_MODULE).TokenCaptureStore(root)
    raise ValueError(f"unknown store {name!r}")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (no interpolation: a value some put really took)."""
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100)
    return sorted_values[int(min(rank, len(sorted_values))) - 1]


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    values = sorted(latencies_s)
    summary = {name: percentile(values, q) * 1e3 for name, q in PERCENTILES}
    summary["max"] = values[-1] * 1e3
    summary["mean"] = statistics.fmean(values) * 1e3
    return summary


_PHASES: contextvars.ContextVar[list[float]] = contextvars.ContextVar("phases")


def trace_phases() -> None:
    """Stamp, for each put of ours, when it was handed to the native store (after the Python
    side built its line) and when the event loop drained its completion; `one()` adds when
    the awaiting task resumed. Profiling only (`--phases`).

    The loop bridge's reader is re-registered behind one that notes the time of each drain:
    a future's done callbacks run (in the next loop iteration) before the next drain can."""
    import tokencapture.jobs as jobs
    import tokencapture.store as store_module

    submit = store_module.__dict__["native_job"]
    last_drain = [0.0]
    watched: set[int] = set()

    def native_job(start: Any, *args: object) -> Any:
        stamps = _PHASES.get(None)
        if stamps is not None:
            stamps.append(time.perf_counter())
        future = submit(start, *args)
        loop = asyncio.get_running_loop()
        bridge = jobs._bridges[loop]
        if id(bridge) not in watched:
            watched.add(id(bridge))
            fd = bridge.completions.fileno()

            def drain() -> None:
                last_drain[0] = time.perf_counter()
                bridge._drain()

            loop.remove_reader(fd)
            loop.add_reader(fd, drain)
        if stamps is not None:
            future.add_done_callback(lambda _f: stamps.append(last_drain[0]))
        return future

    setattr(store_module, "native_job", native_job)  # noqa: B010 (not a re-exported name)


async def timed_puts(store: Any, rollouts: int, calls: int, in_flight: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(in_flight, thread_name_prefix="bench"))
    shape = SmallShape(rollouts=rollouts, calls=calls)
    entries = small_rollouts(shape, prefix="tail")
    warm = small_rollouts(SmallShape(rollouts=1, calls=1), prefix="warmup", seed=99)[0][0]
    await store.put(warm)
    ordered = [entries[r][c] for c in range(calls) for r in range(rollouts)]
    semaphore = asyncio.Semaphore(in_flight)
    latencies: list[float] = []
    clock = time.perf_counter

    phases: list[tuple[float, float, float]] = []  # (python, native + doorbell, resume) s

    async def one(entry: Any) -> None:
        async with semaphore:
            stamps = [clock()]
            _PHASES.set(stamps)
            await store.put(entry)
            stamps.append(clock())
            latencies.append(stamps[-1] - stamps[0])
            if len(stamps) == 4:
                started, submitted, drained, resumed = stamps
                phases.append((submitted - started, drained - submitted, resumed - drained))

    cpu0 = time.process_time()
    begin = clock()
    await asyncio.gather(*(one(entry) for entry in ordered))
    wall = clock() - begin
    cpu = time.process_time() - cpu0
    result: dict[str, Any] = {}
    if phases:
        # The phases of the slowest 1% of puts, and of all, summed over those puts.
        slowest = sorted(phases, key=sum)[-max(1, len(phases) // 100) :]
        names = ("python_ms", "native_ms", "resume_ms")
        result["phases_p99_puts"] = {
            n: statistics.fmean(p[k] for p in slowest) * 1e3 for k, n in enumerate(names)
        }
        result["phases_all_puts"] = {
            n: statistics.fmean(p[k] for p in phases) * 1e3 for k, n in enumerate(names)
        }
    return result | {
        "puts": len(ordered),
        "wall_s": wall,
        "puts_per_s": len(ordered) / wall,
        "cpu_us_per_put": cpu / len(ordered) * 1e6,
        "latency_ms": latency_summary(latencies),
    }


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    root = Path(spec["dir"])
    root.mkdir(parents=True, exist_ok=True)
    store = open_store(spec["store"], root)
    if spec.get("phases") and spec["store"] in (OURS, BASELINE):
        trace_phases()
    result = asyncio.run(timed_puts(store, spec["rollouts"], spec["calls"], spec["in_flight"]))
    result["module"] = sys.modules[type(store).__module__].__file__
    return result


def run_worker_process(
    spec: dict[str, Any], timeout: float, package: Path | None = None
) -> dict[str, Any]:
    """Run one point in a fresh process; `package`: a directory holding another build of
    `tokencapture`, put first on the worker's path (see `--baseline`)."""
    env = None
    if package is not None:
        path = os.pathsep.join([os.fspath(package), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
    return run_worker(Path(__file__), spec, f"{spec['store']} {spec['point']}", timeout, env)


# Neighbours -----------------------------------------------------------------------------------

CPU_NEIGHBOUR = "while True:\n    pass\n"
DISK_NEIGHBOUR = """
import os, sys
directory, chunk = sys.argv[1], int(sys.argv[2])
block = os.urandom(1 << 20)
i = 0
while True:
    path = os.path.join(directory, f"neighbour-{i % 2}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(chunk >> 20):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    i += 1
"""


@contextmanager
def neighbours(condition: str, scratch: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the condition's neighbour processes; stop them (by pid) on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    directory = scratch / "neighbour"
    try:
        if condition == "cpu":
            for _ in range(2):
                procs.append(subprocess.Popen([sys.executable, "-c", CPU_NEIGHBOUR]))
        elif condition == "disk":
            directory.mkdir(parents=True, exist_ok=True)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", DISK_NEIGHBOUR, os.fspath(directory), str(DISK_CHUNK)]
                )
            )
        elif condition != "quiet":
            raise ValueError(f"unknown condition {condition!r}")
        if procs:
            time.sleep(1.0)  # let them reach their steady state
        yield procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


# The driver -----------------------------------------------------------------------------------


def rotated(items: Sequence[str], shift: int) -> list[str]:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def median_and_range(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """{condition: {point: {store: {metric: {median, min, max}}}}} over the repeats."""
    grouped: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    for sample in samples:
        by_point = grouped.setdefault(sample["condition"], {})
        by_point.setdefault(sample["point"], {}).setdefault(sample["store"], []).append(
            sample["result"]
        )
    summary: dict[str, Any] = {}
    for condition, by_point in grouped.items():
        for point, by_store in by_point.items():
            for store, results in by_store.items():
                metrics: dict[str, dict[str, float]] = {
                    "puts_per_s": median_and_range([r["puts_per_s"] for r in results]),
                    "cpu_us_per_put": median_and_range([r["cpu_us_per_put"] for r in results]),
                }
                for key in (*(name for name, _ in PERCENTILES), "max"):
                    metrics[key] = median_and_range([r["latency_ms"][key] for r in results])
                summary.setdefault(condition, {}).setdefault(point, {})[store] = metrics
    return summary


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's tail targets at every (condition, point) measured."""
    checks: list[dict[str, Any]] = []
    for condition, by_point in summary.items():
        for point, by_store in by_point.items():
            ours = by_store.get(OURS)
            if ours is None:
                continue
            p99 = ours["p99"]["median"]
            peer = by_store.get(NEMO_GYM)
            if peer is not None:
                bound = peer["p99"]["median"]
                checks.append(
                    {
                        "condition": condition,
                        "point": point,
                        "target": "p99 <= NeMo Gym p99",
                        "value": p99,
                        "bound": bound,
                        "status": "PASS" if p99 <= bound else "MISS",
                    }
                )
            base = by_store.get(BASELINE)
            if base is not None:
                checks.append(
                    {
                        "condition": condition,
                        "point": point,
                        "target": "puts/s >= baseline",
                        "value": ours["puts_per_s"]["median"],
                        "bound": base["puts_per_s"]["median"],
                        "status": "PASS"
                        if ours["puts_per_s"]["median"] >= base["puts_per_s"]["median"]
                        else "MISS",
                    }
                )
            in_flight = int(point.rsplit("@", 1)[1])
            if in_flight >= 16:
                bound = 10 * ours["p50"]["median"]
                checks.append(
                    {
                        "condition": condition,
                        "point": point,
                        "target": "p99 <= 10x own p50",
                        "value": p99,
                        "bound": bound,
                        "status": "PASS" if p99 <= bound else "MISS",
                    }
                )
    return checks


def render(summary: dict[str, Any], checks: list[dict[str, Any]]) -> str:
    lines = []
    header = (
        f"{'condition':9} {'point':16} {'store':12} {'p50':>8} {'p90':>8} {'p99':>8} "
        f"{'p99.9':>8} {'max':>8} {'puts/s':>9}   p99 range"
    )
    lines.append(header)
    lines.append("-" * len(header))
    for condition, by_point in summary.items():
        for point, by_store in by_point.items():
            for store, m in by_store.items():
                cells = " ".join(
                    f"{m[key]['median']:8.1f}" for key in ("p50", "p90", "p99", "p99.9", "max")
                )
                lines.append(
                    f"{condition:9} {point:16} {store:12} {cells} "
                    f"{m['puts_per_s']['median']:9,.0f}   "
                    f"{m['p99']['min']:.1f}-{m['p99']['max']:.1f}"
                )
    lines.append("")
    lines.append("latencies in ms (median of the repeats); targets:")
    for check in checks:
        lines.append(
            f"  {check['status']:4} {check['condition']:6} {check['point']:16} "
            f"{check['target']:22} {check['value']:8.1f} vs {check['bound']:8.1f}"
        )
    return "\n".join(lines)


def nemo_gym_available() -> bool:
    try:
        importlib.import_module(NEMO_GYM_MODULE)
    except ImportError:
        return False
    return True


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", os.fspath(BENCHES.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def drive(args: argparse.Namespace) -> dict[str, Any]:
    points = QUICK_POINTS if args.quick else FULL_POINTS
    if args.points:
        points = tuple(p for p in points if point_name(p) in args.points)
        if not points:
            raise SystemExit(f"no such point in {'--quick' if args.quick else 'the full set'}")
    stores = [OURS, NEMO_GYM] if nemo_gym_available() else [OURS]
    if args.baseline is not None:
        stores.append(BASELINE)
    if args.raw:
        stores.append(RAW)
    if args.stores:
        stores = [store for store in stores if store in args.stores]
    args.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tail-", dir=args.scratch))
    samples: list[dict[str, Any]] = []
    # Every sample as it comes (one JSON line each): a run stopped midway keeps its samples,
    # and `--summarize` turns them into the report.
    args.json.parent.mkdir(parents=True, exist_ok=True)
    partial = args.json.with_suffix(".samples.jsonl").open("w")
    try:
        for condition in args.conditions:
            with neighbours(condition, scratch):
                for repeat in range(args.repeats):
                    for index, point in enumerate(points):
                        for store in rotated(stores, repeat + index):
                            spec = {
                                "store": store,
                                "point": point_name(point),
                                "rollouts": point[0],
                                "calls": point[1],
                                "in_flight": point[2],
                                "dir": os.fspath(scratch / f"{condition}-{repeat}-{index}-{store}"),
                                "phases": args.phases,
                            }
                            package = args.baseline if store == BASELINE else None
                            result = run_worker_process(spec, args.timeout, package)
                            shutil.rmtree(spec["dir"], ignore_errors=True)
                            samples.append(
                                {
                                    "condition": condition,
                                    "repeat": repeat,
                                    "point": spec["point"],
                                    "store": store,
                                    "result": result,
                                    "loadavg_1m": os.getloadavg()[0],
                                }
                            )
                            partial.write(json.dumps(samples[-1]) + "\n")
                            partial.flush()
                            if not args.silent:
                                lat = result["latency_ms"]
                                print(
                                    f"{condition:6} r{repeat} {spec['point']:16} {store:12} "
                                    f"p50 {lat['p50']:7.1f} p99 {lat['p99']:7.1f} "
                                    f"max {lat['max']:7.1f} ms {result['puts_per_s']:8,.0f}/s",
                                    flush=True,
                                )
    finally:
        partial.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return report(samples, args, stores, points)


def report(
    samples: list[dict[str, Any]],
    args: argparse.Namespace,
    stores: Sequence[str],
    points: Sequence[Sequence[int]],
) -> dict[str, Any]:
    summary = summarize(samples)
    checks = targets(summary)
    return {
        "meta": {
            "commit": _git_commit(),
            "quick": args.quick,
            "repeats": args.repeats,
            "conditions": list(dict.fromkeys(s["condition"] for s in samples)),
            "points": [point_name(p) for p in points],
            "stores": stores,
            "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "summary": summary,
        "targets": checks,
        "samples": samples,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny points, for a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per worker run")
    parser.add_argument("--silent", action="store_true", help="print only the table")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding another build of the tokencapture package (its parent "
        "directory of `tokencapture/`), measured beside ours as " + BASELINE,
    )
    parser.add_argument("--points", nargs="+", help="only these points (e.g. r64x16@128)")
    parser.add_argument("--raw", action="store_true", help=f"add {RAW}, the disk's own floor")
    parser.add_argument(
        "--stores",
        nargs="+",
        choices=(OURS, NEMO_GYM, BASELINE, RAW),
        help="only these of the stores the other options select",
    )
    parser.add_argument(
        "--summarize",
        type=Path,
        help="write the report of a samples file (JSON lines, as a run writes beside --json) "
        "instead of measuring",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="profile ours: split each put into Python / native + doorbell / task resume",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print_result(worker(json.loads(args.worker)))
        return 0
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.summarize is not None:
        lines = args.summarize.read_text().splitlines()
        samples = [json.loads(line) for line in lines if line.strip()]
        stores = list(dict.fromkeys(sample["store"] for sample in samples))
        names = list(dict.fromkeys(sample["point"] for sample in samples))
        points = [tuple(int(x) for x in re.split("[rx@]", n)[1:]) for n in names]
        full = report(samples, args, stores, points)
        full["meta"]["summarized_from"] = os.fspath(args.summarize)
    else:
        full = drive(args)
    args.json.write_text(json.dumps(full, indent=1) + "\n")
    print(render(full["summary"], full["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
