"""Benchmark: the capture gateway beside calling the upstream directly, and beside rLLM's.

    python benches/bench_gateway.py [--sessions 16 64] [--seconds 5] [--rounds 5]
        [--rllm-python "$(bash benches/rllm-env.sh)"] [--vllm] [--json results.json]

For each target and concurrency it runs closed-loop sessions (each sends its next chat call as
soon as the previous answer arrives) for `--seconds`, then SIGKILLs the target while calls are
in flight and counts the acknowledged calls the store does not have. Figures:

* captured calls/s (answers with status 200 per second of the measured window);
* gateway CPU per call (user + system CPU of the gateway's processes over the window / calls);
* p50 / p99 latency, and the p50 / p99 added over calling the upstream directly;
* acknowledged calls lost after the SIGKILL (read back through the store API; for rLLM
  through its `/sessions/{id}/traces` API after a restart on the same database).

Targets: `direct` (the fake upstream itself), `tokencapture` (`tokencapture gateway`, file
store), and, when `--rllm-python` names a venv with PyPI's `rllm-model-gateway` (installed
apart: it is not our dependency), `rllm` (its default: traces written after the answer) and
`rllm-sync` (`sync_traces: true`). The upstream is the fast fake (tests/fake_upstream.py) in
its own process, so the engine is not the bottleneck; `--vllm` adds a run against the tiny
vLLM of the tests (tests/vllm_engine.py; slow, a minute to start).

The load generator, the upstream and the gateway share the machine: on a 2-core machine the
figures are bounded by that, and when other work runs they are "measured while the machine was
shared". The script prints them with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fake_upstream import (  # noqa: E402
    Server,
    free_port,
    server_dir,
    server_runner,
    start_fake,
    start_gateway,
)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]


def cpu_seconds(group: int) -> float:
    """User + system CPU of every live process in process group `group` (a server and, with
    `--workers`, its worker processes, whose CPU its own figures do not include)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == group:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _load(
    url_for: Any, sessions: int, seconds: float, server: Server | None, kill: bool, model: str
) -> dict[str, Any]:
    latencies: list[float] = []
    acknowledged: dict[str, int] = {}
    measuring = False
    stop = asyncio.Event()
    errors = 0

    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 8}).encode()

    async def session(client: aiohttp.ClientSession, index: int) -> None:
        nonlocal errors
        sid = f"bench{index}"
        url = url_for(sid)
        turn = 0
        while not stop.is_set():
            started = time.perf_counter()
            try:
                async with client.post(
                    url,
                    data=body,
                    headers={
                        "x-model-call-id": f"{sid}-{turn}",
                        "content-type": "application/json",
                    },
                ) as answer:
                    await answer.read()
                    status = answer.status
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                if stop.is_set():
                    return
                await asyncio.sleep(0.01)
                continue
            turn += 1
            if status != 200:
                errors += 1
                continue
            acknowledged[sid] = acknowledged.get(sid, 0) + 1
            if measuring:
                latencies.append(time.perf_counter() - started)

    # aiohttp's client: the load generator shares the CPUs and must cost little per call.
    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as client:
        tasks = [asyncio.create_task(session(client, i)) for i in range(sessions)]
        await asyncio.sleep(min(1.0, seconds / 4))  # warm up
        cpu0 = cpu_seconds(server.process.pid) if server and server.process else 0.0
        measuring, started = True, time.perf_counter()
        await asyncio.sleep(seconds)
        measuring, elapsed = False, time.perf_counter() - started
        calls = len(latencies)
        cpu1 = cpu_seconds(server.process.pid) if server and server.process else 0.0
        if kill and server is not None:
            server.kill()  # SIGKILL with calls in flight
        stop.set()
        await asyncio.gather(*tasks)
    return {
        "calls": calls,
        "calls_per_s": calls / elapsed,
        "cpu_ms_per_call": (cpu1 - cpu0) / calls * 1e3 if calls and server else None,
        "p50_ms": _percentile(latencies, 0.50) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
        "acknowledged": dict(acknowledged),
        "errors_after_kill_or_refused": errors,
    }


def _session_url(prefix: str, sid: str) -> str:
    return f"{prefix}{sid}/v1/chat/completions"


def _lost_tokencapture(store: Path, acknowledged: dict[str, int]) -> int:
    from tokencapture import TokenCaptureStore

    capture = TokenCaptureStore(store)
    lost = 0
    for sid, count in acknowledged.items():
        ids = {e.model_call_id for e in capture.read_entries(sid)}
        lost += sum(1 for turn in range(count) if f"{sid}-{turn}" not in ids)
    return lost


def _start_rllm(python: str, upstream: str, db: Path, log_dir: Path, sync: bool) -> Server:
    port = free_port()
    config = log_dir / f"rllm-{port}.yaml"
    config.write_text(f"sync_traces: {'true' if sync else 'false'}\n")
    argv = [
        python,
        "-m",
        "rllm_model_gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker",
        f"{upstream}/v1",
        "--db-path",
        str(db),
        "--log-level",
        "WARNING",
        "--config",
        str(config),
    ]
    return Server(argv, port, log_dir / f"rllm-{port}.log").start()


