"""`stage()` throughput of PostgresStagingStore beside FileStagingStore, in one run.

W1-sized deltas (320 tokens, 32 generated) from 1, 8 and 32 threads; each thread stages its own
rollouts' chains (24 calls a rollout). Every round runs every (backend, threads) cell once, in a
rotated order (so neither backend always goes first), on a fresh directory / fresh database;
the figures are medians and ranges over the rounds, and the PostgreSQL / file ratio of each
round (issue 23's target: PostgreSQL >= 0.7x the file backend's stages/s at 32 threads).

The PostgreSQL server is a throwaway one on these cores (tests/pg_server.py: fsync and
synchronous_commit on), unless --dsn names a server (each round then makes its own database
on it). The records are built before timing; a stage's time includes its native verification
and encoding, the commit, and (for PostgreSQL) the hop to the store's event-loop thread.

    python benches/bench_staging_pg.py [--rounds 5] [--stages 1920] [--threads 1,8,32] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.pg_server import PgServer
from tests.staging_backends import chain

from tokencapture.postgres import PostgresStagingStore, install_schema_sync
from tokencapture.staging import FileStagingStore

CALLS_PER_ROLLOUT = 24
DELTA_TOKENS = 320


def workload(stages: int, threads: int) -> list[list[Any]]:
    """Per thread, the records it stages (whole rollouts of 24 chained calls)."""
    rollouts = max(threads, stages // CALLS_PER_ROLLOUT)
    per_thread: list[list[Any]] = [[] for _ in range(threads)]
    tag = uuid.uuid4().hex[:8]
    for n in range(rollouts):
        records = chain(f"w1-{tag}-{n}", CALLS_PER_ROLLOUT, size=DELTA_TOKENS)
        per_thread[n % threads].extend(records)
    return per_thread


def drive(store: Any, per_thread: list[list[Any]]) -> tuple[float, list[float]]:
    """Stage every thread's records; (seconds, per-stage latencies)."""
    latencies: list[list[float]] = [[] for _ in per_thread]
    barrier = threading.Barrier(len(per_thread) + 1)
    failures: list[str] = []

    def run(index: int) -> None:
        mine = latencies[index]
        barrier.wait()
        for record in per_thread[index]:
            began = time.perf_counter()
            result = store.stage(record)
            mine.append(time.perf_counter() - began)
            if not result.ok:
                failures.append(str(result.error))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(per_thread))]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if failures:
        raise RuntimeError(f"{len(failures)} stage(s) failed, first: {failures[0]}")
    return elapsed, [x for xs in latencies for x in xs]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def new_database(server_dsn: str, admin: Any) -> str:
    name = f"bench_{uuid.uuid4().hex[:10]}"
    admin(f"CREATE DATABASE {name}")
    dsn = server_dsn.rsplit("/", 1)[0] + "/" + name
    install_schema_sync(dsn)
    return dsn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stages", type=int, default=1920, help="stages per cell")
    parser.add_argument("--threads", default="1,8,32")
    parser.add_argument("--dsn", default=None, help="a server to use (default: a throwaway one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]

    server: PgServer | None = None
    if args.dsn is None:
        server = PgServer()
        server.start()
        base_dsn = server.dsn

        def admin(sql: str) -> None:
            assert server is not None
            server.psql(sql)
    else:
        import asyncio

        import asyncpg  # type: ignore[import-untyped, unused-ignore]

        base_dsn = args.dsn

        def admin(sql: str) -> None:
            async def go() -> None:
                connection = await asyncpg.connect(base_dsn)
                try:
                    await connection.execute(sql)
                finally:
                    await connection.close()

            asyncio.run(go())

    cells = [(backend, t) for t in thread_counts for backend in ("file", "postgres")]
    results: dict[str, list[dict[str, float]]] = {f"{b}@{t}": [] for b, t in cells}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-staging-pg-") as scratch:
            for round_index in range(args.rounds):
                shift = round_index % len(cells)
                for backend, threads in cells[shift:] + cells[:shift]:
                    per_thread = workload(args.stages, threads)
                    store: Any
                    if backend == "file":
                        store = FileStagingStore(Path(scratch) / uuid.uuid4().hex)
                    else:
                        store = PostgresStagingStore(new_database(base_dsn, admin))
                    try:
                        elapsed, latencies = drive(store, per_thread)
                    finally:
                        if backend == "postgres":
                            store.close()
                    count = len(latencies)
                    results[f"{backend}@{threads}"].append(
                        {
                            "stages_per_s": count / elapsed,
                            "p50_ms": percentile(latencies, 0.50) * 1000,
                            "p99_ms": percentile(latencies, 0.99) * 1000,
                        }
                    )
                    print(
                        f"round {round_index + 1} {backend:>8} {threads:>2} threads: "
                        f"{count / elapsed:8.0f} stages/s",
                        file=sys.stderr,
                    )
    finally:
        if server is not None:
            server.cleanup()

    summary: dict[str, Any] = {}
    for cell, rounds in results.items():
        summary[cell] = {
            metric: {
                "median": statistics.median(r[metric] for r in rounds),
                "min": min(r[metric] for r in rounds),
                "max": max(r[metric] for r in rounds),
            }
            for metric in ("stages_per_s", "p50_ms", "p99_ms")
        }
    for threads in thread_counts:
        ratios = [
            pg["stages_per_s"] / f["stages_per_s"]
            for pg, f in zip(
                results[f"postgres@{threads}"], results[f"file@{threads}"], strict=True
            )
        ]
        summary[f"ratio@{threads}"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    print(f"{'CELL':<14} {'STAGES/S median [min-max]':>32} {'P50 ms':>8} {'P99 ms':>8}")
    for threads in thread_counts:
        for backend in ("file", "postgres"):
            s = summary[f"{backend}@{threads}"]
            rate = s["stages_per_s"]
            print(
                f"{backend + '@' + str(threads):<14} "
                f"{rate['median']:>10.0f} [{rate['min']:.0f}-{rate['max']:.0f}]".ljust(48)
                + f"{s['p50_ms']['median']:>8.2f} {s['p99_ms']['median']:>8.2f}"
            )
        r = summary[f"ratio@{threads}"]
        print(
            f"  postgres/file at {threads} threads: {r['median']:.2f}x "
            f"[{r['min']:.2f}-{r['max']:.2f}] over {args.rounds} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
