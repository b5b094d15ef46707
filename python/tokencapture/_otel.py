"""OpenTelemetry instruments for store operations (only imported when `opentelemetry-api` is).

`tokencapture.metrics` imports this module on first use and only when the
`opentelemetry.metrics` import succeeds, so a process without the package imports nothing of
OpenTelemetry and records nothing. Every store operation is one measurement of the duration
histogram and one increment of an in-process tally that the observable operation counter
reports at collection, both with the same attributes.

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


def outcome_of(error_type: type[BaseException] | None) -> str:
    """The `tokencapture.outcome` value of an operation that raised `error_type` (None: ok)."""
    if error_type is None:
        return "success"
    for cls in error_type.__mro__:
        outcome = _OUTCOME_BY_CLASS.get(cls.__name__)
        if outcome is not None:
            return outcome
    return "error"


def _error_type_name(error_type: type[BaseException] | None) -> str:
    """OpenTelemetry's `error.type`: the exception's qualified class name (`_OTHER` unknown)."""
    if error_type is None:
        return "_OTHER"
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

    def __init__(self, attributes: Mapping[str, str]) -> None:
        self.attributes = attributes
        self.count = 0


class _Instruments:
    """One meter provider's instruments, and the recorders that record into them.

    The counter is observable: it reports the recorders' tallies when the provider collects,
    so a call pays for one synchronous measurement (the histogram's) and an integer increment.
    """

    __slots__ = ("counter", "histogram", "recorders")

    def __init__(self, provider: otel_metrics.MeterProvider | None) -> None:
        meter = otel_metrics.get_meter(METER_NAME, _package_version(), meter_provider=provider)
        self.recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()
        description = "Duration of tokencapture store operations, as the caller experienced it."
        try:
            self.histogram = meter.create_histogram(
                DURATION_NAME,
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=BUCKET_BOUNDS_SECONDS,
            )
        except TypeError:  # opentelemetry-api < 1.23 has no bucket advice
            self.histogram = meter.create_histogram(
                DURATION_NAME, unit="s", description=description
            )
        self.counter = meter.create_observable_counter(
            COUNTER_NAME,
            callbacks=[self._observe],
            unit="{operation}",
            description="Completed tokencapture store operations, failed ones included.",
        )

    def _observe(self, options: otel_metrics.CallbackOptions) -> list[otel_metrics.Observation]:
        del options
        totals: dict[tuple[tuple[str, str], ...], list[Any]] = {}
        with _lock:
            recorders = list(self.recorders)
        for recorder in recorders:
            for tally in recorder.tallies():
                key = tuple(sorted(tally.attributes.items()))
                found = totals.get(key)
                if found is None:
                    totals[key] = [tally.attributes, tally.count]
                else:
                    found[1] += tally.count
        return [
            otel_metrics.Observation(count, attributes) for attributes, count in totals.values()
        ]


_lock = threading.Lock()
renew_after_fork(sys.modules[__name__], "_lock")
_default_provider: otel_metrics.MeterProvider | None = None  # None: the global provider
_instruments: dict[int, tuple[object, _Instruments]] = {}  # id(provider or None) -> instruments
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
    """Records one store's (store kind, backend) operations into the OpenTelemetry instruments."""

    __slots__ = ("__weakref__", "_base", "_failures", "_lock", "_successes", "histogram")

    def __init__(
        self, store: str, backend: str, provider: otel_metrics.MeterProvider | None
    ) -> None:
        self._base = {ATTR_STORE: store, ATTR_BACKEND: backend}
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")
        self._successes: dict[str, _Tally] = {}
        self._failures: dict[tuple[str, type[BaseException] | None], _Tally] = {}
        if provider is None:
            with _lock:
                _following_default.add(self)
                provider = _default_provider
        self._bind(_instruments_for(provider))

    def _bind(self, instruments: _Instruments) -> None:
        """Record into `instruments` from now on; the counts start again from zero there."""
        with _lock:
            for each in _instruments.values():
                each[1].recorders.discard(self)
            instruments.recorders.add(self)
        with self._lock:
            self._successes = {}
            self._failures = {}
            self.histogram = instruments.histogram

    def tallies(self) -> list[_Tally]:
        with self._lock:
            return [*self._successes.values(), *self._failures.values()]

    def _new_tally(
        self, operation: str, failed: bool, error_type: type[BaseException] | None
    ) -> _Tally:
        attributes = {**self._base, ATTR_OPERATION: operation, ATTR_OUTCOME: "success"}
        if failed:
            attributes[ATTR_OUTCOME] = "error" if error_type is None else outcome_of(error_type)
            attributes[ATTR_ERROR_TYPE] = _error_type_name(error_type)
        return _Tally(attributes)

    def record(
        self,
        operation: str,
        seconds: float,
        failed: bool,
        error_type: type[BaseException] | None,
    ) -> None:
        """One call of `operation` took `seconds` (`failed`: it raised `error_type`)."""
        if not failed:
            tally = self._successes.get(operation)
            if tally is None:
                tally = self._successes.setdefault(
                    operation, self._new_tally(operation, False, None)
                )
        else:
            key = (operation, error_type)
            tally = self._failures.get(key)
            if tally is None:
                tally = self._failures.setdefault(key, self._new_tally(operation, True, error_type))
        with self._lock:
            tally.count += 1
            histogram = self.histogram
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
