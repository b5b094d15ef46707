//! The capture ledger: token-free rows of calls whose token data a framework stages itself.
//!
//! # On-disk format
//!
//! Beside the token store's files, per rollout id `R`:
//!
//! | file | content |
//! | --- | --- |
//! | `R.lineage.jsonl` | one row per line, `\n`-terminated, in commit order |
//! | `R.lineage.retired` | the fence: an empty file whose existence means "retired" |
//! | `R.tokens.lock` | the same `flock` target as the token store (writers exclusive, readers shared) |
//!
//! Rows are JSON objects with sorted keys and no spaces (what orjson `OPT_SORT_KEYS` writes):
//!
//! * commit: `{"kind":"commit","record":{CallRecord},"rollout_id":R,"schema_version":2,
//!   "staging_chain":[...]}`; its call id is `record.model_call_id`;
//! * failure: `{"kind":"failure","model_call_id":C,"reason":T,"rollout_id":R,"schema_version":2}`.
//!
//! # Rules
//!
//! * **Write once.** Per call id there is at most one commit row: an identical row (same bytes,
//!   compared by payload digest) is a no-op, a different one is a [`LedgerError::Conflict`] and
//!   nothing is written. Failure rows never conflict; an identical `(call id, reason)` is a no-op.
//!   Rows appended by a writer without this check (a foreign or racing writer) are judged on
//!   read: a second, different commit row for a call id makes that call *conflicted*, which is
//!   never a resolution candidate and is reported as a failure.
//! * **Durable and visible before returning.** A row and its newline are written in one call
//!   and `fdatasync`ed; creating the ledger file also fsyncs the directory. Readers in any
//!   process fold the bytes past their cursor under the shared lock, so a row whose `record`
//!   has returned is seen by the next read anywhere.
//! * **Torn and corrupt lines** follow the token store ([`crate::log`]): a final line without
//!   its newline was never acknowledged, so readers ignore it and a writer truncates it before
//!   appending; a complete line that is not a ledger row (not a JSON object, unknown `kind`, no
//!   call id, another rollout's id, a newer `schema_version`) is [`Error::Corrupt`].
//! * **Poison rows.** A commit row whose record is not a valid `CallRecord` is kept but
//!   classified: no response id -> `missing_response_id`, no `digest` or `chain_hash` ->
//!   `missing_chain_digest`, anything else -> `invalid_call_record`. It is listed as a failure,
//!   never resolved. A call that also has a failure row is never resolved either.
//! * **The fence.** `retire` first creates every missing `R.lineage.retired` and fsyncs it and
//!   the directory, then removes `R.lineage.jsonl` and fsyncs the directory again, so a removal
//!   can never be durable without its fence. A fenced rollout discards later rows (the write
//!   returns [`RecordOutcome::Discarded`]), and reading it is [`LedgerError::Retired`], even if a
//!   crash left rows behind. `delete` removes the rows and the fence (and the lock file, when no
//!   token-store file of the rollout remains), then fsyncs the directory.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::digest::payload_digest;
use crate::error::{Error, IoContext};
use crate::lineage::{Missing, Request, REASON_AMBIGUOUS, REASON_NO_MATCH};
use crate::lock::{LockMode, RolloutLock};
use crate::log::{append_line, complete_lines, complete_prefix_len};
use crate::state::is_hex_digest;
use crate::store::{
    remove_if_exists, rollout_cache, validate_rollout_id, validate_rollout_ids, Removal,
    RolloutPaths, RootDir,
};

/// The row and wire schema version.
pub const LEDGER_SCHEMA_VERSION: u64 = 2;
/// Default number of rollouts whose index a [`Ledger`] keeps (one descriptor each).
pub const DEFAULT_CACHED_ROLLOUTS: usize = 256;

/// A committed row without a response id.
pub const MISSING_RESPONSE_ID_REASON: &str = "missing_response_id";
/// A committed row without its token digest or chain hash.
pub const MISSING_CHAIN_DIGEST_REASON: &str = "missing_chain_digest";
/// A committed row whose record is not a valid `CallRecord` for another reason.
pub const INVALID_CALL_RECORD_REASON: &str = "invalid_call_record";
/// A call id with two different committed rows.
pub const CONFLICTING_CALL_RECORD_REASON: &str = "conflicting_call_record";

/// What a ledger operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// I/O, corruption or invalid input.
    #[error(transparent)]
    Store(#[from] Error),
    /// The rollout's ledger was read after it was retired.
    #[error(
        "rollout {0:?} was retired: its ledger is gone, not empty (delete the rollout to reuse \
         its id)"
    )]
    Retired(String),
    /// A commit row for a call id that already has a different one.
    #[error(
        "model_call_id {call_id:?} of rollout {rollout_id:?} is already recorded with a \
         different row; ledger rows are written once"
    )]
    Conflict { rollout_id: String, call_id: String },
}

pub type Result<T> = std::result::Result<T, LedgerError>;

fn invalid<T>(message: impl Into<String>) -> Result<T> {
    Err(Error::InvalidInput(message.into()).into())
}

