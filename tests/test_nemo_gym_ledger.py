"""Differential tests against NeMo Gym 0.7.0: staging wire models and capture-ledger files.

The oracle is NeMo Gym's own code (`tests/nemo_oracle.py`). The models are compared field by
field and dump by dump on generated input, refusals included (same error types, locations and
messages). The ledgers share one directory both ways: what NeMo Gym's `FileLineageStore` writes
our `FileCaptureLedger` reads, and the reverse, with equal manifests, `has_rows` and `resolve`
answers, and the same operations write the same bytes.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from tests.conftest import resolution_answer, sha
from tests.nemo_oracle import import_nemo

from tokencapture.ledger import CaptureLedgerConflictError, FileCaptureLedger
from tokencapture.staging import records as ours

theirs = import_nemo("staging.records")
nemo_lineage = import_nemo("lineage")

MODELS = [
    "CaptureAdmission",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "StageResult",
    "CommitCoords",
    "CallRecord",
    "CaptureLedgerCommit",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutReceipt",
]


# ---- the models, statically ------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_models_have_the_same_fields_defaults_and_config(name: str) -> None:
    mine, reference = getattr(ours, name), getattr(theirs, name)
    assert mine.model_config == reference.model_config
    assert list(mine.model_fields) == list(reference.model_fields)
    for field, info in reference.model_fields.items():
        got = mine.model_fields[field]
        assert repr(got.default) == repr(info.default), field
        assert got.default_factory is info.default_factory, field
        assert repr(got.metadata) == repr(info.metadata), field
    schema, expected = mine.model_json_schema(), reference.model_json_schema()
    for each in (schema, expected):  # docstrings are our own
        each.pop("description", None)
        for definition in each.get("$defs", {}).values():
            definition.pop("description", None)
    assert schema == expected


def test_public_names_and_constants_match() -> None:
    public = [name for name in dir(theirs) if not name.startswith("_")]
    constants = [name for name in public if name.isupper()]
    assert constants and all(getattr(ours, name) == getattr(theirs, name) for name in constants)
    for name in ("CaptureDisposition", "CaptureMode", "staging_key", *MODELS):
        assert hasattr(ours, name), name
    assert ours.RolloutManifest(rollout_id="r").records == []
    assert theirs.RolloutManifest(rollout_id="r").records == []


# ---- the models, on generated input ----------------------------------------------------------

H1, H2, H3, H4 = sha("1"), sha("2"), sha("3"), sha("4")
ABSENT = object()
DIGESTS = st.sampled_from([H1, H2, H1.upper(), "", None, 5, "z" * 64, ABSENT])
IDS = st.sampled_from(["c", "call-é", "", None, 5, b"c", ["c"], ABSENT])
COUNTS = st.sampled_from([0, 1, 3, 5, -1, True, 2.0, "3", 2**70, None, ABSENT])
FLOATS = st.sampled_from([None, 1.5, 5, -0.0, 1e300, math.nan, math.inf, "1.5", True, ABSENT])
VERSIONS = st.sampled_from([0, 1, 2, 3, 2.0, "2", True, ABSENT])


def _drop_absent(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not ABSENT}


@st.composite
def call_record_input(draw: st.DrawFn) -> dict[str, Any]:
    root = draw(st.booleans())
    prev = 0 if root else 3
    plausible = {
        "model_call_id": "c",
        "parent_call_id": None if root else "p",
        "prev_len": prev,
        "delta_len": 2,
        "cum_len": prev + 2,
        "weight_version": 1,
        "digest": H1,
        "extras_digest": H2,
        "staging_key": "r/c",
        "mode": "text" if root else "token_in",
        "chain_hash": H3,
        "cumulative_hash": H4,
        "response_id": "resp",
        "admitted_at": 1.25,
        "output_fingerprint": None,
        "continuation_fingerprint": H1,
        "fingerprint_version": 2,
    }
    pools: dict[str, st.SearchStrategy[Any]] = {
        "model_call_id": IDS,
        "parent_call_id": IDS,
        "prev_len": COUNTS,
        "delta_len": COUNTS,
        "cum_len": COUNTS,
        "weight_version": COUNTS,
        "digest": DIGESTS,
        "extras_digest": DIGESTS,
        "staging_key": IDS,
        "mode": st.sampled_from(["text", "token_in", "TEXT", None, ABSENT]),
        "chain_hash": DIGESTS,
        "cumulative_hash": DIGESTS,
        "response_id": IDS,
        "admitted_at": FLOATS,
        "output_fingerprint": DIGESTS,
        "continuation_fingerprint": DIGESTS,
        "fingerprint_version": COUNTS,
        "schema_version": VERSIONS,
        "digest_version": VERSIONS,
        "extras_digest_version": VERSIONS,
    }
    changed = draw(st.sets(st.sampled_from(sorted(pools)), max_size=3))
    fields = dict(plausible)
    for key in changed:
        fields[key] = draw(pools[key])
    if draw(st.integers(0, 9)) == 0:
        fields["surprise"] = 1
    return _drop_absent(fields)


def _errors(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [(e["type"], e["loc"], e["msg"]) for e in exc.errors()]


def _both(name: str, payload: Any) -> tuple[Any, Any]:
    """Validate with both classes: (instance or error list) for each."""
    results: list[Any] = []
    for module in (ours, theirs):
        try:
            results.append(getattr(module, name).model_validate(payload))
        except ValidationError as exc:
            results.append(_errors(exc))
    return results[0], results[1]


def _same_outcome(name: str, payload: Any) -> BaseModel | None:
    mine, reference = _both(name, payload)
    if isinstance(reference, list):
        assert mine == reference
        return None
    assert isinstance(mine, BaseModel), mine
    assert mine.model_dump() == reference.model_dump()
    assert mine.model_dump(mode="json") == reference.model_dump(mode="json")
    assert mine.model_dump_json() == reference.model_dump_json()
    # Each side accepts the other's dumps, and ours accepts NeMo Gym's instance.
    assert getattr(theirs, name).model_validate(mine.model_dump()) == reference
    from_json = getattr(theirs, name).model_validate_json(reference.model_dump_json())
    assert getattr(theirs, name).model_validate_json(mine.model_dump_json()) == from_json
    assert getattr(ours, name).model_validate(reference) == mine
    mine_from_json = getattr(ours, name).model_validate_json(reference.model_dump_json())
    assert mine_from_json.model_dump() == from_json.model_dump()
    return mine


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(call_record_input())
def test_call_record_matches_nemo_gym(payload: dict[str, Any]) -> None:
    _same_outcome("CallRecord", payload)


@SETTINGS
@given(
    call_record_input(),
    st.sampled_from([(), ("s1",), ["s1", "s2"], ("",), (5,), "s1", None, ABSENT]),
    st.sampled_from([[], [{"role": "user", "content": "q"}], [[1]], None, ABSENT, [{1: 2}]]),
    st.sampled_from(["r", "", 5, ABSENT]),
)
def test_commit_matches_nemo_gym(
    record: dict[str, Any], chain: Any, items: Any, rollout_id: Any
) -> None:
    payload = _drop_absent(
        {
            "rollout_id": rollout_id,
            "record": record,
            "staging_chain": chain,
            "request_items": items,
            "response_items": [{"role": "assistant", "content": "a"}],
        }
    )
    _same_outcome("CaptureLedgerCommit", payload)


@SETTINGS
@given(
    st.lists(call_record_input(), max_size=3),
    st.lists(st.fixed_dictionaries({"model_call_id": IDS, "reason": IDS}), max_size=2),
)
def test_manifest_and_failure_match_nemo_gym(
    records: list[dict[str, Any]], failures: list[dict[str, Any]]
) -> None:
    failures = [_drop_absent(failure) for failure in failures]
    for failure in failures:
        _same_outcome("ManifestFailure", failure)
    _same_outcome("RolloutManifest", {"rollout_id": "r", "records": records, "failures": failures})


@SETTINGS
@given(
    st.lists(call_record_input(), max_size=2),
    st.sampled_from([None, "c", "x"]),
    st.sampled_from([None, "declared", "heuristic", "bogus"]),
    st.booleans(),
    st.sampled_from([None, "boom"]),
)
def test_receipt_matches_nemo_gym(
    manifest: list[dict[str, Any]],
    terminal: str | None,
    selection: str | None,
    poisoned: bool,
    reason: str | None,
) -> None:
    payload = {
        "rollout_id": "r",
        "manifest": manifest,
        "terminal_model_call_id": terminal,
        "terminal_selection": selection,
        "capture_poisoned": poisoned,
        "failure_reason": reason,
    }
    _same_outcome("RolloutReceipt", payload)


@SETTINGS
@given(
    st.sampled_from([None, "p"]),
    st.sampled_from([0, 2]),
    st.sampled_from([[5, 6], [5, -1], [5]]),
    st.sampled_from([[0.0, 1.0], [0.5, 1.0], [1.0, 1.0]]),
    st.sampled_from([[0.0, -0.5], [-1.0, 0.0], [0.0, 1e39]]),
    st.sampled_from([None, {"k": 1}, {"k": [1.5, None, "s"]}, {"k": math.nan}]),
    st.booleans(),
)
def test_staged_records_match_nemo_gym(
    parent: str | None,
    prev_len: int,
    tokens: list[int],
    masks: list[float],
    log_probs: list[float],
    extras: dict[str, Any] | None,
    right_digest: bool,
) -> None:
    fields: dict[str, Any] = {
        "rollout_id": "r",
        "model_call_id": "c",
        "parent_call_id": parent,
        "mode": "text" if parent is None else "token_in",
        "prev_len": prev_len,
        "delta_len": len(tokens),
        "cum_len": prev_len + len(tokens),
        "weight_version": 1,
        "token_ids_delta": tokens,
        "token_mask_delta": masks,
        "generation_log_probs_delta": log_probs,
        "chain_hash": H3,
        "cumulative_hash": H4,
    }
    versions: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
    }
    try:
        extras_digest = theirs.compute_extras_digest(extras)
        digest = theirs.compute_staging_digest(**versions, **fields, extras_digest=extras_digest)
    except (TypeError, ValueError) as exc:
        digest, extras_digest = H1, H2
        with pytest.raises(type(exc)):
            ours.compute_extras_digest(extras)
            ours.compute_staging_digest(**versions, **fields, extras_digest=H2)
    else:
        assert ours.compute_extras_digest(extras) == extras_digest
        assert ours.compute_staging_digest(**versions, **fields, extras_digest=extras_digest) == (
            digest
        )
    payload = {**fields, "digest": digest if right_digest else H1, "extras_digest": extras_digest}
    _same_outcome("StagedCallBaseSnapshot", payload)
    _same_outcome("StagedCallRecord", {**payload, "extras": extras})


@SETTINGS
@given(
    st.sampled_from(["text", "token_in"]),
    st.sampled_from([None, "p"]),
    st.sampled_from([0, 2]),
    st.sampled_from([[], [1, 2], [-1, 2]]),
    st.sampled_from([[], ["s"]]),
    st.sampled_from([None, H1]),
    st.sampled_from(["staged", "capture_failed"]),
)
def test_admission_and_coords_match_nemo_gym(
    mode: str,
    parent: str | None,
    prev_len: int,
    prefix: list[int],
    chain: list[str],
    digest: str | None,
    disposition: str,
) -> None:
    _same_outcome(
        "CaptureAdmission",
        {
            "rollout_id": "r",
            "model_call_id": "c",
            "parent_call_id": parent,
            "prev_len": prev_len,
            "mode": mode,
            "required_prefix_token_ids": prefix,
            "staging_chain": chain,
            "parent_chain_hash": digest,
        },
    )
    staged = {key: digest for key in ("digest", "extras_digest", "chain_hash", "cumulative_hash")}
    _same_outcome(
        "CommitCoords",
        {
            "rollout_id": "r",
            "model_call_id": "c",
            "parent_call_id": parent,
            "prev_len": prev_len,
            "delta_len": len(prefix),
            "cum_len": prev_len + len(prefix),
            "weight_version": 0,
            "disposition": disposition,
            "staging_key": None if digest is None else "r/c",
            **staged,
        },
    )
    _same_outcome("StageResult", {"ok": digest is not None, "staging_key": "k", "error": None})


# ---- the ledgers, on one directory -----------------------------------------------------------

REQUESTS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "q1"}],
    [{"role": "user", "content": "q2"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}],
    [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "q3"},
    ],
]
RESPONSES: list[list[dict[str, Any]]] = [
    [{"role": "assistant", "content": "a1"}],
    [{"role": "assistant", "content": "a2 ✓"}],
    [{"type": "function_call", "call_id": "t1", "name": "calc", "arguments": '{"x": 1}'}],
]


def _commit(module: Any, op: tuple[Any, ...]) -> Any:
    _, call, request, response, version, admitted, parent = op
    prev = 0 if parent is None else 4
    record = module.CallRecord(
        model_call_id=call,
        parent_call_id=parent,
        prev_len=prev,
        delta_len=3,
        cum_len=prev + 3,
        weight_version=1,
        digest=sha(f"staged-{call}"),
        extras_digest=H2,
        staging_key=f"r/{call}",
        mode="text" if parent is None else "token_in",
        chain_hash=sha(f"chain-{call}"),
        cumulative_hash=sha(f"cum-{call}-{response}"),
        response_id=f"resp-{call}-é",
        admitted_at=admitted,
        fingerprint_version=version,
    )
    return module.CaptureLedgerCommit(
        rollout_id="r",
        record=record,
        staging_chain=(f"seg-{call}",) if parent is None else ("seg-p", f"seg-{call}"),
        request_items=REQUESTS[request],
        response_items=RESPONSES[response],
    )


OPS = st.one_of(
    st.tuples(
        st.just("commit"),
        st.sampled_from(["c1", "c2", "c3", "c4"]),
        st.integers(0, len(REQUESTS) - 1),
        st.integers(0, len(RESPONSES) - 1),
        st.sampled_from([2, 2, 0, 1]),
        st.sampled_from([None, 1.5, 1e-05, 1.7e9 + 0.1]),
        st.sampled_from([None, "c1"]),
    ),
    st.tuples(
        st.just("failure"), st.sampled_from(["c1", "c2", "c5"]), st.sampled_from(["boom", "é"])
    ),
)


async def _apply(writer: Any, op: tuple[Any, ...], nemo: bool) -> str:
    """Run one operation; the outcome is "ok" or "conflict"."""
    try:
        if op[0] == "failure":
            await writer.record_failure("r", op[1], op[2])
        else:
            await writer.record(_commit(theirs if nemo else ours, op))
    except CaptureLedgerConflictError:
        return "conflict"
    except ValueError as exc:
        if nemo and "conflicting lineage record" in str(exc):
            return "conflict"
        raise
    return "ok"


def _probes() -> list[list[dict[str, Any]]]:
    probes: list[list[dict[str, Any]]] = [[], [{"role": "user", "content": "only"}]]
    for request in REQUESTS:
        for response in RESPONSES:
            probes.append([*request, *response, {"role": "user", "content": "next"}])
            probes.append([*response])  # shorter than the recorded context
    return probes


async def _readings(root: Path) -> list[Any]:
    """What each implementation reads from the directory (ours first, then NeMo Gym's)."""
    readers = [FileCaptureLedger(root), nemo_lineage.FileLineageStore(root)]
    out = []
    for reader in readers:
        answers = [resolution_answer(await reader.resolve("r", probe)) for probe in _probes()]
        out.append((await reader.manifest("r"), await reader.has_rows("r"), answers))
    return out


def _run(ops: list[tuple[Any, ...]], root: Path, writers: str) -> list[str]:
    """Apply `ops` with "ours", "nemo", or "mixed" (alternating) writers."""

    async def go() -> list[str]:
        mine, reference = FileCaptureLedger(root), nemo_lineage.FileLineageStore(root)
        outcomes = []
        for index, op in enumerate(ops):
            nemo = writers == "nemo" or (writers == "mixed" and index % 2 == 1)
            outcomes.append(await _apply(reference if nemo else mine, op, nemo))
        return outcomes

    return asyncio.run(go())


LEDGER_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@LEDGER_SETTINGS
@given(st.lists(OPS, min_size=1, max_size=8))
def test_both_writers_write_the_same_bytes_and_read_alike(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[Any, ...]]
) -> None:
    roots = {name: tmp_path_factory.mktemp(name) for name in ("ours", "nemo", "mixed")}
    outcomes = {name: _run(ops, root, name) for name, root in roots.items()}
    assert outcomes["ours"] == outcomes["nemo"] == outcomes["mixed"]
    contents = {name: (root / "r.lineage.jsonl").read_bytes() for name, root in roots.items()}
    assert contents["ours"] == contents["nemo"] == contents["mixed"]
    for root in roots.values():
        mine, reference = asyncio.run(_readings(root))
        assert mine == reference
        ours.RolloutManifest.model_validate(mine[0])


