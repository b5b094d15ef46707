//! The capture ledger: token-free rows of calls whose token data a framework stages itself.
//!
//! # On-disk format
//!
//! Beside the token store's files, per rollout id `R`:
//!
//! | file | content |
//! | --- | --- |
//! | `R.lineage.jsonl` | one row per line, `\n`-terminated, in commit order |
//! | `R.lineage.retired` | the fence: an empty file whose existence means "retired" (ours only) |
//! | `R.tokens.lock` | the same `flock` target as the token store (writers exclusive, readers shared) |
//!
//! The rows are NeMo Gym 0.7.0's `FileLineageStore` rows, so both implementations share one
//! directory: JSON objects with sorted keys, `(",", ":")` separators and every non-ASCII or
//! control character `\u`-escaped (what Python's `json.dumps(row, sort_keys=True,
//! separators=(",", ":"))` writes; the binding builds commit rows with exactly that call).
//!
//! * commit row: `model_call_id`, `fingerprint`, `context_len`, `context_digest`, `digest`
//!   (the record's cumulative hash) and the record's custody columns (`staging_key`,
//!   `staging_digest`, `chain_hash`, ...);
//! * failure row: `{"failure_reason":T,"model_call_id":C}`.
//!
//! This module does not interpret custody columns: the manifest is built from the raw rows by
//! the binding, by NeMo Gym's rules. What it keeps per row is what the write rules and
//! resolution need: the call id, the failure pair, and the fingerprint.
//!
//! # Rules
//!
//! * **Write once, as NeMo Gym decides it.** A commit row is compared (by Python value equality:
//!   `1 == 1.0 == true`) with the *first* row of its call id: equal is a no-op, different is a
//!   [`LedgerError::Conflict`] and nothing is written (so a commit after a failure row of the
//!   same call conflicts, as in NeMo Gym). A failure row is a no-op when an identical failure
//!   row exists, and is appended otherwise (also after a commit of the same call).
//! * **Durable and visible before returning.** A row and its newline are written in one call
//!   and `fdatasync`ed; creating the ledger file also fsyncs the directory. Readers in any
//!   process fold the bytes past their cursor under the shared lock.
//! * **Torn and corrupt lines.** A final line without its newline was never acknowledged:
//!   readers ignore it and a writer truncates it before appending. Lines that are empty after
//!   stripping ASCII whitespace are skipped (as NeMo Gym does). Any other complete line that is
//!   not a JSON object with a `model_call_id` key, or that carries a `kind` key (the row format
//!   of tokencapture before it adopted NeMo Gym's), is [`Error::Corrupt`] with its offset. JSON
//!   here is what Python's `json.loads` reads: `NaN`, `Infinity` and escaped lone surrogates,
//!   which NeMo Gym's writer can emit, are read too ([`parse_stored_row`]).
//! * **Resolution candidates** are the rows whose `fingerprint` is the request's and whose
//!   `fingerprint_version` equals 2 (numerically): exactly one is a candidate, any other count
//!   is no candidate (NeMo Gym's rule; it never collapses or reports "ambiguous" here).
//! * **The fence.** `retire` first creates every missing `R.lineage.retired` and fsyncs it and
//!   the directory, then removes `R.lineage.jsonl` and fsyncs the directory again, so a removal
//!   can never be durable without its fence. A fenced rollout discards later rows (the write
//!   returns [`RecordOutcome::Discarded`]), reading it is [`LedgerError::Retired`], and it
//!   resolves nothing. `delete` removes the rows and the fence (and the lock file, when no
//!   token-store file of the rollout remains), then fsyncs the directory.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value};

use crate::descriptors::{self, FdCache, Kept};
use crate::error::{Error, IoContext};
use crate::lock::{LockMode, RolloutLock};
use crate::log::{append_line, complete_lines, complete_prefix_len};
use crate::store::{
    remove_if_exists, rollout_cache, validate_rollout_id, validate_rollout_ids, Removal,
    RolloutPaths, RootDir,
};

/// The fingerprint version whose rows can resolve (`tokencapture.fingerprint`'s).
pub const FINGERPRINT_VERSION: u64 = 2;
/// Default number of rollouts whose index a [`Ledger`] keeps (one descriptor each, within the
/// process's descriptor budget: see `descriptors`).
pub const DEFAULT_CACHED_ROLLOUTS: usize = 256;

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
    /// A commit row for a call id whose first row is a different one (NeMo Gym's wording
    /// first: callers match on it).
    #[error(
        "conflicting lineage record for model call {call_id}: model_call_id {call_id:?} of \
         rollout {rollout_id:?} is already recorded with a different row; ledger rows are \
         written once"
    )]
    Conflict { rollout_id: String, call_id: String },
}

