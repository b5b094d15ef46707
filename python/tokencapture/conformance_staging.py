"""Check a framework's NeMo Gym ``StagingSink`` / ``StagingSource`` against the staging contract.

The staging half of `tokencapture.conformance` (re-exported there). A framework that stages
token deltas from its inference workers (``token_id_capture.external_staging``) and fetches
them in its trainer runs these checks to learn whether Gym can rely on its store.

Factories
    Zero-argument callables returning a *fresh* client over *one shared* backend each time
    (for the file store: ``functools.partial(FileStagingStore, root)``). ``source_factory``
    defaults to the sink factory. Clients with a ``close`` method are closed after each check.
    ``process_factory`` (optional) is a factory that can be pickled and called in another
    process (a module-level class with ``functools.partial`` arguments, say; a lambda fails
    with a message saying so); the checks that cross processes run only with it, and a script
    running them needs the ``if __name__ == "__main__":`` guard (the spawned child imports its
    main module again). Without it they are skipped with the reason. Clients are closed even
    when a check fails (an ``async def close`` is awaited); a close error fails the check, or
    is attached as a note to an earlier failure, which stays the one reported.

Checks (`STAGING_CHECKS`, in order)
    ``stage_visible_before_return`` (a fresh client fetches what ``stage`` acknowledged, no
    close or flush in between), ``fetch_in_order`` (one verified base snapshot per key, in the
    order asked, however the keys are ordered; an unknown key raises a ``KeyError``, never a
    short answer), ``stage_idempotent``, ``stage_conflict_refused`` (the same key with other
    content: ``ok=False`` with a reason, the first content kept), ``invalid_record_refused`` (a
    record whose digest does not verify: ``ok=False``, nothing staged), ``attachment_rule``
    (attachments are stored in the same write or the call is refused; an attachment that cannot
    be stored refuses the call, naming its type, and leaves nothing behind: no record, no
    attachment), ``attachments_round_trip`` (with a source that has ``fetch_attachments``, not
    part of NeMo Gym's protocol: acknowledged attachments come back byte for byte; without one
    it is skipped as unverified), ``extras_round_trip`` (with a source that has
    ``fetch_records``: extras such as ``routed_experts`` come back digest-equal),
    ``concurrent_stages`` (16 threads staging at once; an exception or a ``None`` from
    ``stage`` is reported as such); with a sink that has ``retire``: ``retire_fences`` (after
    ``retire`` returns, a stage of the rollout from an existing client is refused, a restage
    of an already staged record included, and its keys are no longer fetchable); with a
    ``process_factory``: ``retire_fences_other_processes``
    and ``acknowledged_survives_sigkill`` (a process that stages and is killed with SIGKILL
    right after ``stage`` returned: every acknowledged key is fetchable and verifies).

Records are built with NeMo Gym's own models when ``nemo_gym.token_id_capture.staging.records``
is importable (the models its capture code hands a sink), ours otherwise, or the module given
as ``records_module``; digests are computed with NeMo Gym's algorithms (natively,
`tokencapture.staging_digest`). A fetched snapshot is checked field by field against the staged
record and its digest recomputed.

Running it: ``run_staging_conformance(sink_factory, ...)`` returns the names of the checks that
passed (a `ConformanceResults`, whose ``.skipped`` maps each skipped check to its reason) and
raises `ConformanceError` at the first failure; ``run_staging_check(name, ...)``
runs one (False: it does not apply); ``pytest_staging_checks(...)`` is a parametrized test
function whose factories may take the test's directory, as `tokencapture.conformance` has.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn
from uuid import uuid4

from tokencapture import staging_records as _our_records
from tokencapture.conformance_runner import (
    NO_PROCESS_FACTORY,
    ConformanceResults,
    Outcome,
    SkipCheck,
    bind_directory,
    close_sync,
    describe_error,
    receive,
    spawned,
    with_close_errors,
)
from tokencapture.staging_digest import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)

__all__ = [
    "STAGING_CHECKS",
    "ConformanceResults",
    "StagingConformanceError",
    "build_chain",
    "pytest_staging_checks",
    "run_staging_check",
    "run_staging_conformance",
]

NEMO_RECORDS = "nemo_gym.token_id_capture.staging.records"
_Factory = Callable[[], Any]

# Fields a base snapshot must give back exactly as staged.
_BASE_FIELDS = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "token_ids_delta",
    "token_mask_delta",
    "generation_log_probs_delta",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)


class StagingConformanceError(AssertionError):
    """A staging implementation broke the contract the check named `check` verifies."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(check, detail)
        self.check = check
        self.detail = detail

    def __str__(self) -> str:
        return f"staging conformance check {self.check!r} failed: {self.detail}"


