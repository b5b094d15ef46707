"""What the OpenTelemetry instruments cost a put: puts/s with and without an SDK meter provider.

    python benches/bench_otel.py [--rounds N] [--puts N] [--dir PATH] [--json PATH]

Three conditions, run in the same process on the same store kind, alternating within each
round (the order rotates between rounds) so load from other processes hits them alike:

- ``off``: the store's `Metrics` records nothing into OpenTelemetry (what a process without
  `opentelemetry-api`, or with ``TOKENCAPTURE_OTEL=0``, runs);
- ``api``: `opentelemetry-api` present, no SDK provider installed (the API's no-op meters);
- ``sdk``: an SDK `MeterProvider` with an in-memory reader installed through
  `tokencapture.metrics.use_meter_provider` (every put is aggregated for real).

Each run writes `--puts` fresh entries with `TokenCaptureStore.append` (append + fsync, the
synchronous put) into a new store under `--dir` (default: /dev/shm when it exists, where an
fsync is cheapest, so an instrumentation cost is least hidden by the disk). Reported: the
median and range of puts/s per condition over the rounds, and the paired ratio to ``off``
(each round's ``api``/``sdk`` divided by the same round's ``off``). A micro measurement of one
`Metrics.observe` call per condition shows the per-put cost in nanoseconds directly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokencapture import metrics
from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore

CONDITIONS = ("off", "api", "sdk")


def entries(count: int) -> list[TokenEntry]:
    """`count` small entries spread over 8 rollouts (built before the clock starts)."""
    return [
        TokenEntry(
            rollout_id=f"r{i % 8}",
            model_call_id=f"call-{i}",
            model="bench",
            prompt_token_ids=list(range(i % 97, i % 97 + 64)),
            generation_token_ids=list(range(32)),
            generation_log_probs=[-0.5] * 32,
            created_at=1700000000.0 + i,
        )
        for i in range(count)
    ]


def setup(condition: str, sdk_provider: Any) -> Callable[[TokenCaptureStore], None]:
    """Install `condition`'s provider; return what to do to each new store."""
    metrics.use_meter_provider(sdk_provider if condition == "sdk" else None)

    def prepare(store: TokenCaptureStore) -> None:
        if condition == "off":
            store._metrics._otel = None

    return prepare


def run_puts(
    root: Path, batch: list[TokenEntry], prepare: Callable[[TokenCaptureStore], None]
) -> float:
    """Puts per second of `batch` into a new store at `root`."""
    store = TokenCaptureStore(root)
    prepare(store)
    append = store.append
    started = time.perf_counter()
    for entry in batch:
        append(entry)
    return len(batch) / (time.perf_counter() - started)


def observe_ns(prepare: Callable[[TokenCaptureStore], None], root: Path, calls: int) -> float:
    """Nanoseconds of one `Metrics.observe("put", ...)` call, the store's per-put bookkeeping."""
    store = TokenCaptureStore(root)
    prepare(store)
    observe = store._metrics.observe
    started = time.perf_counter()
    for _ in range(calls):
        observe("put", 0.001)
    return (time.perf_counter() - started) / calls * 1e9


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (>= 5)")
    parser.add_argument("--puts", type=int, default=2000, help="puts per run")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    args = parser.parse_args(argv)
    if not metrics.otel_enabled():
        print("opentelemetry-api is not importable (or TOKENCAPTURE_OTEL=0)", file=sys.stderr)
        return 2
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    except ImportError:
        print("needs opentelemetry-sdk: pip install 'tokencapture[test]'", file=sys.stderr)
        return 2
    reader = InMemoryMetricReader()
    sdk_provider = MeterProvider(metric_readers=[reader])
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    work = Path(tempfile.mkdtemp(prefix="bench-otel-", dir=base))
    batch = entries(args.puts)
    samples: dict[str, list[float]] = {condition: [] for condition in CONDITIONS}
    observe: dict[str, list[float]] = {condition: [] for condition in CONDITIONS}
    try:
        for condition in CONDITIONS:  # warm-up: first stores, imports, instrument creation
            run_puts(work / f"warm-{condition}", batch[:200], setup(condition, sdk_provider))
        for round_ in range(args.rounds):
            order = CONDITIONS[round_ % 3 :] + CONDITIONS[: round_ % 3]
            for condition in order:
                prepare = setup(condition, sdk_provider)
                root = work / f"{round_}-{condition}"
                samples[condition].append(run_puts(root, batch, prepare))
                observe[condition].append(observe_ns(prepare, root / "observe", 20000))
                shutil.rmtree(root, ignore_errors=True)
    finally:
        metrics.use_meter_provider(None)
        sdk_provider.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    result: dict[str, Any] = {"rounds": args.rounds, "puts_per_run": args.puts, "dir": str(base)}
    print(f"{args.rounds} alternating rounds of {args.puts} puts (append + fsync) in {base}")
    print(
        f"{'condition':<10}{'puts/s median':>15}{'range':>22}{'ratio to off':>28}{'observe ns':>12}"
    )
    for condition in CONDITIONS:
        ratios = [a / b for a, b in zip(samples[condition], samples["off"], strict=True)]
        stats, ratio = summary(samples[condition]), summary(ratios)
        ns = statistics.median(observe[condition])
        result[condition] = {
            "puts_per_s": stats,
            "paired_ratio_to_off": ratio,
            "observe_ns_median": ns,
            "samples": samples[condition],
        }
        spread = f"{stats['min']:,.0f}-{stats['max']:,.0f}"
        paired = f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"
        print(f"{condition:<10}{stats['median']:>15,.0f}{spread:>22}{paired:>28}{ns:>12,.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
