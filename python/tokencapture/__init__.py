"""tokencapture: a fast, durable store for training-token capture in LLM reinforcement learning.

A drop-in for `nemo_gym.token_id_capture`: the same records, protocols, store API and on-disk
format, with the hot path (append + fsync, flock, digests, tail reconciliation) in Rust.
"""

import logging as _logging
import platform as _platform
import sys as _sys
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _distribution_version

# The compiled core first: where it cannot load, say which platform this is and what is supported,
# instead of a bare loader error from whichever module happened to import it first.
try:
    from tokencapture import _core as _core
except ImportError as _error:
    _here = (
        f"{_platform.system() or _sys.platform} {_platform.machine()}, "
        f"{_platform.python_implementation()} {_platform.python_version()}"
    )
    if _sys.platform == "win32":
        raise ImportError(
            f"tokencapture does not support Windows ({_here}): its Rust core relies on POSIX "
            "file locking (flock), positioned reads and Unix descriptors. Run it on Linux or "
            "macOS (on Windows, under WSL).",
            name="tokencapture._core",
        ) from _error
    _libc = " ".join(_platform.libc_ver()).strip()
    raise ImportError(
        f"tokencapture's compiled core (tokencapture._core) does not load on this platform "
        f"({_here}{', ' + _libc if _libc else ''}): {_error}. Prebuilt wheels cover Linux "
        "x86_64 and aarch64 with glibc 2.17 or later (manylinux2014) or musl 1.2 or later "
        "(musllinux_1_2), and macOS x86_64 and arm64, for CPython 3.11 and later; anywhere else "
        "that is Unix-like, build it from the source distribution with a Rust toolchain "
        "(pip install --no-binary tokencapture tokencapture).",
        name="tokencapture._core",
    ) from _error

from tokencapture.capture_settings import TokenIdCaptureConfig, TokenIdCaptureSettings
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
    DIGEST_VERSION,
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    TOKEN_ENTRY_MIN_SCHEMA_VERSION,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    ParentResolutionStatus,
    TokenEntry,
    compute_digest,
    cumulative_tokens,
    encode_token_ids,
    extract_token_fields,
    response_to_output_items,
    stamp_lineage,
    strip_token_fields,
)
from tokencapture.staging.store import FileStagingStore
from tokencapture.staging_errors import StagingKeyError, StagingKeyRetiredError
from tokencapture.staging_records import (
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
    RolloutRemoval,
)
from tokencapture.store import (
    TokenCaptureStore,
    make_token_store,
    validate_rollout_id,
    validate_rollout_ids,
)

# A library prints nothing its application did not ask for: without this, Python's last-resort
# handler wrote every logged failure to stderr (a CLI error came out twice, a full disk gave a
# line a put). Applications configure logging as they like; the gateway does, and the CLI
# reports its own errors.
_logging.getLogger("tokencapture").addHandler(_logging.NullHandler())

# The installed distribution's version, which maturin takes from Cargo.toml (its one source).
# Imported from a bare source tree (no installed metadata), the version is unknown, not guessed.
try:
    __version__: str = _distribution_version("tokencapture")
except _PackageNotFoundError:
    __version__ = "0+unknown"

__all__ = [
    "DIGEST_VERSION",
    "FINGERPRINT_VERSION",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "CallRecord",
    "CaptureLedger",
    "CaptureLedgerCommit",
    "CaptureLedgerConflictError",
    "FileCaptureLedger",
    "FileLineageStore",
    "FileStagingStore",
    "InMemoryLineageStore",
    "LineageIntegrityError",
    "LineageMatch",
    "LineageResolution",
    "LineageResolver",
    "ManifestFailure",
    "ParentResolutionStatus",
    "RolloutManifest",
    "RolloutRemoval",
    "RolloutRemovalPayload",
    "RolloutRetiredError",
    "StagingKeyError",
    "StagingKeyRetiredError",
    "TokenCaptureConflictError",
    "TokenCaptureCorruptionError",
    "TokenCaptureFrozenError",
    "TokenCaptureRetiredError",
    "TokenCaptureSnapshot",
    "TokenCaptureStore",
    "TokenEntry",
    "TokenIdCaptureConfig",
    "TokenIdCaptureSettings",
    "TokenSink",
    "TokenSource",
    "assistant_fingerprint",
    "canonicalize_tool_arguments",
    "compute_digest",
    "conversation_digest",
    "cumulative_tokens",
    "encode_delta",
    "encode_token_ids",
    "extract_token_fields",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
    "make_token_store",
    "response_to_output_items",
    "stamp_continuation",
    "stamp_lineage",
    "strip_token_fields",
    "validate_rollout_id",
    "validate_rollout_ids",
]

# The PostgreSQL backend, imported on first access so that `import tokencapture` never needs
# its driver (`pip install tokencapture[postgres]`); not in __all__ for the same reason.
_POSTGRES_NAMES = frozenset(
    {
        "PostgresCaptureLedger",
        "PostgresLineageStore",
        "PostgresStagingStore",
        "PostgresTokenCaptureStore",
    }
)


def __getattr__(name: str) -> object:
    if name in _POSTGRES_NAMES:
        from tokencapture import postgres

        return getattr(postgres, name)
    raise AttributeError(f"module 'tokencapture' has no attribute {name!r}")