def default_records_module() -> ModuleType:
    """NeMo Gym's staging records when importable, else ours."""
    try:
        return importlib.import_module(NEMO_RECORDS)
    except ImportError:
        return _our_records


def build_chain(
    models: ModuleType,
    rollout_id: str,
    calls: int,
    *,
    variant: int = 0,
    prompt_tokens: int = 5,
    generated_tokens: int = 3,
    extras: Mapping[str, Any] | None = None,
) -> list[Any]:
    """A verified ``token_in`` chain of `calls` staged records of one rollout, root first:
    each call carries its parent's generation forward plus a new prompt turn, as NeMo Gym's
    capture builds them (masks 0 then 1, carry log-probabilities 0.0)."""
    records: list[Any] = []
    cumulative: list[int] = []
    parent_chain: str | None = None
    for index in range(calls):
        base = 1000 * (variant + 1) + 100 * index
        carried = [base + i for i in range(prompt_tokens)]
        generated = [base + 50 + i for i in range(generated_tokens)]
        log_probs = [-0.5, -0.0, -0.25, -1.5, -2.0][:generated_tokens]
        log_probs += [-0.125] * (generated_tokens - len(log_probs))
        ids = carried + generated
        masks = [0.0] * len(carried) + [1.0] * len(generated)
        lps = [0.0] * len(carried) + log_probs
        prev_len = len(cumulative)
        cumulative += ids
        call_extras = dict(extras) if extras is not None and index == calls - 1 else None
        fields: dict[str, Any] = {
            "rollout_id": rollout_id,
            "model_call_id": f"call-{index}",
            "parent_call_id": None if index == 0 else f"call-{index - 1}",
            "mode": "text" if index == 0 else "token_in",
            "prev_len": prev_len,
            "delta_len": len(ids),
            "cum_len": len(cumulative),
            "weight_version": 3 + index,
            "token_ids_delta": ids,
            "token_mask_delta": masks,
            "generation_log_probs_delta": lps,
            "extras_digest": compute_extras_digest(call_extras),
            "chain_hash": compute_chain_hash(parent_chain, ids),
            "cumulative_hash": hash_token_ids(cumulative),
        }
        digest = compute_staging_digest(
            schema_version=STAGING_SCHEMA_VERSION,
            digest_version=STAGING_DIGEST_VERSION,
            extras_digest_version=EXTRAS_DIGEST_VERSION,
            **fields,
        )
        records.append(models.StagedCallRecord(digest=digest, extras=call_extras, **fields))
        parent_chain = fields["chain_hash"]
    return records


def _key(record: Any) -> str:
    return f"{record.rollout_id}/{record.model_call_id}"