// ---- rows ----------------------------------------------------------------------------------

/// What resolution needs of a valid commit row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitMeta {
    pub fingerprint: String,
    pub context_len: usize,
    pub context_digest: String,
    pub digest: String,
    pub cum_len: u64,
    pub prev_len: u64,
    pub chain_hash: String,
    pub staging_chain: Vec<String>,
}

/// One parsed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Row {
    Commit {
        call_id: String,
        /// The record as compact JSON (what the manifest lists).
        record: Vec<u8>,
        /// The resolution metadata, or the failure reason of a poison row.
        meta: std::result::Result<CommitMeta, &'static str>,
    },
    Failure {
        call_id: String,
        reason: String,
    },
}

impl Row {
    pub fn call_id(&self) -> &str {
        match self {
            Row::Commit { call_id, .. } | Row::Failure { call_id, .. } => call_id,
        }
    }
}

/// Every field of a `CallRecord` (`extra="forbid"`).
const RECORD_KEYS: [&str; 16] = [
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "model_call_id",
    "response_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "digest",
    "chain_hash",
    "extras_digest",
    "continuation_fingerprint",
    "continuation_context_len",
    "continuation_context_digest",
];

const ROW_KEYS: [&str; 5] = [
    "kind",
    "record",
    "rollout_id",
    "schema_version",
    "staging_chain",
];

fn non_empty_str(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// Classify a record by the rules of `CallRecord` (at least as strict as its validation, so a
/// row resolution accepts always validates). `Err` is the failure reason.
fn classify(
    record: &Map<String, Value>,
    staging_chain: Option<&Value>,
    extra_row_keys: bool,
) -> std::result::Result<CommitMeta, &'static str> {
    let absent = |key: &str| match record.get(key) {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(_) => false,
    };
    if absent("response_id") {
        return Err(MISSING_RESPONSE_ID_REASON);
    }
    if absent("digest") || absent("chain_hash") {
        return Err(MISSING_CHAIN_DIGEST_REASON);
    }
    let bad = INVALID_CALL_RECORD_REASON;
    if extra_row_keys
        || record
            .keys()
            .any(|key| !RECORD_KEYS.contains(&key.as_str()))
    {
        return Err(bad);
    }
    for (key, version) in [
        ("schema_version", 2),
        ("digest_version", 2),
        ("extras_digest_version", 1),
    ] {
        if record.get(key).is_some_and(|v| v.as_u64() != Some(version)) {
            return Err(bad);
        }
    }
    let call_id = non_empty_str(record.get("model_call_id")).ok_or(bad)?;
    non_empty_str(record.get("response_id")).ok_or(bad)?;
    let parent = match record.get("parent_call_id") {
        None | Some(Value::Null) => None,
        Some(value) => Some(non_empty_str(Some(value)).ok_or(bad)?),
    };
    let mode = record.get("mode").and_then(Value::as_str).ok_or(bad)?;
    let count = |key: &str| record.get(key).and_then(Value::as_u64).ok_or(bad);
    let (prev_len, delta_len, cum_len) =
        (count("prev_len")?, count("delta_len")?, count("cum_len")?);
    let hex = |key: &str| {
        record
            .get(key)
            .and_then(Value::as_str)
            .filter(|s| is_hex_digest(s))
            .map(str::to_owned)
            .ok_or(bad)
    };
    let digest = hex("digest")?;
    let chain_hash = hex("chain_hash")?;
    let context_digest = hex("continuation_context_digest")?;
    match record.get("extras_digest") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if is_hex_digest(s) => {}
        Some(_) => return Err(bad),
    }
    let fingerprint = record
        .get("continuation_fingerprint")
        .and_then(Value::as_str)
        .filter(|s| s.is_empty() || is_hex_digest(s))
        .ok_or(bad)?
        .to_owned();
    let context_len = usize::try_from(count("continuation_context_len")?).map_err(|_| bad)?;
    if delta_len == 0 || prev_len.checked_add(delta_len) != Some(cum_len) {
        return Err(bad);
    }
    let parent_ok = match parent {
        None => prev_len == 0 && mode == "text",
        Some(parent) => prev_len > 0 && mode == "token_in" && parent != call_id,
    };
    if !parent_ok {
        return Err(bad);
    }
    let staging_chain = match staging_chain {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| non_empty_str(Some(item)).map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or(bad)?,
        Some(_) => return Err(bad),
    };
    Ok(CommitMeta {
        fingerprint,
        context_len,
        context_digest,
        digest,
        cum_len,
        prev_len,
        chain_hash,
        staging_chain,
    })
}