pub type Result<T> = std::result::Result<T, LedgerError>;

fn invalid<T>(message: impl Into<String>) -> Result<T> {
    Err(Error::InvalidInput(message.into()).into())
}

// ---- rows ----------------------------------------------------------------------------------

/// One complete, non-blank row: its file offset, its bytes (ASCII whitespace stripped, as
/// NeMo Gym strips it) and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRow {
    pub offset: u64,
    pub line: Vec<u8>,
    pub value: Map<String, Value>,
}

impl StoredRow {
    fn get(&self, key: &str) -> Option<&Value> {
        self.value.get(key)
    }

    /// Not absent and not `null` (NeMo Gym's `row.get(key) is not None`).
    fn has(&self, key: &str) -> bool {
        !matches!(self.get(key), None | Some(Value::Null))
    }

    /// Whether NeMo Gym's manifest lists this row (as a failure or a committed record).
    pub fn in_manifest(&self) -> bool {
        self.has("failure_reason") || self.has("staging_key")
    }
}

/// Python's `bytes.strip()`: ASCII whitespace, including vertical tab and form feed.
pub fn strip_ascii_whitespace(line: &[u8]) -> &[u8] {
    let space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    let start = line.iter().position(|b| !space(b)).unwrap_or(line.len());
    let end = line
        .iter()
        .rposition(|b| !space(b))
        .map_or(start, |i| i + 1);
    &line[start..end]
}

/// Parse one stripped, non-empty line into a row value. The error is a plain description: the
/// caller adds the file and offset (a corrupt line) or refuses the write (invalid input).
pub fn parse_row(line: &[u8]) -> std::result::Result<Map<String, Value>, String> {
    let value: Value =
        serde_json::from_slice(line).map_err(|err| format!("not a JSON ledger row: {err}"))?;
    checked_row(value)
}

/// [`parse_row`] for a row read from the file: also what Python's `json.dumps` writes and
/// `json.loads` reads but JSON does not have, which NeMo Gym 0.7.0's writer emits for odd
/// `record_failure` arguments (a lone surrogate, `NaN`, `Infinity`, `-Infinity`). Such a token
/// is indexed as a marked string (see `python_json_tokens`); the row's bytes are kept, and
/// the binding reads those with Python's `json` module, as NeMo Gym does.
pub fn parse_stored_row(line: &[u8]) -> std::result::Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(line) {
        Ok(value) => checked_row(value),
        Err(err) => match python_json_tokens(line) {
            Some(rewritten) => parse_row(&rewritten),
            None => Err(format!("not a JSON ledger row: {err}")),
        },
    }
}

/// The marker that starts a rewritten token: NUL and U+FFFF (a noncharacter), as JSON escapes.
const MARK: &[u8] = b"\\u0000\\uffff";

fn hex_unit(line: &[u8], at: usize) -> Option<u32> {
    let digits = line.get(at..at + 4)?;
    let text = std::str::from_utf8(digits).ok()?;
    u32::from_str_radix(text, 16).ok()
}

/// `line` with every escaped lone surrogate (`\ud800`) turned into the string text
/// `MARK + "ud800"` and every `NaN`, `Infinity`, `-Infinity` outside a string into the string
/// `MARK + token`; None when there is no such token. A row that needed this is never equal to
/// a row we write (ours have none of these tokens), and its marked call id, which contains a
/// noncharacter, does not occur as a real one.
fn python_json_tokens(line: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(line.len() + 32);
    let mut changed = false;
    let mut in_string = false;
    let mut i = 0;
    'scan: while i < line.len() {
        let byte = line[i];
        if in_string {
            if byte == b'"' {
                in_string = false;
            } else if byte == b'\\' {
                if line.get(i + 1) == Some(&b'u') {
                    if let Some(unit) = hex_unit(line, i + 2) {
                        let paired = (0xD800..0xDC00).contains(&unit)
                            && line.get(i + 6..i + 8) == Some(b"\\u")
                            && hex_unit(line, i + 8)
                                .is_some_and(|low| (0xDC00..0xE000).contains(&low));
                        if paired {
                            out.extend_from_slice(&line[i..i + 12]);
                            i += 12;
                            continue;
                        }
                        if (0xD800..0xE000).contains(&unit) {
                            out.extend_from_slice(MARK);
                            out.extend_from_slice(&line[i + 1..i + 6]);
                            changed = true;
                            i += 6;
                            continue;
                        }
                    }
                }
                // Any other escape: the backslash and the byte it escapes.
                let end = (i + 2).min(line.len());
                out.extend_from_slice(&line[i..end]);
                i = end;
                continue;
            }
        } else if byte == b'"' {
            in_string = true;
        } else {
            for token in [&b"NaN"[..], b"Infinity", b"-Infinity"] {
                if line[i..].starts_with(token) {
                    out.push(b'"');
                    out.extend_from_slice(MARK);
                    out.extend_from_slice(token);
                    out.push(b'"');
                    changed = true;
                    i += token.len();
                    continue 'scan;
                }
            }
        }
        out.push(byte);
        i += 1;
    }
    changed.then_some(out)
}

