"""Counters and latency histograms for store operations, readable from Python and OpenTelemetry.

Each `TokenCaptureStore` keeps a `Metrics` (see `TokenCaptureStore.stats()`); `snapshot()`
merges every live store's figures so a server can export them in one call. Latencies are what
the caller experienced (an async put includes waiting for the worker pool).

When the `opentelemetry-api` package is importable (`pip install 'tokencapture[otel]'`), every
operation a `Metrics` observes is also recorded into OpenTelemetry instruments (see
`tokencapture._otel` and docs/metrics.md), through the global meter provider unless
`use_meter_provider` or `Metrics(meter_provider=...)` names another. The stores that keep no
`Metrics` (the lineage stores, the capture ledger, the reference store) are timed by the
`instrumented` class decorator, which leaves a class untouched when the package is absent.
Without the package nothing of OpenTelemetry is imported; `TOKENCAPTURE_OTEL=0` in the
environment disables it even when present.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from contextvars import ContextVar, Token
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from tokencapture.forking import renew_after_fork
from tokencapture.latency import BUCKET_BOUNDS_SECONDS as BUCKET_BOUNDS_SECONDS

if TYPE_CHECKING:
    from tokencapture._otel import Recorder

__all__ = [
    "BUCKET_BOUNDS_SECONDS",
    "Metrics",
    "Timed",
    "instrumented",
    "otel_enabled",
    "snapshot",
    "untimed",
    "use_meter_provider",
]


class _Operation:
    __slots__ = ("buckets", "count", "failures", "max_seconds", "total_seconds")

    def __init__(self) -> None:
        self.count = 0
        self.failures = 0
        self.total_seconds = 0.0
        self.max_seconds = 0.0
        self.buckets = [0] * (len(BUCKET_BOUNDS_SECONDS) + 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "failures": self.failures,
            "total_seconds": self.total_seconds,
            "max_seconds": self.max_seconds,
            "buckets": list(self.buckets),
        }


class Timed:
    """Times a block for `Metrics.observe`; an exception counts as a failure and propagates.

    A plain class rather than a generator-based context manager: it sits on every put.
    """

    __slots__ = ("metrics", "operation", "started")

    def __init__(self, metrics: Metrics, operation: str) -> None:
        self.metrics = metrics
        self.operation = operation
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self.started
        if exc_type is None:
            self.metrics.observe(self.operation, elapsed)
        else:
            self.metrics.observe(self.operation, elapsed, failed=True, error_type=exc_type)


class Metrics:
    """Thread-safe per-operation counters (calls, failures) and latency histograms.

    `backend` and `store` become the `tokencapture.backend` and `tokencapture.store`
    attributes of the OpenTelemetry measurements; `meter_provider` pins this store's
    instruments to a provider (default: the one `use_meter_provider` names, else the global).
    """

    def __init__(
        self,
        backend: str = "file",
        *,
        store: str = "token_capture",
        meter_provider: Any = None,
    ) -> None:
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")
        self._operations: dict[str, _Operation] = {}
        otel = _load_otel()
        self._otel: Recorder | None = (
            None if otel is None else otel.recorder(store, backend, meter_provider)
        )
        _live.add(self)

    def observe(
        self,
        operation: str,
        seconds: float,
        *,
        failed: bool = False,
        error_type: type[BaseException] | str | None = None,
        status: int | None = None,
    ) -> None:
        """Count one call of `operation` that took `seconds`.

        A failure's `error_type` (for OpenTelemetry's `error.type`: an exception class, or a
        low-cardinality name such as the gateway's answered error type) defaults to the
        exception being handled when this is called from an `except` block. `status`, the
        HTTP status a capture gateway call answered, becomes OpenTelemetry's
        `http.response.status_code` (bounded: the statuses the gateway answers).
        """
        failed = failed or error_type is not None
        with self._lock:
            stats = self._operations.get(operation)
            if stats is None:
                stats = self._operations[operation] = _Operation()
            stats.count += 1
            stats.failures += failed
            stats.total_seconds += seconds
            if seconds > stats.max_seconds:
                stats.max_seconds = seconds
            stats.buckets[bisect_left(BUCKET_BOUNDS_SECONDS, seconds)] += 1
        otel = self._otel
        if otel is not None:
            if failed and error_type is None:
                error_type = sys.exc_info()[0]
            otel.record(operation, seconds, failed, error_type, status)

    def timed(self, operation: str) -> Timed:
        """A context manager timing the block; an exception counts as a failure."""
        return Timed(self, operation)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """`{operation: {count, failures, total_seconds, max_seconds, buckets}}`.

        `buckets[i]` counts calls that took at most `BUCKET_BOUNDS_SECONDS[i]`; the last bucket
        counts the slower ones.
        """
        with self._lock:
            return {name: stats.as_dict() for name, stats in self._operations.items()}


_live: weakref.WeakSet[Metrics] = weakref.WeakSet()


def snapshot() -> dict[str, dict[str, Any]]:
    """Every live store's figures merged, for a process-wide export."""
    merged: dict[str, dict[str, Any]] = {}
    for metrics in list(_live):
        for name, stats in metrics.snapshot().items():
            into = merged.setdefault(
                name,
                {
                    "count": 0,
                    "failures": 0,
                    "total_seconds": 0.0,
                    "max_seconds": 0.0,
                    "buckets": [0] * (len(BUCKET_BOUNDS_SECONDS) + 1),
                },
            )
            into["count"] += stats["count"]
            into["failures"] += stats["failures"]
            into["total_seconds"] += stats["total_seconds"]
            into["max_seconds"] = max(into["max_seconds"], stats["max_seconds"])
            into["buckets"] = [
                a + b for a, b in zip(into["buckets"], stats["buckets"], strict=True)
            ]
    return merged