/// Parse one row of `rollout_id`'s ledger. The error is a plain description: the caller adds
/// the file and offset (a corrupt line) or refuses the write (invalid input).
pub fn parse_row(line: &[u8], rollout_id: &str) -> std::result::Result<Row, String> {
    let value: Value =
        serde_json::from_slice(line).map_err(|err| format!("not a JSON ledger row: {err}"))?;
    let Value::Object(row) = value else {
        return Err("a ledger row must be a JSON object".into());
    };
    if let Some(version) = row.get("schema_version") {
        match version.as_u64() {
            Some(1..=LEDGER_SCHEMA_VERSION) => {}
            Some(newer) if newer > LEDGER_SCHEMA_VERSION => {
                return Err(format!(
                    "row has schema_version {newer}, newer than this reader's \
                     {LEDGER_SCHEMA_VERSION}; refusing to guess at it"
                ))
            }
            _ => return Err(format!("row has an invalid schema_version {version}")),
        }
    }
    match row.get("rollout_id") {
        None => {}
        Some(Value::String(id)) if id == rollout_id => {}
        Some(other) => {
            return Err(format!(
                "row belongs to rollout {other} but sits in {rollout_id:?}'s ledger"
            ))
        }
    }
    match row.get("kind").and_then(Value::as_str) {
        Some("commit") => {
            let Some(Value::Object(record)) = row.get("record") else {
                return Err("commit row has no record object".into());
            };
            let call_id = non_empty_str(record.get("model_call_id"))
                .ok_or("commit row's record has no model_call_id string")?
                .to_owned();
            let extra = row.keys().any(|key| !ROW_KEYS.contains(&key.as_str()));
            let meta = classify(record, row.get("staging_chain"), extra);
            let record = serde_json::to_vec(record).map_err(|err| err.to_string())?;
            Ok(Row::Commit {
                call_id,
                record,
                meta,
            })
        }
        Some("failure") => {
            let call_id = non_empty_str(row.get("model_call_id"))
                .ok_or("failure row has no model_call_id string")?;
            let reason =
                non_empty_str(row.get("reason")).ok_or("failure row has no reason string")?;
            Ok(Row::Failure {
                call_id: call_id.to_owned(),
                reason: reason.to_owned(),
            })
        }
        Some(other) => Err(format!("unknown row kind {other:?}")),
        None => Err("row has no kind".into()),
    }
}

#[derive(Serialize)]
struct FailureRow<'a> {
    // Declared in sorted order: the compact output has sorted keys.
    kind: &'static str,
    model_call_id: &'a str,
    reason: &'a str,
    rollout_id: &'a str,
    schema_version: u64,
}

/// The canonical failure row.
pub fn failure_row(rollout_id: &str, call_id: &str, reason: &str) -> Vec<u8> {
    serde_json::to_vec(&FailureRow {
        kind: "failure",
        model_call_id: call_id,
        reason,
        rollout_id,
        schema_version: LEDGER_SCHEMA_VERSION,
    })
    .expect("a failure row serializes")
}

// ---- the per-rollout index -----------------------------------------------------------------

#[derive(Debug)]
struct CommitSlot {
    call_id: String,
    row_digest: String,
    record: Vec<u8>,
    meta: std::result::Result<CommitMeta, &'static str>,
    conflicted: bool,
}

#[derive(Debug, Clone)]
enum Listed {
    Commit(usize),
    Failure { call_id: String, reason: String },
}

/// One rollout's rows, folded in file order.
#[derive(Debug, Default)]
struct LedgerIndex {
    listed: Vec<Listed>,
    commits: Vec<CommitSlot>,
    by_call: HashMap<String, usize>,
    failures: HashSet<(String, String)>,
    failed_calls: HashSet<String>,
    by_fingerprint: HashMap<String, Vec<usize>>,
}

/// What adding a row does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    New,
    Duplicate,
    Conflict,
}

impl LedgerIndex {
    /// What `row` would do, without changing anything.
    fn check(&self, row: &Row, row_digest: &str) -> Fold {
        match row {
            Row::Commit { call_id, .. } => match self.by_call.get(call_id) {
                None => Fold::New,
                Some(&slot) if self.commits[slot].row_digest == row_digest => Fold::Duplicate,
                Some(_) => Fold::Conflict,
            },
            Row::Failure { call_id, reason } => {
                if self.failures.contains(&(call_id.clone(), reason.clone())) {
                    Fold::Duplicate
                } else {
                    Fold::New
                }
            }
        }
    }

    /// Fold an acknowledged row in; a conflicting commit marks its call conflicted.
    fn fold(&mut self, row: Row, row_digest: String) -> Fold {
        let outcome = self.check(&row, &row_digest);
        match (outcome, row) {
            (Fold::Duplicate, _) => {}
            (Fold::Conflict, row) => {
                let slot = self.by_call[row.call_id()];
                self.commits[slot].conflicted = true;
            }
            (
                Fold::New,
                Row::Commit {
                    call_id,
                    record,
                    meta,
                },
            ) => {
                let slot = self.commits.len();
                if let Ok(meta) = &meta {
                    if !meta.fingerprint.is_empty() {
                        self.by_fingerprint
                            .entry(meta.fingerprint.clone())
                            .or_default()
                            .push(slot);
                    }
                }
                self.by_call.insert(call_id.clone(), slot);
                self.commits.push(CommitSlot {
                    call_id,
                    row_digest,
                    record,
                    meta,
                    conflicted: false,
                });
                self.listed.push(Listed::Commit(slot));
            }
            (Fold::New, Row::Failure { call_id, reason }) => {
                self.failed_calls.insert(call_id.clone());
                self.failures.insert((call_id.clone(), reason.clone()));
                self.listed.push(Listed::Failure { call_id, reason });
            }
        }
        outcome
    }