fn checked_row(value: Value) -> std::result::Result<Map<String, Value>, String> {
    let Value::Object(row) = value else {
        return Err("a ledger row must be a JSON object".into());
    };
    if row.contains_key("kind") {
        return Err(
            "a row with a \"kind\" key is in tokencapture's pre-0.7-compatible ledger \
                    format, which is no longer read (delete the rollout, or rewrite its rows)"
                .into(),
        );
    }
    if !row.contains_key("model_call_id") {
        return Err("a ledger row must have a model_call_id".into());
    }
    Ok(row)
}

/// A JSON number or bool as Python compares it: ints exactly, floats as floats.
#[derive(Debug, Clone, Copy)]
enum PyNum {
    Int(i128),
    Float(f64),
}

fn py_num(value: &Value) -> Option<PyNum> {
    match value {
        Value::Bool(b) => Some(PyNum::Int(i128::from(*b))),
        Value::Number(n) => Some(if let Some(u) = n.as_u64() {
            PyNum::Int(i128::from(u))
        } else if let Some(i) = n.as_i64() {
            PyNum::Int(i128::from(i))
        } else {
            PyNum::Float(n.as_f64().unwrap_or(f64::NAN))
        }),
        _ => None,
    }
}

/// An integral double at or beyond 2^53, which may stand for several integers.
fn beyond_exact(f: f64) -> bool {
    f.fract() == 0.0 && f.abs() >= 9_007_199_254_740_992.0
}

fn int_eq_float(i: i128, f: f64) -> bool {
    // i128 -> f64 may round, so compare through the float only when it is integral and in
    // range, then exactly.
    f.is_finite() && f.fract() == 0.0 && f.abs() < 1.7e38 && (f as i128) == i
}

/// Python's `==` on two values parsed by `json.loads` (`1 == 1.0 == True`, dicts by keys).
///
/// One deliberate exception: two integral numbers at or beyond 2^53 both parsed as doubles are
/// unequal (they may be different integers); the caller compares the rows' bytes first.
pub fn py_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| py_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => py_eq_map(x, y),
        _ => match (py_num(a), py_num(b)) {
            (Some(PyNum::Int(x)), Some(PyNum::Int(y))) => x == y,
            // Without arbitrary precision, an integer beyond 64 bits parses as a double: two
            // such numbers may be different ints, so only identical bytes make them equal.
            (Some(PyNum::Float(x)), Some(PyNum::Float(y))) => x == y && !beyond_exact(x),
            (Some(PyNum::Int(i)), Some(PyNum::Float(f)))
            | (Some(PyNum::Float(f)), Some(PyNum::Int(i))) => int_eq_float(i, f),
            _ => false,
        },
    }
}

fn py_eq_map(x: &Map<String, Value>, y: &Map<String, Value>) -> bool {
    x.len() == y.len()
        && x.iter()
            .all(|(key, value)| y.get(key).is_some_and(|other| py_eq(value, other)))
}

/// Append `text` as a JSON string the way Python's `json.dumps` (with `ensure_ascii`) writes it.
pub fn push_py_json_str(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    for ch in text.chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            ' '..='~' => out.push(ch as u8),
            _ => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    out.extend_from_slice(format!("\\u{unit:04x}").as_bytes());
                }
            }
        }
    }
    out.push(b'"');
}

/// NeMo Gym's failure row, byte for byte: `{"failure_reason":T,"model_call_id":C}`.
pub fn failure_row(call_id: &str, reason: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(40 + call_id.len() + reason.len());
    out.extend_from_slice(b"{\"failure_reason\":");
    push_py_json_str(&mut out, reason);
    out.extend_from_slice(b",\"model_call_id\":");
    push_py_json_str(&mut out, call_id);
    out.push(b'}');
    out
}

