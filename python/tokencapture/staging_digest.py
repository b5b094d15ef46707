"""NeMo Gym 0.7.0's staging digests (``nemo_gym.token_id_capture.staging.digest``), computed
by the Rust core (``rust/src/staging/digest.rs``).

Same names, same arguments, same results, and the same refusals: each function checks its
inputs in NeMo Gym's order and raises the same ``ValueError``/``TypeError`` (or
``UnicodeEncodeError`` for a lone surrogate) with NeMo Gym's words. ``tests/test_staging_digest.py``
checks this against NeMo Gym's own module on its golden vectors and on generated inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from tokencapture import _core

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "build_staging_delta",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "encode_token_ids",
    "hash_token_ids",
]

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """The framing of a token-id sequence: ``u64_be(count)`` then each id as ``u64_be``."""
    return _core.staging_encode_token_ids(token_ids)


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """The cumulative (prefix) hash of one exact token sequence, lowercase hex."""
    return _core.staging_hash_token_ids(token_ids)


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """This delta chained onto its parent's chain hash (``None`` for a root)."""
    return _core.staging_chain_hash(parent_chain_hash, token_ids_delta)


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """The digest of a call's extras (``None`` or a JSON-like mapping)."""
    return _core.staging_extras_digest(extras)


EMPTY_EXTRAS_DIGEST: Final[str] = compute_extras_digest(None)


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """The v2 digest of one staged call delta."""
    return _core.staging_digest(
        schema_version=schema_version,
        digest_version=digest_version,
        extras_digest_version=extras_digest_version,
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
        delta_len=delta_len,
        cum_len=cum_len,
        weight_version=weight_version,
        token_ids_delta=token_ids_delta,
        token_mask_delta=token_mask_delta,
        generation_log_probs_delta=generation_log_probs_delta,
        extras_digest=extras_digest,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
    )


def build_staging_delta(
    *,
    prompt_token_ids: list[int],
    generated_token_ids: list[int],
    generated_log_probs: list[float],
    prev_len: int,
) -> tuple[list[int], list[float], list[float]]:
    """The next staged delta of a prompt/generation pair: the prompt past ``prev_len``
    (mask 0.0, log-probability 0.0) followed by the generation (mask 1.0)."""
    if prev_len < 0 or prev_len > len(prompt_token_ids):
        raise ValueError(f"prev_len={prev_len} is outside prompt length {len(prompt_token_ids)}")
    if len(generated_token_ids) != len(generated_log_probs):
        raise ValueError(
            "generated token and log-probability lengths differ: "
            f"{len(generated_token_ids)} != {len(generated_log_probs)}"
        )
    carried = prompt_token_ids[prev_len:]
    if not carried and not generated_token_ids:
        raise ValueError("staging delta must contain at least one token")
    ids = [*carried, *generated_token_ids]
    masks = [0.0] * len(carried) + [1.0] * len(generated_token_ids)
    log_probs = [0.0] * len(carried) + list(generated_log_probs)
    return ids, masks, log_probs