    fn manifest(&self) -> Manifest {
        let mut manifest = Manifest::default();
        for listed in &self.listed {
            match listed {
                Listed::Commit(slot) => {
                    let commit = &self.commits[*slot];
                    let reason = if commit.conflicted {
                        Err(CONFLICTING_CALL_RECORD_REASON)
                    } else {
                        commit.meta.as_ref().map(|_| ()).map_err(|reason| *reason)
                    };
                    match reason {
                        Ok(()) => manifest
                            .records
                            .push((commit.call_id.clone(), commit.record.clone())),
                        Err(reason) => manifest
                            .failures
                            .push((commit.call_id.clone(), reason.to_owned())),
                    }
                }
                Listed::Failure { call_id, reason } => {
                    manifest.failures.push((call_id.clone(), reason.clone()))
                }
            }
        }
        manifest
    }

    /// The candidate rules of SPEC section 5 over valid, unconflicted, unfailed commit rows.
    fn decide(
        &self,
        fingerprint: &str,
        request: &mut dyn Request,
    ) -> std::result::Result<Resolution, Missing> {
        let no_match = Ok(Resolution::Unresolved(REASON_NO_MATCH));
        let Some(slots) = self.by_fingerprint.get(fingerprint) else {
            return no_match;
        };
        let n = request.len();
        let fits: Vec<(&CommitSlot, &CommitMeta)> = slots
            .iter()
            .map(|&slot| &self.commits[slot])
            .filter(|commit| !commit.conflicted && !self.failed_calls.contains(&commit.call_id))
            .filter_map(|commit| commit.meta.as_ref().ok().map(|meta| (commit, meta)))
            .filter(|(_, meta)| !meta.context_digest.is_empty() && meta.context_len <= n)
            .collect();
        if fits.is_empty() {
            return no_match;
        }
        let mut lens: Vec<usize> = fits.iter().map(|(_, meta)| meta.context_len).collect();
        lens.sort_unstable();
        lens.dedup();
        let digests = request.context_digests(&lens)?;
        let candidates: Vec<(&CommitSlot, &CommitMeta)> = fits
            .into_iter()
            .filter(|(_, meta)| {
                lens.binary_search(&meta.context_len)
                    .is_ok_and(|at| digests[at] == meta.context_digest)
            })
            .collect();
        let Some((_, first)) = candidates.first() else {
            return no_match;
        };
        let shared = candidates
            .iter()
            .all(|(_, meta)| meta.digest == first.digest && meta.cum_len == first.cum_len);
        if !shared {
            return Ok(Resolution::Unresolved(REASON_AMBIGUOUS));
        }
        let Some((winner, meta)) = candidates
            .iter()
            .min_by(|a, b| a.0.call_id.cmp(&b.0.call_id))
            .copied()
        else {
            return no_match;
        };
        Ok(Resolution::Resolved(LedgerMatch {
            model_call_id: winner.call_id.clone(),
            digest: meta.digest.clone(),
            staging_chain: meta.staging_chain.clone(),
            prev_len: meta.cum_len,
            chain_hash: meta.chain_hash.clone(),
        }))
    }
}

/// A rollout's token-free ledger: valid committed records `(call id, record JSON)` and
/// failures `(call id, reason)`, both in file order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub records: Vec<(String, Vec<u8>)>,
    pub failures: Vec<(String, String)>,
}

/// A verified parent, without tokens (`LineageMatch` with empty `cumulative_token_ids`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerMatch {
    pub model_call_id: String,
    pub digest: String,
    pub staging_chain: Vec<String>,
    /// The parent's `cum_len`: the child's `prev_len`.
    pub prev_len: u64,
    pub chain_hash: String,
}

/// A request-time decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    Root,
    Resolved(LedgerMatch),
    Unresolved(&'static str),
}

/// A decision, or the hashes the caller must supply first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerStep {
    Done(Resolution),
    Missing(Missing),
}

/// What `record` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordOutcome {
    Appended,
    /// The identical row was already there: nothing changed.
    Duplicate,
    /// The rollout is retired: the row was dropped, as the fence requires.
    Discarded,
}

// ---- files ---------------------------------------------------------------------------------

/// The ledger files of one rollout.
#[derive(Debug, Clone)]
pub struct LedgerPaths {
    pub log: PathBuf,
    pub fence: PathBuf,
    pub lock: PathBuf,
}

impl LedgerPaths {
    pub fn new(root: &Path, rollout_id: &str) -> Self {
        LedgerPaths {
            log: root.join(format!("{rollout_id}.lineage.jsonl")),
            fence: root.join(format!("{rollout_id}.lineage.retired")),
            lock: RolloutPaths::new(root, rollout_id).lock,
        }
    }
}

fn exists(path: &Path) -> crate::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err).ctx("stat", path),
    }
}

#[derive(Debug)]
struct PinnedLog {
    file: File,
    dev: u64,
    ino: u64,
    writable: bool,
}

