"""NeMo Gym 0.7.0's worker-owned capture path, end to end, with our FileStagingStore.

NeMo Gym's own code drives our store: ``install_capture`` / ``RolloutTokenCapture``
(``begin_call``, ``complete_call``, ``complete_call_from_response`` with its
``VLLMCaptureAdapter``, ``fail_call``) stages multi-turn ``token_in`` chains from many threads;
the returned ``CommitCoords`` go into a capture ledger (ours, `FileLineageStore`, and NeMo
Gym's ``InMemoryLineageStore``), the way its external-capture handler commits them; NeMo Gym's
``staging.rebuild.verify_and_linearize`` rebuilds the training rows from the ledger's manifest
and our store's ``fetch``. The rows must equal those rebuilt from NeMo Gym's own in-memory
staging double (``_MemorySink`` of its worker unit tests) fed the same calls, and the prefix a
worker fetches for a ``staging_chain`` must equal the exact cumulative tokens, tracked here
independently.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests.nemo_oracle import ORACLE_DIR, import_nemo

nemo_capture = import_nemo("staging.capture")
nemo_records = import_nemo("staging.records")
nemo_rebuild = import_nemo("staging.rebuild")
nemo_vllm = import_nemo("adapters.vllm")
nemo_lineage = import_nemo("lineage")

from tokencapture import FileLineageStore, FileStagingStore  # noqa: E402

ORACLE_SDIST = ORACLE_DIR.parent / "sdist" / "nemo_gym-0.7.0"
WORKER_TESTS = ORACLE_SDIST / "tests" / "unit_tests" / "test_token_capture_staging_worker.py"


def nemo_worker_tests() -> ModuleType:
    """NeMo Gym's worker unit-test module (for its in-memory staging double)."""
    if not WORKER_TESTS.is_file():
        pytest.skip(f"NeMo Gym's unit tests are not unpacked under {WORKER_TESTS.parent}")
    spec = importlib.util.spec_from_file_location("nemo_staging_worker_tests", WORKER_TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- one rollout's conversation, scripted ----------------------------------------------------


@dataclass
class Turn:
    """One model call: which earlier call it continues (None: the root), the new prompt
    tokens, the generation and how NeMo Gym's capture completes it."""

    call_id: str
    parent: str | None
    new_prompt: list[int]
    generated: list[int]
    log_probs: list[float]
    how: str = "response"  # "response" (VLLMCaptureAdapter), "complete" or "fail"
    routed_experts: list[Any] | None = None


def script(rollout: int, turns: int) -> list[Turn]:
    """A chain of `turns` calls plus a branch (a second child of call 1) and a failed call."""
    out: list[Turn] = []
    for index in range(turns):
        base = 10_000 * (rollout + 1) + 1_000 * index
        out.append(
            Turn(
                call_id=f"c{index}",
                parent=None if index == 0 else f"c{index - 1}",
                new_prompt=[base + i for i in range(7 if index == 0 else 4)],
                generated=[base + 500 + i for i in range(3 + index % 3)],
                log_probs=[-0.5, -0.0, -1.25, -2.0, -0.125][: 3 + index % 3],
                how="complete" if index % 2 else "response",
                routed_experts=[[[index, rollout]]] if index == 1 else None,
            )
        )
    out.append(Turn("branch", "c1", [9, 9], [8, 7], [-0.75, -0.5]))
    out.append(Turn("broken", "c0", [1], [2], [-0.1], how="fail"))
    return out


@dataclass
class Worker:
    """An inference worker: NeMo Gym's capture over a sink, plus the staging source it reads
    ``staging_chain`` prefixes from (None: the prefix is sent inline)."""

    capture: Any
    source: Any | None
    coords: dict[str, Any] = field(default_factory=dict)
    cumulative: dict[str, list[int]] = field(default_factory=dict)
    chains: dict[str, list[str]] = field(default_factory=dict)


def admission(rollout_id: str, turn: Turn, worker: Worker) -> Any:
    if turn.parent is None:
        return nemo_records.CaptureAdmission(
            rollout_id=rollout_id, model_call_id=turn.call_id, mode="text"
        )
    parent = worker.coords[turn.parent]
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": turn.call_id,
        "parent_call_id": turn.parent,
        "prev_len": parent.cum_len,
        "mode": "token_in",
        "parent_chain_hash": parent.chain_hash,
    }
    if worker.source is None:
        fields["required_prefix_token_ids"] = worker.cumulative[turn.parent]
    else:
        fields["staging_chain"] = worker.chains[turn.parent]
    return nemo_records.CaptureAdmission(**fields)


