"""OpenTelemetry instruments for store operations (only imported when `opentelemetry-api` is).

`tokencapture.metrics` imports this module on first use and only when the
`opentelemetry.metrics` import succeeds, so a process without the package imports nothing of
OpenTelemetry and records nothing. Every store operation is one measurement of the duration
histogram and one increment of an in-process tally that the observable operation counter
reports at collection, both with the same attributes. The tallies are kept per (meter
provider, store kind, backend) for the life of the process, so the counter never decreases,
and a call counts only when its measurement reaches a real histogram, so the counter's count
and the histogram's agree.

Recording is on the path of every put, so the attribute dicts are built once per
(operation, outcome) and reused; a call allocates nothing here beyond what the SDK's
histogram does with its one measurement.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics as otel_metrics

from tokencapture.forking import renew_after_fork
from tokencapture.latency import BUCKET_BOUNDS_SECONDS

__all__ = [
    "ATTR_BACKEND",
    "ATTR_ERROR_TYPE",
    "ATTR_HTTP_STATUS",
    "ATTR_OPERATION",
    "ATTR_OUTCOME",
    "ATTR_STORE",
    "COUNTER_NAME",
    "DURATION_NAME",
    "METER_NAME",
    "Recorder",
    "outcome_of",
    "recorder",
    "use_meter_provider",
]

METER_NAME = "tokencapture"
DURATION_NAME = "tokencapture.operation.duration"
COUNTER_NAME = "tokencapture.operations"
ATTR_STORE = "tokencapture.store"
ATTR_BACKEND = "tokencapture.backend"
ATTR_OPERATION = "tokencapture.operation"
ATTR_OUTCOME = "tokencapture.outcome"
ATTR_ERROR_TYPE = "error.type"
# OpenTelemetry's semantic convention for an HTTP server's response status (an int): on the
# capture gateway's calls, where the status answered is known.
ATTR_HTTP_STATUS = "http.response.status_code"

# The outcome of a failure, by the name of a class in the exception's MRO (first match wins).
_OUTCOME_BY_CLASS = {
    "TokenCaptureConflictError": "conflict",
    "CaptureLedgerConflictError": "conflict",
    "TokenCaptureRetiredError": "retired",
    "RolloutRetiredError": "retired",
    "TokenCaptureFrozenError": "frozen",
    "TokenCaptureCorruptionError": "corruption",
    "LineageIntegrityError": "corruption",
    "CancelledError": "cancelled",
    "OSError": "io_error",
    "TypeError": "invalid_input",
    "ValueError": "invalid_input",
}


def outcome_of(error_type: type[BaseException] | str | None) -> str:
    """The `tokencapture.outcome` value of an operation that raised `error_type` (None: ok;
    a string, a failure named without an exception class: `error`)."""
    if error_type is None:
        return "success"
    if isinstance(error_type, str):
        return "error"
    for cls in error_type.__mro__:
        outcome = _OUTCOME_BY_CLASS.get(cls.__name__)
        if outcome is not None:
            return outcome
    return "error"


def _error_type_name(error_type: type[BaseException] | str | None) -> str:
    """OpenTelemetry's `error.type`: the exception's qualified class name, or the name given
    as a string (the gateway's answered error types); `_OTHER` unknown."""
    if error_type is None:
        return "_OTHER"
    if isinstance(error_type, str):
        return error_type
    module = error_type.__module__
    if module == "builtins":
        return error_type.__qualname__
    return f"{module}.{error_type.__qualname__}"


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("tokencapture")
    except Exception:  # pragma: no cover - an uninstalled source tree
        return ""


class _Tally:
    """One attribute set's measurements: its attributes, built once, and its call count."""

    __slots__ = ("attributes", "count")

    def __init__(self, attributes: Mapping[str, str | int]) -> None:
        self.attributes = attributes
        self.count = 0


class _Kind:
    """One (meter provider, store kind, backend)'s call counts, kept for the life of the process.

    Every recorder of that store kind and backend bound to that provider counts here, so the
    totals the observable counter reports never decrease: not when a store is collected, not
    when the default recorders move to another provider and back (a monotonic counter that
    went down would read as a reset to Prometheus).
    """

    __slots__ = ("__weakref__", "base", "failures", "histogram", "instruments", "lock", "successes")

    def __init__(self, instruments: _Instruments, store: str, backend: str) -> None:
        self.base = {ATTR_STORE: store, ATTR_BACKEND: backend}
        self.instruments = instruments
        self.histogram = instruments.histogram  # None until the global provider is set
        self.lock = threading.Lock()
        renew_after_fork(self, "lock")
        # Keyed by operation (and the error type), and the HTTP status when there is one.
        self.successes: dict[tuple[str, int | None], _Tally] = {}
        self.failures: dict[tuple[str, type[BaseException] | str | None, int | None], _Tally] = {}

    def tallies(self) -> list[_Tally]:
        with self.lock:
            return [*self.successes.values(), *self.failures.values()]

    def new_tally(
        self,
        operation: str,
        failed: bool,
        error_type: type[BaseException] | str | None,
        status: int | None = None,
    ) -> _Tally:
        attributes: dict[str, str | int] = {
            **self.base,
            ATTR_OPERATION: operation,
            ATTR_OUTCOME: "success",
        }
        if failed:
            attributes[ATTR_OUTCOME] = "error" if error_type is None else outcome_of(error_type)
            attributes[ATTR_ERROR_TYPE] = _error_type_name(error_type)
        if status is not None:
            attributes[ATTR_HTTP_STATUS] = status
        return _Tally(attributes)

    def live_histogram(self) -> Any:
        """The histogram, once measurements reach a real one (None: they would be dropped)."""
        histogram = self.histogram = self.instruments.live_histogram()
        return histogram


class _Instruments:
    """One meter provider's instruments, and the call counts of every (store kind, backend).

    The counter is observable: it reports the tallies when the provider collects, so a call
    pays for one synchronous measurement (the histogram's) and an integer increment. A call
    counts only when its measurement reaches a real histogram: instruments of the global
    provider made before the application set it are the API's proxies, which drop what they
    are given until then, and the counter (whose callback the provider calls only once set)
    must not report those calls either, or its count and the histogram's would differ.
    """

    __slots__ = ("_proxy", "counter", "histogram", "kinds")

    def __init__(self, provider: otel_metrics.MeterProvider | None) -> None:
        meter = otel_metrics.get_meter(METER_NAME, _package_version(), meter_provider=provider)
        self.kinds: dict[tuple[str, str], _Kind] = {}
        description = "Duration of tokencapture store operations, as the caller experienced it."
        try:
            histogram = meter.create_histogram(
                DURATION_NAME,
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=BUCKET_BOUNDS_SECONDS,
            )
        except TypeError:  # opentelemetry-api < 1.23 has no bucket advice
            histogram = meter.create_histogram(DURATION_NAME, unit="s", description=description)
        # A proxy (the global provider not set yet) holds its real instrument, None until set;
        # anything else is real.
        self._proxy = histogram
        self.histogram: Any = getattr(histogram, "_real_instrument", histogram)
        self.counter = meter.create_observable_counter(
            COUNTER_NAME,
            callbacks=[self._observe],
            unit="{operation}",
            description="Completed tokencapture store operations, failed ones included.",
        )

    def live_histogram(self) -> Any:
        """The histogram measurements reach (the real one behind a proxy), None while none."""
        histogram = self.histogram
        if histogram is None:
            histogram = self.histogram = getattr(self._proxy, "_real_instrument", None)
        return histogram

    def kind(self, store: str, backend: str) -> _Kind:
        key = (store, backend)
        with _lock:
            found = self.kinds.get(key)
            if found is None:
                found = self.kinds[key] = _Kind(self, store, backend)
            return found

    def _observe(self, options: otel_metrics.CallbackOptions) -> list[otel_metrics.Observation]:
        del options
        with _lock:
            kinds = list(self.kinds.values())
        return [
            otel_metrics.Observation(tally.count, tally.attributes)
            for kind in kinds
            for tally in kind.tallies()
        ]


_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_lock")
_default_provider: otel_metrics.MeterProvider | None = None  # None: the global provider
# id(provider or None) -> (provider, its instruments); kept for the life of the process, so
# is every count (see `_Kind`).
_instruments: dict[int, tuple[object, _Instruments]] = {}
_following_default: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _instruments_for(provider: otel_metrics.MeterProvider | None) -> _Instruments:
    with _lock:
        found = _instruments.get(id(provider))
        if found is not None and found[0] is provider:
            return found[1]
    made = _Instruments(provider)  # outside the lock: a proxy meter may call back into it
    with _lock:
        found = _instruments.get(id(provider))
        if found is not None and found[0] is provider:
            return found[1]
        _instruments[id(provider)] = (provider, made)
        return made


class Recorder:
    """Records one store's (store kind, backend) operations into the OpenTelemetry instruments
    of its provider, and counts them in that provider's tallies of the kind (see `_Kind`)."""

    __slots__ = ("__weakref__", "_backend", "_kind", "_store")

    def __init__(
        self, store: str, backend: str, provider: otel_metrics.MeterProvider | None
    ) -> None:
        self._store = store
        self._backend = backend
        if provider is None:
            with _lock:
                _following_default.add(self)
                provider = _default_provider
        self._kind = _instruments_for(provider).kind(store, backend)

    def _bind(self, instruments: _Instruments) -> None:
        """Record into `instruments` from now on, counting on from that provider's totals."""
        self._kind = instruments.kind(self._store, self._backend)

    @property
    def _lock(self) -> threading.Lock:
        """The lock a call takes (its kind's)."""
        return self._kind.lock

    def tallies(self) -> list[_Tally]:
        return self._kind.tallies()

    def record(
        self,
        operation: str,
        seconds: float,
        failed: bool,
        error_type: type[BaseException] | str | None,
        status: int | None = None,
    ) -> None:
        """One call of `operation` took `seconds` (`failed`: it raised `error_type`;
        `status`: the HTTP status it answered, for a gateway call)."""
        kind = self._kind
        histogram = kind.histogram
        if histogram is None:
            histogram = kind.live_histogram()
            if histogram is None:  # the global provider is not set: nothing would see it
                return
        if not failed:
            success_key = (operation, status)
            tally = kind.successes.get(success_key)
            if tally is None:
                made = kind.new_tally(operation, False, None, status)
                tally = kind.successes.setdefault(success_key, made)
        else:
            key = (operation, error_type, status)
            tally = kind.failures.get(key)
            if tally is None:
                made = kind.new_tally(operation, True, error_type, status)
                tally = kind.failures.setdefault(key, made)
        with kind.lock:
            tally.count += 1
        histogram.record(seconds, tally.attributes)


_recorders: dict[tuple[str, str], Recorder] = {}


def recorder(store: str, backend: str, provider: Any = None) -> Recorder:
    """The recorder of (store, backend): shared when it follows the default provider."""
    if provider is not None:
        return Recorder(store, backend, provider)
    key = (store, backend)
    found = _recorders.get(key)
    if found is None:
        found = _recorders.setdefault(key, Recorder(store, backend, None))
    return found


def use_meter_provider(provider: Any) -> None:
    """Record every recorder that follows the default into `provider` (None: the global one)."""
    global _default_provider
    instruments = _instruments_for(provider)
    with _lock:
        _default_provider = provider
        following = list(_following_default)
    for each in following:
        each._bind(instruments)
