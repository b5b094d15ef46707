"""Wire models of framework-owned token staging and of the capture ledger (schema version 2).

These are NeMo Gym 0.7.0's ``token_id_capture.staging.records`` models: the same names, fields
in the same order, the same defaults, types, strictness and validation rules, and the same error
messages, so a model of either side validates the other's instance or dump and dumps to the same
bytes. Like NeMo Gym's, the models are mutable (not frozen), refuse unknown fields and refuse
non-finite floats; identifiers are non-empty strict strings, digests lowercase SHA-256 hex, and
counts strict non-negative ints.

The ledger models in short: a framework that stages a call's tokens itself hands the ledger a
`CaptureLedgerCommit` carrying a token-free `CallRecord`; a call that did not commit becomes a
`ManifestFailure`; `RolloutManifest` is one rollout's ledger as read back. `RolloutRemoval` (our
addition, not in NeMo Gym) is what ``retire``/``delete`` report.

The staged-call models (`StagedCallBaseSnapshot` and its subclasses) check their ``digest``
against `compute_staging_digest` and their ``extras_digest`` against `compute_extras_digest`,
NeMo Gym's byte layouts computed by the Rust core (`tokencapture.staging_digest`, re-exported
here).
"""

from __future__ import annotations

from collections.abc import ItemsView, KeysView, Mapping, Sequence
from typing import Annotated, Any, Final, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from tokencapture.records import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
)
from tokencapture.staging_digest import (
    EMPTY_EXTRAS_DIGEST,
    compute_extras_digest,
    compute_staging_digest,
)

__all__ = [
    "CALL_RECORD_DIGEST_VERSION",
    "CALL_RECORD_EXTRAS_DIGEST_VERSION",
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "INVALID_COMMIT_COORDS_REASON",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "LEDGER_SCHEMA_VERSION",
    "MISSING_CHAIN_DIGEST_REASON",
    "MISSING_RESPONSE_ID_REASON",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "TERMINAL_AMBIGUOUS",
    "TERMINAL_DUPLICATE_CALL_ID",
    "TERMINAL_NO_RECORDS",
    "TERMINAL_NO_ROOT",
    "TERMINAL_ORPHANED_ROW",
    "TERMINAL_SELECTED",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "WORKER_CAPTURE_FAILED_REASON",
    "WORKER_MISSING_COMMIT_COORDS_REASON",
    "CallRecord",
    "CaptureAdmission",
    "CaptureDisposition",
    "CaptureLedgerCommit",
    "CaptureMode",
    "CommitCoords",
    "DigestHex",
    "Identifier",
    "ManifestFailure",
    "NonNegativeInt",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "compute_extras_digest",
    "compute_staging_digest",
    "staging_key",
]

# ---- versions and digests ----------------------------------------------------------------

STAGING_SCHEMA_VERSION: Final[Literal[2]] = 2
STAGING_DIGEST_VERSION: Final[Literal[2]] = 2
EXTRAS_DIGEST_VERSION: Final[Literal[1]] = 1

# Older names of this module, kept for callers that import them.
LEDGER_SCHEMA_VERSION: Final[int] = STAGING_SCHEMA_VERSION
CALL_RECORD_DIGEST_VERSION: Final[int] = STAGING_DIGEST_VERSION
CALL_RECORD_EXTRAS_DIGEST_VERSION: Final[int] = EXTRAS_DIGEST_VERSION


# The digests are the Rust core's (`tokencapture.staging_digest`): NeMo Gym's algorithms, checked
# against its golden vectors and its own module by tests/test_staging_digest.py.
def _check_masks(masks: Sequence[float], log_probs: Sequence[float]) -> None:
    if any(mask not in (0.0, 1.0) for mask in masks):
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if any(mask == 0.0 and lp != 0.0 for mask, lp in zip(masks, log_probs, strict=False)):
        raise ValueError("prompt-carry log probabilities must be 0.0")


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """The default staging key of a call: ``"<rollout_id>/<model_call_id>"``."""
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"


# ---- reasons (wire values: frameworks switch on them) -------------------------------------