/// One rollout as this process last read it.
#[derive(Debug, Default)]
struct RolloutState {
    fenced: bool,
    log: Option<PinnedLog>,
    /// End of the complete lines folded into `index`.
    cursor: u64,
    /// The log's length at the last refresh (past `cursor`: a torn final line).
    len: u64,
    index: LedgerIndex,
}

impl RolloutState {
    fn reset_log(&mut self) {
        self.log = None;
        self.cursor = 0;
        self.len = 0;
        self.index = LedgerIndex::default();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // State is only published after every fallible step succeeded (or reset on failure), so
    // a poisoned guard still holds a consistent index.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The file-backed ledger over one directory; safe to share between threads and processes.
#[derive(Debug)]
pub struct Ledger {
    dir: RootDir,
    rollouts: Mutex<LruCache<String, Arc<Mutex<RolloutState>>>>,
}

impl Ledger {
    /// Open (creating if needed) the ledger directory.
    pub fn open(root: impl Into<PathBuf>, cached_rollouts: usize) -> crate::Result<Self> {
        Ok(Ledger {
            dir: RootDir::open(root)?,
            rollouts: rollout_cache(cached_rollouts),
        })
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn paths(&self, rollout_id: &str) -> LedgerPaths {
        LedgerPaths::new(self.dir.path(), rollout_id)
    }

    fn sync_dir(&self) -> crate::Result<()> {
        self.dir.sync()
    }

    /// Drop every cached index (and the descriptors it holds).
    pub fn clear(&self) {
        lock(&self.rollouts).clear();
    }

    pub fn cached_rollouts(&self) -> usize {
        lock(&self.rollouts).len()
    }

    fn rollout(&self, rollout_id: &str) -> Arc<Mutex<RolloutState>> {
        let mut rollouts = lock(&self.rollouts);
        if let Some(found) = rollouts.get(rollout_id) {
            return found.clone();
        }
        let fresh = Arc::new(Mutex::new(RolloutState::default()));
        rollouts.put(rollout_id.to_owned(), fresh.clone());
        fresh
    }

    fn forget(&self, rollout_id: &str) {
        lock(&self.rollouts).pop(rollout_id);
    }

    /// Bring `state` up to date with the disk. Call under the rollout's flock.
    fn refresh(
        &self,
        state: &mut RolloutState,
        paths: &LedgerPaths,
        rollout_id: &str,
    ) -> crate::Result<()> {
        state.fenced = exists(&paths.fence)?;
        if state.fenced {
            state.reset_log();
            return Ok(());
        }
        let on_disk = match std::fs::metadata(&paths.log) {
            Ok(meta) => (meta.dev(), meta.ino()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                state.reset_log();
                return Ok(());
            }
            Err(err) => return Err(err).ctx("stat ledger", &paths.log),
        };
        if state.log.as_ref().map(|log| (log.dev, log.ino)) != Some(on_disk) {
            state.reset_log();
            let file = match File::open(&paths.log) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(err) => return Err(err).ctx("open ledger", &paths.log),
            };
            let meta = file.metadata().ctx("stat ledger", &paths.log)?;
            state.log = Some(PinnedLog {
                file,
                dev: meta.dev(),
                ino: meta.ino(),
                writable: false,
            });
        }
        let Some(log) = &state.log else {
            return Ok(());
        };
        let len = log.file.metadata().ctx("stat ledger", &paths.log)?.len();
        if len < state.cursor {
            // Shorter than what we folded: rows were removed behind our back; read it again.
            state.cursor = 0;
            state.index = LedgerIndex::default();
        }
        state.len = len;
        if len == state.cursor {
            return Ok(());
        }
        let start = state.cursor;
        let mut tail = vec![0u8; (len - start) as usize];
        log.file
            .read_exact_at(&mut tail, start)
            .ctx("read ledger", &paths.log)?;
        for (offset, line) in complete_lines(&tail, start) {
            let row = parse_row(line, rollout_id)
                .map_err(|detail| Error::corrupt(&paths.log, offset, detail))?;
            state.index.fold(row, payload_digest(line));
        }
        state.cursor = start + complete_prefix_len(&tail) as u64;
        Ok(())
    }

    /// Run `op` with the rollout refreshed under the shared lock (released before `op`).
    /// A rollout without any file is read as empty and nothing is created.
    fn read<T>(&self, rollout_id: &str, op: impl FnOnce(&RolloutState) -> T) -> crate::Result<T> {
        validate_rollout_id(rollout_id)?;
        let paths = self.paths(rollout_id);
        let rollout = self.rollout(rollout_id);
        let mut state = lock(&rollout);
        {
            let mut guard = RolloutLock::acquire_if_exists(&paths.lock, LockMode::Shared)?;
            if guard.is_none() && (exists(&paths.log)? || exists(&paths.fence)?) {
                // Files without a lock file (an operator removed it): recreate it.
                guard = Some(RolloutLock::acquire(&paths.lock, LockMode::Shared)?);
            }
            if guard.is_none() {
                *state = RolloutState::default();
            } else if let Err(err) = self.refresh(&mut state, &paths, rollout_id) {
                *state = RolloutState::default();
                return Err(err);
            }
        }
        Ok(op(&state))
    }

    /// Durably append one row (a commit or failure row of `rollout_id`, as one line).
    pub fn record(&self, rollout_id: &str, line: &[u8]) -> Result<RecordOutcome> {
        validate_rollout_id(rollout_id)?;
        if memchr::memchr2(b'\n', b'\r', line).is_some() {
            return invalid("a ledger row must be a single line");
        }
        let row = match parse_row(line, rollout_id) {
            Ok(row) => row,
            Err(detail) => return invalid(format!("not a ledger row: {detail}")),
        };
        if let Row::Commit {
            meta: Err(reason), ..
        } = &row
        {
            return invalid(format!(
                "refusing to record a commit row that reads back as a failure ({reason}): its \
                 record is not a valid CallRecord"
            ));
        }
        let row_digest = payload_digest(line);
        let paths = self.paths(rollout_id);
        let rollout = self.rollout(rollout_id);
        let mut state = lock(&rollout);
        let _guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
        let result = self.append(&mut state, &paths, rollout_id, row, row_digest, line);
        if matches!(result, Err(LedgerError::Store(_))) {
            *state = RolloutState::default();
        }
        result
    }

    fn append(
        &self,
        state: &mut RolloutState,
        paths: &LedgerPaths,
        rollout_id: &str,
        row: Row,
        row_digest: String,
        line: &[u8],
    ) -> Result<RecordOutcome> {
        self.refresh(state, paths, rollout_id)?;
        if state.fenced {
            return Ok(RecordOutcome::Discarded);
        }
        match state.index.check(&row, &row_digest) {
            Fold::Duplicate => return Ok(RecordOutcome::Duplicate),
            Fold::Conflict => {
                return Err(LedgerError::Conflict {
                    rollout_id: rollout_id.to_owned(),
                    call_id: row.call_id().to_owned(),
                })
            }
            Fold::New => {}
        }
        let mut created = false;
        match &mut state.log {
            Some(log) if log.writable => {}
            Some(log) => {
                // Under the exclusive lock the path still names the inode we pinned.
                let file = OpenOptions::new()
                    .read(true)
                    .append(true)
                    .open(&paths.log)
                    .ctx("open ledger", &paths.log)?;
                let meta = file.metadata().ctx("stat ledger", &paths.log)?;
                if (meta.dev(), meta.ino()) != (log.dev, log.ino) {
                    return Err(Error::corrupt(
                        &paths.log,
                        0,
                        "the ledger file was replaced while its lock was held",
                    )
                    .into());
                }
                log.file = file;
                log.writable = true;
            }
            None => {
                let file = OpenOptions::new()
                    .read(true)
                    .append(true)
                    .create(true)
                    .open(&paths.log)
                    .ctx("create ledger", &paths.log)?;
                let meta = file.metadata().ctx("stat ledger", &paths.log)?;
                state.cursor = 0;
                state.len = meta.len();
                state.log = Some(PinnedLog {
                    file,
                    dev: meta.dev(),
                    ino: meta.ino(),
                    writable: true,
                });
                created = true;
            }
        }
        let Some(log) = &state.log else {
            unreachable!("the ledger file was just opened");
        };
        let before = state.cursor;
        if state.len > before {
            // A torn final line was never acknowledged; appending after it would glue onto it.
            log.file
                .set_len(before)
                .ctx("truncate torn row", &paths.log)?;
        }
        if let Err(err) = append_line(&log.file, line).and_then(|()| log.file.sync_data()) {
            // Leave no partial row: the caller is told this record failed.
            let _ = log.file.set_len(before);
            return Err(err)
                .ctx("append ledger", &paths.log)
                .map_err(Into::into);
        }
        if created {
            self.sync_dir()?;
        }
        state.cursor = before + line.len() as u64 + 1;
        state.len = state.cursor;
        state.index.fold(row, row_digest);
        Ok(RecordOutcome::Appended)
    }

    /// Durably record that a call did not commit.
    pub fn record_failure(
        &self,
        rollout_id: &str,
        call_id: &str,
        reason: &str,
    ) -> Result<RecordOutcome> {
        validate_rollout_id(rollout_id)?;
        if call_id.is_empty() {
            return invalid("model_call_id must not be empty");
        }
        if reason.is_empty() {
            return invalid("reason must not be empty");
        }
        self.record(rollout_id, &failure_row(rollout_id, call_id, reason))
    }

    /// Whether any row (committed or failed) exists; a retired rollout is an error.
    pub fn has_rows(&self, rollout_id: &str) -> Result<bool> {
        let (fenced, any) = self.read(rollout_id, |state| {
            (state.fenced, !state.index.listed.is_empty())
        })?;
        if fenced {
            return Err(LedgerError::Retired(rollout_id.to_owned()));
        }
        Ok(any)
    }

    /// The rollout's token-free ledger; a retired rollout is an error.
    pub fn manifest(&self, rollout_id: &str) -> Result<Manifest> {
        let (fenced, manifest) =
            self.read(rollout_id, |state| (state.fenced, state.index.manifest()))?;
        if fenced {
            return Err(LedgerError::Retired(rollout_id.to_owned()));
        }
        Ok(manifest)
    }

    /// Resolve a request against the rollout's committed rows. A retired rollout has none.
    pub fn resolve(&self, rollout_id: &str, request: &mut dyn Request) -> Result<LedgerStep> {
        validate_rollout_id(rollout_id)?;
        let fingerprint = match request.fingerprint() {
            Ok(fp) if fp.is_empty() => return Ok(LedgerStep::Done(Resolution::Root)),
            Ok(fp) => fp,
            Err(missing) => return Ok(LedgerStep::Missing(missing)),
        };
        let step = self.read(rollout_id, |state| {
            match state.index.decide(&fingerprint, request) {
                Ok(resolution) => LedgerStep::Done(resolution),
                Err(missing) => LedgerStep::Missing(missing),
            }
        })?;
        Ok(step)
    }

    /// Fence every rollout, then remove its rows (two phases, each ending in a directory
    /// fsync). Returns the ids that had a ledger and those that had none.
    pub fn retire<S: AsRef<str>>(&self, rollout_ids: &[S]) -> crate::Result<Removal> {
        let ids = validate_rollout_ids(rollout_ids)?;
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        for id in &ids {
            let paths = self.paths(id);
            let _guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(id);
            if !exists(&paths.fence)? {
                let fence = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&paths.fence)
                    .ctx("create fence", &paths.fence)?;
                fence.sync_all().ctx("fsync fence", &paths.fence)?;
            }
        }
        // Even when every fence existed: one may come from an overlapping retire that has not
        // synced yet, and no removal below may become durable before it.
        self.sync_dir()?;
        let mut removal = Removal::default();
        for id in ids {
            let paths = self.paths(&id);
            let _guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(&id);
            let had = remove_if_exists(&paths.log)?;
            removal.note(id, had);
        }
        self.sync_dir()?;
        Ok(removal)
    }

    /// Remove rows and fences, so a reused id starts empty. The shared lock file goes too
    /// when no token-store file of the rollout remains.
    pub fn delete<S: AsRef<str>>(&self, rollout_ids: &[S]) -> crate::Result<Removal> {
        let ids = validate_rollout_ids(rollout_ids)?;
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        let mut removal = Removal::default();
        for id in ids {
            let paths = self.paths(&id);
            let guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(&id);
            let mut had = remove_if_exists(&paths.log)?;
            had |= remove_if_exists(&paths.fence)?;
            let tokens = RolloutPaths::new(self.dir.path(), &id);
            let mut token_files = false;
            for path in [
                &tokens.log,
                &tokens.state,
                &tokens.state_tmp,
                &tokens.intents,
                &tokens.incomplete,
            ] {
                token_files |= exists(path)?;
            }
            if !token_files {
                // Unlinked while held: a waiter on the old inode notices and retries.
                remove_if_exists(&paths.lock)?;
            }
            drop(guard);
            removal.note(id, had);
        }
        // Always, even when nothing was found: an overlapping delete may not have synced yet.
        self.sync_dir()?;
        Ok(removal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lineage::HashedRequest;

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";
    const FP: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const CTX: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    fn record(call: &str, digest: &str, cum_len: u64) -> Value {
        serde_json::json!({
            "schema_version": 2, "digest_version": 2, "extras_digest_version": 1,
            "model_call_id": call, "response_id": format!("resp-{call}"),
            "parent_call_id": null, "mode": "text",
            "prev_len": 0, "delta_len": cum_len, "cum_len": cum_len,
            "digest": digest, "chain_hash": D2, "extras_digest": null,
            "continuation_fingerprint": FP, "continuation_context_len": 1,
            "continuation_context_digest": CTX,
        })
    }

    fn commit_line(rollout: &str, record: Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "kind": "commit", "record": record, "rollout_id": rollout,
            "schema_version": 2, "staging_chain": ["seg-a", "seg-b"],
        }))
        .unwrap()
    }

