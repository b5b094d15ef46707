"""NeMo Gym's own worker capture driving a `FileStagingStore` from 32 threads, SIGKILLed.

The child (`tests/reliability/staging_nemo_child.py`) runs NeMo Gym's ``RolloutTokenCapture``
(installed with ``install_capture``, ``VLLMCaptureAdapter``) over the store: multi-turn
``token_in`` rollouts, prefixes inline or as a ``staging_chain`` fetched back from the store,
extras, attachments, float32 edges, sibling calls. It is killed at a random point, several
rounds over one directory. After each round a fresh store must give back every acknowledged
call: re-validated by NeMo Gym's own models (which recompute the digest), its digests
recomputed with NeMo Gym's ``staging/digest.py``, its columns (log-probs to the bit), extras
and attachments equal to what the child staged, and each rollout rebuilt by NeMo Gym's
``verify_and_linearize`` from our fetch equal to the row rebuilt from the same calls held in
memory. Every key the store lists must fetch and verify too (nothing half-written is visible).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
from tests.nemo_oracle import import_nemo
from tests.reliability.common import kill_once_started

nemo_records = import_nemo("staging.records")
nemo_digest = import_nemo("staging.digest")
nemo_rebuild = import_nemo("staging.rebuild")

from tokencapture import FileStagingStore  # noqa: E402

CHILD = [sys.executable, "-m", "tests.reliability.staging_nemo_child"]
FIELDS = [name for name in nemo_records.StagedCallBaseSnapshot.model_fields if name != "digest"]
# What a manifest row and a base snapshot take from the acknowledged coordinates.
LINKS = ("parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version")
HASHES = ("digest", "extras_digest", "chain_hash", "cumulative_hash")


def check_acknowledged(store: FileStagingStore, ack: dict[str, Any]) -> Any:
    """One acknowledged call, fetched and checked with NeMo Gym's models and digests."""
    key, coords = ack["ack"], ack["coords"]
    (fetched,) = store.fetch([key])
    snapshot = nemo_records.StagedCallBaseSnapshot.model_validate(fetched.model_dump())
    assert (
        nemo_digest.compute_staging_digest(**snapshot.model_dump(include=set(FIELDS)))
        == (coords["digest"])
    )
    for name in (*LINKS, *HASHES):
        assert getattr(snapshot, name) == coords[name], (key, name)
    assert snapshot.token_ids_delta == ack["delta"], key
    assert snapshot.token_mask_delta == ack["mask"], key
    assert [x.hex() for x in snapshot.generation_log_probs_delta] == ack["log_probs"], key
    (record,) = store.fetch_records([key])
    record = nemo_records.StagedCallRecord.model_validate(record.model_dump())
    assert record.extras == ack["extras"], key
    attachments = store.fetch_attachments(key)
    if ack["pixels"] is None:
        assert attachments == {}, key
    else:
        pixels = attachments["pixels"].to_numpy()
        assert pixels.dtype == np.float32 and pixels.shape[1:] == (1,), key
        assert pixels.tobytes().hex() == ack["pixels"], key
        assert bytes(attachments["raw"]) == bytes.fromhex(ack["raw"]), key
    return snapshot


def check_rebuilds(store: FileStagingStore, acks: dict[str, dict[str, Any]]) -> int:
    """Each rollout's acknowledged calls as a ledger manifest; NeMo Gym's verifier rebuilds the
    deepest chain from our fetch and from the calls as staged, held in memory: equal rows."""
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for ack in acks.values():
        by_rollout.setdefault(ack["rollout"], []).append(ack)
    for rollout_id, calls in by_rollout.items():
        calls.sort(key=lambda ack: int(ack["call"][1:]))
        manifest = []
        for ack in calls:
            coords = ack["coords"]
            fields = {name: coords[name] for name in (*LINKS, *HASHES, "staging_key")}
            mode = "text" if coords["parent_call_id"] is None else "token_in"
            manifest.append(
                nemo_records.CallRecord(
                    model_call_id=ack["call"], mode=mode, response_id=f"r-{ack['call']}", **fields
                )
            )
        terminal = max(manifest, key=lambda row: row.cum_len).model_call_id
        receipt = nemo_records.RolloutReceipt(
            rollout_id=rollout_id,
            terminal_model_call_id=terminal,
            manifest=manifest,
            terminal_selection="declared",
        )
        ours = nemo_rebuild.verify_and_linearize(
            receipt, store.fetch([row.staging_key for row in manifest])
        )
        in_memory = [
            nemo_records.StagedCallBaseSnapshot(
                rollout_id=rollout_id,
                model_call_id=ack["call"],
                mode=row.mode,
                token_ids_delta=ack["delta"],
                token_mask_delta=ack["mask"],
                generation_log_probs_delta=[float.fromhex(x) for x in ack["log_probs"]],
                **{name: ack["coords"][name] for name in (*LINKS, *HASHES)},
            )
            for ack, row in zip(calls, manifest, strict=True)
        ]
        expected = nemo_rebuild.verify_and_linearize(receipt, in_memory)
        assert ours == expected, rollout_id
        assert [x.hex() for x in ours.logprobs] == [x.hex() for x in expected.logprobs]
    return len(by_rollout)


def test_nemo_capture_from_32_threads_sigkilled_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    rng = random.Random(2023)
    acks: dict[str, dict[str, Any]] = {}
    unexpected: list[str] = []
    for round_ in range(4):
        # Staging has begun at the first line: killed at a random point after it.
        out = kill_once_started([*CHILD, str(tmp_path), str(round_), "32"], 0.5, rng, b"{")
        for line in out.splitlines():
            if not line.endswith(b"}"):
                continue  # the line the kill cut short
            event = json.loads(line)
            if "ack" in event:
                acks[event["ack"]] = event
            else:
                unexpected.append(event["unexpected"])
        store = FileStagingStore(tmp_path)  # a fresh store, as the next process opens it
        for ack in acks.values():
            check_acknowledged(store, ack)
        visible = store.keys()
        assert set(acks) <= set(visible)
        for key, snapshot in zip(visible, store.fetch(visible), strict=True):
            nemo_records.StagedCallBaseSnapshot.model_validate(snapshot.model_dump())
            assert snapshot.staging_key == key
        assert store.damage() == []
        rebuilt = check_rebuilds(store, acks)
    assert not unexpected, unexpected[:3]
    assert len(acks) > 100 and rebuilt > 30  # the kills landed mid-stream
