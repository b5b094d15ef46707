"""An adversarial second differential of the capture ledger against NeMo Gym 0.7.0.

Written apart from `tests/test_nemo_gym_ledger.py`, with its own scenario generator: a seeded
`random.Random` draws sequences of `record` / `record_failure` calls (commit after failure,
failure after commit, the same commit again, a different commit under a used call id, optional
record fields `None` or set, empty and 40-segment staging chains, fingerprint versions 0 to 3,
lengths past 2^40, weight versions past 2^64, non-ASCII and astral text in ids and response
ids, Responses / Chat items with floats in tool arguments) and runs each sequence three times:
with NeMo Gym's `FileLineageStore` as the only writer, with ours only, and with the writer
drawn per call. The outcomes (stored / conflict / error type), the bytes of the file and what
both implementations read back (manifest, `has_rows`, `resolve` over probes that continue each
recorded call, and over falsy request items) must be the same. Rows NeMo Gym's writer makes
from odd `record_failure` arguments are read back as NeMo Gym reads them, and our retire /
delete is checked from NeMo Gym's side (a deleted or retired rollout reads as empty there, a
reused id starts over).

`TOKENCAPTURE_ADVERSARIAL_EXAMPLES` scales the scenario count (default 1500 gives 60 scenarios;
run 20000 or more locally).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import resolution_answer, sha
from tests.nemo_oracle import import_nemo

from tokencapture import records as ours_records
from tokencapture.ledger import CaptureLedgerConflictError, FileCaptureLedger
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.protocols import RolloutRetiredError
from tokencapture.reference.lineage import FileLineageStore as ReferenceLineageStore
from tokencapture.staging import records as ours

theirs = import_nemo("staging.records")
nemo_lineage = import_nemo("lineage")

EXAMPLES = int(os.environ.get("TOKENCAPTURE_ADVERSARIAL_EXAMPLES", "1500"))
SCENARIOS = max(EXAMPLES // 25, 4)


REQUESTS: list[list[dict[str, Any]]] = [
    [],
    [{"role": "user", "content": "q"}],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "é\U0001f600 e\u0301"},
    ],
    [
        {"role": "system", "content": [{"type": "input_text", "text": "s"}]},
        {
            "type": "function_call",
            "call_id": "t",
            "name": "f",
            "arguments": '{"b":1,"a":[1.5,1e16,-0.0],"b":2}',
        },
        {"type": "function_call_output", "call_id": "t", "output": {"v": 1e-7}},
    ],
]
RESPONSES: list[list[dict[str, Any]]] = [
    [],
    [{"role": "assistant", "content": "a"}],
    [{"role": "assistant", "content": [{"type": "output_text", "text": "x\u2028\x00"}]}],
    [{"type": "function_call", "call_id": "t2", "name": "g", "arguments": " {} "}],
    [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "function": {"name": None, "arguments": "NaN"}}],
        }
    ],
]
CALL_IDS = ["c1", "c2", "c3", "é", "c/x", "\U0001f600"]


def _record_fields(rng: random.Random) -> dict[str, Any]:
    call = rng.choice(CALL_IDS)
    parent = rng.choice([None, None, "c1", "p\u00e9"])
    prev = 0 if parent is None else rng.choice([1, 7, 2**40])
    delta = rng.choice([1, 3])
    return {
        "model_call_id": call,
        "parent_call_id": parent,
        "prev_len": prev,
        "delta_len": delta,
        "cum_len": prev + delta,
        "weight_version": rng.choice([0, 1, 2**70]),
        "digest": sha("d" + call),
        "extras_digest": sha("e"),
        "staging_key": rng.choice([f"r/{call}", "k\u00e9"]),
        "mode": "text" if parent is None else "token_in",
        "chain_hash": sha("ch" + call),
        "cumulative_hash": sha("cu" + call + str(rng.randint(0, 1))),
        "response_id": rng.choice(["resp", "r\u00e9\U0001f600", "x\x00y"]),
        "admitted_at": rng.choice([None, 1.5, 1e-7, 1e16, 5.0, 1 / 3, -0.0, 1.7e9 + 0.123]),
        "output_fingerprint": rng.choice([None, sha("o")]),
        "continuation_fingerprint": rng.choice([None, sha("c")]),
        "fingerprint_version": rng.choice([0, 1, 2, 2, 2, 3]),
    }


def _commit_fields(rng: random.Random) -> dict[str, Any]:
    chain_len = rng.choice([0, 1, 2, 40])
    return {
        "rollout_id": "r",
        "record": _record_fields(rng),
        "staging_chain": tuple(f"seg{i}" for i in range(chain_len)),
        "request_items": rng.choice(REQUESTS),
        "response_items": rng.choice(RESPONSES),
    }


Op = tuple[Any, ...]


def scenario(rng: random.Random) -> list[Op]:
    ops: list[Op] = []
    for _ in range(rng.randint(1, 10)):
        if rng.random() < 0.6:
            ops.append(("commit", _commit_fields(rng)))
        else:
            reason = rng.choice(["boom", "é", "worker_capture_failed", "x" * 300])
            ops.append(("failure", rng.choice([*CALL_IDS, "c9"]), reason))
        if rng.random() < 0.3:
            ops.append(ops[-1])  # a replay
    return ops


def _commit(module: Any, fields: dict[str, Any]) -> Any:
    record = module.CallRecord(**fields["record"])
    return module.CaptureLedgerCommit(**{**fields, "record": record})


async def apply(writer: Any, op: Op, nemo: bool) -> str:
    try:
        if op[0] == "failure":
            await writer.record_failure("r", op[1], op[2])
        else:
            await writer.record(_commit(theirs if nemo else ours, op[1]))
    except ValueError as error:
        # Ours may add detail, but says what NeMo Gym says (callers match on its wording).
        call_id = op[1] if op[0] == "failure" else op[1]["record"]["model_call_id"]
        if str(error).startswith(f"conflicting lineage record for model call {call_id}"):
            return "conflict"
        return f"{type(error).__name__}: {error}"
    return "ok"


def _probes() -> list[Any]:
    probes: list[Any] = [[], None, "", {}, ()]
    for request in REQUESTS:
        for response in RESPONSES:
            probes.append([*request, *response, {"role": "user", "content": "next"}])
            probes.append(tuple([*request, *response]))
    probes.extend(RESPONSES)
    return probes


async def _attempt(method: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Await ``method(*args)``; an error (raised when called or when awaited) is its type."""
    try:
        return await method(*args)
    except Exception as error:  # any error: its type is the answer
        return type(error).__name__