@dataclass
class _Context:
    check: str
    prefix: str
    sink_factory: _Factory
    source_factory: _Factory
    process_factory: _Factory | None
    models: ModuleType

    def __post_init__(self) -> None:
        self._clients: list[Any] = []

    def rollout(self, suffix: str = "") -> str:
        return f"{self.prefix}-{suffix}" if suffix else self.prefix

    def fail(self, detail: str) -> NoReturn:
        raise StagingConformanceError(self.check, detail)

    def expect(self, condition: bool, detail: str) -> None:
        if not condition:
            self.fail(detail)

    def _make(self, factory: _Factory, role: str) -> Any:
        try:
            client = factory()
        except Exception as exc:
            raise StagingConformanceError(
                self.check, f"the {role} factory raised {describe_error(exc)}"
            ) from exc
        if client is None:
            self.fail(f"the {role} factory returned None")
        self._clients.append(client)
        return client

    def sink(self) -> Any:
        return self._make(self.sink_factory, "sink")

    def source(self) -> Any:
        return self._make(self.source_factory, "source")

    def close_all(self) -> list[BaseException]:
        return close_sync(self._clients)

    def error(self, detail: str) -> StagingConformanceError:
        return StagingConformanceError(self.check, detail)

    def chain(self, rollout_id: str, calls: int = 3, **kwargs: Any) -> list[Any]:
        return build_chain(self.models, rollout_id, calls, **kwargs)

    def stage_ok(self, sink: Any, record: Any, **kwargs: Any) -> str:
        result = sink.stage(record, **kwargs)
        self.expect(
            bool(getattr(result, "ok", False)),
            f"stage of {_key(record)} failed: {getattr(result, 'error', result)!r}",
        )
        key = getattr(result, "staging_key", None)
        self.expect(
            isinstance(key, str) and bool(key),
            f"stage of {_key(record)} returned ok without a staging_key",
        )
        return str(key)

    def refused(self, result: Any, what: str) -> str:
        self.expect(not getattr(result, "ok", True), f"{what} was acknowledged (ok=True)")
        error = getattr(result, "error", None)
        self.expect(isinstance(error, str) and bool(error), f"{what}: ok=False without a reason")
        return str(error)

    def expect_snapshot(self, snapshot: Any, record: Any, what: str) -> None:
        for name in _BASE_FIELDS:
            got, want = getattr(snapshot, name, None), getattr(record, name)
            if name in ("token_mask_delta", "generation_log_probs_delta"):
                same = [float(v).hex() for v in got or ()] == [float(v).hex() for v in want]
            else:
                same = got == want
            self.expect(same, f"{what}: field {name} is {got!r}, staged {want!r}")
        recomputed = compute_staging_digest(
            **{name: getattr(snapshot, name) for name in _BASE_FIELDS if name != "digest"}
        )
        self.expect(recomputed == snapshot.digest, f"{what}: its digest does not verify")

    def expect_unknown(self, source: Any, keys: list[str], what: str) -> None:
        try:
            answer = source.fetch(keys)
        except KeyError:
            return
        self.fail(f"{what}: fetch returned {len(answer)} snapshots instead of raising KeyError")


_CheckFunc = Callable[[_Context], None]
_REGISTRY: dict[str, tuple[_CheckFunc, str]] = {}


def _check(name: str, needs: str = "") -> Callable[[_CheckFunc], _CheckFunc]:
    def register(func: _CheckFunc) -> _CheckFunc:
        _REGISTRY[name] = (func, needs)
        return func

    return register


@_check("stage_visible_before_return")
def _visible_before_return(ctx: _Context) -> None:
    sink = ctx.sink()
    records = ctx.chain(ctx.rollout(), 2)
    keys = [ctx.stage_ok(sink, record) for record in records]
    ctx.expect(len(set(keys)) == len(keys), f"two calls were staged under one key: {keys}")
    # A fresh client, with the sink neither closed nor flushed: what stage acknowledged is there.
    snapshots = ctx.source().fetch(keys)
    ctx.expect(len(snapshots) == len(keys), f"{len(snapshots)} snapshots for {len(keys)} keys")
    for snapshot, record in zip(snapshots, records, strict=True):
        ctx.expect_snapshot(snapshot, record, f"fetch of {_key(record)}")


@_check("fetch_in_order")
def _fetch_in_order(ctx: _Context) -> None:
    sink = ctx.sink()
    records = [*ctx.chain(ctx.rollout("a"), 3), *ctx.chain(ctx.rollout("b"), 2, variant=1)]
    keys = [ctx.stage_ok(sink, record) for record in records]
    source = ctx.source()
    order = [4, 0, 2, 1, 3, 0]
    snapshots = source.fetch([keys[i] for i in order])
    ctx.expect(len(snapshots) == len(order), f"{len(snapshots)} snapshots for {len(order)} keys")
    for snapshot, i in zip(snapshots, order, strict=True):
        ctx.expect_snapshot(snapshot, records[i], f"key {keys[i]} at its place")
    ctx.expect(source.fetch([]) == [], "fetch([]) is not []")
    missing = f"{keys[0]}-never-staged-{uuid4().hex[:6]}"
    ctx.expect_unknown(source, [keys[0], missing], "an unknown key among known ones")


