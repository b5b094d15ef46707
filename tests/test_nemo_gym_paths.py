"""NeMo Gym 0.7.0's own code paths driven with our classes in place of its own (issue 15).

Each NeMo Gym function that takes a sink, source, lineage resolver, capture ledger, token entry,
staging model or lineage answer runs the same scenario twice: once with NeMo Gym's classes and
once with ours (`tokencapture.TokenCaptureStore`, `FileLineageStore`, `InMemoryLineageStore`,
`FileCaptureLedger`, our `TokenEntry` and staging models). The expected values are what NeMo
Gym's code returns with its own classes; the test compares what it returns with ours: values,
the bytes of the files written, manifests and resolutions.

NeMo Gym's modules that cannot be imported without its server stack are not driven here:
`control_routes` (FastAPI) and `delivery` (imports `nemo_gym.rollout_correlation`, which is not
part of the token-capture package; it is replayed below with a stand-in for that one helper).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tests.nemo_oracle import import_nemo

nemo_records = import_nemo("records")
nemo_protocols = import_nemo("protocols")
nemo_lineage = import_nemo("lineage")
nemo_store = import_nemo("store")
nemo_sink = import_nemo("sink")
nemo_builder = import_nemo("builder")
nemo_consumer = import_nemo("consumer")
nemo_terminal = import_nemo("terminal")
nemo_external = import_nemo("external_capture")
nemo_config = import_nemo("config")
nemo_conformance = import_nemo("conformance")
nemo_staging = import_nemo("staging.records")
nemo_capture = import_nemo("staging.capture")
nemo_rebuild = import_nemo("staging.rebuild")
nemo_staging_terminal = import_nemo("staging.terminal")
nemo_golden = import_nemo("staging.conformance")
nemo_vllm = import_nemo("adapters.vllm")

from tokencapture import records as our_records  # noqa: E402
from tokencapture.ledger import FileCaptureLedger  # noqa: E402
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore  # noqa: E402
from tokencapture.staging import records as our_staging  # noqa: E402
from tokencapture.store import TokenCaptureStore  # noqa: E402

NOW = 1700000000.0


@dataclasses.dataclass(frozen=True)
class Side:
    """One implementation's classes, as NeMo Gym's code would be handed them."""

    name: str
    store: Callable[[Path], Any]
    lineage: Callable[[Path], Any]
    memory_lineage: Callable[[], Any]
    ledger: Callable[[Path], Any]
    entry: Any
    staging: Any


NEMO = Side(
    "nemo",
    store=nemo_store.TokenCaptureStore,
    lineage=nemo_lineage.FileLineageStore,
    memory_lineage=nemo_lineage.InMemoryLineageStore,
    ledger=nemo_lineage.FileLineageStore,
    entry=nemo_records.TokenEntry,
    staging=nemo_staging,
)
OURS = Side(
    "ours",
    store=TokenCaptureStore,
    lineage=FileLineageStore,
    memory_lineage=InMemoryLineageStore,
    ledger=FileCaptureLedger,
    entry=our_records.TokenEntry,
    staging=our_staging,
)


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo Gym's sink stamps `created_at` with `time.time()`: fixed, so both runs write the
    same bytes."""
    monkeypatch.setattr(nemo_sink, "time", types.SimpleNamespace(time=lambda: NOW))


def resolution_view(resolution: Any) -> tuple[Any, ...]:
    """A lineage answer as plain values (status by value, the match field by field)."""
    match = None
    if resolution.match is not None:
        match = dataclasses.asdict(resolution.match)
        match["cumulative_token_ids"] = list(match["cumulative_token_ids"])
        match["staging_chain"] = list(match["staging_chain"])
    return (str(resolution.status.value), match, resolution.reason)


def without_snapshot_id(built: dict[str, Any] | None) -> dict[str, Any] | None:
    """A build result without the snapshot id, which each store mints at random."""
    if built is None:
        return None
    copy = dict(built)
    snapshot = dict(copy.pop("_capture_snapshot", {}))
    snapshot.pop("snapshot_id", None)
    copy["_capture_snapshot"] = snapshot
    return copy


# ---- sink.py: resolve_parent, capture_tokens, commit_entry (local capture) ------------------

REQUEST_0 = [{"role": "user", "content": "What is the weather in Paris?"}]
OUTPUT_0 = [
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me check."}],
    }
]


