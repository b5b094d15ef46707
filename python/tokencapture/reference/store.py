"""The pure-Python reference `TokenCaptureStore`.

Same public API, semantics and files as the Rust-backed `tokencapture.store.TokenCaptureStore`
(SPEC section 3), so either can continue a directory the other wrote. Its write path follows
NeMo Gym 0.7.0's design, which makes it the honest baseline of the benchmarks:

* every put appends its canonical line and newline in one write and `os.fsync`s the log;
* every put then rewrites the state index with an atomic replace (`R.tokens.state.json.tmp`,
  rename) that is *not* fsynced: the index is reconstructible from the log;
* lifecycle transitions (conflict, mark_incomplete, freeze, drop, retire) fsync the state and
  the directory.

Recovery rules (shared with the Rust store): log bytes past the state's `indexed_size` are an
acknowledged tail that is folded in (each new call id bumps the version, the same id with the
same payload digest is a no-op, with a different digest it marks the rollout incomplete and
bumps the version). A final line without its newline was never acknowledged: readers ignore it
and writers truncate it under the exclusive lock. A newline-terminated line that is not a JSON
object with a string `model_call_id` raises `TokenCaptureCorruptionError` naming the file and
the byte offset. Freeze verifies every indexed line against its payload digest.

Input handling follows the same rules as `tokencapture.store` (and shares its pure-Python
parts: entry coercion, the field type checks, call ids, batches of rollout ids, marker lines),
so both stores raise the same errors and write the same bytes; the checks that the Rust-backed
store runs natively (rollout ids, token arrays, non-finite floats and nesting) are written out
in Python here, so nothing on this store's path calls the native module.

Where the differential tests showed the Rust store straying from the specification, this store
keeps to it (tests/test_differential.py marks those cases): `retire` fences the state a reader
sees (log folded in, as `drop` does), `drop` answers False for any version that is not the
current one, and every acknowledged line is parsed as JSON, so a line that is not JSON is
corruption wherever it is read.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from tokencapture.entries import as_token_entry, marker_line
from tokencapture.metrics import instrumented
from tokencapture.protocols import (
    RolloutRemovalPayload,
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from tokencapture.records import TokenEntry, check_entry_invariants, check_field_types
from tokencapture.rollout_files import RolloutFiles
from tokencapture.validation import (
    LINE_SPACE,
    check_call_id,
    check_snapshot_id,
    validated_batch,
)

__all__ = ["TokenCaptureStore"]

_FILE_MODE = 0o666
_U64_MAX = 2**64 - 1
_MAX_ROLLOUT_ID_LEN = 200
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._-]+")
_MAX_JSON_DEPTH = 128


def validate_rollout_id(rollout_id: str) -> str:
    """The Rust-backed store's rollout-id rules, in Python."""
    if not isinstance(rollout_id, str):
        raise TypeError(f"rollout_id must be a str, not {type(rollout_id).__name__}")
    if not rollout_id:
        raise ValueError("rollout_id must not be empty")
    if len(rollout_id.encode("utf-8", "surrogatepass")) > _MAX_ROLLOUT_ID_LEN:
        raise ValueError(
            f"rollout_id is {len(rollout_id)} characters long; at most "
            f"{_MAX_ROLLOUT_ID_LEN} fit in the file names"
        )
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        bad = next(c for c in rollout_id if not _ROLLOUT_ID.fullmatch(c))
        raise ValueError(
            f"rollout_id {rollout_id!r} contains {bad!r}; only ASCII letters, digits, '.', '_' "
            "and '-' are allowed"
        )
    return rollout_id


def validate_rollout_ids(rollout_ids: Sequence[str]) -> list[str]:
    """Validate a whole batch first and drop duplicates; a bare string is refused."""
    return validated_batch(rollout_ids, validate_rollout_id)


_TOKEN_ARRAYS = ("prompt_token_ids", "generation_token_ids")


def _check_list_items(name: str, items: object, accept: tuple[type, ...], what: str) -> None:
    """Every item's type is one of `accept` (bools never count as numbers)."""
    if not isinstance(items, list):
        raise ValueError(f"{name} must be a list, got {type(items).__name__}")
    kinds = set(map(type, items))
    if all(issubclass(kind, accept) and not issubclass(kind, bool) for kind in kinds):
        return
    for index, item in enumerate(items):
        if not isinstance(item, accept) or isinstance(item, bool):
            raise ValueError(f"{name}.{index} must be {what}, got {type(item).__name__}")


