"""Worker-owned staging: ``stage()`` throughput and latency, and the fetch of a 24-call chain.

Backends (`BACKENDS`, a factory table: name -> ``factory(directory) -> sink`` or None where it
cannot run here):

* ``file``: `tokencapture.FileStagingStore` (durable: group commit, ``fdatasync`` per batch);
* ``memory``: a dict behind a lock (the ceiling a durable sink is measured against);
* ``postgres``: `tokencapture.PostgresStagingStore` on a fresh database per run, of the server
  $TOKENCAPTURE_BENCH_PG_DSN names or a throwaway one on these cores (issue 23's target: at
  least 0.7x the file backend's stages/s; the report gives the per-run ratio);
* ``transferqueue``: TransferQueue's in-memory storage where it imports (PyPI
  ``transferqueue``): the ``StorageUnitData`` a ``SimpleStorageUnit`` keeps its rows in, put
  into directly behind a lock (its ZMQ transport and Ray actor are left out, so this is a
  lower bound of its cost). Neither in-memory column is durable.

Workloads: W1, one 320-token root delta per stage (64 prompt + 256 generated tokens); W2,
24-call ``token_in`` chains with ~700-token deltas (450 new prompt + 250 generated tokens),
each thread staging its chains call after call. From 1, 8 and 32 threads: stages/s (wall
clock over all threads) and per-stage p50/p99 latency. Records are built (and their digests
computed) before the clock starts; each run stages into a fresh directory on the real disk
(``benches/.scratch/``, since ``/tmp`` may be tmpfs).

Fetch: a fresh `FileStagingStore` fetching the 24 keys of one W2 chain (verified base
snapshots) against a fresh file `TokenCaptureStore` freezing the same rollout (the same
tokens as 24 entries, already frozen once: an idempotent re-freeze, no write).

Runs are interleaved (one run = every backend once, in rotated order); the report gives the
median and range over runs, and the file backend's per-run ratios to the ceiling.

    python benches/bench_staging.py --runs 5 [--quick] [--json benches/results/staging.json]
    python benches/bench_staging.py --fetch-only --fetch-repeats 40   # the fetch case alone
    python benches/bench_staging.py --backends file,postgres,pg1 \
        --postgres-variant pg1:stage_flushes=1      # store options side by side, one server
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parent
ROOT = BENCHES.parent


def _package_argument(argv: list[str]) -> str | None:
    """`--package DIR` (see main), read before tokencapture is first imported."""
    for i, arg in enumerate(argv):
        if arg == "--package" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--package="):
            return arg.split("=", 1)[1]
    return None


# This tree's package unless --package names another build (an A/B); first on sys.path
# either way, so neither PYTHONPATH nor an installed copy decides which build is measured.
sys.path.insert(0, str(Path(_package_argument(sys.argv[1:]) or ROOT / "python").resolve()))

from tokencapture import FileStagingStore, TokenCaptureStore, TokenEntry  # noqa: E402
from tokencapture.conformance_staging import build_chain  # noqa: E402
from tokencapture.staging import records as models  # noqa: E402

THREADS = (1, 8, 32)
W1_PROMPT, W1_GENERATED = 64, 256
W2_CALLS, W2_PROMPT, W2_GENERATED = 24, 450, 250


class DictSink:
    """The ceiling: a dict behind a lock, nothing verified, nothing durable."""

    def __init__(self, _directory: str) -> None:
        self._rows: dict[str, Any] = {}
        self._lock = threading.Lock()

    def stage(self, record: Any) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        with self._lock:
            self._rows[key] = record
        return models.StageResult(ok=True, staging_key=key)


class TransferQueueSink:
    """TransferQueue's in-memory row storage (what a SimpleStorageUnit holds)."""

    def __init__(self, _directory: str) -> None:
        from transfer_queue.storage.simple_storage import StorageUnitData

        self._data = StorageUnitData(None)
        self._lock = threading.Lock()
        self._next = 0

    def stage(self, record: Any) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        fields = {
            "token_ids": [list(record.token_ids_delta)],
            "token_mask": [list(record.token_mask_delta)],
            "log_probs": [list(record.generation_log_probs_delta)],
            "meta": [{"key": key, "digest": record.digest, "cum_len": record.cum_len}],
        }
        with self._lock:
            index = self._next
            self._next += 1
            self._data.put_data(fields, [index])
        return models.StageResult(ok=True, staging_key=key)


