//! Worker-owned staging (NeMo Gym 0.7.0's `token_id_capture.staging`): the staging digests,
//! the stored row of a staged call, and the file staging store.
//!
//! * [`digest`]: NeMo Gym's staging digest, chain hash, cumulative (prefix) hash, extras
//!   digest and token-id framing, byte for byte.
//! * [`row`]: the binary row and attachments blob every staging backend stores, and their
//!   verification.
//! * [`file`](mod@file): the file backend: append-only segments written by group commit, a control log
//!   for segments and fences, and the recovery rule.
//! * [`postgres`]: the native group commit of the PostgreSQL backend's `stage` (the rows
//!   encoded here, sent with `tokio-postgres` by the calling threads).

pub mod digest;
pub mod file;
pub mod postgres;
pub mod row;

use std::io;
use std::path::Path;

use crate::error::Error;

/// Why a stage, fetch or lifecycle call failed.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// The record does not verify (its digests, lengths, masks) or cannot be encoded.
    #[error("{0}")]
    Digest(#[from] digest::DigestError),
    /// The caller passed something refused before any file is touched.
    #[error("{0}")]
    Invalid(String),
    /// A stage of a retired rollout.
    #[error("rollout {0:?} is retired: its staged calls are fenced until it is deleted")]
    Retired(String),
    /// A key already staged with other content.
    #[error("staging key {0:?} is already staged with different content")]
    Conflict(String),
    /// A fetch of a key that was never staged (or was deleted).
    #[error("staging key {0:?} is not staged")]
    UnknownKey(String),
    /// A fetch of a key of a retired rollout.
    #[error("staging key {key:?} belongs to retired rollout {rollout_id:?}")]
    RetiredKey { key: String, rollout_id: String },
    /// An operating-system call failed.
    #[error("{0}")]
    Io(Error),
    /// Stored bytes that are not what was acknowledged.
    #[error("{0}")]
    Corrupt(Error),
    /// The batch this stage was part of failed (the reason is the batch's).
    #[error("{0}")]
    Failed(String),
}

impl StagingError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        StagingError::Io(Error::Io {
            op,
            path: path.to_path_buf(),
            source,
        })
    }
}
