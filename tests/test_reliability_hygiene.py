"""Long-run hygiene: rollouts that are put, retired and deleted leave no files, descriptors or
memory behind.

The full measurement (100k puts across 10k rollouts) is `tests/reliability/memory_soak.py`;
here a quick version (10k puts across 1k rollouts) runs in a child process and asserts that
RSS, open descriptors and the directory stay bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.reliability.common import (
    REPO_ROOT,
    child_env,
    long_mode,
    make_entry,
    open_store,
)
from tests.reliability.params import STORES

ROLLOUTS = 150  # more than the Rust store's default index cache (128 rollouts)


@pytest.fixture
def fast_dir() -> Iterator[Path]:
    """A scratch directory on tmpfs when there is one: these tests count files, not fsyncs."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="tokencapture-hygiene-", dir=base) as directory:
        yield Path(directory)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kind", STORES)
def test_put_retire_delete_leaves_no_files(kind: str, fast_dir: Path) -> None:
    root = fast_dir / "store"
    store = open_store(kind, root)
    fds_before = open_fds()
    ids = [f"h{i}" for i in range(ROLLOUTS)]
    for i, rollout_id in enumerate(ids):
        store.append(make_entry(rollout_id, "a"))
        store._begin_call(rollout_id, "b")
        store.append(make_entry(rollout_id, "b"))
        store._begin_call(rollout_id, "lost")  # a dangling intent
        if i % 5 == 0:
            store._mark_incomplete(rollout_id, "lost")
        snap = store.freeze_now(rollout_id)
        assert snap.incomplete and len(snap.entries) == 2
        if i % 3 == 0:
            assert store._drop(rollout_id, snap.snapshot_id, snap.version)
        elif i % 3 == 1:
            assert store.retire_now([rollout_id]) == {"removed": [rollout_id], "absent": []}
    # Dropped and retired rollouts keep their fence (and lock) only; the others everything.
    for i, rollout_id in enumerate(ids):
        names = {
            p.name.removeprefix(f"{rollout_id}.tokens.")
            for p in root.glob(f"{rollout_id}.tokens.*")
        }
        if i % 3 == 2:
            assert {"jsonl", "state.json", "intents", "lock"} <= names, names
        else:
            assert names == {"state.json", "lock"}, (rollout_id, names)
    for start in range(0, ROLLOUTS, 50):
        batch = ids[start : start + 50]
        assert sorted(store.delete_now(batch)["removed"]) == sorted(batch)
    assert sorted(p.name for p in root.iterdir()) == []
    # Every descriptor the store used for them is closed again (the index cache forgets
    # deleted rollouts).
    assert open_fds() <= fds_before + 2
    # A reused id starts empty.
    store.append(make_entry("h0", "fresh"))
    snap = store.freeze_now("h0")
    assert [e.model_call_id for e in snap.entries] == ["fresh"]
    assert not snap.incomplete and snap.version == 2


@pytest.mark.parametrize("kind", STORES)
def test_reads_and_removals_of_absent_rollouts_create_nothing(kind: str, fast_dir: Path) -> None:
    root = fast_dir / "store"
    store = open_store(kind, root)
    assert store.read_entries("ghost") == []
    assert store.is_incomplete("ghost") is False
    assert store._drop("ghost", "0" * 32, 1) is False
    assert store.delete_now(["ghost", "ghost2"]) == {"removed": [], "absent": ["ghost", "ghost2"]}
    assert sorted(p.name for p in root.iterdir()) == []
    # Retiring an absent rollout writes its fence (a late writer must be refused) ...
    assert store.retire_now(["ghost"]) == {"removed": [], "absent": ["ghost"]}
    assert {p.name for p in root.iterdir()} <= {"ghost.tokens.state.json", "ghost.tokens.lock"}
    # ... and deleting it removes the fence too.
    store.delete_now(["ghost"])
    assert sorted(p.name for p in root.iterdir()) == []


def test_the_index_cache_bounds_open_descriptors(fast_dir: Path) -> None:
    """The Rust store keeps at most three descriptors per cached rollout (128 by default): the
    log and the state file it pins, and the lock file it reuses."""
    store = open_store("rust", fast_dir / "store")
    before = open_fds()
    for i in range(400):
        store.append(make_entry(f"fd{i}", "a"))
    assert open_fds() - before <= 3 * 128 + 4
    store.delete_now([f"fd{i}" for i in range(400)])
    assert open_fds() <= before + 2


# The reference store is slower per put (it rewrites its index on every put): fewer puts.
SOAK_PUTS = {"rust": 10_000, "reference": 5_000}


@pytest.mark.parametrize("kind", STORES)
def test_memory_soak_quick(kind: str) -> None:
    """10k puts across 1k rollouts (5k for the reference; 100k across 10k for both with
    TOKENCAPTURE_LONG=1) in a child: RSS after warm-up grows by less than 16 MiB,
    descriptors and files stay bounded."""
    puts = 100_000 if long_mode() else SOAK_PUTS[kind]
    every = puts // 5
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.reliability.memory_soak",
            "--store",
            kind,
            "--puts",
            str(puts),
            "--rollouts",
            str(puts // 10),
            "--every",
            str(every),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=child_env(),
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = [json.loads(line) for line in proc.stdout.splitlines()]
    print(proc.stderr.strip())
    warm, last = points[1], points[-1]
    assert last["puts"] == puts
    assert last["rss_kib"] - warm["rss_kib"] < 16 * 1024, points
    assert max(p["open_fds"] for p in points) < 3 * 128 + 64, points
    assert max(p["files_in_dir"] for p in points) <= 200 * 4, points
