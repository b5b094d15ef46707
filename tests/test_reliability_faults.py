"""Fault injection: writes and syncs that fail with ENOSPC or EIO, and a really full disk.

`tests/reliability/faultfs.c` is compiled here into an LD_PRELOAD shim and a child process
(`tests/reliability/fault_driver.py`) runs a script of store calls with it, arming and
disarming faults between calls. For each fault the test checks that:

* the call raises an `OSError` whose `errno` is the injected one;
* the raw files keep no partial line a later reader would trust: every JSONL/intents/marker
  line is complete and valid, or a torn tail is left that readers ignore and the next writer
  truncates, and the rollout reads back only acknowledged entries;
* the rollout can still be marked incomplete (during the fault when the marker files are not
  the ones failing, and in any case once space returns);
* the store keeps working once the fault is gone: retries succeed exactly once, other rollouts
  are untouched, freeze returns what was acknowledged.

The last test fills a real 1 MiB tmpfs (root only) and does the same without any shim.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.reliability.common import (
    REPO_ROOT,
    StoreLike,
    child_env,
    make_entry,
    open_store,
)
from tests.reliability.params import STORES

SHIM_SOURCE = REPO_ROOT / "tests" / "reliability" / "faultfs.c"
BIG = 3000  # prompt tokens: a line of about 20 KB, far past a small write budget
# Prompt tokens for a line of about 140 KB: past the 64 KiB a log reserves ahead of its end, so
# a full disk fails it midway through its write.
HUGE = 20_000


@pytest.fixture(scope="module")
def faultfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled shim (skipped, with the reason, when there is no C compiler)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler (cc/gcc) to build the faultfs LD_PRELOAD shim")
    out = tmp_path_factory.mktemp("faultfs") / "faultfs.so"
    build = subprocess.run(
        [compiler, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(out), str(SHIM_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, f"building the faultfs shim failed:\n{build.stderr}"
    return out


@dataclass(frozen=True)
class Outcome:
    step: list[Any]
    value: Any = None
    error: dict[str, Any] | None = None

    def ok(self) -> Any:
        assert self.error is None, f"{self.step} failed: {self.error}"
        return self.value

    def oserror(self, code: int) -> str:
        """Assert the step raised an OSError with errno `code`; returns its message."""
        assert self.error is not None, f"{self.step} succeeded; expected errno {code}"
        assert "OSError" in self.error["mro"], f"{self.step}: not an OSError: {self.error}"
        assert self.error["errno"] == code, f"{self.step}: errno {self.error['errno']} != {code}"
        message = str(self.error["msg"])
        assert os.strerror(code) in message, f"{self.step}: message hides the cause: {message}"
        return message


@dataclass(frozen=True)
class Results:
    by_label: dict[str, Outcome]
    fired: int

    def __getitem__(self, label: str) -> Outcome:
        return self.by_label[label]


def drive(faultfs: Path, kind: str, root: Path, script: list[tuple[str, list[Any]]]) -> Results:
    """Run `script` (label, step) in a child with the shim preloaded."""
    control = root.parent / f"{root.name}.faultfs-control"
    log = root.parent / f"{root.name}.faultfs-log"
    log.unlink(missing_ok=True)
    env = child_env(LD_PRELOAD=str(faultfs), FAULTFS_CONTROL=str(control), FAULTFS_LOG=str(log))
    request = {"store": kind, "root": str(root), "steps": [step for _, step in script]}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.fault_driver"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"fault driver crashed:\n{proc.stderr[-3000:]}"
    raw = json.loads(proc.stdout)
    outcomes = {
        label: Outcome(step, result.get("ok"), result.get("error"))
        for (label, step), result in zip(script, raw[:-1], strict=True)
    }
    return Results(outcomes, int(raw[-1]["fired"]))


def assert_files_sane(root: Path) -> None:
    """Every store file under `root` is whole: complete, valid lines and a parseable state."""
    for path in sorted(root.iterdir()):
        data = path.read_bytes()
        if path.name.endswith(".tokens.jsonl"):
            assert not data or data.endswith(b"\n"), f"{path.name} ends in a partial line"
            ids = [json.loads(line)["model_call_id"] for line in data.splitlines()]
            assert len(ids) == len(set(ids)), f"{path.name} repeats a call id: {ids}"
        elif path.name.endswith((".tokens.intents", ".tokens.incomplete")):
            assert not data or data.endswith(b"\n"), f"{path.name} ends in a partial line"
        elif path.name.endswith(".tokens.state.json"):
            assert isinstance(json.loads(data), dict), path.name


def arm(pattern: str, ops: str, code: int, **extra: int) -> list[Any]:
    return ["arm", {"pattern": pattern, "ops": ops, "errno": code, **extra}]


@pytest.mark.parametrize("kind", STORES)
def test_enospc_on_the_log_fails_the_put_and_the_store_recovers(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put1", ["put", "r", "c1", 5]),
            ("arm", arm("/r.tokens.jsonl", "write", errno.ENOSPC)),
            ("put2", ["put", "r", "c2", 5]),
            ("raw", ["raw", "r.tokens.jsonl"]),
            ("read", ["read", "r"]),
            # The most available write works while the log cannot grow.
            ("mark", ["mark", "r", "c2"]),
            ("other", ["put", "other", "o1", 5]),
            ("disarm", ["disarm"]),
            ("retry", ["put", "r", "c2", 5]),
            ("put3", ["put", "r", "c3", 5]),
            ("freeze", ["freeze", "r"]),
            ("flag", ["incomplete", "r"]),
            ("freeze_other", ["freeze", "other"]),
        ],
    )
    assert res.fired >= 1
    res["put1"].ok()
    assert "No space left on device" in res["put2"].oserror(errno.ENOSPC)
    raw = res["raw"].ok()
    assert raw["complete"] and len(raw["lines"]) == 1
    assert res["read"].ok() == ["c1"]
    res["mark"].ok()
    res["other"].ok()
    res["retry"].ok()
    res["put3"].ok()
    frozen = res["freeze"].ok()
    assert frozen["ids"] == ["c1", "c2", "c3"] and frozen["incomplete"]
    assert res["flag"].ok() is True
    assert res["freeze_other"].ok()["ids"] == ["o1"]
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_a_write_cut_short_by_a_full_disk_leaves_no_partial_line(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put1", ["put", "r", "c1", 5]),
            # 100 more bytes fit, then the disk is full: the big line is cut short.
            ("arm", arm("/r.tokens.jsonl", "write", errno.ENOSPC, budget=100)),
            ("put2", ["put", "r", "c2", BIG]),
            ("raw", ["raw", "r.tokens.jsonl"]),
            ("read", ["read", "r"]),
            ("disarm", ["disarm"]),
            ("mark", ["mark", "r", "c2"]),
            ("put3", ["put", "r", "c3", 5]),
            ("raw_after", ["raw", "r.tokens.jsonl"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 1
    res["put1"].ok()
    res["put2"].oserror(errno.ENOSPC)
    raw = res["raw"].ok()
    assert raw["complete"], f"a partial line was left behind: {raw['size']} bytes"
    assert res["read"].ok() == ["c1"]
    res["mark"].ok()
    res["put3"].ok()
    after = res["raw_after"].ok()
    assert after["complete"]
    assert [json.loads(line)["model_call_id"] for line in after["lines"]] == ["c1", "c3"]
    frozen = res["freeze"].ok()
    assert frozen["ids"] == ["c1", "c3"] and frozen["incomplete"]
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_when_the_cleanup_fails_too_the_torn_tail_is_ignored_then_truncated(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    """The short write lands and the truncate that would remove it fails as well: what is
    left is a line without its newline, which readers ignore and the next put removes."""
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put1", ["put", "r", "c1", 5]),
            ("arm", arm("/r.tokens.jsonl", "write,truncate", errno.ENOSPC, budget=100)),
            ("put2", ["put", "r", "c2", BIG]),
            ("raw", ["raw", "r.tokens.jsonl"]),
            ("read", ["read", "r"]),
            ("disarm", ["disarm"]),
            ("reopen", ["reopen"]),
            ("read_fresh", ["read", "r"]),
            ("put3", ["put", "r", "c3", 5]),
            ("raw_after", ["raw", "r.tokens.jsonl"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 2  # the write and the truncate
    res["put2"].oserror(errno.ENOSPC)
    raw = res["raw"].ok()
    assert len(raw["lines"]) == 1  # c1 whole; at most a torn tail after it
    assert res["read"].ok() == ["c1"]
    assert res["read_fresh"].ok() == ["c1"]
    res["put3"].ok()
    after = res["raw_after"].ok()
    assert after["complete"], "the next put glued its line onto the torn tail"
    assert [json.loads(line)["model_call_id"] for line in after["lines"]] == ["c1", "c3"]
    assert res["freeze"].ok()["ids"] == ["c1", "c3"]
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_eio_on_the_log_fsync_fails_the_put_and_a_retry_stores_it_once(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put1", ["put", "r", "c1", 5]),
            ("arm", arm(".tokens.jsonl", "sync", errno.EIO)),
            ("put2", ["put", "r", "c2", 5]),
            ("first", ["put", "fresh", "f1", 5]),
            ("read", ["read", "r"]),
            ("disarm", ["disarm"]),
            ("retry", ["put", "r", "c2", 5]),
            ("retry_first", ["put", "fresh", "f1", 5]),
            ("freeze", ["freeze", "r"]),
            ("freeze_fresh", ["freeze", "fresh"]),
        ],
    )
    assert res.fired >= 2
    res["put2"].oserror(errno.EIO)
    res["first"].oserror(errno.EIO)
    # The failed put was not acknowledged; whether or not its bytes stayed, a reader sees at
    # most a whole line (never a partial one) and a retry stores it exactly once.
    assert res["read"].ok() in (["c1"], ["c1", "c2"])
    res["retry"].ok()
    res["retry_first"].ok()
    assert res["freeze"].ok()["ids"] == ["c1", "c2"]
    assert res["freeze_fresh"].ok()["ids"] == ["f1"]
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_a_state_index_that_cannot_be_written_never_loses_or_doubles_an_entry(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    """The first put of a rollout and every lifecycle transition write the state index.
    When that write fails the call may report the error (the line can already be durable:
    the index is reconstructible), but a mark must fail loudly, and after the fault a retry
    stores the entry exactly once and the mark sticks."""
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("arm", arm("state.json", "write", errno.ENOSPC)),
            ("put1", ["put", "r", "c1", 5]),
            ("mark", ["mark", "r", "c1"]),
            ("freeze_armed", ["freeze", "r"]),
            ("disarm", ["disarm"]),
            ("reopen", ["reopen"]),
            ("read", ["read", "r"]),
            ("retry", ["put", "r", "c1", 5]),
            ("put2", ["put", "r", "c2", 5]),
            ("mark_again", ["mark", "r", "c1"]),
            ("flag", ["incomplete", "r"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 1
    if res["put1"].error is not None:
        res["put1"].oserror(errno.ENOSPC)
    res["mark"].oserror(errno.ENOSPC)
    res["freeze_armed"].oserror(errno.ENOSPC)
    assert res["read"].ok() in ([], ["c1"])
    res["retry"].ok()
    res["put2"].ok()
    res["mark_again"].ok()
    assert res["flag"].ok() is True
    frozen = res["freeze"].ok()
    assert frozen["ids"] == ["c1", "c2"] and frozen["incomplete"]
    assert_files_sane(root)
    assert not list(root.glob("*.tmp")), "a failed state write left its temporary file"


def test_a_checkpoint_that_cannot_be_written_does_not_fail_the_puts_it_follows(
    faultfs: Path, tmp_path: Path
) -> None:
    """Every 64 entries a put checkpoints the state index, after its line is durable. On a
    full disk that checkpoint failed and the put raised ENOSPC with its line stored: a caller
    that regenerated the call then conflicted with its own line and the rollout was marked
    incomplete (found filling a real tmpfs). The index may lag the log, so those puts succeed;
    the index catches up once space returns. (NeMo Gym's store, which writes its state on
    every put, is not held to this.)"""
    root = tmp_path / "store"
    before = [(f"put{i}", ["put", "r", f"c{i}", 5]) for i in range(60)]
    during = [(f"full{i}", ["put", "r", f"c{i}", 5]) for i in range(60, 70)]
    res = drive(
        faultfs,
        "rust",
        root,
        [
            *before,
            ("arm", arm("state.json", "write", errno.ENOSPC)),
            *during,
            ("read_full", ["read", "r"]),
            ("disarm", ["disarm"]),
            ("after", ["put", "r", "c70", 5]),
            ("reopen", ["reopen"]),
            ("read", ["read", "r"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 7  # the checkpoint at the 64th entry, then at every put after it
    for label, _ in during:
        res[label].ok()
    ids = [f"c{i}" for i in range(71)]
    assert res["read_full"].ok() == ids[:70]
    res["after"].ok()
    assert res["read"].ok() == ids
    frozen = res["freeze"].ok()
    assert frozen["ids"] == ids and not frozen["incomplete"]
    assert_files_sane(root)
    state = json.loads((root / "r.tokens.state.json").read_bytes())
    assert len(state["entry_digests"]) == 71  # the index caught up (the freeze wrote it)
    assert not list(root.glob("*.tmp")), "a failed state write left its temporary file"


@pytest.mark.parametrize("kind", STORES)
def test_directory_fsync_failure_is_reported_and_retire_can_be_retried(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put0", ["put", "old", "c0", 5]),
            ("arm", arm(f"{root}$", "sync", errno.EIO)),
            ("put1", ["put", "r", "c1", 5]),
            ("retire", ["retire", ["old"]]),
            ("disarm", ["disarm"]),
            ("retry", ["put", "r", "c1", 5]),
            ("retire_again", ["retire", ["old"]]),
            ("freeze_old", ["freeze", "old"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 2
    res["put0"].ok()
    res["put1"].oserror(errno.EIO)
    res["retire"].oserror(errno.EIO)
    res["retry"].ok()
    assert res["retire_again"].ok()["absent"] in ([], ["old"])
    error = res["freeze_old"].error
    assert error is not None and "TokenCaptureRetiredError" in error["mro"]
    assert not (root / "old.tokens.jsonl").exists()
    assert res["freeze"].ok()["ids"] == ["c1"]
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_intent_and_marker_writes_fail_cleanly_and_work_after(
    faultfs: Path, kind: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    res = drive(
        faultfs,
        kind,
        root,
        [
            ("put1", ["put", "r", "c1", 5]),
            ("arm_intents", arm(".tokens.intents", "write", errno.ENOSPC)),
            ("begin", ["begin", "r", "c2"]),
            ("raw_intents", ["raw", "r.tokens.intents"]),
            ("arm_marker", arm(".tokens.incomplete", "write", errno.EIO)),
            ("mark", ["mark", "r", "c9"]),
            ("raw_marker", ["raw", "r.tokens.incomplete"]),
            ("disarm", ["disarm"]),
            ("begin_again", ["begin", "r", "c2"]),
            ("put2", ["put", "r", "c2", 5]),
            ("freeze_complete", ["freeze", "r"]),
            ("mark_again", ["mark", "r", "c9"]),
            ("flag", ["incomplete", "r"]),
            ("freeze", ["freeze", "r"]),
        ],
    )
    assert res.fired >= 2
    res["begin"].oserror(errno.ENOSPC)
    assert res["raw_intents"].ok()["complete"]
    res["mark"].oserror(errno.EIO)
    assert res["raw_marker"].ok()["complete"]
    res["begin_again"].ok()
    res["put2"].ok()
    frozen = res["freeze_complete"].ok()
    assert frozen["ids"] == ["c1", "c2"]
    # The failed mark must not have half-happened: nothing else made the rollout incomplete.
    assert not frozen["incomplete"]
    res["mark_again"].ok()
    assert res["flag"].ok() is True
    assert res["freeze"].ok()["incomplete"]
    assert_files_sane(root)


# A real full disk ---------------------------------------------------------------------------


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `mount_point` (made here) for the block; skipped with the
    reason where it cannot be (not Linux, not root, no working `mount`)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs Linux and root")
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root and a working `mount` only; skipped with the reason otherwise)."""
    with mounted_tmpfs(tmp_path / "tiny", "1m") as mount_point:
        yield mount_point


