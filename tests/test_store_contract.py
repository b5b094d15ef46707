"""One test (at least) per rule of SPEC section 3, against the Rust-backed store."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from tests.conftest import make_entry

from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
)
from tokencapture.store import TokenCaptureStore, canonical_line


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    return TokenCaptureStore(tmp_path / "capture")


def files(store: TokenCaptureStore) -> set[str]:
    return {p.name for p in store.root.iterdir()}


def state_of(store: TokenCaptureStore, rollout_id: str) -> dict[str, object]:
    return dict(json.loads(store.state_path_for(rollout_id).read_bytes()))


def test_put_appends_one_canonical_line_and_freeze_reads_it_back(store: TokenCaptureStore) -> None:
    entry = make_entry(extra_field={"kept": [1, 2]})
    store.append(entry)
    assert store.path_for("r1").read_bytes() == canonical_line(entry) + b"\n"
    snapshot = store.freeze_now("r1")
    assert snapshot.entries == (entry,)
    assert snapshot.entries[0].model_extra == {"extra_field": {"kept": [1, 2]}}
    assert snapshot.rollout_id == "r1" and not snapshot.incomplete
    assert len(snapshot.snapshot_id) == 32 and snapshot.version == 2


def index_by_checkpoint(store: TokenCaptureStore, rollout_id: str = "r1") -> None:
    """Put entries until the first checkpoint writes the state index (64 entries)."""
    for n in range(1, 65):
        store.append(make_entry(rollout_id, n))
    assert store.state_path_for(rollout_id).exists()


def test_first_put_creates_the_log_and_lock_and_the_index_waits_for_a_checkpoint(
    store: TokenCaptureStore,
) -> None:
    # A missing state index is a fresh rollout (SPEC), so the first puts write none: the log
    # alone reads the same. It appears at the first checkpoint (64 entries), covering the log.
    store.append(make_entry())
    assert files(store) == {"r1.tokens.jsonl", "r1.tokens.lock"}
    assert TokenCaptureStore(store.root).inspect("r1")["version"] == 1  # type: ignore[index]
    for n in range(2, 64):
        store.append(make_entry("r1", n))
        assert not store.state_path_for("r1").exists(), n
    store.append(make_entry("r1", 64))
    state = state_of(store, "r1")
    assert state["version"] == 64 and state["indexed_size"] == store.path_for("r1").stat().st_size


def test_identical_reput_is_a_noop_without_version_bump(store: TokenCaptureStore) -> None:
    entry = make_entry()
    store.append(entry)
    store.append(entry.model_copy())
    assert store.path_for("r1").read_bytes().count(b"\n") == 1
    assert store.freeze_now("r1").version == 2  # one put + the freeze


def test_conflicting_reput_marks_incomplete_bumps_version_and_raises(
    store: TokenCaptureStore,
) -> None:
    store.append(make_entry())
    with pytest.raises(TokenCaptureConflictError, match="different payload") as info:
        store.append(make_entry(generation_log_probs=[-0.5, -0.3]))
    assert isinstance(info.value, ValueError)
    state = state_of(store, "r1")  # persisted durably before raising
    assert state["incomplete"] is True and state["version"] == 2
    assert store.is_incomplete("r1")
    snapshot = store.freeze_now("r1")
    assert snapshot.incomplete and len(snapshot.entries) == 1 and snapshot.version == 3


@pytest.mark.parametrize("write", ["put", "begin_call"])
def test_writes_after_freeze_raise_frozen(store: TokenCaptureStore, write: str) -> None:
    store.append(make_entry())
    store.freeze_now("r1")
    with pytest.raises(TokenCaptureFrozenError) as info:
        if write == "put":
            store.append(make_entry(call=2))
        else:
            store._begin_call("r1", "call-2")
    assert not isinstance(info.value, TokenCaptureRetiredError)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("write", ["put", "begin_call", "mark_incomplete", "freeze"])
def test_writes_after_retire_raise_retired(store: TokenCaptureStore, write: str) -> None:
    store.append(make_entry())
    store.retire_now(["r1"])
    with pytest.raises(TokenCaptureRetiredError):
        if write == "put":
            store.append(make_entry(call=2))
        elif write == "begin_call":
            store._begin_call("r1", "call-2")
        elif write == "mark_incomplete":
            store._mark_incomplete("r1", "call-2")
        else:
            store.freeze_now("r1")


def test_mark_incomplete_after_freeze_succeeds_and_changes_version(
    store: TokenCaptureStore,
) -> None:
    store.append(make_entry())
    first = store.freeze_now("r1")
    store._mark_incomplete("r1", "call-9")
    second = store.freeze_now("r1")
    assert second.incomplete and second.version == first.version + 1
    assert second.snapshot_id == first.snapshot_id
    assert store.incomplete_path_for("r1").read_bytes() == b"call-9\n"


async def test_mark_incomplete_if_open_marks_only_an_open_rollout(
    store: TokenCaptureStore,
) -> None:
    """The gateway's mark for a failed call: made on an open rollout, a no-op (False, the
    version unchanged, no marker line) on a frozen or retired one, where a mark would move the
    snapshot's version and the trainer's `drop` of it would fail."""
    store.append(make_entry())
    assert await store.mark_incomplete_if_open("r1", "lost") is True
    assert store.incomplete_path_for("r1").read_bytes() == b"lost\n"
    snapshot = store.freeze_now("r1")
    assert snapshot.incomplete and snapshot.version == 3  # put, mark, freeze
    assert await store.mark_incomplete_if_open("r1", "late") is False
    assert store.incomplete_path_for("r1").read_bytes() == b"lost\n"
    assert store.freeze_now("r1").version == snapshot.version
    assert store._drop("r1", snapshot.snapshot_id, snapshot.version)
    assert await store.mark_incomplete_if_open("r1", "later") is False  # retired
    with pytest.raises(ValueError, match="rollout"):
        store.mark_incomplete_if_open("bad id")


async def test_mark_incomplete_if_open_decides_under_the_rollout_lock(tmp_path: Path) -> None:
    """Another process freezes the rollout while the mark waits for its lock: the mark sees
    the freeze (not the open state this store instance cached before it waited) and leaves
    the snapshot as it was. The "freeze" is the frozen state file of an identical rollout,
    moved in while the test holds the rollout's lock, as a freezing process would."""
    import fcntl

    store, twin = TokenCaptureStore(tmp_path / "a"), TokenCaptureStore(tmp_path / "b")
    store.append(make_entry())
    twin.append(make_entry())
    frozen = twin.freeze_now("r1")
    with open(store.lock_path_for("r1"), "rb+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marking = asyncio.ensure_future(store.mark_incomplete_if_open("r1", "late"))
        await asyncio.sleep(0.3)
        assert not marking.done()  # waiting for the lock
        moved_in = store.state_path_for("r1").with_suffix(".moving")
        moved_in.write_bytes(twin.state_path_for("r1").read_bytes())
        os.replace(moved_in, store.state_path_for("r1"))
        fcntl.flock(lock, fcntl.LOCK_UN)
    assert await marking is False
    snapshot = store.freeze_now("r1")
    assert (snapshot.snapshot_id, snapshot.version, snapshot.incomplete) == (
        frozen.snapshot_id,
        frozen.version,
        False,
    )
    assert not store.incomplete_path_for("r1").exists()


def test_stale_drop_returns_false_and_keeps_evidence(store: TokenCaptureStore) -> None:
    store.append(make_entry())
    snapshot = store.freeze_now("r1")
    store._mark_incomplete("r1")
    assert store._drop("r1", snapshot.snapshot_id, snapshot.version) is False
    assert store._drop("r1", "not-the-snapshot", snapshot.version + 1) is False
    assert store.path_for("r1").exists()
    assert len(store.freeze_now("r1").entries) == 1


def test_drop_before_freeze_and_of_unknown_rollout_is_false_and_creates_nothing(
    store: TokenCaptureStore,
) -> None:
    assert store._drop("ghost", "x", 1) is False
    assert files(store) == set()
    store.append(make_entry())
    assert store._drop("r1", "", 1) is False


def test_exact_drop_returns_true_and_fences(store: TokenCaptureStore) -> None:
    store.append(make_entry())
    store._begin_call("r1", "call-1")
    store._mark_incomplete("r1", "call-x")
    snapshot = store.freeze_now("r1")
    assert store._drop("r1", snapshot.snapshot_id, snapshot.version) is True
    assert files(store) == {"r1.tokens.state.json", "r1.tokens.lock"}
    state = state_of(store, "r1")
    assert state["retired"] is True and state["entry_digests"] == {} and state["indexed_size"] == 0
    assert state["snapshot_id"] == snapshot.snapshot_id and state["version"] == snapshot.version
    with pytest.raises(TokenCaptureRetiredError):
        store.append(make_entry(call=2))


def test_retire_reports_removed_and_absent_and_is_idempotent(store: TokenCaptureStore) -> None:
    store.append(make_entry("a"))
    store._begin_call("b", "call-1")
    result = store.retire_now(["a", "b", "never", "a"])
    assert result == {"removed": ["a", "b"], "absent": ["never"]}
    assert files(store) == {
        f"{r}.tokens.{s}" for r in ("a", "b", "never") for s in ("state.json", "lock")
    }
    assert store.retire_now(["a", "b", "never"]) == {"removed": [], "absent": ["a", "b", "never"]}
    for rollout_id in ("a", "never"):
        with pytest.raises(TokenCaptureRetiredError):
            store.append(make_entry(rollout_id, call=5))


def test_delete_removes_everything_and_reuse_starts_empty(store: TokenCaptureStore) -> None:
    store.append(make_entry())
    store._begin_call("r1", "call-2")
    store._mark_incomplete("r1", "call-2")
    store.retire_now(["r1"])
    assert store.delete_now(["r1", "never"]) == {"removed": ["r1"], "absent": ["never"]}
    assert files(store) == set()
    assert store.delete_now(["r1"]) == {"removed": [], "absent": ["r1"]}
    store.append(make_entry(call=7))
    snapshot = store.freeze_now("r1")
    assert [e.model_call_id for e in snapshot.entries] == ["call-7"]
    assert not snapshot.incomplete and snapshot.version == 2


def test_empty_batches_do_nothing(store: TokenCaptureStore) -> None:
    assert store.retire_now([]) == {"removed": [], "absent": []}
    assert store.delete_now([]) == {"removed": [], "absent": []}


def test_batches_refuse_a_bare_string_and_validate_everything_first(
    store: TokenCaptureStore,
) -> None:
    store.append(make_entry("good"))
    with pytest.raises(TypeError):
        store.retire_now("good")
    with pytest.raises(TypeError):
        store.delete_now("good")
    with pytest.raises(ValueError):
        store.retire_now(["good", "../bad"])
    with pytest.raises(ValueError):
        store.delete_now(["good", "bad id"])
    assert len(store.freeze_now("good").entries) == 1


def test_dangling_intent_masks_the_snapshot(store: TokenCaptureStore) -> None:
    store._begin_call("r1", "call-1")
    store._begin_call("r1", "call-2")
    store.append(make_entry(call=1))
    assert store.intents_path_for("r1").read_bytes() == b"call-1\ncall-2\n"
    assert not store.is_incomplete("r1")  # a call in flight is not a hole until freeze
    assert store.freeze_now("r1").incomplete


def test_intent_with_its_entry_does_not_mask(store: TokenCaptureStore) -> None:
    store._begin_call("r1", "call-1")
    store.append(make_entry(call=1))
    assert not store.freeze_now("r1").incomplete


def test_torn_last_line_is_ignored_by_readers_and_truncated_by_writers(
    store: TokenCaptureStore,
) -> None:
    store.append(make_entry(call=1))
    path = store.path_for("r1")
    good = path.read_bytes()
    torn = canonical_line(make_entry(call=2))[:40]
    with path.open("ab") as handle:
        handle.write(torn)
    assert [e.model_call_id for e in store.read_entries("r1")] == ["call-1"]
    assert path.read_bytes() == good + torn  # readers change nothing
    store.append(make_entry(call=3))
    assert path.read_bytes() == good + canonical_line(make_entry(call=3)) + b"\n"


def test_a_complete_torn_looking_line_without_newline_is_still_torn(
    store: TokenCaptureStore,
) -> None:
    store.append(make_entry(call=1))
    path = store.path_for("r1")
    with path.open("ab") as handle:
        handle.write(canonical_line(make_entry(call=2)))  # parses, but no newline
    snapshot = store.freeze_now("r1")
    assert [e.model_call_id for e in snapshot.entries] == ["call-1"]
    assert path.read_bytes().count(b"\n") == 1 and path.read_bytes().endswith(b"\n")


def test_corrupt_line_with_content_after_it_raises(store: TokenCaptureStore) -> None:
    store.append(make_entry(call=1))
    path = store.path_for("r1")
    with path.open("ab") as handle:
        handle.write(b'{"model_call_id": "call-2", "prompt_tok\n')
        handle.write(canonical_line(make_entry(call=3)) + b"\n")
    for action in (
        lambda: store.freeze_now("r1"),
        lambda: store.append(make_entry(call=4)),
        lambda: store.read_entries("r1"),
    ):
        with pytest.raises(TokenCaptureCorruptionError, match=r"r1\.tokens\.jsonl"):
            action()


def test_tail_appended_by_another_process_is_folded_with_version_bumps(
    store: TokenCaptureStore, tmp_path: Path
) -> None:
    store.append(make_entry(call=1))
    # Another writer (a second store instance stands in for another process) appends twice.
    other = TokenCaptureStore(store.root)
    other.append(make_entry(call=2))
    other.append(make_entry(call=3))
    # Raw tail written by a foreign writer, after the last state write.
    with store.path_for("r1").open("ab") as handle:
        handle.write(canonical_line(make_entry(call=4)) + b"\n")
    store.append(make_entry(call=5))
    snapshot = store.freeze_now("r1")
    assert [e.model_call_id for e in snapshot.entries] == [f"call-{i}" for i in range(1, 6)]
    assert snapshot.version == 6
    assert TokenCaptureStore(store.root).freeze_now("r1").version == 6


def test_freeze_is_idempotent_and_stable_across_instances(store: TokenCaptureStore) -> None:
    store.append(make_entry())
    first = store.freeze_now("r1")
    second = TokenCaptureStore(store.root).freeze_now("r1")
    assert (first.snapshot_id, first.version, first.entries) == (
        second.snapshot_id,
        second.version,
        second.entries,
    )


def test_freeze_of_an_empty_rollout_is_a_valid_empty_snapshot(store: TokenCaptureStore) -> None:
    snapshot = store.freeze_now("empty")
    assert snapshot.entries == () and not snapshot.incomplete and snapshot.version == 1


def test_reads_of_unknown_rollouts_create_nothing(store: TokenCaptureStore) -> None:
    assert store.read_entries("ghost") == []
    assert store.is_incomplete("ghost") is False
    assert store.inspect("ghost") is None
    assert files(store) == set()


def test_freeze_detects_a_line_that_changed_after_it_was_indexed(store: TokenCaptureStore) -> None:
    store.append(make_entry(call=1))
    store.freeze_now("r1")  # indexes the line
    path = store.path_for("r1")
    data = path.read_bytes().replace(b"-0.25", b"-0.75")
    path.write_bytes(data)
    with pytest.raises(TokenCaptureCorruptionError, match="payload digest"):
        TokenCaptureStore(store.root).freeze_now("r1")


def test_mark_incomplete_records_odd_call_ids_as_lines(store: TokenCaptureStore) -> None:
    store._mark_incomplete("r1")
    store._mark_incomplete("r1", "a\nb")
    store._mark_incomplete("r1", "bad\ud800")
    store._mark_incomplete("r1", "plain")
    assert store.incomplete_path_for("r1").read_bytes() == b'\n"a\\nb"\n"bad\\ud800"\nplain\n'
    assert store.is_incomplete("r1")
    assert state_of(store, "r1")["version"] == 4


@pytest.mark.parametrize("call_id", ["", "a\nb", "a\rb", "bad\ud800"])
def test_put_and_begin_call_refuse_call_ids_that_are_not_one_line(
    store: TokenCaptureStore, call_id: str
) -> None:
    with pytest.raises(ValueError):
        store.append(make_entry(call=call_id) if call_id else make_entry(model_call_id=""))
    with pytest.raises(ValueError):
        store._begin_call("r1", call_id)
    assert files(store) == set()


def test_path_helpers(store: TokenCaptureStore) -> None:
    root = store.root
    assert store.path_for("r") == root / "r.tokens.jsonl"
    assert store.state_path_for("r") == root / "r.tokens.state.json"
    assert store.intents_path_for("r") == root / "r.tokens.intents"
    assert store.incomplete_path_for("r") == root / "r.tokens.incomplete"
    assert store.lock_path_for("r") == root / "r.tokens.lock"
    with pytest.raises(ValueError):
        store.path_for("../x")


def test_root_is_created_and_close_is_idempotent(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path / "a" / "b")
    assert store.root == tmp_path / "a" / "b" and store.root.is_dir()
    asyncio.run(store.close())
    asyncio.run(store.close())


async def test_async_methods_run_off_the_event_loop(store: TokenCaptureStore) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.gather(
        *(store.put(make_entry(f"r{i}", call=c)) for i in range(8) for c in range(4))
    )
    await store.begin_call("r0", "call-x")
    await store.mark_incomplete("r1", "call-y")
    snapshots = [await store.freeze(f"r{i}") for i in range(8)]
    assert [len(s.entries) for s in snapshots] == [4] * 8
    assert await store.drop("r2", snapshots[2].snapshot_id, snapshots[2].version) is True
    assert await store.retire(["r3"]) == {"removed": ["r3"], "absent": []}
    assert await store.delete(["r3", "r2"]) == {"removed": ["r3", "r2"], "absent": []}
    task.cancel()
    assert ticks > 10  # the loop kept running while the disk worked


def test_separate_rollouts_do_not_wait_on_each_other(store: TokenCaptureStore) -> None:
    import fcntl
    import threading

    store.append(make_entry("busy"))
    with store.lock_path_for("busy").open("rb") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # another writer holds rollout "busy"
        done = threading.Event()

        def other_rollout() -> None:
            store.append(make_entry("free"))
            done.set()

        thread = threading.Thread(target=other_rollout)
        thread.start()
        assert done.wait(5), "a put to another rollout waited on an unrelated lock"
        blocked = threading.Thread(target=store.append, args=(make_entry("busy", call=2),))
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive(), "a put to a locked rollout did not wait for the lock"
        fcntl.flock(handle, fcntl.LOCK_UN)
    blocked.join(5)
    assert not blocked.is_alive()
    thread.join()
    assert len(store.read_entries("busy")) == 2


def test_lock_file_deleted_under_a_live_store_is_recreated(store: TokenCaptureStore) -> None:
    store.append(make_entry(call=1))
    os.unlink(store.lock_path_for("r1"))
    store.append(make_entry(call=2))
    assert store.lock_path_for("r1").exists()
    assert len(store.freeze_now("r1").entries) == 2


def test_a_vanished_log_with_an_index_is_corruption_not_a_fresh_start(
    store: TokenCaptureStore,
) -> None:
    index_by_checkpoint(store)
    store.freeze_now("other")  # unrelated rollout keeps working
    os.unlink(store.path_for("r1"))
    for action in (lambda: store.append(make_entry(call=99)), lambda: store.freeze_now("r1")):
        with pytest.raises(TokenCaptureCorruptionError, match="missing"):
            action()
    assert not store.path_for("r1").exists()
    store._mark_incomplete("r1", "call-99")  # the most available write still works
    assert store.retire_now(["r1"]) == {"removed": ["r1"], "absent": []}


def test_write_refusal_is_the_file_stores_own_exception(store: TokenCaptureStore) -> None:
    """`_core.write_refusal` (how the PostgreSQL store raises what its server refused) gives
    the exception, type and words, that the file store raises for the same refusal."""
    from tokencapture import _core

    odd_call = 'c"é\x01'  # quoting and escapes as the core's messages spell them
    store.append(make_entry(model_call_id=odd_call))
    raised: list[Exception] = []
    for attempt in (
        lambda: store.append(make_entry(model_call_id=odd_call, model="other")),
        lambda: (store.freeze_now("r1"), store.append(make_entry(model_call_id="late")))[1],
        lambda: (store.retire_now(["r1"]), store.append(make_entry(model_call_id="late")))[1],
    ):
        with pytest.raises(Exception) as info:
            attempt()
        raised.append(info.value)
    built = [
        _core.write_refusal("conflict", "r1", odd_call),
        _core.write_refusal("frozen", "r1"),
        _core.write_refusal("retired", "r1"),
    ]
    assert [(type(e), str(e)) for e in built] == [(type(e), str(e)) for e in raised]
    with pytest.raises(ValueError, match="kind must be"):
        _core.write_refusal("closed", "r1")
