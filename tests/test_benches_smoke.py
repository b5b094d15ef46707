"""Smoke tests of the benchmark commands, end to end at tiny sizes: the comparison
(`benches/compare.py --quick --repeats 1`) and the put latency tail (`benches/bench_tail.py
--quick`).

Every column or store, in fresh subprocesses; checks that the JSON reports carry every
figure. The real runs are `python benches/compare.py` and `python benches/bench_tail.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[1] / "benches" / "compare.py"
COLUMNS = ("tokencapture", "reference", "sqlite", "raw")
PUT_KEYS = ("puts_per_s", "cpu_us_per_put", "peak_rss_mb")


def test_compare_quick_writes_every_column(tmp_path: Path) -> None:
    pytest.importorskip("tokencapture.reference", reason="the reference store is not built yet")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(COMPARE),
            "--quick",
            "--repeats",
            "1",
            "--silent",
            "--json",
            str(out),
            "--scratch",
            str(tmp_path / "scratch"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets" in proc.stdout

    report = json.loads(out.read_text())
    medians = report["medians"]
    for workload in ("W1", "W2"):
        for column in COLUMNS:
            figures = medians[workload][column]
            for key in PUT_KEYS:
                assert figures[key] > 0, (workload, column, key)
    for column in COLUMNS:
        assert medians["W3"][column]["ms_per_freeze"] > 0, column
    if report["w4_skipped"] is None:
        for column in ("tokencapture", "reference"):
            assert medians["W4"][column]["us_per_resolve"] > 0, column
    else:
        assert "W4" not in medians
    # The read workloads: our columnar and object trainer reads, the long rollout.
    trainer = medians["W3C"]["tokencapture"]
    assert trainer["ms_per_trainer_read"] > 0 and trainer["ms_per_object_trainer_read"] > 0
    long = medians["W5"]["tokencapture"]
    assert long["freeze_gb_per_s"] > 0 and long["ms_last_resolve"] > 0 and long["log_mb"] > 0
    # The minor page faults of each timed read (a tiny read may take none).
    for column in COLUMNS:
        assert medians["W3"][column]["faults_per_freeze"] >= 0, column
    assert trainer["faults_per_trainer_read"] >= 0 and trainer["faults_per_object_read"] >= 0
    assert float(long["faults_per_freeze"]).is_integer() and long["faults_per_freeze"] >= 0
    assert "page faults/freeze" in proc.stdout
    assert {target["status"] for target in report["targets"]} <= {"PASS", "MISS", "N/A"}
    # The seven against the reference, and the three of issue 24 that need no NeMo Gym or
    # PostgreSQL column (W3C columns against objects, W5's freeze rate and last resolve); with
    # NeMo Gym importable, its three (W3, W4, W3C) too. No PostgreSQL column: no PG target.
    names = [target["target"] for target in report["targets"]]
    assert len(names) == (7 + 3 if "nemo-gym" not in report["meta"]["columns"] else 7 + 6)
    assert "W5 freeze >= 1 GB/s of log" in names
    assert not any("1.5x files" in name for name in names)
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").iterdir())


def test_compare_adds_a_nemo_gym_column_where_nemo_gym_imports(tmp_path: Path) -> None:
    """A stand-in `nemo_gym.token_id_capture.store` (our reference store under NeMo Gym's
    module name) on the path makes the comparison add the `nemo-gym` column and its ratios."""
    pytest.importorskip("tokencapture.reference", reason="the reference store is not built yet")
    package = tmp_path / "fake" / "nemo_gym" / "token_id_capture"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "store.py").write_text(
        "from tokencapture.reference import TokenCaptureStore as TokenCaptureStore\n"
    )
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), *sys.path])}
    proc = subprocess.run(
        [
            *(sys.executable, str(COMPARE), "--quick", "--repeats", "1", "--silent"),
            *("--workloads", "W1", "W2", "W3", "--json", str(out)),
            *("--scratch", str(tmp_path / "scratch")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["columns"][-1] == "nemo-gym"
    for workload in ("W1", "W2"):
        assert report["medians"][workload]["nemo-gym"]["puts_per_s"] > 0, workload
    assert report["medians"]["W3"]["nemo-gym"]["ms_per_freeze"] > 0
    assert report["ratios"]["W3 nemo-gym ms / tokencapture ms"] > 0
    assert "W1 tokencapture/nemo-gym puts/s" in proc.stdout


def test_staging_bench_quick_reports_every_backend(tmp_path: Path) -> None:
    """`benches/bench_staging.py --quick --runs 1`: every backend that imports, every case, and
    the fetch-versus-freeze figure, in its JSON report."""
    out = tmp_path / "staging.json"
    bench = COMPARE.parent / "bench_staging.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--quick", "--runs", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(COMPARE.parents[1] / "python")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["cases"]) == sorted(f"W{w}x{t}" for w in (1, 2) for t in (1, 8, 32))
    for case in report["cases"].values():
        assert {"file", "memory"} <= set(case)
        assert case["file"]["stages_per_s"]["median"] > 0
        assert case["file"]["p99_ms"] >= case["file"]["p50_ms"]
    assert report["fetch"]["fetch_ms"]["median"] > 0


TAIL = Path(__file__).resolve().parents[1] / "benches" / "bench_tail.py"


def test_bench_tail_quick_reports_every_percentile_and_target(tmp_path: Path) -> None:
    """`benches/bench_tail.py --quick` beside two CPU-bound neighbours: every point, every
    store (NeMo Gym's where it imports, and the raw fdatasync floor), a percentile ladder."""
    out = tmp_path / "tail.json"
    proc = subprocess.run(
        [
            *(sys.executable, str(TAIL), "--quick", "--repeats", "1", "--silent"),
            *("--conditions", "cpu", "--json", str(out), "--raw"),
            *("--scratch", str(tmp_path / "scratch")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    stores = report["meta"]["stores"]
    assert stores[0] == "tokencapture" and "raw-fdatasync" in stores
    for condition in ("cpu",):
        points = report["summary"][condition]
        assert sorted(points) == sorted(report["meta"]["points"])
        for point, by_store in points.items():
            assert sorted(by_store) == sorted(stores), point
            for figures in by_store.values():
                ladder = [figures[k]["median"] for k in ("p50", "p90", "p99", "p99.9", "max")]
                assert ladder[0] > 0 and ladder == sorted(ladder), (point, ladder)
                assert figures["puts_per_s"]["median"] > 0
    # One sample per (point, store), and the scratch directory left empty.
    assert len(report["samples"]) == len(report["meta"]["points"]) * len(stores)
    assert {check["status"] for check in report["targets"]} <= {"PASS", "MISS"}
    assert not any((tmp_path / "scratch").iterdir())


def test_bench_tail_percentiles_are_nearest_rank() -> None:
    sys.path.insert(0, str(TAIL.parent))
    try:
        from bench_tail import latency_summary, percentile
    finally:
        sys.path.remove(str(TAIL.parent))
    values = [float(v) for v in range(1, 1001)]  # 1 .. 1000
    assert [percentile(values, q) for q in (50, 90, 99, 99.9, 100)] == [500, 900, 990, 999, 1000]
    assert percentile([7.0], 99.9) == 7.0
    summary = latency_summary([0.004, 0.001, 0.003, 0.002])  # seconds, unsorted
    assert (summary["p50"], summary["p99"], summary["max"]) == (2.0, 4.0, 4.0)
