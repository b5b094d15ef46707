"""Wire models of the capture ledger (schema version 2).

A `CaptureLedger` records metadata for model calls whose token arrays a training framework
staged outside Gym's file store. A successfully staged call is published as a
`CaptureLedgerCommit` holding a token-free `CallRecord`; a call that did not commit becomes a
`ManifestFailure` row. `RolloutManifest` is what a reader gets back for one rollout, and
`RolloutRemoval` what `retire`/`delete` report.

Every model refuses unknown fields and non-finite floats: ledger rows are JSON, and a row that
would not read back identically must be refused before it is written. Identifiers are non-empty
strings, digests are lowercase hex SHA-256, and counts are non-negative ints; none of them is
coerced from another type, so a ``1`` never silently becomes ``"1"`` or a ``True`` a ``1``.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, model_validator

from tokencapture.records import UNCOMMITTED_CALL_REASON, UNRESOLVED_PARENT_REASON

__all__ = [
    "CALL_RECORD_DIGEST_VERSION",
    "CALL_RECORD_EXTRAS_DIGEST_VERSION",
    "CONFLICTING_CALL_RECORD_REASON",
    "INVALID_CALL_RECORD_REASON",
    "LEDGER_SCHEMA_VERSION",
    "MISSING_CHAIN_DIGEST_REASON",
    "MISSING_RESPONSE_ID_REASON",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "CallRecord",
    "CaptureLedgerCommit",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutRemoval",
]

LEDGER_SCHEMA_VERSION: Final = 2
CALL_RECORD_DIGEST_VERSION: Final = 2
CALL_RECORD_EXTRAS_DIGEST_VERSION: Final = 1

# Failure-row reasons written by ledgers, beside the two shared with the file store
# (`UNCOMMITTED_CALL_REASON`, `UNRESOLVED_PARENT_REASON`, re-exported from `tokencapture.records`).
MISSING_RESPONSE_ID_REASON: Final = "missing_response_id"
"""The engine returned no response id, so the staged token data cannot be located."""
MISSING_CHAIN_DIGEST_REASON: Final = "missing_chain_digest"
"""The staging layer reported no chain digest, so the call's tokens cannot be verified."""
INVALID_CALL_RECORD_REASON: Final = "invalid_call_record"
"""A committed ledger row whose record is not a valid `CallRecord` (a foreign or older writer)."""
CONFLICTING_CALL_RECORD_REASON: Final = "conflicting_call_record"
"""Two different committed ledger rows for one call id: neither can be trusted."""

Identifier = Annotated[str, StringConstraints(strict=True, min_length=1)]
Digest = Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$")]
# An assistant fingerprint is a digest, or "" when the call's request and response contain no
# model-authored item (such a call can never be continued, but it still belongs in the manifest).
Fingerprint = Annotated[str, StringConstraints(strict=True, pattern=r"^(?:[0-9a-f]{64})?$")]
Count = Annotated[int, Field(strict=True, ge=0)]
JsonItem = dict[str, JsonValue]


