"""A pure-Python `FileLineageStore`: the oracle of the lineage differential tests.

Same rules and answers as `tokencapture.lineage.FileLineageStore`, written to be read rather than
to be fast: request hashes by `tokencapture.fingerprint`, every new line parsed whole with
orjson, token digests by hashlib. It is incremental like the native resolver (a cursor per
rollout, new bytes read under the rollout's shared flock, a replaced or shrunk file resets the
rollout), but it keeps every parsed entry, caches no materialized sequence and bounds nothing.
It is the baseline of the lineage benchmark, never a fallback.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.jobs import off_loop
from tokencapture.lineage import (
    AMBIGUOUS_REASON,
    NO_MATCH_REASON,
    LineageIntegrityError,
    request_list,
)
from tokencapture.protocols import LineageMatch, LineageResolution, TokenCaptureCorruptionError
from tokencapture.records import ParentResolutionStatus
from tokencapture.resolution import prepare_in_python
from tokencapture.validation import check_resolve_args, validate_rollout_id

__all__ = ["FileLineageStore", "token_digest"]

_TOKEN_DOMAIN = b"nemo-gym-tokens"
_MAX_ID = 2**64 - 1
_I64 = range(-(2**63), 2**63)


def token_digest(ids: list[int]) -> str:
    """The token digest of SPEC section 2, in plain Python."""
    if not ids:
        return hashlib.sha256(_TOKEN_DOMAIN).hexdigest()
    body = struct.pack(f">{len(ids)}Q", *ids)
    return hashlib.sha256(_TOKEN_DOMAIN + b"\x01" + len(ids).to_bytes(8, "big") + body).hexdigest()


@dataclass
class _Call:
    call_id: str
    fingerprint: str
    context_len: int
    context_digest: str
    cum_len: int | None
    digest: str | None
    parent_call_id: str | None
    prompt_is_delta: bool
    prompt: Any
    generation: Any
    line: bytes
    conflicted: bool = False


@dataclass
class _Rollout:
    file: BinaryIO | None = None
    ino: tuple[int, int] = (0, 0)
    cursor: int = 0
    calls: dict[str, _Call] = field(default_factory=dict)
    by_fingerprint: dict[str, list[str]] = field(default_factory=dict)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _typed(record: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """A lineage field: missing or null is `default`; any other type is corruption."""
    value = record.get(key)
    if value is None:
        return default
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value not in _I64:
            raise TypeError(f"{key} has the wrong type")
    elif not isinstance(value, kind):
        raise TypeError(f"{key} has the wrong type")
    return value


def _parse_call(line: bytes) -> _Call:
    record = orjson.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("model_call_id"), str):
        raise TypeError("no string model_call_id")
    version = _typed(record, "fingerprint_version", int, None)
    fingerprint = _typed(record, "continuation_fingerprint", str, "")
    digest = _typed(record, "digest", str, None)
    return _Call(
        call_id=record["model_call_id"],
        fingerprint=fingerprint if version == 2 else "",
        context_len=_typed(record, "continuation_context_len", int, 0),
        context_digest=_typed(record, "continuation_context_digest", str, ""),
        cum_len=_typed(record, "cum_len", int, None),
        digest=digest or None,
        parent_call_id=_typed(record, "parent_call_id", str, None),
        prompt_is_delta=_typed(record, "prompt_is_delta", bool, False),
        prompt=record.get("prompt_token_ids"),
        generation=record.get("generation_token_ids"),
        line=line,
    )


def _token_list(call: _Call, name: str, value: Any) -> list[int]:
    ok = isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_ID for t in value
    )
    if not ok:
        raise LineageIntegrityError(f"{name} of entry {call.call_id!r} is not a list of token ids")
    return list(value)


class FileLineageStore:
    """Pure-Python lineage resolver over a `TokenCaptureStore` directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = Path(root)
        self._rollouts: dict[str, _Rollout] = {}
        self._mutex = threading.Lock()

    # Reading ---------------------------------------------------------------------------------

    def _refresh(self, rollout_id: str) -> _Rollout:
        rollout = self._rollouts.setdefault(rollout_id, _Rollout())
        log = self._root / f"{rollout_id}.tokens.jsonl"
        lock_fd = self._lock_shared(self._root / f"{rollout_id}.tokens.lock")
        try:
            try:
                st = os.stat(log)
            except FileNotFoundError:
                rollout.close()
                self._rollouts[rollout_id] = rollout = _Rollout()
                return rollout
            if rollout.file is None or rollout.ino != (st.st_dev, st.st_ino):
                rollout.close()
                self._rollouts[rollout_id] = rollout = _Rollout()
                try:
                    rollout.file = open(log, "rb")  # noqa: SIM115 (kept open: it pins the inode)
                except FileNotFoundError:
                    return rollout
                held = os.fstat(rollout.file.fileno())
                rollout.ino = (held.st_dev, held.st_ino)
            handle = rollout.file
            assert handle is not None
            size = os.fstat(handle.fileno()).st_size
            cursor = rollout.cursor
            if size < cursor or (cursor and os.pread(handle.fileno(), 1, cursor - 1) != b"\n"):
                # Truncated, or rewritten in place: read it again from the start.
                self._rollouts[rollout_id] = rollout = _Rollout(file=handle, ino=rollout.ino)
            handle.seek(rollout.cursor)
            tail = handle.read(size - rollout.cursor)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        end = tail.rfind(b"\n") + 1
        offset = rollout.cursor
        for line in tail[:end].split(b"\n")[:-1]:
            try:
                call = _parse_call(line)
            except (orjson.JSONDecodeError, TypeError) as exc:
                raise TokenCaptureCorruptionError(f"{log}: {exc} (byte offset {offset})") from exc
            self._add(rollout, call)
            offset += len(line) + 1
            rollout.cursor = offset
        return rollout

    @staticmethod
    def _lock_shared(path: Path) -> int | None:
        """Lock-then-verify on an existing lock file; None (and nothing created) without one."""
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            held = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                os.close(fd)
                return None
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
            os.close(fd)

    @staticmethod
    def _add(rollout: _Rollout, call: _Call) -> None:
        known = rollout.calls.get(call.call_id)
        if known is not None:
            if known.line != call.line:
                known.conflicted = True
            return
        rollout.calls[call.call_id] = call
        if call.fingerprint:
            rollout.by_fingerprint.setdefault(call.fingerprint, []).append(call.call_id)

    # Resolving -------------------------------------------------------------------------------

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        validate_rollout_id(rollout_id)
        items = list(request_list(request_items))
        return self._resolve_fingerprinted(rollout_id, items, assistant_fingerprint(items))

    def _resolve_fingerprinted(
        self, rollout_id: str, items: list[Any], fingerprint: str
    ) -> LineageResolution:
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        with self._mutex:
            rollout = self._refresh(rollout_id)
            candidates = []
            for call_id in rollout.by_fingerprint.get(fingerprint, []):
                call = rollout.calls[call_id]
                if call.conflicted or not call.context_digest:
                    continue
                if not 0 <= call.context_len <= len(items):
                    continue
                if conversation_digest(items[: call.context_len]) == call.context_digest:
                    candidates.append(call)
            if not candidates:
                return self._unresolved(NO_MATCH_REASON)
            first = candidates[0]
            shared = first.digest is not None and all(
                (c.digest, c.cum_len) == (first.digest, first.cum_len) for c in candidates
            )
            if len(candidates) > 1 and not shared:
                return self._unresolved(AMBIGUOUS_REASON)
            winner = min(candidates, key=lambda c: c.call_id)
            tokens, digest = self._materialize(rollout, winner)
        return LineageResolution(
            ParentResolutionStatus.RESOLVED, LineageMatch(winner.call_id, tuple(tokens), digest)
        )

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """`resolve_now` off the event loop, of the request as it was when called: the
        arguments are checked, and the items copied and fingerprinted (content the fingerprint
        refuses raises), when this is called, as the native resolvers prepare a resolve."""
        prepared = prepare_in_python(check_resolve_args(rollout_id, request_items))
        return off_loop(
            self._resolve_fingerprinted, rollout_id, prepared.items, prepared.fingerprint
        )

    @staticmethod
    def _unresolved(reason: str) -> LineageResolution:
        return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)

    @staticmethod
    def _materialize(rollout: _Rollout, winner: _Call) -> tuple[list[int], str]:
        chain = [winner]
        seen = {winner.call_id}
        current = winner
        while current.prompt_is_delta:
            parent_id = current.parent_call_id
            if parent_id is None:
                raise LineageIntegrityError(f"delta entry {current.call_id!r} has no parent")
            parent = rollout.calls.get(parent_id)
            if parent is None:
                raise LineageIntegrityError(
                    f"parent {parent_id!r} of {current.call_id!r} is absent"
                )
            if parent_id in seen:
                raise LineageIntegrityError(f"the chain of {winner.call_id!r} has a cycle")
            seen.add(parent_id)
            chain.append(parent)
            current = parent
        tokens: list[int] = []
        for link in reversed(chain):
            tokens += _token_list(link, "prompt_token_ids", link.prompt)
            tokens += _token_list(link, "generation_token_ids", link.generation)
        if winner.cum_len is not None and winner.cum_len != len(tokens):
            raise LineageIntegrityError(
                f"{winner.call_id!r} records cum_len {winner.cum_len}, its chain has {len(tokens)}"
            )
        digest = token_digest(tokens)
        if winner.digest is not None and winner.digest != digest:
            raise LineageIntegrityError(f"{winner.call_id!r}: digest mismatch")
        # The match carries the recorded digest, "" when none is recorded (as NeMo Gym's).
        return tokens, winner.digest or ""

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        with self._mutex:
            for rollout in self._rollouts.values():
                rollout.close()
            self._rollouts.clear()