def _write(root: Path, rows: list[bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "r.lineage.jsonl").write_bytes(b"".join(row + b"\n" for row in rows))


def test_hand_written_rows_read_alike(tmp_path: Path) -> None:
    """Rows NeMo Gym's writer never makes but its reader accepts: both read them the same."""
    good = asyncio.run(_row_of(tmp_path / "seed", ("commit", "c1", 0, 0, 2, 1.5, None)))
    rows = [
        good.replace(b'"response_id":"resp-c1-\\u00e9"', b'"response_id":""'),
        good.replace(b'"chain_hash":"', b'"chain_hash":null,"x":"'),
        good.replace(b'"model_call_id":"c1"', b'"model_call_id":"c2"').replace(
            b'"prev_len":0', b'"prev_len":0.0'
        ),
        b'{"model_call_id":"legacy","fingerprint":"0","context_len":0}',
        b'{"failure_reason":3,"model_call_id":4}',
        b"   ",
        good.replace(b'"fingerprint_version":2', b'"fingerprint_version":2.0').replace(
            b'"model_call_id":"c1"', b'"model_call_id":"c9"'
        ),
    ]
    _write(tmp_path / "d", rows)
    mine, reference = asyncio.run(_readings(tmp_path / "d"))
    assert mine == reference
    manifest = ours.RolloutManifest.model_validate(mine[0])
    assert [failure.reason for failure in manifest.failures] == [
        ours.LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
        ours.LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
        "3",
    ]


async def _row_of(root: Path, op: tuple[Any, ...]) -> bytes:
    writer = nemo_lineage.FileLineageStore(root)
    await _apply(writer, op, nemo=True)
    return (root / "r.lineage.jsonl").read_bytes().rstrip(b"\n")


def test_our_fence_is_ignored_by_nemo_gym(tmp_path: Path) -> None:
    async def go() -> None:
        mine = FileCaptureLedger(tmp_path)
        await mine.record(_commit(ours, ("commit", "c1", 0, 0, 2, None, None)))
        await mine.retire(["r"])
        reference = nemo_lineage.FileLineageStore(tmp_path)
        assert await reference.has_rows("r") is False  # the rows are gone; the fence unread
        assert (tmp_path / "r.lineage.retired").exists()

    asyncio.run(go())


def test_a_torn_tail_nemo_gym_left_is_not_folded_in(tmp_path: Path) -> None:
    good = asyncio.run(_row_of(tmp_path / "seed", ("commit", "c1", 0, 0, 2, 1.5, None)))
    _write(tmp_path / "d", [good])
    path = tmp_path / "d" / "r.lineage.jsonl"
    path.write_bytes(path.read_bytes() + b'{"failure_reason":"x","mo')
    ledger = FileCaptureLedger(tmp_path / "d")
    assert [r["model_call_id"] for r in ledger.manifest_now("r")["records"]] == ["c1"]
    ledger.record_failure_now("r", "c2", "late")
    assert path.read_bytes() == good + b'\n{"failure_reason":"late","model_call_id":"c2"}\n'
    mine, reference = asyncio.run(_readings(tmp_path / "d"))
    assert mine == reference


def _concurrent_writer(root: str, nemo: bool) -> None:
    async def go() -> None:
        writer = nemo_lineage.FileLineageStore(root) if nemo else FileCaptureLedger(root)
        module = theirs if nemo else ours
        for n in range(12):
            op = ("commit", f"{'n' if nemo else 'o'}{n}", n % 4, n % 3, 2, None, None)
            await writer.record(_commit(module, op))
            await writer.record_failure("r", f"f{n}", "boom")  # both write it: one row
        await writer.record(_commit(module, ("commit", "common", 0, 0, 2, 1.5, None)))

    asyncio.run(go())


def test_concurrent_writers_of_both_kinds_share_the_lock(tmp_path: Path) -> None:
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.starmap(_concurrent_writer, [(str(tmp_path), True), (str(tmp_path), False)])
    lines = (tmp_path / "r.lineage.jsonl").read_bytes().splitlines()
    assert len(lines) == 12 + 12 + 12 + 1
    mine, reference = asyncio.run(_readings(tmp_path))
    assert mine == reference
    assert len(mine[0]["records"]) == 25


def test_our_ledger_records_nemo_gyms_commit_objects(tmp_path: Path) -> None:
    op = ("commit", "c1", 3, 2, 2, 1e-05, None)

    async def go() -> None:
        await FileCaptureLedger(tmp_path / "a").record(_commit(theirs, op))
        await nemo_lineage.FileLineageStore(tmp_path / "b").record(_commit(theirs, op))

    asyncio.run(go())
    written = (tmp_path / "a" / "r.lineage.jsonl").read_bytes()
    assert written == (tmp_path / "b" / "r.lineage.jsonl").read_bytes()
    assert b'"admitted_at":1e-05' in written and b"\\u00e9" in written


def test_async_methods_check_their_arguments_when_called(tmp_path: Path) -> None:
    ledger = FileCaptureLedger(tmp_path)
    # NeMo Gym 0.7.0 code calls `store.delete(rollout_id)` without awaiting: it must fail here.
    with pytest.raises(TypeError):
        ledger.delete("r")  # type: ignore[unused-coroutine]  # a bare string
    with pytest.raises(TypeError):
        ledger.retire("r")  # type: ignore[unused-coroutine]
    with pytest.raises(TypeError):
        ledger.record("not a commit")  # type: ignore[arg-type,unused-coroutine]
    with pytest.raises(ValidationError):
        ledger.record({"rollout_id": "r"})  # type: ignore[unused-coroutine]
    with pytest.raises(ValueError, match="must not be empty"):
        ledger.record_failure("r", "", "x")  # type: ignore[unused-coroutine]
    for read in (ledger.manifest, ledger.has_rows):
        with pytest.raises(ValueError):
            read("../escape")
    with pytest.raises(TypeError):
        ledger.resolve("r", "not a list")  # type: ignore[arg-type,unused-coroutine]
    assert list(tmp_path.iterdir()) == []


@SETTINGS
@given(
    st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12),
    st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12),
)
def test_failure_rows_are_escaped_as_nemo_gym_escapes_them(call_id: str, reason: str) -> None:
    # Control characters, DEL, non-ASCII and astral characters are all \u-escaped by Python.
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        roots = [Path(scratch) / "ours", Path(scratch) / "nemo"]

        async def go() -> None:
            await FileCaptureLedger(roots[0]).record_failure("r", call_id, reason)
            await nemo_lineage.FileLineageStore(roots[1]).record_failure("r", call_id, reason)

        asyncio.run(go())
        written = [(root / "r.lineage.jsonl").read_bytes() for root in roots]
        assert written[0] == written[1]
        mine, reference = asyncio.run(_readings(roots[0]))
        assert mine == reference


