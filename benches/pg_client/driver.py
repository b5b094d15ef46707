"""Paired measurement: asyncpg (the product's PostgreSQL store) against the `postgres` Rust
client driven from a fixed pool of native threads (this directory's `pg_client_bench`).

`python driver.py --module-dir DIR [--repeats 6] [--rollouts 512] [--batch 64 [11 ...]]
[--clients rust ...]` starts a throwaway server (tests/pg_server.py), and for each repeat
runs the clients below in a rotating order (reversed every other repeat), each in a fresh
process against a fresh database whose schema `tokencapture db init` installed. All run the
same W1-like puts (about 2 KB canonical lines, 32 in flight, many rollouts of 16 calls)
through the same Python path:
`PostgresTokenCaptureStore.put` validates the entry and builds the canonical line and its
digest; only the transport differs:

- asyncpg: the store as shipped (pool of 10 connections, puts waiting for a connection share
  one `put_batch` call of at most 64);
- rust: the same store object whose `_put` hands the arguments to `pg_client_bench.PutPool`
  (10 native threads, one connection each, every queued put up to 64 in one `put_batch` call,
  the most recently idle thread first)
  and awaits a future completed from a descriptor the event loop watches, as the file store's
  native bridge does. The puts of one event-loop iteration are handed over together
  (`submit_many`), the asyncpg batcher's rule;
- rust-eager: the same, but each put is queued the moment it is made (`submit`), as the file
  store's native jobs are: an idle worker takes it at once, so batches are smaller;
- no-transport: the same store object whose `_put` completes each put on the next event-loop
  iteration without sending anything: the floor (validation, canonical line, digest, the
  future, the semaphore) that both clients pay; client CPU minus this is the transport's.

`--batch` sets the most puts in one call for every client (the store's `put_batch_size`);
several values make one column per client and value. `--clients` picks the columns beside
asyncpg, which always runs: the ratios are against the first column.

Each database has `track_functions = 'pl'`, so the parent reads how many `put_batch` calls
the run made (pg_stat_user_functions) and reports puts per call.

Reported per run: puts/s, client CPU per put (the process's user + system time over all its
threads, during the timed puts only) and server CPU per put (the postmaster and its children
from /proc, the same window). Prints a table of medians and ranges and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from time import perf_counter
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CLIENTS = ("asyncpg", "rust", "rust-eager", "no-transport")
PROMPT_TOKENS, GENERATED_TOKENS = 128, 24  # canonical lines of about 2.0 KB
IN_FLIGHT = 32
POOL = 10  # connections: the asyncpg store's default pool_size, and the Rust worker threads
MAX_BATCH = 64  # the asyncpg store's default put_batch_size (--batch changes both clients')

sys.path.insert(0, str(ROOT / "tests"))
# The throwaway server, and its CPU (postmaster and children) read from /proc.
from pg_server import PgServer, server_cpu_seconds  # type: ignore[import-not-found, unused-ignore]  # noqa: E402


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# One client run (a child process) -----------------------------------------------------------


def _connection_warmups() -> list[Any]:
    """One put per connection, run on it before timing (functions compiled, catalog cached)."""
    from bench_data import SmallShape, small_rollouts  # type: ignore[import-not-found, unused-ignore]

    shape = SmallShape(rollouts=POOL, calls=1, prompt_tokens=PROMPT_TOKENS)
    return [calls[0] for calls in small_rollouts(shape, prefix="conn", seed=97)]


def _rust_store(dsn: str, eager: bool) -> Any:
    import pg_client_bench  # type: ignore[import-not-found, unused-ignore]  # built by run.sh

    from tokencapture.postgres import PostgresTokenCaptureStore

    class RustPutStore(PostgresTokenCaptureStore):
        """The product's store with its put transport replaced by the native pool."""

        def __init__(self, dsn: str, eager: bool) -> None:
            super().__init__(dsn)
            self.eager = eager
            self.pending: list[tuple[Any, ...]] = []
            warm = [(0, *self._put_args(entry)) for entry in _connection_warmups()]
            self.pool = pg_client_bench.PutPool(dsn, POOL, MAX_BATCH, warm)
            self.futures: dict[int, asyncio.Future[int]] = {}
            self.tokens = itertools.count()
            self.loop: asyncio.AbstractEventLoop | None = None

        def _drain(self) -> None:
            for token, status, error in self.pool.drain():
                future = self.futures.pop(token, None)
                if future is None or future.done():
                    continue
                if error is not None:
                    future.set_exception(ConnectionError(error))
                else:
                    future.set_result(status)

        async def _put(self, args: Any, entry: object, started: float) -> None:
            try:
                if self.loop is None:
                    self.loop = asyncio.get_running_loop()
                    self.loop.add_reader(self.pool.fileno(), self._drain)
                token = next(self.tokens)
                future = self.loop.create_future()
                self.futures[token] = future
                if self.eager:
                    self.pool.submit(token, *args)
                else:
                    if not self.pending:
                        self.loop.call_soon(self._hand_over)
                    self.pending.append((token, *args))
                status = await future
                self._put_status(status, args)
            except BaseException as exc:
                self._put_failed(entry, exc, started)
                raise
            self._metrics.observe("put", perf_counter() - started)

        def _hand_over(self) -> None:
            pending, self.pending = self.pending, []
            self.pool.submit_many(pending)

        def shutdown(self) -> None:
            if self.loop is not None:
                self.loop.remove_reader(self.pool.fileno())
            self.pool.close()

    return RustPutStore(dsn, eager)