// ---- the per-rollout index -----------------------------------------------------------------

/// One rollout's rows, folded in file order.
#[derive(Debug, Default)]
struct LedgerIndex {
    rows: Vec<StoredRow>,
    /// The first row of each string `model_call_id`.
    first_by_call: HashMap<String, usize>,
    /// Rows that are exactly `{"failure_reason": str, "model_call_id": str}`.
    failure_pairs: HashSet<(String, String)>,
    /// Rows with a string `fingerprint` and `fingerprint_version == 2`.
    by_fingerprint: HashMap<String, Vec<usize>>,
}

/// What a new row would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fold {
    New,
    Duplicate,
    Conflict,
}

fn failure_pair(row: &Map<String, Value>) -> Option<(String, String)> {
    if row.len() != 2 {
        return None;
    }
    match (row.get("model_call_id"), row.get("failure_reason")) {
        (Some(Value::String(call)), Some(Value::String(reason))) => {
            Some((call.clone(), reason.clone()))
        }
        _ => None,
    }
}

impl LedgerIndex {
    fn add(&mut self, row: StoredRow) {
        let at = self.rows.len();
        if let Some(Value::String(call_id)) = row.get("model_call_id") {
            self.first_by_call.entry(call_id.clone()).or_insert(at);
        }
        if let Some(pair) = failure_pair(&row.value) {
            self.failure_pairs.insert(pair);
        }
        let version_ok = row
            .get("fingerprint_version")
            .and_then(py_num)
            .is_some_and(|n| match n {
                PyNum::Int(i) => i == i128::from(FINGERPRINT_VERSION),
                PyNum::Float(f) => f == FINGERPRINT_VERSION as f64,
            });
        if let (Some(Value::String(fingerprint)), true) = (row.get("fingerprint"), version_ok) {
            self.by_fingerprint
                .entry(fingerprint.clone())
                .or_default()
                .push(at);
        }
        self.rows.push(row);
    }

    /// What appending a commit row (`failure` false) or failure row would do.
    fn check(&self, call_id: &str, line: &[u8], value: &Map<String, Value>, failure: bool) -> Fold {
        if failure {
            return match failure_pair(value) {
                Some(pair) if self.failure_pairs.contains(&pair) => Fold::Duplicate,
                _ => Fold::New,
            };
        }
        match self.first_by_call.get(call_id) {
            None => Fold::New,
            Some(&at) if self.rows[at].line == line || py_eq_map(&self.rows[at].value, value) => {
                Fold::Duplicate
            }
            Some(_) => Fold::Conflict,
        }
    }

    fn candidate(&self, fingerprint: &str) -> Option<&StoredRow> {
        match self.by_fingerprint.get(fingerprint).map(Vec::as_slice) {
            Some([only]) => Some(&self.rows[*only]),
            _ => None,
        }
    }
}

/// A row about to be appended.
#[derive(Debug)]
struct NewRow {
    call_id: String,
    value: Map<String, Value>,
    failure: bool,
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
    file: Kept<File>,
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
    rollouts: Arc<FdCache<Arc<Mutex<RolloutState>>>>,
}

impl Ledger {
    /// Open (creating if needed) the ledger directory.
    pub fn open(root: impl Into<PathBuf>, cached_rollouts: usize) -> crate::Result<Self> {
        Self::open_with(root, cached_rollouts, None)
    }

    /// [`Ledger::open`], keeping at most `max_open_files` descriptors between operations (if
    /// given; the process's descriptor budget applies either way).
    pub fn open_with(
        root: impl Into<PathBuf>,
        cached_rollouts: usize,
        max_open_files: Option<usize>,
    ) -> crate::Result<Self> {
        Ok(Ledger {
            dir: RootDir::open(root)?,
            rollouts: rollout_cache(cached_rollouts, max_open_files),
        })
    }

    /// Descriptors this ledger keeps (cached between operations, or in use now).
    pub fn open_files(&self) -> usize {
        self.rollouts.held()
    }

    /// This ledger's own cap on kept descriptors, `None` when only the process budget applies.
    pub fn max_open_files(&self) -> Option<usize> {
        self.rollouts.max_open()
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
        self.rollouts.clear();
    }

    pub fn cached_rollouts(&self) -> usize {
        self.rollouts.lock().len()
    }

    fn rollout(&self, rollout_id: &str) -> Arc<Mutex<RolloutState>> {
        let mut rollouts = self.rollouts.lock();
        if let Some(found) = rollouts.get(rollout_id) {
            return found.clone();
        }
        let fresh = Arc::new(Mutex::new(RolloutState::default()));
        rollouts.put(rollout_id.to_owned(), fresh.clone());
        fresh
    }

