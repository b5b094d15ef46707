"""Check a token-capture implementation against the sink, source, lineage and ledger contracts.

A training framework that brings its own transport (a `TokenSink` in its inference workers, a
`TokenSource` in its trainer, a `LineageResolver`, a `CaptureLedger`) runs this suite to learn
whether Gym can rely on it. Each check is a small scenario over its own rollout id; the suite
creates fresh clients for every role it plays, so a check also proves that a write made through
one client is visible through another (the situation of separate server workers).

Factories
    Zero-argument callables, sync or async, that return a *fresh* client over *one shared*
    backend each time they are called (for the file store: ``lambda: TokenCaptureStore(root)``
    with the same ``root``). Every client the suite makes is closed (``await client.close()``),
    whether its check passed or not. ``source_factory`` may be the sink factory when one class
    plays both roles.

Checks (`CHECKS`, in the order they run; each relies only on behaviour checked before it)
    ``put_then_freeze``, ``idempotent_reput``, ``conflicting_reput_fails_closed``,
    ``freeze_idempotent``, ``conditional_drop``, ``write_after_freeze``,
    ``mark_incomplete_durable``, ``retire_fences``, ``delete_allows_reuse``,
    ``batch_validation`` (the retire/delete checks are skipped, with the reason, when the source
    lacks those optional methods); with a sink that has ``begin_call``:
    ``dangling_intent_masks``; with a ``process_factory``: ``visible_across_processes`` (a put
    made here is frozen by another process, which sees the same snapshot; its puts and marks are
    seen here); with a lineage factory: ``lineage_visible_to_existing_and_fresh``,
    ``lineage_rewritten_context_unresolved``, ``lineage_root_without_history``; with a ledger
    factory (``retire``/``delete`` optional, as for the source): ``ledger_round_trip``,
    ``ledger_replay_and_conflict``, ``ledger_failure_rows``,
    ``ledger_fence_after_retire``, ``ledger_reuse_after_delete``. A check whose capability is
    absent is skipped: it is not reported as passed. Lineage and ledger checks also require
    that a call of one rollout never resolves a continuation asked in another.

Processes
    ``process_factory`` is called in a *spawned* process, so it must pickle: a module-level
    class or function, or a ``functools.partial`` of one (``functools.partial(MyStore, url)``),
    never a lambda or a local function (the check fails saying so). A script that runs the
    suite needs the ``if __name__ == "__main__":`` guard, as the child imports its main module
    again. Without a process factory, ``visible_across_processes`` is skipped with that reason:
    in ``run_conformance``'s result (``.skipped``), as a pytest skip, and as a ``SKIP`` line of
    the command line (``--process module:factory``).

Staging
    The staging sink and source (NeMo Gym's worker-owned staging) have their own checks,
    `STAGING_CHECKS`, run with `run_staging_conformance`, `run_staging_check` or
    `pytest_staging_checks`; they are synchronous, as the staging protocols are. See
    `tokencapture.conformance_staging`.

Running it
    ``await run_conformance(sink_factory, source_factory, lineage_factory, ledger_factory)``
    returns the names of the checks that passed (a `ConformanceResults`: a ``list[str]`` whose
    ``.skipped`` maps each skipped check to its reason) and raises `ConformanceError` (an
    ``AssertionError`` with ``.check`` and ``.detail``) at the first failure. An unexpected
    exception from the implementation is reported as a failure of the check that hit it, with
    the original exception chained. ``run_conformance_sync(...)`` does the same from sync code.
    Exceptions are recognised by class or by name, so an implementation that raises NeMo Gym's
    own ``TokenCaptureFrozenError`` is judged the same as one raising tokencapture's; a bare
    ``RuntimeError`` (what NeMo Gym 0.7.0's own file store raises on a write after freeze) is
    not, and the failure names what was raised and what is expected. ``drop`` is called with
    ``snapshot_id=`` and ``version=`` by keyword, which fits both signatures.

In pytest, one line per implementation (each check becomes its own test case; the factories
may take a directory argument, in which case each test passes its own ``tmp_path``)::

    # tests/test_my_transport_conformance.py
    from tokencapture.conformance import pytest_checks
    from my_framework.capture import MySink, MySource, MyResolver

    test_token_capture_conformance = pytest_checks(MySink, MySource, lineage_factory=MyResolver)

When the factories need your own fixtures (a server URL, a client pool), parametrize yourself
and call `run_check`, which returns False when the check does not apply::

    import pytest
    from tokencapture.conformance import CHECKS, run_check

    @pytest.mark.parametrize("check", CHECKS)
    async def test_conformance(check: str, capture_server) -> None:
        applies = await run_check(
            check,
            lambda: MySink(capture_server.url),
            lambda: MySource(capture_server.url),
        )
        if not applies:
            pytest.skip(f"{check} needs a capability this transport does not provide")

From a shell (exit status 0 when every applicable check passes, 1 otherwise)::

    python -m tokencapture.conformance tokencapture.store:TokenCaptureStore \\
        --lineage tokencapture.lineage:FileLineageStore \\
        --process tokencapture.store:TokenCaptureStore

Each ``module:factory`` names a callable; ``--source`` defaults to the sink factory. A factory
that takes one parameter receives a directory: ``--dir DIR``, or a fresh temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import importlib
import inspect
import logging
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from uuid import uuid4

import orjson

from tokencapture.conformance_runner import (
    NO_PROCESS_FACTORY,
    ConformanceResults,
    Outcome,
    SkipCheck,
    bind_directory,
    describe_error,
    receive,
    spawned,
    with_close_errors,
)
from tokencapture.conformance_staging import (
    STAGING_CHECKS,
    StagingConformanceError,
    pytest_staging_checks,
    run_staging_check,
    run_staging_conformance,
)
from tokencapture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from tokencapture.lineage import stamp_continuation
from tokencapture.protocols import (
    CaptureLedger,
    LineageResolution,
    LineageResolver,
    RolloutRetiredError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
)
from tokencapture.records import (
    TOKEN_FIELDS,
    UNCOMMITTED_CALL_REASON,
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    stamp_lineage,
)
from tokencapture.staging_records import (
    CallRecord,
    CaptureLedgerCommit,
    RolloutManifest,
    RolloutRemoval,
)

__all__ = [
    "CHECKS",
    "STAGING_CHECKS",
    "ConformanceError",
    "ConformanceResults",
    "StagingConformanceError",
    "main",
    "pytest_checks",
    "pytest_staging_checks",
    "run_check",
    "run_conformance",
    "run_conformance_sync",
    "run_staging_check",
    "run_staging_conformance",
]

_T = TypeVar("_T")
_Factory = Callable[[], _T | Awaitable[_T]]

SinkFactory = Callable[[], TokenSink | Awaitable[TokenSink]]
SourceFactory = Callable[[], TokenSource | Awaitable[TokenSource]]
LineageFactory = Callable[[], LineageResolver | Awaitable[LineageResolver]]
LedgerFactory = Callable[[], CaptureLedger | Awaitable[CaptureLedger]]

_ROLLOUT_ID = re.compile(r"[A-Za-z0-9._-]+")


class ConformanceError(AssertionError):
    """An implementation broke the contract that the check named `check` verifies."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(check, detail)
        self.check = check
        self.detail = detail

    def __str__(self) -> str:
        return f"conformance check {self.check!r} failed: {self.detail}"


# --- The per-check context -------------------------------------------------------------------


async def _call_factory(factory: Callable[[], Any]) -> Any:
    client = factory()
    if inspect.isawaitable(client):
        client = await client
    return client


