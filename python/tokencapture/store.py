"""`TokenCaptureStore`: the durable, rollout-keyed JSONL store, backed by the Rust core.

The Python side turns an entry into its canonical line (orjson, sorted keys) once; the native
store does everything else with the GIL released: per-rollout flock, tail reconciliation,
payload digests, append + fdatasync, the state index, fences. The hot async writes (put,
begin_call, mark_incomplete) run on the native worker pool and complete through a batched
event-loop reader; the rest (freeze, drop, retire, delete), which build Python objects, run on
a thread pool. Either way the event loop never waits on a disk.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import perf_counter
from time import time as wall_time
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

import orjson
from pydantic import BaseModel

from tokencapture import _core
from tokencapture.descriptors import check_max_open_files, descriptor_stats
from tokencapture import columnar as _columnar
from tokencapture.metrics import Metrics, Timed
from tokencapture.protocols import (
    RolloutRemovalPayload,
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureSnapshot,
)
from tokencapture.records import (
    BOOL_FIELDS,
    INT_FIELDS,
    OPTIONAL_INT_FIELDS,
    OPTIONAL_TEXT_FIELDS,
    REQUIRED_FIELDS,
    STATUS_VALUES,
    TEXT_FIELDS,
    ParentResolutionStatus,
    TokenEntry,
    check_entry_invariants,
)

__all__ = [
    "TokenCaptureStore",
    "canonical_line",
    "make_token_store",
    "validate_rollout_id",
    "validate_rollout_ids",
]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Threads for the lifecycle calls (created on demand): enough that the fsyncs of freezes and
# retirements of different rollouts overlap, since the disk rewards concurrency.
_IO_THREADS = 64
_executor: ThreadPoolExecutor | None = None
_executor_pid = 0
_executor_lock = threading.Lock()


def _io_executor() -> ThreadPoolExecutor:
    """The process-wide pool for blocking store calls (recreated in a forked child)."""
    global _executor, _executor_pid
    pid = os.getpid()
    if _executor is None or _executor_pid != pid:
        with _executor_lock:
            if _executor is None or _executor_pid != pid:
                _executor = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="tokencapture-io")
                _executor_pid = pid
    return _executor


async def _off_loop(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run a blocking call that builds Python objects (freeze, batches) on the thread pool."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_io_executor(), lambda: func(*args, **kwargs))


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


def _native_job(start: Callable[..., None], *args: object) -> asyncio.Future[Any]:
    """Start `start(completions, token, *args)` on the worker pool; a future for its result.

    A cancelled await does not stop the job: a durable write either completes or fails whole.
    """
    loop = asyncio.get_running_loop()
    bridge = _bridges.get(loop)
    if bridge is None:
        bridge = _bridges[loop] = _LoopBridge(loop)
    token = next(bridge.tokens)
    future = loop.create_future()
    bridge.futures[token] = future
    try:
        start(bridge.completions, token, *args)
    except BaseException:
        del bridge.futures[token]
        raise
    return future


def validate_rollout_id(rollout_id: str) -> str:
    """Reject anything that could escape the store directory or index a bad file."""
    if not isinstance(rollout_id, str):
        raise TypeError(f"rollout_id must be a str, not {type(rollout_id).__name__}")
    _core.validate_rollout_id(rollout_id)
    return rollout_id


def validate_rollout_ids(rollout_ids: Sequence[str]) -> list[str]:
    """Validate a whole batch before anything changes, and drop duplicates (first order kept).

    A bare string is rejected (`TypeError`): it is a sequence of one-character rollout ids, and
    NeMo Gym 0.7.0's synchronous `delete(rollout_id)` would otherwise silently do nothing.
    """
    return validated_batch(rollout_ids, validate_rollout_id)


def validated_batch(rollout_ids: Sequence[str], validate_one: Callable[[str], str]) -> list[str]:
    """`validate_rollout_ids` with the check of one id given (the reference store's is Python)."""
    if isinstance(rollout_ids, str | bytes):
        raise TypeError(
            f"rollout_ids must be a sequence of rollout ids, not a single string "
            f"({rollout_ids!r}); pass [{rollout_ids!r}]. NeMo Gym 0.7.0's synchronous "
            "store.delete(rollout_id) is store.delete_now([rollout_id]) here"
        )
    if not isinstance(rollout_ids, Iterable):
        raise TypeError(
            f"rollout_ids must be a sequence of rollout ids, not {type(rollout_ids).__name__}"
        )
    return list(dict.fromkeys(validate_one(rollout_id) for rollout_id in rollout_ids))


def check_snapshot_id(snapshot_id: object) -> str:
    """A snapshot id is a str (`TypeError` otherwise)."""
    if not isinstance(snapshot_id, str):
        raise TypeError(f"snapshot_id must be a str, not {type(snapshot_id).__name__}")
    return snapshot_id


# What readers strip from both ends of an intents line (`bytes.strip()`, as NeMo Gym reads them).
_LINE_SPACE = " \t\n\x0b\x0c\r"


def check_call_id(call_id: object) -> str:
    """A call id must be one line of the intents file: non-empty, no line break, UTF-8, and
    without the surrounding whitespace readers strip (`TypeError` / `ValueError`)."""
    if (
        type(call_id) is str
        and call_id.isascii()
        and call_id.isprintable()  # printable ASCII: no line break, tab or surrogate
        and call_id[:1] != " "
        and call_id[-1:] != " "
        and call_id
    ):
        return call_id
    if not isinstance(call_id, str):
        raise TypeError(f"model_call_id must be a str, not {type(call_id).__name__}")
    if not call_id:
        raise ValueError("model_call_id must not be empty")
    if "\n" in call_id or "\r" in call_id:
        raise ValueError(f"model_call_id {call_id!r} contains a line break")
    if call_id != call_id.strip(_LINE_SPACE):
        raise ValueError(
            f"model_call_id {call_id!r} starts or ends with whitespace, which readers of the "
            "intents file strip: its intent would not match its entry"
        )
    try:
        call_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("model_call_id must be valid Unicode text (no lone surrogates)") from None
    return call_id


def _as_token_entry(entry: object) -> TokenEntry:
    if isinstance(entry, TokenEntry):
        return entry
    if isinstance(entry, BaseModel):
        # A foreign model with the same fields (NeMo Gym's own TokenEntry): revalidate its
        # Python-mode values so nothing (NaN included) is converted before our checks. Its
        # serializer is not asked to judge the values (`warnings=False`): NeMo Gym's
        # `commit_entry` stamps a resolver's status onto its entry unvalidated, so with our
        # resolver its enum field holds our `ParentResolutionStatus`, which its dump would warn
        # about; the validation below checks every value anyway.
        return TokenEntry.model_validate(entry.model_dump(warnings=False))
    if isinstance(entry, Mapping):
        return TokenEntry.model_validate(dict(entry))
    raise TypeError(
        "expected a TokenEntry, a pydantic model with TokenEntry's fields, or a dict; "
        f"got {type(entry).__name__}"
    )


# The type rules of TokenEntry's fields, checked natively (see `records.check_field_types`).
_ENTRY_FIELDS = _core.EntryFields(
    required=REQUIRED_FIELDS,
    text=TEXT_FIELDS,
    optional_text=OPTIONAL_TEXT_FIELDS,
    ints=INT_FIELDS,
    optional_ints=OPTIONAL_INT_FIELDS,
    bools=BOOL_FIELDS,
    statuses=sorted(STATUS_VALUES),
)


# A record that holds exactly the model's fields (what every current writer stores) becomes an
# entry by setting the four attributes `model_construct` would set, in its field order: ~1 us
# instead of ~10 us per entry, a few percent of a freeze. Anything else (older records missing
# defaulted fields, extra keys) goes through `model_construct`. tests/test_entry_fields.py
# checks both give identical entries, so a pydantic upgrade that changes them is caught.
_FIELD_ORDER = tuple(TokenEntry.model_fields)
_FIELD_SET = frozenset(_FIELD_ORDER)
_FAST_CONSTRUCT = (
    not TokenEntry.__private_attributes__ and TokenEntry.model_config.get("extra") == "allow"
)
_set_attribute = object.__setattr__


def _entry_from_record(record: dict[str, Any]) -> TokenEntry:
    """Build an entry from a decoded, digest-verified record without a second full validation
    (the field type checks and the model's invariants still run; the decoder already checked
    the token arrays)."""
    _ENTRY_FIELDS.check(record)
    status = record.get("parent_resolution")
    if status is not None:
        record["parent_resolution"] = ParentResolutionStatus(status)
    if _FAST_CONSTRUCT and record.keys() == _FIELD_SET:
        entry = TokenEntry.__new__(TokenEntry)
        _set_attribute(entry, "__dict__", {name: record[name] for name in _FIELD_ORDER})
        _set_attribute(entry, "__pydantic_fields_set__", set(_FIELD_ORDER))
        _set_attribute(entry, "__pydantic_extra__", {})
        _set_attribute(entry, "__pydantic_private__", None)
    else:
        entry = TokenEntry.model_construct(**record)
    check_entry_invariants(entry)
    return entry


def entries_from_records(
    records: Sequence[dict[str, Any]], offsets: Sequence[int], where: str
) -> tuple[TokenEntry, ...]:
    """Entries from natively decoded records (any backend); a record that is not a valid entry
    is corruption, reported with `where` (the log) and the line's byte offset."""
    entries = []
    for record, offset in zip(records, offsets, strict=True):
        try:
            entries.append(_entry_from_record(record))
        except ValueError as exc:
            raise TokenCaptureCorruptionError(
                f"{where}: the line is not a valid entry: {exc} (byte offset {offset})"
            ) from exc
    return tuple(entries)


def canonical_line(entry: TokenEntry) -> bytes:
    """The stored form of an entry: `orjson.dumps(model_dump(mode="json"), OPT_SORT_KEYS)`.

    Raises `ValueError`, before anything is written, for an entry that would not read back
    (a value of the wrong type, a non-finite float, an integer beyond 64 bits, a non-string
    key, nesting deeper than readers accept).
    """
    values = dict(entry.__dict__)
    if entry.__pydantic_extra__:
        values.update(entry.__pydantic_extra__)
    status = values.get("parent_resolution")
    if status is not None:
        values["parent_resolution"] = str(status.value if hasattr(status, "value") else status)
    try:
        # One native call: the field types, then a walk for non-finite floats, nesting and
        # token-array item types. It also says whether every value is plain JSON, which orjson
        # serializes exactly as pydantic's JSON mode would, without a second copy of the arrays.
        plain = _ENTRY_FIELDS.check(values, deep=True)
        check_entry_invariants(entry)
    except ValueError as exc:
        raise ValueError(f"entry {values.get('model_call_id')!r} cannot be stored: {exc}") from exc
    try:
        payload = values if plain else entry.model_dump(mode="json")
        return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError) as exc:
        raise ValueError(
            f"entry {entry.model_call_id!r} of rollout {entry.rollout_id!r} cannot be stored as "
            f"JSON that reads back: {exc}"
        ) from exc