class CallRecord(BaseModel):
    """One committed model call, without its tokens.

    The call's cumulative token sequence (every prompt and generated token up to and including
    this call) has length ``cum_len`` and token digest ``digest``. The framework staged it as the
    parent's ``prev_len`` tokens followed by ``delta_len`` new ones; ``chain_hash`` identifies
    that staged chain, so a child resolved to this call can be verified against it.

    ``mode`` says how the prompt reached the engine: ``"text"`` for a root call sent as a full
    prompt (no parent, ``prev_len == 0``), ``"token_in"`` for a continuation sent as token ids
    on top of its resolved parent (``prev_len > 0``).

    The ``continuation_*`` fields are what `stamp_continuation` puts on a `TokenEntry`: they let
    a later request be matched to this call exactly as in the file store's lineage resolution.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    schema_version: Literal[2] = 2
    digest_version: Literal[2] = 2
    """Version of ``digest`` and ``chain_hash``."""
    extras_digest_version: Literal[1] = 1
    """Version of ``extras_digest``."""

    model_call_id: Identifier
    response_id: Identifier
    """The engine's response id: the key of the staged token data."""
    parent_call_id: Identifier | None = None
    mode: Literal["text", "token_in"]

    prev_len: Count
    """Tokens inherited from the parent (its ``cum_len``); 0 for a root."""
    delta_len: Count
    """Tokens this call added (its new prompt suffix and its generation); always positive."""
    cum_len: Count
    """Length of the cumulative sequence: ``prev_len + delta_len``."""

    digest: Digest
    """Token digest of the cumulative sequence (`tokencapture.records.compute_digest`)."""
    chain_hash: Digest
    """Digest of the staged chain that rebuilds the cumulative sequence."""
    extras_digest: Digest | None = None
    """Digest of staged per-token extras (log-probs, routed experts), when any were staged."""

    continuation_fingerprint: Fingerprint
    continuation_context_len: Count
    continuation_context_digest: Digest

    @model_validator(mode="after")
    def _check_lengths_and_parent(self) -> Self:
        if self.delta_len == 0:
            raise ValueError("delta_len must be positive: a call adds at least one token")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError(
                f"cum_len ({self.cum_len}) must equal prev_len ({self.prev_len})"
                f" + delta_len ({self.delta_len})"
            )
        if self.parent_call_id is None:
            if self.prev_len != 0 or self.mode != "text":
                raise ValueError('a call without a parent must have prev_len 0 and mode "text"')
        else:
            if self.prev_len == 0 or self.mode != "token_in":
                raise ValueError('a call with a parent must have prev_len > 0 and mode "token_in"')
            # A self-parent is a one-call cycle: its chain could never be rebuilt.
            if self.parent_call_id == self.model_call_id:
                raise ValueError("a call cannot be its own parent")
        return self


class CaptureLedgerCommit(BaseModel):
    """What `CaptureLedger.record` publishes: a call record and the request that produced it.

    ``staging_chain`` lists the framework's staged segments that rebuild the cumulative sequence,
    root first; a resolver hands it back in `LineageMatch.staging_chain`. ``request_items`` are
    the unmodified harness items and ``response_items`` the model's output items: the ledger
    needs them to index the call for request-time lineage, and they must be plain JSON.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    schema_version: Literal[2] = 2
    rollout_id: Identifier
    record: CallRecord
    staging_chain: tuple[Identifier, ...] = ()
    request_items: list[JsonItem]
    response_items: list[JsonItem]


class ManifestFailure(BaseModel):
    """A call that did not commit; its presence makes finalization reject the rollout.

    ``reason`` is free text, usually one of the ``*_REASON`` constants of this module.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    schema_version: Literal[2] = 2
    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(BaseModel):
    """A rollout's token-free ledger: committed calls under ``records``, poison rows under
    ``failures``. Each committed call appears once.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    schema_version: Literal[2] = 2
    rollout_id: Identifier
    records: tuple[CallRecord, ...] = ()
    failures: tuple[ManifestFailure, ...] = ()

    @model_validator(mode="after")
    def _check_unique_records(self) -> Self:
        seen: set[str] = set()
        for record in self.records:
            if record.model_call_id in seen:
                raise ValueError(f"model_call_id {record.model_call_id!r} is recorded twice")
            seen.add(record.model_call_id)
        return self


class RolloutRemoval(BaseModel):
    """The result of retiring or deleting rollouts: ids that had rows, and ids that had none.

    It has no ``schema_version`` so that its dump is exactly a `RolloutRemovalPayload`.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    removed: list[Identifier]
    absent: list[Identifier]

    @model_validator(mode="after")
    def _check_disjoint(self) -> Self:
        both = set(self.removed).intersection(self.absent)
        if both:
            raise ValueError(f"rollouts cannot be both removed and absent: {sorted(both)}")
        return self