def _start_baseline(sources: str, upstream: str, store: Path, log_dir: Path) -> Server:
    """`tokencapture gateway` of another build: the `python/` of `sources` (a copy of another
    commit's tree with its `_core` extension built in place) first on the path."""
    runner, python = server_runner()
    *interpreter, code = python
    path = str(Path(sources).resolve() / "python")
    code = code.replace("import runpy", f"sys.path.insert(0, {path!r}); import runpy", 1)
    port = free_port()
    argv = [*interpreter, code, "tokencapture", "gateway", "--upstream", upstream]
    argv += ["--store", str(store), "--port", str(port)]
    return Server(argv, port, log_dir / f"baseline-{port}.log", runner=runner).start()


def _lost_rllm(
    python: str, upstream: str, db: Path, log_dir: Path, acknowledged: dict[str, int]
) -> int:
    server = _start_rllm(python, upstream, db, log_dir, sync=False)
    try:
        lost = 0
        for sid, count in acknowledged.items():
            answer = httpx.get(f"{server.url}/sessions/{sid}/traces", timeout=30)
            traces = answer.json() if answer.status_code == 200 else []
            lost += max(0, count - len(traces))
        return lost
    finally:
        server.stop()


def _measure_target(
    args: argparse.Namespace,
    work: Path,
    target: str,
    upstream_name: str,
    upstream: str,
    model: str,
    sessions: int,
    round_: int,
    direct: dict[str, Any],
) -> dict[str, Any]:
    store = work / f"{target}-{upstream_name}-{sessions}-{round_}"
    if target == "tokencapture":
        server = start_gateway(upstream, store, work)
        prefix = f"{server.url}/rollouts/"
    elif target.startswith("workers"):
        server = start_gateway(upstream, store, work, "--workers", target.removeprefix("workers"))
        prefix = f"{server.url}/rollouts/"
    elif target == "baseline":
        server = _start_baseline(args.baseline, upstream, store, work)
        prefix = f"{server.url}/rollouts/"
    else:
        store.mkdir()
        server = _start_rllm(
            args.rllm_python, upstream, store / "traces.db", work, target == "rllm-sync"
        )
        prefix = f"{server.url}/sessions/"
    try:
        measured = asyncio.run(
            _load(
                functools.partial(_session_url, prefix),
                sessions,
                args.seconds,
                server,
                True,
                model,
            )
        )
    finally:
        server.kill()
    acknowledged = measured.pop("acknowledged")
    if target in ("tokencapture", "baseline") or target.startswith("workers"):
        lost = _lost_tokencapture(store, acknowledged)
    else:
        lost = _lost_rllm(args.rllm_python, upstream, store / "traces.db", work, acknowledged)
    return {
        "upstream": upstream_name,
        "sessions": sessions,
        "round": round_,
        "target": target,
        **measured,
        "acknowledged_total": sum(acknowledged.values()),
        "acknowledged_lost": lost,
        "added_p50_ms": measured["p50_ms"] - direct["p50_ms"],
        "added_p99_ms": measured["p99_ms"] - direct["p99_ms"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """`--rounds` rounds; in each, for every upstream and concurrency, the direct baseline
    and then every target, in an order rotated from round to round (the machine's noise
    falls on all of them alike)."""
    # As root the gateway runs as the tests' unprivileged account: its stores live where that
    # account can write (tests/fake_upstream.py's server_dir).
    work = server_dir("bench-gateway-")
    results: dict[str, Any] = {
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "runs": [],
    }
    upstreams: list[tuple[str, str, Any]] = []
    fake = start_fake(work)
    if not args.skip_fake:
        upstreams.append(("fake", fake.url, "fake-tiny"))
    engine = None
    if args.vllm:
        from tests.vllm_engine import VllmEngine

        engine = VllmEngine()
        engine.start()
        upstreams.append(("vllm", engine.base_url, engine.model))
    targets = ["tokencapture"]
    if args.workers > 1:
        targets.append(f"workers{args.workers}")
    if args.baseline:
        targets.append("baseline")
    if args.rllm_python:
        targets += ["rllm", "rllm-sync"]
    try:
        for round_ in range(args.rounds):
            for upstream_name, upstream, model in upstreams:
                for sessions in args.sessions:
                    direct = asyncio.run(
                        _load(
                            lambda sid, u=upstream: f"{u}/v1/chat/completions",
                            sessions,
                            args.seconds,
                            None,
                            False,
                            model,
                        )
                    )
                    row = {
                        "upstream": upstream_name,
                        "sessions": sessions,
                        "round": round_,
                        "target": "direct",
                        **{k: v for k, v in direct.items() if k != "acknowledged"},
                    }
                    results["runs"].append(row)
                    print(_line(row), flush=True)
                    shift = round_ % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        row = _measure_target(
                            args,
                            work,
                            target,
                            upstream_name,
                            upstream,
                            model,
                            sessions,
                            round_,
                            direct,
                        )
                        results["runs"].append(row)
                        print(_line(row), flush=True)
    finally:
        fake.stop()
        if engine is not None:
            engine.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    results["summary"] = summarize(results["runs"])
    return results


_FIGURES = ("calls_per_s", "cpu_ms_per_call", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (upstream, sessions, target): the median and range of each figure over the rounds,
    the acknowledged calls lost (summed), and for tokencapture its per-round ratios to rLLM's
    (calls/s ours / theirs, CPU per call theirs / ours)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in runs:
        groups.setdefault((row["upstream"], row["sessions"], row["target"]), []).append(row)
    summary = []
    for (upstream, sessions, target), rows in groups.items():
        item: dict[str, Any] = {"upstream": upstream, "sessions": sessions, "target": target}
        for figure in _FIGURES:
            values = [r[figure] for r in rows if r.get(figure) is not None]
            if values:
                item[figure] = _spread(values)
        if "acknowledged_total" in rows[0]:
            item["acknowledged_total"] = sum(r["acknowledged_total"] for r in rows)
            item["acknowledged_lost"] = sum(r["acknowledged_lost"] for r in rows)
        if target == "tokencapture" or target.startswith("workers"):
            for peer in ("baseline", "rllm", "rllm-sync"):
                theirs = {r["round"]: r for r in groups.get((upstream, sessions, peer), [])}
                pairs = [(r, theirs[r["round"]]) for r in rows if r["round"] in theirs]
                if pairs:
                    item[f"calls_per_s_x_{peer}"] = _spread(
                        [
                            ours["calls_per_s"] / max(them["calls_per_s"], 1e-9)
                            for ours, them in pairs
                        ]
                    )
                    item[f"cpu_per_call_{peer}_over_ours"] = _spread(
                        [them["cpu_ms_per_call"] / ours["cpu_ms_per_call"] for ours, them in pairs]
                    )
        summary.append(item)
    return summary


def _summary_line(item: dict[str, Any]) -> str:
    def fmt(name: str, unit: str = "") -> str:
        s = item.get(name)
        if s is None:
            return ""
        return f" {name} {s['median']:.2f}{unit} [{s['min']:.2f}-{s['max']:.2f}]"

    text = f"{item['upstream']:>5} {item['sessions']:>3} {item['target']:>12}:"
    text += fmt("calls_per_s") + fmt("cpu_ms_per_call") + fmt("p50_ms") + fmt("added_p50_ms")
    text += fmt("added_p99_ms")
    if "acknowledged_total" in item:
        text += f" lost {item['acknowledged_lost']}/{item['acknowledged_total']}"
    for peer in ("baseline", "rllm", "rllm-sync"):
        text += fmt(f"calls_per_s_x_{peer}", "x") + fmt(f"cpu_per_call_{peer}_over_ours", "x")
    return text


def _line(row: dict[str, Any]) -> str:
    text = (
        f"{row.get('round', 0)}: {row['upstream']:>5} {row['sessions']:>3} sessions "
        f"{row['target']:>12}: "
        f"{row['calls_per_s']:8.1f} calls/s  p50 {row['p50_ms']:7.2f} ms  "
        f"p99 {row['p99_ms']:7.2f} ms"
    )
    if row.get("cpu_ms_per_call") is not None:
        text += f"  CPU {row['cpu_ms_per_call']:6.2f} ms/call"
    if "added_p50_ms" in row:
        text += (
            f"  added p50 {row['added_p50_ms']:+.2f} ms p99 {row['added_p99_ms']:+.2f} ms"
            f"  lost {row['acknowledged_lost']}/{row['acknowledged_total']} acknowledged"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions")
    parser.add_argument(
        "--rllm-python",
        default=None,
        help="python of a venv with rllm-model-gateway (measured beside ours)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="a source tree of another build (its python/ with _core built in place), measured "
        "as `baseline` in the same rounds (an interleaved A/B)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="also measure `tokencapture gateway --workers N` (as `workersN`; its CPU is the "
        "supervisor's and its workers')",
    )
    parser.add_argument("--vllm", action="store_true", help="also against the tiny vLLM")
    parser.add_argument(
        "--skip-fake", action="store_true", help="with --vllm: only against the tiny vLLM"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    print(
        f"load average {os.getloadavg()} on {os.cpu_count()} CPUs; the load generator, the "
        "upstream and the gateway share them (figures measured while the machine was shared "
        "when the load average exceeds the CPUs)",
        flush=True,
    )
    results = run(args)
    print("\nmedians [ranges] over the rounds:", flush=True)
    for item in results["summary"]:
        print(_summary_line(item), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