def _check_json_value(value: object, path: str, depth: int) -> None:
    """Refuse non-finite floats and nesting deeper than readers accept."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{path} is {value}: JSON cannot carry non-finite floats, so the entry would "
                "not read back"
            )
        return
    if isinstance(value, list | tuple):
        if depth > _MAX_JSON_DEPTH:
            raise ValueError(f"{path} is nested deeper than {_MAX_JSON_DEPTH} levels")
        kinds = set(map(type, value))
        if kinds <= {int, str, bool, type(None)}:
            return  # a token array: nothing inside can be non-finite or nested
        if kinds == {float} and all(map(math.isfinite, value)):
            return  # log-probs: one C loop instead of a call per item
        for index, item in enumerate(value):
            _check_json_value(item, f"{path}.{index}", depth + 1)
    elif isinstance(value, dict):
        if depth > _MAX_JSON_DEPTH:
            raise ValueError(f"{path} is nested deeper than {_MAX_JSON_DEPTH} levels")
        for key, item in value.items():
            _check_json_value(item, f"{path}.{key}", depth + 1)


def canonical_line(entry: TokenEntry) -> bytes:
    """`orjson.dumps(entry.model_dump(mode="json"), OPT_SORT_KEYS)`, the format's definition,
    refused with `ValueError` before anything is written when it would not read back."""
    values = dict(entry.__dict__)
    if entry.__pydantic_extra__:
        values.update(entry.__pydantic_extra__)
    status = values.get("parent_resolution")
    if status is not None:
        values["parent_resolution"] = str(getattr(status, "value", status))
    try:
        check_field_types(values)
        for name in _TOKEN_ARRAYS:
            _check_list_items(name, values[name], (int,), "an int")
        _check_list_items(
            "generation_log_probs", values["generation_log_probs"], (int, float), "a float"
        )
        check_entry_invariants(entry)
        for name, value in values.items():
            if name not in _TOKEN_ARRAYS:  # just checked: plain ints
                _check_json_value(value, name, 1)
    except ValueError as exc:
        raise ValueError(f"entry {values.get('model_call_id')!r} cannot be stored: {exc}") from exc
    try:
        return orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError) as exc:
        raise ValueError(
            f"entry {entry.model_call_id!r} of rollout {entry.rollout_id!r} cannot be stored as "
            f"JSON that reads back: {exc}"
        ) from exc


def _corrupt(path: Path, offset: int, detail: str) -> TokenCaptureCorruptionError:
    return TokenCaptureCorruptionError(f"{path}: {detail} (byte offset {offset})")


def _payload_digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _is_hex_digest(text: object) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


# The state index ---------------------------------------------------------------------------


@dataclass(slots=True)
class _State:
    """`R.tokens.state.json`: lifecycle flags, snapshot, version and the entry index."""

    entry_digests: dict[str, str] = field(default_factory=dict)
    frozen: bool = False
    incomplete: bool = False
    indexed_size: int = 0
    retired: bool = False
    snapshot_id: str = ""
    version: int = 0

    def fenced(self) -> _State:
        """What a retired rollout keeps: flags, snapshot and version stay, entries go."""
        return replace(self, entry_digests={}, indexed_size=0, retired=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "entry_digests": dict(self.entry_digests),
            "frozen": self.frozen,
            "incomplete": self.incomplete,
            "indexed_size": self.indexed_size,
            "retired": self.retired,
            "snapshot_id": self.snapshot_id,
            "version": self.version,
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict(), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def parse(cls, data: bytes, path: Path) -> _State:
        """Parse a state file; anything we did not write is corruption, never a silent reset."""
        if not data:
            raise _corrupt(path, 0, "state index is empty (truncated)")
        if not data.lstrip().startswith(b"{"):
            raise _corrupt(path, 0, "state index is not a JSON object")
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise _corrupt(path, 0, f"state index is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise _corrupt(path, 0, "state index is not a JSON object")
        state = cls()
        for name in ("frozen", "incomplete", "retired"):
            if name in raw:
                value = raw[name]
                if not isinstance(value, bool):
                    raise _corrupt(path, 0, f"state index field {name!r} is not a boolean")
                setattr(state, name, value)
        for name in ("indexed_size", "version"):
            if name in raw:
                value = raw[name]
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int)
                    or not 0 <= value <= _U64_MAX
                ):
                    raise _corrupt(path, 0, f"state index field {name!r} is not a u64")
                setattr(state, name, value)
        if "snapshot_id" in raw:
            if not isinstance(raw["snapshot_id"], str):
                raise _corrupt(path, 0, "state index field 'snapshot_id' is not a string")
            state.snapshot_id = raw["snapshot_id"]
        if "entry_digests" in raw:
            digests = raw["entry_digests"]
            if not isinstance(digests, dict):
                raise _corrupt(path, 0, "state index field 'entry_digests' is not an object")
            for call_id, digest in digests.items():
                if not _is_hex_digest(digest):
                    raise _corrupt(
                        path,
                        0,
                        f"state index digest for {call_id!r} is not 64 hex digits: {digest!r}",
                    )
            state.entry_digests = digests
        return state


_NEW, _DUPLICATE, _CONFLICT = "new", "duplicate", "conflict"


def _fold_line(state: _State, call_id: str, digest: str) -> str:
    """Apply one acknowledged log line to the index."""
    known = state.entry_digests.get(call_id)
    if known is None:
        state.entry_digests[call_id] = digest
        state.version += 1
        return _NEW
    if known == digest:
        return _DUPLICATE
    # Two committed payloads for one call id: the rollout has a hole it cannot repair.
    state.incomplete = True
    state.version += 1
    return _CONFLICT


def _complete_lines(buf: bytes, base: int) -> Iterator[tuple[int, bytes]]:
    """`(file offset, line without newline)` of every newline-terminated line of `buf`."""
    start = 0
    while True:
        end = buf.find(b"\n", start)
        if end < 0:
            return
        yield base + start, buf[start:end]
        start = end + 1


def _complete_prefix_len(buf: bytes) -> int:
    return buf.rfind(b"\n") + 1


def _parse_record(line: bytes, path: Path, offset: int) -> tuple[str, dict[str, Any]]:
    """The call id and parsed object of one acknowledged line, or a corruption error."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise _corrupt(path, offset, f"not a JSON record: {exc}") from None
    if not isinstance(record, dict):
        raise _corrupt(path, offset, "not a JSON record: not an object")
    call_id = record.get("model_call_id")
    if not isinstance(call_id, str):
        raise _corrupt(path, offset, "no string model_call_id")
    if line.count(b'"model_call_id"') > 1 and _top_level_call_id_keys(line) > 1:
        # JSON parsers keep the last of duplicate keys; a record must name one call.
        raise _corrupt(path, offset, "model_call_id appears twice")
    return call_id, record


