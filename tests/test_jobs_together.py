"""Native jobs started together (`Completions.hold` / `release`, `jobs.start_together`): held
jobs do not run until released, then run as one job of the worker pool, in order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tokencapture import TokenCaptureStore, _core
from tokencapture.jobs import _bridge, native_job, start_together


def _drained(completions: _core.Completions, count: int) -> list[tuple[int, object, bool]]:
    done: list[tuple[int, object, bool]] = []
    deadline = time.monotonic() + 30
    while len(done) < count:
        assert time.monotonic() < deadline, f"only {done} of {count} jobs completed"
        done += completions.drain()
        time.sleep(0.005)
    return done


def test_held_jobs_wait_for_the_release_and_run_in_order(tmp_path: Path) -> None:
    """Nothing held runs before `release` (no intents file appears, nothing completes); then
    every held job runs, in the order started, each reporting to its own token."""
    store = TokenCaptureStore(tmp_path)
    completions = _core.Completions()
    assert not completions.holding()
    completions.hold()
    assert completions.holding()
    store._native.submit_begin_call(completions, 1, "held", "first", False)
    store._native.submit_begin_call(completions, 2, "held", "second", False)
    time.sleep(0.3)  # ample for two intents, were they running
    assert completions.drain() == []
    assert list(tmp_path.iterdir()) == []
    assert completions.release() == 2
    assert not completions.holding()
    done = _drained(completions, 2)
    assert [(token, value, failed) for token, value, failed in done] == [
        (1, False, False),
        (2, False, False),
    ]
    intents = next(tmp_path.glob("held*intents*")).read_bytes()
    assert intents.index(b"first") < intents.index(b"second")
    assert completions.release() == 0  # nothing held: nothing to do
    # Not holding: a job runs at once.
    store._native.submit_begin_call(completions, 3, "held", "third", False)
    assert _drained(completions, 1) == [(3, False, False)]


def test_a_failing_held_job_does_not_stop_the_next(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    completions = _core.Completions()
    completions.hold()
    store._native.submit_begin_call(completions, 1, "../refused", "call", False)
    store._native.submit_begin_call(completions, 2, "after", "call", False)
    completions.release()
    done = _drained(completions, 2)
    assert [(token, failed) for token, _, failed in done] == [(1, True), (2, False)]
    assert isinstance(done[0][1], ValueError)


async def test_start_together_holds_exactly_the_first_steps_of_its_coroutines(
    tmp_path: Path,
) -> None:
    """The coroutines' first steps run while this loop's completions are held, and nothing
    scheduled before or after them does; their jobs complete."""
    store = TokenCaptureStore(tmp_path)
    completions = _bridge(asyncio.get_running_loop()).completions
    seen: dict[str, bool] = {}

    async def look(name: str) -> None:
        seen[name] = completions.holding()

    async def intent(call: str) -> None:
        seen[call] = completions.holding()
        await native_job(store._native.submit_begin_call, "together", call, False)
        seen[call + " after"] = completions.holding()

    before = asyncio.ensure_future(look("before"))
    first, second = start_together(intent("one"), intent("two"))
    after = asyncio.ensure_future(look("after"))
    await asyncio.wait_for(asyncio.gather(before, first, second, after), 30)
    assert seen == {
        "before": False,
        "one": True,
        "two": True,
        "after": False,
        "one after": False,
        "two after": False,
    }
    intents = next(tmp_path.glob("together*intents*")).read_bytes()
    assert intents.index(b"one") < intents.index(b"two")