def served(
    output_text: str, prompt: list[int], generated: list[int], response_id: str
) -> dict[str, Any]:
    """A Responses payload as a model server serves it, with its token fields."""
    return {
        "id": response_id,
        "model": "m",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": output_text}],
                "prompt_token_ids": prompt,
                "generation_token_ids": generated,
                "generation_log_probs": [-0.25] * len(generated),
            }
        ],
    }


async def capture_call(
    side: Side, store: Any, lineage: Any, call_id: str, request: list[Any], response: dict[str, Any]
) -> Any:
    """One model call through NeMo Gym's middleware functions; returns the resolution."""
    context = nemo_sink.CaptureContext(
        rollout_id="r1",
        model_call_id=call_id,
        token_sink=store,
        lineage_store=lineage,
        model="m",
        delta_records=True,
    )
    token = nemo_sink.set_token_sink(context)
    try:
        await nemo_sink.register_call_intent()
        await nemo_sink.resolve_parent(request)
        await nemo_sink.capture_tokens(response, request)
    finally:
        nemo_sink.reset_token_sink(token)
    assert context.committed, f"{side.name}: call {call_id} was not committed"
    return context.parent_resolution


async def local_capture_scenario(side: Side, root: Path) -> dict[str, Any]:
    store, lineage = side.store(root), side.lineage(root)
    try:
        first = await capture_call(
            side,
            store,
            lineage,
            "c0",
            REQUEST_0,
            served("Let me check.", [1, 2, 3], [4, 5], "resp-0"),
        )
        request_1 = [*REQUEST_0, *OUTPUT_0, {"role": "user", "content": "And tomorrow?"}]
        second = await capture_call(
            side,
            store,
            lineage,
            "c1",
            request_1,
            served("Sunny.", [1, 2, 3, 4, 5, 6, 7], [8], "resp-1"),
        )
        # A rewritten history resolves nothing; NeMo Gym records the call unresolved.
        third = await capture_call(
            side,
            store,
            lineage,
            "c2",
            [{"role": "user", "content": "REWRITTEN"}, *OUTPUT_0],
            served("Hm.", [9, 4, 5], [10], "resp-2"),
        )
        data = store.path_for("r1").read_bytes()
        verified = served("Sunny.", [], [], "resp-1")
        built = await nemo_consumer.trajectories_from_source(
            "r1", store, verified_response=verified
        )
    finally:
        await lineage.close()
        await store.close()
    return {
        "resolutions": [resolution_view(r) for r in (first, second, third)],
        "file": data,
        "names": sorted(path.name for path in root.iterdir()),
        "built": without_snapshot_id(built),
    }


async def test_sink_capture_and_consumer_build_alike(tmp_path: Path) -> None:
    expected = await local_capture_scenario(NEMO, tmp_path / "nemo")
    got = await local_capture_scenario(OURS, tmp_path / "ours")
    assert expected["resolutions"][1][0] == "resolved"  # the scenario does what it means to
    assert got["resolutions"] == expected["resolutions"]
    assert got["file"] == expected["file"]
    assert got["names"] == expected["names"]
    assert got["built"] == expected["built"]


# ---- sink.py + external_capture.py + staging/capture.py: external staging ------------------


class MemoryStagingSink:
    """A framework's staging sink: keeps each staged record under its key, answers with NeMo
    Gym's `StageResult` (the worker code checks that class)."""

    def __init__(self) -> None:
        self.staged: dict[str, Any] = {}

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        self.staged[key] = record
        return nemo_staging.StageResult(ok=True, staging_key=key)

    def prefix(self, staging_chain: list[str]) -> list[int]:
        return [token for key in staging_chain for token in self.staged[key].token_ids_delta]


def served_output(text: str, response_id: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
    }


