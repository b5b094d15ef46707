"""Worker-owned staging: the wire models, the digests and the file staging store.

They are NeMo Gym 0.7.0's `staging.records` models, field for field (see
`tokencapture.staging.records`), plus `RolloutRemoval`, what a ledger's ``retire`` and
``delete`` report.

`FileStagingStore` lives in ``tokencapture.staging.store`` (a backend above this package) and is
exported from ``tokencapture``; the digests are in
`tokencapture.staging.digest`, the exceptions in `tokencapture.staging.errors`.
"""

from tokencapture.staging.records import (
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
    "ManifestFailure",
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