@_check("stage_idempotent")
def _idempotent(ctx: _Context) -> None:
    (record,) = ctx.chain(ctx.rollout(), 1, extras={"routed_experts": [[[1, 2]]]})
    first = ctx.stage_ok(ctx.sink(), record)
    again = ctx.stage_ok(
        ctx.sink(), ctx.models.StagedCallRecord.model_validate(record.model_dump())
    )
    ctx.expect(first == again, f"a restage answered key {again!r}, the first stage {first!r}")
    (snapshot,) = ctx.source().fetch([first])
    ctx.expect_snapshot(snapshot, record, "the restaged key")


@_check("stage_conflict_refused")
def _conflict(ctx: _Context) -> None:
    rollout = ctx.rollout()
    (record,) = ctx.chain(rollout, 1)
    (other,) = ctx.chain(rollout, 1, variant=1)  # same key, other tokens
    sink = ctx.sink()
    key = ctx.stage_ok(sink, record)
    ctx.refused(ctx.sink().stage(other), f"a conflicting restage of {key}")
    ctx.refused(sink.stage(other), f"a conflicting restage of {key} (same client)")
    (snapshot,) = ctx.source().fetch([key])
    ctx.expect_snapshot(snapshot, record, "the key after a refused conflict")


@_check("invalid_record_refused")
def _invalid(ctx: _Context) -> None:
    (record,) = ctx.chain(ctx.rollout(), 1)
    fields = dict(record)
    fields["token_ids_delta"] = [*record.token_ids_delta[:-1], record.token_ids_delta[-1] + 1]
    forged = ctx.models.StagedCallRecord.model_construct(**fields)  # digest no longer matches
    try:
        result = ctx.sink().stage(forged)
    except (ValueError, TypeError):
        result = None  # refusing by raising is allowed: NeMo Gym reports capture_failed
    if result is not None:
        ctx.refused(result, "a record whose digest does not verify")
    # Nothing of the refused record holds its call: the genuine record stages (no conflict).
    key = ctx.stage_ok(ctx.sink(), record)
    (snapshot,) = ctx.source().fetch([key])
    ctx.expect_snapshot(snapshot, record, "the genuine record after a forged one was refused")


class _NotStorable:
    """An attachment no sink can store (no buffer, no Arrow export)."""


def _stage_attachments(sink: Any, record: Any, attachments: Mapping[str, Any]) -> Any:
    """`sink.stage` with attachments; None when it refuses the keyword with a TypeError."""
    try:
        return sink.stage(record, attachments=attachments)
    except TypeError:
        return None  # a sink without attachments support refuses loudly: allowed


@_check("attachment_rule")
def _attachments(ctx: _Context) -> None:
    import array

    (record,) = ctx.chain(ctx.rollout("kept"), 1)
    payload = {"pixels": b"\x00\x01\xff" * 5, "grid": array.array("i", [1, -2, 3])}
    sink = ctx.sink()
    result = _stage_attachments(sink, record, payload)
    if result is None or not result.ok:
        # A sink without attachment support refused the whole call; the call is not held.
        ctx.stage_ok(ctx.sink(), record)
        return
    # One storable and one unstorable attachment: the whole call is refused, naming the
    # culprit, and nothing of it is held (not the record, not the storable attachment).
    (refused_record,) = ctx.chain(ctx.rollout("refused"), 1)
    bad = _stage_attachments(
        sink, refused_record, {"pixels": b"\x07" * 9, "handle": _NotStorable()}
    )
    if bad is not None:
        error = ctx.refused(bad, "a call with an attachment that cannot be stored")
        ctx.expect(
            "_NotStorable" in error or "handle" in error,
            f"the refusal does not name the attachment or its type: {error!r}",
        )
    refused_key = _key(refused_record)
    ctx.expect_unknown(ctx.source(), [refused_key], "the key of a refused call")
    fetch_attachments = getattr(ctx.source(), "fetch_attachments", None)
    if callable(fetch_attachments):
        try:
            held = fetch_attachments(refused_key)
        except KeyError:
            held = {}
        ctx.expect(not held, f"a refused call's attachments were kept: {sorted(held)}")
    # Staged again without attachments, the refused call has none.
    key = ctx.stage_ok(ctx.sink(), refused_record)
    if callable(fetch_attachments):
        left = fetch_attachments(key)
        ctx.expect(not left, f"a refused call's attachments came back: {sorted(left)}")