    fn forget(&self, rollout_id: &str) {
        let forgotten = self.rollouts.lock().pop(rollout_id);
        drop(forgotten); // closed outside the lock
    }

    /// Bring `state` up to date with the disk. Call under the rollout's flock.
    fn refresh(&self, state: &mut RolloutState, paths: &LedgerPaths) -> crate::Result<()> {
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
            let file = match descriptors::retry(|| File::open(&paths.log)) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(err) => return Err(err).ctx("open ledger", &paths.log),
            };
            let meta = file.metadata().ctx("stat ledger", &paths.log)?;
            state.log = Some(PinnedLog {
                file: self.rollouts.account().keep(file),
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
            let line = strip_ascii_whitespace(line);
            if line.is_empty() {
                continue;
            }
            let value = parse_stored_row(line)
                .map_err(|detail| Error::corrupt(&paths.log, offset, detail))?;
            state.index.add(StoredRow {
                offset,
                line: line.to_vec(),
                value,
            });
        }
        state.cursor = start + complete_prefix_len(&tail) as u64;
        Ok(())
    }

    /// Run `op` with the rollout refreshed under the shared lock (released before `op`).
    /// A rollout without any file is read as empty and nothing is created.
    fn read<T>(&self, rollout_id: &str, op: impl FnOnce(&RolloutState) -> T) -> crate::Result<T> {
        validate_rollout_id(rollout_id)?;
        let paths = self.paths(rollout_id);
        let permit = descriptors::enter();
        let rollout = self.rollout(rollout_id);
        let result = self.read_locked(&rollout, &paths, op);
        drop(permit);
        drop(rollout);
        self.rollouts.settle();
        result
    }

    fn read_locked<T>(
        &self,
        rollout: &Mutex<RolloutState>,
        paths: &LedgerPaths,
        op: impl FnOnce(&RolloutState) -> T,
    ) -> crate::Result<T> {
        let mut state = lock(rollout);
        {
            let mut guard = RolloutLock::acquire_if_exists(&paths.lock, LockMode::Shared)?;
            if guard.is_none() && (exists(&paths.log)? || exists(&paths.fence)?) {
                // Files without a lock file (an operator removed it): recreate it.
                guard = Some(RolloutLock::acquire(&paths.lock, LockMode::Shared)?);
            }
            if guard.is_none() {
                *state = RolloutState::default();
            } else if let Err(err) = self.refresh(&mut state, paths) {
                *state = RolloutState::default();
                return Err(err);
            }
        }
        Ok(op(&state))
    }

    /// Durably append one commit row of `rollout_id` (one line, built by the caller as NeMo
    /// Gym writes it: see the module docs).
    pub fn record(&self, rollout_id: &str, line: &[u8]) -> Result<RecordOutcome> {
        self.write(rollout_id, line, false)
    }

    fn write(&self, rollout_id: &str, line: &[u8], failure: bool) -> Result<RecordOutcome> {
        validate_rollout_id(rollout_id)?;
        if memchr::memchr2(b'\n', b'\r', line).is_some() {
            return invalid("a ledger row must be a single line");
        }
        if strip_ascii_whitespace(line).len() != line.len() {
            return invalid("a ledger row must not start or end with whitespace");
        }
        let value = match parse_row(line) {
            Ok(value) => value,
            Err(detail) => return invalid(format!("not a ledger row: {detail}")),
        };
        let call_id = match value.get("model_call_id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => return invalid("a ledger row's model_call_id must be a non-empty string"),
        };
        if failure != failure_pair(&value).is_some() {
            return invalid(if failure {
                "a failure row is exactly {\"failure_reason\": str, \"model_call_id\": str}"
            } else {
                "a commit row must not have the shape of a failure row"
            });
        }
        let paths = self.paths(rollout_id);
        let permit = descriptors::enter();
        let rollout = self.rollout(rollout_id);
        let new = NewRow {
            call_id,
            value,
            failure,
        };
        let result = (|| {
            let mut state = lock(&rollout);
            let _guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            let result = self.append(&mut state, &paths, rollout_id, new, line);
            if matches!(result, Err(LedgerError::Store(_))) {
                *state = RolloutState::default();
            }
            result
        })();
        drop(permit);
        drop(rollout);
        self.rollouts.settle();
        result
    }