# A key of the stored row, and a value NeMo Gym's `==` may or may not find equal to it.
MUTATIONS = [
    ("admitted_at", 2),  # 2.0 == 2
    ("admitted_at", True),  # 2.0 != True
    ("admitted_at", 2.0000000000000004),
    ("prev_len", False),  # 0 == False
    ("prev_len", 0.0),
    ("prev_len", None),
    ("weight_version", 1.0),
    ("weight_version", "1"),
    ("fingerprint_version", 2.0),
    ("staging_chain", ["seg-c1"]),
    ("staging_chain", ["seg-c1", "x"]),
    ("staging_chain", "seg-c1"),
    ("output_fingerprint", ""),
    ("response_id", "resp-c1-\u00e9"),
    ("response_id", "resp-c1-e"),
    ("extra", None),  # an added key
    ("parent_call_id", ...),  # a removed key
]


@SETTINGS
@given(st.sampled_from(MUTATIONS), st.booleans())
def test_write_once_compares_rows_as_nemo_gym_does(mutation: tuple[str, Any], pretty: bool) -> None:
    import json
    import tempfile

    key, value = mutation
    op = ("commit", "c1", 0, 0, 2, 2.0, None)
    with tempfile.TemporaryDirectory() as scratch:
        seed = asyncio.run(_row_of(Path(scratch) / "seed", op))
        row = json.loads(seed)
        if value is ...:
            del row[key]
        else:
            row[key] = value
        # The stored row need not be in canonical form: spacing, key order, raw UTF-8.
        line = json.dumps(row)
        if pretty:
            line = json.dumps(dict(reversed(list(row.items()))), ensure_ascii=False)
        roots = [Path(scratch) / "ours", Path(scratch) / "nemo"]
        for root in roots:
            root.mkdir()
            (root / "r.lineage.jsonl").write_bytes(line.encode() + b"\n")

        async def go() -> list[str]:
            return [
                await _apply(FileCaptureLedger(roots[0]), op, nemo=False),
                await _apply(nemo_lineage.FileLineageStore(roots[1]), op, nemo=True),
            ]

        mine, reference = asyncio.run(go())
        assert mine == reference, (key, value)
        written = [(root / "r.lineage.jsonl").read_bytes() for root in roots]
        assert written[0] == written[1]


