//! Errors of the core. Each variant maps to one specific Python exception in `py/errors.rs`.

use std::io;
use std::path::{Path, PathBuf};

/// Everything a store operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system call failed; `op` says which step, `path` which file.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A capture write arrived after the rollout was frozen.
    #[error("rollout {0:?} is frozen: its capture no longer accepts writes")]
    Frozen(String),
    /// A write (or a read of a ledger) arrived after the rollout was retired.
    #[error("rollout {0:?} is retired: its capture is fenced until it is deleted")]
    Retired(String),
    /// A call id was reused with different bytes. The rollout has been marked incomplete.
    #[error(
        "model_call_id {call_id:?} of rollout {rollout_id:?} is already stored with a \
         different payload; the rollout is now marked incomplete"
    )]
    Conflict { rollout_id: String, call_id: String },
    /// A file holds bytes that were never a valid acknowledged record.
    #[error("{}: {detail} (byte offset {offset})", path.display())]
    Corrupt {
        path: PathBuf,
        offset: u64,
        detail: String,
    },
    /// The caller passed something the store refuses before touching any file.
    #[error("{0}")]
    InvalidInput(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Attach the failing step and file to an `io::Error`.
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: &Path) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: &Path) -> Result<T> {
        self.map_err(|source| Error::Io {
            op,
            path: path.to_path_buf(),
            source,
        })
    }
}

impl Error {
    /// An equal error for another caller (an `io::Error` is not `Clone`: its OS error code, or
    /// its kind and message, are kept). A group commit tells each of its puts the same failure.
    pub(crate) fn duplicate(&self) -> Self {
        match self {
            Error::Io { op, path, source } => Error::Io {
                op,
                path: path.clone(),
                source: match (
                    source.raw_os_error(),
                    crate::descriptors::exhaustion(source),
                ) {
                    (Some(code), _) => io::Error::from_raw_os_error(code),
                    // An exhaustion `descriptors::retry` gave up on stays one.
                    (None, Some((code, true))) => crate::descriptors::exhausted_after_closing(
                        io::Error::from_raw_os_error(code),
                    ),
                    (None, _) => io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::Frozen(id) => Error::Frozen(id.clone()),
            Error::Retired(id) => Error::Retired(id.clone()),
            Error::Conflict {
                rollout_id,
                call_id,
            } => Error::Conflict {
                rollout_id: rollout_id.clone(),
                call_id: call_id.clone(),
            },
            Error::Corrupt {
                path,
                offset,
                detail,
            } => Error::Corrupt {
                path: path.clone(),
                offset: *offset,
                detail: detail.clone(),
            },
            Error::InvalidInput(message) => Error::InvalidInput(message.clone()),
        }
    }

    pub(crate) fn corrupt(path: &Path, offset: u64, detail: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.to_path_buf(),
            offset,
            detail: detail.into(),
        }
    }
}