def _no_transport_store(dsn: str) -> Any:
    from tokencapture.postgres import PostgresTokenCaptureStore

    class NoTransportStore(PostgresTokenCaptureStore):
        async def _put(self, args: Any, entry: object, started: float) -> None:
            try:
                loop = asyncio.get_running_loop()
                future: asyncio.Future[int] = loop.create_future()
                loop.call_soon(future.set_result, 0)
                self._put_status(await future, args)
            except BaseException as exc:
                self._put_failed(entry, exc, started)
                raise
            self._metrics.observe("put", perf_counter() - started)

        def shutdown(self) -> None:
            pass

    return NoTransportStore(dsn)


async def _timed(store: Any, client: str, rollouts: list[list[Any]], pid: int) -> dict[str, Any]:
    # Warm up: every connection runs one put_batch (the Rust pool did so when it connected),
    # then one put per in-flight slot goes through the store.
    if client == "asyncpg":
        from tokencapture.postgres.store import _PUT_BATCH

        pool = await store._client.pool()
        held = [await pool.acquire() for _ in range(POOL)]
        for connection, entry in zip(held, _connection_warmups(), strict=True):
            args = store._put_args(entry)
            await connection.fetchval(_PUT_BATCH, *([value] for value in args))
        for connection in held:
            await pool.release(connection)
    from bench_data import SmallShape, small_rollouts  # type: ignore[import-not-found, unused-ignore]

    warm = small_rollouts(SmallShape(rollouts=IN_FLIGHT, calls=1), prefix="warm", seed=98)
    await asyncio.gather(*(store.put(calls[0]) for calls in warm))
    semaphore = asyncio.Semaphore(IN_FLIGHT)

    async def one(calls: list[Any]) -> None:
        for entry in calls:
            async with semaphore:
                await store.put(entry)

    cpu0, server0, begin = _process_cpu(), server_cpu_seconds(pid), perf_counter()
    await asyncio.gather(*(one(calls) for calls in rollouts))
    wall = perf_counter() - begin
    cpu1, server1 = _process_cpu(), server_cpu_seconds(pid)
    puts = sum(len(calls) for calls in rollouts)
    return {
        "client": client,
        "puts": puts,
        "puts_per_s": puts / wall,
        "client_cpu_us_per_put": (cpu1 - cpu0) / puts * 1e6,
        "server_cpu_us_per_put": (server1 - server0) / puts * 1e6,
        "wall_s": wall,
    }