class _Context:
    """What one check runs with: fresh clients on demand (all closed afterwards), rollout ids."""

    def __init__(
        self,
        check: str,
        rollout_id: str,
        sink_factory: SinkFactory,
        source_factory: SourceFactory,
        lineage_factory: LineageFactory | None,
        ledger_factory: LedgerFactory | None,
        process_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.check = check
        self._prefix = f"{rollout_id}-{check}-{uuid4().hex[:8]}"
        self._sink_factory = sink_factory
        self._source_factory = source_factory
        self._lineage_factory = lineage_factory
        self._ledger_factory = ledger_factory
        self.process_factory = process_factory
        self._clients: list[Any] = []

    def rollout(self, suffix: str = "") -> str:
        """This check's rollout id; a suffix names a second rollout of the same check."""
        return f"{self._prefix}-{suffix}" if suffix else self._prefix

    def fail(self, detail: str) -> NoReturn:
        raise ConformanceError(self.check, detail)

    def error(self, detail: str) -> ConformanceError:
        return ConformanceError(self.check, detail)

    def expect(self, condition: bool, detail: str) -> None:
        if not condition:
            self.fail(detail)

    async def _make(self, factory: Callable[[], Any] | None, role: str) -> Any:
        if factory is None:
            raise SkipCheck(f"no {role} factory was given")
        try:
            client = await _call_factory(factory)
        except Exception as exc:
            raise ConformanceError(
                self.check, f"the {role} factory raised {type(exc).__name__}: {exc}"
            ) from exc
        if client is None:
            self.fail(f"the {role} factory returned None")
        self._clients.append(client)
        return client

    async def sink(self) -> TokenSink:
        client: TokenSink = await self._make(self._sink_factory, "sink")
        return client

    async def source(self) -> TokenSource:
        client: TokenSource = await self._make(self._source_factory, "source")
        return client

    async def lineage(self) -> LineageResolver:
        client: LineageResolver = await self._make(self._lineage_factory, "lineage")
        return client

    async def ledger(self) -> CaptureLedger:
        client: CaptureLedger = await self._make(self._ledger_factory, "ledger")
        return client

    async def close_all(self) -> list[BaseException]:
        """Close every client made (each distinct object once, newest first)."""
        errors: list[BaseException] = []
        seen: set[int] = set()
        for client in reversed(self._clients):
            if id(client) in seen:
                continue
            seen.add(id(client))
            try:
                result = client.close()
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                errors.append(exc)
        self._clients.clear()
        return errors


_CheckFunc = Callable[[_Context], Awaitable[None]]


@dataclass(frozen=True)
class _CheckSpec:
    name: str
    func: _CheckFunc
    needs: str  # "", "lineage" or "ledger"


_REGISTRY: dict[str, _CheckSpec] = {}


def _check(name: str, needs: str = "") -> Callable[[_CheckFunc], _CheckFunc]:
    def register(func: _CheckFunc) -> _CheckFunc:
        _REGISTRY[name] = _CheckSpec(name, func, needs)
        return func

    return register


# --- Helpers shared by the checks ------------------------------------------------------------


def _is_error(exc: BaseException, cls: type[BaseException]) -> bool:
    """`exc` is a `cls`, or an exception class of the same name (NeMo Gym's own, for one)."""
    return isinstance(exc, cls) or any(base.__name__ == cls.__name__ for base in type(exc).__mro__)


def _unexpected(exc: BaseException, cls: type[BaseException]) -> str:
    """What was raised instead of `cls`, with the hint NeMo Gym 0.7.0's own store needs."""
    text = f"raised {describe_error(exc)}, expected {cls.__name__}"
    if type(exc) is RuntimeError and issubclass(cls, RuntimeError):
        # NeMo Gym 0.7.0's TokenCaptureStore raises a bare RuntimeError here. Kept strict: a
        # caller drops a fenced write silently but must treat a bare RuntimeError as a failure.
        text += (
            f" (a bare RuntimeError is not a {cls.__name__}, a RuntimeError subclass matched by "
            "class or name: NeMo Gym 0.7.0's TokenCaptureStore raises the bare one)"
        )
    return text


def _optional(ctx: _Context, client: Any, name: str) -> Callable[..., Awaitable[Any]]:
    """`client.name`, or a skip: retire and delete are optional (install_token_source and
    NeMo Gym's in-memory lineage store do without them)."""
    method = getattr(client, name, None)
    if not callable(method):
        raise SkipCheck(
            f"the {type(client).__name__} has no {name}(rollout_ids) (an optional method)"
        )
    bound: Callable[..., Awaitable[Any]] = method
    return bound


async def _drop(source: TokenSource, rollout_id: str, snapshot_id: str, version: int) -> Any:
    # By keyword: NeMo Gym 0.7.0's protocol makes them keyword-only, ours takes either.
    return await source.drop(rollout_id, snapshot_id=snapshot_id, version=version)


def _canonical(entry: Any) -> bytes:
    """The canonical bytes of an entry (any pydantic model with TokenEntry's fields)."""
    return orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


_EXTRA_FIELD = "conformance_extra"


def _entry(rollout_id: str, call_id: str, variant: int = 0, **fields: Any) -> TokenEntry:
    """A realistic entry: unicode output, awkward floats, routed experts and an unknown field."""
    base = 1000 * (variant + 1)
    prompt = [151643, 0, 2**31 + 5, *range(base, base + 61)]
    generation = [base + 7, base + 11, 2**31 - 1]
    values: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "conformance/model-ü",
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.1234567890123456, -1.25e-07, -0.0],
        "routed_experts": [[3, 7], [1, 2], [0, 5]],
        "output_items": [
            {"role": "assistant", "content": f'answer {variant}: ünïcødé ✓ "quoted"\n'}
        ],
        "token_item_index": 0,
        "response_id": f"resp-{call_id}-{variant}",
        "created_at": 1718000000.123456 + variant,
        _EXTRA_FIELD: {"note": "kept ✓", "nested": [1, 2.5, None, True, "x"], "variant": variant},
    }
    values.update(fields)
    return TokenEntry.model_validate(values)


def _snapshot_fields(ctx: _Context, snapshot: Any, rollout_id: str) -> TokenCaptureSnapshot:
    """Check the shape of a snapshot and return it as ours (entries as given)."""
    try:
        fields = (
            snapshot.rollout_id,
            tuple(snapshot.entries),
            snapshot.incomplete,
            snapshot.snapshot_id,
            snapshot.version,
        )
    except AttributeError as exc:
        ctx.fail(f"freeze returned {type(snapshot).__name__}, not a snapshot: {exc}")
    result = TokenCaptureSnapshot(*fields)
    ctx.expect(
        result.rollout_id == rollout_id,
        f"freeze({rollout_id!r}) returned a snapshot of rollout {result.rollout_id!r}",
    )
    ctx.expect(
        isinstance(result.snapshot_id, str) and result.snapshot_id != "",
        f"snapshot_id must be a non-empty str, got {result.snapshot_id!r}",
    )
    ctx.expect(
        isinstance(result.version, int) and not isinstance(result.version, bool),
        f"version must be an int, got {result.version!r}",
    )
    ctx.expect(
        isinstance(result.incomplete, bool),
        f"incomplete must be a bool, got {result.incomplete!r}",
    )
    seen: set[str] = set()
    for entry in result.entries:
        ctx.expect(
            entry.rollout_id == rollout_id,
            f"the snapshot of {rollout_id!r} holds an entry of rollout {entry.rollout_id!r}",
        )
        ctx.expect(
            entry.model_call_id not in seen,
            f"the snapshot holds model_call_id {entry.model_call_id!r} more than once "
            "(entries must be unique per call id)",
        )
        seen.add(entry.model_call_id)
    return result


async def _freeze(
    ctx: _Context, rollout_id: str, source: TokenSource | None = None
) -> TokenCaptureSnapshot:
    """Freeze through `source`, or through a fresh source client."""
    if source is None:
        source = await ctx.source()
    return _snapshot_fields(ctx, await source.freeze(rollout_id), rollout_id)


def _by_call(snapshot: TokenCaptureSnapshot) -> dict[str, bytes]:
    return {entry.model_call_id: _canonical(entry) for entry in snapshot.entries}


def _expect_entries(
    ctx: _Context, snapshot: TokenCaptureSnapshot, expected: Iterable[TokenEntry], when: str
) -> None:
    """The snapshot holds exactly `expected`, byte for byte in canonical form."""
    want = {entry.model_call_id: _canonical(entry) for entry in expected}
    got = _by_call(snapshot)
    if set(got) != set(want):
        ctx.fail(f"{when}: the snapshot holds calls {sorted(got)}, expected {sorted(want)}")
    for call_id, line in want.items():
        if got[call_id] != line:
            ctx.fail(
                f"{when}: entry {call_id!r} does not round-trip byte for byte: stored "
                f"{line.decode()[:300]}... but read back {got[call_id].decode()[:300]}..."
            )


def _expect_same_snapshot(
    ctx: _Context, first: TokenCaptureSnapshot, again: TokenCaptureSnapshot, when: str
) -> None:
    ctx.expect(
        (again.snapshot_id, again.version) == (first.snapshot_id, first.version),
        f"{when}: freeze returned snapshot {again.snapshot_id!r} version {again.version}, "
        f"expected the unchanged {first.snapshot_id!r} version {first.version}",
    )
    ctx.expect(
        again.incomplete == first.incomplete,
        f"{when}: incomplete changed from {first.incomplete} to {again.incomplete}",
    )
    ctx.expect(
        _by_call(again) == _by_call(first),
        f"{when}: the entries changed from {sorted(_by_call(first))} to {sorted(_by_call(again))}",
    )