# OpenTelemetry ------------------------------------------------------------------------------

_otel_module: ModuleType | None = None
_otel_checked = False
_otel_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_otel_lock")
_DISABLED = frozenset({"0", "false", "no", "off"})


def _load_otel() -> Any:
    """`tokencapture._otel`, or None when `opentelemetry-api` is absent or disabled."""
    global _otel_module, _otel_checked
    if _otel_checked:
        return _otel_module
    with _otel_lock:
        if not _otel_checked:
            if os.environ.get("TOKENCAPTURE_OTEL", "").strip().lower() not in _DISABLED:
                try:
                    import opentelemetry.metrics  # noqa: F401
                except ImportError:
                    pass
                else:
                    from tokencapture import _otel

                    _otel_module = _otel
            _otel_checked = True
    return _otel_module


def otel_enabled() -> bool:
    """Whether store operations are recorded into OpenTelemetry instruments."""
    return _load_otel() is not None


def use_meter_provider(meter_provider: Any) -> None:
    """Record every store's operations into `meter_provider` from now on (None: the global).

    Stores created with `Metrics(meter_provider=...)` keep theirs. Raises `ImportError` when
    `opentelemetry-api` is not installed (or `TOKENCAPTURE_OTEL=0` disabled it).
    """
    otel = _load_otel()
    if otel is None:
        raise ImportError(
            "OpenTelemetry metrics need the opentelemetry-api package: "
            "pip install 'tokencapture[otel]' (and TOKENCAPTURE_OTEL unset)"
        )
    otel.use_meter_provider(meter_provider)


_C = TypeVar("_C", bound=type)


def instrumented(
    store: str,
    backend: str,
    operations: Mapping[str, str],
    *,
    refusals: Mapping[str, str] | None = None,
) -> Callable[[_C], _C]:
    """Class decorator: time the methods named in `operations` (method -> operation name).

    Each call is recorded into the OpenTelemetry instruments with `store` and `backend` as
    attributes; a coroutine function (or a method returning an awaitable) is timed until its
    result is ready. A timed method that calls another timed method of the same object in the
    same context (an async twin awaiting its sync twin, or `asyncio.to_thread` of it) counts
    once, as the outer call; an async twin that hands its sync twin to an executor without
    copying the context must not be named as well, nor one that hands it to
    `asyncio.to_thread` (its sync twin times the work). Name those in `refusals` instead
    (method -> operation name): what such a method raises when called (its argument checks,
    before anything ran) counts as one failed call of the operation, and the awaitable it
    returns is left to the twin it runs. Without OpenTelemetry the class is returned as is.
    """

    def decorate(cls: _C) -> _C:
        otel = _load_otel()
        if otel is None:
            return cls
        recorder = otel.recorder(store, backend)
        for names, wrap in ((operations, _timed_method), (refusals or {}, _refusing_method)):
            for method, operation in names.items():
                function = cls.__dict__.get(method)
                if not callable(function):
                    raise AttributeError(f"{cls.__name__}.{method} is not a method to instrument")
                setattr(cls, method, wrap(function, recorder, operation))
        return cls

    return decorate


