"""tokencapture: a fast, durable store for training-token capture in LLM reinforcement learning.

A drop-in for `nemo_gym.token_id_capture`: the same records, protocols, store API and on-disk
format, with the hot path (append + fsync, flock, digests, tail reconciliation) in Rust.
"""

from tokencapture.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    canonicalize_tool_arguments,
    conversation_digest,
)
from tokencapture.ledger import (
    CaptureLedgerConflictError,
    FileCaptureLedger,
)
from tokencapture.lineage import (
    FileLineageStore,
    InMemoryLineageStore,
    LineageIntegrityError,
    encode_delta,
    stamp_continuation,
)
from tokencapture.protocols import (
    CaptureLedger,
    LineageMatch,
    LineageResolution,
    LineageResolver,
    RolloutRemovalPayload,
    RolloutRetiredError,
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_lineage_store,
    install_token_sink,
    install_token_source,
    installed_lineage_store,
    installed_token_sink,
    installed_token_source,
)
from tokencapture.records import (
    TOKEN_ENTRY_MIN_SCHEMA_VERSION,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    cumulative_tokens,
    stamp_lineage,
)
from tokencapture.store import (
    TokenCaptureStore,
    make_token_store,
    validate_rollout_id,
    validate_rollout_ids,
)

__version__ = "0.1.0"

__all__ = [
    "FINGERPRINT_VERSION",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "CaptureLedger",
    "CaptureLedgerConflictError",
    "FileCaptureLedger",
    "FileLineageStore",
    "InMemoryLineageStore",
    "LineageIntegrityError",
    "LineageMatch",
    "LineageResolution",
    "LineageResolver",
    "ParentResolutionStatus",
    "RolloutRemovalPayload",
    "RolloutRetiredError",
    "TokenCaptureConflictError",
    "TokenCaptureCorruptionError",
    "TokenCaptureFrozenError",
    "TokenCaptureRetiredError",
    "TokenCaptureSnapshot",
    "TokenCaptureStore",
    "TokenEntry",
    "TokenSink",
    "TokenSource",
    "assistant_fingerprint",
    "canonicalize_tool_arguments",
    "compute_digest",
    "conversation_digest",
    "cumulative_tokens",
    "encode_delta",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
    "make_token_store",
    "stamp_continuation",
    "stamp_lineage",
    "validate_rollout_id",
    "validate_rollout_ids",
]
