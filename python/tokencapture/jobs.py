"""The async bridge every backend and surface shares (a neutral module below all of them).

Two ways to run blocking work without blocking the event loop:

* `native_job(start, *args)`: start a job on the Rust worker pool (no GIL) and get a future of
  its result. Finished jobs are queued in one `_core.Completions` per event loop, whose
  descriptor the loop watches; one wake-up drains every job finished since the last one, so a
  put costs the loop a future and a dictionary entry, not a thread hop. A cancelled await does
  not stop the job: a durable write completes or fails whole.
* `start_together(*coroutines)`: start coroutines as tasks whose native jobs (those each
  starts before it first waits) go to the worker pool as one job, run in order: one worker
  wake-up instead of one per job.
* `prepare_loop()`: make the running loop's queue (and its descriptor) now, as a server does at
  startup, instead of at its first native job.
* `off_loop(func, *args)`: run a blocking call that builds Python objects (a freeze, a batch)
  on the process-wide thread pool (`io_executor()`, recreated in a forked child).

`checked_when_called` makes an async method validate its arguments when it is called, not when
it is awaited. See docs/architecture.md for the layer map.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

from tokencapture import _core
from tokencapture.forking import renew_after_fork

__all__ = [
    "checked_when_called",
    "io_executor",
    "native_job",
    "off_loop",
    "prepare_loop",
    "start_together",
]

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Threads for the lifecycle calls (created on demand): enough that the fsyncs of freezes and
# retirements of different rollouts overlap, since the disk rewards concurrency.
_IO_THREADS = 64
_executor: ThreadPoolExecutor | None = None
_executor_pid = 0
_executor_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_executor_lock")


def io_executor() -> ThreadPoolExecutor:
    """The process-wide pool for blocking store calls (recreated in a forked child)."""
    global _executor, _executor_pid
    pid = os.getpid()
    if _executor is None or _executor_pid != pid:
        with _executor_lock:
            if _executor is None or _executor_pid != pid:
                _executor = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="tokencapture-io")
                _executor_pid = pid
    return _executor


async def off_loop(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run a blocking call that builds Python objects (freeze, batches) on the thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(io_executor(), lambda: func(*args, **kwargs))


_F = TypeVar("_F", bound=Callable[..., Coroutine[Any, Any, Any]])


def checked_when_called(check: Callable[..., object]) -> Callable[[_F], _F]:
    """Make an async method validate its arguments when it is called, not when it is awaited.

    `check` takes some of the method's parameters, by the same names (for example
    `validate_rollout_id(rollout_id)`), and raises on bad values; only then is the coroutine
    created. So `obj.method(bad)` raises at once, even if its result is never awaited, and a
    refused call leaves no coroutine behind. The decorated method is a plain function that
    returns the coroutine: `await obj.method(...)` works as before.
    """
    wanted = tuple(inspect.signature(check).parameters)

    def decorate(method: _F) -> _F:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def checked(*args: Any, **kwargs: Any) -> Coroutine[Any, Any, Any]:
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            check(**{name: arguments.arguments[name] for name in wanted})
            return method(*args, **kwargs)

        return cast(_F, checked)

    return decorate


class _LoopBridge:
    """Completions of native jobs for one event loop.

    The hot writes (put, begin_call, mark_incomplete) run on the Rust worker pool without the
    GIL; each finished job is queued in `completions`, whose descriptor the loop watches. One
    wake-up drains every job finished since the last one, so a put costs the loop a future and a
    dictionary entry, not a thread hop.
    """

    __slots__ = ("__weakref__", "completions", "futures", "tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.completions = _core.Completions()
        self.futures: dict[int, asyncio.Future[Any]] = {}
        self.tokens = itertools.count()
        loop.add_reader(self.completions.fileno(), self._drain)

    def _drain(self) -> None:
        for token, value, failed in self.completions.drain():
            future = self.futures.pop(token, None)
            if future is None or future.done():  # the awaiting task was cancelled
                continue
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)


_bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopBridge] = (
    weakref.WeakKeyDictionary()
)


def _bridge(loop: asyncio.AbstractEventLoop) -> _LoopBridge:
    bridge = _bridges.get(loop)
    if bridge is None:
        bridge = _bridges[loop] = _LoopBridge(loop)
    return bridge


def prepare_loop() -> None:
    """Make the running loop's completion queue now, not at its first native job.

    The queue holds a descriptor (its doorbell): a server makes it at startup, so that a later
    shortage of descriptors (its clients' sockets) cannot fail a call for the want of it.
    """
    _bridge(asyncio.get_running_loop())


def native_job(start: Callable[..., None], *args: object) -> asyncio.Future[Any]:
    """Start `start(completions, token, *args)` on the worker pool; a future for its result.

    A cancelled await does not stop the job: a durable write either completes or fails whole.
    """
    loop = asyncio.get_running_loop()
    bridge = _bridge(loop)
    token = next(bridge.tokens)
    future = loop.create_future()
    bridge.futures[token] = future
    try:
        start(bridge.completions, token, *args)
    except BaseException:
        del bridge.futures[token]
        raise
    return future


def start_together(*coroutines: Coroutine[Any, Any, Any]) -> list[asyncio.Task[Any]]:
    """Start `coroutines` as tasks, in order; the native jobs their first steps start (before
    each first waits) go to the worker pool as one job that runs them in that order.

    One worker wake-up for all of them (a futex wake on the loop's thread, and a worker's wake
    and sleep) instead of one each. Each job still reports to its own future as it finishes,
    but a job waits for the ones before it: start together only jobs where that costs nothing,
    such as a durable intent and then a lookup needed only once the call's answer is back.

    The loop runs the first steps right after one another (its ready queue is first in, first
    out, and they are queued here back to back, between the hold and the release of this
    loop's completion queue); a job started by anything else runs apart.
    """
    loop = asyncio.get_running_loop()
    try:
        completions = _bridge(loop).completions
    except BaseException:
        # No queue (its descriptor could not be made): none of them starts, and none is left
        # behind unawaited.
        for coroutine in coroutines:
            coroutine.close()
        raise
    loop.call_soon(completions.hold)
    try:
        return [loop.create_task(coroutine) for coroutine in coroutines]
    finally:
        loop.call_soon(completions.release)
