"""PostgresStagingStore driven by NeMo Gym 0.7.0's own capture code: multi-turn token_in chains
staged from NeMo's RolloutTokenCapture, fetched as NeMo's own verified models, and NeMo's
staging conformance helpers accepting our sink and source."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.nemo_oracle import import_nemo
from tests.postgres_fixture import dsn, pg_dsn, pg_server

nemo_capture = import_nemo("staging.capture")
nemo_records = import_nemo("staging.records")

from tokencapture import StagingKeyRetiredError  # noqa: E402
from tokencapture.postgres import PostgresStagingStore  # noqa: E402

__all__ = ["dsn", "pg_dsn", "pg_server"]


@pytest.fixture
def staging(dsn: str) -> Iterator[PostgresStagingStore]:
    store = PostgresStagingStore(dsn)
    yield store
    store.close_sync()


def test_nemo_capture_stages_a_token_in_chain(staging: PostgresStagingStore, dsn: str) -> None:
    capture = nemo_capture.RolloutTokenCapture(sink=staging, weight_version_fn=lambda: 3)
    prompt = [1, 2]
    coords = []
    parent = None
    for turn in range(4):
        if parent is None:
            admission = nemo_records.CaptureAdmission(
                rollout_id="r", model_call_id=f"c{turn}", mode="text"
            )
        else:
            admission = nemo_records.CaptureAdmission(
                rollout_id="r",
                model_call_id=f"c{turn}",
                mode="token_in",
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                parent_chain_hash=parent.chain_hash,
                required_prefix_token_ids=prompt[: parent.cum_len],
            )
        generated = [100 + turn, 200 + turn]
        coord = capture.complete_call(
            capture.begin_call(admission),
            prompt_token_ids=prompt,
            generated_token_ids=generated,
            generated_logprobs=[-0.5, -0.25],
            extras={"turn": turn},
        )
        assert coord.disposition == "staged", coord
        coords.append(coord)
        parent = coord
        prompt = [*prompt, *generated, 7, 8]  # the next prompt carries the whole history
    # Another process's view: a new store on the same database fetches NeMo's own models.
    other = PostgresStagingStore(dsn)
    try:
        snapshots = other.fetch([c.staging_key for c in coords])
    finally:
        other.close_sync()
    assert all(isinstance(s, nemo_records.StagedCallBaseSnapshot) for s in snapshots)
    for snapshot in snapshots:
        nemo_records.StagedCallBaseSnapshot.model_validate(snapshot.model_dump())
    cumulative = [t for s in snapshots for t in s.token_ids_delta]
    assert cumulative == prompt[:-2]  # every token of the chain, each once, in order
    assert [s.chain_hash for s in snapshots] == [c.chain_hash for c in coords]
    records = staging.fetch_records([c.staging_key for c in coords])
    assert [r.extras for r in records] == [{"turn": t} for t in range(4)]
    assert staging.stage(records[1]).ok  # idempotent
    assert staging.retire(["r"]) == {"removed": ["r"], "absent": []}
    assert not staging.stage(records[1]).ok
    with pytest.raises(StagingKeyRetiredError):
        staging.fetch([coords[0].staging_key])


@pytest.mark.parametrize(
    "test_name",
    [
        "test_worker_path_rows_equal_nemo_gyms_in_memory_double",
        "test_a_retired_rollout_poisons_the_next_call_not_the_completion",
    ],
)
def test_nemo_worker_path_with_the_postgres_store(
    test_name: str, dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file store's NeMo worker-path tests (tests/test_staging_worker_path.py: NeMo's
    install_capture and RolloutTokenCapture staging multi-turn token_in chains from many
    rollouts at once, workers resolving staging_chain prefixes by fetch, NeMo's rebuild of the
    rows against our source), run as they are with every store they open on PostgreSQL."""
    from tests import test_staging_worker_path as worker_path

    opened: list[PostgresStagingStore] = []

    def on_postgres(_root: object) -> PostgresStagingStore:
        store = PostgresStagingStore(dsn)
        opened.append(store)
        return store

    monkeypatch.setattr(worker_path, "FileStagingStore", on_postgres)
    try:
        getattr(worker_path, test_name)(tmp_path)
    finally:
        for store in opened:
            store.close()
    assert opened  # the test ran on PostgreSQL stores