def _expect_removal(ctx: _Context, payload: Any, what: str) -> tuple[list[str], list[str]]:
    """Check the wire shape `{"removed": [...], "absent": [...]}` and return both lists."""
    if not isinstance(payload, Mapping) or set(payload) != {"removed", "absent"}:
        ctx.fail(f"{what} must return {{'removed': [...], 'absent': [...]}}, got {payload!r}")
    removed, absent = payload["removed"], payload["absent"]
    for key, value in (("removed", removed), ("absent", absent)):
        ctx.expect(
            isinstance(value, list) and all(isinstance(item, str) for item in value),
            f"{what}: {key!r} must be a list of str, got {value!r}",
        )
    try:
        RolloutRemoval.model_validate({"removed": removed, "absent": absent})
    except ValueError as exc:
        ctx.fail(f"{what} returned {payload!r}, which is not a valid RolloutRemoval: {exc}")
    return list(removed), list(absent)


async def _put_refused(
    ctx: _Context, sink: TokenSink, entry: TokenEntry, cls: type[BaseException], when: str
) -> None:
    """`sink.put(entry)` must raise `cls` (by class or name)."""
    await _refused(ctx, functools.partial(sink.put, entry), cls, f"{when}: put")


async def _refused(
    ctx: _Context, call: Callable[[], Awaitable[Any]], cls: type[BaseException], what: str
) -> None:
    """`call()` must raise `cls` (by class or name)."""
    try:
        result = await call()
    except Exception as exc:
        if not _is_error(exc, cls):
            raise ConformanceError(ctx.check, f"{what} {_unexpected(exc, cls)}") from exc
        return
    ctx.fail(f"{what} returned {result!r}, expected {cls.__name__}")


# --- Sink and source checks ------------------------------------------------------------------