# LEDGER_ROW_MISSING_RESPONSE_ID_REASON: a committed ledger row has no response id (terminal
# attribution joins on it); LEDGER_ROW_MISSING_CHAIN_HASH_REASON: it lacks its chain or
# cumulative hash (verification anchors on them). Both are NeMo Gym's records constants.
MISSING_RESPONSE_ID_REASON: Final[str] = LEDGER_ROW_MISSING_RESPONSE_ID_REASON
"""Older name of `LEDGER_ROW_MISSING_RESPONSE_ID_REASON`."""
MISSING_CHAIN_DIGEST_REASON: Final[str] = LEDGER_ROW_MISSING_CHAIN_HASH_REASON
"""Older name of `LEDGER_ROW_MISSING_CHAIN_HASH_REASON`."""
WORKER_MISSING_COMMIT_COORDS_REASON: Final[str] = "worker_response_missing_commit_coordinates"
WORKER_CAPTURE_FAILED_REASON: Final[str] = "worker_capture_failed"
INVALID_COMMIT_COORDS_REASON: Final[str] = "invalid_worker_commit_coordinates"

TERMINAL_SELECTED: Final[str] = "selected"
TERMINAL_NO_RECORDS: Final[str] = "no_records"
TERMINAL_DUPLICATE_CALL_ID: Final[str] = "duplicate_call_id"
TERMINAL_ORPHANED_ROW: Final[str] = "orphaned_row"
TERMINAL_NO_ROOT: Final[str] = "no_root"
TERMINAL_AMBIGUOUS: Final[str] = "ambiguous_terminal"

# ---- field types ---------------------------------------------------------------------------

