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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
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
