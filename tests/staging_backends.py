"""Staged records built with NeMo Gym's rules (our digest functions). Imported without pytest
too (`tests/read_only_child.py` runs as the servers' account): the backends fixture is in
`tests.staging_fixture`."""

from __future__ import annotations

from typing import Any

from tokencapture.staging import digest
from tokencapture.staging.records import StagedCallRecord

__all__ = ["chain", "make_record"]


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
