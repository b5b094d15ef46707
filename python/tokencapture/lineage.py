"""Request-time lineage: which committed model call does a new request continue?

A model call's entry is stamped (`stamp_continuation`) with the fingerprint of everything the
model authored up to and including its own output, and with the length and digest of the request
context it saw. A later request whose model-authored turns hash to that fingerprint, and whose
prefix of that length digests to the recorded context, continues the call: the resolver returns
the call's verified cumulative tokens (prompt + generation, rebuilt through delta entries), so the
next prompt can be checked or encoded against them (`encode_delta`).

Resolvers (`tokencapture.protocols.LineageResolver`):

* `FileLineageStore` reads the JSONL files that `tokencapture.store.TokenCaptureStore` writes, in
  any process: a put that has returned is visible to the next resolve, even in a resolver built
  before the put. Reading is incremental and memory is bounded (an LRU over rollouts and a token
  budget for materialized sequences).
* `InMemoryLineageStore` is the bounded single-process variant, fed by its own `put`.

Both run the same native matcher (`tokencapture._core`): candidate rules, never a guess, and a
digest check of every answer. The request hashes run natively for plain JSON items and fall back
to `tokencapture.fingerprint` for anything else, which is the definition of both hashes.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final

from tokencapture import _core
from tokencapture.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    conversation_digest,
)
from tokencapture.metrics import instrumented
from tokencapture.protocols import LineageMatch, LineageResolution, RolloutRemovalPayload
from tokencapture.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokencapture.store import (
    _as_token_entry,
    _native_job,
    _off_loop,
    canonical_line,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = [
    "AMBIGUOUS_REASON",
    "DEFAULT_CACHED_ROLLOUTS",
    "DEFAULT_CACHED_TOKENS",
    "NO_MATCH_REASON",
    "FileLineageStore",
    "InMemoryLineageStore",
    "LineageIntegrityError",
    "check_resolve_args",
    "encode_delta",
    "request_list",
    "stamp_continuation",
]

NO_MATCH_REASON: Final[str] = "no_match"
AMBIGUOUS_REASON: Final[str] = "ambiguous"
DEFAULT_CACHED_ROLLOUTS: Final[int] = 256
DEFAULT_CACHED_TOKENS: Final[int] = 4_000_000


class LineageIntegrityError(ValueError):
    """A resolved call's stored chain does not rebuild to its recorded tokens.

    Raised instead of ever returning wrong tokens: the chain's `cum_len` or token digest does not
    match the winner's record, the chain has a cycle or a missing parent, or a token array is not
    a list of token ids.
    """


_ROOT: Final[LineageResolution] = LineageResolution(ParentResolutionStatus.ROOT)


def stamp_continuation(entry: TokenEntry, request_items: Sequence[Mapping[str, Any]]) -> TokenEntry:
    """Stamp `entry` (in place, and return it) with its continuation lookup metadata.

    Sets `continuation_fingerprint = assistant_fingerprint(request_items + output_items)`,
    `continuation_context_len = len(request_items)`, `continuation_context_digest =
    conversation_digest(request_items)` and `fingerprint_version = 2`. Unstamped entries are
    invisible to resolution.
    """
    items = list(request_items)
    combined = [*items, *entry.output_items]
    hashes = _core.continuation_hashes(combined, len(items))
    if hashes is None:
        fingerprint, digest = assistant_fingerprint(combined), conversation_digest(items)
    else:
        fingerprint, digest = hashes
    entry.continuation_fingerprint = fingerprint
    entry.continuation_context_len = len(items)
    entry.continuation_context_digest = digest
    entry.fingerprint_version = FINGERPRINT_VERSION
    return entry


_Native = _core.FileLineage | _core.MemoryLineage


def _resolution(raw: tuple[str, str | None, tuple[int, ...] | None, str, str]) -> LineageResolution:
    status, call_id, tokens, digest, reason = raw
    if status == "resolved":
        assert call_id is not None and tokens is not None
        return LineageResolution(
            ParentResolutionStatus.RESOLVED, LineageMatch(call_id, tokens, digest)
        )
    if status == "root":
        return _ROOT
    return LineageResolution(ParentResolutionStatus.UNRESOLVED, reason=reason)


def request_list(request_items: Iterable[Any]) -> list[Any]:
    """The request items as a list (a list is used as is, any other iterable copied).

    A `str`, `bytes` or mapping is refused with `TypeError`: each is iterable, but iterating
    it yields characters or keys, never request items.
    """
    if isinstance(request_items, list):
        return request_items
    if isinstance(request_items, str | bytes | bytearray | Mapping) or not isinstance(
        request_items, Iterable
    ):
        raise TypeError(
            f"request_items must be a list of request items, not {type(request_items).__name__}"
        )
    return list(request_items)


def check_resolve_args(rollout_id: str, request_items: Iterable[Any]) -> list[Any]:
    """The checks of `resolve`'s arguments: a valid rollout id and a list of request items
    (`TypeError` / `ValueError`); returns the items as `request_list` does."""
    validate_rollout_id(rollout_id)
    return request_list(request_items)


def _resolve(native: _Native, rollout_id: str, request_items: Iterable[Any]) -> LineageResolution:
    validate_rollout_id(rollout_id)
    items = request_list(request_items)
    raw = native.resolve(rollout_id, items)
    if raw is not None:
        return _resolution(raw)
    return _resolve_in_python(native, rollout_id, items)


def _resolve_in_python(native: _Native, rollout_id: str, items: list[Any]) -> LineageResolution:
    """Items the native hashes do not cover: tokencapture.fingerprint decides (or raises)."""
    fingerprint = assistant_fingerprint(items)
    if not fingerprint:
        return _ROOT
    digests: dict[int, str] = {}
    while True:
        step = native.resolve_hashed(rollout_id, fingerprint, len(items), digests)
        if isinstance(step, tuple):
            return _resolution(step)
        for length in step:
            digests[length] = conversation_digest(items[:length])


@instrumented("lineage", "file", {"resolve_now": "resolve", "resolve": "resolve"})
class FileLineageStore:
    """A `LineageResolver` over the JSONL files of a `TokenCaptureStore` directory.

    Every resolve looks for bytes appended since the last one (under the rollout's shared lock;
    nothing is created), so a put that has returned in any process is visible. A replaced,
    truncated or deleted file resets that rollout's index: a retired or deleted rollout resolves
    nothing, and a reused rollout id resolves against its new entries only.

    Memory is bounded: the metadata indexes of at most `max_cached_rollouts` rollouts (LRU; one
    open descriptor each), at most `max_cached_tokens` tokens of verified cumulative sequences
    (8 bytes a token, LRU), and at most `max_cached_tokens` tokens of answer tuples (the last
    answer per rollout, from which the next one is extended). Token ids below 2**18 share one
    Python int per process (at most about 10 MB).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_cached_rollouts: int = DEFAULT_CACHED_ROLLOUTS,
        max_cached_tokens: int = DEFAULT_CACHED_TOKENS,
    ) -> None:
        if max_cached_rollouts < 1:
            raise ValueError("max_cached_rollouts must be at least 1")
        if max_cached_tokens < 0:
            raise ValueError("max_cached_tokens must not be negative")
        self._root = os.fspath(root)
        self._native = _core.FileLineage(self._root, max_cached_rollouts, max_cached_tokens)

    def __repr__(self) -> str:
        return f"FileLineageStore({self._root!r})"

    @property
    def root(self) -> str:
        return self._root

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        """Synchronous `resolve` (blocks on the rollout's shared lock and file reads)."""
        return _resolve(self._native, rollout_id, request_items)

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """Return ROOT, RESOLVED with the verified parent, or UNRESOLVED with a reason.

        The arguments are checked when this is called (`TypeError` / `ValueError`). When it
        is awaited the request items are copied; hashing, the file check and materialization
        run on the native worker pool (no GIL, no thread hop), and only the answer is built
        on the loop.
        """
        validate_rollout_id(rollout_id)
        return self._resolve_job(rollout_id, request_list(request_items))

    async def _resolve_job(self, rollout_id: str, items: list[Any]) -> LineageResolution:
        job = self._native.prepare(rollout_id, items)
        if job is not None:
            await _native_job(self._native.submit, job)
            raw = self._native.finish(job)
            if raw is not None:
                return _resolution(raw)
        return await _off_loop(_resolve_in_python, self._native, rollout_id, items)

    def is_process_shared(self) -> bool:
        return True

    def cached_tokens(self) -> int:
        """Tokens held by the materialized-sequence cache."""
        return self._native.cached_tokens()

    def cached_rollouts(self) -> int:
        return self._native.cached_rollouts()

    async def close(self) -> None:
        """Drop the caches and their descriptors. Idempotent; the store stays usable."""
        self._native.clear()


