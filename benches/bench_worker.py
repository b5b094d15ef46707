"""One measurement in a fresh process: how `compare.py` and `bench_tail.py` run their workers.

The parent runs ``python SCRIPT --worker SPEC_JSON``; the worker prints its result as one line
``RESULT <json>`` (`print_result`), which `run_worker` reads back, or raises with the worker's
output when it failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["RESULT_PREFIX", "print_result", "run_worker"]

RESULT_PREFIX = "RESULT "


def print_result(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(
    script: Path,
    spec: dict[str, Any],
    label: str,
    timeout: float,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `script --worker spec` in a fresh interpreter and return the result it printed;
    `label` names the worker in the error when it fails."""
    proc = subprocess.run(
        [sys.executable, os.fspath(script.resolve()), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX) and proc.returncode == 0:
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return result
    raise RuntimeError(
        f"worker {label} failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