CaptureDisposition = Literal["staged", "capture_failed"]
CaptureMode = Literal["token_in", "text"]
Identifier = Annotated[StrictStr, Field(min_length=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
DigestHex = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: Literal[2] = STAGING_SCHEMA_VERSION

    @model_validator(mode="before")
    @classmethod
    def _foreign_instance(cls, data: Any) -> Any:
        """NeMo Gym's instance of the same model (same class name): validate its fields.

        Pydantic accepts only instances of the field's own class, and a foreign model's values
        must be checked anyway (models are mutable). Other input passes through unchanged.
        """
        if (
            isinstance(data, BaseModel)
            and not isinstance(data, cls)
            and type(data).__name__ == cls.__name__
        ):
            return data.model_dump()
        return data

    # A read-only mapping view of the fields, so NeMo Gym's models take ours: pydantic validates
    # a model-typed field from an instance of that very class, a dict or any
    # `collections.abc.Mapping` (read with ``get`` and ``items``), so NeMo Gym's
    # ``CaptureLedgerCommit(record=<our CallRecord>)`` or ``RolloutReceipt(manifest=[...])``
    # revalidates our values by its own rules. As a registered `Mapping` it answers ``len``,
    # ``in``, ``keys``, ``items``, ``get`` and ``[]`` over the field names. One exception:
    # iteration stays pydantic's ``(name, value)`` pairs, which code written for NeMo Gym's
    # plain models may rely on (``for name, value in record``); generic mapping code should
    # use ``keys()`` or ``items()``. ``dict(model)`` goes through ``keys``: the same dict.

    def keys(self) -> KeysView[str]:
        """The field names."""
        return self.__dict__.keys()

    def items(self) -> ItemsView[str, Any]:
        """``(name, value)`` for every field, values as they are held (not dumped)."""
        return self.__dict__.items()

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value, or ``default`` when no field has that name."""
        return self.__dict__.get(key, default)

    def __getitem__(self, key: str) -> Any:
        try:
            return self.__dict__[key]
        except KeyError:
            raise KeyError(key) from None

    def __len__(self) -> int:
        return len(self.__dict__)

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__


Mapping.register(_WireModel)


class _DigestWireModel(_WireModel):
    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION


def _check_parent_shape(parent_call_id: str | None, prev_len: int, mode: str, noun: str) -> None:
    """The root/child rules shared by staged calls and manifest rows."""
    if parent_call_id is None and prev_len != 0:
        raise ValueError(f"a parentless {noun} must have prev_len == 0")
    if parent_call_id is not None and prev_len == 0:
        raise ValueError(f"a child {noun} must have prev_len > 0")
    if parent_call_id is None and mode != "text":
        raise ValueError(f"a parentless {noun} must use text mode")
    if parent_call_id is not None and mode != "token_in":
        raise ValueError(f"a child {noun} must use token_in mode")


class CaptureAdmission(_WireModel):
    """What the gate tells the inference worker about one call: who it is and, for a
    ``token_in`` continuation, the exact prefix it must extend (inline ids, or the staged
    records in ``staging_chain`` whose deltas concatenate to it)."""

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt = 0
    mode: CaptureMode
    required_prefix_token_ids: list[StrictInt] = Field(default_factory=list)
    staging_chain: list[str] = Field(default_factory=list)
    parent_chain_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _check_prefix(self) -> Self:
        if any(token < 0 for token in self.required_prefix_token_ids):
            raise ValueError("required_prefix_token_ids must be non-negative")
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len == 0:
                raise ValueError("token_in admission requires a parent_call_id and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError("token_in admission requires the parent's chain hash")
            if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
                raise ValueError("required_prefix_token_ids length must equal prev_len")
            return self
        has_prefix = (
            self.parent_call_id is not None
            or self.prev_len != 0
            or bool(self.required_prefix_token_ids)
            or bool(self.staging_chain)
            or self.parent_chain_hash is not None
        )
        if has_prefix:
            raise ValueError("text admission must be a parentless root with no required prefix")
        return self


class StagedCallBaseSnapshot(_DigestWireModel):
    """One staged call's token deltas and metadata, without its ``extras`` payload.

    Validation recomputes ``digest`` (`compute_staging_digest`) over these fields and the
    recorded ``extras_digest``; it cannot check extras it does not carry.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    mode: CaptureMode
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    token_ids_delta: list[StrictInt]
    token_mask_delta: list[StrictFloat]
    generation_log_probs_delta: list[StrictFloat]
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex

    @property
    def staging_key(self) -> str:
        return staging_key(self.rollout_id, self.model_call_id)

    @model_validator(mode="after")
    def _check_base(self) -> Self:
        _check_parent_shape(self.parent_call_id, self.prev_len, self.mode, "staged call")
        if self.delta_len == 0:
            raise ValueError("a staged call delta must contain at least one token")
        if any(token < 0 for token in self.token_ids_delta):
            raise ValueError("token_ids_delta must be non-negative")
        _check_masks(self.token_mask_delta, self.generation_log_probs_delta)
        expected = compute_staging_digest(
            schema_version=self.schema_version,
            digest_version=self.digest_version,
            extras_digest_version=self.extras_digest_version,
            rollout_id=self.rollout_id,
            model_call_id=self.model_call_id,
            parent_call_id=self.parent_call_id,
            mode=self.mode,
            prev_len=self.prev_len,
            delta_len=self.delta_len,
            cum_len=self.cum_len,
            weight_version=self.weight_version,
            token_ids_delta=self.token_ids_delta,
            token_mask_delta=self.token_mask_delta,
            generation_log_probs_delta=self.generation_log_probs_delta,
            extras_digest=self.extras_digest,
            chain_hash=self.chain_hash,
            cumulative_hash=self.cumulative_hash,
        )
        if self.digest != expected:
            raise ValueError("digest does not match staged call contents")
        return self


class StagedCallRecord(StagedCallBaseSnapshot):
    """A staged call with its optional ``extras``, checked against ``extras_digest``."""

    extras: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_extras(self) -> Self:
        if self.extras_digest != compute_extras_digest(self.extras):
            raise ValueError("extras_digest does not match extras")
        return self


class StagedCallSnapshot(StagedCallRecord):
    """A staged call exactly as a framework's staging source returns it."""


class StageResult(_WireModel):
    """Whether a staging sink made a call durable (and under which key), or why not."""

    ok: bool
    staging_key: Identifier | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_result(self) -> Self:
        if self.ok and self.staging_key is None:
            raise ValueError("a successful stage result requires staging_key")
        if not self.ok and not self.error:
            raise ValueError("a failed stage result requires an error")
        return self


class CommitCoords(_DigestWireModel):
    """What an inference worker reports after staging (or failing to stage) one call."""

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    disposition: CaptureDisposition = "staged"
    digest: DigestHex | None = None
    extras_digest: DigestHex | None = None
    staging_key: Identifier | None = None
    chain_hash: DigestHex | None = None
    cumulative_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _check_coords(self) -> Self:
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("parentless coordinates must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len == 0:
            raise ValueError("child coordinates must have prev_len > 0")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        payload = (
            self.digest,
            self.extras_digest,
            self.staging_key,
            self.chain_hash,
            self.cumulative_hash,
        )
        if self.disposition == "staged":
            if None in payload:
                raise ValueError(
                    "staged coordinates require digest, extras_digest, staging_key, chain_hash,"
                    " and cumulative_hash"
                )
            if self.delta_len == 0:
                raise ValueError("staged coordinates require a non-empty delta")
        elif any(value is not None for value in payload):
            raise ValueError("capture_failed coordinates cannot carry staged payload metadata")
        elif self.delta_len != 0:
            raise ValueError("capture_failed coordinates cannot carry token deltas")
        return self


class CallRecord(_DigestWireModel):
    """One committed call of a rollout's capture ledger, without its tokens.

    ``digest`` is the staged record's digest, ``chain_hash`` chains this call's token delta onto
    its parent's, ``cumulative_hash`` covers the whole cumulative sequence. ``response_id`` is
    the response envelope id served to the harness (terminal attribution joins on it);
    ``admitted_at`` the wall-clock admission time; the fingerprints (``None`` when the items
    could not be fingerprinted) are of version ``fingerprint_version`` (0: none recorded).
    """

    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    extras_digest: DigestHex
    staging_key: Identifier
    mode: CaptureMode = "token_in"
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    response_id: Identifier
    admitted_at: StrictFloat | None = None
    output_fingerprint: DigestHex | None = None
    continuation_fingerprint: DigestHex | None = None
    fingerprint_version: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check_row(self) -> Self:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        _check_parent_shape(self.parent_call_id, self.prev_len, self.mode, "manifest row")
        return self


class CaptureLedgerCommit(_WireModel):
    """What `CaptureLedger.record` takes: the call's manifest row (``record``), plus what
    parent resolution needs and the manifest does not keep (the staged segments in
    ``staging_chain``, root first, and the request and response items)."""

    rollout_id: Identifier
    record: CallRecord
    staging_chain: tuple[Identifier, ...] = ()
    request_items: list[dict]  # type: ignore[type-arg]
    response_items: list[dict]  # type: ignore[type-arg]


class ManifestFailure(_WireModel):
    """A call whose capture did not complete; it poisons its rollout's manifest."""

    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(_WireModel):
    """One rollout's token-free ledger: committed calls and failures, in row order."""

    rollout_id: Identifier
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


class RolloutReceipt(_DigestWireModel):
    """The token-free manifest a framework assembles when a rollout ends, with its terminal.

    ``terminal_selection`` says how the terminal call was chosen (None: no attribution stage
    ran, so the receipt must be poisoned with a ``failure_reason``).
    """

    rollout_id: Identifier
    reward: float | None = None
    terminal_model_call_id: Identifier | None = None
    manifest: list[CallRecord] = Field(default_factory=list)
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: Literal["declared", "response_id", "content", "heuristic"] | None = None
    terminal_attribution_reason: str | None = None

    @model_validator(mode="after")
    def _check_manifest(self) -> Self:
        call_ids = [record.model_call_id for record in self.manifest]
        if len(call_ids) != len(set(call_ids)):
            raise ValueError("receipt manifest contains duplicate model_call_id values")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in call_ids:
            raise ValueError("terminal_model_call_id is absent from the receipt manifest")
        return self

    @model_validator(mode="after")
    def _check_attribution(self) -> Self:
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise ValueError("an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise ValueError(
                    "an unpoisoned receipt must name terminal_model_call_id and terminal_selection"
                )
        if self.terminal_selection is None:
            if self.terminal_model_call_id is not None:
                raise ValueError("terminal_model_call_id requires a terminal_selection method")
            if self.failure_reason is None:
                raise ValueError(
                    "a receipt with no attribution stage must be poisoned with a failure_reason"
                )
        return self


class RolloutRemoval(BaseModel):
    """What retiring or deleting rollouts reports: ids that had a ledger, ids that had none.

    Not a NeMo Gym model (our addition). It has no ``schema_version``, so its dump is exactly a
    `RolloutRemovalPayload`.
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