def child(client: str, dsn: str, pid: int, rollouts_count: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benches"))
    from bench_data import SmallShape, small_rollouts  # type: ignore[import-not-found, unused-ignore]
    from tokencapture.postgres import PostgresTokenCaptureStore
    from tokencapture.store import canonical_line

    shape = SmallShape(
        rollouts=rollouts_count,
        calls=16,
        prompt_tokens=PROMPT_TOKENS,
        generated_tokens=GENERATED_TOKENS,
    )
    rollouts = small_rollouts(shape)
    line_bytes = statistics.mean(len(canonical_line(entry)) for entry in rollouts[0])
    store: Any
    if client == "asyncpg":
        store = PostgresTokenCaptureStore(dsn, put_batch_size=MAX_BATCH)
    elif client == "no-transport":
        store = _no_transport_store(dsn)
    else:
        store = _rust_store(dsn, eager=client == "rust-eager")

    async def main() -> dict[str, Any]:
        try:
            return await _timed(store, client, rollouts, pid)
        finally:
            if client != "asyncpg":
                store.shutdown()
            await store.close()

    result = asyncio.run(main())
    result["line_bytes"] = line_bytes
    return result


# The paired runs (the parent process) -------------------------------------------------------


def _summary(values: list[float]) -> str:
    spec = ",.0f" if statistics.median(values) >= 100 else ".1f"
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def parent(args: argparse.Namespace) -> None:
    names = ("asyncpg", *(c for c in args.clients if c != "asyncpg"))
    # A column is a client and a batch limit; the ratios are against the first column.
    specs = [(name, batch) for batch in args.batch for name in names]
    labels = {spec: spec[0] if len(args.batch) == 1 else f"{spec[0]}@{spec[1]}" for spec in specs}
    clients = [labels[spec] for spec in specs]
    server = PgServer()

    def psql(dsn: str, sql: str) -> str:
        found = subprocess.run(
            [f"{server.bindir}/psql", "-qAt", "-d", dsn, "-c", sql],
            check=True,
            capture_output=True,
            text=True,
        )
        return found.stdout.strip()

    runs: list[dict[str, Any]] = []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(args.module_dir), str(ROOT / "benches")]),
    }
    try:
        server.start()
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        for repeat in range(args.repeats):
            # Rotate which client goes first, second and third.
            turn = repeat % len(specs)
            order = specs[turn:] + specs[:turn]
            if repeat % 2:
                order = order[::-1]
            for client, batch in order:
                database = f"run{repeat}_{client.replace('-', '_')}_{batch}"
                psql(server.dsn, f"CREATE DATABASE {database}")
                dsn = server.dsn_for(database)
                psql(dsn, f"ALTER DATABASE {database} SET track_functions = 'pl'")
                subprocess.run(
                    [sys.executable, "-m", "tokencapture", "db", "init", dsn],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                load = os.getloadavg()[0]
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        client,
                        "--dsn",
                        dsn,
                        "--server-pid",
                        str(server.pid),
                        "--rollouts",
                        str(args.rollouts),
                        "--batch",
                        str(batch),
                    ],
                    check=False,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"{client} run failed:\n{out.stderr}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                calls = psql(
                    dsn,
                    "SELECT calls FROM pg_stat_user_functions WHERE funcname = 'put_batch'",
                )
                # Every acknowledged put is stored (timed puts, one per connection, 32 warm-up).
                stored = int(psql(dsn, "SELECT count(*) FROM tokencapture.entries"))
                expected = 0 if client == "no-transport" else result["puts"] + POOL + IN_FLIGHT
                if stored != expected:
                    raise RuntimeError(f"{client}: {stored} entries stored, {expected} expected")
                # The warm-up's calls are in the count too (see puts_per_call).
                result.update(
                    repeat=repeat,
                    load_before=load,
                    put_batch_calls=int(calls or 0),
                    stored=stored,
                    batch=batch,
                    label=labels[client, batch],
                )
                runs.append(result)
                print(json.dumps(result), flush=True)
    finally:
        server.cleanup()
    by = {client: [run for run in runs if run["label"] == client] for client in clients}
    print(
        f"\n{args.repeats} paired repeats, {runs[0]['puts']} puts each, at most {args.batch} a "
        f"call, {runs[0]['line_bytes']:.0f}-byte lines, {IN_FLIGHT} in flight; started {started}"
    )
    for run in runs:
        # Not counting the POOL one-put calls that warmed each connection.
        calls = run["put_batch_calls"] - POOL
        run["puts_per_call"] = (run["puts"] + IN_FLIGHT) / calls if calls > 0 else 0.0
    header = f"{'metric':22}" + "".join(f"{client:>24}" for client in clients)
    print(header + "".join(f"{client + '/' + clients[0]:>24}" for client in clients[1:]))
    for key, label in (
        ("puts_per_s", "puts/s"),
        ("client_cpu_us_per_put", "client CPU us/put"),
        ("server_cpu_us_per_put", "server CPU us/put"),
        ("puts_per_call", "puts per put_batch"),
    ):
        line = f"{label:22}" + "".join(
            f"{_summary([run[key] for run in by[client]]):>24}" for client in clients
        )
        for client in clients[1:]:
            ratios = [
                other[key] / base[key]
                for base, other in zip(by[clients[0]], by[client], strict=True)
            ]
            line += f"{_ratio(ratios):>24}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "runs": runs}, indent=1) + "\n")


def main() -> None:
    global MAX_BATCH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module-dir", type=Path, help="where pg_client_bench's .so is")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--rollouts", type=int, default=512, help="rollouts of 16 puts per run")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[MAX_BATCH], help="most puts in one call"
    )
    parser.add_argument(
        "--clients", nargs="+", choices=CLIENTS, default=CLIENTS, help="asyncpg always runs"
    )
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    MAX_BATCH = args.batch[0]
    if args.child:
        print(json.dumps(child(args.child, args.dsn, args.server_pid, args.rollouts)))
    else:
        parent(args)


if __name__ == "__main__":
    main()