def _top_level_call_id_keys(line: bytes) -> int:
    """How many `model_call_id` keys the top-level object has (orjson keeps only the last).

    Only reached when the key occurs more than once anywhere in the line (nested objects such
    as output items may carry their own), so the slow pairs-preserving parse is rare.
    """
    objects: list[list[tuple[str, Any]]] = []

    def keep_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)  # inner objects complete first: the top level comes last
        return dict(pairs)

    try:
        json.loads(line, object_pairs_hook=keep_pairs)
    except (ValueError, RecursionError):
        return 0  # orjson read it; nesting the stdlib parser cannot follow is no duplicate
    return sum(key == "model_call_id" for key, _ in objects[-1]) if objects else 0


_Records = list[tuple[int, dict[str, Any]]]
"""Unique records in file order, each with the byte offset of its line."""


def _verify_and_fold(paths: _Paths, state: _State, buf: bytes) -> _Records:
    """Check every complete line of a whole log against `state` and fold the rest in.

    An indexed line (before `indexed_size`) must carry the payload digest the index recorded
    for its call id; lines past the index are folded in. Leaves `indexed_size` at the end of
    the complete lines (a torn final line is not counted) and returns the unique records (the
    first line of each call id) in file order.
    """
    complete_end = _complete_prefix_len(buf)
    indexed = state.indexed_size
    if indexed > complete_end:
        raise _corrupt(
            paths.log,
            complete_end,
            f"{paths.state} covers {indexed} bytes but the log's complete lines end here",
        )
    records: _Records = []
    seen: set[str] = set()
    for offset, line in _complete_lines(buf, 0):
        call_id, record = _parse_record(line, paths.log, offset)
        digest = _payload_digest(line)
        if offset < indexed:
            if call_id in seen:
                continue  # a later copy; the index judged it when it was folded
            known = state.entry_digests.get(call_id)
            if known is None:
                raise _corrupt(paths.log, offset, f"{call_id!r} is missing from {paths.state}")
            if known != digest:
                raise _corrupt(
                    paths.log,
                    offset,
                    f"line of {call_id!r} does not match its payload digest in {paths.state}",
                )
        elif _fold_line(state, call_id, digest) != _NEW:
            continue
        seen.add(call_id)
        records.append((offset, record))
    state.indexed_size = complete_end
    return records