def _with_parent_length(resolution: LineageResolution) -> LineageResolution:
    """NeMo Gym's in-memory resolver reports the parent's cumulative length as the match's
    `prev_len` (its file resolver leaves it 0, and so does ours): match it, as a drop-in."""
    match = resolution.match
    if match is None:
        return resolution
    return LineageResolution(
        resolution.status,
        match=dataclasses.replace(match, prev_len=len(match.cumulative_token_ids)),
        reason=resolution.reason,
    )


@instrumented(
    "lineage",
    "memory",
    {
        "put_now": "put",
        "put": "put",
        "resolve_now": "resolve",
        "resolve": "resolve",
        "delete_now": "delete",
        "delete": "delete",
    },
)
class InMemoryLineageStore:
    """A bounded, single-process `LineageResolver` fed by `put`.

    At most `max_rollouts` rollouts (LRU) and `max_tokens` tokens of stored entries; eviction
    never removes the most recently used rollout, so a single rollout larger than the budget is
    kept. Materialized cumulative sequences are cached separately, up to `max_cached_tokens`
    (default: a quarter of `max_tokens`). Reusing a model_call_id with a different payload raises
    `TokenCaptureConflictError` and removes that call from resolution.
    """

    def __init__(
        self,
        max_rollouts: int = 512,
        max_tokens: int = 8_000_000,
        *,
        max_cached_tokens: int | None = None,
    ) -> None:
        if max_rollouts < 1:
            raise ValueError("max_rollouts must be at least 1")
        if max_tokens < 0:
            raise ValueError("max_tokens must not be negative")
        cached = max_tokens // 4 if max_cached_tokens is None else max_cached_tokens
        if cached < 0:
            raise ValueError("max_cached_tokens must not be negative")
        self._native = _core.MemoryLineage(max_rollouts, max_tokens, cached)
        # The call ids put per rollout, for the delta-parent check of `put` (the native index
        # cannot be asked). Kept for up to 4x the native LRU's rollouts, touched on every put
        # and resolve, so it holds at least every rollout the native index still holds.
        self._seen: OrderedDict[str, set[str]] = OrderedDict()
        self._seen_rollouts = 4 * max_rollouts

    def _check_put(self, entry: object) -> tuple[TokenEntry, bytes]:
        """Check an entry for `put`: its type, fields, canonical line and delta parent."""
        token_entry = _as_token_entry(entry)
        rollout_id = validate_rollout_id(token_entry.rollout_id)
        line = canonical_line(token_entry)
        parent = token_entry.parent_call_id
        if token_entry.prompt_is_delta and parent not in self._seen.get(rollout_id, ()):
            raise ValueError(
                "delta records require a durable-log-backed lineage store: entry "
                f"{token_entry.model_call_id!r} of rollout {rollout_id!r} stores its prompt as "
                f"a delta of {parent!r}, which this in-memory store does not hold (never put, "
                "deleted or evicted), so its tokens could never be rebuilt. Put the parent "
                "first, or resolve over a FileLineageStore"
            )
        return token_entry, line

    def _index(self, entry: TokenEntry, line: bytes) -> bool:
        rollout_id = entry.rollout_id
        added = self._native.put(rollout_id, line)
        seen = self._seen.get(rollout_id)
        if seen is None:
            seen = self._seen[rollout_id] = set()
            while len(self._seen) > self._seen_rollouts:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(rollout_id)
        seen.add(entry.model_call_id)
        return added

    def _touch(self, rollout_id: str) -> None:
        if rollout_id in self._seen:
            self._seen.move_to_end(rollout_id)

    def put_now(self, entry: TokenEntry) -> bool:
        """Index one entry; False when the identical entry was already indexed.

        A delta entry (`prompt_is_delta`) whose parent this store does not hold is refused
        with `ValueError`, as NeMo Gym's in-memory store refuses delta entries.
        """
        return self._index(*self._check_put(entry))

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Index one entry (the `TokenSink.put` shape). The entry is checked when this is
        called (`TypeError` / `ValueError`), indexed when it is awaited."""
        return self._put_job(*self._check_put(entry))

    async def _put_job(self, entry: TokenEntry, line: bytes) -> None:
        self._index(entry, line)

    def resolve_now(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        resolution = _with_parent_length(_resolve(self._native, rollout_id, request_items))
        self._touch(rollout_id)
        return resolution

    def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> Coroutine[Any, Any, LineageResolution]:
        """`resolve_now` when awaited; the arguments are checked when this is called."""
        validate_rollout_id(rollout_id)
        return self._resolve_job(rollout_id, request_list(request_items))

    async def _resolve_job(self, rollout_id: str, items: list[Any]) -> LineageResolution:
        resolution = _with_parent_length(_resolve(self._native, rollout_id, items))
        self._touch(rollout_id)
        return resolution

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Forget rollouts, so a reused id starts empty."""
        removed, absent = self._native.delete(validate_rollout_ids(rollout_ids))
        for rollout_id in (*removed, *absent):
            self._seen.pop(rollout_id, None)
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`delete_now` when awaited; the batch is validated when this is called."""
        return self._delete_job(validate_rollout_ids(rollout_ids))

    async def _delete_job(self, rollout_ids: list[str]) -> RolloutRemovalPayload:
        return self.delete_now(rollout_ids)

    def is_process_shared(self) -> bool:
        return False

    def stored_tokens(self) -> int:
        return self._native.stored_tokens()

    def rollout_count(self) -> int:
        return self._native.rollout_count()

    def cached_tokens(self) -> int:
        return self._native.cached_tokens()

    async def close(self) -> None:
        """Forget everything. Idempotent."""
        self._native.clear()
        self._seen.clear()


def encode_delta(entry: TokenEntry, parent: LineageResolution | LineageMatch) -> TokenEntry:
    """Return a copy of `entry` stamped with its RESOLVED parent, its prompt stored as a delta.

    When the prompt extends the parent's cumulative tokens exactly, the copy keeps only the
    suffix past them (`prompt_is_delta=True`); otherwise it keeps the full prompt. Either way
    `cum_len` and `digest` describe the full cumulative sequence (parent + suffix + generation, or
    prompt + generation), which is what a resolver rebuilds and verifies.
    """
    match = parent.match if isinstance(parent, LineageResolution) else parent
    if match is None:
        status = parent.status.value if isinstance(parent, LineageResolution) else "?"
        raise ValueError(f"encode_delta needs a RESOLVED lineage decision, got {status!r}")
    if entry.prompt_is_delta:
        raise ValueError(f"entry {entry.model_call_id!r} already stores its prompt as a delta")
    prefix = match.cumulative_token_ids
    prompt = entry.prompt_token_ids
    copy = entry.model_copy()
    if _core.tokens_extend(prefix, prompt):
        full = [*prompt, *entry.generation_token_ids]
        copy.prompt_token_ids = list(prompt[len(prefix) :])
        copy.prompt_is_delta = True
        return stamp_lineage(
            copy,
            match.model_call_id,
            parent_resolution=ParentResolutionStatus.RESOLVED,
            cumulative=full,
        )
    return stamp_lineage(
        copy, match.model_call_id, parent_resolution=ParentResolutionStatus.RESOLVED
    )