def loosely(reading: Any) -> Any:
    """A reading with every error type name replaced by the built-in error it subclasses (our
    `TokenCaptureCorruptionError` stands in for NeMo Gym's pydantic `ValidationError` where a
    row cannot become a manifest entry: both are `ValueError`s)."""
    if isinstance(reading, str) and reading.endswith("Error"):
        return "ValueError" if reading in ERROR_BASES else reading
    if isinstance(reading, list | tuple):
        return type(reading)(loosely(part) for part in reading)
    return reading


ERROR_BASES = {"ValueError", "ValidationError", "TokenCaptureCorruptionError"}


async def readings(root: Path, rollout_id: str = "r") -> list[Any]:
    """What each implementation reads back (ours first, then NeMo Gym's)."""
    out = []
    for reader in (FileCaptureLedger(root), nemo_lineage.FileLineageStore(root)):
        answers = [
            resolution_answer(await _attempt(reader.resolve, rollout_id, probe))
            for probe in _probes()
        ]
        manifest = await _attempt(reader.manifest, rollout_id)
        has_rows = await _attempt(reader.has_rows, rollout_id)
        out.append((manifest, has_rows, answers))
    return out


async def run(ops: list[Op], root: Path, writers: str, rng: random.Random) -> list[str]:
    mine, reference = FileCaptureLedger(root), nemo_lineage.FileLineageStore(root)
    outcomes = []
    for op in ops:
        nemo = writers == "nemo" or (writers == "mixed" and rng.random() < 0.5)
        outcomes.append(await apply(reference if nemo else mine, op, nemo))
    return outcomes


