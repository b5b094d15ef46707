"""Lifecycle writes on a real full tmpfs (root only): an operator frees a full capture disk
through the store, as the staging store and the ledger already allow.

Before, `retire`, `drop` and `mark_incomplete` failed with ENOSPC on a full disk while
`freeze` and `delete` succeeded: an open rollout's log holds 64 KiB or more reserved past its
end, which `freeze` gave back before writing its state and the others did not, and a frozen
rollout kept nothing for its fence. Now each gives the log's reserved blocks back before
writing its state, and a first freeze keeps one block reserved for the fence.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from tests.conftest import make_entry
from tests.test_reliability_faults import assert_files_sane, fill, tiny_tmpfs

from tokencapture import TokenCaptureStore

__all__ = ["tiny_tmpfs"]


def open_rollout(store: TokenCaptureStore, rollout_id: str, calls: int = 3) -> None:
    for call in range(calls):
        store.append(make_entry(rollout_id, call))


def test_retire_lands_on_a_full_disk(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "store"
    store = TokenCaptureStore(root)
    open_rollout(store, "open")
    open_rollout(store, "frozen")
    store.freeze_now("frozen")
    open_rollout(store, "consumed")
    store.freeze_now("consumed")
    filler = fill(tiny_tmpfs)
    # Each alone: a frozen rollout (the usual one to retire: its trainer consumed it) and an
    # open one (abandoned).
    assert store.retire_now(["frozen"])["removed"] == ["frozen"]
    assert store.retire_now(["open"])["removed"] == ["open"]
    for rollout_id in ("frozen", "open"):
        state = TokenCaptureStore(root).inspect(rollout_id)
        assert state is not None and state["retired"] and state["entry_count"] == 0
        assert not store.path_for(rollout_id).exists()
    with pytest.raises(Exception, match="retired"):
        store.append(make_entry("open", 9))
    # The space the retired records held is free again: the disk takes a retire of the rest.
    refill = fill(tiny_tmpfs, "refill.bin")
    assert store.retire_now(["consumed"])["removed"] == ["consumed"]
    filler.unlink()
    refill.unlink()
    assert_files_sane(root)


def test_drop_lands_on_a_full_disk(tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "store"
    store = TokenCaptureStore(root)
    open_rollout(store, "r")
    snapshot = store.freeze_now("r")
    filler = fill(tiny_tmpfs)
    assert store._drop("r", snapshot.snapshot_id, snapshot.version)
    state = TokenCaptureStore(root).inspect("r")
    assert state is not None and state["retired"] and state["version"] == snapshot.version
    filler.unlink()
    assert_files_sane(root)


def test_an_open_rollout_is_marked_incomplete_on_a_full_disk(tiny_tmpfs: Path) -> None:
    """A call of an open rollout failed (the disk is full, say, from another rollout's puts):
    the rollout is marked incomplete all the same, in the room its own reservation held."""
    root = tiny_tmpfs / "store"
    store = TokenCaptureStore(root)
    open_rollout(store, "r")
    filler = fill(tiny_tmpfs)
    with pytest.raises(OSError) as full:
        store.append(make_entry("other", 1))
    assert full.value.errno == errno.ENOSPC
    store._mark_incomplete("r", "lost")
    assert TokenCaptureStore(root).is_incomplete("r")
    filler.unlink()
    store.append(make_entry("r", 7))  # reserves again and goes on
    snapshot = TokenCaptureStore(root).freeze_now("r")
    assert snapshot.incomplete and len(snapshot.entries) == 4
    assert_files_sane(root)


STAGE_UNDER_A_FILE_SIZE_LIMIT = """
import json, sys
from tests.staging_backends import make_record
from tokencapture.staging import FileStagingStore
store = FileStagingStore(sys.argv[1])
results = [store.stage(make_record("r", f"c{i}", list(range(3000)))) for i in range(120)]
print(json.dumps([[r.ok, r.error] for r in results]))
"""


def test_a_staging_writer_starts_a_new_segment_at_the_file_size_limit(tmp_path: Path) -> None:
    """Under RLIMIT_FSIZE a segment that reaches the limit is sealed and the batch written into
    a new one. Before, the writer kept appending to the full segment: every later stage of the
    instance failed with EFBIG (a new instance staged fine)."""
    import json
    import shutil
    import subprocess
    import sys

    from tokencapture.staging import FileStagingStore

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit is not installed")
    root = tmp_path / "staging"
    limit = 1_000_000  # ~ 40 records of ~24 KB per segment; 120 records need three or more
    done = subprocess.run(
        ["prlimit", f"--fsize={limit}", sys.executable, "-c", STAGE_UNDER_A_FILE_SIZE_LIMIT, root],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    assert [error for ok, error in results if not ok] == []
    segments = sorted(root.glob("seg-*.tcs"))
    assert len(segments) >= 3 and all(s.stat().st_size <= limit for s in segments)
    store = FileStagingStore(root)
    keys = store.keys("r")
    assert len(keys) == 120 and len(store.fetch(keys)) == 120 and store.damage() == []


def test_a_freeze_with_one_block_left_takes_it_for_its_state(tiny_tmpfs: Path) -> None:
    """The fence's block is taken after the freeze's own state is written. Taken before, on a
    disk with one free block and a log with nothing reserved past its end (as NeMo Gym writes
    one), it took the block the state needed: the freeze failed, every time."""
    import os

    root = tiny_tmpfs / "store"
    store = TokenCaptureStore(root)
    open_rollout(store, "r")
    log = store.path_for("r")
    os.truncate(log, log.stat().st_size)  # no blocks reserved past the end
    filler = fill(tiny_tmpfs)
    with open(filler, "r+b") as out:  # exactly one block free again
        out.truncate(filler.stat().st_size - 4096)
    snapshot = TokenCaptureStore(root).freeze_now("r")
    assert len(snapshot.entries) == 3 and not snapshot.incomplete
    filler.unlink()
    assert_files_sane(root)


def test_a_conflicting_put_on_a_full_disk_still_marks_the_rollout(tiny_tmpfs: Path) -> None:
    """A put of a stored call id with other bytes marks the rollout incomplete (SPEC). On a
    full disk that mark failed: the caller saw an OSError, not the conflict, and the rollout
    stayed whole to its trainer. The mark now takes the log's reserved blocks, as
    `mark_incomplete` does."""
    root = tiny_tmpfs / "store"
    store = TokenCaptureStore(root)
    store.append(make_entry("r", 1))
    filler = fill(tiny_tmpfs)
    with pytest.raises(Exception) as refused:
        store.append(make_entry("r", 1, generation_log_probs=[-0.1, -0.2]))
    assert type(refused.value).__name__ == "TokenCaptureConflictError"
    assert TokenCaptureStore(root).is_incomplete("r")
    filler.unlink()
    store.append(make_entry("r", 2))  # reserves again and goes on
    assert TokenCaptureStore(root).freeze_now("r").incomplete
    assert_files_sane(root)
