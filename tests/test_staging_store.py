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


def test_zeros_mid_segment_are_reported_never_read_as_its_end(tmp_path: Path) -> None:
    """Stray zero bytes over an acknowledged frame mid-segment: what follows stays fetchable,
    the damage is reported, and a fetch of the lost key is a corruption error, not 'unknown'."""
    from tokencapture import TokenCaptureCorruptionError
    from tokencapture.conformance_staging import build_chain

    store = FileStagingStore(tmp_path)
    records = build_chain(nemo_records, "r", 5)
    for record in records:
        assert store.stage(record).ok
    (segment,) = [p for p in tmp_path.iterdir() if p.name.startswith("seg-")]
    data = bytearray(segment.read_bytes())
    starts = [i for i in range(len(data)) if data[i : i + 4] == b"TCF2"]
    assert len(starts) == 5
    data[starts[2] : starts[3]] = bytes(starts[3] - starts[2])
    segment.write_bytes(bytes(data))
    fresh = FileStagingStore(tmp_path)
    assert fresh.keys() == ["r/call-0", "r/call-1", "r/call-3", "r/call-4"]
    assert fresh.damage() == [(segment.name, starts[2], starts[3])]
    assert [s.model_call_id for s in fresh.fetch(["r/call-4", "r/call-0"])] == ["call-4", "call-0"]
    with pytest.raises(TokenCaptureCorruptionError, match="damaged"):
        fresh.fetch(["r/call-2"])


def test_kept_descriptors_count_in_the_process_budget(tmp_path: Path) -> None:
    import gc

    from tokencapture.conformance_staging import build_chain
    from tokencapture.descriptors import budget

    records = build_chain(nemo_records, "r", 2)
    store = FileStagingStore(tmp_path / "a")
    # Earlier tests' stores awaiting the collector would be collected by the gc.collect()
    # below and leave the budget with less than `before`: collected first.
    gc.collect()
    before = budget()["held"]
    assert store.stats()["descriptors"]["open_files"] == 0
    assert store.stage(records[0]).ok
    stats = store.stats()
    # The segment being written and the kept store lock, both in the process's account.
    assert stats["descriptors"]["open_files"] == 2
    assert stats["descriptors"]["max_open_files"] is None
    assert budget()["held"] == before + 2
    assert stats["commits"] == {"batches": 1, "frames": 1, "syncs": 1}
    capped = FileStagingStore(tmp_path / "b", max_open_files=1)
    assert capped.stage(records[0]).ok and capped.stage(records[1]).ok
    assert capped.stats()["descriptors"] == {
        **capped.stats()["descriptors"],
        "open_files": 1,
        "max_open_files": 1,
    }
    del store
    gc.collect()
    assert budget()["held"] == before + 1  # only the capped store's segment is left
    with pytest.raises(ValueError):
        FileStagingStore(tmp_path / "c", max_open_files=-1)


def test_close_releases_descriptors_and_refuses_later_calls(tmp_path: Path) -> None:
    """`close` (as `PostgresStagingStore`'s): what the instance keeps open is closed, it is
    idempotent, and every later call says the store is closed; the data stays for others."""
    import asyncio
    import gc

    from tokencapture.conformance_staging import build_chain
    from tokencapture.descriptors import budget

    records = build_chain(nemo_records, "r", 2)
    gc.collect()
    before = budget()["held"]
    store = FileStagingStore(tmp_path)
    key = store.stage(records[0]).staging_key
    assert budget()["held"] == before + 2  # the segment being written and the store lock
    assert not store.closed
    store.close()
    assert store.closed
    assert budget()["held"] == before
    store.close()  # idempotent
    asyncio.run(store.aclose())
    assert store.root == tmp_path and repr(store) == f"FileStagingStore({str(tmp_path)!r})"
    result = store.stage(records[1])
    assert not result.ok and result.error == "RuntimeError: the store is closed"
    for call in (
        lambda: store.fetch([key]),
        lambda: store.fetch_records([key]),
        lambda: store.fetch_attachments(key),
        lambda: store.keys(),
        lambda: store.retired(),
        lambda: store.retire(["r"]),
        lambda: store.delete(["r"]),
        lambda: store.damage(),
        lambda: store.stats(),
        lambda: store.commit_stats(),
    ):
        with pytest.raises(RuntimeError, match=r"^the store is closed$"):
            call()
    assert FileStagingStore(tmp_path).keys() == [key]