async def external_call(
    ledger: Any,
    worker: Any,
    sink: MemoryStagingSink,
    call_id: str,
    request: list[Any],
    tokens: tuple[list[int], list[int]],
    served_payload: dict[str, Any],
) -> tuple[Any, Any]:
    """One externally staged call: NeMo Gym's gate resolves and admits it, its worker capture
    stages the tokens, its vLLM handler commits the ledger row. Returns (resolution, context)."""
    context = nemo_sink.CaptureContext(
        rollout_id="r1",
        model_call_id=call_id,
        token_sink=None,
        lineage_store=ledger,
        external_staging=True,
        admitted_at=NOW,
    )
    token = nemo_sink.set_token_sink(context)
    try:
        await nemo_sink.resolve_parent(request)
        handler = nemo_external.make_external_capture_handler("vllm_worker")
        engine_request = handler.prepare_request({"messages": request})
        response = dict(served_payload)
        if nemo_sink.NG_CAPTURE_FIELD in engine_request:
            admission = nemo_staging.CaptureAdmission.model_validate(
                engine_request[nemo_sink.NG_CAPTURE_FIELD]
            )
            prefix = sink.prefix(admission.staging_chain) if admission.mode == "token_in" else None
            call = worker.begin_call(admission, prefix_token_ids=prefix)
            prompt, generated = tokens
            coords = worker.complete_call(
                call,
                prompt_token_ids=[*(prefix or []), *prompt],
                generated_token_ids=generated,
                generated_logprobs=[-0.5] * len(generated),
            )
            response[nemo_sink.NG_COMMIT_COORDS_FIELD] = coords.model_dump(mode="json")
            handler.prepare_response(response)
        await handler.finalize_response(served_payload)
    finally:
        nemo_sink.reset_token_sink(token)
    return context.parent_resolution, context


EXTERNAL_REQUEST_1 = [
    *REQUEST_0,
    *served_output("Let me check.", "x")["output"],
    {"role": "user", "content": "And tomorrow?"},
]


async def external_staging_scenario(side: Side, root: Path) -> dict[str, Any]:
    ledger = side.ledger(root)
    sink = MemoryStagingSink()
    worker = nemo_capture.RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 3)
    try:
        first, c0 = await external_call(
            ledger,
            worker,
            sink,
            "c0",
            REQUEST_0,
            ([1, 2, 3], [4, 5]),
            served_output("Let me check.", "resp-0"),
        )
        second, c1 = await external_call(
            ledger,
            worker,
            sink,
            "c1",
            EXTERNAL_REQUEST_1,
            ([6, 7], [8]),
            served_output("Sunny.", "resp-1"),
        )
        # A rewritten history with ledger rows present is poisoned, never a new root.
        third, c2 = await external_call(
            ledger,
            worker,
            sink,
            "c2",
            [
                {"role": "user", "content": "REWRITTEN"},
                *served_output("Let me check.", "x")["output"],
            ],
            ([9], [10]),
            served_output("Hm.", "resp-2"),
        )
        manifest = await ledger.manifest("r1")
        has_rows = (await ledger.has_rows("r1"), await ledger.has_rows("other"))
    finally:
        await ledger.close()
    return {
        "resolutions": [resolution_view(r) for r in (first, second, third)],
        "committed": [c.committed for c in (c0, c1, c2)],
        "admissions": [
            None if c.capture_admission is None else c.capture_admission.model_dump(mode="json")
            for c in (c0, c1, c2)
        ],
        "file": (root / "r1.lineage.jsonl").read_bytes(),
        "manifest": manifest,
        "has_rows": has_rows,
        "staged": sink.staged,
    }


async def test_external_staging_gate_worker_and_ledger_alike(tmp_path: Path) -> None:
    expected = await external_staging_scenario(NEMO, tmp_path / "nemo")
    got = await external_staging_scenario(OURS, tmp_path / "ours")
    assert expected["committed"] == [True, True, False]
    assert [r[0] for r in expected["resolutions"]] == ["root", "resolved", "unresolved"]
    assert got["resolutions"] == expected["resolutions"]
    assert got["committed"] == expected["committed"]
    assert got["admissions"] == expected["admissions"]
    assert got["file"] == expected["file"]
    assert got["manifest"] == expected["manifest"]
    assert got["has_rows"] == expected["has_rows"]


# ---- staging/terminal.py, staging/rebuild.py, terminal.py: reading the manifest -------------


async def staged_rollout(root: Path) -> tuple[dict[str, Any], MemoryStagingSink]:
    """The external staging scenario's manifest and staged records (written by NeMo Gym)."""
    ledger = NEMO.ledger(root)
    sink = MemoryStagingSink()
    worker = nemo_capture.RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 3)
    try:
        await external_call(
            ledger,
            worker,
            sink,
            "c0",
            REQUEST_0,
            ([1, 2, 3], [4, 5]),
            served_output("Let me check.", "resp-0"),
        )
        await external_call(
            ledger,
            worker,
            sink,
            "c1",
            EXTERNAL_REQUEST_1,
            ([6, 7], [8]),
            served_output("Sunny.", "resp-1"),
        )
        return await ledger.manifest("r1"), sink
    finally:
        await ledger.close()


