"""Worker-owned staging: the wire models, the digests and the file staging store.

The models are NeMo Gym 0.7.0's `staging.records` models, field for field, plus
`RolloutRemoval`, what a ledger's ``retire`` and ``delete`` report; `FileStagingStore` is the
file backend (``tokencapture.staging.store``) and the exceptions every backend raises are
`StagingKeyError` and `StagingKeyRetiredError`.

This package is a front: its ``__init__`` sits above the file backend it exports. What lower
layers and other backends share lives in top-level modules, which this package's submodules
``records``, ``digest``, ``errors``, ``attachments`` and ``rows`` re-export under their public
paths: `tokencapture.staging_records` (the wire models, contract layer),
`tokencapture.staging_digest` (the native digests), `tokencapture.staging_errors`,
`tokencapture.staging_attachments` and `tokencapture.staging_rows` (what every backend does
above the Rust core). Code inside the package imports those modules, never these re-exports.
"""

from tokencapture.staging.store import FileStagingStore
from tokencapture.staging_errors import StagingKeyError, StagingKeyRetiredError
from tokencapture.staging_records import (
    CALL_RECORD_DIGEST_VERSION,
    CALL_RECORD_EXTRAS_DIGEST_VERSION,
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    LEDGER_SCHEMA_VERSION,
    MISSING_CHAIN_DIGEST_REASON,
    MISSING_RESPONSE_ID_REASON,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    CallRecord,
    CaptureAdmission,
    CaptureDisposition,
    CaptureLedgerCommit,
    CaptureMode,
    CommitCoords,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    compute_extras_digest,
    compute_staging_digest,
    staging_key,
)

__all__ = [
    "CALL_RECORD_DIGEST_VERSION",
    "CALL_RECORD_EXTRAS_DIGEST_VERSION",
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "LEDGER_SCHEMA_VERSION",
    "MISSING_CHAIN_DIGEST_REASON",
    "MISSING_RESPONSE_ID_REASON",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "CallRecord",
    "CaptureAdmission",
    "CaptureDisposition",
    "CaptureLedgerCommit",
    "CaptureMode",
    "CommitCoords",
    "FileStagingStore",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "StagingKeyError",
    "StagingKeyRetiredError",
    "compute_extras_digest",
    "compute_staging_digest",
    "staging_key",
]
