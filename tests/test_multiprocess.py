"""Several processes writing shared and separate rollouts at once."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
from tests.conftest import make_entry

from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
)
from tokencapture.store import TokenCaptureStore, canonical_line

WRITERS = 4
PUTS = 40
FORKED_PUTS = 150


def writer(root: str, index: int) -> list[tuple[str, str]]:
    """Put into a private rollout and a shared one; return what was acknowledged."""
    store = TokenCaptureStore(root)
    acknowledged = []
    for n in range(PUTS):
        for rollout_id in (f"own-{index}", "shared"):
            entry = make_entry(
                rollout_id, call=f"w{index}-c{n}", prompt_token_ids=list(range(n, n + 50))
            )
            store.append(entry)
            store.append(entry)  # an identical retry is a no-op
            acknowledged.append((rollout_id, entry.model_call_id))
        if n % 10 == 0:
            store._begin_call("shared", f"intent-w{index}-{n}")
            store.append(make_entry("shared", call=f"intent-w{index}-{n}"))
            acknowledged.append(("shared", f"intent-w{index}-{n}"))
    return acknowledged


def test_concurrent_processes_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    root = tmp_path / "capture"
    TokenCaptureStore(root)
    context = multiprocessing.get_context("spawn")
    with context.Pool(WRITERS) as pool:
        results = pool.starmap(writer, [(str(root), i) for i in range(WRITERS)])
    expected: dict[str, set[str]] = {}
    for acknowledged in results:
        for rollout_id, call_id in acknowledged:
            expected.setdefault(rollout_id, set()).add(call_id)
    store = TokenCaptureStore(root)
    for rollout_id, call_ids in expected.items():
        snapshot = store.freeze_now(rollout_id)
        stored = [e.model_call_id for e in snapshot.entries]
        assert len(stored) == len(set(stored)), "duplicated entries"
        assert set(stored) == call_ids
        # One version per stored entry plus the freeze: no lost or phantom bumps.
        assert snapshot.version == len(call_ids) + 1
        assert not snapshot.incomplete
        lines = store.path_for(rollout_id).read_bytes().splitlines()
        assert len(lines) == len(call_ids)
        for entry in snapshot.entries:
            assert canonical_line(entry) in lines
    assert len(expected["shared"]) == WRITERS * (PUTS + PUTS // 10)


def test_a_forked_child_and_its_parent_share_a_store_object_safely(tmp_path: Path) -> None:
    """The store keeps each rollout's lock file open between writes. A forked child inherits
    those descriptors, which share their lock with the parent's copies, so the child must open
    its own: both processes then write one rollout through one inherited store object."""
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", call="before-fork"))  # leaves the lock descriptor open
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with live threads (3.12+)
        child = os.fork()
    if child == 0:
        status = 1
        try:
            for n in range(FORKED_PUTS):
                store.append(make_entry("r", call=f"child-{n}", prompt_token_ids=[n] * 600))
            status = 0
        finally:
            os._exit(status)
    for n in range(FORKED_PUTS):
        store.append(make_entry("r", call=f"parent-{n}", prompt_token_ids=[n] * 600))
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    snapshot = TokenCaptureStore(tmp_path).freeze_now("r")
    stored = sorted(e.model_call_id for e in snapshot.entries)
    expected = ["before-fork"] + [
        f"{who}-{n}" for who in ("child", "parent") for n in range(FORKED_PUTS)
    ]
    assert stored == sorted(expected)
    assert snapshot.version == len(expected) + 1
    assert not snapshot.incomplete


def other_process(root: str, action: str, rollout_id: str, call: str) -> None:
    """One store operation in a process of its own (spawned: nothing shared with the test)."""
    store = TokenCaptureStore(root)
    if action == "retire":
        store.retire_now([rollout_id])
    elif action == "freeze":
        store.freeze_now(rollout_id)
    elif action == "delete":
        store.delete_now([rollout_id])
    else:
        store.append(make_entry(rollout_id, call=call, prompt_token_ids=[7, 7, 7]))


def test_fences_and_appends_of_another_process_reach_a_warm_store(tmp_path: Path) -> None:
    """A store's cached index of a rollout is checked against the files under the lock before
    every write: a retire or freeze by another process refuses the next `begin_call` and put
    here, an entry another process appended is known to the next put here (same id, other
    payload: a conflict), and a rollout another process deleted and wrote again is read
    afresh (its new entry is a duplicate here, not a new one)."""
    root = str(tmp_path)
    store = TokenCaptureStore(root)
    for rollout_id in ("retired", "frozen", "appended", "reborn"):
        store._begin_call(rollout_id, "warm")  # every rollout's index cached and pinned
        store.append(make_entry(rollout_id, call="warm"))
        store._begin_call(rollout_id, "next")
    context = multiprocessing.get_context("spawn")

    def run(*args: str) -> None:
        process = context.Process(target=other_process, args=(root, *args))
        process.start()
        process.join()
        assert process.exitcode == 0

    run("retire", "retired", "")
    with pytest.raises(TokenCaptureRetiredError):
        store._begin_call("retired", "after")
    with pytest.raises(TokenCaptureRetiredError):
        store.append(make_entry("retired", call="after"))

    run("freeze", "frozen", "")
    with pytest.raises(TokenCaptureFrozenError):
        store._begin_call("frozen", "after")
    with pytest.raises(TokenCaptureFrozenError):
        store.append(make_entry("frozen", call="after"))

    run("append", "appended", "theirs")
    with pytest.raises(TokenCaptureConflictError):
        store.append(make_entry("appended", call="theirs", prompt_token_ids=[8]))

    run("delete", "reborn", "")
    run("append", "reborn", "new")
    store._begin_call("reborn", "new")
    store.append(make_entry("reborn", call="new", prompt_token_ids=[7, 7, 7]))  # a duplicate
    snapshot = TokenCaptureStore(root).freeze_now("reborn")
    assert [e.model_call_id for e in snapshot.entries] == ["new"]
    assert snapshot.version == 2  # the other process's entry and the freeze: no second put