@_check("put_then_freeze")
async def _put_then_freeze(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    sink = await ctx.sink()
    entries = [_entry(rollout_id, "call-1"), _entry(rollout_id, "call-2", 1)]
    for entry in entries:
        await sink.put(entry)
    snapshot = await _freeze(ctx, rollout_id)
    _expect_entries(ctx, snapshot, entries, "freezing from a fresh source after two puts")
    ctx.expect(not snapshot.incomplete, "a rollout with only successful puts froze incomplete")
    extra = [getattr(entry, _EXTRA_FIELD, None) for entry in snapshot.entries]
    ctx.expect(
        all(value is not None for value in extra),
        f"the unknown field {_EXTRA_FIELD!r} was not kept as an attribute of the read entries",
    )


@_check("idempotent_reput")
async def _idempotent_reput(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    entry = _entry(rollout_id, "call-1")
    first, second = await ctx.sink(), await ctx.sink()
    await first.put(entry)
    await first.put(entry)
    # A retry from another worker resends the same bytes in a rebuilt object.
    await second.put(TokenEntry.model_validate_json(_canonical(entry)))
    snapshot = await _freeze(ctx, rollout_id)
    _expect_entries(ctx, snapshot, [entry], "after putting one entry three times")
    ctx.expect(not snapshot.incomplete, "re-putting an identical entry made the rollout incomplete")
    # An identical re-put after the freeze is either refused as frozen or a no-op: it must not
    # move the version (that would stale the retirement of a snapshot nothing changed).
    try:
        await (await ctx.sink()).put(entry)
    except Exception as exc:
        if not _is_error(exc, TokenCaptureFrozenError):
            raise ConformanceError(
                ctx.check,
                f"an identical re-put after freeze {_unexpected(exc, TokenCaptureFrozenError)} "
                "or a no-op",
            ) from exc
    again = await _freeze(ctx, rollout_id)
    _expect_same_snapshot(ctx, snapshot, again, "after an identical re-put following the freeze")


async def _put_then_put_again(
    ctx: _Context, first: TokenEntry, again: TokenEntry
) -> tuple[bool, TokenCaptureSnapshot]:
    """Put `first`, then `again` (the same call id) from another client: whether the second
    put raised, and the rollout's freeze afterwards."""
    await (await ctx.sink()).put(first)
    raised = False
    try:
        await (await ctx.sink()).put(again)
    except Exception:
        raised = True
    return raised, await _freeze(ctx, first.rollout_id)


@_check("conflicting_reput_fails_closed")
async def _conflicting_reput(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    original = _entry(rollout_id, "call-1")
    conflicting = _entry(rollout_id, "call-1", 1)
    raised, snapshot = await _put_then_put_again(ctx, original, conflicting)
    stored = _by_call(snapshot).get("call-1")
    if not raised:
        ctx.expect(
            snapshot.incomplete,
            "a put reusing a model_call_id with a different payload succeeded and the snapshot "
            "is not incomplete (the conflict must fail the put or mask the rollout)",
        )
    elif not snapshot.incomplete:
        ctx.expect(
            stored == _canonical(original),
            "the conflicting put raised, but the stored entry is no longer the original payload",
        )
    # "Same payload" is the whole serialized entry, not the tokens: the same token ids with
    # other log-probs (and a later timestamp) are a rebuilt entry, so a conflict, not a retry.
    subtle_id = ctx.rollout("same-tokens")
    first = _entry(subtle_id, "call-1")
    rebuilt = first.model_copy(
        update={"generation_log_probs": [-0.5, -0.25, -2.0], "created_at": first.created_at + 1}
    )
    refused, snapshot = await _put_then_put_again(ctx, first, rebuilt)
    ctx.expect(
        refused or snapshot.incomplete,
        "a re-put with the same token ids but other log-probs and created_at succeeded and the "
        "snapshot is not incomplete: only a byte-identical entry is a retry (raise "
        "TokenCaptureConflictError, or mask the rollout)",
    )


@_check("freeze_idempotent")
async def _freeze_idempotent(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    sink = await ctx.sink()
    entries = [_entry(rollout_id, "call-1"), _entry(rollout_id, "call-2", 1)]
    for entry in entries:
        await sink.put(entry)
    source = await ctx.source()
    first = await _freeze(ctx, rollout_id, source)
    _expect_entries(ctx, first, entries, "first freeze")
    for when, again in (
        ("freezing from a fresh source", await _freeze(ctx, rollout_id)),
        ("freezing from another fresh source", await _freeze(ctx, rollout_id)),
        ("freezing again from the first source", await _freeze(ctx, rollout_id, source)),
    ):
        _expect_same_snapshot(ctx, first, again, when)


@_check("conditional_drop")
async def _conditional_drop(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    entry = _entry(rollout_id, "call-1")
    await (await ctx.sink()).put(entry)
    snapshot = await _freeze(ctx, rollout_id)
    source = await ctx.source()
    stale = [
        (snapshot.snapshot_id, snapshot.version + 1, "a newer version"),
        (snapshot.snapshot_id, snapshot.version - 1, "an older version"),
        (uuid4().hex, snapshot.version, "another snapshot id"),
    ]
    for snapshot_id, version, what in stale:
        dropped = await _drop(source, rollout_id, snapshot_id, version)
        ctx.expect(
            dropped is False,
            f"drop with {what} ({snapshot_id!r}, {version}) returned {dropped!r}, expected False "
            f"(the frozen snapshot is {snapshot.snapshot_id!r} version {snapshot.version})",
        )
    kept = await _freeze(ctx, rollout_id)
    _expect_same_snapshot(ctx, snapshot, kept, "after refused drops")
    _expect_entries(ctx, kept, [entry], "after refused drops (the evidence must stay readable)")
    dropped = await _drop(await ctx.source(), rollout_id, snapshot.snapshot_id, snapshot.version)
    ctx.expect(
        dropped is True, f"drop of the exact frozen snapshot returned {dropped!r}, expected True"
    )
    sink = await ctx.sink()
    for late in (_entry(rollout_id, "call-2", 1), entry):
        await _put_refused(
            ctx, sink, late, TokenCaptureFrozenError, "after the snapshot was dropped"
        )


@_check("write_after_freeze")
async def _write_after_freeze(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    first = _entry(rollout_id, "call-1")
    late = _entry(rollout_id, "call-2", 1)
    await (await ctx.sink()).put(first)
    snapshot = await _freeze(ctx, rollout_id)
    try:
        await (await ctx.sink()).put(late)
    except Exception as exc:
        if not _is_error(exc, TokenCaptureFrozenError):
            raise ConformanceError(
                ctx.check,
                f"a put after freeze {_unexpected(exc, TokenCaptureFrozenError)}",
            ) from exc
        again = await _freeze(ctx, rollout_id)
        _expect_same_snapshot(ctx, snapshot, again, "after a refused put following the freeze")
        return
    # A relaxed fence may let a racing write succeed, but then it must bump the version, so the
    # consumed snapshot can no longer be dropped and the late record stays as evidence.
    dropped = await _drop(await ctx.source(), rollout_id, snapshot.snapshot_id, snapshot.version)
    ctx.expect(
        dropped is False,
        "a put after freeze succeeded without changing the version: the stale snapshot was "
        "dropped, losing the late record (refuse it with TokenCaptureFrozenError, or bump the "
        "version)",
    )
    again = await _freeze(ctx, rollout_id)
    ctx.expect(
        again.version != snapshot.version,
        "a put after freeze succeeded but freezing again returns the same version",
    )
    ctx.expect(
        "call-2" in _by_call(again),
        "a put after freeze succeeded but its entry is not in the next snapshot",
    )


@_check("mark_incomplete_durable")
async def _mark_incomplete_durable(ctx: _Context) -> None:
    # Before any freeze: the mark is durable and visible to a fresh source.
    early = ctx.rollout("a")
    early_entry = _entry(early, "call-1")
    sink = await ctx.sink()
    await sink.put(early_entry)
    await sink.mark_incomplete(early, "call-2")
    marked = await _freeze(ctx, early)
    ctx.expect(marked.incomplete, "a fresh source does not see mark_incomplete as incomplete")
    _expect_entries(ctx, marked, [early_entry], "after mark_incomplete")
    # After a freeze that found the rollout complete (the late-failure case), and again after a
    # freeze that already found it incomplete: each mark succeeds, and each must move the
    # version so the retirement of the snapshot consumed before it fails.
    rollout_id = ctx.rollout("b")
    entry = _entry(rollout_id, "call-1")
    await (await ctx.sink()).put(entry)
    previous = await _freeze(ctx, rollout_id)
    ctx.expect(not previous.incomplete, "a rollout with only successful puts froze incomplete")
    for call_id in ("call-2", "call-3"):
        try:
            await (await ctx.sink()).mark_incomplete(rollout_id, call_id)
        except Exception as exc:
            raise ConformanceError(
                ctx.check,
                f"mark_incomplete after freeze must succeed, but raised {describe_error(exc)}",
            ) from exc
        later = await _freeze(ctx, rollout_id)
        ctx.expect(later.incomplete, "a fresh source does not see a mark after freeze")
        ctx.expect(
            later.version != previous.version,
            f"mark_incomplete after freeze left the version at {previous.version}: a stale "
            "retirement of the consumed snapshot would still succeed",
        )
        dropped = await _drop(
            await ctx.source(), rollout_id, previous.snapshot_id, previous.version
        )
        ctx.expect(
            dropped is False,
            f"drop of the snapshot frozen before the mark returned {dropped!r}, expected False",
        )
        _expect_entries(
            ctx,
            await _freeze(ctx, rollout_id),
            [entry],
            "after the stale drop (the evidence must stay readable)",
        )
        previous = later


@_check("retire_fences")
async def _retire_fences(ctx: _Context) -> None:
    written, unused = ctx.rollout("a"), ctx.rollout("b")
    retire = _optional(ctx, await ctx.source(), "retire")
    await (await ctx.sink()).put(_entry(written, "call-1"))
    removed, absent = _expect_removal(ctx, await retire([written, unused]), "retire")
    ctx.expect(
        removed == [written] and absent == [unused],
        f"retire of a rollout with records and one without returned removed={removed}, "
        f"absent={absent}; expected removed={[written]}, absent={[unused]}",
    )
    sink = await ctx.sink()
    for rollout_id in (written, unused):
        for call_id, variant in (("call-1", 0), ("call-9", 1)):
            await _put_refused(
                ctx,
                sink,
                _entry(rollout_id, call_id, variant),
                TokenCaptureRetiredError,
                f"after retiring {rollout_id!r}",
            )
        # The retired records are gone: freezing must not serve them (nor an empty snapshot
        # that would read as a rollout that made no calls), and a failure mark must not be
        # acknowledged into a rollout nobody will read again.
        await _refused(
            ctx,
            functools.partial(_freeze, ctx, rollout_id),
            TokenCaptureRetiredError,
            f"after retiring {rollout_id!r}, freeze",
        )
        await _refused(
            ctx,
            functools.partial(sink.mark_incomplete, rollout_id, "call-8"),
            TokenCaptureRetiredError,
            f"after retiring {rollout_id!r}, mark_incomplete",
        )
    removed, absent = _expect_removal(
        ctx,
        await _optional(ctx, await ctx.source(), "retire")([written, unused]),
        "a second retire",
    )
    ctx.expect(
        removed == [] and sorted(absent) == sorted([written, unused]),
        f"retiring again must be a no-op reporting every id as absent, got removed={removed}, "
        f"absent={absent}",
    )
    await _put_refused(
        ctx, sink, _entry(written, "call-2"), TokenCaptureRetiredError, "after retiring twice"
    )


@_check("delete_allows_reuse")
async def _delete_allows_reuse(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    source = await ctx.source()
    retire, delete = _optional(ctx, source, "retire"), _optional(ctx, source, "delete")
    sink = await ctx.sink()
    await sink.put(_entry(rollout_id, "call-1"))
    await sink.mark_incomplete(rollout_id, "call-x")
    _expect_removal(ctx, await retire([rollout_id]), "retire")
    removed, absent = _expect_removal(ctx, await delete([rollout_id]), "delete")
    ctx.expect(
        sorted(removed + absent) == [rollout_id],
        f"delete([{rollout_id!r}]) must report the id once, got removed={removed}, absent={absent}",
    )
    removed, absent = _expect_removal(
        ctx, await _optional(ctx, await ctx.source(), "delete")([rollout_id]), "a second delete"
    )
    ctx.expect(
        removed == [] and absent == [rollout_id],
        f"deleting again must be a no-op reporting the id as absent, got removed={removed}, "
        f"absent={absent}",
    )
    # The reused id starts empty: the old call id takes a new payload without a conflict, and
    # neither the old entries nor the old incomplete marker come back.
    reused = [_entry(rollout_id, "call-1", 2), _entry(rollout_id, "call-2", 3)]
    fresh_sink = await ctx.sink()
    for entry in reused:
        try:
            await fresh_sink.put(entry)
        except Exception as exc:
            raise ConformanceError(
                ctx.check,
                f"put of {entry.model_call_id!r} into the deleted and reused rollout raised "
                f"{describe_error(exc)}",
            ) from exc
    snapshot = await _freeze(ctx, rollout_id)
    _expect_entries(ctx, snapshot, reused, "freezing the reused rollout")
    ctx.expect(
        not snapshot.incomplete, "the reused rollout inherited the deleted one's incomplete mark"
    )


@_check("batch_validation")
async def _batch_validation(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    first = _entry(rollout_id, "call-1")
    await (await ctx.sink()).put(first)
    source = await ctx.source()
    bad_batch = [rollout_id, f"../{rollout_id}"]
    methods = [name for name in ("retire", "delete") if callable(getattr(source, name, None))]
    if not methods:
        raise SkipCheck(
            f"the {type(source).__name__} has neither retire nor delete (both optional)"
        )
    attempts: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
    for name in methods:
        method = getattr(source, name)
        attempts.append((f"{name}(<bare str>)", functools.partial(method, rollout_id)))
        attempts.append((f"{name}({bad_batch!r})", functools.partial(method, bad_batch)))
    for what, attempt in attempts:
        try:
            result = await attempt()
        except (TypeError, ValueError):
            continue
        except Exception as exc:
            raise ConformanceError(
                ctx.check, f"{what} raised {describe_error(exc)}, expected TypeError or ValueError"
            ) from exc
        ctx.fail(f"{what} returned {result!r}, expected TypeError or ValueError")
    # Nothing changed for the valid id: it is neither fenced nor emptied.
    second = _entry(rollout_id, "call-2", 1)
    try:
        await (await ctx.sink()).put(second)
    except Exception as exc:
        raise ConformanceError(
            ctx.check,
            f"after refused batches, a put to {rollout_id!r} raised {describe_error(exc)}: a batch "
            "holding an invalid id must change nothing",
        ) from exc
    _expect_entries(ctx, await _freeze(ctx, rollout_id), [first, second], "after refused batches")


@_check("dangling_intent_masks")
async def _dangling_intent_masks(ctx: _Context) -> None:
    sink = await ctx.sink()
    begin_call = getattr(sink, "begin_call", None)
    if not callable(begin_call):
        raise SkipCheck("the sink has no begin_call (an optional extension)")
    finished, dangling = ctx.rollout("a"), ctx.rollout("b")
    for rollout_id in (finished, dangling):
        await begin_call(rollout_id, "call-1")
        await sink.put(_entry(rollout_id, "call-1"))
    await begin_call(dangling, "call-2")
    snapshot = await _freeze(ctx, finished)
    ctx.expect(
        not snapshot.incomplete,
        "a rollout whose every begin_call was followed by its put froze incomplete",
    )
    snapshot = await _freeze(ctx, dangling)
    ctx.expect(
        snapshot.incomplete,
        "begin_call without a matching put did not make the frozen snapshot incomplete",
    )


# --- Across processes ------------------------------------------------------------------------


async def _other_process_job(
    factory: Callable[[], Any], frozen: str, lines: list[bytes], marked: str
) -> tuple[str, int, bool, list[bytes]]:
    """In the child: freeze what the parent put, then put `lines` and mark `marked`."""
    client = await _call_factory(factory)
    try:
        snapshot = await client.freeze(frozen)
        seen = (
            snapshot.snapshot_id,
            snapshot.version,
            snapshot.incomplete,
            sorted(_canonical(entry) for entry in snapshot.entries),
        )
        for line in lines:
            entry = TokenEntry.model_validate_json(line)
            await client.put(entry)
            if entry.rollout_id == marked:
                await client.mark_incomplete(marked, "call-9")
    finally:
        result = client.close()
        if inspect.isawaitable(result):
            await result
    return seen


def _in_other_process(
    factory: Callable[[], Any], job: tuple[str, list[bytes], str], conn: Any
) -> None:
    """The child side of `visible_across_processes` (runs in a spawned process)."""
    conn.send(("ok", asyncio.run(_other_process_job(factory, *job))))


@_check("visible_across_processes", needs="process")
async def _visible_across_processes(ctx: _Context) -> None:
    here, there, marked = ctx.rollout("here"), ctx.rollout("there"), ctx.rollout("marked")
    mine = [_entry(here, "call-1"), _entry(here, "call-2", 1)]
    sink = await ctx.sink()
    for entry in mine:
        await sink.put(entry)
    theirs = [_entry(there, "call-1", 2), _entry(there, "call-2", 3), _entry(marked, "call-1")]
    job = (here, [_canonical(entry) for entry in theirs], marked)
    with spawned(ctx.process_factory, _in_other_process, job, ctx.error) as conn:
        snapshot_id, version, incomplete, lines = receive(
            conn, "freezing and putting in another process", ctx.error
        )
    ctx.expect(
        lines == sorted(_canonical(entry) for entry in mine) and not incomplete,
        f"another process froze {len(lines)} entries (incomplete={incomplete}) of the "
        f"{len(mine)} put here: a put must be visible to every process before it returns",
    )
    # The freeze made there is the one every process sees: freezing here returns it.
    again = await _freeze(ctx, here)
    ctx.expect(
        (again.snapshot_id, again.version) == (snapshot_id, version),
        f"freezing here returned snapshot {again.snapshot_id!r} version {again.version}, but "
        f"another process froze {snapshot_id!r} version {version}",
    )
    _expect_entries(
        ctx, await _freeze(ctx, there), theirs[:2], "freezing entries put by another process"
    )
    snapshot = await _freeze(ctx, marked)
    ctx.expect(snapshot.incomplete, "a mark_incomplete made by another process is not seen here")
    _expect_entries(ctx, snapshot, theirs[2:], "freezing a rollout marked by another process")


# --- Lineage checks --------------------------------------------------------------------------

_SYSTEM = {"role": "system", "content": "You are a careful assistant."}
_USER = {"role": "user", "content": "What is 17 * 23? Explain."}


def _stamped(
    rollout_id: str,
    call_id: str,
    request_items: list[dict[str, Any]],
    variant: int,
    *,
    parent: tuple[str, list[int]] | None = None,
) -> tuple[TokenEntry, list[int]]:
    """A stamped entry and its cumulative tokens (a delta entry when `parent` is given)."""
    output = [{"role": "assistant", "content": f"Step {variant}: 17 * 23 = 391."}]
    if parent is None:
        entry = _entry(rollout_id, call_id, variant, output_items=output)
        cumulative = [*entry.prompt_token_ids, *entry.generation_token_ids]
        stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
    else:
        parent_id, parent_tokens = parent
        entry = _entry(
            rollout_id,
            call_id,
            variant,
            output_items=output,
            prompt_token_ids=[13, 198, 4000 + variant],
            prompt_is_delta=True,
            parent_call_id=parent_id,
            parent_resolution=ParentResolutionStatus.RESOLVED,
        )
        cumulative = [*parent_tokens, *entry.prompt_token_ids, *entry.generation_token_ids]
        stamp_lineage(
            entry,
            parent_id,
            parent_resolution=ParentResolutionStatus.RESOLVED,
            cumulative=cumulative,
        )
    return stamp_continuation(entry, request_items), cumulative


def _status(resolution: Any) -> str:
    status = getattr(resolution, "status", None)
    return str(getattr(status, "value", status))


def _expect_resolution(
    ctx: _Context,
    resolution: LineageResolution,
    call_id: str,
    cumulative: list[int],
    when: str,
) -> None:
    ctx.expect(
        _status(resolution) == ParentResolutionStatus.RESOLVED.value,
        f"{when}: resolve returned {_status(resolution)!r} "
        f"({getattr(resolution, 'reason', '')!r}), expected 'resolved' to {call_id!r}",
    )
    match = resolution.match
    if match is None:
        ctx.fail(f"{when}: a RESOLVED decision carries no match")
    ctx.expect(
        match.model_call_id == call_id,
        f"{when}: resolved to {match.model_call_id!r}, expected {call_id!r}",
    )
    ctx.expect(
        tuple(match.cumulative_token_ids) == tuple(cumulative),
        f"{when}: the match's cumulative tokens ({len(match.cumulative_token_ids)} ids) are not "
        f"the {len(cumulative)} of {call_id!r} (prompt + generation through its parent chain)",
    )
    ctx.expect(
        match.digest == compute_digest(cumulative),
        f"{when}: the match's digest {match.digest!r} is not the digest of its tokens",
    )


@_check("lineage_visible_to_existing_and_fresh", needs="lineage")
async def _lineage_visible(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    early = await ctx.lineage()
    request = [_SYSTEM, _USER]
    root, root_tokens = _stamped(rollout_id, "call-1", request, 0)
    continuation = [*request, *root.output_items, {"role": "user", "content": "Check it."}]
    before = await early.resolve(rollout_id, continuation)
    ctx.expect(
        _status(before) != ParentResolutionStatus.RESOLVED.value,
        "resolve found a parent before any entry was put",
    )
    await (await ctx.sink()).put(root)
    _expect_resolution(
        ctx,
        await early.resolve(rollout_id, continuation),
        "call-1",
        root_tokens,
        "a resolver created before the put",
    )
    _expect_resolution(
        ctx,
        await (await ctx.lineage()).resolve(rollout_id, continuation),
        "call-1",
        root_tokens,
        "a fresh resolver",
    )
    # The continuation itself, stored as a delta on top of its parent: resolving the next turn
    # must rebuild the cumulative tokens through the chain.
    child, child_tokens = _stamped(
        rollout_id, "call-2", continuation, 1, parent=("call-1", root_tokens)
    )
    await (await ctx.sink()).put(child)
    grandchild = [*continuation, *child.output_items, {"role": "user", "content": "Thanks."}]
    _expect_resolution(
        ctx,
        await early.resolve(rollout_id, grandchild),
        "call-2",
        child_tokens,
        "a resolver created before the delta put",
    )
    _expect_resolution(
        ctx,
        await (await ctx.lineage()).resolve(rollout_id, grandchild),
        "call-2",
        child_tokens,
        "a fresh resolver, after the delta put",
    )


@_check("lineage_rewritten_context_unresolved", needs="lineage")
async def _lineage_rewritten(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    request = [_SYSTEM, _USER]
    root, root_tokens = _stamped(rollout_id, "call-1", request, 0)
    await (await ctx.sink()).put(root)
    follow_up = {"role": "user", "content": "Check it."}
    resolver = await ctx.lineage()
    _expect_resolution(
        ctx,
        await resolver.resolve(rollout_id, [*request, *root.output_items, follow_up]),
        "call-1",
        root_tokens,
        "the unmodified continuation",
    )
    rewrites = {
        "a rewritten user turn": [
            _SYSTEM,
            {"role": "user", "content": "What is 17 * 24? Explain."},
        ],
        "a rewritten system prompt": [{"role": "system", "content": "Be brief."}, _USER],
        "a dropped system prompt": [_USER],
    }
    for what, context in rewrites.items():
        resolution = await (await ctx.lineage()).resolve(
            rollout_id, [*context, *root.output_items, follow_up]
        )
        ctx.expect(
            _status(resolution) == ParentResolutionStatus.UNRESOLVED.value
            and resolution.match is None,
            f"a continuation with {what} (same assistant turn) resolved as "
            f"{_status(resolution)!r} to "
            f"{getattr(resolution.match, 'model_call_id', None)!r}, expected 'unresolved'",
        )
    rewritten_answer = [*request, {"role": "assistant", "content": "It is 400."}, follow_up]
    resolution = await resolver.resolve(rollout_id, rewritten_answer)
    ctx.expect(
        _status(resolution) == ParentResolutionStatus.UNRESOLVED.value,
        f"a continuation with a rewritten assistant turn resolved as {_status(resolution)!r}",
    )
    # Lineage is per rollout: the unmodified continuation asked in another rollout (one that
    # has entries of its own) has no parent there.
    other = ctx.rollout("other")
    other_root, _ = _stamped(other, "call-1", [_SYSTEM, {"role": "user", "content": "Hi."}], 1)
    await (await ctx.sink()).put(other_root)
    for when, client in (("the resolver", resolver), ("a fresh resolver", await ctx.lineage())):
        resolution = await client.resolve(other, [*request, *root.output_items, follow_up])
        ctx.expect(
            _status(resolution) == ParentResolutionStatus.UNRESOLVED.value
            and resolution.match is None,
            f"{when}: the continuation of a call put only in {rollout_id!r}, asked in "
            f"{other!r}, resolved as {_status(resolution)!r} to "
            f"{getattr(resolution.match, 'model_call_id', None)!r}, expected 'unresolved'",
        )


@_check("lineage_root_without_history", needs="lineage")
async def _lineage_root(ctx: _Context) -> None:
    used, unused = ctx.rollout("a"), ctx.rollout("b")
    root, _ = _stamped(used, "call-1", [_SYSTEM, _USER], 0)
    await (await ctx.sink()).put(root)
    resolver = await ctx.lineage()
    requests = {
        "system + user": [_SYSTEM, _USER],
        "user only": [_USER],
        "two user turns": [_USER, {"role": "user", "content": "Also 3 * 4?"}],
    }
    for rollout_id in (used, unused):
        for what, request in requests.items():
            resolution = await resolver.resolve(rollout_id, request)
            ctx.expect(
                _status(resolution) == ParentResolutionStatus.ROOT.value
                and resolution.match is None,
                f"a request without model-authored items ({what}) on {rollout_id!r} resolved "
                f"as {_status(resolution)!r}, expected 'root' without a match",
            )


# --- Ledger checks ---------------------------------------------------------------------------


def _commit(rollout_id: str, call_id: str, variant: int = 0) -> CaptureLedgerCommit:
    """A root call's ledger commit, consistent with the fingerprints of its items."""
    request: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": f"Question {variant}: what is 17 * 23?"},
    ]
    response: list[dict[str, Any]] = [{"role": "assistant", "content": f"Answer {variant}: 391 ✓"}]
    tokens = list(range(500 + variant, 540 + variant))

    def sha(label: str) -> str:
        return hashlib.sha256(f"{label}:{call_id}:{variant}".encode()).hexdigest()

    record = CallRecord(
        model_call_id=call_id,
        prev_len=0,
        delta_len=len(tokens),
        cum_len=len(tokens),
        weight_version=variant,
        digest=sha("staged"),
        extras_digest=sha("extras"),
        staging_key=f"{rollout_id}/{call_id}",
        mode="text",
        chain_hash=sha("chain"),
        cumulative_hash=compute_digest(tokens),
        response_id=f"resp-{call_id}-{variant}",
        admitted_at=1_700_000_000.25 + variant,
        output_fingerprint=assistant_fingerprint(response),
        continuation_fingerprint=assistant_fingerprint([*request, *response]),
        # Only rows of the current fingerprint version resolve.
        fingerprint_version=FINGERPRINT_VERSION,
    )
    return CaptureLedgerCommit(
        rollout_id=rollout_id,
        record=record,
        staging_chain=(f"stage-{call_id}-{variant}",),
        request_items=request,
        response_items=response,
    )


def _continuation_of(commit: CaptureLedgerCommit) -> list[dict[str, Any]]:
    return [
        *commit.request_items,
        *commit.response_items,
        {"role": "user", "content": "Check it."},
    ]


_TOKEN_KEYS = frozenset({*TOKEN_FIELDS, "cumulative_token_ids", "token_ids"})


def _token_arrays(value: Any, path: str = "manifest") -> list[str]:
    """Paths in a manifest that look like token arrays (a token key, or a list of ints)."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key in _TOKEN_KEYS:
                found.append(f"{path}.{key}")
            found.extend(_token_arrays(item, f"{path}.{key}"))
    elif isinstance(value, list | tuple):
        if value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            found.append(path)
        for index, item in enumerate(value):
            found.extend(_token_arrays(item, f"{path}[{index}]"))
    return found


async def _manifest(ctx: _Context, ledger: CaptureLedger, rollout_id: str) -> RolloutManifest:
    raw = await ledger.manifest(rollout_id)
    ctx.expect(isinstance(raw, Mapping), f"manifest returned {type(raw).__name__}, not a dict")
    arrays = _token_arrays(raw)
    ctx.expect(not arrays, f"the manifest carries token arrays at {arrays}")
    try:
        manifest = RolloutManifest.model_validate(raw)
    except ValueError as exc:
        raise ConformanceError(
            ctx.check, f"the manifest does not validate as RolloutManifest: {exc}"
        ) from exc
    ctx.expect(
        manifest.rollout_id == rollout_id,
        f"manifest({rollout_id!r}) is the manifest of {manifest.rollout_id!r}",
    )
    return manifest


def _records(manifest: RolloutManifest) -> dict[str, CallRecord]:
    return {record.model_call_id: record for record in manifest.records}


@_check("ledger_round_trip", needs="ledger")
async def _ledger_round_trip(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    commit = _commit(rollout_id, "call-1")
    await (await ctx.ledger()).record(commit)
    fresh = await ctx.ledger()
    manifest = await _manifest(ctx, fresh, rollout_id)
    ctx.expect(
        list(_records(manifest)) == ["call-1"] and _records(manifest)["call-1"] == commit.record,
        f"the manifest's records are {[r.model_dump() for r in manifest.records]}, expected "
        f"exactly the recorded {commit.record.model_dump()}",
    )
    ctx.expect(not manifest.failures, f"unexpected failure rows {manifest.failures}")
    ctx.expect(await fresh.has_rows(rollout_id) is True, "has_rows is not True after a record")
    resolution = await fresh.resolve(rollout_id, _continuation_of(commit))
    ctx.expect(
        _status(resolution) == ParentResolutionStatus.RESOLVED.value
        and resolution.match is not None
        and resolution.match.model_call_id == "call-1"
        and resolution.match.digest == commit.record.cumulative_hash
        and resolution.match.chain_hash == commit.record.chain_hash
        and resolution.match.prev_len == commit.record.cum_len
        and tuple(resolution.match.staging_chain) == commit.staging_chain,
        f"a fresh ledger client resolved the continuation of the recorded call as "
        f"{_status(resolution)!r} ({getattr(resolution, 'reason', '')!r}) to "
        f"{getattr(resolution.match, 'model_call_id', None)!r}, expected 'call-1' with its "
        "cumulative hash as digest, its chain hash, its cum_len as prev_len and its staging chain",
    )
    # A second call of the rollout, from another client: rows accumulate, none replaces another.
    second = _commit(rollout_id, "call-2", 1)
    await (await ctx.ledger()).record(second)
    fresh = await ctx.ledger()
    manifest = await _manifest(ctx, fresh, rollout_id)
    ctx.expect(
        _records(manifest) == {"call-1": commit.record, "call-2": second.record},
        f"after recording two calls the manifest's records are "
        f"{sorted(_records(manifest))}, expected both, unchanged (a record must not replace "
        "the rollout's earlier rows)",
    )
    for recorded in (commit, second):
        resolution = await fresh.resolve(rollout_id, _continuation_of(recorded))
        ctx.expect(
            resolution.match is not None
            and resolution.match.model_call_id == recorded.record.model_call_id,
            f"after recording two calls, the continuation of "
            f"{recorded.record.model_call_id!r} resolved as {_status(resolution)!r} to "
            f"{getattr(resolution.match, 'model_call_id', None)!r}",
        )
    # Lineage is per rollout: the same continuation asked in another rollout has no parent.
    other = ctx.rollout("other")
    resolution = await fresh.resolve(other, _continuation_of(commit))
    ctx.expect(
        _status(resolution) == ParentResolutionStatus.UNRESOLVED.value and resolution.match is None,
        f"the continuation of a call recorded only in {rollout_id!r}, asked in {other!r}, "
        f"resolved as {_status(resolution)!r} to "
        f"{getattr(resolution.match, 'model_call_id', None)!r}, expected 'unresolved'",
    )


@_check("ledger_replay_and_conflict", needs="ledger")
async def _ledger_replay_and_conflict(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    commit = _commit(rollout_id, "call-1")
    await (await ctx.ledger()).record(commit)
    try:
        await (await ctx.ledger()).record(
            CaptureLedgerCommit.model_validate_json(commit.model_dump_json())
        )
    except Exception as exc:
        raise ConformanceError(
            ctx.check,
            f"replaying an identical commit raised {describe_error(exc)}; it must be a no-op",
        ) from exc
    manifest = await _manifest(ctx, await ctx.ledger(), rollout_id)
    ctx.expect(
        [record.model_call_id for record in manifest.records] == ["call-1"]
        and not manifest.failures,
        f"after a replay the manifest holds records {[r.model_call_id for r in manifest.records]}"
        f" and failures {list(manifest.failures)}, expected the one record",
    )
    raised = False
    try:
        await (await ctx.ledger()).record(_commit(rollout_id, "call-1", 1))
    except Exception:
        raised = True
    manifest = await _manifest(ctx, await ctx.ledger(), rollout_id)
    failed = any(failure.model_call_id == "call-1" for failure in manifest.failures)
    ctx.expect(
        raised or failed,
        "recording a different commit for an existing model_call_id neither raised nor left a "
        "failure row",
    )
    stored = _records(manifest).get("call-1")
    ctx.expect(
        failed or stored == commit.record,
        "the conflicting commit replaced the original record",
    )


@_check("ledger_failure_rows", needs="ledger")
async def _ledger_failure_rows(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    ledger = await ctx.ledger()
    ctx.expect(await ledger.has_rows(rollout_id) is False, "has_rows is True for an unused id")
    empty = await _manifest(ctx, ledger, rollout_id)
    ctx.expect(
        not empty.records and not empty.failures, "an unused rollout has a non-empty manifest"
    )
    await ledger.record_failure(rollout_id, "call-1", UNCOMMITTED_CALL_REASON)
    fresh = await ctx.ledger()
    ctx.expect(await fresh.has_rows(rollout_id) is True, "has_rows is not True after a failure row")
    await fresh.record(_commit(rollout_id, "call-2"))
    manifest = await _manifest(ctx, await ctx.ledger(), rollout_id)
    failures = [(failure.model_call_id, failure.reason) for failure in manifest.failures]
    ctx.expect(
        failures == [("call-1", UNCOMMITTED_CALL_REASON)],
        f"the manifest's failures are {failures}, expected {[('call-1', UNCOMMITTED_CALL_REASON)]}",
    )
    ctx.expect(
        list(_records(manifest)) == ["call-2"],
        f"the manifest's records are {list(_records(manifest))}, expected ['call-2'] (a failure "
        "row is not a record)",
    )


async def _expect_retired_read(
    ctx: _Context, read: Callable[[], Awaitable[Any]], what: str
) -> None:
    try:
        result = await read()
    except Exception as exc:
        if not _is_error(exc, RolloutRetiredError):
            raise ConformanceError(
                ctx.check,
                f"{what} of a retired rollout raised {describe_error(exc)}, expected "
                "RolloutRetiredError",
            ) from exc
        return
    ctx.fail(f"{what} of a retired rollout returned {result!r}, expected RolloutRetiredError")


@_check("ledger_fence_after_retire", needs="ledger")
async def _ledger_fence(ctx: _Context) -> None:
    rollout_id, unused = ctx.rollout("a"), ctx.rollout("b")
    retire = _optional(ctx, await ctx.ledger(), "retire")
    await (await ctx.ledger()).record(_commit(rollout_id, "call-1"))
    removed, absent = _expect_removal(ctx, await retire([rollout_id, unused]), "retire")
    ctx.expect(
        removed == [rollout_id] and absent == [unused],
        f"retire returned removed={removed}, absent={absent}; expected removed={[rollout_id]}, "
        f"absent={[unused]}",
    )
    ledger = await ctx.ledger()
    for target in (rollout_id, unused):
        await _expect_retired_read(ctx, functools.partial(ledger.manifest, target), "manifest")
        await _expect_retired_read(ctx, functools.partial(ledger.has_rows, target), "has_rows")
    late_writes: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("record", functools.partial(ledger.record, _commit(rollout_id, "call-2", 1))),
        (
            "record of the same call",
            functools.partial(ledger.record, _commit(rollout_id, "call-1")),
        ),
        (
            "record_failure",
            functools.partial(ledger.record_failure, rollout_id, "call-3", UNCOMMITTED_CALL_REASON),
        ),
        (
            "record into the retired unused id",
            functools.partial(ledger.record, _commit(unused, "c")),
        ),
    ]
    for what, write in late_writes:
        # Refusing a late write is as good as discarding it; starting a new ledger is not.
        with contextlib.suppress(Exception):
            await write()
        fresh = await ctx.ledger()
        for target in (rollout_id, unused):
            await _expect_retired_read(
                ctx, functools.partial(fresh.manifest, target), f"after a late {what}, manifest"
            )
    removed, absent = _expect_removal(
        ctx,
        await _optional(ctx, await ctx.ledger(), "retire")([rollout_id, unused]),
        "a second retire",
    )
    ctx.expect(
        removed == [] and sorted(absent) == sorted([rollout_id, unused]),
        f"retiring again must be a no-op reporting every id as absent, got removed={removed}, "
        f"absent={absent}",
    )


@_check("ledger_reuse_after_delete", needs="ledger")
async def _ledger_reuse(ctx: _Context) -> None:
    rollout_id = ctx.rollout()
    ledger = await ctx.ledger()
    retire, delete = _optional(ctx, ledger, "retire"), _optional(ctx, ledger, "delete")
    await ledger.record(_commit(rollout_id, "call-1"))
    await ledger.record_failure(rollout_id, "call-2", UNCOMMITTED_CALL_REASON)
    _expect_removal(ctx, await retire([rollout_id]), "retire")
    removed, absent = _expect_removal(ctx, await delete([rollout_id]), "delete")
    ctx.expect(
        sorted(removed + absent) == [rollout_id],
        f"delete must report the id once, got removed={removed}, absent={absent}",
    )
    removed, absent = _expect_removal(
        ctx, await _optional(ctx, await ctx.ledger(), "delete")([rollout_id]), "a second delete"
    )
    ctx.expect(
        removed == [] and absent == [rollout_id],
        f"deleting again must be a no-op reporting the id as absent, got removed={removed}, "
        f"absent={absent}",
    )
    fresh = await ctx.ledger()
    ctx.expect(await fresh.has_rows(rollout_id) is False, "a deleted rollout still has rows")
    reused = _commit(rollout_id, "call-1", 2)
    try:
        await fresh.record(reused)
    except Exception as exc:
        raise ConformanceError(
            ctx.check, f"recording into the deleted and reused rollout raised {describe_error(exc)}"
        ) from exc
    manifest = await _manifest(ctx, await ctx.ledger(), rollout_id)
    ctx.expect(
        list(_records(manifest)) == ["call-1"]
        and _records(manifest)["call-1"] == reused.record
        and not manifest.failures,
        f"the reused rollout's manifest holds records {[r.model_dump() for r in manifest.records]}"
        f" and failures {list(manifest.failures)}, expected only the new record",
    )


CHECKS: tuple[str, ...] = tuple(_REGISTRY)
"""Every check's name, in the order `run_conformance` runs them."""


# --- Running ---------------------------------------------------------------------------------


def _validate_base(rollout_id: str) -> None:
    if not isinstance(rollout_id, str) or not _ROLLOUT_ID.fullmatch(rollout_id):
        raise ValueError(
            f"rollout_id {rollout_id!r} must be non-empty ASCII letters, digits, '.', '_' or '-'"
        )


async def _run_one(
    spec: _CheckSpec,
    sink_factory: SinkFactory,
    source_factory: SourceFactory,
    lineage_factory: LineageFactory | None,
    ledger_factory: LedgerFactory | None,
    rollout_id: str,
    process_factory: Callable[[], Any] | None,
) -> Outcome:
    if spec.needs == "lineage" and lineage_factory is None:
        return Outcome(spec.name, "skip", "no lineage factory was given")
    if spec.needs == "ledger" and ledger_factory is None:
        return Outcome(spec.name, "skip", "no ledger factory was given")
    if spec.needs == "process" and process_factory is None:
        return Outcome(spec.name, "skip", NO_PROCESS_FACTORY)
    ctx = _Context(
        spec.name,
        rollout_id,
        sink_factory,
        source_factory,
        lineage_factory,
        ledger_factory,
        process_factory,
    )
    error: ConformanceError | None = None
    skipped = ""
    try:
        await spec.func(ctx)
    except SkipCheck as exc:
        skipped = str(exc)
    except ConformanceError as exc:
        error = exc
    except Exception as exc:
        error = ConformanceError(spec.name, f"the implementation raised {describe_error(exc)}")
        error.__cause__ = exc
    finally:
        close_errors = await ctx.close_all()
    error = with_close_errors(error, close_errors, ctx.error)
    if error is not None:
        return Outcome(spec.name, "fail", error.detail, error)
    if skipped:
        return Outcome(spec.name, "skip", skipped)
    return Outcome(spec.name, "pass")


async def _run(
    sink_factory: SinkFactory,
    source_factory: SourceFactory,
    lineage_factory: LineageFactory | None,
    ledger_factory: LedgerFactory | None,
    rollout_id: str,
    names: Sequence[str],
    stop_on_failure: bool,
    report: Callable[[Outcome], None] | None = None,
    process_factory: Callable[[], Any] | None = None,
) -> list[Outcome]:
    _validate_base(rollout_id)
    unknown = [name for name in names if name not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown conformance checks {unknown}; known: {list(CHECKS)}")
    outcomes: list[Outcome] = []
    for name in names:
        outcome = await _run_one(
            _REGISTRY[name],
            sink_factory,
            source_factory,
            lineage_factory,
            ledger_factory,
            rollout_id,
            process_factory,
        )
        outcomes.append(outcome)
        if report is not None:
            report(outcome)
        if outcome.error is not None and stop_on_failure:
            raise outcome.error
    return outcomes


async def run_conformance(
    sink_factory: SinkFactory,
    source_factory: SourceFactory,
    lineage_factory: LineageFactory | None = None,
    ledger_factory: LedgerFactory | None = None,
    *,
    rollout_id: str = "conformance",
    process_factory: Callable[[], Any] | None = None,
) -> ConformanceResults:
    """Run every applicable check; return the names of those that passed, in order.

    Raises `ConformanceError` at the first failure. Checks whose capability is absent (no
    lineage, ledger or process factory, a sink without ``begin_call``, a source without
    ``retire``) are not listed; the result's ``.skipped`` maps each of them to the reason.
    Each check uses its own rollout ids, ``f"{rollout_id}-{check}-{random}"`` plus a suffix.
    ``process_factory`` (picklable; see the module's docs) enables
    ``visible_across_processes``.
    """
    outcomes = await _run(
        sink_factory,
        source_factory,
        lineage_factory,
        ledger_factory,
        rollout_id,
        CHECKS,
        stop_on_failure=True,
        process_factory=process_factory,
    )
    return ConformanceResults(
        [outcome.check for outcome in outcomes if outcome.status == "pass"],
        {outcome.check: outcome.detail for outcome in outcomes if outcome.status == "skip"},
    )


def run_conformance_sync(
    sink_factory: SinkFactory,
    source_factory: SourceFactory,
    lineage_factory: LineageFactory | None = None,
    ledger_factory: LedgerFactory | None = None,
    *,
    rollout_id: str = "conformance",
    process_factory: Callable[[], Any] | None = None,
) -> ConformanceResults:
    """`run_conformance` from synchronous code (it runs its own event loop)."""
    return asyncio.run(
        run_conformance(
            sink_factory,
            source_factory,
            lineage_factory,
            ledger_factory,
            rollout_id=rollout_id,
            process_factory=process_factory,
        )
    )


async def run_check(
    check: str,
    sink_factory: SinkFactory,
    source_factory: SourceFactory,
    lineage_factory: LineageFactory | None = None,
    ledger_factory: LedgerFactory | None = None,
    *,
    rollout_id: str = "conformance",
    process_factory: Callable[[], Any] | None = None,
) -> bool:
    """Run one check by name: True if it passed, False if it does not apply (skipped).

    Raises `ConformanceError` if it failed and `ValueError` for an unknown name.
    """
    (outcome,) = await _run(
        sink_factory,
        source_factory,
        lineage_factory,
        ledger_factory,
        rollout_id,
        [check],
        stop_on_failure=True,
        process_factory=process_factory,
    )
    return outcome.status == "pass"


# --- Factories that take a directory, pytest and the command line ----------------------------


_bind_directory = bind_directory  # shared with the staging suite


def pytest_checks(
    sink_factory: Callable[..., Any],
    source_factory: Callable[..., Any] | None = None,
    lineage_factory: Callable[..., Any] | None = None,
    ledger_factory: Callable[..., Any] | None = None,
    *,
    rollout_id: str = "conformance",
    process_factory: Callable[..., Any] | None = None,
) -> Callable[[str, Path], None]:
    """A pytest test function parametrized over `CHECKS`; assign it to a ``test_*`` name.

    Each factory takes no argument or one directory (the test's ``tmp_path``, as a str, the same
    for every factory of one test case). ``source_factory`` defaults to ``sink_factory``. A check
    that does not apply is reported as skipped, with the reason (``visible_across_processes``
    without a ``process_factory``, for one).
    """
    import pytest

    source = sink_factory if source_factory is None else source_factory

    @pytest.mark.parametrize("check", CHECKS)
    def test_conformance(check: str, tmp_path: Path) -> None:
        directory = str(tmp_path)
        outcomes = asyncio.run(
            _run(
                _bind_directory(sink_factory, directory),
                _bind_directory(source, directory),
                None if lineage_factory is None else _bind_directory(lineage_factory, directory),
                None if ledger_factory is None else _bind_directory(ledger_factory, directory),
                rollout_id,
                [check],
                stop_on_failure=True,
                process_factory=None
                if process_factory is None
                else _bind_directory(process_factory, directory),
            )
        )
        if outcomes[0].status == "skip":
            pytest.skip(f"{check}: {outcomes[0].detail}")

    return test_conformance


def _load(spec: str) -> Callable[..., Any]:
    """Import ``module:attribute`` (the attribute may be dotted) and return the callable."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected module:factory, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    factory: Callable[..., Any] = target
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the checks against factories named ``module:factory``."""
    parser = argparse.ArgumentParser(
        prog="python -m tokencapture.conformance",
        description="Check a token-capture implementation against the tokencapture contracts.",
    )
    parser.add_argument("sink", help="module:factory of the sink (and source, by default)")
    parser.add_argument("--source", help="module:factory of the source (default: the sink's)")
    parser.add_argument("--lineage", help="module:factory of a lineage resolver")
    parser.add_argument("--ledger", help="module:factory of a capture ledger")
    parser.add_argument(
        "--process",
        help="module:factory of a sink and source to call in another process (usually the "
        "sink's); without it visible_across_processes is skipped",
    )
    parser.add_argument(
        "--dir", help="directory passed to factories that take one (default: a temporary one)"
    )
    parser.add_argument("--rollout-id", default="conformance", help="prefix of the rollout ids")
    args = parser.parse_args(argv)
    try:
        specs = {
            "sink": _load(args.sink),
            "source": _load(args.source or args.sink),
            "lineage": _load(args.lineage) if args.lineage else None,
            "ledger": _load(args.ledger) if args.ledger else None,
            "process": _load(args.process) if args.process else None,
        }
        _validate_base(args.rollout_id)
    except Exception as exc:
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 2

    # Implementations log what the checks provoke (a refused conflicting put, for one): label it.
    logging.basicConfig(level=logging.WARNING, format="log  %(levelname)s %(name)s: %(message)s")

    def report(outcome: Outcome) -> None:
        line = f"{outcome.status.upper():4} {outcome.check}"
        print(f"{line}: {outcome.detail}" if outcome.detail else line, flush=True)

    def run(directory: str) -> list[Outcome]:
        factories = {
            role: None if factory is None else _bind_directory(factory, directory)
            for role, factory in specs.items()
        }
        return asyncio.run(
            _run(
                factories["sink"],  # type: ignore[arg-type]
                factories["source"],  # type: ignore[arg-type]
                factories["lineage"],
                factories["ledger"],
                args.rollout_id,
                CHECKS,
                stop_on_failure=False,
                report=report,
                process_factory=factories["process"],
            )
        )

    try:
        if args.dir:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
            outcomes = run(str(Path(args.dir).resolve()))
        else:
            with tempfile.TemporaryDirectory(prefix="tokencapture-conformance-") as directory:
                outcomes = run(directory)
    except Exception as exc:
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 2
    counts = {status: sum(o.status == status for o in outcomes) for status in ("pass", "fail")}
    skipped = len(outcomes) - counts["pass"] - counts["fail"]
    print(f"{counts['pass']} passed, {counts['fail']} failed, {skipped} skipped")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    # Run the importable module's main, so the classes the checks use are the ones a factory
    # module sees when it imports tokencapture.conformance itself.
    from tokencapture.conformance import main as _main

    sys.exit(_main())
