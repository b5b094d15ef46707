//! The Rust core of `tokencapture`: a durable, rollout-keyed store of training-token records.
//!
//! # On-disk format (shared with NeMo Gym 0.7.0's file store)
//!
//! One directory; per rollout id `R` (ASCII letters, digits, `.`, `_`, `-`):
//!
//! | file | content |
//! | --- | --- |
//! | `R.tokens.jsonl` | one canonical JSON entry per line, `\n`-terminated, in commit order |
//! | `R.tokens.state.json` | the state index: flags, snapshot id, version, payload digests |
//! | `R.tokens.intents` | one `model_call_id` per line, written before a call is dispatched |
//! | `R.tokens.incomplete` | one line per call that failed to capture |
//! | `R.tokens.lock` | the `flock` target (exclusive for writers, shared for readers) |
//!
//! # Durability and recovery
//!
//! * A put returns only after its line and newline are written in one call and `fdatasync`ed;
//!   creating a file also fsyncs the directory.
//! * The state index is replaced atomically (temporary file, fsync, rename). It may lag the log,
//!   or be missing (no put writes it before a rollout's first checkpoint): bytes past
//!   `indexed_size` are acknowledged records that every reader folds in the same way (each new
//!   call id bumps the version by one), and a missing index is a fresh rollout, so the lag is
//!   invisible.
//! * A final line without a newline was never acknowledged (torn write): readers ignore it,
//!   writers truncate it under the exclusive lock. A newline-terminated line that is not a
//!   record is corruption and raises with the file and offset; nothing is skipped silently.
//! * Lifecycle transitions (freeze, mark incomplete, drop, retire, delete) fsync the directory
//!   before returning; retire writes every fence durably before it removes any record.
//!
//! This crate has no Python dependency; the PyO3 bindings live in `py/` (one file per domain)
//! behind the `python` feature.

pub mod columnar;
pub mod descriptors;
pub mod digest;
pub mod doorbell;
pub mod error;
pub mod fetched;
pub mod fork;
pub mod json;
pub mod ledger;
pub mod lineage;
pub mod lock;
pub mod log;
#[cfg(any(target_os = "linux", target_os = "android"))]
pub mod mapped;
pub mod pool;
pub mod ring;
pub mod sha256x2;
pub mod split;
pub mod spread;
pub mod staging;
pub mod state;
pub mod store;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use store::{PutOutcome, Records, Removal, Snapshot, Store};