@_check("attachments_round_trip")
def _attachments_round_trip(ctx: _Context) -> None:
    import array

    fetch_attachments = getattr(ctx.source(), "fetch_attachments", None)
    if not callable(fetch_attachments):
        # Not part of NeMo Gym's StagingSource: without a reader, "stored" cannot be checked.
        raise SkipCheck(
            "the source has no fetch_attachments(staging_key): that acknowledged attachments "
            "were stored is unverified"
        )
    (record,) = ctx.chain(ctx.rollout(), 1)
    payload = {"pixels": b"\x00\x01\xff" * 5, "grid": array.array("i", [1, -2, 3])}
    result = _stage_attachments(ctx.sink(), record, payload)
    if result is None or not result.ok:
        raise SkipCheck("the sink refuses attachments")
    stored = fetch_attachments(result.staging_key)
    for name, value in payload.items():
        ctx.expect(name in stored, f"attachment {name!r} was dropped")
        ctx.expect(
            bytes(stored[name]) == bytes(value), f"attachment {name!r} came back as other bytes"
        )


@_check("extras_round_trip")
def _extras_round_trip(ctx: _Context) -> None:
    fetch_records = getattr(ctx.source(), "fetch_records", None)
    if not callable(fetch_records):
        # NeMo Gym's StagingSource has fetch only; extras stay behind the key.
        raise SkipCheck("the source has no fetch_records(staging_keys): extras are unverified")
    extras = {"routed_experts": [[[3, 7], [1, 2]], [[0, 5], [4, 6]]], "engine": "conf ✓"}
    (plain, with_extras) = ctx.chain(ctx.rollout(), 2, extras=extras)
    keys = [ctx.stage_ok(ctx.sink(), record) for record in (plain, with_extras)]
    fetched = fetch_records(keys)
    ctx.expect(len(fetched) == 2, f"fetch_records returned {len(fetched)} records for 2 keys")
    for got, record in zip(fetched, (plain, with_extras), strict=True):
        ctx.expect_snapshot(got, record, f"fetch_records of {_key(record)}")
        got_extras = getattr(got, "extras", None)
        ctx.expect(
            compute_extras_digest(got_extras) == record.extras_digest,
            f"fetch_records of {_key(record)}: its extras {got_extras!r} do not match the "
            f"staged extras_digest (staged {record.extras!r})",
        )


@_check("concurrent_stages")
def _concurrent(ctx: _Context) -> None:
    sink = ctx.sink()
    chains = [ctx.chain(ctx.rollout(str(t)), 4, variant=t) for t in range(16)]
    failures: list[str] = []
    raised: list[BaseException] = []
    start = threading.Barrier(len(chains))

    keys: dict[str, str] = {}

    def run(records: list[Any]) -> None:
        # Every outcome is collected for the main thread: nothing escapes to stderr.
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait()
        for record in records:
            try:
                result = sink.stage(record)
            except Exception as exc:
                raised.append(exc)
                failures.append(f"{_key(record)}: stage raised {describe_error(exc)}")
                return
            if result is None:
                failures.append(f"{_key(record)}: stage returned None, expected a StageResult")
                return
            key = getattr(result, "staging_key", None)
            if not getattr(result, "ok", False) or not key:
                failures.append(f"{_key(record)}: {result!r}")
            else:
                keys[_key(record)] = key

    threads = [threading.Thread(target=run, args=(chain,)) for chain in chains]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        error = ctx.error(
            f"{len(failures)} of {len(chains)} threads staging at once failed: {failures[:3]}"
        )
        raise error from (raised[0] if raised else None)
    everything = [record for chain in chains for record in chain]
    snapshots = ctx.source().fetch([keys[_key(record)] for record in everything])
    ctx.expect(
        len(snapshots) == len(everything),
        f"{len(snapshots)} snapshots for {len(everything)} keys",
    )
    for snapshot, record in zip(snapshots, everything, strict=True):
        ctx.expect_snapshot(snapshot, record, f"concurrently staged {_key(record)}")