def _file(root: Path) -> bytes | None:
    path = root / "r.lineage.jsonl"
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize("seed", range(4))
def test_generated_scenarios_write_and_read_as_nemo_gym(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for number in range(max(SCENARIOS // 4, 1)):
        ops = scenario(rng)
        roots = {name: tmp_path / f"{number}-{name}" for name in ("ours", "nemo", "mixed")}
        outcomes = {
            name: asyncio.run(run(ops, root, name, random.Random(number)))
            for name, root in roots.items()
        }
        assert outcomes["ours"] == outcomes["nemo"] == outcomes["mixed"], ops
        files = {name: _file(root) for name, root in roots.items()}
        assert files["ours"] == files["nemo"] == files["mixed"], ops
        for root in roots.values():
            mine, reference = asyncio.run(readings(root))
            assert mine == reference, ops


FALSY_ITEMS: list[Any] = [None, "", b"", {}, 0, False, 0.0, ()]
TRUTHY_NON_LISTS: list[Any] = ["ab", {"role": "assistant"}, 5, b"x"]


def _resolvers(root: Path) -> dict[str, Any]:
    return {
        "FileCaptureLedger": FileCaptureLedger(root),
        "FileLineageStore": FileLineageStore(root),
        "InMemoryLineageStore": InMemoryLineageStore(),
        "reference.FileLineageStore": ReferenceLineageStore(root),
    }


@pytest.mark.parametrize("items", FALSY_ITEMS, ids=repr)
def test_falsy_request_items_are_a_root_as_in_nemo_gym(tmp_path: Path, items: Any) -> None:
    """NeMo Gym's resolvers read request items as ``items or []``: a falsy value is a request
    without history, a root (its `FileLineageStore` and `InMemoryLineageStore` alike)."""

    async def go() -> None:
        await nemo_lineage.FileLineageStore(tmp_path).record(
            _commit(theirs, _commit_fields(random.Random(1)))
        )
        for reference in (
            nemo_lineage.FileLineageStore(tmp_path),
            nemo_lineage.InMemoryLineageStore(),
        ):
            assert resolution_answer(await reference.resolve("r", items)) == ("root", "", None)
        for name, resolver in _resolvers(tmp_path).items():
            assert resolution_answer(await resolver.resolve("r", items)) == ("root", "", None), name
            if hasattr(resolver, "resolve_now"):
                assert resolution_answer(resolver.resolve_now("r", items)) == ("root", "", None), (
                    name
                )

    asyncio.run(go())


@pytest.mark.parametrize("items", TRUTHY_NON_LISTS, ids=repr)
def test_truthy_non_list_items_are_refused_where_nemo_gym_raises(
    tmp_path: Path, items: Any
) -> None:
    async def go() -> None:
        for reference in (
            nemo_lineage.FileLineageStore(tmp_path),
            nemo_lineage.InMemoryLineageStore(),
        ):
            with pytest.raises((TypeError, ValueError)):
                await reference.resolve("r", items)
        for name, resolver in _resolvers(tmp_path).items():
            with pytest.raises(TypeError):
                resolver.resolve("r", items)  # refused when called, before any await
            del name

    asyncio.run(go())


ODD_FAILURES: list[tuple[Any, Any]] = [
    ("c\ud800", "x"),
    ("c", "\udfff"),
    ("c", float("nan")),
    ("c", float("inf")),
    (float("-inf"), "x"),
    ("c", ["\ud83d", {"k": float("nan")}, "\ud83d\ude00"]),
    ("c", 1e300),
    (None, "x"),
    (7, {"nested": [True, None]}),
]


@pytest.mark.parametrize(("call_id", "reason"), ODD_FAILURES, ids=repr)
def test_failure_rows_nemo_gym_writes_for_odd_arguments_read_and_extend_alike(
    tmp_path: Path, call_id: Any, reason: Any
) -> None:
    """NeMo Gym's `record_failure` does not check its arguments: `json.dumps` writes a lone
    surrogate as an escape and a non-finite float as `NaN` / `Infinity`, which its reader
    (`json.loads`) reads back. Ours must read such a row as NeMo Gym does (`has_rows`,
    `resolve`, and the manifest or its refusal), and both must go on extending the file."""
    commit = _commit_fields(random.Random(3))
    commit["record"]["fingerprint_version"] = 2

    async def go(root: Path, writer: str) -> list[Any]:
        reference = nemo_lineage.FileLineageStore(root)
        await reference.record_failure("r", call_id, reason)
        first = loosely(await readings(root))
        extender = reference if writer == "nemo" else FileCaptureLedger(root)
        await extender.record_failure("r", "c", "later")
        await extender.record(_commit(theirs if writer == "nemo" else ours, commit))
        return [first, loosely(await readings(root))]

    for_nemo = asyncio.run(go(tmp_path / "nemo", "nemo"))
    for_ours = asyncio.run(go(tmp_path / "ours", "ours"))
    for mine, reference in for_nemo + for_ours:
        assert mine == reference
    assert for_ours == for_nemo
    assert (tmp_path / "ours" / "r.lineage.jsonl").read_bytes() == (
        tmp_path / "nemo" / "r.lineage.jsonl"
    ).read_bytes()


def _mixed(ops: list[Op], root: Path, seed: int) -> list[str]:
    return asyncio.run(run(ops, root, "mixed", random.Random(seed)))


@pytest.mark.parametrize("seed", range(3))
def test_a_deleted_rollout_id_starts_over_for_both(tmp_path: Path, seed: int) -> None:
    """After our `delete`, the id is unused on both sides: what follows writes and reads as in
    a fresh directory, whoever writes."""
    rng = random.Random(100 + seed)
    before, after = scenario(rng), scenario(rng)
    reused, fresh = tmp_path / "reused", tmp_path / "fresh"
    _mixed(before, reused, seed)
    removal = asyncio.run(FileCaptureLedger(reused).delete(["r", "unused"]))
    assert removal == {"removed": ["r"], "absent": ["unused"]}
    assert asyncio.run(nemo_lineage.FileLineageStore(reused).has_rows("r")) is False
    assert _mixed(after, reused, seed) == _mixed(after, fresh, seed)
    assert _file(reused) == _file(fresh)
    assert asyncio.run(readings(reused)) == asyncio.run(readings(fresh))


def test_a_retired_rollout_reads_as_empty_to_nemo_gym_and_stays_fenced_for_us(
    tmp_path: Path,
) -> None:
    ops: list[Op] = [("commit", _commit_fields(random.Random(seed))) for seed in range(3)]
    ops.append(("failure", "c1", "boom"))
    _mixed(ops, tmp_path, 0)

    async def go() -> None:
        mine, reference = FileCaptureLedger(tmp_path), nemo_lineage.FileLineageStore(tmp_path)
        assert await mine.retire(["r"]) == {"removed": ["r"], "absent": []}
        assert await mine.retire(["r"]) == {"removed": [], "absent": ["r"]}
        # NeMo Gym knows no fence: the rows are gone, so the rollout reads as unused.
        assert await reference.has_rows("r") is False
        assert (await reference.manifest("r"))["records"] == []
        # Ours refuses to read it as empty and discards late writes.
        with pytest.raises(RolloutRetiredError):
            await mine.has_rows("r")
        with pytest.raises(RolloutRetiredError):
            await mine.manifest("r")
        await mine.record_failure("r", "late", "x")
        await mine.record(_commit(ours, ops[0][1]))
        assert not (tmp_path / "r.lineage.jsonl").exists()
        # A late NeMo Gym writer starts a new file; our fence still holds until delete.
        await reference.record_failure("r", "late", "x")
        assert await reference.has_rows("r") is True
        with pytest.raises(RolloutRetiredError):
            await mine.has_rows("r")
        probe = [*REQUESTS[1], *RESPONSES[1]]
        assert resolution_answer(await mine.resolve("r", probe)) == ("unresolved", "no_match", None)
        assert await mine.delete(["r"]) == {"removed": ["r"], "absent": []}
        assert await mine.has_rows("r") is False
        assert await reference.has_rows("r") is False

    asyncio.run(go())


def test_a_long_ledger_of_both_writers_reads_alike(tmp_path: Path) -> None:
    """Hundreds of rows, interleaved writers, commits under 60 call ids (replays, conflicts,
    failures before and after their commits)."""
    rng = random.Random(7)
    ops: list[Op] = []
    for number in range(240):
        if rng.random() < 0.7:
            fields = _commit_fields(rng)
            fields["record"]["model_call_id"] = f"call-{rng.randrange(60)}"
            fields["record"]["fingerprint_version"] = 2
            fields["response_items"] = [{"role": "assistant", "content": f"answer {number}"}]
            ops.append(("commit", fields))
        else:
            ops.append(("failure", f"call-{rng.randrange(60)}", rng.choice(["a", "b"])))
        if rng.random() < 0.2:
            ops.append(ops[-1])
    outcomes_mixed = _mixed(ops, tmp_path / "mixed", 7)
    outcomes_nemo = asyncio.run(run(ops, tmp_path / "nemo", "nemo", random.Random(0)))
    assert outcomes_mixed == outcomes_nemo
    assert {"ok", "conflict"} <= set(outcomes_nemo)
    assert _file(tmp_path / "mixed") == _file(tmp_path / "nemo")
    mine, reference = asyncio.run(readings(tmp_path / "mixed"))
    assert mine == reference
    assert len(mine[0]["records"]) > 30


def test_resolve_with_zero_one_and_two_candidate_rows(tmp_path: Path) -> None:
    """One fingerprint-2 row resolves; a second row with the same fingerprint makes both no
    candidates (`no_match`, never `ambiguous`); rows of versions 0, 1 and 3 never count."""
    base = _commit_fields(random.Random(11))
    base["request_items"] = REQUESTS[2]
    base["response_items"] = RESPONSES[3]
    probe = [*REQUESTS[2], *RESPONSES[3], {"type": "function_call_output", "call_id": "t2"}]

    def commit(call_id: str, version: int) -> Op:
        fields = {**base, "record": {**base["record"], "model_call_id": call_id}}
        fields["record"]["fingerprint_version"] = version
        fields["record"]["staging_key"] = f"r/{call_id}"
        return ("commit", fields)

    steps: list[tuple[Op, Any]] = [
        (commit("v0", 0), ("unresolved", "no_match")),
        (commit("v1", 1), ("unresolved", "no_match")),
        (commit("v3", 3), ("unresolved", "no_match")),
        (commit("one", 2), ("resolved", "")),
        (commit("one", 2), ("resolved", "")),  # a replay adds no row
        (("failure", "one", "boom"), ("resolved", "")),  # poisons the manifest only
        (("failure", "x", "boom"), ("resolved", "")),
        (commit("x", 2), ("resolved", "")),  # a commit after its failure row conflicts
        (commit("two", 2), ("unresolved", "no_match")),
    ]
    for index, (op, expected) in enumerate(steps):
        root = tmp_path / str(index)
        ops = [step for step, _ in steps[: index + 1]]
        outcomes = asyncio.run(run(ops, root, "ours", random.Random(0)))
        assert outcomes == asyncio.run(run(ops, tmp_path / f"n{index}", "nemo", random.Random(0)))
        assert outcomes[-1] == ("conflict" if index == 7 else "ok")
        for reader in (FileCaptureLedger(root), nemo_lineage.FileLineageStore(root)):
            got = resolution_answer(asyncio.run(reader.resolve("r", probe)))
            assert got[:2] == expected, (index, type(reader).__name__)
        del op


HAND_LAID: dict[str, bytes] = {
    "empty": b"",
    "blank lines": b"\n\n",
    "whitespace lines": b"  \n\t\n\x0b\x0c\n",
    "crlf": b'{"failure_reason":"x","model_call_id":"c"}\r\n',
    "duplicate keys": b'{"failure_reason":"x","model_call_id":"a","model_call_id":"b"}\n',
    "raw utf-8": '{"failure_reason":"é\U0001f600","model_call_id":"c"}\n'.encode(),
    "null reason": b'{"failure_reason":null,"model_call_id":"c"}\n',
    "NaN inside": b'{"failure_reason":"x","model_call_id":"c","z":[NaN,-Infinity]}\n',
    "surrogate pair": b'{"failure_reason":"\\ud83d\\ude00","model_call_id":"c"}\n',
    "lone surrogate": b'{"failure_reason":"x","model_call_id":"c\\ud800"}\n',
    "escaped quote before NaN": b'{"failure_reason":"\\"NaN","model_call_id":"c","v":NaN}\n',
}


@pytest.mark.parametrize("content", HAND_LAID.values(), ids=HAND_LAID.keys())
def test_hand_laid_files_nemo_gyms_reader_accepts_read_alike(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / "r.lineage.jsonl").write_bytes(content)
    mine, reference = loosely(asyncio.run(readings(tmp_path)))
    assert mine == reference


def test_a_conflict_says_what_nemo_gym_says(tmp_path: Path) -> None:
    first = _commit_fields(random.Random(5))
    second = {**first, "record": {**first["record"], "cumulative_hash": sha("another")}}
    call_id = first["record"]["model_call_id"]
    expected = f"conflicting lineage record for model call {call_id}"

    async def go() -> None:
        reference = nemo_lineage.FileLineageStore(tmp_path / "nemo")
        await reference.record(_commit(theirs, first))
        with pytest.raises(ValueError) as theirs_error:
            await reference.record(_commit(theirs, second))
        assert str(theirs_error.value) == expected
        mine = FileCaptureLedger(tmp_path / "ours")
        await mine.record(_commit(ours, first))
        with pytest.raises(CaptureLedgerConflictError) as awaited:
            await mine.record(_commit(ours, second))
        with pytest.raises(CaptureLedgerConflictError) as synchronous:
            mine.record_now(_commit(ours, second))
        for error in (awaited.value, synchronous.value):
            assert str(error).startswith(expected + ":"), error

    asyncio.run(go())


async def _store_readings(store: Any) -> tuple[Any, Any, list[Any]]:
    answers = [resolution_answer(await _attempt(store.resolve, "r", probe)) for probe in _probes()]
    return (
        await _attempt(store.manifest, "r"),
        await _attempt(store.has_rows, "r"),
        answers,
    )


@pytest.mark.parametrize("seed", range(2))
def test_in_memory_ledgers_answer_as_nemo_gyms(seed: int) -> None:
    """NeMo Gym's `InMemoryLineageStore` is a capture ledger too, with rules of its own: its
    rows are the custody columns only (write-once against the first row of the call id, a
    failure row included), and a committed call resolves whatever its fingerprint version,
    with several matching calls collapsed when they share (digest, cum_len) and "ambiguous"
    otherwise. Ours must answer the same scenarios alike."""
    rng = random.Random(200 + seed)
    for _ in range(max(SCENARIOS // 2, 2)):
        ops = scenario(rng)

        async def go(store: Any, nemo: bool, ops: list[Op] = ops) -> Any:
            outcomes = [await apply(store, op, nemo) for op in ops]
            return outcomes, await _store_readings(store)

        mine = asyncio.run(go(InMemoryLineageStore(), False))
        reference = asyncio.run(go(nemo_lineage.InMemoryLineageStore(), True))
        assert mine == reference, ops


@pytest.mark.parametrize("seed", range(2))
def test_our_file_lineage_store_is_nemo_gyms_ledger_too(tmp_path: Path, seed: int) -> None:
    """NeMo Gym's `FileLineageStore` is its file capture ledger: ours, over the same
    directory, writes the same bytes and reads the same answers."""
    rng = random.Random(300 + seed)
    for number in range(max(SCENARIOS // 4, 2)):
        ops = scenario(rng)
        roots = (tmp_path / f"{number}-ours", tmp_path / f"{number}-nemo")

        async def go(store: Any, nemo: bool, ops: list[Op] = ops) -> Any:
            outcomes = [await apply(store, op, nemo) for op in ops]
            return outcomes, await _store_readings(store)

        mine = asyncio.run(go(FileLineageStore(roots[0]), False))
        reference = asyncio.run(go(nemo_lineage.FileLineageStore(roots[1]), True))
        assert mine == reference, ops
        assert _file(roots[0]) == _file(roots[1])


MIXED_STEPS: list[list[tuple[Any, ...]]] = [
    [("put", "c1", True), ("record", "c1", "c1")],
    [("record", "c1", "c1"), ("put", "c1", True)],
    [("put", "c1", False)],
    [("put", "c1", False), ("record", "c1", "c1")],
    [("record", "c1", "c1"), ("put", "c1", False)],
    [("put", "c1", True), ("record", "c2", "c9"), ("put", "c3", True)],
    [("failure", "c1"), ("put", "c1", True)],
    # One entry and one committed call answering alike: two candidates, "ambiguous".
    [("put", "c1", True), ("record", "c2", "c1")],
    [("record", "c2", "c1"), ("put", "c1", True)],
    [("record", "c2", "c1"), ("record", "c3", "c1")],
    [("record", "c2", "c1"), ("put", "c1", False)],
]


@pytest.mark.parametrize("steps", MIXED_STEPS, ids=repr)
def test_in_memory_entries_and_ledger_rows_share_call_ids_as_in_nemo_gym(
    steps: list[tuple[Any, ...]],
) -> None:
    """In NeMo Gym's in-memory store a call id is a put entry or a committed ledger row, not
    both (the second raises its conflict), and `has_rows` counts only entries its index takes
    (stamped with a fingerprint)."""
    nemo_records = import_nemo("records")
    nemo_fingerprint = import_nemo("fingerprint")
    request = [{"role": "user", "content": "q"}]

    def entry(call_id: str, stamped: bool, nemo: bool) -> Any:
        fields: dict[str, Any] = {
            "rollout_id": "r",
            "model_call_id": call_id,
            "model": "m",
            "prompt_token_ids": [1, 2],
            "generation_token_ids": [3],
            "generation_log_probs": [-0.5],
            "output_items": [{"role": "assistant", "content": f"answer {call_id}"}],
            # With its digest: NeMo Gym reports an entry's recorded digest ("" when it has
            # none) where ours reports the digest of the rebuilt tokens.
            "digest": nemo_records.compute_digest([1, 2, 3]),
        }
        if stamped:
            fields["continuation_fingerprint"] = nemo_fingerprint.assistant_fingerprint(
                [*request, *fields["output_items"]]
            )
            fields["continuation_context_len"] = 1
            fields["continuation_context_digest"] = nemo_fingerprint.conversation_digest(request)
            fields["fingerprint_version"] = 2
        return (nemo_records if nemo else ours_records).TokenEntry(**fields)

    async def go(store: Any, nemo: bool) -> list[Any]:
        out: list[Any] = []
        for step in steps:
            try:
                if step[0] == "put":
                    await store.put(entry(step[1], step[2], nemo))
                elif step[0] == "failure":
                    await store.record_failure("r", step[1], "boom")
                else:
                    fields = _commit_fields(random.Random(1))
                    fields["record"]["model_call_id"] = step[1]
                    fields["record"]["cumulative_hash"] = sha(f"cumulative {step[1]}")
                    fields["request_items"] = request
                    fields["response_items"] = [
                        {"role": "assistant", "content": f"answer {step[2]}"}
                    ]
                    await store.record(_commit(theirs if nemo else ours, fields))
                out.append("ok")
            except ValueError as error:
                expected = f"conflicting lineage record for model call {step[1]}"
                out.append("conflict" if str(error).startswith(expected) else repr(error))
        out.append(await store.has_rows("r"))
        for answered in ("c1", "c9"):
            probe = [*request, {"role": "assistant", "content": f"answer {answered}"}]
            out.append(
                resolution_answer(
                    await store.resolve("r", [*probe, {"role": "user", "content": "n"}])
                )
            )
        return out

    assert asyncio.run(go(InMemoryLineageStore(), False)) == asyncio.run(
        go(nemo_lineage.InMemoryLineageStore(), True)
    )
