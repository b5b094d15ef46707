"""Read-only stores: every read of a token store and of a staging store works on a read-only
mount and for a user who may only read, and every write fails cleanly, naming the path.

Before, the token store's `inspect` (so `tokencapture ls/show/verify`) opened the log for
appending, and every staging read opened `store.lock` for writing: on a read-only mount or as
another user, `ls` called every rollout unreadable, `verify` failed an undamaged store, and no
staging read worked at all. The checks run twice: on a tmpfs remounted read-only (as root),
and as the test servers' unprivileged account over a root-owned 0755/0644 store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests import fake_upstream
from tests.conftest import make_entry
from tests.fake_upstream import server_runner
from tests.read_only_child import cli, copy_tokens, read_everything, try_writes
from tests.staging_backends import chain, make_record
from tests.test_reliability_faults import mounted_tmpfs

from tokencapture import TokenCaptureStore
from tokencapture.staging import FileStagingStore

REPO = Path(__file__).resolve().parents[1]


def build(root: Path, *, lock_removed: bool = False) -> tuple[Path, Path]:
    """A token store and a staging store with some of everything under `root`."""
    tokens, staging = root / "tokens", root / "staging"
    store = TokenCaptureStore(tokens)
    for call in range(3):
        store.append(make_entry("open", call))
    for call in range(2):
        store.append(make_entry("frozen", call))
    store.freeze_now("frozen")
    store.append(make_entry("marked", 1))
    store._mark_incomplete("marked", "call-9")
    if lock_removed:
        # An operator removed the lock file: a read on a read-only mount cannot recreate it.
        store.append(make_entry("nolock", 1))
        store.lock_path_for("nolock").unlink()
    stage = FileStagingStore(staging)
    for record in chain("a/b", 3):
        assert stage.stage(record).ok
    raw = {"raw": b"\x01\x02\x03"}
    assert stage.stage(make_record("solo", extras={"k": 1}), attachments=raw).ok
    return tokens, staging


def expected_reads(tokens: Path, staging: Path, scratch: Path) -> dict[str, Any]:
    """What the reads give on the store while it is still writable (by root)."""
    copy_to = scratch / "expected"
    copy_to.mkdir()
    return read_everything(tokens, staging, copy_to)


def check_writes_failed(failed: dict[str, Any], reason: str) -> None:
    for name in ("put open", "put new", "freeze", "retire", "mark"):
        kind, _, message = failed[name]
        assert kind in ("OSError", "PermissionError"), (name, failed[name])
        assert reason in message and "/tokens/" in message, (name, message)
    ok, error = failed["stage"]
    assert not ok and reason in error and "store.lock" in error, failed["stage"]
    assert failed["files unchanged"]


def small_tmpfs(where: Path) -> contextlib.AbstractContextManager[Path]:
    return mounted_tmpfs(where, "8m")


def remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)


def test_reads_work_on_a_read_only_mount(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt") as mount:
        tokens, staging = build(mount, lock_removed=True)
        expected = expected_reads(tokens, staging, tmp_path)
        assert expected["verify"][0] == 0 and expected["ls"][0] == 0
        assert expected["entries nolock"] == ["call-1"]
        expected_copy = copy_tokens(tokens, tmp_path / "expected")
        assert expected_copy["copy"] == 0, expected_copy
        # The read above made the removed lock file again: remove it once more.
        (tokens / "nolock.tokens.lock").unlink()
        remount(mount, "ro")
        try:
            out = tmp_path / "out"
            out.mkdir()
            assert read_everything(tokens, staging, out) == expected
            # Without its lock file: read unlocked (nothing writes through a read-only mount).
            assert not (tokens / "nolock.tokens.lock").exists()
            check_writes_failed(try_writes(tokens, staging), "Read-only file system")
        finally:
            remount(mount, "rw")


def test_copy_out_of_a_read_only_mount(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt") as mount:
        tokens, _ = build(mount)
        expected = copy_tokens(tokens, tmp_path / "expected_copy")
        remount(mount, "ro")
        try:
            assert copy_tokens(tokens, tmp_path / "copy") == expected
        finally:
            remount(mount, "rw")


def test_copy_out_of_a_read_only_mount_of_a_rollout_without_its_lock_file(
    tmp_path: Path,
) -> None:
    """`ls` and `verify` read such a rollout unlocked (nothing writes through a read-only
    mount); `copy` tried to create the lock file and listed it unreadable."""
    with small_tmpfs(tmp_path / "mnt") as mount:
        tokens, _ = build(mount, lock_removed=True)
        remount(mount, "ro")
        try:
            code, report = cli("copy", str(tokens), str(tmp_path / "copy"))
        finally:
            remount(mount, "rw")
    assert code == 0, report
    assert "nolock" in [c["rollout_id"] for c in report["copied"]]
    copied = TokenCaptureStore(tmp_path / "copy").read_entries("nolock")
    assert [e.model_call_id for e in copied] == ["call-1"]


def as_reader(function: str, *args: str) -> Any:
    """`function(*args)` of `tests.read_only_child`, run as the test servers' unprivileged
    account (its interpreter and a readable copy of the sources when the checkout is not
    readable to it: CI's clone sits in a 0700 directory); its JSON result."""
    runner, prefix = server_runner()
    done = subprocess.run(
        [*prefix, "tests.read_only_child", function, *args],
        cwd="/",
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=False,
        **runner.popen(),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory the servers' unprivileged account can reach (pytest's own is private to
    root), when the tests run as root and that account can run this Python; skipped, with the
    reason, otherwise."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("running as another user needs Linux and root")
    runner, _ = server_runner()
    if not runner.drops_root:
        reason = f"no unprivileged account to read as: {fake_upstream.RUNNER_REASON}"
        # The servers' account runs the system python of this minor version: the main CI pass
        # has one (a failure then), the extra pass on another CPython may not (a skip).
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        assert not shutil.which(version, path="/usr/bin:/usr/local/bin"), reason
        pytest.skip(reason)
    where = Path(tempfile.mkdtemp(prefix="tc-readonly-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where)


def test_reads_work_for_a_user_who_may_only_read(shared_tmp: Path) -> None:
    tokens, staging = build(shared_tmp / "store")
    for path in [shared_tmp / "store", *(shared_tmp / "store").rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    scratch = shared_tmp / "scratch"
    scratch.mkdir()
    expected = expected_reads(tokens, staging, scratch)
    assert expected["verify"][0] == 0 and expected["ls"][0] == 0
    out = shared_tmp / "out"
    out.mkdir()
    runner, _ = server_runner()
    os.chown(out, runner.uid, runner.gid)
    # Through JSON, as the child's answer comes (tuples become lists).
    assert as_reader("read_everything", str(tokens), str(staging), str(out)) == json.loads(
        json.dumps(expected)
    )
    check_writes_failed(as_reader("try_writes", str(tokens), str(staging)), "Permission denied")


def test_a_missing_lock_file_a_reader_cannot_create_is_a_clear_error(shared_tmp: Path) -> None:
    """Without write permission another user may be writing: reading without the lock could
    see a write its writer is about to undo, so the read fails, naming the lock file."""
    tokens, _ = build(shared_tmp / "store", lock_removed=True)
    problem = as_reader("read_nolock", str(tokens))
    assert problem[0] == "PermissionError", problem
    assert "create missing lock file" in problem[1] and "nolock.tokens.lock" in problem[1]
    assert not (tokens / "nolock.tokens.lock").exists()


def test_the_childs_code_imports_without_pytest() -> None:
    """`tests/read_only_child.py` runs as the servers' account, whose interpreter may have no
    pytest (CI's does not): it and what it imports must not need it (a fixture moved into
    `tests/staging_backends.py` once made both tests above fail there)."""
    root = Path(__file__).resolve().parents[1]
    blocked = "import sys; sys.modules['pytest'] = None; import tests.read_only_child"
    # From the checkout's root, so `tests` imports; tokencapture as this interpreter has it.
    subprocess.run(
        [sys.executable, "-c", blocked], cwd=root, check=True, capture_output=True, timeout=60
    )