def _marker_line(model_call_id: object) -> bytes:
    """One line for the incomplete file, whatever the call id holds (it must never fail)."""
    text = model_call_id if isinstance(model_call_id, str) else str(model_call_id)
    if "\n" not in text and "\r" not in text:
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            pass
    return json.dumps(text).encode("ascii")


def _log_failure(name: str, rollout_id: object, exc: BaseException) -> None:
    """Log the failures an operator must see (fenced refusals only at debug level)."""
    if isinstance(exc, TokenCaptureFrozenError):
        logger.debug("%s refused for fenced rollout %r", name, rollout_id)
    elif isinstance(exc, TokenCaptureConflictError):
        logger.warning("%s: %s", name, exc)
    elif isinstance(exc, TokenCaptureCorruptionError):
        logger.error("%s of rollout %r found corruption: %s", name, rollout_id, exc)
    elif isinstance(exc, OSError):
        logger.warning("%s of rollout %r failed: %s", name, rollout_id, exc)


class _Operation(Timed):
    """`Timed`, plus a log record for the failures an operator must see."""

    __slots__ = ("rollout_id",)

    def __init__(self, metrics: Metrics, name: str, rollout_id: object) -> None:
        super().__init__(metrics, name)
        self.rollout_id = rollout_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, traceback)
        if exc is not None:
            _log_failure(self.operation, self.rollout_id, exc)