def test_write_once_tells_integers_beyond_64_bits_apart(tmp_path: Path) -> None:
    op = ("commit", "c1", 0, 0, 2, None, None)

    def big(module: Any, weight_version: int) -> Any:
        commit = _commit(module, op)
        commit.record.weight_version = weight_version  # the models are mutable
        return commit

    async def go() -> list[str]:
        outcomes = []
        for root in (tmp_path / "ours", tmp_path / "nemo"):
            await nemo_lineage.FileLineageStore(root).record(big(theirs, 2**70))
        for nemo, root in ((False, tmp_path / "ours"), (True, tmp_path / "nemo")):
            writer = nemo_lineage.FileLineageStore(root) if nemo else FileCaptureLedger(root)
            for weight_version in (2**70, 2**70 + 1):
                commit = big(theirs if nemo else ours, weight_version)
                try:
                    await writer.record(commit)
                    outcomes.append("ok")
                except ValueError:
                    outcomes.append("conflict")
        return outcomes

    assert asyncio.run(go()) == ["ok", "conflict", "ok", "conflict"]
    ours_bytes = (tmp_path / "ours" / "r.lineage.jsonl").read_bytes()
    assert ours_bytes == (tmp_path / "nemo" / "r.lineage.jsonl").read_bytes()
    assert b'"weight_version":1180591620717411303424' in ours_bytes
    manifest = FileCaptureLedger(tmp_path / "ours").manifest_now("r")
    assert manifest["records"][0]["weight_version"] == 2**70


