"""Wire models of the capture ledger: staged calls, their manifest and removal results.

The ledger stores token-free metadata for calls whose token arrays were staged by a training
framework; see `tokencapture.staging.records`.
"""

from tokencapture.staging.records import (
    CALL_RECORD_DIGEST_VERSION,
    CALL_RECORD_EXTRAS_DIGEST_VERSION,
    LEDGER_SCHEMA_VERSION,
    MISSING_CHAIN_DIGEST_REASON,
    MISSING_RESPONSE_ID_REASON,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
    RolloutRemoval,
)

__all__ = [
    "CALL_RECORD_DIGEST_VERSION",
    "CALL_RECORD_EXTRAS_DIGEST_VERSION",
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
