"""FileStagingStore driven by NeMo Gym 0.7.0's own capture code; digests against NeMo's."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.nemo_oracle import import_nemo

nemo_digest = import_nemo("staging.digest")
nemo_capture = import_nemo("staging.capture")
nemo_records = import_nemo("staging.records")
nemo_conformance = import_nemo("staging.conformance")

from tokencapture import FileStagingStore, StagingKeyError, StagingKeyRetiredError  # noqa: E402
from tokencapture.staging import digest  # noqa: E402


def test_golden_vectors_match_nemo() -> None:
    vectors = nemo_conformance.load_golden_vectors()
    assert digest.compute_extras_digest(vectors["extras"]) == vectors["extras_digest"]
    assert digest.compute_staging_digest(**vectors["staged_call"]) == vectors["staged_call_digest"]
    for ids in ([], [0], [2**64 - 1, 5]):
        assert digest.hash_token_ids(ids) == nemo_digest.hash_token_ids(ids)
        assert digest.compute_chain_hash(None, ids) == nemo_digest.compute_chain_hash(None, ids)


def test_nemo_capture_stages_fetches_retires(tmp_path: Path) -> None:
    store = FileStagingStore(tmp_path)
    capture = nemo_capture.RolloutTokenCapture(sink=store, weight_version_fn=lambda: 3)
    admission = nemo_records.CaptureAdmission(rollout_id="r", model_call_id="c1", mode="text")
    coords = capture.complete_call(
        capture.begin_call(admission),
        prompt_token_ids=[1, 2],
        generated_token_ids=[3],
        generated_logprobs=[-0.1],
        extras={"a": [1, 2.5, "é"]},
    )
    assert coords.disposition == "staged"
    # A second process's view (a fresh instance) fetches NeMo's own verified model.
    snapshot = FileStagingStore(tmp_path).fetch([coords.staging_key])[0]
    assert isinstance(snapshot, nemo_records.StagedCallBaseSnapshot)
    nemo_records.StagedCallBaseSnapshot.model_validate(snapshot.model_dump())
    assert snapshot.generation_log_probs_delta == [0.0, 0.0, -0.1]
    record = store.fetch_records([coords.staging_key])[0]
    assert record.extras == {"a": [1, 2.5, "é"]}
    assert store.stage(record).ok  # idempotent
    with pytest.raises(StagingKeyError):
        store.fetch(["r/nope"])
    assert store.retire(["r"]) == {"removed": ["r"], "absent": []}
    assert not store.stage(record).ok
    with pytest.raises(StagingKeyRetiredError):
        store.fetch([coords.staging_key])