def fill(directory: Path, name: str = "filler.bin") -> Path:
    """Write a filler file until the filesystem is full."""
    filler = directory / name
    chunk = b"\0" * 4096
    with filler.open("wb", buffering=0) as out, pytest.raises(OSError) as full:
        while True:
            out.write(chunk)
    assert full.value.errno == errno.ENOSPC
    return filler


def test_space_reserved_before_the_disk_filled_takes_puts(tiny_tmpfs: Path) -> None:
    """A log reserves blocks past its end (fallocate, size unchanged), so a put that fits in
    them succeeds durably after the disk fills; one that does not fails whole."""
    root = tiny_tmpfs / "store"
    store = open_store("rust", root)
    store.append(make_entry("r", "c1", tokens=5))
    filler = fill(tiny_tmpfs)
    store.append(make_entry("r", "c2", tokens=BIG))  # ~20 KB, inside the reservation
    with pytest.raises(OSError) as caught:
        store.append(make_entry("r", "c3", tokens=HUGE))
    assert caught.value.errno == errno.ENOSPC
    filler.unlink()
    snapshot = open_store("rust", root).freeze_now("r")
    assert [e.model_call_id for e in snapshot.entries] == ["c1", "c2"]
    assert not snapshot.incomplete
    assert_files_sane(root)


