"""W3, columnar: freeze every W2 rollout as Arrow columns, as objects, and with NeMo Gym's store.

A trainer process opens the store and freezes a batch of W2 rollouts (16 rollouts of 24
calls, prompts growing to ~27.6k tokens; `bench_data.AgenticShape`). Three columns, each run
in its own worker process on its own fresh copy of the same unfrozen logs:

* `columnar`: `freeze_columns_now`;
* `objects`: `freeze_now` (`TokenEntry` objects);
* `nemo-gym`: NeMo Gym 0.7.0's `TokenCaptureStore.freeze_now`, where it imports
  (`tests/nemo_oracle.py` finds it).

Each worker times the freezes (`ms_per_freeze`), then a trainer's next step: per entry, its
prompt ids, generated ids and log-probs as numpy int64/float64 arrays (through
`pyarrow.table(snapshot)` for the columns, `numpy.array(list)` for objects);
`ms_per_trainer_read` is both together. Then it freezes every rollout again
(`ms_per_refreeze`: nothing changed, so no state write and no fsync). Runs are paired (one
run = each column once, in rotated order); the report gives medians and ranges of the
per-run ratios. The columnar worker also checks every token id and log-prob against the
object freeze (outside the timed part) and reports its peak memory above its baseline
against the bytes of the snapshots' token ids and log-probs.

    python benches/bench_columnar.py --runs 5 [--json benches/results/columnar.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parent
ROOT = BENCHES.parent
for path in (BENCHES, ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_data import AgenticShape, agentic_rollouts, import_numeric_libraries  # noqa: E402

NEMO_GYM = "nemo-gym"
COLUMNS = ("columnar", "objects", NEMO_GYM)
RESULT = "RESULT "


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _flat(table: Any, name: str) -> tuple[Any, Any]:
    """A list column's values and offsets as numpy views (the batch is one chunk)."""
    column = table[name]
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return array.values.to_numpy(zero_copy_only=True), array.offsets.to_numpy()


def to_numpy_columnar(snapshot: Any) -> list[list[Any]]:
    """Per entry, numpy int64/float64 views of its prompt ids, generated ids and log-probs."""
    import numpy as np
    import pyarrow as pa  # type: ignore[import-untyped]

    table = pa.table(snapshot)
    fields = []
    for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        values, offsets = _flat(table, name)
        fields.append(np.split(values, offsets[1:-1]))
    return fields


def to_numpy_objects(entries: Any) -> list[list[Any]]:
    """The same arrays from `TokenEntry` objects (what a trainer must do with them)."""
    import numpy as np

    return [
        [np.array(e.prompt_token_ids, dtype=np.int64) for e in entries],
        [np.array(e.generation_token_ids, dtype=np.int64) for e in entries],
        [np.array(e.generation_log_probs, dtype=np.float64) for e in entries],
    ]


def worker(column: str, root: Path, rollout_ids: list[str]) -> dict[str, Any]:
    """Freeze every rollout once (first freezes: each makes its state durable), then turn the
    token arrays into numpy arrays as a trainer would."""
    if column == NEMO_GYM:
        from tests.nemo_oracle import import_nemo

        store: Any = import_nemo("store").TokenCaptureStore(root)
    else:
        from tokencapture.store import TokenCaptureStore

        store = TokenCaptureStore(root)
    import numpy as np

    import_numeric_libraries()  # before the clock, as a trainer has them: long before it reads

    baseline = _rss_now_mb()
    cpu0 = _cpu_s()
    begin = time.perf_counter()
    if column == "columnar":
        snapshots: list[Any] = [store.freeze_columns_now(r) for r in rollout_ids]
    else:
        snapshots = [store.freeze_now(r).entries for r in rollout_ids]
    frozen = time.perf_counter()
    cpu1 = _cpu_s()
    peak = _peak_rss_mb()
    convert = to_numpy_columnar if column == "columnar" else to_numpy_objects
    arrays = [convert(snapshot) for snapshot in snapshots]
    converted = time.perf_counter()
    cpu2 = _cpu_s()
    # Freeze again: nothing changed, so no state is written and no fsync waited for (on a
    # busy disk the first freezes' fsyncs dominate their wall time).
    freeze = store.freeze_columns_now if column == "columnar" else store.freeze_now
    cpu3 = _cpu_s()
    again = time.perf_counter()
    for rollout_id in rollout_ids:
        freeze(rollout_id)
    refrozen = time.perf_counter()
    cpu4 = _cpu_s()
    n = len(rollout_ids)
    result: dict[str, Any] = {
        "ms_per_refreeze": (refrozen - again) / n * 1e3,
        "cpu_ms_per_refreeze": (cpu4 - cpu3) / n * 1e3,
        "ms_per_freeze": (frozen - begin) / n * 1e3,
        "cpu_ms_per_freeze": (cpu1 - cpu0) / n * 1e3,
        "ms_per_trainer_read": (converted - begin) / n * 1e3,
        "cpu_ms_per_trainer_read": (cpu2 - cpu0) / n * 1e3,
        "peak_above_baseline_mb": peak - baseline,
    }
    if column == "columnar":
        ids = sum(len(a) for fields in arrays for a in (*fields[0], *fields[1]))
        probs = sum(len(a) for fields in arrays for a in fields[2])
        token_bytes = (ids + probs) * 8
        result["snapshot_token_bytes_mb"] = token_bytes / 2**20
        # Token ids at 4 bytes (int32) and log-probs at 8: the smallest faithful form.
        result["compact_token_bytes_mb"] = (ids * 4 + probs * 8) / 2**20
        result["memory_ratio"] = (
            result["peak_above_baseline_mb"] / result["snapshot_token_bytes_mb"]
        )
        result["memory_ratio_vs_int32"] = (
            result["peak_above_baseline_mb"] / result["compact_token_bytes_mb"]
        )
        # Every token equals the object freeze's (outside the timed part).
        checked = 0
        for rollout_id, fields in zip(rollout_ids, arrays, strict=True):
            expected = to_numpy_objects(store.read_entries(rollout_id))
            for got, want in zip(fields, expected, strict=True):
                if len(got) != len(want) or not all(
                    a.dtype == b.dtype and np.array_equal(a, b)
                    for a, b in zip(got, want, strict=True)
                ):
                    raise RuntimeError(f"{rollout_id}: the columns differ from the entries")
                checked += sum(len(a) for a in got)
        result["values_checked"] = checked
    return result