def run_turn(rollout_id: str, turn: Turn, worker: Worker) -> Any:
    gate = admission(rollout_id, turn, worker)
    prefix: list[int] | None = None
    if gate.staging_chain:
        # What a worker does with a staging_chain: fetch the staged deltas, concatenate them.
        prefix = [
            t
            for snap in worker.source.fetch(list(gate.staging_chain))
            for t in snap.token_ids_delta
        ]  # type: ignore[union-attr]
        assert prefix == worker.cumulative[turn.parent], "fetched prefix is not the exact tokens"  # type: ignore[index]
    call = worker.capture.begin_call(gate, prefix_token_ids=prefix)
    prompt = [*(worker.cumulative[turn.parent] if turn.parent else []), *turn.new_prompt]
    if turn.how == "fail":
        coords = worker.capture.fail_call(call, reason="engine error")
    elif turn.how == "complete":
        coords = worker.capture.complete_call(
            call,
            prompt_token_ids=prompt,
            generated_token_ids=turn.generated,
            generated_logprobs=turn.log_probs,
            extras={"routed_experts": turn.routed_experts} if turn.routed_experts else None,
        )
    else:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "ok",
            "generation_token_ids": turn.generated,
            "generation_log_probs": turn.log_probs,
        }
        if turn.routed_experts is not None:
            message["routed_experts"] = turn.routed_experts
        payload = {
            "id": f"resp-{turn.call_id}",
            "prompt_token_ids": prompt,
            "choices": [{"message": message}],
        }
        coords = worker.capture.complete_call_from_response(call, payload)
    worker.coords[turn.call_id] = coords
    if coords.disposition == "staged":
        worker.cumulative[turn.call_id] = [*prompt, *turn.generated]
        worker.chains[turn.call_id] = [
            *(worker.chains[turn.parent] if turn.parent else []),
            coords.staging_key,
        ]
    return coords


def ledger_commit(rollout_id: str, coords: Any, worker: Worker) -> Any:
    """The ledger commit NeMo Gym's external-capture handler makes of a call's coordinates."""
    record = nemo_records.CallRecord(
        model_call_id=coords.model_call_id,
        parent_call_id=coords.parent_call_id,
        prev_len=coords.prev_len,
        delta_len=coords.delta_len,
        cum_len=coords.cum_len,
        weight_version=coords.weight_version,
        digest=coords.digest,
        extras_digest=coords.extras_digest,
        staging_key=coords.staging_key,
        mode="text" if coords.parent_call_id is None else "token_in",
        chain_hash=coords.chain_hash,
        cumulative_hash=coords.cumulative_hash,
        response_id=f"resp-{coords.model_call_id}",
    )
    return nemo_records.CaptureLedgerCommit(
        rollout_id=rollout_id,
        record=record,
        staging_chain=tuple(worker.chains[coords.model_call_id]),
        request_items=[{"role": "user", "content": f"turn {coords.model_call_id}"}],
        response_items=[{"type": "message", "role": "assistant", "content": "ok"}],
    )


def rebuild(rollout_id: str, manifest: dict[str, Any], terminal: str, fetch: Any) -> Any:
    """NeMo Gym's verifier over a ledger manifest and the snapshots a source fetched."""
    rows = [nemo_records.CallRecord.model_validate(row) for row in manifest["records"]]
    receipt = nemo_records.RolloutReceipt(
        rollout_id=rollout_id,
        terminal_model_call_id=terminal,
        manifest=rows,
        terminal_selection="declared",
    )
    return nemo_rebuild.verify_and_linearize(receipt, fetch([row.staging_key for row in rows]))


class _Host:
    def __init__(self) -> None:
        self.token_capture: Any = None

    def install_token_capture(self, capture: Any) -> None:
        self.token_capture = capture


def test_worker_path_rows_equal_nemo_gyms_in_memory_double(tmp_path: Path) -> None:
    rollouts, turns = 8, 6
    store = FileStagingStore(tmp_path / "staging")
    host = _Host()
    capture = nemo_capture.install_capture(
        host, sink=store, weight_version_fn=lambda: 4, adapter=nemo_vllm.VLLMCaptureAdapter()
    )
    assert host.token_capture is capture
    # Many rollouts at once, each worker fetching its staging_chain prefixes from a store
    # instance of its own (another process's view, as a second serving worker has).
    workers = {
        f"rollout-{r}": Worker(capture, FileStagingStore(tmp_path / "staging"))
        for r in range(rollouts)
    }

    def drive(rollout_id: str) -> None:
        for turn in script(int(rollout_id.split("-")[1]), turns):
            run_turn(rollout_id, turn, workers[rollout_id])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(drive, workers))

    # The same calls through NeMo Gym's in-memory staging double (inline prefixes).
    double_tests = nemo_worker_tests()
    doubles = {}
    for rollout_id in workers:
        sink = double_tests._MemorySink()
        double = Worker(
            nemo_capture.RolloutTokenCapture(
                sink=sink, weight_version_fn=lambda: 4, adapter=nemo_vllm.VLLMCaptureAdapter()
            ),
            None,
        )
        for turn in script(int(rollout_id.split("-")[1]), turns):
            run_turn(rollout_id, turn, double)
        doubles[rollout_id] = (double, sink)

    ours_ledger = FileLineageStore(tmp_path / "ledger")
    nemo_ledger = nemo_lineage.InMemoryLineageStore()

    async def commit_all() -> None:
        for rollout_id, worker in workers.items():
            for coords in worker.coords.values():
                for ledger in (ours_ledger, nemo_ledger):
                    if coords.disposition == "staged":
                        await ledger.record(ledger_commit(rollout_id, coords, worker))
                    else:
                        await ledger.record_failure(
                            rollout_id, coords.model_call_id, "worker_capture_failed"
                        )

    asyncio.run(commit_all())

    for rollout_id, worker in workers.items():
        dispositions = {call: c.disposition for call, c in worker.coords.items()}
        assert dispositions.pop("broken") == "capture_failed"
        assert set(dispositions.values()) == {"staged"}
        double, sink = doubles[rollout_id]
        by_call = {record.model_call_id: record for record in sink.records}
        for terminal in (f"c{turns - 1}", "branch"):
            manifests = [
                asyncio.run(ours_ledger.manifest(rollout_id)),
                asyncio.run(nemo_ledger.manifest(rollout_id)),
            ]
            assert [len(m["failures"]) for m in manifests] == [1, 1]
            ours_rows = [rebuild(rollout_id, m, terminal, store.fetch) for m in manifests]
            # The double's staged records, as its source would give them, in manifest order.
            nemo_row = rebuild(
                rollout_id,
                manifests[1],
                terminal,
                lambda keys, by_call=by_call: [by_call[key.split("/", 1)[1]] for key in keys],
            )
            assert ours_rows[0] == ours_rows[1] == nemo_row
            assert nemo_row.token_ids == worker.cumulative[terminal]
            assert nemo_row.token_ids == double.cumulative[terminal]
        # Every staged record comes back whole, extras included, as NeMo Gym's own model.
        keys = [c.staging_key for c in worker.coords.values() if c.disposition == "staged"]
        for fetched in store.fetch_records(keys):
            assert isinstance(fetched, nemo_records.StagedCallRecord)
            expected = by_call[fetched.model_call_id]
            assert fetched.model_dump() == expected.model_dump()
    asyncio.run(ours_ledger.close())