def untimed(obj: object) -> _Untimed:
    """A context manager: within it, the timed methods of `obj` (see `instrumented`) do not
    count. For a store that delegates part of its own operation to another one (a
    `FileLineageStore`'s resolve answered by its capture ledger's `resolve_now`): that is the
    caller's one call, counted by the caller."""
    return _Untimed(id(obj))


class _Untimed:
    __slots__ = ("_id", "_token")

    _token: Token[int | None]

    def __init__(self, obj_id: int) -> None:
        self._id = obj_id

    def __enter__(self) -> None:
        self._token = _timing.set(self._id)

    def __exit__(self, *exc_info: object) -> None:
        _timing.reset(self._token)


# The `id` of the object whose timed method is running in this context (its nested timed calls
# don't count). Its id, not the object: a context is copied into whatever a call schedules (a
# driver's timer, say, which may live for minutes), and must not keep the store alive there.
_timing: ContextVar[int | None] = ContextVar("tokencapture_timing", default=None)


class _Timed(Coroutine[Any, Any, Any]):
    """The timing coroutine of a call, which closes the call's own coroutine when it is closed
    or cancelled before it ran (a task cancelled before its first step, `wait_for` timing out,
    a shutdown): the call's coroutine was made when the method was called (its arguments are
    checked then), so otherwise it would be left "never awaited" (a RuntimeWarning, an error
    under `-W error`)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, outer: Coroutine[Any, Any, Any], inner: Awaitable[Any]) -> None:
        self._outer = outer
        self._inner = inner

    def send(self, value: Any) -> Any:
        return self._outer.send(value)

    def throw(self, *exc: Any) -> Any:
        try:
            return self._outer.throw(*exc)
        finally:
            if inspect.getcoroutinestate(self._outer) == inspect.CORO_CLOSED:  # so is the call
                self._close_inner()

    def close(self) -> None:
        self._outer.close()
        self._close_inner()

    def _close_inner(self) -> None:
        close = getattr(self._inner, "close", None)
        if callable(close):
            close()  # a no-op for a coroutine that ran to its end

    def __await__(self) -> Generator[Any, None, Any]:
        return self._outer.__await__()


def _timed_method(function: Callable[..., Any], recorder: Recorder, operation: str) -> Any:
    record = recorder.record
    clock = time.perf_counter

    async def finish(self: object, awaitable: Awaitable[Any], started: float) -> Any:
        token = _timing.set(id(self))
        try:
            result = await awaitable
        except BaseException as exc:
            record(operation, clock() - started, True, type(exc))
            raise
        finally:
            _timing.reset(token)
        record(operation, clock() - started, False, None)
        return result

    @functools.wraps(function)
    def timed(self: object, *args: Any, **kwargs: Any) -> Any:
        if _timing.get() == id(self):
            return function(self, *args, **kwargs)
        token = _timing.set(id(self))
        started = clock()
        try:
            result = function(self, *args, **kwargs)
        except BaseException as exc:
            record(operation, clock() - started, True, type(exc))
            raise
        finally:
            _timing.reset(token)
        if inspect.isawaitable(result):
            return _Timed(finish(self, result, started), result)
        record(operation, clock() - started, False, None)
        return result

    if inspect.iscoroutinefunction(function):
        # Still a coroutine function to callers that check; `timed` times the awaitable.
        @functools.wraps(function)
        async def timed_coroutine(self: object, *args: Any, **kwargs: Any) -> Any:
            return await timed(self, *args, **kwargs)

        return timed_coroutine
    return timed


def _refusing_method(function: Callable[..., Any], recorder: Recorder, operation: str) -> Any:
    """`function` (which checks its arguments and returns an awaitable), counting what it
    raises when called as a failed `operation`; the awaitable is not timed here."""
    record = recorder.record
    clock = time.perf_counter

    @functools.wraps(function)
    def refusing(self: object, *args: Any, **kwargs: Any) -> Any:
        if _timing.get() == id(self):
            return function(self, *args, **kwargs)
        started = clock()
        try:
            return function(self, *args, **kwargs)
        except BaseException as exc:
            record(operation, clock() - started, True, type(exc))
            raise

    return refusing