class TokenCaptureStore:
    """Durable, rollout-keyed JSONL sink and source for `TokenEntry` records.

    Safe to share between threads, and between processes that open the same directory.

    Between operations the store keeps up to three descriptors for each of at most
    `cached_rollouts` recently used rollouts, within the process's descriptor budget (a
    sixteenth of the soft `RLIMIT_NOFILE` by default, shared by every store of the process;
    `TOKENCAPTURE_MAX_OPEN_FILES` sets it) and, if given, at most `max_open_files` of its own
    (0 keeps none). See docs/reliability.md, "Descriptor budget".
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        cached_rollouts: int = 128,
        max_open_files: int | None = None,
    ) -> None:
        check_max_open_files(max_open_files)
        self._root = Path(root)
        self._native = _core.Store(os.fspath(self._root), cached_rollouts, max_open_files)
        self._metrics = Metrics()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-operation counts, failures and latency histograms (see `tokencapture.metrics`),
        and under `"descriptors"` the descriptors this store keeps open (`open_files`), its
        own cap (`max_open_files`, None without one) and the process-wide budget's counters
        (`process_*`: see `descriptor_stats`)."""
        stats = self._metrics.snapshot()
        stats["descriptors"] = descriptor_stats(self._native)
        return stats

    def _operation(self, name: str, rollout_id: object) -> _Operation:
        """Time one operation and log the failures an operator must see."""
        return _Operation(self._metrics, name, rollout_id)

    def __repr__(self) -> str:
        return f"TokenCaptureStore({os.fspath(self._root)!r})"

    @property
    def root(self) -> Path:
        return self._root

    # Paths -------------------------------------------------------------------------------

    def _file(self, rollout_id: str, suffix: str) -> Path:
        return self._root / f"{validate_rollout_id(rollout_id)}.tokens.{suffix}"

    def path_for(self, rollout_id: str) -> Path:
        return self._file(rollout_id, "jsonl")

    def state_path_for(self, rollout_id: str) -> Path:
        return self._file(rollout_id, "state.json")

    def intents_path_for(self, rollout_id: str) -> Path:
        """The durable per-call intent file."""
        return self._file(rollout_id, "intents")

    def incomplete_path_for(self, rollout_id: str) -> Path:
        """Sentinel marking that at least one call of this rollout failed to capture."""
        return self._file(rollout_id, "incomplete")

    def lock_path_for(self, rollout_id: str) -> Path:
        return self._file(rollout_id, "lock")

    # Writes ------------------------------------------------------------------------------

    # The two puts time themselves inline rather than through `_operation`: a context manager
    # costs ~5 us of Python calls per put, the inline form ~1.5 us (same figures, same logs).

    def append(self, entry: TokenEntry) -> None:
        """Idempotently append one entry and fsync it before returning."""
        started = perf_counter()
        try:
            token_entry = _as_token_entry(entry)
            line = canonical_line(token_entry)
            self._native.put(token_entry.rollout_id, token_entry.model_call_id, line)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Store an entry durably without blocking the event loop (`await store.put(entry)`).

        The entry is checked and its canonical line built when `put` is called, so a bad
        entry raises then, awaited or not; the lock, append and fsync run natively on the
        worker pool when the returned coroutine is awaited.
        """
        started = perf_counter()
        try:
            token_entry = _as_token_entry(entry)
            line = canonical_line(token_entry)  # the field types, rollout_id a str included
            _core.validate_rollout_id(token_entry.rollout_id)
            check_call_id(token_entry.model_call_id)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        if type(self).append is not TokenCaptureStore.append:
            # A subclass that overrides `append` (NeMo Gym's store awaits `append` in a thread
            # from `put`, and subclasses rely on that) gets its own `append` here too.
            return _off_loop(self.append, token_entry)
        return self._put_line(token_entry, line, started)

    async def _put_line(self, entry: TokenEntry, line: bytes, started: float) -> None:
        try:
            await _native_job(self._native.submit_put, entry.rollout_id, entry.model_call_id, line)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)

    def _refused(self, name: str, rollout_id: object, exc: BaseException) -> None:
        """Count and log a call refused before it started."""
        self._metrics.observe(name, 0.0, failed=True)
        _log_failure(name, rollout_id, exc)

    def _put_failed(self, entry: object, exc: BaseException, started: float) -> None:
        self._metrics.observe("put", perf_counter() - started, failed=True)
        _log_failure("put", getattr(entry, "rollout_id", None), exc)

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Synchronous `begin_call` (the reference's name)."""
        with self._operation("begin_call", rollout_id):
            self._native.begin_call(rollout_id, model_call_id)

    def begin_call(self, rollout_id: str, model_call_id: str) -> Coroutine[Any, Any, None]:
        """Durably record that a captured call is about to be dispatched.

        An intent with no entry at freeze masks the rollout. The ids are checked when this is
        called (`TypeError` / `ValueError`), the intent is written when it is awaited.
        """
        try:
            validate_rollout_id(rollout_id)
            check_call_id(model_call_id)
        except BaseException as exc:
            self._refused("begin_call", rollout_id, exc)
            raise
        return self._begin_call_job(rollout_id, model_call_id)

    async def _begin_call_job(self, rollout_id: str, model_call_id: str) -> None:
        with self._operation("begin_call", rollout_id):
            await _native_job(self._native.submit_begin_call, rollout_id, model_call_id)

    def _mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Synchronous `mark_incomplete` (the reference's name)."""
        with self._operation("mark_incomplete", rollout_id):
            self._native.mark_incomplete(rollout_id, _marker_line(model_call_id))

    def mark_incomplete(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, None]:
        """Durably record that a call was lost (allowed after freeze, refused after retire).

        The rollout id is checked when this is called; any call id is accepted.
        """
        try:
            validate_rollout_id(rollout_id)
        except BaseException as exc:
            self._refused("mark_incomplete", rollout_id, exc)
            raise
        return self._mark_incomplete_job(rollout_id, _marker_line(model_call_id))

    async def _mark_incomplete_job(self, rollout_id: str, line: bytes) -> None:
        with self._operation("mark_incomplete", rollout_id):
            await _native_job(self._native.submit_mark_incomplete, rollout_id, line)

    # Reads and lifecycle -----------------------------------------------------------------

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Synchronously freeze one rollout and return its stable snapshot."""
        with self._operation("freeze", rollout_id):
            records, incomplete, snapshot_id, version = self._native.freeze(rollout_id)
            entries = self._entries(rollout_id, *records)
            return TokenCaptureSnapshot(rollout_id, entries, incomplete, snapshot_id, version)

    def _entries(
        self, rollout_id: str, records: list[dict[str, Any]], offsets: list[int]
    ) -> tuple[TokenEntry, ...]:
        return entries_from_records(records, offsets, str(self.path_for(rollout_id)))

    def freeze(self, rollout_id: str) -> Coroutine[Any, Any, TokenCaptureSnapshot]:
        """Freeze the rollout off the event loop (the id is checked when this is called)."""
        validate_rollout_id(rollout_id)
        return _off_loop(self.freeze_now, rollout_id)

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """The stored entries (a torn tail is ignored; nothing is created or changed)."""
        return list(self._entries(rollout_id, *self._native.read_lines(rollout_id)))

    def is_incomplete(self, rollout_id: str) -> bool:
        return self._native.is_incomplete(rollout_id)

    # Columnar reads (tokencapture.columnar) -----------------------------------------------

    def freeze_columns_now(self, rollout_id: str) -> _columnar.ColumnarSnapshot:
        """`freeze_now`, with the entries as Arrow columns instead of `TokenEntry` objects."""
        with self._operation("freeze_columns", rollout_id):
            try:
                entries, incomplete, snapshot_id, version = _core.freeze_columns(
                    self._native, rollout_id
                )
            except _core.ColumnarRecordError as exc:
                raise _columnar._refusal(
                    exc,
                    self.path_for(rollout_id),
                    lambda: self._entries(rollout_id, *self._native.freeze(rollout_id)[0]),
                ) from None
            return _columnar.ColumnarSnapshot(rollout_id, entries, incomplete, snapshot_id, version)

    def freeze_columns(self, rollout_id: str) -> Coroutine[Any, Any, _columnar.ColumnarSnapshot]:
        """`freeze`, with the entries as Arrow columns (validates `rollout_id` when called)."""
        validate_rollout_id(rollout_id)
        return _off_loop(self.freeze_columns_now, rollout_id)

    def read_columns(self, rollout_id: str) -> _columnar.ColumnarEntries:
        """`read_entries` as Arrow columns (a torn tail is ignored; nothing changes)."""
        try:
            return _core.read_columns(self._native, rollout_id)
        except _core.ColumnarRecordError as exc:
            raise _columnar._refusal(
                exc, self.path_for(rollout_id), lambda: self.read_entries(rollout_id)
            ) from None

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Synchronous `drop` (the reference's name)."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**64:
            return False  # no stored version can equal it
        with self._operation("drop", rollout_id):
            return self._native.drop_snapshot(rollout_id, snapshot_id, version)

    def drop(self, rollout_id: str, snapshot_id: str, version: int) -> Coroutine[Any, Any, bool]:
        """Delete the consumed snapshot's records and keep its fence, if nothing changed.

        The rollout id and the snapshot id's type are checked when this is called.
        """
        validate_rollout_id(rollout_id)
        check_snapshot_id(snapshot_id)
        return _off_loop(self._drop, rollout_id, snapshot_id, version)

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `retire`: fence every rollout durably, then remove their records."""
        ids = validate_rollout_ids(rollout_ids)
        with self._operation("retire", ids):
            removed, absent = self._native.retire(ids)
        return {"removed": removed, "absent": absent}

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and keep a fence, whatever their state.

        The batch is validated when this is called (a bare string is a `TypeError`).
        """
        ids = validate_rollout_ids(rollout_ids)
        return _off_loop(self.retire_now, ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `delete`: remove records, fences and lock files."""
        ids = validate_rollout_ids(rollout_ids)
        with self._operation("delete", ids):
            removed, absent = self._native.delete(ids)
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and fences, so a reused id starts empty.

        The batch is validated when this is called. NeMo Gym 0.7.0's `delete(rollout_id)` was
        synchronous and took one id; called that way here it raises `TypeError` at once (a
        bare string), instead of building a coroutine that never runs: use
        `delete_now([rollout_id])`.
        """
        ids = validate_rollout_ids(rollout_ids)
        return _off_loop(self.delete_now, ids)

    def sweep_retired(self, older_than_seconds: float) -> int:
        """NeMo Gym 0.7.0's `sweep_retired`: remove the fences (state, lock, intents and
        incomplete files) of rollouts retired at least `older_than_seconds` ago (by the state
        file's modification time), and return how many were removed. Synchronous, as NeMo
        Gym's is. Rollouts that are not retired are never touched."""
        if isinstance(older_than_seconds, bool) or not isinstance(older_than_seconds, int | float):
            raise TypeError(
                f"older_than_seconds must be a number, not {type(older_than_seconds).__name__}"
            )
        cutoff = wall_time() - older_than_seconds
        suffix = ".tokens.state.json"
        retired = []
        for state_path in self.root.glob(f"*{suffix}"):
            rollout_id = state_path.name[: -len(suffix)]
            try:
                _core.validate_rollout_id(rollout_id)
                if state_path.stat().st_mtime > cutoff:
                    continue
                state = orjson.loads(state_path.read_bytes() or b"{}")
            except (OSError, ValueError):
                continue  # not a rollout's state, or gone meanwhile
            if isinstance(state, dict) and state.get("retired") is True:
                retired.append(rollout_id)
        if not retired:
            return 0
        return len(self.delete_now(retired)["removed"])

    def inspect(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's state as a reader sees it, or None when it has no files.

        Read-only: every indexed line is checked against its payload digest (a mismatch raises
        `TokenCaptureCorruptionError`) and the unindexed tail is folded in, as freeze would.
        The state index's keys plus `entry_count` (unique records in the log).
        """
        found = self._native.inspect(rollout_id)
        if found is None:
            return None
        raw, entry_count = found
        return {**orjson.loads(raw), "entry_count": entry_count}

    async def close(self) -> None:
        """Close the descriptors the store keeps between operations (nothing to flush; the
        store stays usable and reopens what it needs)."""
        self._native.clear()


def make_token_store(global_config_dict: Any) -> TokenCaptureStore | None:
    """Build the training-token file store from a NeMo Gym global config.

    Reads `token_id_capture.{enabled, dir, sink}`, falling back to a top-level
    `model_call_capture_dir`. Returns None when capture is disabled, when a custom sink owns
    the records, or when no directory resolves. A relative directory is a `ValueError`.
    """
    config = global_config_dict if global_config_dict is not None else {}
    capture = config.get("token_id_capture") or {}
    if not capture.get("enabled", True):
        return None
    if capture.get("sink"):
        return None
    directory = capture.get("dir") or config.get("model_call_capture_dir")
    if not directory:
        return None
    path = Path(os.fspath(directory)).expanduser()
    if not path.is_absolute():
        raise ValueError(f"token capture directory must be absolute, got {os.fspath(directory)!r}")
    return TokenCaptureStore(path)