def _retire(ctx: _Context, client: Any, rollout_id: str) -> None:
    retire = getattr(client, "retire", None)
    if not callable(retire):
        raise SkipCheck("the sink has no retire(rollout_ids)")
    retire([rollout_id])


@_check("retire_fences")
def _retire_fences(ctx: _Context) -> None:
    rollout = ctx.rollout()
    first, second = ctx.chain(rollout, 2)
    worker = ctx.sink()  # exists before the retire, as a long-lived worker's client does
    key = ctx.stage_ok(worker, first)
    _retire(ctx, ctx.sink(), rollout)
    ctx.refused(worker.stage(second), "a stage of a retired rollout")
    ctx.refused(ctx.sink().stage(second), "a stage of a retired rollout (fresh client)")
    # A record staged before the retire is no idempotent restage now: its key is gone, so
    # acknowledging it (a client-side "already staged" cache, say) would hand out a dead key.
    ctx.refused(worker.stage(first), "a restage of an already staged record after retire")
    ctx.refused(
        ctx.sink().stage(first), "a restage of an already staged record after retire (fresh client)"
    )
    ctx.expect_unknown(ctx.source(), [key], "a key of a retired rollout")


def _in_process(factory: _Factory, job: tuple[str, list[Any]], conn: Any) -> None:
    """The child side of the cross-process checks (runs in a spawned process)."""
    name, records = job
    client = factory()
    if name == "retire":
        client.retire([records[0].rollout_id])
        conn.send(("ok", "retired"))
    elif name == "stage":
        conn.send(("ok", [bool(client.stage(record).ok) for record in records]))
    elif name == "stage_then_kill":
        for record in records:
            result = client.stage(record)
            # Sent only after stage returned.
            conn.send(("ok", (result.staging_key, bool(result.ok))))
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _child(ctx: _Context, job: str, records: list[Any]) -> Iterator[Any]:
    with spawned(ctx.process_factory, _in_process, (job, records), ctx.error) as conn:
        yield conn


@_check("retire_fences_other_processes", needs="process")
def _retire_other_processes(ctx: _Context) -> None:
    rollout = ctx.rollout("here")
    first, second = ctx.chain(rollout, 2)
    worker = ctx.sink()
    ctx.stage_ok(worker, first)
    if not callable(getattr(worker, "retire", None)):
        raise SkipCheck("the sink has no retire(rollout_ids)")
    with _child(ctx, "retire", [first]) as conn:
        answer = receive(conn, "retiring in another process", ctx.error)
        ctx.expect(answer == "retired", "the retiring process did not finish")
    ctx.refused(worker.stage(second), "a stage after another process retired the rollout")
    there = ctx.rollout("there")
    root, child_call = ctx.chain(there, 2)
    ctx.stage_ok(worker, root)
    _retire(ctx, worker, there)
    with _child(ctx, "stage", [child_call]) as conn:
        ok = receive(conn, "staging in another process", ctx.error)
    ctx.expect(ok == [False], "another process staged into a rollout retired here")


@_check("acknowledged_survives_sigkill", needs="process")
def _survives_sigkill(ctx: _Context) -> None:
    records = ctx.chain(ctx.rollout(), 3)
    acknowledged: list[str] = []
    with _child(ctx, "stage_then_kill", records) as conn, contextlib.suppress(EOFError):
        while True:
            key, ok = receive(conn, "staging in the process then killed", ctx.error)
            if ok:
                acknowledged.append(key)
        # EOF: the child is gone (killed right after its last stage returned).
    ctx.expect(len(acknowledged) == len(records), f"the child acknowledged only {acknowledged}")
    snapshots = ctx.source().fetch(acknowledged)
    for snapshot, record in zip(snapshots, records, strict=True):
        ctx.expect_snapshot(snapshot, record, f"{_key(record)} after its stager was killed")