def _check_missing_log(paths: _Paths, state: _State) -> None:
    """A rollout without a log is fine unless its index says the log held records: then
    acknowledged entries vanished, and writing on would index new lines at wrong offsets."""
    if state.indexed_size > 0:
        raise _corrupt(
            paths.log,
            0,
            f"the log is missing but {paths.state} indexes {state.indexed_size} bytes of it",
        )


# Files and locks ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Paths:
    log: Path
    state: Path
    state_tmp: Path
    intents: Path
    incomplete: Path
    lock: Path

    @classmethod
    def of(cls, root: Path, rollout_id: str) -> _Paths:
        def file(suffix: str) -> Path:
            return root / f"{rollout_id}.tokens.{suffix}"

        return cls(
            log=file("jsonl"),
            state=file("state.json"),
            state_tmp=file("state.json.tmp"),
            intents=file("intents"),
            incomplete=file("incomplete"),
            lock=file("lock"),
        )

    def records(self) -> tuple[Path, Path, Path]:
        """The files that hold records (as opposed to the fence and the lock)."""
        return (self.log, self.intents, self.incomplete)


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    return True


def _remove_if_exists(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_at(fd: int, offset: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            raise OSError(f"unexpected end of file at byte {offset}")
        chunks.append(chunk)
        offset += len(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _open_existing(path: Path, flags: int) -> int | None:
    try:
        return os.open(path, flags | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


class _Lock:
    """A held flock on `R.tokens.lock`; closing the descriptor releases it."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> _Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @classmethod
    def acquire(cls, path: Path, *, shared: bool, create: bool) -> _Lock | None:
        """Lock, then check that the path still names the inode we locked (a delete may have
        unlinked it while we waited); retry if not. Without `create`, None when absent."""
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        while True:
            try:
                fd = os.open(path, flags | os.O_CLOEXEC, _FILE_MODE)
            except FileNotFoundError:
                if create:
                    raise
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                held = os.fstat(fd)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                else:
                    if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                        return cls(fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)


# The store ---------------------------------------------------------------------------------


@instrumented(
    "token_capture",
    "reference",
    {
        "append": "put",
        "_begin_call": "begin_call",
        "_mark_incomplete": "mark_incomplete",
        "freeze_now": "freeze",
        "_drop": "drop",
        "retire_now": "retire",
        "delete_now": "delete",
    },
    refusals={
        "put": "put",
        "begin_call": "begin_call",
        "mark_incomplete": "mark_incomplete",
        "freeze": "freeze",
        "drop": "drop",
        "retire": "retire",
        "delete": "delete",
    },
)
class TokenCaptureStore(RolloutFiles):
    """Durable, rollout-keyed JSONL sink and source for `TokenEntry` records (pure Python).

    Safe to share between threads, and between processes (and Rust-backed stores) that open
    the same directory: every operation takes the rollout's flock.
    """

    def __init__(self, root: str | os.PathLike[str], *, cached_rollouts: int = 128) -> None:
        # `cached_rollouts` is accepted for signature compatibility; this store caches nothing.
        del cached_rollouts
        self._root = Path(root)
        if not self._root.is_dir():
            self._root.mkdir(parents=True, exist_ok=True)
            # Make the new directory's own entry durable, or a crash could lose every record.
            self._fsync_dir(self._root.parent)

    def __repr__(self) -> str:
        return f"reference.TokenCaptureStore({os.fspath(self._root)!r})"

    @property
    def root(self) -> Path:
        return self._root

    # Paths -------------------------------------------------------------------------------

    def _paths(self, rollout_id: str) -> _Paths:
        return _Paths.of(self._root, validate_rollout_id(rollout_id))

    # Low-level helpers -------------------------------------------------------------------

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_root(self) -> None:
        self._fsync_dir(self._root)

    def _locked(self, paths: _Paths, *, shared: bool = False) -> _Lock:
        lock = _Lock.acquire(paths.lock, shared=shared, create=True)
        assert lock is not None
        return lock

    def _locked_existing(self, paths: _Paths, *, shared: bool) -> _Lock | None:
        """Lock a rollout only if it has any file; None (and nothing created) otherwise."""
        lock = _Lock.acquire(paths.lock, shared=shared, create=False)
        if lock is not None:
            return lock
        if any(_exists(path) for path in (*paths.records(), paths.state)):
            # Files without a lock file (an operator removed it): recreate it.
            return self._locked(paths, shared=shared)
        return None

    @staticmethod
    def _read_state(paths: _Paths) -> _State | None:
        try:
            with open(paths.state, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        return _State.parse(data, paths.state)

    def _write_state(self, paths: _Paths, state: _State, *, durable: bool, sync_root: bool) -> None:
        """Atomically replace the state file (temporary file, rename).

        `durable` fsyncs the temporary file first; `sync_root` makes the rename durable.
        """
        fd = os.open(
            paths.state_tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _FILE_MODE
        )
        try:
            _write_all(fd, state.to_json())
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _remove_if_exists(paths.state_tmp)
            raise
        os.close(fd)
        os.replace(paths.state_tmp, paths.state)
        if sync_root:
            self._fsync_root()

    @staticmethod
    def _fold_tail(paths: _Paths, state: _State, log_fd: int | None) -> None:
        """Fold log bytes past `indexed_size` into `state`; truncate a torn final line.

        Call only under the exclusive lock, with `log_fd` opened for writing (or None).
        """
        if log_fd is None:
            _check_missing_log(paths, state)
            return
        size = os.fstat(log_fd).st_size
        covered = state.indexed_size
        if size < covered:
            raise _corrupt(
                paths.log,
                size,
                f"log ends at byte {size} but its state index covers {covered} bytes",
            )
        if covered > 0 and _read_at(log_fd, covered - 1, 1) != b"\n":
            # Appending after an index that ends inside a line would glue records together.
            raise _corrupt(paths.log, covered, f"{paths.state} ends its index inside a line")
        if size == covered:
            return
        tail = _read_at(log_fd, covered, size - covered)
        for offset, line in _complete_lines(tail, covered):
            call_id, _ = _parse_record(line, paths.log, offset)
            _fold_line(state, call_id, _payload_digest(line))
        complete_end = covered + _complete_prefix_len(tail)
        state.indexed_size = complete_end
        if complete_end < size:
            os.ftruncate(log_fd, complete_end)

    @staticmethod
    def _append_marker(path: Path, line: bytes) -> bool:
        """Durably append one line to an intents or incomplete file; True if the directory
        must be fsynced to make the file's name durable."""
        fd = _open_existing(path, os.O_WRONLY | os.O_APPEND)
        created = fd is None
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
        try:
            before = os.fstat(fd).st_size
            try:
                _write_all(fd, line + b"\n")
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, before)  # leave no partial line behind
                raise
        finally:
            os.close(fd)
        # An empty file found on disk may come from a failed first append whose name was
        # never made durable: treat it like one we created.
        return created or before == 0

    @staticmethod
    def _retired_error(rollout_id: str) -> TokenCaptureRetiredError:
        return TokenCaptureRetiredError(
            f'rollout "{rollout_id}" is retired: its capture is fenced until it is deleted'
        )

    @classmethod
    def _check_writable(cls, rollout_id: str, state: _State) -> None:
        """Capture writes are refused after retire (the fence) and after freeze."""
        if state.retired:
            raise cls._retired_error(rollout_id)
        if state.frozen:
            raise TokenCaptureFrozenError(
                f'rollout "{rollout_id}" is frozen: its capture no longer accepts writes'
            )

    # Writes ------------------------------------------------------------------------------

    @staticmethod
    def _checked(entry: object) -> tuple[TokenEntry, bytes]:
        """The entry and its canonical line, or the error a put of it raises."""
        token_entry = as_token_entry(entry)
        line = canonical_line(token_entry)
        validate_rollout_id(token_entry.rollout_id)
        check_call_id(token_entry.model_call_id)
        return token_entry, line

    def append(self, entry: TokenEntry, *, _line: bytes | None = None) -> None:
        """Idempotently append one entry and fsync it before returning.

        (`_line` is `put`'s already checked canonical line of `entry`.)
        """
        if _line is None:
            entry, _line = self._checked(entry)
        line = _line
        rollout_id = entry.rollout_id
        call_id = entry.model_call_id
        digest = _payload_digest(line)
        paths = self._paths(rollout_id)
        with self._locked(paths):
            state = self._read_state(paths) or _State()
            log_fd = _open_existing(paths.log, os.O_RDWR | os.O_APPEND)
            try:
                self._fold_tail(paths, state, log_fd)
                self._check_writable(rollout_id, state)
                known = state.entry_digests.get(call_id)
                if known == digest:
                    return
                if known is not None:
                    state.incomplete = True
                    state.version += 1
                    self._write_state(paths, state, durable=True, sync_root=True)
                    raise TokenCaptureConflictError(
                        f"model_call_id {call_id!r} of rollout {rollout_id!r} is already stored "
                        "with a different payload; the rollout is now marked incomplete"
                    )
                created = log_fd is None
                if log_fd is None:
                    log_fd = os.open(
                        paths.log,
                        os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                        _FILE_MODE,
                    )
                before = state.indexed_size
                try:
                    _write_all(log_fd, line + b"\n")
                    os.fsync(log_fd)
                except BaseException:
                    # Leave no partial line: the caller is told this put failed.
                    os.ftruncate(log_fd, before)
                    raise
            finally:
                if log_fd is not None:
                    os.close(log_fd)
            state.indexed_size = before + len(line) + 1
            state.version += 1
            state.entry_digests[call_id] = digest
            # NeMo Gym's design: the index follows every put, atomically but not durably.
            self._write_state(paths, state, durable=False, sync_root=False)
            if created or before == 0:
                # A new log's name must be durable too (an empty one found on disk may come
                # from a writer that failed before making it so).
                self._fsync_root()

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Store an entry durably without blocking the event loop (`await store.put(entry)`).

        The entry is checked when this is called, appended on a thread when it is awaited.
        """
        token_entry, line = self._checked(entry)
        return asyncio.to_thread(self.append, token_entry, _line=line)

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Synchronous `begin_call`."""
        if not isinstance(model_call_id, str):
            raise TypeError(f"model_call_id must be a str, not {type(model_call_id).__name__}")
        paths = self._paths(rollout_id)
        call_id = check_call_id(model_call_id)
        with self._locked(paths):
            state = self._read_state(paths) or _State()
            self._check_writable(rollout_id, state)
            if self._append_marker(paths.intents, call_id.encode("utf-8")):
                self._fsync_root()

    def begin_call(self, rollout_id: str, model_call_id: str) -> Coroutine[Any, Any, None]:
        """Durably record that a captured call is about to be dispatched.

        An intent with no entry at freeze masks the rollout. The ids are checked when this is
        called, the intent written when it is awaited.
        """
        validate_rollout_id(rollout_id)
        check_call_id(model_call_id)
        return asyncio.to_thread(self._begin_call, rollout_id, model_call_id)

    def _mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Synchronous `mark_incomplete`."""
        line = marker_line(model_call_id)
        paths = self._paths(rollout_id)
        with self._locked(paths):
            state = self._read_state(paths) or _State()
            if state.retired:
                raise self._retired_error(rollout_id)
            self._append_marker(paths.incomplete, line)
            state.incomplete = True
            state.version += 1
            # One directory fsync covers both the marker file's creation and the rename.
            self._write_state(paths, state, durable=True, sync_root=True)

    def mark_incomplete(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, None]:
        """Durably record that a call was lost (allowed after freeze, refused after retire).

        The rollout id is checked when this is called; any call id is accepted.
        """
        validate_rollout_id(rollout_id)
        return asyncio.to_thread(self._mark_incomplete, rollout_id, model_call_id)

    # Reads and lifecycle -----------------------------------------------------------------

    def _scan_and_fold(self, paths: _Paths, state: _State) -> _Records:
        """Read the whole log: verify it and fold its tail into `state`, then truncate a torn
        final line (call under the exclusive lock). Returns the unique records in file order."""
        log_fd = _open_existing(paths.log, os.O_RDWR)
        if log_fd is None:
            _check_missing_log(paths, state)
            return []
        try:
            size = os.fstat(log_fd).st_size
            records = _verify_and_fold(paths, state, _read_at(log_fd, 0, size))
            if state.indexed_size < size:
                os.ftruncate(log_fd, state.indexed_size)
            return records
        finally:
            os.close(log_fd)

    @staticmethod
    def _has_dangling_intent(paths: _Paths, state: _State) -> bool:
        """True when an acknowledged intent has no stored entry."""
        try:
            data = paths.intents.read_bytes()
        except FileNotFoundError:
            return False
        for _, line in _complete_lines(data, 0):
            try:
                call_id = line.decode("utf-8").strip(LINE_SPACE)  # matched as NeMo Gym does
            except UnicodeDecodeError:
                return True
            if call_id and call_id not in state.entry_digests:
                return True
        return False

    @staticmethod
    def _entries(paths: _Paths, records: _Records) -> tuple[TokenEntry, ...]:
        """Validate stored records; one that is not a valid entry is corruption, named so."""
        entries = []
        for offset, record in records:
            try:
                entries.append(TokenEntry.model_validate(record))
            except ValidationError as exc:
                error = exc.errors()[0]
                where = ".".join(map(str, error["loc"])) or "the record"
                raise TokenCaptureCorruptionError(
                    f"{paths.log}: the line is not a valid entry: {error['msg']} at {where} "
                    f"(byte offset {offset})"
                ) from exc
        return tuple(entries)

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Synchronously freeze one rollout and return its stable snapshot."""
        paths = self._paths(rollout_id)
        with self._locked(paths):
            state = self._read_state(paths) or _State()
            if state.retired:
                raise self._retired_error(rollout_id)
            disk_indexed_size = state.indexed_size
            records = self._scan_and_fold(paths, state)
            changed = state.indexed_size != disk_indexed_size
            if not state.frozen:
                state.frozen = True
                state.snapshot_id = uuid.uuid4().hex
                state.version += 1
                changed = True
            if changed:
                self._write_state(paths, state, durable=True, sync_root=True)
            incomplete = state.incomplete or self._has_dangling_intent(paths, state)
        entries = self._entries(paths, records)
        return TokenCaptureSnapshot(
            rollout_id, entries, incomplete, state.snapshot_id, state.version
        )

    def freeze(self, rollout_id: str) -> Coroutine[Any, Any, TokenCaptureSnapshot]:
        """`freeze_now` on a thread; the rollout id is checked when this is called."""
        validate_rollout_id(rollout_id)
        return asyncio.to_thread(self.freeze_now, rollout_id)

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """The stored entries (a torn tail is ignored; nothing is created or changed)."""
        paths = self._paths(rollout_id)
        lock = self._locked_existing(paths, shared=True)
        if lock is None:
            return []
        with lock:
            try:
                data = paths.log.read_bytes()
            except FileNotFoundError:
                return []
        records: _Records = []
        seen: set[str] = set()
        for offset, line in _complete_lines(data, 0):
            call_id, record = _parse_record(line, paths.log, offset)
            if call_id not in seen:
                seen.add(call_id)
                records.append((offset, record))
        return list(self._entries(paths, records))

    def is_incomplete(self, rollout_id: str) -> bool:
        """The stored flag: a call in flight is not a hole until freeze judges it."""
        state = self._read_state(self._paths(rollout_id))
        return state is not None and state.incomplete

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Synchronous `drop`."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return False
        if not isinstance(snapshot_id, str):
            raise TypeError(f"snapshot_id must be a str, not {type(snapshot_id).__name__}")
        paths = self._paths(rollout_id)
        try:
            snapshot_id.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "snapshot_id must be valid Unicode text (no lone surrogates)"
            ) from None
        lock = self._locked_existing(paths, shared=False)
        if lock is None:
            return False
        with lock:
            state = self._read_state(paths) or _State()
            log_fd = _open_existing(paths.log, os.O_RDWR)
            try:
                self._fold_tail(paths, state, log_fd)
            finally:
                if log_fd is not None:
                    os.close(log_fd)
            if not (state.frozen and state.snapshot_id == snapshot_id and state.version == version):
                return False
            if not state.retired:
                # The fence must be durable before any removal can be.
                self._write_state(paths, state.fenced(), durable=True, sync_root=True)
            self._remove_records(paths)
            self._fsync_root()
            return True

    def drop(self, rollout_id: str, snapshot_id: str, version: int) -> Coroutine[Any, Any, bool]:
        """Delete the consumed snapshot's records and keep its fence, if nothing changed.

        The rollout id and the snapshot id's type are checked when this is called.
        """
        validate_rollout_id(rollout_id)
        check_snapshot_id(snapshot_id)
        return asyncio.to_thread(self._drop, rollout_id, snapshot_id, version)

    @staticmethod
    def _remove_records(paths: _Paths) -> bool:
        """Remove a rollout's records, intents and incomplete marker; True if any existed."""
        had = False
        for path in paths.records():
            had |= _remove_if_exists(path)
        _remove_if_exists(paths.state_tmp)
        return had

    def _fence_source(self, paths: _Paths) -> _State:
        """The state a retire fences: the stored state with as much of the log tail folded in
        as is readable (what a reader sees, stopping at a corrupt line), or a bare state when
        the state itself is corrupt: retiring is how a damaged rollout is cleaned up."""
        try:
            state = self._read_state(paths) or _State()
        except (TokenCaptureCorruptionError, OSError):
            return _State()
        if state.retired:
            return state
        try:
            data = paths.log.read_bytes()
        except OSError:
            return state
        covered = state.indexed_size
        if covered > len(data) or (covered > 0 and data[covered - 1 : covered] != b"\n"):
            return state
        for offset, line in _complete_lines(data[covered:], covered):
            try:
                call_id, _ = _parse_record(line, paths.log, offset)
            except TokenCaptureCorruptionError:
                break  # the records are about to go; the fence keeps what was readable
            _fold_line(state, call_id, _payload_digest(line))
        return state

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `retire`: fence every rollout durably, then remove their records.

        Two phases, each ending in one directory fsync, so a removal can never be durable
        before its fence. The first fsync runs even when no fence was written: one found may
        come from an overlapping retire that has not synced yet.
        """
        ids = validate_rollout_ids(rollout_ids)
        if not ids:
            return {"removed": [], "absent": []}
        for rollout_id in ids:
            paths = self._paths(rollout_id)
            with self._locked(paths):
                state = self._fence_source(paths)
                if not state.retired:
                    self._write_state(paths, state.fenced(), durable=True, sync_root=False)
        self._fsync_root()
        removed: list[str] = []
        absent: list[str] = []
        for rollout_id in ids:
            paths = self._paths(rollout_id)
            with self._locked(paths):
                (removed if self._remove_records(paths) else absent).append(rollout_id)
        self._fsync_root()
        return {"removed": removed, "absent": absent}

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and keep a fence, whatever their state (the batch is
        validated when this is called)."""
        ids = validate_rollout_ids(rollout_ids)
        return asyncio.to_thread(self.retire_now, ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Synchronous `delete`: remove records, fences and lock files.

        Every non-empty batch fsyncs the directory before returning, even when it found
        nothing: an overlapping delete may have removed the files without syncing yet.
        """
        ids = validate_rollout_ids(rollout_ids)
        if not ids:
            return {"removed": [], "absent": []}
        removed: list[str] = []
        absent: list[str] = []
        for rollout_id in ids:
            paths = self._paths(rollout_id)
            with self._locked(paths):
                had = self._remove_records(paths)
                had |= _remove_if_exists(paths.state)
                # Unlink the lock while holding it; a waiter on the old inode notices, retries.
                _remove_if_exists(paths.lock)
            (removed if had else absent).append(rollout_id)
        self._fsync_root()
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove rollouts' records and fences, so a reused id starts empty (the batch is
        validated when this is called; a bare string is a `TypeError`)."""
        ids = validate_rollout_ids(rollout_ids)
        return asyncio.to_thread(self.delete_now, ids)

    @staticmethod
    def _read_and_verify(paths: _Paths, state: _State) -> _Records:
        """`_verify_and_fold` over the whole log without changing any file."""
        try:
            data = paths.log.read_bytes()
        except FileNotFoundError:
            return []
        return _verify_and_fold(paths, state, data)

    def inspect(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's state as a reader sees it, or None when it has no files.

        Read-only: every indexed line is checked against its payload digest (a mismatch raises
        `TokenCaptureCorruptionError`) and the unindexed tail is folded in, as freeze would.
        The state index's keys plus `entry_count` (unique records in the log).
        """
        paths = self._paths(rollout_id)
        lock = self._locked_existing(paths, shared=True)
        if lock is None:
            return None
        with lock:
            state = self._read_state(paths) or _State()
            records = self._read_and_verify(paths, state)
        return {**state.as_dict(), "entry_count": len(records)}

    async def close(self) -> None:
        """The file store owns no persistent handles; nothing to flush."""