    fn request(digest: &str) -> HashedRequest {
        HashedRequest {
            fingerprint: FP.into(),
            len: 3,
            digests: HashMap::from([(1, digest.to_owned())]),
        }
    }

    #[test]
    fn records_are_written_once_and_resolve_without_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        let line = commit_line("r", record("c1", D1, 5));
        assert_eq!(ledger.record("r", &line).unwrap(), RecordOutcome::Appended);
        assert_eq!(ledger.record("r", &line).unwrap(), RecordOutcome::Duplicate);
        let other = commit_line("r", record("c1", D2, 5));
        assert!(matches!(
            ledger.record("r", &other),
            Err(LedgerError::Conflict { .. })
        ));
        let bytes = std::fs::read(dir.path().join("r.lineage.jsonl")).unwrap();
        assert_eq!(bytes, [&line[..], b"\n"].concat());

        // A second ledger (another process, in effect) sees it.
        let reader = Ledger::open(dir.path(), 4).unwrap();
        let step = reader.resolve("r", &mut request(CTX)).unwrap();
        let LedgerStep::Done(Resolution::Resolved(found)) = step else {
            panic!("{step:?}");
        };
        assert_eq!(found.model_call_id, "c1");
        assert_eq!(found.prev_len, 5);
        assert_eq!(found.chain_hash, D2);
        assert_eq!(found.staging_chain, ["seg-a", "seg-b"]);
        let wrong = reader.resolve("r", &mut request(D1)).unwrap();
        assert_eq!(wrong, LedgerStep::Done(Resolution::Unresolved("no_match")));
        let need = HashedRequest {
            fingerprint: FP.into(),
            len: 3,
            digests: HashMap::new(),
        };
        let step = reader.resolve("r", &mut { need }).unwrap();
        assert_eq!(step, LedgerStep::Missing(Missing::Need(vec![1])));
    }

    #[test]
    fn candidates_collapse_or_are_ambiguous() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        for call in ["c2", "c1"] {
            ledger
                .record("r", &commit_line("r", record(call, D1, 5)))
                .unwrap();
        }
        let step = ledger.resolve("r", &mut request(CTX)).unwrap();
        assert!(
            matches!(step, LedgerStep::Done(Resolution::Resolved(ref m)) if m.model_call_id == "c1")
        );
        ledger
            .record("r", &commit_line("r", record("c3", D2, 5)))
            .unwrap();
        let step = ledger.resolve("r", &mut request(CTX)).unwrap();
        assert_eq!(step, LedgerStep::Done(Resolution::Unresolved("ambiguous")));
        // A failure row takes its call out of resolution.
        ledger.record_failure("r", "c3", "boom").unwrap();
        let step = ledger.resolve("r", &mut request(CTX)).unwrap();
        assert!(matches!(step, LedgerStep::Done(Resolution::Resolved(_))));
    }

    #[test]
    fn poison_rows_are_failures_and_torn_lines_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.lineage.jsonl");
        let mut no_response = record("c1", D1, 5);
        no_response.as_object_mut().unwrap().remove("response_id");
        let mut no_chain = record("c2", D1, 5);
        no_chain["chain_hash"] = Value::Null;
        let mut bad_len = record("c3", D1, 5);
        bad_len["cum_len"] = 9.into();
        let mut bytes = Vec::new();
        for rec in [no_response, no_chain, bad_len, record("c4", D1, 5)] {
            bytes.extend(commit_line("r", rec));
            bytes.push(b'\n');
        }
        bytes.extend(b"{\"kind\":\"fail");
        std::fs::write(&path, &bytes).unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        let manifest = ledger.manifest("r").unwrap();
        assert_eq!(manifest.records.len(), 1);
        assert_eq!(
            manifest.failures,
            [
                ("c1".into(), MISSING_RESPONSE_ID_REASON.into()),
                ("c2".into(), MISSING_CHAIN_DIGEST_REASON.into()),
                ("c3".into(), INVALID_CALL_RECORD_REASON.into()),
            ]
        );
        // A write truncates the torn tail before appending.
        ledger.record_failure("r", "c5", "why").unwrap();
        let after = std::fs::read(&path).unwrap();
        assert!(after.ends_with(b"\"schema_version\":2}\n"));
        assert_eq!(
            after.len(),
            bytes.len() - 13 + failure_row("r", "c5", "why").len() + 1
        );

        std::fs::write(&path, b"not json\n").unwrap();
        let fresh = Ledger::open(dir.path(), 4).unwrap();
        assert!(matches!(
            fresh.manifest("r"),
            Err(LedgerError::Store(Error::Corrupt { offset: 0, .. }))
        ));
    }

    #[test]
    fn retire_fences_and_delete_clears() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        ledger
            .record("r", &commit_line("r", record("c1", D1, 5)))
            .unwrap();
        let removal = ledger.retire(&["r", "unused"]).unwrap();
        assert_eq!(removal.removed, ["r"]);
        assert_eq!(removal.absent, ["unused"]);
        assert!(matches!(ledger.has_rows("r"), Err(LedgerError::Retired(_))));
        assert_eq!(
            ledger.record_failure("r", "c2", "late").unwrap(),
            RecordOutcome::Discarded
        );
        assert!(!dir.path().join("r.lineage.jsonl").exists());
        let removal = ledger.delete(&["r", "unused", "never"]).unwrap();
        assert_eq!(removal.removed, ["r", "unused"]);
        assert_eq!(removal.absent, ["never"]);
        assert!(!ledger.has_rows("r").unwrap());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn bad_input_touches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        for (rollout, line) in [
            ("bad/id", commit_line("bad/id", record("c", D1, 5))),
            ("r", commit_line("other", record("c", D1, 5))),
            ("r", b"{\"kind\":\"commit\"}".to_vec()),
            ("r", commit_line("r", record("c", "", 5))),
            ("r", b"{}\n{}".to_vec()),
        ] {
            assert!(ledger.record(rollout, &line).is_err());
        }
        assert!(ledger.record_failure("r", "", "x").is_err());
        assert!(ledger.retire(&["ok", "bad id"]).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