@pytest.mark.parametrize("kind", STORES)
def test_a_real_full_tmpfs(kind: str, tiny_tmpfs: Path) -> None:
    root = tiny_tmpfs / "store"
    store: StoreLike = open_store(kind, root)
    store.append(make_entry("r", "c1", tokens=5))
    filler = fill(tiny_tmpfs)
    with pytest.raises(OSError) as caught:
        store.append(make_entry("r", "c2", tokens=HUGE))
    assert caught.value.errno == errno.ENOSPC
    log = store.path_for("r").read_bytes()
    assert log.endswith(b"\n") and log.count(b"\n") == 1, "a partial line was left behind"
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]
    # The failed put's truncation gave back what it had written (and any reserved space).
    refill = fill(tiny_tmpfs, "refill.bin")
    with pytest.raises(OSError) as caught_new:
        store.append(make_entry("new", "n1", tokens=BIG))
    assert caught_new.value.errno == errno.ENOSPC
    assert store.read_entries("new") == []
    # Space returns: everything works again, and nothing acknowledged was lost.
    filler.unlink()
    refill.unlink()
    store._mark_incomplete("r", "c2")
    store.append(make_entry("r", "c2", tokens=BIG))
    store.append(make_entry("new", "n1", tokens=5))
    fresh = open_store(kind, root)
    snap = fresh.freeze_now("r")
    assert [e.model_call_id for e in snap.entries] == ["c1", "c2"] and snap.incomplete
    assert [e.model_call_id for e in fresh.freeze_now("new").entries] == ["n1"]
    assert_files_sane(root)
