"""The benchmark's citus column (W1-W4 on a coordinator and two workers it starts) runs beside
the single-server postgres column in one run (quick sizes) and reports every node's CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.citus_fixture import citus_cluster
from tests.pg_server import CitusCluster

__all__ = ["citus_cluster"]

ROOT = Path(__file__).resolve().parents[1]


def test_compare_quick_with_a_citus_column_beside_postgres(
    citus_cluster: CitusCluster, tmp_path: Path
) -> None:
    # The session's cluster proves Citus can start here (or fails the run in CI); the
    # benchmark starts its own servers, as it does when run by hand.
    assert citus_cluster.coordinator.running
    out = tmp_path / "figures.json"
    command = [sys.executable, str(ROOT / "benches" / "compare.py"), "--quick", "--repeats", "1"]
    command += ["--columns", "postgres", "citus", "--json", str(out)]
    command += ["--scratch", str(tmp_path / "scratch"), "--silent"]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    medians = report["medians"]
    for column in ("postgres", "citus"):
        assert medians["W1"][column]["puts_per_s"] > 0
        assert medians["W1"][column]["server_cpu_us_per_put"] >= 0  # clock ticks
        assert medians["W3"][column]["ms_per_freeze"] > 0
        assert medians["W4"][column]["us_per_resolve"] > 0
    ratios = report["ratios"]
    assert ratios["W1 citus/postgres puts/s"] > 0 and ratios["W4 citus/postgres us"] > 0
    assert "W1 citus/postgres puts/s" in proc.stdout