def test_a_retired_rollout_poisons_the_next_call_not_the_completion(tmp_path: Path) -> None:
    store = FileStagingStore(tmp_path)
    worker = Worker(
        nemo_capture.RolloutTokenCapture(
            sink=store, weight_version_fn=lambda: 1, adapter=nemo_vllm.VLLMCaptureAdapter()
        ),
        FileStagingStore(tmp_path),
    )
    first, second, *_ = script(0, 3)
    assert run_turn("r", first, worker).disposition == "staged"
    FileStagingStore(tmp_path).retire(["r"])
    worker.chains["c0"] = []  # the prefix travels inline: the staged chain is fenced
    worker.source = None
    assert run_turn("r", second, worker).disposition == "capture_failed"


# ---- NeMo Gym's own worker unit tests, with our store behind its in-memory sink -------------

OUR_STORE_BEHIND_THE_DOUBLE = '''

_NemoMemorySink = _MemorySink


class _MemorySink(_NemoMemorySink):
    """NeMo Gym's double, with every accepted call staged in our FileStagingStore first and
    the record it keeps read back from our store (so its assertions judge our round trip)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        import tempfile
        from tokencapture import FileStagingStore

        self.store = FileStagingStore(tempfile.mkdtemp(prefix="nemo-worker-"))

    def stage(self, record, *, attachments=None):
        result = super().stage(record, attachments=attachments)
        if not result.ok:
            return result
        ours = self.store.stage(record, attachments=attachments)
        if not ours.ok:
            self.records.pop()
            self.attachments.pop()
            return ours
        (fetched,) = self.store.fetch_records([ours.staging_key])
        assert fetched.model_dump() == record.model_dump()
        self.records[-1] = fetched
        return result
'''

# NeMo Gym's tests that stage `object()` placeholders as attachments: a durable store cannot
# store them and refuses the call (NeMo Gym's rule: store every attachment or reject), so with
# our store behind the double these report capture_failed, as they must.
REFUSED_PLACEHOLDER_ATTACHMENTS = {
    "test_attachments_reach_the_sink_unchanged_and_stay_out_of_the_record",
    "test_attachments_do_not_change_digests_or_coordinates",
    "test_complete_call_from_response_forwards_attachments",
}


def test_nemo_gyms_worker_unit_tests_pass_with_our_store_behind_its_double(tmp_path: Path) -> None:
    if not WORKER_TESTS.is_file():
        pytest.skip(f"NeMo Gym's unit tests are not unpacked under {WORKER_TESTS.parent}")
    source = WORKER_TESTS.read_text()
    marker = "\n\nclass _LegacySink:"
    assert source.count(marker) == 1
    (tmp_path / WORKER_TESTS.name).write_text(
        source.replace(marker, OUR_STORE_BEHIND_THE_DOUBLE + marker)
    )
    ours = (
        Path(FileStagingStore.__module__ and sys.modules["tokencapture"].__file__)
        .resolve()
        .parents[1]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ours), str(ORACLE_DIR)])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(tmp_path)],
        cwd=tempfile.gettempdir(),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    failed = {
        line.split("::", 1)[1].split(" ", 1)[0].split("[", 1)[0]
        for line in run.stdout.splitlines()
        if line.startswith("FAILED ")
    }
    assert failed == REFUSED_PLACEHOLDER_ATTACHMENTS, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
