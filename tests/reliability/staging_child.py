"""A child process that stages into a `FileStagingStore`, for tests/test_staging_faults.py.

    python -m tests.reliability.staging_child MODE ROOT ARGS...

Modes:
    ``stage ROOT PREFIX THREADS``: stage chains from THREADS threads until killed. Each
        thread stages chain after chain (rollout ``PREFIX-t<thread>-<n>``, 4 calls, built by
        `expected_chain`); a line ``ok KEY`` or ``no KEY ERROR`` is written to stdout (one
        ``os.write``, after ``stage`` returned) for every answer.
    ``script ROOT``: read a JSON list of steps on stdin and print one JSON answer per step:
        ``["arm", {faultfs control}]``, ``["disarm"]``, ``["stage", ROLLOUT, CALLS, ATT_BYTES]``
        (the chain's calls, each with an attachment of ATT_BYTES bytes; answers
        ``[[ok, error], ...]``), ``["fetch", [KEYS]]`` (answers the call ids), ``["reopen"]``.
    ``race ROOT ROLLOUT MARKER SECONDS``: stage calls of ROLLOUT in a loop for SECONDS; a call
        started after MARKER exists and acknowledged is a fence violation. Prints a JSON
        summary ``{"ok_before", "ok_after_marker", "refused"}``.
    ``retire ROOT MARKER ROLLOUTS...``: wait for the go file ``MARKER.go``, retire ROLLOUTS,
        then create MARKER; prints the removal as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tokencapture import FileStagingStore
from tokencapture.conformance_staging import build_chain
from tokencapture.staging import records as ours

CALLS = 4


def expected_chain(rollout_id: str, calls: int = CALLS) -> list[Any]:
    """The records a child stages for a rollout (deterministic: tests rebuild them)."""
    return build_chain(ours, rollout_id, calls, prompt_tokens=80, generated_tokens=240)


def stage_forever(root: str, prefix: str, threads: int) -> None:
    store = FileStagingStore(root)

    def run(thread: int) -> None:
        n = 0
        while True:
            for record in expected_chain(f"{prefix}-t{thread}-{n}"):
                result = store.stage(record)
                key = f"{record.rollout_id}/{record.model_call_id}"
                line = f"ok {key}\n" if result.ok else f"no {key} {result.error}\n"
                os.write(1, line.encode())
            n += 1

    workers = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def arm(control: str, spec: dict[str, Any], gen: list[int]) -> None:
    gen[0] += 1
    lines = [f"gen={gen[0]}"] + [f"{key}={value}" for key, value in spec.items()]
    tmp = Path(control + ".next")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, control)


def script(root: str) -> None:
    control = os.environ.get("FAULTFS_CONTROL", "")
    gen = [0]
    store = FileStagingStore(root)
    answers: list[Any] = []
    for step in json.loads(sys.stdin.read()):
        op = step[0]
        if op == "arm":
            arm(control, step[1], gen)
            answers.append(None)
        elif op == "disarm":
            arm(control, {}, gen)
            answers.append(None)
        elif op == "stage":
            _, rollout_id, calls, att_bytes = step
            results = []
            for record in expected_chain(rollout_id, calls):
                attachments = {"blob": os.urandom(att_bytes)} if att_bytes else None
                result = store.stage(record, attachments=attachments)
                results.append([result.ok, result.error])
            answers.append(results)
        elif op == "fetch":
            try:
                answers.append([s.model_call_id for s in store.fetch(step[1])])
            except Exception as error:
                answers.append({"error": f"{type(error).__name__}: {error}"})
        elif op == "reopen":
            store = FileStagingStore(root)
            answers.append(None)
    print(json.dumps(answers))


def race(root: str, rollout_id: str, marker: str, seconds: float) -> None:
    """Stage fresh calls until ``seconds`` after the retire marker appeared (at most a minute).

    ``<marker>.ready.<pid>`` appears once this process has an acknowledged stage, so the test
    starts the retirers only when every stager is really staging (a loaded machine can take
    seconds to import)."""
    store = FileStagingStore(root)
    summary = {"ok_before": 0, "ok_after_marker": 0, "refused": 0}
    give_up = time.monotonic() + 60.0
    marker_seen: float | None = None
    ready = Path(f"{marker}.ready.{os.getpid()}")
    n = 0
    while time.monotonic() < give_up:
        if marker_seen is not None and time.monotonic() - marker_seen >= seconds:
            break
        (record,) = build_chain(ours, rollout_id, 1, variant=0)
        record = ours.StagedCallRecord.model_validate(
            {**record.model_dump(), "model_call_id": f"call-{os.getpid()}-{n}"}
            | _redigest(record, f"call-{os.getpid()}-{n}")
        )
        after_marker = os.path.exists(marker)
        if after_marker and marker_seen is None:
            marker_seen = time.monotonic()
        result = store.stage(record)
        if not result.ok:
            summary["refused"] += 1
        elif after_marker:
            summary["ok_after_marker"] += 1
        else:
            summary["ok_before"] += 1
            ready.touch()
        n += 1
    print(json.dumps(summary))


def _redigest(record: Any, call_id: str) -> dict[str, Any]:
    from tokencapture.staging_digest import compute_staging_digest

    fields = {
        name: getattr(record, name)
        for name in record.model_fields
        if name not in ("digest", "extras")
    }
    fields["model_call_id"] = call_id
    return {"digest": compute_staging_digest(**fields)}


def retire(root: str, marker: str, rollout_ids: list[str]) -> None:
    go = Path(marker + ".go")
    while not go.exists():
        time.sleep(0.001)
    removal = FileStagingStore(root).retire(rollout_ids)
    Path(marker).touch()
    print(json.dumps(removal))


def main() -> None:
    mode, root, *args = sys.argv[1:]
    if mode == "stage":
        stage_forever(root, args[0], int(args[1]))
    elif mode == "script":
        script(root)
    elif mode == "race":
        race(root, args[0], args[1], float(args[2]))
    elif mode == "retire":
        retire(root, args[0], args[1:])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
