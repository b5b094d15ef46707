"""Smoke test of the comparison command: `benches/compare.py --quick --repeats 1` end to end.

Tiny sizes, every column, every workload, in fresh subprocesses; checks that the JSON report
carries every column's figures. The real comparison is `python benches/compare.py`.
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
    assert {target["status"] for target in report["targets"]} <= {"PASS", "MISS", "N/A"}
    assert len(report["targets"]) == 7
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