def linearized_view(row: Any) -> dict[str, Any]:
    return dataclasses.asdict(row)


async def test_terminal_selection_and_linearize_take_our_call_records(tmp_path: Path) -> None:
    manifest, sink = await staged_rollout(tmp_path)
    snapshots = [
        nemo_staging.StagedCallBaseSnapshot.model_validate(
            sink.staged[row["staging_key"]].model_dump(exclude={"extras"})
        )
        for row in manifest["records"]
    ]
    outcomes = {}
    for side in (NEMO, OURS):
        records = side.staging.RolloutManifest.model_validate(manifest).records
        selection = nemo_staging_terminal.select_terminal_call(records)
        # `linearize` builds NeMo Gym's RolloutReceipt around the records it is given.
        row = nemo_rebuild.linearize(
            "r1", snapshots, records, terminal_hint=selection.terminal_model_call_id
        )
        outcomes[side.name] = (selection, linearized_view(row))
    assert outcomes["nemo"][0].terminal_model_call_id == "c1"
    assert outcomes["ours"] == outcomes["nemo"]


@pytest.mark.parametrize(
    ("model", "build"),
    [
        (
            "CaptureLedgerCommit",
            lambda s, rec, fail: {
                "rollout_id": "r1",
                "record": rec,
                "request_items": [],
                "response_items": [],
            },
        ),
        (
            "RolloutManifest",
            lambda s, rec, fail: {"rollout_id": "r1", "records": [rec], "failures": [fail]},
        ),
        (
            "RolloutReceipt",
            lambda s, rec, fail: {
                "rollout_id": "r1",
                "manifest": [rec],
                "terminal_model_call_id": rec.model_call_id,
                "terminal_selection": "declared",
            },
        ),
    ],
)
async def test_nemo_gym_models_take_our_nested_models(
    tmp_path: Path, model: str, build: Callable[..., dict[str, Any]]
) -> None:
    """NeMo Gym's models built around our CallRecord and ManifestFailure instances equal the
    same models built around its own, and revalidate our values by its rules."""
    manifest, _ = await staged_rollout(tmp_path)
    built = {}
    for side in (NEMO, OURS):
        record = side.staging.CallRecord.model_validate(manifest["records"][0])
        failure = side.staging.ManifestFailure(model_call_id="c9", reason="worker_capture_failed")
        built[side.name] = getattr(nemo_staging, model)(**build(side, record, failure))
    assert type(built["ours"]) is getattr(nemo_staging, model)
    assert built["ours"] == built["nemo"]
    assert built["ours"].model_dump_json() == built["nemo"].model_dump_json()
    # Top level too: NeMo Gym's model validates ours as it validates its own dump.
    ours = getattr(our_staging, model).model_validate(built["nemo"])
    assert getattr(nemo_staging, model).model_validate(ours) == built["nemo"]


def test_the_mapping_view_leaves_our_models_pydantic_models() -> None:
    """What makes NeMo Gym's models take ours changes nothing pydantic users rely on."""
    failure = our_staging.ManifestFailure(model_call_id="c9", reason="worker_capture_failed")
    fields = {"schema_version": 2, "model_call_id": "c9", "reason": "worker_capture_failed"}
    assert list(failure) == list(fields.items())  # iteration: (name, value) pairs, as before
    assert dict(failure) == fields == failure.model_dump() == {**failure}
    assert failure["reason"] == failure.get("reason") == "worker_capture_failed"
    assert failure.get("nope", 7) == 7
    with pytest.raises(KeyError):
        failure["nope"]
    assert isinstance(failure, Mapping)
    # Ours still refuse what they refused, and validate NeMo Gym's instances.
    with pytest.raises(ValidationError):
        our_staging.ManifestFailure.model_validate({**fields, "extra": 1})
    nemo_failure = nemo_staging.ManifestFailure(**fields)
    assert our_staging.ManifestFailure.model_validate(nemo_failure) == failure
