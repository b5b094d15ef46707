"""FileStagingStore under faults: SIGKILL mid-stage, a full disk, a failing sync, racing retires.

Each fault runs in a child process (`tests/reliability/staging_child.py`); the parent judges
what a fresh store over the same directory shows afterwards: every stage that was acknowledged
(``ok=True``) is fetchable and verifies, byte for byte the record staged, and nothing else is
visible unless it is whole.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.reliability.common import REPO_ROOT, child_env, kill_once_started
from tests.reliability.staging_child import expected_chain
from tests.test_reliability_faults import faultfs, fill, tiny_tmpfs  # noqa: F401 (fixtures)

from tokencapture import FileStagingStore, StagingKeyRetiredError

CHILD = [sys.executable, "-m", "tests.reliability.staging_child"]


def expected_record(key: str) -> Any:
    rollout_id, call_id = key.rsplit("/", 1)
    return expected_chain(rollout_id)[int(call_id.split("-")[1])]


def assert_everything_visible_is_whole(store: FileStagingStore, acknowledged: set[str]) -> None:
    visible = set(store.keys())
    missing = acknowledged - visible
    assert not missing, f"{len(missing)} acknowledged keys lost, e.g. {sorted(missing)[:3]}"
    keys = sorted(visible)
    for key, record in zip(keys, store.fetch_records(keys), strict=True):
        assert record.model_dump() == expected_record(key).model_dump(), key


def test_sigkill_while_staging_from_32_threads_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    rng = random.Random(23)
    acknowledged: set[str] = set()
    refused: list[str] = []
    for round_ in range(6):
        # The first acknowledgement (the child is staging), then a kill at a random point.
        argv = [*CHILD, "stage", str(tmp_path), f"round{round_}", "32"]
        out = kill_once_started(argv, 0.4, rng, b"ok ")
        for line in out.decode().splitlines():
            if line.startswith("ok "):
                acknowledged.add(line[3:])
            elif line:
                refused.append(line)
        # A fresh store (the next process) sees every acknowledged key, whole.
        assert_everything_visible_is_whole(FileStagingStore(tmp_path), acknowledged)
    assert not refused, refused[:3]
    assert len(acknowledged) > 30  # the kills landed mid-stream, not before staging began


def run_script(faultfs: Path, root: Path, steps: list[Any]) -> list[Any]:  # noqa: F811
    control = root.parent / f"{root.name}.faultfs-control"
    log = root.parent / f"{root.name}.faultfs-log"
    env = child_env(LD_PRELOAD=str(faultfs), FAULTFS_CONTROL=str(control), FAULTFS_LOG=str(log))
    done = subprocess.run(
        [*CHILD, "script", str(root)],
        input=json.dumps(steps),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answers: list[Any] = json.loads(done.stdout)
    assert log.read_text().strip(), "the fault never fired"
    return answers


def test_a_failing_sync_refuses_the_batch_and_loses_nothing(
    faultfs: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    root = tmp_path / "staging"
    answers = run_script(
        faultfs,
        root,
        [
            ["stage", "before", 2, 0],
            ["arm", {"pattern": "seg-", "ops": "sync", "errno": errno.EIO, "count": 1}],
            ["stage", "during", 1, 0],
            ["disarm"],
            ["stage", "during", 2, 0],
            ["reopen"],
            ["fetch", ["before/call-0", "before/call-1", "during/call-0", "during/call-1"]],
        ],
    )
    assert answers[0] == [[True, None], [True, None]]
    ((ok, error),) = answers[2]
    assert not ok and os.strerror(errno.EIO) in error, error
    assert answers[4] == [[True, None], [True, None]]  # the refused call stages on retry
    assert answers[6] == ["call-0", "call-1", "call-0", "call-1"]
    assert_everything_visible_is_whole(
        FileStagingStore(root), {"before/call-0", "before/call-1", "during/call-0", "during/call-1"}
    )


def test_a_write_cut_short_refuses_the_call_and_leaves_no_partial_frame(
    faultfs: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    root = tmp_path / "staging"
    answers = run_script(
        faultfs,
        root,
        [
            ["stage", "before", 1, 1000],
            ["arm", {"pattern": "seg-", "ops": "write", "errno": errno.ENOSPC, "budget": 5000}],
            ["stage", "big", 1, 200_000],
            ["disarm"],
            ["stage", "after", 1, 10],
            ["reopen"],
            ["fetch", ["before/call-0", "after/call-0"]],
            ["fetch", ["big/call-0"]],
        ],
    )
    ((ok, error),) = answers[2]
    assert not ok and os.strerror(errno.ENOSPC) in error, error
    assert answers[4] == [[True, None]]
    assert answers[6] == ["call-0", "call-0"]
    assert "StagingKeyError" in answers[7]["error"]
    assert_everything_visible_is_whole(FileStagingStore(root), {"before/call-0", "after/call-0"})


def test_a_real_full_disk(tiny_tmpfs: Path) -> None:  # noqa: F811
    root = tiny_tmpfs / "staging"
    store = FileStagingStore(root)
    acknowledged = set()
    for record in expected_chain("early", 2):
        assert store.stage(record).ok
        acknowledged.add(f"early/{record.model_call_id}")
    filler = fill(tiny_tmpfs)
    refusals = []
    for record in expected_chain("late", 4):
        result = store.stage(record, attachments={"blob": b"\x01" * 300_000})
        if result.ok:
            acknowledged.add(f"late/{record.model_call_id}")
        else:
            refusals.append(result.error)
    assert refusals and all(os.strerror(errno.ENOSPC) in error for error in refusals), refusals
    assert_everything_visible_is_whole(FileStagingStore(root), acknowledged)
    filler.unlink()
    for record in expected_chain("late", 4):
        assert store.stage(record).ok  # space is back: the refused calls stage
    assert_everything_visible_is_whole(
        FileStagingStore(root), acknowledged | {f"late/call-{i}" for i in range(4)}
    )


def test_retire_and_delete_land_on_a_full_disk(tiny_tmpfs: Path) -> None:  # noqa: F811
    """The operator frees a full disk through the store: the control log keeps blocks
    reserved past its end, so retire and delete lines (here ~18 KB of them, several pages
    past the last one allocated) are appended and synced after the disk filled."""
    root = tiny_tmpfs / "staging"
    store = FileStagingStore(root)
    (record,) = expected_chain("staged", 1)
    assert store.stage(record).ok
    filler = fill(tiny_tmpfs)
    fenced = [f"fenced-{i:03d}-" + "x" * 60 for i in range(200)]
    for rollout_id in fenced:
        assert store.retire([rollout_id]) == {"removed": [], "absent": [rollout_id]}
    assert store.delete(["staged"]) == {"removed": ["staged"], "absent": []}
    fresh = FileStagingStore(root)
    with pytest.raises(KeyError):
        fresh.fetch(["staged/call-0"])
    filler.unlink()
    refused = fresh.stage(expected_chain(fenced[-1], 1)[0])
    assert not refused.ok and "retired" in (refused.error or ""), refused
    assert fresh.stage(record).ok  # deleted: the id takes new stages


def test_processes_racing_retire_fence_every_stager(tmp_path: Path) -> None:
    """Four processes stage into a rollout while three others retire it (and a second rollout)
    at once: every retire succeeds, each rollout is reported removed by exactly one of them,
    and no stage that started after a retire returned is acknowledged, in any process."""
    root = tmp_path / "staging"
    seed = FileStagingStore(root)
    for rollout_id in ("hot", "cold"):
        assert seed.stage(expected_chain(rollout_id, 1)[0]).ok
    marker = tmp_path / "retired"
    stagers = [
        subprocess.Popen(
            [*CHILD, "race", str(root), "hot", str(marker), "1"],
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            env=child_env(),
        )
        for _ in range(4)
    ]
    retirers = [
        subprocess.Popen(
            [*CHILD, "retire", str(root), str(marker), "hot", "cold"],
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            env=child_env(),
        )
        for _ in range(3)
    ]
    # Retire only once every stager has an acknowledged stage (imports can take seconds here).
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("retired.ready.*"))) < len(stagers):
        assert time.monotonic() < deadline, "the stagers never staged"
        assert all(p.poll() is None for p in stagers), "a stager exited before staging"
        time.sleep(0.01)
    Path(str(marker) + ".go").touch()
    removals = [json.loads(p.communicate(timeout=60)[0]) for p in retirers]
    summaries = [json.loads(p.communicate(timeout=60)[0]) for p in stagers]
    assert all(p.returncode == 0 for p in [*retirers, *stagers])
    for rollout_id in ("hot", "cold"):
        removed_by = [r for r in removals if rollout_id in r["removed"]]
        assert len(removed_by) == 1, removals
        assert all(rollout_id in r["removed"] + r["absent"] for r in removals)
    assert sum(s["ok_before"] for s in summaries) > 0
    assert sum(s["refused"] for s in summaries) > 0
    assert [s["ok_after_marker"] for s in summaries] == [0, 0, 0, 0], summaries
    fresh = FileStagingStore(root)
    assert fresh.keys("hot") == []
    with pytest.raises(StagingKeyRetiredError):
        fresh.fetch(["hot/call-0"])
    assert not fresh.stage(expected_chain("hot", 1)[0]).ok