def _transferqueue() -> Callable[[str], Any] | None:
    try:
        import transfer_queue.storage.simple_storage  # noqa: F401
    except Exception as error:  # any import failure: the column is left out, with why
        print(f"transferqueue: not measured ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    return TransferQueueSink


class PostgresColumn:
    """The ``postgres`` column: `tokencapture.PostgresStagingStore`, each run on a fresh
    database of one server: $TOKENCAPTURE_BENCH_PG_DSN, or a throwaway one started on these
    cores on first use (tests/pg_server.py: fsync and synchronous_commit on)."""

    def __init__(self, shared: PostgresColumn | None = None, **options: Any) -> None:
        """`options` go to every store this column opens; `shared`: a column whose server
        (and databases' owner) this one uses too, so variants of one run share a server."""
        self.shared = shared
        self.options = options
        self.variants: list[PostgresColumn] = []
        if shared is not None:
            shared.variants.append(self)
        self.base = os.environ.get("TOKENCAPTURE_BENCH_PG_DSN")
        self.server: Any = None
        self.opened: list[Any] = []

    def _admin(self, sql: str) -> None:
        import asyncio

        import asyncpg  # type: ignore[import-untyped, unused-ignore]

        async def run() -> None:
            connection = await asyncpg.connect(self.base)
            try:
                await connection.execute(sql)
            finally:
                await connection.close()

        asyncio.run(run())

    def __call__(self, _directory: str) -> Any:
        from tokencapture.postgres import PostgresStagingStore, install_schema_sync

        if self.shared is not None:
            self.shared.start()
            self.base = self.shared.base
        self.start()
        assert self.base is not None
        name = f"bench_staging_{uuid.uuid4().hex[:10]}"
        self._admin(f"CREATE DATABASE {name}")
        dsn = self.base.rsplit("/", 1)[0] + "/" + name
        install_schema_sync(dsn)
        store = PostgresStagingStore(dsn, **self.options)
        self.opened.append(store)
        return store

    def start(self) -> None:
        """Start the throwaway server unless a DSN is given or it runs already."""
        if self.base is None:
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            from tests.pg_server import PgServer

            self.server = PgServer()
            self.server.start()
            self.base = self.server.dsn

    def close_stores(self) -> None:
        """Close the stores this column opened (every one, even after one fails to)."""
        opened, self.opened = self.opened, []
        close_all(store.close for store in opened)

    def close(self) -> None:
        """Close this column's stores (and its variants', before the server they share) and
        stop its server: stopped even when a close fails, whose error is raised after."""
        close_all([*(variant.close for variant in self.variants), self.close_stores, self._stop])

    def _stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.cleanup()


def close_all(closers: Iterable[Callable[[], object]]) -> None:
    """Call every closer, even after one raised (a close that fails must not leave the
    servers after it running); then raise the first error, the others noted on it."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as error:  # an interrupt too: stop the rest first
            if first is None:
                first = error
            else:
                first.add_note(f"while cleaning up, also: {type(error).__name__}: {error}")
    if first is not None:
        raise first


def _postgres() -> PostgresColumn | None:
    try:
        import asyncpg  # noqa: F401
    except ImportError as error:
        print(f"postgres: not measured ({error})", file=sys.stderr)
        return None
    if os.environ.get("TOKENCAPTURE_BENCH_PG_DSN") is None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from tests.pg_server import find_bindir

        bindir = find_bindir()
        if bindir is None or not (bindir / "initdb").exists():
            print("postgres: not measured (no PostgreSQL server installed)", file=sys.stderr)
            return None
    return PostgresColumn()


# name -> factory(directory) -> sink; None: cannot run here.
BACKENDS: dict[str, Callable[[str], Any] | None] = {
    "file": FileStagingStore,
    "memory": DictSink,
    "transferqueue": _transferqueue(),
    "postgres": _postgres(),
}


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:KEY=VALUE,...`` -> (NAME, options); a value is JSON where it parses."""
    name, _, spec = text.partition(":")
    if not name or name in BACKENDS:
        raise SystemExit(f"--postgres-variant {text!r}: give a new column name before ':'")
    options: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--postgres-variant {text!r}: {item!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, options


def w1_records(threads: int, per_thread: int, tag: str) -> list[list[Any]]:
    return [
        [
            build_chain(
                models,
                f"{tag}-w1-t{t}-{i}",
                1,
                variant=i,
                prompt_tokens=W1_PROMPT,
                generated_tokens=W1_GENERATED,
            )[0]
            for i in range(per_thread)
        ]
        for t in range(threads)
    ]


def w2_records(threads: int, chains_per_thread: int, tag: str) -> list[list[Any]]:
    return [
        [
            record
            for c in range(chains_per_thread)
            for record in build_chain(
                models,
                f"{tag}-w2-t{t}-{c}",
                W2_CALLS,
                variant=c,
                prompt_tokens=W2_PROMPT,
                generated_tokens=W2_GENERATED,
            )
        ]
        for t in range(threads)
    ]


def run_stages(sink: Any, per_thread: list[list[Any]], warm: int = 0) -> dict[str, float]:
    """Stage every thread's records from its own thread; stages/s and latency quantiles.
    `warm`: stage that many records of another rollout from as many threads first, untimed
    (a PostgreSQL store then has its connections and its server backends their compiled
    functions before the clock starts)."""
    if warm:
        warmers = [
            threading.Thread(
                target=lambda i=i: sink.stage(
                    build_chain(models, f"warm-{uuid.uuid4().hex}-{i}", 1, variant=i)[0]
                )
            )
            for i in range(warm)
        ]
        for warmer in warmers:
            warmer.start()
        for warmer in warmers:
            warmer.join()
    latencies: list[list[int]] = [[] for _ in per_thread]
    start = threading.Barrier(len(per_thread) + 1)
    failures: list[str] = []

    def work(index: int) -> None:
        mine = latencies[index]
        start.wait()
        for record in per_thread[index]:
            t0 = time.perf_counter_ns()
            result = sink.stage(record)
            mine.append(time.perf_counter_ns() - t0)
            if not result.ok:
                failures.append(str(result.error))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(per_thread))]
    for worker in workers:
        worker.start()
    start.wait()
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if failures:
        raise RuntimeError(f"{len(failures)} stages failed: {failures[0]}")
    flat = sorted(ns for per in latencies for ns in per)
    return {
        "stages_per_s": len(flat) / wall,
        "p50_ms": flat[len(flat) // 2] / 1e6,
        "p99_ms": flat[min(len(flat) - 1, int(len(flat) * 0.99))] / 1e6,
        # This process's CPU (every thread; a throwaway server is another process).
        "client_cpu_us": ((cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime))
        * 1e6
        / len(flat),
    }


def fetch_vs_freeze(scratch: Path, repeats: int) -> dict[str, list[float]]:
    """Milliseconds: a fresh store fetching one W2 chain, a fresh token store re-freezing it."""
    chain = build_chain(
        models, "fetch-w2", W2_CALLS, prompt_tokens=W2_PROMPT, generated_tokens=W2_GENERATED
    )
    staging_dir, token_dir = scratch / "fetch-staging", scratch / "fetch-tokens"
    sink = FileStagingStore(staging_dir)
    keys = [sink.stage(record).staging_key for record in chain]
    tokens = TokenCaptureStore(token_dir)
    cumulative: list[int] = []
    for record in chain:
        carry = int(sum(1 for m in record.token_mask_delta if m == 0.0))
        prompt = [*cumulative, *record.token_ids_delta[:carry]]
        tokens.append(
            TokenEntry(
                rollout_id="fetch-w2",
                model_call_id=record.model_call_id,
                model="bench-model",
                prompt_token_ids=prompt,
                generation_token_ids=record.token_ids_delta[carry:],
                generation_log_probs=record.generation_log_probs_delta[carry:],
                created_at=1_760_000_000.0,
            )
        )
        cumulative = [*prompt, *record.token_ids_delta[carry:]]
    tokens.freeze_now("fetch-w2")
    out: dict[str, list[float]] = {"fetch_ms": [], "freeze_ms": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        fetched = FileStagingStore(staging_dir).fetch(keys)
        out["fetch_ms"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        frozen = TokenCaptureStore(token_dir).freeze_now("fetch-w2")
        out["freeze_ms"].append((time.perf_counter() - t0) * 1e3)
        assert [t for s in fetched for t in s.token_ids_delta] == cumulative
        assert len(frozen.entries) == W2_CALLS
        # Freed outside the clocks (else each run would time the last run's deallocation).
        del fetched, frozen
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--cases", default="", help="comma-separated cases to run (W1x32,...): default all"
    )
    parser.add_argument("--no-fetch", action="store_true", help="leave out the fetch timing")
    parser.add_argument(
        "--package",
        metavar="DIR",
        help="import tokencapture from DIR (a directory holding a built tokencapture/, e.g. an "
        "unpacked wheel or another checkout's python/) instead of this tree's python/",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="before each timed case, stage one record per thread, untimed (connections "
        "made, server functions compiled): the steady state without a store's start-up",
    )
    parser.add_argument(
        "--fetch-only", action="store_true", help="only the fetch timing (no stage cases)"
    )
    parser.add_argument(
        "--fetch-repeats",
        type=int,
        default=0,
        help="fetch/re-freeze pairs to time (default: 4 per run, at least 5)",
    )
    parser.add_argument(
        "--postgres-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another postgres column, NAME, whose stores get these options (values read as "
        "JSON where they parse, else as text), on the postgres column's server; name it in "
        "--backends too (e.g. --postgres-variant pg1:stage_flushes=1 "
        "--backends file,postgres,pg1)",
    )
    args = parser.parse_args(argv)
    for variant in args.postgres_variant:
        name, options = parse_variant(variant)
        base = BACKENDS["postgres"]
        if not isinstance(base, PostgresColumn):
            parser.error(f"--postgres-variant {name}: the postgres column cannot run here")
        BACKENDS[name] = PostgresColumn(shared=base, **options)
    names = [n for n in args.backends.split(",") if BACKENDS.get(n) is not None]
    scale = 0.05 if args.quick else 1.0
    (BENCHES / ".scratch").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="staging-", dir=BENCHES / ".scratch"))
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        cases = []
        for threads in THREADS:
            w1_per_thread = max(2, int({1: 400, 8: 500, 32: 250}[threads] * scale))
            w2_chains = max(1, int({1: 8, 8: 2, 32: 1}[threads] * scale))
            cases.append((f"W1x{threads}", threads, "w1", w1_per_thread))
            cases.append((f"W2x{threads}", threads, "w2", w2_chains))
        if args.cases:
            wanted = set(args.cases.split(","))
            cases = [case for case in cases if case[0] in wanted]
        if args.fetch_only:
            cases = []
        for run in range(args.runs):
            for case, threads, shape, size in cases:
                order = names[run % len(names) :] + names[: run % len(names)]
                for name in order:
                    build = w1_records if shape == "w1" else w2_records
                    per_thread = build(threads, size, f"{name}-{run}")
                    directory = scratch / f"{case}-{name}-{run}"
                    factory = BACKENDS[name]
                    assert factory is not None
                    sink = factory(str(directory))
                    measured = run_stages(sink, per_thread, args.warm and threads)
                    # Closed after each run: stores left open would hold their connections
                    # (several variants' stores over many runs exhaust a server's slots).
                    if isinstance(factory, PostgresColumn):
                        factory.close_stores()
                    results.setdefault(case, {}).setdefault(name, []).append(measured)
                    shutil.rmtree(directory, ignore_errors=True)
        repeats = args.fetch_repeats or max(5, args.runs * 4)
        fetch = None if args.no_fetch else fetch_vs_freeze(scratch, repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        # The postgres column owns the server its variants share: closed even when unnamed.
        # Every column is closed (its servers stopped) even when one before it fails to close.
        factories = [
            BACKENDS[n] for n in [*names, *(["postgres"] if args.postgres_variant else [])]
        ]
        # A column object owns what its stores share; a store class (a bare factory, whose
        # `close` is an instance's) owns nothing.
        closers = [None if isinstance(f, type) else getattr(f, "close", None) for f in factories]
        close_all(close for close in closers if close is not None)

    import tokencapture

    # Which build was measured (this tree's or --package's).
    report: dict[str, Any] = {"package": str(Path(tokencapture.__file__).parent), "cases": {}}
    print(
        f"{'case':8} {'backend':14} {'stages/s':>24} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'cpu us/stage':>12}"
    )
    for case, by_name in results.items():
        report["cases"][case] = {}
        for name, runs in by_name.items():
            rate = summary([r["stages_per_s"] for r in runs])
            p50 = statistics.median(r["p50_ms"] for r in runs)
            p99 = statistics.median(r["p99_ms"] for r in runs)
            cpu = statistics.median(r["client_cpu_us"] for r in runs)
            report["cases"][case][name] = {
                "stages_per_s": rate,
                "p50_ms": p50,
                "p99_ms": p99,
                "client_cpu_us": cpu,
            }
            span = f"{rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f})"
            print(f"{case:8} {name:14} {span:>24} {p50:8.2f} {p99:8.2f} {cpu:12.1f}")
        postgres_columns = [n for n in by_name if isinstance(BACKENDS.get(n), PostgresColumn)]
        pairs = [*((n, "file") for n in postgres_columns), ("file", "memory")]
        for top, bottom in pairs:
            if top in by_name and bottom in by_name:
                ratios = [
                    a["stages_per_s"] / b["stages_per_s"]
                    for a, b in zip(by_name[top], by_name[bottom], strict=True)
                ]
                report["cases"][case][f"{top}_vs_{bottom}"] = summary(ratios)
                label = f"{top}/{bottom}"
                print(
                    f"{case:8} {label:14} {statistics.median(ratios):24.2f} "
                    f"(runs {min(ratios):.2f}-{max(ratios):.2f})"
                )
    if fetch is not None:
        report["fetch"] = {k: summary(v) for k, v in fetch.items()}
        ratio = [a / b for a, b in zip(fetch["fetch_ms"], fetch["freeze_ms"], strict=True)]
        report["fetch"]["fetch_vs_freeze"] = summary(ratio)
        print(
            f"fetch of a 24-call chain: {statistics.median(fetch['fetch_ms']):.2f} ms, token "
            f"store re-freeze {statistics.median(fetch['freeze_ms']):.2f} ms, ratio "
            f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})"
        )
    report["load_average"] = list(os.getloadavg())
    print("load average {:.2f} {:.2f} {:.2f}".format(*report["load_average"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