def write_data(directory: Path, shape: AgenticShape) -> list[str]:
    from tokencapture.store import TokenCaptureStore

    store = TokenCaptureStore(directory)
    rollouts = agentic_rollouts(shape)
    for calls in rollouts:
        for entry in calls:
            store.append(entry)
    return [calls[0].rollout_id for calls in rollouts]


def run_worker(column: str, data: Path, scratch: Path, rollout_ids: list[str]) -> dict[str, Any]:
    root = scratch / column
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(data, root)
    spec = json.dumps({"column": column, "root": os.fspath(root), "rollout_ids": rollout_ids})
    done = subprocess.run(
        [sys.executable, __file__, "--worker", spec],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    shutil.rmtree(root, ignore_errors=True)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])  # type: ignore[no-any-return]
    raise RuntimeError(f"{column} worker failed:\n{done.stdout}\n{done.stderr}")


def nemo_available() -> bool:
    code = "from tests.nemo_oracle import import_nemo; import_nemo('store')"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, check=False, timeout=60
    )
    return done.returncode == 0


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny shape (a smoke run)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = worker(spec["column"], Path(spec["root"]), spec["rollout_ids"])
        print(RESULT + json.dumps(result))
        return 0
    shape = (
        AgenticShape(
            rollouts=2,
            calls=4,
            first_prompt_tokens=200,
            new_tokens_per_turn=50,
            generated_tokens=32,
        )
        if args.quick
        else AgenticShape()
    )
    columns = [c for c in COLUMNS if c != NEMO_GYM or nemo_available()]
    with tempfile.TemporaryDirectory(prefix="bench-columnar-") as tmp:
        data = Path(tmp) / "data"
        rollout_ids = write_data(data, shape)
        runs: list[dict[str, dict[str, Any]]] = []
        for run in range(args.runs):
            order = columns[run % len(columns) :] + columns[: run % len(columns)]
            runs.append({c: run_worker(c, data, Path(tmp), rollout_ids) for c in order})
            print(
                f"run {run + 1}/{args.runs}: "
                + ", ".join(f"{c} {runs[-1][c]['ms_per_freeze']:.2f} ms" for c in columns),
                file=sys.stderr,
            )
    report: dict[str, Any] = {
        "shape": {
            "rollouts": shape.rollouts,
            "calls": shape.calls,
            "final_prompt_tokens": shape.final_prompt_tokens(),
        },
        "runs": runs,
        "ms_per_freeze": {c: spread([r[c]["ms_per_freeze"] for r in runs]) for c in columns},
        "cpu_ms_per_freeze": {
            c: spread([r[c]["cpu_ms_per_freeze"] for r in runs]) for c in columns
        },
        "paired_ratios": {
            f"{c} ms / columnar ms": spread(
                [r[c]["ms_per_freeze"] / r["columnar"]["ms_per_freeze"] for r in runs]
            )
            for c in columns
            if c != "columnar"
        },
        "ms_per_trainer_read": {
            c: spread([r[c]["ms_per_trainer_read"] for r in runs]) for c in columns
        },
        "cpu_ms_per_trainer_read": {
            c: spread([r[c]["cpu_ms_per_trainer_read"] for r in runs]) for c in columns
        },
        "paired_trainer_read_ratios": {
            f"{c} ms / columnar ms": spread(
                [r[c]["ms_per_trainer_read"] / r["columnar"]["ms_per_trainer_read"] for r in runs]
            )
            for c in columns
            if c != "columnar"
        },
        "ms_per_refreeze": {c: spread([r[c]["ms_per_refreeze"] for r in runs]) for c in columns},
        "paired_refreeze_ratios": {
            f"{c} ms / columnar ms": spread(
                [r[c]["ms_per_refreeze"] / r["columnar"]["ms_per_refreeze"] for r in runs]
            )
            for c in columns
            if c != "columnar"
        },
        "paired_cpu_ratios": {
            f"{c} CPU / columnar CPU": spread(
                [r[c]["cpu_ms_per_freeze"] / r["columnar"]["cpu_ms_per_freeze"] for r in runs]
            )
            for c in columns
            if c != "columnar"
        },
        "memory_ratio": spread([r["columnar"]["memory_ratio"] for r in runs]),
        "memory_ratio_vs_int32": spread([r["columnar"]["memory_ratio_vs_int32"] for r in runs]),
        "peak_above_baseline_mb": spread([r["columnar"]["peak_above_baseline_mb"] for r in runs]),
        "snapshot_token_bytes_mb": runs[0]["columnar"]["snapshot_token_bytes_mb"],
        "values_checked": runs[0]["columnar"]["values_checked"],
    }
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    summary = {key: value for key, value in report.items() if key != "runs"}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