    fn append(
        &self,
        state: &mut RolloutState,
        paths: &LedgerPaths,
        rollout_id: &str,
        row: NewRow,
        line: &[u8],
    ) -> Result<RecordOutcome> {
        self.refresh(state, paths)?;
        if state.fenced {
            return Ok(RecordOutcome::Discarded);
        }
        match state
            .index
            .check(&row.call_id, line, &row.value, row.failure)
        {
            Fold::Duplicate => return Ok(RecordOutcome::Duplicate),
            Fold::Conflict => {
                return Err(LedgerError::Conflict {
                    rollout_id: rollout_id.to_owned(),
                    call_id: row.call_id,
                })
            }
            Fold::New => {}
        }
        let mut created = false;
        match &mut state.log {
            Some(log) if log.writable => {}
            Some(log) => {
                // Under the exclusive lock the path still names the inode we pinned.
                let mut options = OpenOptions::new();
                options.read(true).append(true);
                let file = descriptors::retry(|| options.open(&paths.log))
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
                log.file = self.rollouts.account().keep(file);
                log.writable = true;
            }
            None => {
                let mut options = OpenOptions::new();
                options.read(true).append(true).create(true);
                let file = descriptors::retry(|| options.open(&paths.log))
                    .ctx("create ledger", &paths.log)?;
                let meta = file.metadata().ctx("stat ledger", &paths.log)?;
                state.cursor = 0;
                state.len = meta.len();
                state.log = Some(PinnedLog {
                    file: self.rollouts.account().keep(file),
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
        state.index.add(StoredRow {
            offset: before,
            line: line.to_vec(),
            value: row.value,
        });
        Ok(RecordOutcome::Appended)
    }

    /// Durably record that a call did not commit (NeMo Gym's failure row).
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
        self.write(rollout_id, &failure_row(call_id, reason), true)
    }

    /// Whether any row exists; a retired rollout is an error.
    pub fn has_rows(&self, rollout_id: &str) -> Result<bool> {
        let (fenced, any) = self.read(rollout_id, |state| {
            (state.fenced, !state.index.rows.is_empty())
        })?;
        if fenced {
            return Err(LedgerError::Retired(rollout_id.to_owned()));
        }
        Ok(any)
    }

    /// The rows NeMo Gym's manifest lists (a non-null `failure_reason` or `staging_key`), in
    /// file order, as `(offset, bytes)`; a retired rollout is an error.
    pub fn manifest_rows(&self, rollout_id: &str) -> Result<Vec<(u64, Vec<u8>)>> {
        let (fenced, rows) = self.read(rollout_id, |state| {
            let rows = state
                .index
                .rows
                .iter()
                .filter(|row| row.in_manifest())
                .map(|row| (row.offset, row.line.clone()))
                .collect();
            (state.fenced, rows)
        })?;
        if fenced {
            return Err(LedgerError::Retired(rollout_id.to_owned()));
        }
        Ok(rows)
    }

    /// The only row that can resolve a request of this (non-empty) fingerprint, as
    /// `(offset, bytes)`: None when no row or several rows carry it, or the rollout is retired.
    /// The caller verifies the row's context and builds the match.
    pub fn candidate(&self, rollout_id: &str, fingerprint: &str) -> Result<Option<(u64, Vec<u8>)>> {
        let found = self.read(rollout_id, |state| {
            state
                .index
                .candidate(fingerprint)
                .map(|row| (row.offset, row.line.clone()))
        })?;
        Ok(found)
    }

    /// Fence every rollout, then remove its rows (two phases, each ending in a directory
    /// fsync). Returns the ids that had a ledger and those that had none.
    pub fn retire<S: AsRef<str>>(&self, rollout_ids: &[S]) -> crate::Result<Removal> {
        let ids = validate_rollout_ids(rollout_ids)?;
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        let _permit = descriptors::enter();
        for id in &ids {
            let paths = self.paths(id);
            let _guard = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(id);
            if !exists(&paths.fence)? {
                let mut options = OpenOptions::new();
                options.write(true).create(true).truncate(false);
                let fence = descriptors::retry(|| options.open(&paths.fence))
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
        let _permit = descriptors::enter();
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

    #[test]
    fn rows_python_writes_beyond_json_are_read_with_marked_tokens() {
        // What `json.dumps` writes for a lone surrogate and non-finite floats (NeMo Gym's
        // `record_failure` with such arguments); a surrogate pair and escapes stay as they are.
        let line = br#"{"failure_reason":[NaN,-Infinity,Infinity,"\ud83d\ude00\"NaN\\"],"model_call_id":"c\udc00\ud800"}"#;
        assert!(parse_row(line).is_err());
        let row = parse_stored_row(line).unwrap();
        let mark = "\u{0}\u{ffff}";
        assert_eq!(
            row["failure_reason"],
            serde_json::json!([
                format!("{mark}NaN"),
                format!("{mark}-Infinity"),
                format!("{mark}Infinity"),
                "\u{1f600}\"NaN\\"
            ])
        );
        assert_eq!(row["model_call_id"], format!("c{mark}udc00{mark}ud800"));
        // Nothing to rewrite: the JSON error stands.
        assert!(parse_stored_row(br#"{"model_call_id":"c",}"#).is_err());
        assert!(parse_stored_row(br#"{"model_call_id":"c","x":nan}"#).is_err());
    }

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const FP: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    /// A commit row as NeMo Gym's `json.dumps(sort_keys=True, separators=(",", ":"))` writes it.
    fn commit_line(call: &str, fingerprint: &str, admitted_at: &str) -> Vec<u8> {
        format!(
            "{{\"admitted_at\":{admitted_at},\"chain_hash\":\"{D1}\",\"context_digest\":\"{D1}\",\
             \"context_len\":1,\"continuation_fingerprint\":null,\"cum_len\":5,\"cumulative_hash\":\
             \"{D1}\",\"delta_len\":5,\"digest\":\"{D1}\",\"extras_digest\":\"{D1}\",\
             \"fingerprint\":\"{fingerprint}\",\"fingerprint_version\":2,\"mode\":\"text\",\
             \"model_call_id\":\"{call}\",\"output_fingerprint\":null,\"parent_call_id\":null,\
             \"prev_len\":0,\"response_id\":\"resp-{call}\",\"staging_chain\":[\"seg\"],\
             \"staging_digest\":\"{D1}\",\"staging_key\":\"r/{call}\",\"weight_version\":0}}"
        )
        .into_bytes()
    }

    #[test]
    fn python_json_strings_and_equality() {
        let mut out = Vec::new();
        push_py_json_str(&mut out, "a\"\\\n\u{7f}é\u{1F600}\u{1}");
        assert_eq!(out, br#""a\"\\\n\u007f\u00e9\ud83d\ude00\u0001""#.to_vec());
        assert_eq!(
            failure_row("c", "why"),
            br#"{"failure_reason":"why","model_call_id":"c"}"#.to_vec()
        );
        let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert!(py_eq(
            &v("[1, true, 2.0, {\"a\": null}]"),
            &v("[1.0, 1, 2, {\"a\": null}]")
        ));
        assert!(!py_eq(&v("[1]"), &v("[1.5]")));
        assert!(!py_eq(&v("{\"a\": 1}"), &v("{\"a\": 1, \"b\": 1}")));
        assert!(!py_eq(&v("\"1\""), &v("1")));
        assert!(!py_eq(&v("null"), &v("0")));
        // Integers beyond 64 bits parse as doubles: never equal unless the bytes are.
        assert!(!py_eq(
            &v("1180591620717411303424"),
            &v("1180591620717411303425")
        ));
        assert!(py_eq(&v("4.5e15"), &v("4500000000000000")));
        assert_eq!(strip_ascii_whitespace(b" \x0b{}\x0c\r"), b"{}");
    }

    #[test]
    fn write_once_against_the_first_row_of_a_call() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        let line = commit_line("c1", FP, "1.5");
        assert_eq!(ledger.record("r", &line).unwrap(), RecordOutcome::Appended);
        assert_eq!(ledger.record("r", &line).unwrap(), RecordOutcome::Duplicate);
        // Equal by Python's `==` although the bytes differ: a no-op.
        let ints = commit_line("c1", FP, "1.50");
        assert_eq!(ledger.record("r", &ints).unwrap(), RecordOutcome::Duplicate);
        let other = commit_line("c1", FP, "2.5");
        assert!(matches!(
            ledger.record("r", &other),
            Err(LedgerError::Conflict { .. })
        ));
        // A failure row after a commit is appended; a commit after a failure row conflicts.
        assert_eq!(
            ledger.record_failure("r", "c1", "late").unwrap(),
            RecordOutcome::Appended
        );
        assert_eq!(
            ledger.record_failure("r", "c1", "late").unwrap(),
            RecordOutcome::Duplicate
        );
        ledger.record_failure("r", "c2", "boom").unwrap();
        assert!(matches!(
            ledger.record("r", &commit_line("c2", FP, "1.0")),
            Err(LedgerError::Conflict { .. })
        ));
        let bytes = std::fs::read(dir.path().join("r.lineage.jsonl")).unwrap();
        let expected = [
            &line[..],
            b"\n",
            &failure_row("c1", "late"),
            b"\n",
            &failure_row("c2", "boom"),
            b"\n",
        ]
        .concat();
        assert_eq!(bytes, expected);
        // Another instance (another process, in effect) reads the same rows.
        let reader = Ledger::open(dir.path(), 4).unwrap();
        let rows = reader.manifest_rows("r").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], (0, line.clone()));
        assert_eq!(reader.candidate("r", FP).unwrap(), Some((0, line)));
        assert_eq!(reader.candidate("r", D1).unwrap(), None);
        assert!(reader.has_rows("r").unwrap());
    }

    #[test]
    fn a_shared_fingerprint_is_no_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        ledger.record("r", &commit_line("c1", FP, "1.0")).unwrap();
        ledger.record("r", &commit_line("c2", FP, "1.0")).unwrap();
        assert_eq!(ledger.candidate("r", FP).unwrap(), None);
        // A row of another fingerprint version is not counted.
        let path = dir.path().join("s.lineage.jsonl");
        let old = String::from_utf8(commit_line("c1", FP, "1.0"))
            .unwrap()
            .replace("\"fingerprint_version\":2", "\"fingerprint_version\":1");
        let new = commit_line("c2", FP, "1.0");
        std::fs::write(&path, [old.as_bytes(), b"\n", &new, b"\n"].concat()).unwrap();
        let found = ledger.candidate("s", FP).unwrap().unwrap();
        assert_eq!(found.0, old.len() as u64 + 1);
    }

    #[test]
    fn blank_torn_and_corrupt_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.lineage.jsonl");
        let line = commit_line("c1", FP, "1.0");
        let mut bytes = b"  \n".to_vec();
        bytes.extend_from_slice(&line);
        bytes.extend_from_slice(b"\n{\"model_call_id\":\"lineage-only\"}\n{\"failure_re");
        std::fs::write(&path, &bytes).unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        let rows = ledger.manifest_rows("r").unwrap();
        assert_eq!(rows, [(3, line.clone())]);
        // A write truncates the torn tail before appending.
        ledger.record_failure("r", "c5", "why").unwrap();
        let after = std::fs::read(&path).unwrap();
        assert_eq!(
            after,
            [&bytes[..bytes.len() - 12], &failure_row("c5", "why"), b"\n"].concat()
        );
        for (junk, offset) in [
            (&b"not json\n"[..], 0),
            (b"{}\n[1]\n", 0),
            (b"\n{\"kind\":\"commit\",\"model_call_id\":\"c\"}\n", 1),
        ] {
            std::fs::write(&path, junk).unwrap();
            let fresh = Ledger::open(dir.path(), 4).unwrap();
            let err = fresh.manifest_rows("r").unwrap_err();
            assert!(
                matches!(err, LedgerError::Store(Error::Corrupt { offset: o, .. }) if o == offset),
                "{err}"
            );
        }
    }

    #[test]
    fn retire_fences_and_delete_clears() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path(), 4).unwrap();
        ledger.record("r", &commit_line("c1", FP, "1.0")).unwrap();
        let removal = ledger.retire(&["r", "unused"]).unwrap();
        assert_eq!(removal.removed, ["r"]);
        assert_eq!(removal.absent, ["unused"]);
        assert!(matches!(ledger.has_rows("r"), Err(LedgerError::Retired(_))));
        assert!(matches!(
            ledger.manifest_rows("r"),
            Err(LedgerError::Retired(_))
        ));
        assert_eq!(ledger.candidate("r", FP).unwrap(), None);
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
        let good = commit_line("c", FP, "1.0");
        for (rollout, line) in [
            ("bad/id", good.clone()),
            (
                "r",
                b"{\"kind\":\"commit\",\"model_call_id\":\"c\"}".to_vec(),
            ),
            ("r", b"{\"model_call_id\":5}".to_vec()),
            ("r", b"{\"model_call_id\":\"\"}".to_vec()),
            (
                "r",
                b"{\"failure_reason\":\"x\",\"model_call_id\":\"c\"}".to_vec(),
            ),
            ("r", b"{}\n{}".to_vec()),
            ("r", [b" ", &good[..]].concat()),
            ("r", b"[]".to_vec()),
        ] {
            assert!(ledger.record(rollout, &line).is_err());
        }
        assert!(ledger.record_failure("r", "", "x").is_err());
        assert!(ledger.record_failure("r", "c", "").is_err());
        assert!(ledger.retire(&["ok", "bad id"]).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
