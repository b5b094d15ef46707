"""`TokenCaptureStore.put_unless_stored`: a put that leaves another entry stored under its call
id standing, writing and marking nothing (the capture gateway's second attempt of a call that
raced the first through another process), where `put` follows SPEC (mark, then raise)."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
from tests.conftest import make_entry

from tokencapture import TokenCaptureStore
from tokencapture.protocols import TokenCaptureConflictError, TokenCaptureFrozenError


def _log(root: Path, rollout_id: str = "r1") -> bytes:
    return (root / f"{rollout_id}.tokens.jsonl").read_bytes()


async def test_another_entry_under_the_call_id_stands_and_nothing_is_marked(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    first = make_entry()
    other = make_entry(generation_log_probs=[-9.0, -9.0])  # another answer to call-1
    assert await store.put_unless_stored(first) is False  # stored
    log = _log(tmp_path)
    assert await store.put_unless_stored(other) is True  # kept the first
    assert await store.put_unless_stored(first) is False  # the same entry: a no-op
    assert _log(tmp_path) == log
    snapshot = store.freeze_now("r1")
    assert snapshot.entries == (first,) and not snapshot.incomplete
    assert snapshot.version == 2  # the put and the freeze: the kept attempt bumped nothing
    stats = store.stats()["put"]
    assert stats["count"] == 3 and stats["failures"] == 0


async def test_put_still_marks_and_raises_on_a_conflict(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    await store.put(make_entry())
    with pytest.raises(TokenCaptureConflictError):
        await store.put(make_entry(generation_log_probs=[-9.0, -9.0]))
    assert store.is_incomplete("r1")


async def test_it_is_fenced_and_checked_as_put(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    with pytest.raises(ValueError):
        store.put_unless_stored(make_entry(rollout_id="bad/id"))  # raised when called
    await store.put_unless_stored(make_entry())
    store.freeze_now("r1")
    with pytest.raises(TokenCaptureFrozenError):
        await store.put_unless_stored(make_entry(call=2))


async def test_of_two_attempts_at_once_through_two_stores_one_is_stored(tmp_path: Path) -> None:
    """Two stores on one directory (as two gateway processes), each putting its own answer to
    one call at once, over many rounds: exactly one of each pair is stored, the other kept
    out, and no rollout is marked."""
    one, two = TokenCaptureStore(tmp_path), TokenCaptureStore(tmp_path)
    for n in range(40):
        rollout = f"r{n}"
        results = await asyncio.gather(
            one.put_unless_stored(make_entry(rollout, generation_log_probs=[-1.0, -1.0])),
            two.put_unless_stored(make_entry(rollout, generation_log_probs=[-2.0, -2.0])),
        )
        assert sorted(results) == [False, True], (rollout, results)
        snapshot = one.freeze_now(rollout)
        assert len(snapshot.entries) == 1 and not snapshot.incomplete
        winner = snapshot.entries[0].generation_log_probs[0]
        assert winner == (-1.0 if results[0] is False else -2.0)


def _put_in_child(root: str, rollout_id: str, log_prob: float, start: object, out: object) -> None:
    store = TokenCaptureStore(root)
    start.wait()  # type: ignore[attr-defined]
    entry = make_entry(rollout_id, generation_log_probs=[log_prob, log_prob])
    out.put(asyncio.run(store.put_unless_stored(entry)))  # type: ignore[attr-defined]


def test_of_two_processes_putting_one_call_at_once_one_is_stored(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    for n in range(3):
        start, out = context.Event(), context.Queue()
        children = [
            context.Process(target=_put_in_child, args=(str(tmp_path), f"p{n}", lp, start, out))
            for lp in (-1.0, -2.0)
        ]
        for child in children:
            child.start()
        start.set()
        results = sorted(out.get(timeout=60) for _ in children)
        for child in children:
            child.join(timeout=60)
            assert child.exitcode == 0
        assert results == [False, True]
        snapshot = TokenCaptureStore(tmp_path).freeze_now(f"p{n}")
        assert len(snapshot.entries) == 1 and not snapshot.incomplete