STAGING_CHECKS: tuple[str, ...] = tuple(_REGISTRY)


def _run_one(name: str, ctx: _Context) -> Outcome:
    func, needs = _REGISTRY[name]
    if needs == "process" and ctx.process_factory is None:
        return Outcome(name, "skip", NO_PROCESS_FACTORY)
    error: StagingConformanceError | None = None
    skipped = ""
    try:
        func(ctx)
    except SkipCheck as exc:
        skipped = str(exc)
    except StagingConformanceError as exc:
        error = exc
    except Exception as exc:
        error = StagingConformanceError(name, f"the implementation raised {describe_error(exc)}")
        error.__cause__ = exc
    finally:
        close_errors = ctx.close_all()
    error = with_close_errors(error, close_errors, ctx.error)
    if error is not None:
        return Outcome(name, "fail", error.detail, error)
    if skipped:
        return Outcome(name, "skip", skipped)
    return Outcome(name, "pass")


def _run(
    names: Sequence[str],
    sink_factory: _Factory,
    source_factory: _Factory | None,
    process_factory: _Factory | None,
    records_module: ModuleType | None,
    rollout_id: str,
) -> list[Outcome]:
    unknown = [name for name in names if name not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown staging checks {unknown}; known: {list(STAGING_CHECKS)}")
    models = records_module or default_records_module()
    outcomes: list[Outcome] = []
    for name in names:
        ctx = _Context(
            name,
            f"{rollout_id}-{name}-{uuid4().hex[:8]}",
            sink_factory,
            source_factory or sink_factory,
            process_factory,
            models,
        )
        outcome = _run_one(name, ctx)
        if outcome.error is not None:
            raise outcome.error
        outcomes.append(outcome)
    return outcomes


def run_staging_conformance(
    sink_factory: _Factory,
    source_factory: _Factory | None = None,
    *,
    process_factory: _Factory | None = None,
    records_module: ModuleType | None = None,
    rollout_id: str = "conformance",
) -> ConformanceResults:
    """Run every applicable staging check; the names of those that passed, in order, with
    ``.skipped`` mapping each check that did not apply to the reason. Raises
    `StagingConformanceError` at the first failure."""
    outcomes = _run(
        STAGING_CHECKS, sink_factory, source_factory, process_factory, records_module, rollout_id
    )
    return ConformanceResults(
        [o.check for o in outcomes if o.status == "pass"],
        {o.check: o.detail for o in outcomes if o.status == "skip"},
    )


def run_staging_check(
    check: str,
    sink_factory: _Factory,
    source_factory: _Factory | None = None,
    *,
    process_factory: _Factory | None = None,
    records_module: ModuleType | None = None,
    rollout_id: str = "conformance",
) -> bool:
    """Run one staging check: True if it passed, False if it does not apply."""
    (outcome,) = _run(
        [check], sink_factory, source_factory, process_factory, records_module, rollout_id
    )
    return outcome.status == "pass"


def pytest_staging_checks(
    sink_factory: Callable[..., Any],
    source_factory: Callable[..., Any] | None = None,
    *,
    process_factory: Callable[..., Any] | None = None,
    records_module: ModuleType | None = None,
) -> Callable[[str, Path], None]:
    """A pytest test parametrized over `STAGING_CHECKS` (assign it to a ``test_*`` name).
    Factories taking one argument get the test's ``tmp_path`` (as a str); a check that does
    not apply is skipped with the reason."""
    import pytest

    @pytest.mark.parametrize("check", STAGING_CHECKS)
    def test_staging_conformance(check: str, tmp_path: Path) -> None:
        directory = str(tmp_path)
        (outcome,) = _run(
            [check],
            bind_directory(sink_factory, directory),
            None if source_factory is None else bind_directory(source_factory, directory),
            None if process_factory is None else bind_directory(process_factory, directory),
            records_module,
            "conformance",
        )
        if outcome.status == "skip":
            pytest.skip(f"{check}: {outcome.detail}")

    return test_staging_conformance
