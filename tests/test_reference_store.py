"""Focused tests of what only the pure-Python reference store does (or does its own way)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.conftest import GOLDEN

import tokencapture.reference.store as reference_module
from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureRetiredError,
)
from tokencapture.records import TokenEntry
from tokencapture.reference import TokenCaptureStore
from tokencapture.store import TokenCaptureStore as RustStore
from tokencapture.store import canonical_line


def make_entry(rollout_id: str, call_id: str, **fields: Any) -> TokenEntry:
    values: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -0.25],
    }
    values.update(fields)
    return TokenEntry(**values)


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    return TokenCaptureStore(tmp_path / "capture")


def state_of(store: TokenCaptureStore, rollout_id: str) -> dict[str, Any]:
    return dict(json.loads(store.state_path_for(rollout_id).read_bytes()))


def names(store: TokenCaptureStore) -> set[str]:
    return set(os.listdir(store.root))


def test_state_is_rewritten_after_every_put(store: TokenCaptureStore) -> None:
    for n in range(1, 5):
        previous = open(store.state_path_for("r"), "rb") if n > 1 else None  # noqa: SIM115
        store.append(make_entry("r", f"c{n}"))
        if previous is not None:
            # An atomic replace each time (the held handle pins the old inode), never in place.
            with previous:
                assert os.fstat(previous.fileno()).st_ino != store.state_path_for("r").stat().st_ino
        state = state_of(store, "r")
        assert state["version"] == n
        assert state["indexed_size"] == store.path_for("r").stat().st_size
        assert sorted(state["entry_digests"]) == [f"c{i}" for i in range(1, n + 1)]
        assert names(store) == {"r.tokens.jsonl", "r.tokens.state.json", "r.tokens.lock"}
    raw = store.state_path_for("r").read_bytes()
    assert raw == orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS)


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files and directories the reference store fsyncs, in order."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(reference_module.os, "fsync", recording_fsync)
    return synced


def test_fsync_points_follow_the_reference_design(
    store: TokenCaptureStore, fsyncs: list[str]
) -> None:
    root = store.root.name
    store.append(make_entry("r", "a"))
    assert fsyncs == ["r.tokens.jsonl", root]  # the line, then the new file's entry
    fsyncs.clear()
    store.append(make_entry("r", "b"))
    assert fsyncs == ["r.tokens.jsonl"]  # the state is replaced, not fsynced
    fsyncs.clear()
    store.append(make_entry("r", "b"))
    assert fsyncs == []  # an identical re-put changes nothing
    with pytest.raises(TokenCaptureConflictError):
        store.append(make_entry("r", "b", model="other"))
    assert fsyncs == ["r.tokens.state.json.tmp", root]
    fsyncs.clear()
    store._begin_call("r", "c")
    assert fsyncs == ["r.tokens.intents", root]
    fsyncs.clear()
    store._mark_incomplete("r", "c")
    assert fsyncs == ["r.tokens.incomplete", "r.tokens.state.json.tmp", root]
    fsyncs.clear()
    snapshot = store.freeze_now("r")
    assert fsyncs == ["r.tokens.state.json.tmp", root]
    fsyncs.clear()
    assert store.freeze_now("r") == snapshot
    assert fsyncs == []  # idempotent: nothing written
    assert store._drop("r", snapshot.snapshot_id, snapshot.version)
    assert fsyncs == ["r.tokens.state.json.tmp", root, root]  # fence, then the removals
    assert not any(name.endswith(".tmp") for name in names(store))


def test_golden_directory_freezes_as_the_reference_did(tmp_path: Path) -> None:
    target = tmp_path / "golden"
    shutil.copytree(GOLDEN / "store-0.7.0", target)
    target.chmod(0o755)
    for path in target.iterdir():
        path.chmod(0o644)
    expected = json.loads((GOLDEN / "store-0.7.0.expected.json").read_text())
    store = TokenCaptureStore(target)
    for rollout_id, want in expected.items():
        if want.get("retired"):
            with pytest.raises(TokenCaptureRetiredError):
                store.freeze_now(rollout_id)
            continue
        snapshot = store.freeze_now(rollout_id)
        assert len(snapshot.entries) == want["entry_count"]
        assert snapshot.incomplete == want["incomplete"]
        assert [e.model_call_id for e in snapshot.entries] == want["model_call_ids"]
        # The index now covers the whole log; the torn line of golden-torn is gone.
        log = store.path_for(rollout_id).read_bytes()
        assert log.endswith(b"\n")
        assert state_of(store, rollout_id)["indexed_size"] == len(log)
        assert store.freeze_now(rollout_id) == snapshot
    # The Rust store reads what the reference froze identically.
    rust = RustStore(target)
    for rollout_id, want in expected.items():
        if not want.get("retired"):
            assert rust.freeze_now(rollout_id) == store.freeze_now(rollout_id)


def test_continues_a_rust_directory_whose_index_lags(tmp_path: Path) -> None:
    rust = RustStore(tmp_path)
    for n in range(5):
        rust.append(make_entry("r", f"c{n}"))
    # The Rust store checkpoints its index lazily: none yet after five puts.
    assert not (tmp_path / "r.tokens.state.json").exists()
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c5"))
    assert state_of(store, "r")["version"] == 6
    with pytest.raises(TokenCaptureConflictError):
        store.append(make_entry("r", "c1", model="changed"))
    snapshot = store.freeze_now("r")
    assert snapshot.version == 8 and snapshot.incomplete
    assert rust.freeze_now("r") == snapshot


def test_torn_tail_is_ignored_by_readers_and_truncated_by_writers(
    store: TokenCaptureStore,
) -> None:
    entry = make_entry("r", "a")
    store.append(entry)
    log = store.path_for("r")
    good = log.read_bytes()
    with open(log, "ab") as file:
        file.write(b'{"model_call_id":"b"}')  # parses, but it has no newline: torn
    assert store.read_entries("r") == [entry]
    assert store.inspect("r") == {**state_of(store, "r"), "entry_count": 1}
    assert log.read_bytes() != good  # readers never truncate
    store.append(make_entry("r", "c"))
    assert log.read_bytes() == good + canonical_line(make_entry("r", "c")) + b"\n"


def test_bad_lines_raise_with_file_and_offset(store: TokenCaptureStore) -> None:
    store.append(make_entry("r", "a"))
    log = store.path_for("r")
    offset = log.stat().st_size
    with open(log, "ab") as file:
        file.write(b'{"model_call_id":7}\n')
    for read in (store.read_entries, store.freeze_now, store.inspect):
        with pytest.raises(TokenCaptureCorruptionError, match=rf"r\.tokens\.jsonl.*{offset}"):
            read("r")
    with pytest.raises(TokenCaptureCorruptionError):
        store.append(make_entry("r", "b"))
    store._mark_incomplete("r")  # the most available write does not read the log
    assert store.retire_now(["r"]) == {"removed": ["r"], "absent": []}


def test_freeze_verifies_indexed_lines_against_their_digests(store: TokenCaptureStore) -> None:
    store.append(make_entry("r", "a", model="m1"))
    store.append(make_entry("r", "b"))
    log = store.path_for("r")
    log.write_bytes(log.read_bytes().replace(b'"model":"m1"', b'"model":"m2"', 1))
    with pytest.raises(TokenCaptureCorruptionError, match=r"does not match.*byte offset 0"):
        store.freeze_now("r")
    assert not state_of(store, "r")["frozen"]


def test_reads_of_unknown_rollouts_create_nothing(store: TokenCaptureStore) -> None:
    assert store.read_entries("nope") == []
    assert store.inspect("nope") is None
    assert not store.is_incomplete("nope")
    assert not store._drop("nope", "", 0)
    assert names(store) == set()


def test_retire_replaces_a_corrupt_state_with_a_bare_fence(store: TokenCaptureStore) -> None:
    store.append(make_entry("r", "a"))
    store.state_path_for("r").write_bytes(b'{"frozen":')
    with pytest.raises(TokenCaptureCorruptionError, match="state"):
        store.is_incomplete("r")
    assert store.retire_now(["r", "never-seen"]) == {"removed": ["r"], "absent": ["never-seen"]}
    for rollout_id in ("r", "never-seen"):
        assert state_of(store, rollout_id) == {
            "entry_digests": {},
            "frozen": False,
            "incomplete": False,
            "indexed_size": 0,
            "retired": True,
            "snapshot_id": "",
            "version": 0,
        }
    assert store.delete_now(["r", "never-seen"]) == {"removed": ["r", "never-seen"], "absent": []}
    assert names(store) == set()


def test_a_waiter_on_a_deleted_lock_retries_on_the_new_file(store: TokenCaptureStore) -> None:
    store.append(make_entry("r", "a"))
    paths = reference_module._Paths.of(store.root, "r")
    held = reference_module._Lock.acquire(paths.lock, shared=False, create=True)
    assert held is not None
    done = threading.Event()

    def put() -> None:
        store.append(make_entry("r", "b"))
        done.set()

    thread = threading.Thread(target=put)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()  # waiting on the lock we hold
    os.unlink(paths.lock)  # what delete does while holding the lock
    held.release()
    thread.join(timeout=10)
    assert done.is_set()
    assert paths.lock.exists()  # the waiter locked the file the path names now
    assert [e.model_call_id for e in store.read_entries("r")] == ["a", "b"]


async def test_async_twins(store: TokenCaptureStore) -> None:
    entry = make_entry("r", "a")
    await store.put(entry)
    await store.begin_call("r", "b")
    await store.mark_incomplete("r", "b")
    snapshot = await store.freeze("r")
    assert snapshot.entries == (entry,) and snapshot.incomplete
    assert await store.drop("r", snapshot.snapshot_id, snapshot.version)
    assert await store.retire(["r"]) == {"removed": [], "absent": ["r"]}
    assert await store.delete(["r"]) == {"removed": ["r"], "absent": []}
    await store.close()
    await store.close()