def test_nemo_gym_models_nest_inside_ours() -> None:
    commit = _commit(theirs, ("commit", "c1", 0, 0, 2, 1.5, None))
    mine = ours.CaptureLedgerCommit(
        rollout_id="r",
        record=commit.record,  # NeMo Gym's CallRecord instance
        request_items=commit.request_items,
        response_items=commit.response_items,
    )
    assert isinstance(mine.record, ours.CallRecord)
    assert mine.record.model_dump() == commit.record.model_dump()
    manifest = ours.RolloutManifest(rollout_id="r", records=[commit.record])
    assert (
        manifest.model_dump_json()
        == theirs.RolloutManifest(rollout_id="r", records=[commit.record]).model_dump_json()
    )
    # A changed foreign instance is validated again, not trusted.
    commit.record.delta_len = 0
    with pytest.raises(ValidationError, match="manifest lengths"):
        ours.RolloutManifest(rollout_id="r", records=[commit.record])
    # Another model of another name is refused as pydantic refuses it.
    with pytest.raises(ValidationError, match="valid dictionary or instance of CallRecord"):
        ours.RolloutManifest(
            rollout_id="r", records=[theirs.ManifestFailure(model_call_id="c", reason="x")]
        )


def test_nemo_gyms_published_golden_vectors() -> None:
    vectors = import_nemo("staging.conformance").load_golden_vectors()
    assert ours.compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert ours.compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]
