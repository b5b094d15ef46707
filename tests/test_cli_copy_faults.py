"""`tokencapture copy` into a directory that fails mid-copy (a full disk), or a crash mid-copy.

Before, a copy into a disk that filled stopped with one bare `[Errno 28]` line and left the
rollout it was writing half there: a torn log and a lock, no state index, so it read as an
open rollout of no entries (its freeze fence lost), `verify` passed, and a repeated copy
skipped it as "already in the target" for ever (found filling a tmpfs).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry

from tokencapture import TokenCaptureStore, transfer
from tokencapture.cli import main


def source_store(root: Path) -> TokenCaptureStore:
    store = TokenCaptureStore(root)
    for rollout_id in ("a", "b", "c"):
        for call in range(2):
            store.append(make_entry(rollout_id, call=call))
        store._begin_call(rollout_id, "late")
    store.freeze_now("b")
    return store


def files_of(root: Path, rollout_id: str) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(root.iterdir())
        if p.name.startswith(f"{rollout_id}.") and not p.name.endswith(".lock")
    }


def same_rollout(source: Path, target: Path, rollout_id: str) -> bool:
    """The same log, intents and markers byte for byte, and the same index (a source rollout
    that was only put to has no state file yet; its copy has one)."""
    ours, theirs = files_of(source, rollout_id), files_of(target, rollout_id)
    state = f"{rollout_id}.tokens.state.json"
    ours.pop(state, None)
    theirs.pop(state, None)
    return ours == theirs and (
        TokenCaptureStore(source).inspect(rollout_id)
        == TokenCaptureStore(target).inspect(rollout_id)
    )


def cut_short(tmp_path: Path) -> tuple[Path, Path]:
    """A source store, and a target where a copy of rollout `b` was cut short by a crash: its
    marker, and a third of its log."""
    source = tmp_path / "source"
    source_store(source)
    target = tmp_path / "target"
    target.mkdir()
    log = files_of(source, "b")["b.tokens.jsonl"]
    (target / "b.tokens.importing").touch()
    (target / "b.tokens.jsonl").write_bytes(log[: len(log) // 3])
    return source, target


def copy(capsys: pytest.CaptureFixture[str], source: Path, target: Path) -> tuple[int, Any]:
    code = main(["copy", str(source), str(target), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_rollout_the_target_cannot_take_is_reported_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "source"
    source_store(source)
    target = tmp_path / "target"
    real_write = transfer._write_synced

    def full_while_writing_b(path: Path, data: bytes) -> None:
        if path.name.startswith("b."):
            real_write(path, data[: len(data) // 2])  # part of it made it to disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(transfer, "_write_synced", full_while_writing_b)
    code, report = copy(capsys, source, target)
    assert code == 1
    assert [c["rollout_id"] for c in report["copied"]] == ["a", "c"]
    ((failed),) = report["failed_in_target"]
    assert failed["rollout_id"] == "b"
    assert "'b'" in failed["problem"] and "No space left on device" in failed["problem"]
    assert files_of(target, "b") == {}  # no torn log, no marker: nothing that reads as b
    # Space is back: the same copy takes b, whole, and skips what it already copied.
    monkeypatch.setattr(transfer, "_write_synced", real_write)
    code, report = copy(capsys, source, target)
    assert [c["rollout_id"] for c in report["copied"]] == ["b"]
    assert report["exists_in_target"] == ["a", "c"] and code == 1
    for rollout_id in ("a", "b", "c"):
        assert same_rollout(source, target, rollout_id), rollout_id
    assert main(["verify", str(target)]) == 0


def test_a_copy_a_crash_cut_short_is_redone_by_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash between the first file and the last leaves the marker beside a partial copy:
    the next copy removes the partial files and writes the rollout whole."""
    source, target = cut_short(tmp_path)
    code, report = copy(capsys, source, target)
    assert code == 0 and [c["rollout_id"] for c in report["copied"]] == ["a", "b", "c"]
    assert same_rollout(source, target, "b")
    frozen = TokenCaptureStore(target).inspect("b")
    assert frozen is not None and frozen["frozen"] and frozen["entry_count"] == 2


def test_a_rollout_the_target_already_holds_is_never_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the marker, files in the target are a rollout of its own (its log may have no
    state index yet: puts write none before a checkpoint), kept as it is."""
    source = tmp_path / "source"
    source_store(source)
    target = TokenCaptureStore(tmp_path / "target")
    target.append(make_entry("b", call=7))
    before = files_of(tmp_path / "target", "b")
    code, report = copy(capsys, source, tmp_path / "target")
    assert code == 1 and report["exists_in_target"] == ["b"]
    assert files_of(tmp_path / "target", "b") == before


def test_a_partial_copy_a_writer_has_used_since_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a crash mid-copy, a writer of the target put into the rollout and was told its
    entry is stored. The next copy redid the import and deleted that entry; now it refuses,
    and `ls` and `verify` say a copy was cut short there (they read it as a whole rollout)."""
    source, target = cut_short(tmp_path)
    code = main(["ls", str(target), "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0 and row["status"] == "partial-copy" and "cut short" in row["problem"]
    assert main(["verify", str(target)]) == 1
    assert "cut short" in capsys.readouterr().out
    TokenCaptureStore(target).append(make_entry("b", call="acked"))
    code, report = copy(capsys, source, target)
    assert code == 1 and [c["rollout_id"] for c in report["copied"]] == ["a", "c"]
    ((failed),) = report["failed_in_target"]
    assert failed["rollout_id"] == "b" and "changed since" in failed["problem"]
    ids = [e.model_call_id for e in TokenCaptureStore(target).read_entries("b")]
    assert "acked" in ids


def test_a_copy_between_directories_needs_no_postgresql_driver(tmp_path: Path) -> None:
    """The directory side of `copy` lived in `tokencapture.postgres.transfer`: without the
    `postgres` extra a copy between two directories failed asking for asyncpg."""
    import subprocess
    import sys

    source_store(tmp_path / "source")
    code = (
        "import sys; sys.modules['asyncpg'] = None\n"
        "from tokencapture.cli import main\n"
        f"sys.exit(main(['copy', {str(tmp_path / 'source')!r}, {str(tmp_path / 'target')!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "copied 3 rollout(s)" in done.stdout


def test_a_marker_left_alone_is_listed_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The marker of a copy cut short before its first file (or whose files an operator
    removed) is a rollout `ls` and `verify` name, not nothing."""
    (tmp_path / "y.tokens.importing").touch()
    code = main(["ls", str(tmp_path), "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0 and (row["rollout_id"], row["status"]) == ("y", "partial-copy")
    assert main(["verify", str(tmp_path)]) == 1
    assert "cut short" in capsys.readouterr().out
