"""Staged records built with NeMo Gym's rules (our digest functions), and the staging backends
the same behavioural tests run on (the file store and the PostgreSQL store)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokencapture import FileStagingStore
from tokencapture.postgres import PostgresStagingStore
from tokencapture.staging import digest
from tokencapture.staging.records import StagedCallRecord

__all__ = ["Store", "chain", "make_record", "staging_backend"]

Store = FileStagingStore | PostgresStagingStore


@pytest.fixture(name="staging", params=["file", "postgres", "postgres-native"])
def staging_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each backend in turn (the PostgreSQL one on a fresh database, its stages through
    asyncpg and through the native group commit). A module using it imports the `dsn`
    fixture too (`tests.postgres_fixture`); a test takes it as `staging`."""
    if request.param == "file":
        yield FileStagingStore(tmp_path / "staging")
        return
    database = request.getfixturevalue("dsn")
    store = PostgresStagingStore(database, native_group_commit=request.param == "postgres-native")
    yield store
    if request.param == "postgres-native" and store.native_fallback_reason is None:
        # Whatever the test staged went through the native client.
        assert store._native is None or store._native.stats()[1] > 0 or not store.keys()
    store.close_sync()


def make_record(
    rollout_id: str = "r",
    model_call_id: str = "c1",
    tokens: list[int] | None = None,
    *,
    generated: int = 1,
    extras: dict[str, Any] | None = None,
    parent: StagedCallRecord | None = None,
    prefix: list[int] | None = None,
    weight_version: int = 1,
) -> StagedCallRecord:
    """One verified staged call: `tokens` as its delta (the last `generated` of them generated,
    the rest carried prompt), chained to `parent` when given, whose cumulative tokens are
    `prefix` (the parent's delta when not given)."""
    ids = list(tokens if tokens is not None else [1, 2, 3])
    carried = len(ids) - generated
    masks = [0.0] * carried + [1.0] * generated
    log_probs = [0.0] * carried + [-0.25 - i / 8 for i in range(generated)]
    prev_len = parent.cum_len if parent is not None else 0
    prefix_hash = parent.chain_hash if parent is not None else None
    before = (
        [] if parent is None else list(prefix if prefix is not None else parent.token_ids_delta)
    )
    fields: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "parent_call_id": parent.model_call_id if parent is not None else None,
        "mode": "token_in" if parent is not None else "text",
        "prev_len": prev_len,
        "delta_len": len(ids),
        "cum_len": prev_len + len(ids),
        "weight_version": weight_version,
        "token_ids_delta": ids,
        "token_mask_delta": masks,
        "generation_log_probs_delta": log_probs,
        "extras_digest": digest.compute_extras_digest(extras),
        "chain_hash": digest.compute_chain_hash(prefix_hash, ids),
        "cumulative_hash": digest.hash_token_ids([*before, *ids]),
    }
    return StagedCallRecord(digest=digest.compute_staging_digest(**fields), extras=extras, **fields)


def chain(rollout_id: str, calls: int, size: int = 8) -> list[StagedCallRecord]:
    """`calls` chained calls of one rollout, each with a delta of `size` tokens."""
    records: list[StagedCallRecord] = []
    cumulative: list[int] = []
    for n in range(calls):
        parent = records[-1] if records else None
        tokens = [(n * size + i) % 50_000 for i in range(size)]
        records.append(make_record(rollout_id, f"c{n}", tokens, parent=parent, prefix=cumulative))
        cumulative = [*cumulative, *tokens]
    return records
