//! Request-time lineage: which committed call does a new request continue?
//!
//! # The index
//!
//! Per rollout, an append-only, metadata-only index of committed entries: call id ->
//! (fingerprint, `continuation_context_len`, `continuation_context_digest`, `cum_len`,
//! `digest`, `parent_call_id`, `prompt_is_delta`, where its line is), and fingerprint -> call
//! ids. Only entries with `fingerprint_version == 2` and a non-empty fingerprint are
//! candidates; every entry is recorded, so a delta chain can pass through any of them.
//! Token arrays are never parsed to build the index: a structural scan finds the top-level
//! members and skips flat arrays with `memchr`.
//!
//! # Resolution (SPEC section 5)
//!
//! 1. The request's fingerprint; `""` is a root.
//! 2. Candidates: calls with that fingerprint whose context length fits the request and
//!    whose recorded context digest equals the digest of the request's prefix of that length
//!    (an empty recorded digest never matches). A call id committed with two different
//!    payloads counts as zero candidates.
//! 3. Several candidates that all share one non-empty `(digest, cum_len)` collapse to the
//!    smallest call id (identical retries); otherwise several is `ambiguous`, none is
//!    `no_match`. Never a guess.
//!
//! # Materialization
//!
//! Only the winner's tokens are built: walk `parent_call_id` through delta entries back to
//! the nearest full-prompt anchor (or to an ancestor whose verified tokens are cached),
//! concatenate prompt + generation of every link, and check the winner's recorded `cum_len`
//! and token digest. Only the token arrays of the links are read and parsed (8 bytes at a time
//! in the canonical form). A full-prompt winner whose parent's tokens are cached is first tried
//! as "the parent's tokens + the rest of its prompt": the ids the parent covers are counted,
//! not parsed, and the result is kept only if it has the winner's recorded digest. A
//! mismatch, a cycle, a missing parent or a malformed token array is a
//! [`LineageError::Integrity`]: never wrong tokens. Verified sequences are cached by their
//! digest under a token budget; a digest names its sequence, so the cache never goes stale
//! (a deleted and reused rollout id cannot alias it), and every answer is still checked
//! against the digest the winner records. The answer carries that recorded digest (`""` when
//! the winner records none, as NeMo Gym's resolvers answer), not the rebuilt tokens' digest.
//!
//! # Reading the store's files ([`FileLineage`])
//!
//! Incremental: each rollout keeps a cursor into `R.tokens.jsonl` and an open handle on it
//! (the handle pins the inode, so "the path still names the inode we hold" proves the file was
//! not replaced), and its lock file open, unlocked, between resolves (locked again through that
//! descriptor only when the path still names it, and only by the process that opened it). Every resolve checks the file: new bytes past the cursor are read under the
//! rollout's shared flock (so a put that failed and truncated its line is never observed),
//! complete lines are folded in, a torn final line is left for later. A megabyte or more of
//! new bytes is read through a memory map made and dropped under that lock (the private
//! `mapped` module), less with `pread`: the same bytes either way, folded by the same scanner.
//! Those bytes stay with the resolve that read them: a winner among the lines just folded in
//! (the usual case) takes its token arrays from them instead of reading them again, so a map
//! and the shared lock it needs are held until the winner's tokens are built and verified.
//! Nothing read is kept across resolves (a later resolve reads older lines from the file). A
//! replaced or deleted file, or one shorter than the cursor, resets the rollout's index.
//! Reading creates no file.

pub mod fingerprint;
pub mod verdict;

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::descriptors::{self, FdCache, Kept};
use crate::digest::token_digest;
use crate::error::{Error, IoContext};
use crate::lock::{FileId, LockFile, LockMode, RolloutLock};
use crate::log::complete_prefix_len;
use crate::store::{validate_rollout_id, RolloutPaths};

use fingerprint::{PrefixDigests, Unsupported};

/// Default number of rollouts whose index a [`FileLineage`] keeps (one descriptor each).
pub const DEFAULT_CACHED_ROLLOUTS: usize = 256;
/// Bytes of a log read at once when folding new lines into an index.
const READ_WINDOW: usize = 8 << 20;
/// New bytes from which a look maps the log instead of reading it: a map costs two system
/// calls and a fault per 64 KiB, a `pread` a copy of every byte (a put's few kilobytes are
/// cheaper read).
const MAP_AT_LEAST: u64 = 1 << 20;
/// Default token budget of the materialized-sequence cache.
pub const DEFAULT_CACHED_TOKENS: usize = 4_000_000;

/// A verified cumulative token sequence, shared by the cache and every answer that uses it.
pub type Tokens = Arc<Vec<u64>>;

/// What resolution can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LineageError {
    /// Reading the store failed (I/O, corruption, an invalid rollout id).
    #[error(transparent)]
    Store(#[from] Error),
    /// The winner's chain does not rebuild to its recorded tokens.
    #[error("{0}")]
    Integrity(String),
}

pub type Result<T> = std::result::Result<T, LineageError>;

fn integrity<T>(message: impl Into<String>) -> Result<T> {
    Err(LineageError::Integrity(message.into()))
}

// ---- line scanning -------------------------------------------------------------------------

/// The lineage metadata of one entry line; token arrays are located, not parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LineMeta {
    pub call_id: String,
    /// The continuation fingerprint, or "" unless `fingerprint_version == 2`.
    pub fingerprint: String,
    /// `continuation_context_len`; `None` when negative (such an entry never matches).
    pub context_len: Option<usize>,
    pub context_digest: String,
    pub cum_len: Option<i64>,
    /// The recorded token digest; an empty string reads as absent.
    pub digest: Option<String>,
    pub parent_call_id: Option<String>,
    pub prompt_is_delta: bool,
    /// Byte spans of the two token arrays within the line.
    pub prompt: Option<Range<usize>>,
    pub generation: Option<Range<usize>>,
}

impl LineMeta {
    fn indexed(&self) -> bool {
        !self.fingerprint.is_empty()
    }

    /// Roughly how many tokens the line holds (for memory budgets).
    fn token_count(&self, line: &[u8]) -> u64 {
        [&self.prompt, &self.generation]
            .into_iter()
            .flatten()
            .map(|span| {
                let array = &line[span.clone()];
                let commas = memchr::memchr_iter(b',', array).count() as u64;
                commas + u64::from(array.iter().any(u8::is_ascii_digit))
            })
            .sum()
    }
}

fn skip_ws(buf: &[u8], pos: usize) -> usize {
    skip_ws_in::<false>(buf, pos)
}

// The scanner's functions take `NL`: `false` scans one line (the bytes up to its newline);
// `true` scans from a line's start through the rest of a buffer, refusing at any newline, so
// that a scan that ends at a newline proves where the line ends without a separate pass for
// it (see `scan_next_line`).
const ERR_NEWLINE: &str = "a newline inside the value";

fn skip_ws_in<const NL: bool>(buf: &[u8], mut pos: usize) -> usize {
    while let Some(&byte) = buf.get(pos) {
        match byte {
            b' ' | b'\t' | b'\r' => pos += 1,
            b'\n' if !NL => pos += 1,
            _ => break,
        }
    }
    pos
}

/// End (exclusive) of the JSON string starting at `pos`.
fn skip_string<const NL: bool>(buf: &[u8], pos: usize) -> std::result::Result<usize, String> {
    let mut at = pos + 1;
    loop {
        let rest = &buf[at.min(buf.len())..];
        let found = if NL {
            memchr::memchr3(b'"', b'\\', b'\n', rest)
        } else {
            memchr::memchr2(b'"', b'\\', rest)
        };
        match found {
            None => return Err(format!("unterminated string at column {pos}")),
            Some(i) if buf[at + i] == b'"' => return Ok(at + i + 1),
            Some(i) if NL && (buf[at + i] == b'\n' || buf.get(at + i + 1) == Some(&b'\n')) => {
                return Err(ERR_NEWLINE.into())
            }
            Some(i) => at += i + 2,
        }
    }
}

const MAX_DEPTH: usize = 1024;

/// End (exclusive) of the value starting at `pos`.
fn skip_value<const NL: bool>(buf: &[u8], pos: usize) -> std::result::Result<usize, String> {
    match buf.get(pos) {
        Some(b'"') => skip_string::<NL>(buf, pos),
        Some(b'[') => {
            // Token arrays: a flat array (no brackets, braces or strings inside) ends at the
            // first ']'; anything else takes the bracket-matching walk.
            match first_structural::<NL>(&buf[pos + 1..]) {
                Some(at) if buf[pos + 1 + at] == b']' => Ok(pos + at + 2),
                _ => skip_container::<NL>(buf, pos),
            }
        }
        Some(b'{') => skip_container::<NL>(buf, pos),
        Some(_) => {
            let mut at = pos;
            while let Some(&byte) = buf.get(at) {
                match byte {
                    b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n' => break,
                    b'"' | b'[' | b'{' | b':' => {
                        return Err(format!("malformed value at column {at}"));
                    }
                    _ => at += 1,
                }
            }
            Ok(at)
        }
        None => Err(format!("missing value at column {pos}")),
    }
}

/// The position of the first `[`, `]`, `{`, `}` or `"` of `bytes` (or newline, with `NL`).
///
/// One pass where finding `]` and then checking the bytes before it for the other four took
/// three: the blocks are tested with a loop the compiler vectorizes (setting bit 5 maps `[`
/// and `]` onto `{` and `}`), and only the block holding a hit is searched byte by byte.
fn first_structural<const NL: bool>(bytes: &[u8]) -> Option<usize> {
    const BLOCK: usize = 64;
    let structural =
        |b: u8| (b | 0x20) == b'{' || (b | 0x20) == b'}' || b == b'"' || (NL && b == b'\n');
    let mut blocks = bytes.chunks_exact(BLOCK);
    let mut base = 0usize;
    for block in blocks.by_ref() {
        if block.iter().fold(false, |hit, &b| hit | structural(b)) {
            return block
                .iter()
                .position(|&b| structural(b))
                .map(|at| base + at);
        }
        base += BLOCK;
    }
    blocks
        .remainder()
        .iter()
        .position(|&b| structural(b))
        .map(|at| base + at)
}

fn skip_container<const NL: bool>(buf: &[u8], pos: usize) -> std::result::Result<usize, String> {
    let mut stack: Vec<u8> = Vec::new();
    let mut at = pos;
    loop {
        let Some(&byte) = buf.get(at) else {
            return Err(format!("unbalanced brackets from column {pos}"));
        };
        match byte {
            b'"' => {
                at = skip_string::<NL>(buf, at)?;
                continue;
            }
            b'\n' if NL => return Err(ERR_NEWLINE.into()),
            b'[' => stack.push(b']'),
            b'{' => stack.push(b'}'),
            b']' | b'}' => {
                if stack.pop() != Some(byte) {
                    return Err(format!("mismatched bracket at column {at}"));
                }
                if stack.is_empty() {
                    return Ok(at + 1);
                }
            }
            _ => {}
        }
        if stack.len() > MAX_DEPTH {
            return Err("nesting too deep".into());
        }
        at += 1;
    }
}

/// Visit the top-level members of a one-object line: `(raw key with quotes, value span)`.
///
/// Returns the line's length: `line.len()`, or with `NL` the position of the newline that
/// follows the object (and its trailing blanks).
fn members<const NL: bool>(
    line: &[u8],
    mut visit: impl FnMut(&[u8], Range<usize>),
) -> std::result::Result<usize, String> {
    let mut pos = skip_ws_in::<NL>(line, 0);
    if line.get(pos) != Some(&b'{') {
        return Err("not a JSON object".into());
    }
    pos = skip_ws_in::<NL>(line, pos + 1);
    if line.get(pos) == Some(&b'}') {
        pos += 1;
    } else {
        loop {
            if line.get(pos) != Some(&b'"') {
                return Err(format!("expected a key at column {pos}"));
            }
            let key_end = skip_string::<NL>(line, pos)?;
            let key = &line[pos..key_end];
            pos = skip_ws_in::<NL>(line, key_end);
            if line.get(pos) != Some(&b':') {
                return Err(format!("expected ':' at column {pos}"));
            }
            pos = skip_ws_in::<NL>(line, pos + 1);
            let value_end = skip_value::<NL>(line, pos)?;
            if value_end == pos {
                return Err(format!("missing value at column {pos}"));
            }
            visit(key, pos..value_end);
            pos = skip_ws_in::<NL>(line, value_end);
            match line.get(pos) {
                Some(b',') => pos = skip_ws_in::<NL>(line, pos + 1),
                Some(b'}') => {
                    pos += 1;
                    break;
                }
                _ => return Err(format!("expected ',' or '}}' at column {pos}")),
            }
        }
    }
    let end = skip_ws_in::<NL>(line, pos);
    if NL {
        return match line.get(end) {
            Some(b'\n') => Ok(end),
            _ => Err("no newline after the object".into()),
        };
    }
    if end != line.len() {
        return Err("trailing bytes after the object".into());
    }
    Ok(end)
}

fn field<T: DeserializeOwned>(
    line: &[u8],
    span: &Option<Range<usize>>,
    name: &str,
) -> std::result::Result<Option<T>, String> {
    match span {
        None => Ok(None),
        Some(span) => serde_json::from_slice::<Option<T>>(&line[span.clone()])
            .map_err(|err| format!("{name} has the wrong type: {err}")),
    }
}

/// Scan one entry line. The error is a plain description (the caller adds file and offset).
pub fn scan_line(line: &[u8]) -> std::result::Result<LineMeta, String> {
    scan_members::<false>(line).map(|(meta, _)| meta)
}

/// Scan the line that starts `rest` (which holds at least one newline): its length (without
/// the newline) and `scan_line`'s result for it.
///
/// One pass: the scan runs on from the line's start refusing any newline, so a scan that ends
/// at one has looked at every byte before it and found the line's end itself. Anything else
/// (a newline inside the object, any refusal) finds the newline and runs `scan_line`, whose
/// answer, error included, is the one returned.
fn scan_next_line(rest: &[u8]) -> (usize, std::result::Result<LineMeta, String>) {
    if let Ok((meta, len)) = scan_members::<true>(rest) {
        return (len, Ok(meta));
    }
    let len = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
    (len, scan_line(&rest[..len]))
}

/// A line's length and its scanned members (or why it is not an entry line).
type ScannedLine = (usize, std::result::Result<LineMeta, String>);

/// The lines of `complete` (complete lines, each ending in a newline), scanned in order.
struct LineScan<'a>(&'a [u8]);

impl Iterator for LineScan<'_> {
    type Item = ScannedLine;

    fn next(&mut self) -> Option<ScannedLine> {
        if self.0.is_empty() {
            return None;
        }
        let (len, meta) = scan_next_line(self.0);
        self.0 = self.0.get(len + 1..).unwrap_or_default();
        Some((len, meta))
    }
}

/// Chunks this long (a fresh resolver's first look at a long log) are scanned by two
/// threads; below it, a thread's start costs more than half the scan saves.
const SPLIT_SCAN_BYTES: usize = 4 << 20;

/// `scan_line` by the scanner in `NL` mode, with the line's length.
fn scan_members<const NL: bool>(line: &[u8]) -> std::result::Result<(LineMeta, usize), String> {
    #[derive(Default)]
    struct Spans {
        call_id: Option<Range<usize>>,
        version: Option<Range<usize>>,
        fingerprint: Option<Range<usize>>,
        context_len: Option<Range<usize>>,
        context_digest: Option<Range<usize>>,
        cum_len: Option<Range<usize>>,
        digest: Option<Range<usize>>,
        parent: Option<Range<usize>>,
        delta: Option<Range<usize>>,
        prompt: Option<Range<usize>>,
        generation: Option<Range<usize>>,
    }
    let mut spans = Spans::default();
    let len = members::<NL>(line, |key, span| {
        let slot = match key {
            b"\"model_call_id\"" => &mut spans.call_id,
            b"\"fingerprint_version\"" => &mut spans.version,
            b"\"continuation_fingerprint\"" => &mut spans.fingerprint,
            b"\"continuation_context_len\"" => &mut spans.context_len,
            b"\"continuation_context_digest\"" => &mut spans.context_digest,
            b"\"cum_len\"" => &mut spans.cum_len,
            b"\"digest\"" => &mut spans.digest,
            b"\"parent_call_id\"" => &mut spans.parent,
            b"\"prompt_is_delta\"" => &mut spans.delta,
            b"\"prompt_token_ids\"" => &mut spans.prompt,
            b"\"generation_token_ids\"" => &mut spans.generation,
            _ => return,
        };
        *slot = Some(span);
    })?;
    let line = &line[..len];
    let call_id: String = field(line, &spans.call_id, "model_call_id")?
        .ok_or_else(|| "no string model_call_id".to_string())?;
    let version: Option<i64> = field(line, &spans.version, "fingerprint_version")?;
    let fingerprint: String =
        field(line, &spans.fingerprint, "continuation_fingerprint")?.unwrap_or_default();
    let context_len: i64 =
        field(line, &spans.context_len, "continuation_context_len")?.unwrap_or_default();
    let meta = LineMeta {
        call_id,
        fingerprint: if version == Some(2) {
            fingerprint
        } else {
            String::new()
        },
        context_len: usize::try_from(context_len).ok(),
        context_digest: field(line, &spans.context_digest, "continuation_context_digest")?
            .unwrap_or_default(),
        cum_len: field(line, &spans.cum_len, "cum_len")?,
        digest: field::<String>(line, &spans.digest, "digest")?.filter(|d| !d.is_empty()),
        parent_call_id: field(line, &spans.parent, "parent_call_id")?,
        prompt_is_delta: field(line, &spans.delta, "prompt_is_delta")?.unwrap_or_default(),
        prompt: spans.prompt,
        generation: spans.generation,
    };
    Ok((meta, len))
}

/// Append the ids of a JSON array of non-negative integers to `out`.
///
/// One pass over the bytes with a small state machine; whitespace is allowed around numbers
/// and separators, as in any JSON. Refused: signs, fractions, exponents, leading zeros, ids
/// above 2**64-1, empty elements and anything after the closing bracket.
pub fn parse_token_array(bytes: &[u8], out: &mut Vec<u64>) -> std::result::Result<(), String> {
    let inner = array_inner(bytes).ok_or_else(|| "not an array of token ids".to_string())?;
    if skip_ws(inner, 0) == inner.len() {
        return Ok(()); // `[]`
    }
    parse_inner_ids(inner, out)
}

/// The bytes between the brackets of a JSON array (`None` if `bytes` is not one bracketed
/// value).
fn array_inner(bytes: &[u8]) -> Option<&[u8]> {
    let open = skip_ws(bytes, 0);
    if bytes.get(open) != Some(&b'[') {
        return None;
    }
    let close = bytes.iter().rposition(|&b| b == b']')?;
    if close < open || skip_ws(bytes, close + 1) != bytes.len() {
        return None;
    }
    Some(&bytes[open + 1..close])
}

/// Parse the non-empty comma-separated ids between the brackets of a token array.
fn parse_inner_ids(inner: &[u8], out: &mut Vec<u64>) -> std::result::Result<(), String> {
    let bad = |at: usize| Err(format!("not an array of token ids (column {})", at + 1));
    // About seven bytes per id in the canonical form.
    out.reserve(inner.len() / 7 + 1);
    let before = out.len();
    if parse_canonical_ids(inner, out) {
        return Ok(());
    }
    out.truncate(before);
    let mut value: u64 = 0;
    let mut digits = 0usize;
    let mut leading_zero = false;
    // After a number and some whitespace, only a separator may follow.
    let mut ended = false;
    for (at, &byte) in inner.iter().enumerate() {
        let digit = byte.wrapping_sub(b'0');
        if digit < 10 {
            if ended || leading_zero {
                return bad(at);
            }
            if digits == 0 && digit == 0 {
                leading_zero = true;
            }
            // Nineteen digits never overflow; the twentieth is checked.
            if digits < 19 {
                value = value * 10 + u64::from(digit);
            } else {
                value = match value
                    .checked_mul(10)
                    .and_then(|v| v.checked_add(u64::from(digit)))
                {
                    Some(v) => v,
                    None => return Err(format!("token id above 2**64-1 (column {at})")),
                };
            }
            digits += 1;
        } else if byte == b',' {
            if digits == 0 {
                return bad(at);
            }
            out.push(value);
            value = 0;
            digits = 0;
            leading_zero = false;
            ended = false;
        } else if matches!(byte, b' ' | b'\t' | b'\r' | b'\n') {
            ended = digits > 0;
        } else {
            return bad(at);
        }
    }
    if digits == 0 {
        return bad(inner.len());
    }
    out.push(value);
    Ok(())
}

/// The fast path of [`parse_token_array`] for the canonical form (`1,22,333` between the
/// brackets: no whitespace, ids below 10**8): eight bytes at a time, the digits of one id
/// combined with three multiplications (SWAR). Returns false at anything else, leaving the
/// general parser to decide (it accepts or refuses exactly the same arrays).
fn parse_canonical_ids(inner: &[u8], out: &mut Vec<u64>) -> bool {
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    let n = inner.len();
    let mut at = 0usize;
    while at < n {
        let chunk = match inner.get(at..at + 8) {
            Some(bytes) => u64::from_le_bytes(bytes.try_into().unwrap_or_default()),
            None => {
                let mut padded = [0u8; 8]; // NUL is not a digit: it ends the id
                padded[..n - at].copy_from_slice(&inner[at..]);
                u64::from_le_bytes(padded)
            }
        };
        // Byte k (the k-th character) becomes its digit value; any other byte gets its high
        // bit set by the addition (a carry only ever leaves a non-digit byte, so the lowest
        // flagged byte is exactly the first non-digit).
        let digits = chunk ^ ZEROS;
        let flagged = (digits.wrapping_add(0x7676_7676_7676_7676) | digits) & 0x8080_8080_8080_8080;
        let len = (flagged.trailing_zeros() / 8) as usize;
        if len == 0 || len == 8 || (len > 1 && inner[at] == b'0') {
            return false; // not an id here, eight or more digits, or a leading zero
        }
        // Right-align the `len` digits (leading positions become zeros), then combine pairs,
        // quads and octets.
        let mut value = digits << (8 * (8 - len));
        value = (value.wrapping_mul(10) + (value >> 8)) & 0x00ff_00ff_00ff_00ff;
        value = (value.wrapping_mul(100) + (value >> 16)) & 0x0000_ffff_0000_ffff;
        value = (value.wrapping_mul(10_000) + (value >> 32)) & 0x0000_0000_ffff_ffff;
        out.push(value);
        at += len;
        match inner.get(at) {
            None => return true,
            Some(b',') if at + 1 < n => at += 1,
            Some(_) => return false,
        }
    }
    false
}

// ---- the per-rollout index -----------------------------------------------------------------

/// Where an entry's line lives.
#[derive(Debug, Clone)]
enum Loc {
    File { offset: u64, len: usize },
    Memory(Arc<[u8]>),
}

#[derive(Debug)]
struct Call {
    meta: LineMeta,
    loc: Loc,
    /// Committed twice with different payloads: never a candidate.
    conflicted: bool,
}

/// What adding a line did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    New,
    Duplicate,
    Conflict,
}

/// One rollout's index.
#[derive(Debug, Default)]
struct RolloutIndex {
    calls: Vec<Call>,
    by_id: HashMap<String, usize>,
    by_fingerprint: HashMap<String, Vec<usize>>,
    tokens: u64,
}

/// The outcome of the candidate rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    NoMatch,
    Ambiguous,
    Winner(usize),
}

impl RolloutIndex {
    /// Add one committed line. `same_payload` compares its bytes with the earlier line of
    /// the same call id.
    fn add(
        &mut self,
        meta: LineMeta,
        loc: Loc,
        tokens: u64,
        same_payload: impl FnOnce(&Loc) -> Result<bool>,
    ) -> Result<Added> {
        if let Some(&known) = self.by_id.get(&meta.call_id) {
            if same_payload(&self.calls[known].loc)? {
                return Ok(Added::Duplicate);
            }
            self.calls[known].conflicted = true;
            return Ok(Added::Conflict);
        }
        let index = self.calls.len();
        self.by_id.insert(meta.call_id.clone(), index);
        if meta.indexed() {
            self.by_fingerprint
                .entry(meta.fingerprint.clone())
                .or_default()
                .push(index);
        }
        self.tokens += tokens;
        self.calls.push(Call {
            meta,
            loc,
            conflicted: false,
        });
        Ok(Added::New)
    }

    fn decide(
        &self,
        fingerprint: &str,
        request: &mut dyn Request,
    ) -> std::result::Result<Decision, Missing> {
        let Some(ids) = self.by_fingerprint.get(fingerprint) else {
            return Ok(Decision::NoMatch);
        };
        let n = request.len();
        let fits: Vec<usize> = ids
            .iter()
            .copied()
            .filter(|&i| {
                let call = &self.calls[i];
                !call.conflicted
                    && !call.meta.context_digest.is_empty()
                    && call.meta.context_len.is_some_and(|k| k <= n)
            })
            .collect();
        if fits.is_empty() {
            return Ok(Decision::NoMatch);
        }
        let mut lens: Vec<usize> = fits
            .iter()
            .filter_map(|&i| self.calls[i].meta.context_len)
            .collect();
        lens.sort_unstable();
        lens.dedup();
        let digests = request.context_digests(&lens)?;
        let candidates: Vec<&Call> = fits
            .iter()
            .map(|&i| &self.calls[i])
            .filter(|call| {
                let k = call.meta.context_len.unwrap_or_default();
                lens.binary_search(&k)
                    .is_ok_and(|at| digests[at] == call.meta.context_digest)
            })
            .collect();
        let Some(first) = candidates.first() else {
            return Ok(Decision::NoMatch);
        };
        let shared = first.meta.digest.is_some()
            && candidates.iter().all(|call| {
                call.meta.digest == first.meta.digest && call.meta.cum_len == first.meta.cum_len
            });
        if candidates.len() > 1 && !shared {
            return Ok(Decision::Ambiguous);
        }
        let winner = candidates
            .iter()
            .min_by(|a, b| a.meta.call_id.cmp(&b.meta.call_id))
            .map(|call| call.meta.call_id.as_str())
            .unwrap_or_default();
        Ok(Decision::Winner(self.by_id[winner]))
    }
}

// ---- requests ------------------------------------------------------------------------------

/// Why a request cannot be decided by the native code alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Missing {
    /// The Rust port of the hashes declined: compute them in Python.
    Fallback,
    /// These prefix lengths need their conversation digest.
    Need(Vec<usize>),
}

impl From<Unsupported> for Missing {
    fn from(_: Unsupported) -> Self {
        Missing::Fallback
    }
}

/// The hashes of one request, computed on demand.
pub trait Request {
    /// The request's assistant fingerprint.
    fn fingerprint(&mut self) -> std::result::Result<String, Missing>;
    /// Number of request items.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `conversation_digest(items[:k])` for each `k` of `lens` (ascending, distinct).
    fn context_digests(&mut self, lens: &[usize]) -> std::result::Result<Vec<String>, Missing>;
}

/// Request items as JSON values; the hashes are computed by the Rust port.
pub struct ItemsRequest {
    items: Vec<Value>,
    prefix: PrefixDigests,
    /// The fingerprint, once computed: a request fingerprinted when a resolve is called (so a
    /// refused request is refused then) is not hashed again when it is resolved.
    fingerprint: Option<String>,
}

impl ItemsRequest {
    pub fn new(items: Vec<Value>) -> Self {
        ItemsRequest {
            items,
            prefix: PrefixDigests::new(),
            fingerprint: None,
        }
    }
}

impl Request for ItemsRequest {
    fn fingerprint(&mut self) -> std::result::Result<String, Missing> {
        if let Some(fingerprint) = &self.fingerprint {
            return Ok(fingerprint.clone());
        }
        let fingerprint = fingerprint::assistant_fingerprint(&self.items)?;
        self.fingerprint = Some(fingerprint.clone());
        Ok(fingerprint)
    }

    fn len(&self) -> usize {
        self.items.len()
    }

    fn context_digests(&mut self, lens: &[usize]) -> std::result::Result<Vec<String>, Missing> {
        lens.iter()
            .map(|&k| self.prefix.digest_of(&self.items, k).map_err(Missing::from))
            .collect()
    }
}

/// A request whose hashes the caller computed (the Python fallback).
pub struct HashedRequest {
    pub fingerprint: String,
    pub len: usize,
    pub digests: HashMap<usize, String>,
}

impl Request for HashedRequest {
    fn fingerprint(&mut self) -> std::result::Result<String, Missing> {
        Ok(self.fingerprint.clone())
    }

    fn len(&self) -> usize {
        self.len
    }

    fn context_digests(&mut self, lens: &[usize]) -> std::result::Result<Vec<String>, Missing> {
        let missing: Vec<usize> = lens
            .iter()
            .copied()
            .filter(|k| !self.digests.contains_key(k))
            .collect();
        if !missing.is_empty() {
            return Err(Missing::Need(missing));
        }
        Ok(lens.iter().map(|k| self.digests[k].clone()).collect())
    }
}

/// A request-time decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Root,
    Resolved {
        call_id: String,
        tokens: Tokens,
        /// The digest the winner records, `""` when it records none.
        digest: String,
        /// The cached sequence `tokens` was built by extending, if any (not part of the value).
        base: Base,
        /// Set only by [`FileLineage::resolve_unverified`]: the digest `tokens` must still be
        /// checked against ([`FileLineage::verify`]) before they may be handed back.
        unverified: Unverified,
    },
    Unresolved {
        reason: &'static str,
    },
}

/// The verified sequence an answer's tokens were built from by appending ids: its ids are
/// exactly the answer's first ones, by construction, so a caller holding the same allocation
/// (`Arc::ptr_eq`) knows the answer extends it without comparing them. Only a hint: it takes
/// no part in an outcome's equality.
#[derive(Clone, Default)]
pub struct Base(pub Option<Tokens>);

impl Base {
    /// Whether the answer was built by extending exactly `tokens` (the same allocation).
    pub fn is(&self, tokens: &Tokens) -> bool {
        self.0
            .as_ref()
            .is_some_and(|base| Arc::ptr_eq(base, tokens))
    }
}

impl PartialEq for Base {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Base {}

impl std::fmt::Debug for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Some(_) => "Base(Some(..))",
            None => "Base(None)",
        })
    }
}

/// The recorded digest an answer's tokens have not been checked against yet (see
/// [`FileLineage::resolve_unverified`]); `None` when they were (every other resolve). Not part
/// of an outcome's equality.
#[derive(Clone, Default)]
pub struct Unverified(pub Option<String>);

impl PartialEq for Unverified {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Unverified {}

impl std::fmt::Debug for Unverified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Unverified({:?})", self.0)
    }
}

pub const REASON_NO_MATCH: &str = "no_match";
pub const REASON_AMBIGUOUS: &str = "ambiguous";

/// Either a decision or what the caller must supply first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Done(Outcome),
    Missing(Missing),
}

// ---- the materialized-sequence cache --------------------------------------------------------

struct CacheInner {
    lru: LruCache<String, Tokens>,
    tokens: usize,
}

/// Verified cumulative sequences by token digest, bounded by their total length.
pub struct TokenCache {
    inner: Mutex<CacheInner>,
    budget: usize,
}

impl TokenCache {
    pub fn new(budget: usize) -> Self {
        TokenCache {
            inner: Mutex::new(CacheInner {
                lru: LruCache::unbounded(),
                tokens: 0,
            }),
            budget,
        }
    }

    fn lock(&self) -> MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether no thread holds the cache now (it never waits; see [`MemoryLineage::idle`]).
    fn idle(&self) -> bool {
        !matches!(
            self.inner.try_lock(),
            Err(std::sync::TryLockError::WouldBlock)
        )
    }

    fn get(&self, digest: &str) -> Option<Tokens> {
        self.lock().lru.get(digest).cloned()
    }

    fn insert(&self, digest: String, tokens: Tokens) {
        if tokens.len() > self.budget {
            return;
        }
        let mut inner = self.lock();
        if inner.lru.contains(&digest) {
            return;
        }
        inner.tokens += tokens.len();
        inner.lru.put(digest, tokens);
        while inner.tokens > self.budget {
            match inner.lru.pop_lru() {
                Some((_, evicted)) => inner.tokens -= evicted.len(),
                None => break,
            }
        }
    }

    /// Tokens currently cached.
    pub fn tokens(&self) -> usize {
        self.lock().tokens
    }

    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.lru.clear();
        inner.tokens = 0;
    }
}

/// Reads the bytes of a span of a call's line.
trait Lines {
    /// The bytes of `span` of the line at `loc`; a file is read into `scratch`.
    fn span<'a>(
        &'a self,
        loc: &'a Loc,
        span: Range<usize>,
        scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8]>;
}

/// Largest read buffer a thread keeps between materializations.
const MAX_SCRATCH: usize = 1 << 20;

thread_local! {
    /// A read buffer reused across materializations, so reading a long prompt costs neither an
    /// allocation nor fresh zeroed pages each time.
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Run `f` with this thread's read buffer.
fn with_scratch<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    let mut scratch = SCRATCH.take();
    let result = f(&mut scratch);
    if scratch.capacity() <= MAX_SCRATCH {
        SCRATCH.set(scratch);
    }
    result
}

/// Lines held in memory.
struct MemoryLines;

impl Lines for MemoryLines {
    fn span<'a>(
        &'a self,
        loc: &'a Loc,
        span: Range<usize>,
        _scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8]> {
        match loc {
            Loc::Memory(line) => Ok(&line[span]),
            Loc::File { .. } => integrity("a file line in an in-memory index"),
        }
    }
}

/// Lines of one pinned log file, and the bytes this resolve's look read from it.
struct FileLines<'f> {
    file: &'f File,
    path: &'f std::path::Path,
    recent: &'f Recent,
}

/// The bytes a look read (or mapped) from a log, kept for the rest of that one resolve: the
/// winner is usually a line the look just folded in, whose token arrays are then taken from
/// these bytes instead of being read again. They are the bytes the index was built from, read
/// under the rollout's shared lock in this same resolve; nothing is kept across resolves.
enum Recent {
    Nothing,
    /// `buf[..len]` holds the log's bytes from `start`.
    Read {
        start: u64,
        buf: Vec<u8>,
        len: usize,
    },
    /// A map of the log from `start`, and the shared lock it was made under (see
    /// `crate::mapped`: the lock must outlive the map, and fields drop in declaration order).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    Mapped {
        start: u64,
        map: crate::mapped::Mapped,
        _guard: RolloutLock,
    },
}

impl Recent {
    /// The `len` bytes at `offset` of the log, if this look read them.
    fn bytes_at(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let (start, bytes) = match self {
            Recent::Nothing => return None,
            Recent::Read { start, buf, len } => (*start, &buf[..*len]),
            #[cfg(any(target_os = "linux", target_os = "android"))]
            Recent::Mapped { start, map, .. } => (*start, map.bytes()),
        };
        let from = usize::try_from(offset.checked_sub(start)?).ok()?;
        bytes.get(from..from.checked_add(len)?)
    }
}

impl Lines for FileLines<'_> {
    fn span<'a>(
        &'a self,
        loc: &'a Loc,
        span: Range<usize>,
        scratch: &'a mut Vec<u8>,
    ) -> Result<&'a [u8]> {
        match loc {
            Loc::File { offset, len } => {
                if span.end > *len {
                    return integrity("a token span past the end of its line");
                }
                let n = span.len();
                if let Some(bytes) = self.recent.bytes_at(offset + span.start as u64, n) {
                    return Ok(bytes);
                }
                if scratch.len() < n {
                    scratch.resize(n, 0);
                }
                self.file
                    .read_exact_at(&mut scratch[..n], offset + span.start as u64)
                    .ctx("read log", self.path)?;
                Ok(&scratch[..n])
            }
            Loc::Memory(line) => Ok(&line[span]),
        }
    }
}

fn append_link_tokens(
    call: &Call,
    lines: &dyn Lines,
    rollout_id: &str,
    out: &mut Vec<u64>,
) -> Result<()> {
    for (name, span) in [
        ("prompt_token_ids", &call.meta.prompt),
        ("generation_token_ids", &call.meta.generation),
    ] {
        let Some(span) = span else {
            return integrity(format!(
                "entry {:?} of rollout {rollout_id:?} has no {name}",
                call.meta.call_id
            ));
        };
        let bytes = with_scratch(|scratch| -> Result<_> {
            let bytes = lines.span(&call.loc, span.clone(), scratch)?;
            Ok(parse_token_array(bytes, out))
        })?;
        bytes.map_err(|err| {
            LineageError::Integrity(format!(
                "{name} of entry {:?} of rollout {rollout_id:?}: {err}",
                call.meta.call_id
            ))
        })?;
    }
    Ok(())
}

fn cached_fits(call: &Call, tokens: &[u64]) -> bool {
    call.meta
        .cum_len
        .is_none_or(|len| usize::try_from(len).is_ok_and(|len| len == tokens.len()))
}

/// The common case of a full-prompt winner, whose prompt is its parent's cumulative tokens
/// plus the new turn: when the parent's verified tokens are cached, skip that many ids of the
/// prompt (counting separators instead of parsing) and parse only the rest. The result is
/// used only if it has the winner's recorded length and digest, which proves it is exactly the
/// winner's tokens; otherwise (`None`) the caller parses everything.
fn extend_cached_parent(
    index: &RolloutIndex,
    top: &Call,
    lines: &dyn Lines,
    cache: &TokenCache,
    digest: &str,
    defer: bool,
) -> Result<Option<(Vec<u64>, Tokens)>> {
    let parent = top
        .meta
        .parent_call_id
        .as_deref()
        .and_then(|id| index.by_id.get(id))
        .and_then(|&i| index.calls[i].meta.digest.as_deref())
        .and_then(|parent_digest| cache.get(parent_digest));
    let (Some(parent), false, Some(prompt), Some(generation)) = (
        parent,
        top.meta.prompt_is_delta,
        &top.meta.prompt,
        &top.meta.generation,
    ) else {
        return Ok(None);
    };
    let skip = parent.len();
    let capacity = top.meta.cum_len.and_then(|n| usize::try_from(n).ok());
    let mut tokens = Vec::with_capacity(capacity.unwrap_or(skip));
    tokens.extend_from_slice(&parent);
    let parsed = with_scratch(|scratch| -> Result<bool> {
        let bytes = lines.span(&top.loc, prompt.clone(), scratch)?;
        let Some(inner) = array_inner(bytes) else {
            return Ok(false);
        };
        let rest = if skip == 0 {
            inner
        } else {
            match nth_comma(inner, skip - 1) {
                Ok(comma) => &inner[comma + 1..],
                // Exactly `skip` ids (fewer separators than that otherwise): nothing new.
                Err(commas) if commas == skip - 1 && skip_ws(inner, 0) < inner.len() => {
                    &inner[inner.len()..]
                }
                Err(_) => return Ok(false),
            }
        };
        if !rest.is_empty() && parse_inner_ids(rest, &mut tokens).is_err() {
            return Ok(false);
        }
        let bytes = lines.span(&top.loc, generation.clone(), scratch)?;
        Ok(parse_token_array(bytes, &mut tokens).is_ok())
    })?;
    if !parsed {
        return Ok(None);
    }
    let fits = capacity.is_none_or(|n| n == tokens.len());
    // Deferred: the caller checks the digest before the tokens leave (see `Unverified`).
    Ok((fits && (defer || token_digest(&tokens) == digest)).then_some((tokens, parent)))
}

/// The position of the `n`-th comma (from 0) of `bytes`, or how many commas there are.
///
/// Separators are every few bytes in a token array, so counting them a block at a time (a
/// loop the compiler vectorizes) beats finding them one by one.
fn nth_comma(bytes: &[u8], n: usize) -> std::result::Result<usize, usize> {
    const BLOCK: usize = 512;
    let mut seen = 0usize;
    for (index, block) in bytes.chunks(BLOCK).enumerate() {
        let commas = count_commas(block);
        if seen + commas > n {
            let mut left = n - seen;
            for (at, &byte) in block.iter().enumerate() {
                if byte == b',' {
                    if left == 0 {
                        return Ok(index * BLOCK + at);
                    }
                    left -= 1;
                }
            }
        }
        seen += commas;
    }
    Err(seen)
}

/// The commas in `bytes`, counted in byte-wide counters over runs of at most 255 bytes: the
/// compiler then compares and adds 16 bytes per instruction, where a `usize` count widens every
/// byte first (measured ~15x faster on a 94 KB array of token ids: 2.0 against 31.8 us).
fn count_commas(bytes: &[u8]) -> usize {
    bytes
        .chunks(255)
        .map(|run| {
            let commas = run.iter().fold(0u8, |count, &byte| {
                count.wrapping_add(u8::from(byte == b','))
            });
            usize::from(commas)
        })
        .sum()
}

/// Build and verify the winner's cumulative tokens.
fn materialize(
    index: &RolloutIndex,
    winner: usize,
    lines: &dyn Lines,
    cache: &TokenCache,
    rollout_id: &str,
    defer: bool,
) -> Result<(Tokens, String, Base, Unverified)> {
    let top = &index.calls[winner];
    let recorded = top.meta.digest.clone();
    if let Some(digest) = &recorded {
        if let Some(tokens) = cache.get(digest).filter(|t| cached_fits(top, t)) {
            return Ok((tokens, digest.clone(), Base(None), Unverified(None)));
        }
        if let Some((tokens, parent)) =
            extend_cached_parent(index, top, lines, cache, digest, defer)?
        {
            let tokens = Arc::new(tokens);
            if defer {
                // Cached by `FileLineage::verify` once the digest is checked.
                let unverified = Unverified(Some(digest.clone()));
                return Ok((tokens, digest.clone(), Base(Some(parent)), unverified));
            }
            cache.insert(digest.clone(), tokens.clone());
            return Ok((tokens, digest.clone(), Base(Some(parent)), Unverified(None)));
        }
    }
    let mut chain = vec![winner];
    let mut visited = HashSet::from([winner]);
    let mut base: Option<Tokens> = None;
    let mut current = winner;
    while index.calls[current].meta.prompt_is_delta {
        let call = &index.calls[current];
        let Some(parent_id) = call.meta.parent_call_id.as_deref() else {
            return integrity(format!(
                "delta entry {:?} of rollout {rollout_id:?} has no parent_call_id",
                call.meta.call_id
            ));
        };
        let Some(&parent) = index.by_id.get(parent_id) else {
            return integrity(format!(
                "parent {parent_id:?} of delta entry {:?} is not in rollout {rollout_id:?}",
                call.meta.call_id
            ));
        };
        if !visited.insert(parent) {
            return integrity(format!(
                "the parent chain of {:?} in rollout {rollout_id:?} has a cycle through {parent_id:?}",
                top.meta.call_id
            ));
        }
        let parent_call = &index.calls[parent];
        if let Some(digest) = &parent_call.meta.digest {
            if let Some(tokens) = cache.get(digest).filter(|t| cached_fits(parent_call, t)) {
                base = Some(tokens);
                break;
            }
        }
        chain.push(parent);
        current = parent;
    }
    let capacity = top
        .meta
        .cum_len
        .and_then(|len| usize::try_from(len).ok())
        .unwrap_or_default();
    let mut tokens: Vec<u64> = Vec::with_capacity(capacity);
    if let Some(base) = &base {
        tokens.extend_from_slice(base);
    }
    for &link in chain.iter().rev() {
        append_link_tokens(&index.calls[link], lines, rollout_id, &mut tokens)?;
    }
    if let Some(len) = top.meta.cum_len {
        if usize::try_from(len).ok() != Some(tokens.len()) {
            return integrity(format!(
                "entry {:?} of rollout {rollout_id:?} records cum_len {len} but its chain \
                 rebuilds {} tokens",
                top.meta.call_id,
                tokens.len()
            ));
        }
    }
    let computed = token_digest(&tokens);
    if let Some(digest) = &recorded {
        if *digest != computed {
            return integrity(format!(
                "entry {:?} of rollout {rollout_id:?} records digest {digest} but its chain \
                 rebuilds tokens with digest {computed}",
                top.meta.call_id
            ));
        }
    }
    let tokens: Tokens = Arc::new(tokens);
    cache.insert(computed, tokens.clone());
    // The match carries the digest the entry records, "" when it records none (as NeMo Gym's
    // resolvers answer); the computed one only keys the cache.
    Ok((
        tokens,
        recorded.unwrap_or_default(),
        Base(base),
        Unverified(None),
    ))
}

/// Run the rules on an up-to-date index and materialize the winner.
fn resolve_in(
    index: &RolloutIndex,
    fingerprint: &str,
    request: &mut dyn Request,
    lines: &dyn Lines,
    cache: &TokenCache,
    rollout_id: &str,
    defer: bool,
) -> Result<Step> {
    let decision = match index.decide(fingerprint, request) {
        Ok(decision) => decision,
        Err(missing) => return Ok(Step::Missing(missing)),
    };
    Ok(Step::Done(match decision {
        Decision::NoMatch => Outcome::Unresolved {
            reason: REASON_NO_MATCH,
        },
        Decision::Ambiguous => Outcome::Unresolved {
            reason: REASON_AMBIGUOUS,
        },
        Decision::Winner(winner) => {
            let (tokens, digest, base, unverified) =
                materialize(index, winner, lines, cache, rollout_id, defer)?;
            Outcome::Resolved {
                call_id: index.calls[winner].meta.call_id.clone(),
                tokens,
                digest,
                base,
                unverified,
            }
        }
    }))
}

/// The request's fingerprint, or the step that says what is missing / that it is a root.
fn request_fingerprint(request: &mut dyn Request) -> std::result::Result<String, Step> {
    match request.fingerprint() {
        Ok(fp) if fp.is_empty() => Err(Step::Done(Outcome::Root)),
        Ok(fp) => Ok(fp),
        Err(missing) => Err(Step::Missing(missing)),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Entries are updated in place only by infallible steps or before being published, so a
    // poisoned guard still holds a consistent index.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn capacity(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n.max(1)).unwrap_or(NonZeroUsize::MIN)
}

/// An empty LRU of at most `n` (at least one) entries that allocates as it fills
/// (`LruCache::new` allocates for all `n` at once).
fn lru_of<K: std::hash::Hash + Eq, V>(n: usize) -> LruCache<K, V> {
    let mut lru = LruCache::unbounded();
    lru.resize(capacity(n));
    lru
}

// ---- the file-backed resolver ---------------------------------------------------------------

#[derive(Debug)]
struct PinnedLog {
    file: Kept<File>,
    dev: u64,
    ino: u64,
}

/// A rollout's lock file, kept open (unlocked) between resolves: opening it by name cost an
/// `open`, an `fstat` and a `close` on every resolve. Counted against the descriptor budget
/// like the log handle; used only by the thread holding the rollout's mutex, and only by the
/// process that opened it (`pid`): a forked child never locks a descriptor it inherited,
/// whose flock would be the parent's too.
#[derive(Debug)]
struct KeptLock {
    file: Kept<LockFile>,
    id: FileId,
    pid: u32,
}

#[derive(Debug, Default)]
struct FileRollout {
    log: Option<PinnedLog>,
    cursor: u64,
    index: RolloutIndex,
    lock: Option<KeptLock>,
}

impl FileRollout {
    /// Forget the index and the log handle. The kept lock descriptor stays: it is checked
    /// against the path (lock, then verify) every time it is locked again.
    fn reset(&mut self) {
        let lock = self.lock.take();
        *self = FileRollout {
            lock,
            ..FileRollout::default()
        };
    }
}

/// Resolves over the JSONL files a `Store` writes in `root`, from any process.
pub struct FileLineage {
    root: PathBuf,
    rollouts: Arc<FdCache<Arc<Mutex<FileRollout>>>>,
    cache: TokenCache,
    read_window: usize,
    map_at_least: u64,
    split_scan_at_least: usize,
    /// A read buffer kept between looks (see `keep_spare`).
    spare: Mutex<Vec<u8>>,
}

impl FileLineage {
    pub fn new(root: impl Into<PathBuf>, cached_rollouts: usize, cached_tokens: usize) -> Self {
        Self::with_max_open_files(root, cached_rollouts, cached_tokens, None)
    }

    /// [`FileLineage::new`], keeping at most `max_open_files` descriptors between resolves
    /// (if given; the process's descriptor budget applies either way).
    pub fn with_max_open_files(
        root: impl Into<PathBuf>,
        cached_rollouts: usize,
        cached_tokens: usize,
        max_open_files: Option<usize>,
    ) -> Self {
        FileLineage {
            root: root.into(),
            rollouts: FdCache::new(cached_rollouts, max_open_files),
            cache: TokenCache::new(cached_tokens),
            read_window: READ_WINDOW,
            map_at_least: MAP_AT_LEAST,
            split_scan_at_least: SPLIT_SCAN_BYTES,
            spare: Mutex::new(Vec::new()),
        }
    }

    /// Descriptors this resolver keeps (cached between resolves, or in use now).
    pub fn open_files(&self) -> usize {
        self.rollouts.held()
    }

    /// This resolver's own cap on kept descriptors, `None` when only the process budget
    /// applies.
    pub fn max_open_files(&self) -> Option<usize> {
        self.rollouts.max_open()
    }

    #[cfg(test)]
    fn with_read_window(mut self, bytes: usize) -> Self {
        self.read_window = bytes.max(1);
        self
    }

    /// Map the log from this many new bytes up (`u64::MAX`: always `pread`).
    #[cfg(test)]
    fn with_map_at_least(mut self, bytes: u64) -> Self {
        self.map_at_least = bytes.max(1);
        self
    }

    /// Scan chunks of this many bytes or more on two threads (`usize::MAX`: never).
    #[cfg(test)]
    fn with_split_scan_at_least(mut self, bytes: usize) -> Self {
        self.split_scan_at_least = bytes.max(1);
        self
    }

    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// Drop every cached index and sequence (and the descriptors they hold).
    pub fn clear(&self) {
        self.rollouts.clear();
        self.cache.clear();
    }

    /// Tokens held by the materialized-sequence cache.
    pub fn cached_tokens(&self) -> usize {
        self.cache.tokens()
    }

    /// Number of rollouts with a cached index.
    pub fn cached_rollouts(&self) -> usize {
        self.rollouts.lock().len()
    }

    fn rollout(&self, rollout_id: &str) -> Arc<Mutex<FileRollout>> {
        let mut rollouts = self.rollouts.lock();
        if let Some(found) = rollouts.get(rollout_id) {
            return found.clone();
        }
        let fresh = Arc::new(Mutex::new(FileRollout::default()));
        rollouts.put(rollout_id.to_owned(), fresh.clone());
        fresh
    }

    /// Resolve `request` against the committed entries of `rollout_id`.
    pub fn resolve(&self, rollout_id: &str, request: &mut dyn Request) -> Result<Step> {
        self.resolve_with(rollout_id, request, false)
    }

    /// [`FileLineage::resolve`], except that an answer built by extending its parent's cached
    /// tokens (the usual one) may come back before its digest is checked: then its
    /// `unverified` names the recorded digest, and the tokens must pass
    /// [`FileLineage::verify`] before they are handed to anyone. Lets the caller build the
    /// answer's Python objects on one thread while another hashes. A failed check says only
    /// that this shortcut does not hold: resolve again with [`FileLineage::resolve`], which
    /// answers by the full path or raises.
    pub fn resolve_unverified(&self, rollout_id: &str, request: &mut dyn Request) -> Result<Step> {
        self.resolve_with(rollout_id, request, true)
    }

    /// Whether `tokens` hash to `digest` (a deferred answer's check); if so they are cached as
    /// that digest's verified sequence.
    pub fn verify(&self, tokens: &Tokens, digest: &str) -> bool {
        let good = token_digest(tokens) == digest;
        if good {
            self.cache.insert(digest.to_owned(), tokens.clone());
        }
        good
    }

    fn resolve_with(
        &self,
        rollout_id: &str,
        request: &mut dyn Request,
        defer: bool,
    ) -> Result<Step> {
        validate_rollout_id(rollout_id)?;
        let fingerprint = match request_fingerprint(request) {
            Ok(fp) => fp,
            Err(step) => return Ok(step),
        };
        let permit = descriptors::enter();
        let rollout = self.rollout(rollout_id);
        let result = self.resolve_locked(&rollout, rollout_id, &fingerprint, request, defer);
        drop(permit);
        drop(rollout);
        self.rollouts.settle();
        result
    }

    fn resolve_locked(
        &self,
        rollout: &Mutex<FileRollout>,
        rollout_id: &str,
        fingerprint: &str,
        request: &mut dyn Request,
        defer: bool,
    ) -> Result<Step> {
        let mut state = lock(rollout);
        let paths = RolloutPaths::new(&self.root, rollout_id);
        let recent = match self.refresh(&mut state, &paths) {
            Ok(recent) => recent,
            Err(err) => {
                // Whatever was half-read is discarded; the next resolve starts over.
                state.reset();
                return Err(err);
            }
        };
        let result = match &state.log {
            None => Ok(Step::Done(Outcome::Unresolved {
                reason: REASON_NO_MATCH,
            })),
            Some(log) => {
                let lines = FileLines {
                    file: &log.file,
                    path: &paths.log,
                    recent: &recent,
                };
                resolve_in(
                    &state.index,
                    fingerprint,
                    request,
                    &lines,
                    &self.cache,
                    rollout_id,
                    defer,
                )
            }
        };
        if let Some(guard) = self.keep_spare(recent) {
            state.lock = self.keep_lock(Some(guard));
        }
        result
    }

    /// Keep a read buffer for the next look (one per resolver, at most `MAX_SCRATCH`), so a
    /// look at a new line reuses memory instead of faulting in fresh pages. A map is dropped
    /// here, before the shared lock it was made under is returned (still held) for keeping.
    fn keep_spare(&self, recent: Recent) -> Option<RolloutLock> {
        match recent {
            Recent::Read { buf, .. } => {
                if buf.len() <= MAX_SCRATCH {
                    let mut spare = lock(&self.spare);
                    if spare.len() < buf.len() {
                        *spare = buf;
                    }
                }
                None
            }
            #[cfg(any(target_os = "linux", target_os = "android"))]
            Recent::Mapped { map, _guard, .. } => {
                drop(map); // unmapped while the lock is still held (see `mapped`)
                Some(_guard)
            }
            Recent::Nothing => None,
        }
    }

    /// The rollout's shared lock: through the lock file descriptor kept from an earlier
    /// resolve when this process opened it and the path still names that file (lock, then
    /// verify: a deleted or re-created rollout's lock file is a new inode, and the stale
    /// descriptor is closed), otherwise by opening the lock file (`None` when there is none).
    fn lock_shared(
        &self,
        kept: Option<KeptLock>,
        paths: &RolloutPaths,
    ) -> Result<Option<RolloutLock>> {
        if let Some(kept) = kept.filter(|kept| kept.pid == crate::fork::current_pid()) {
            let file = kept.file.into_inner();
            if let Some(lock) = RolloutLock::relock(file, kept.id, &paths.lock, LockMode::Shared)? {
                return Ok(Some(lock));
            }
        }
        Ok(RolloutLock::acquire_if_exists(
            &paths.lock,
            LockMode::Shared,
        )?)
    }

    /// Release `guard` and keep its descriptor (counted) for the rollout's next resolve.
    fn keep_lock(&self, guard: Option<RolloutLock>) -> Option<KeptLock> {
        let (file, id) = guard?.unlock()?;
        Some(KeptLock {
            file: self.rollouts.account().keep(file),
            id,
            pid: crate::fork::current_pid(),
        })
    }

    /// Fold in whatever was appended since the last look; reset on replacement or deletion.
    /// Returns the bytes read (or mapped, with the lock it needs) for the rest of the resolve.
    fn refresh(&self, state: &mut FileRollout, paths: &RolloutPaths) -> Result<Recent> {
        // Without a lock file there is nothing to lock (and we create no file); a log that
        // exists anyway (an operator removed the lock) is read without it.
        let guard = self.lock_shared(state.lock.take(), paths)?;
        let on_disk = match std::fs::metadata(&paths.log) {
            Ok(meta) => (meta.dev(), meta.ino()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                state.reset();
                state.lock = self.keep_lock(guard);
                return Ok(Recent::Nothing);
            }
            Err(err) => return Err(err).ctx("stat log", &paths.log).map_err(Into::into),
        };
        if state.log.as_ref().map(|log| (log.dev, log.ino)) != Some(on_disk) {
            state.reset();
            let file = match descriptors::retry(|| OpenOptions::new().read(true).open(&paths.log)) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    state.lock = self.keep_lock(guard);
                    return Ok(Recent::Nothing);
                }
                Err(err) => return Err(err).ctx("open log", &paths.log).map_err(Into::into),
            };
            let meta = file.metadata().ctx("stat log", &paths.log)?;
            state.log = Some(PinnedLog {
                file: self.rollouts.account().keep(file),
                dev: meta.dev(),
                ino: meta.ino(),
            });
        }
        let Some(log) = &state.log else {
            state.lock = self.keep_lock(guard);
            return Ok(Recent::Nothing);
        };
        let len = log.file.metadata().ctx("stat log", &paths.log)?.len();
        if len < state.cursor || !ends_a_line(&log.file, state.cursor, &paths.log)? {
            // Truncated below what we indexed, or rewritten in place: whatever the file holds
            // now is read from scratch.
            state.cursor = 0;
            state.index = RolloutIndex::default();
        }
        if len == state.cursor {
            state.lock = self.keep_lock(guard);
            return Ok(Recent::Nothing);
        }
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if guard.is_some() && len - state.cursor >= self.map_at_least {
            // Only under the shared lock (see `crate::mapped`); a map that fails (a filesystem
            // that cannot map, no address space) falls back to reading.
            if let Ok(map) = crate::mapped::Mapped::new(&log.file, state.cursor, len) {
                let start = state.cursor;
                let chunk = map.bytes();
                let complete = complete_prefix_len(chunk);
                if complete > 0 {
                    self.fold(&mut state.index, &log.file, &paths.log, chunk, start)?;
                    state.cursor += complete as u64;
                }
                // The map lives on with the lock, for the materialization that follows.
                return Ok(match guard {
                    Some(guard) => Recent::Mapped {
                        start,
                        map,
                        _guard: guard,
                    },
                    None => Recent::Nothing,
                });
            }
        }
        // Read in windows, so a long log costs bounded memory; a line longer than a window
        // widens it. Every byte read was acknowledged before `len` was taken under the lock.
        let mut window = self.read_window;
        // One buffer for every window (the resolver's spare, if it has one): a fresh allocation
        // is zeroed by the kernel as it is first touched, a reused one is overwritten (no
        // memset of megabytes per window).
        let mut buf = std::mem::take(&mut *lock(&self.spare));
        let mut read = (0u64, 0usize);
        while state.cursor < len {
            let start = state.cursor;
            let want = (len - start).min(window as u64) as usize;
            if buf.len() < want {
                buf = vec![0u8; want];
            }
            let chunk = &mut buf[..want];
            log.file
                .read_exact_at(chunk, start)
                .ctx("read log", &paths.log)?;
            let chunk = &*chunk;
            read = (start, want);
            if complete_prefix_len(chunk) == 0 {
                if start + want as u64 == len {
                    break; // a torn final line: left for a later look
                }
                window = window.saturating_mul(2);
                continue;
            }
            self.fold(&mut state.index, &log.file, &paths.log, chunk, start)?;
            state.cursor = start + complete_prefix_len(chunk) as u64;
        }
        state.lock = self.keep_lock(guard);
        Ok(Recent::Read {
            start: read.0,
            buf,
            len: read.1,
        })
    }

    /// Add the complete lines of `chunk` (read at `start`) to the index.
    ///
    /// A chunk of [`SPLIT_SCAN_BYTES`] or more (unless a test says otherwise) is scanned by
    /// two threads: a helper scans the lines of its second half (from the first line start
    /// past the middle) while this thread scans and adds those of the first, then adds the
    /// helper's in order. Adding stays in file order, so the index, and the first error
    /// reported, are those of one thread's fold.
    fn fold(
        &self,
        index: &mut RolloutIndex,
        file: &File,
        path: &std::path::Path,
        chunk: &[u8],
        start: u64,
    ) -> Result<()> {
        let complete = &chunk[..complete_prefix_len(chunk)];
        let middle = (complete.len() >= self.split_scan_at_least)
            .then(|| memchr::memchr(b'\n', &complete[complete.len() / 2..]))
            .flatten()
            .map(|at| complete.len() / 2 + at + 1)
            .filter(|&middle| middle < complete.len());
        let Some(middle) = middle else {
            return Self::add_lines(index, file, path, complete, start, LineScan(complete));
        };
        let (head, tail) = complete.split_at(middle);
        let split = crate::spread::Split::begin();
        let splitting = &split;
        std::thread::scope(|scope| {
            let helper = scope.spawn(move || {
                let _cores = splitting.enter_helper();
                // Lines past a bad one are never added: the scan stops there.
                let mut scanned = Vec::new();
                for line in LineScan(tail) {
                    let bad = line.1.is_err();
                    scanned.push(line);
                    if bad {
                        break;
                    }
                }
                scanned
            });
            let added = Self::add_lines(index, file, path, head, start, LineScan(head));
            let scanned = helper.join().expect("lineage scan thread");
            added?;
            let at = start + middle as u64;
            Self::add_lines(index, file, path, tail, at, scanned.into_iter())
        })
    }

    /// Add `lines` (each line's length and what [`scan_next_line`] made of it), the lines of
    /// `complete` in order, read at `start`, to the index.
    fn add_lines(
        index: &mut RolloutIndex,
        file: &File,
        path: &std::path::Path,
        complete: &[u8],
        start: u64,
        lines: impl Iterator<Item = ScannedLine>,
    ) -> Result<()> {
        let mut at = 0usize;
        for (len, meta) in lines {
            let (offset, line) = (start + at as u64, &complete[at..at + len]);
            at += len + 1;
            let meta = meta.map_err(|e| Error::corrupt(path, offset, e))?;
            let loc = Loc::File {
                offset,
                len: line.len(),
            };
            index.add(meta, loc, 0, |known| match known {
                Loc::File {
                    offset: known_offset,
                    len: known_len,
                } => {
                    if *known_len != line.len() {
                        return Ok(false);
                    }
                    let mut earlier = vec![0u8; *known_len];
                    file.read_exact_at(&mut earlier, *known_offset)
                        .ctx("read log", path)?;
                    Ok(earlier == line)
                }
                Loc::Memory(bytes) => Ok(&bytes[..] == line),
            })?;
        }
        Ok(())
    }
}

/// Whether the byte before `cursor` is the newline that ended the last line we indexed.
fn ends_a_line(file: &File, cursor: u64, path: &std::path::Path) -> Result<bool> {
    if cursor == 0 {
        return Ok(true);
    }
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, cursor - 1)
        .ctx("read log", path)?;
    Ok(byte[0] == b'\n')
}

// ---- the in-memory resolver -----------------------------------------------------------------

struct MemoryState {
    rollouts: LruCache<String, Arc<Mutex<RolloutIndex>>>,
    tokens: u64,
}

/// A bounded, single-process index fed by `put`: LRU over rollouts and a token budget,
/// never evicting the most recently used rollout.
pub struct MemoryLineage {
    state: Mutex<MemoryState>,
    max_tokens: u64,
    cache: TokenCache,
}

impl MemoryLineage {
    pub fn new(max_rollouts: usize, max_tokens: u64, cached_tokens: usize) -> Self {
        MemoryLineage {
            state: Mutex::new(MemoryState {
                rollouts: lru_of(max_rollouts),
                tokens: 0,
            }),
            max_tokens,
            cache: TokenCache::new(cached_tokens),
        }
    }

    /// Index one canonical entry line of `rollout_id`. A repeat with the same bytes is a
    /// no-op (`Ok(false)`); the same call id with different bytes makes it a conflict, which
    /// removes it from resolution and is an [`Error::Conflict`].
    pub fn put(&self, rollout_id: &str, line: &[u8]) -> Result<bool> {
        validate_rollout_id(rollout_id)?;
        let meta =
            scan_line(line).map_err(|e| Error::InvalidInput(format!("not an entry line: {e}")))?;
        let rollout = {
            let mut state = lock(&self.state);
            match state.rollouts.get(rollout_id) {
                Some(found) => found.clone(),
                None => {
                    let fresh = Arc::new(Mutex::new(RolloutIndex::default()));
                    if let Some((_, evicted)) =
                        state.rollouts.push(rollout_id.to_owned(), fresh.clone())
                    {
                        state.tokens = state.tokens.saturating_sub(lock(&evicted).tokens);
                    }
                    fresh
                }
            }
        };
        let tokens = meta.token_count(line);
        let call_id = meta.call_id.clone();
        let added = lock(&rollout).add(meta, Loc::Memory(Arc::from(line)), tokens, |known| {
            Ok(matches!(known, Loc::Memory(bytes) if &bytes[..] == line))
        })?;
        match added {
            Added::Duplicate => Ok(false),
            Added::Conflict => Err(Error::Conflict {
                rollout_id: rollout_id.to_owned(),
                call_id,
            }
            .into()),
            Added::New => {
                let mut state = lock(&self.state);
                let current = state
                    .rollouts
                    .peek(rollout_id)
                    .is_some_and(|r| Arc::ptr_eq(r, &rollout));
                if current {
                    state.tokens += tokens;
                }
                while state.tokens > self.max_tokens && state.rollouts.len() > 1 {
                    match state.rollouts.pop_lru() {
                        Some((_, evicted)) => {
                            state.tokens = state.tokens.saturating_sub(lock(&evicted).tokens)
                        }
                        None => break,
                    }
                }
                Ok(true)
            }
        }
    }

    pub fn resolve(&self, rollout_id: &str, request: &mut dyn Request) -> Result<Step> {
        validate_rollout_id(rollout_id)?;
        let fingerprint = match request_fingerprint(request) {
            Ok(fp) => fp,
            Err(step) => return Ok(step),
        };
        let rollout = lock(&self.state).rollouts.get(rollout_id).cloned();
        let Some(rollout) = rollout else {
            return Ok(Step::Done(Outcome::Unresolved {
                reason: REASON_NO_MATCH,
            }));
        };
        let index = lock(&rollout);
        resolve_in(
            &index,
            &fingerprint,
            request,
            &MemoryLines,
            &self.cache,
            rollout_id,
            false,
        )
    }

    /// Forget rollouts; returns `(removed, absent)`.
    pub fn delete<S: AsRef<str>>(&self, rollout_ids: &[S]) -> Result<(Vec<String>, Vec<String>)> {
        let ids = crate::store::validate_rollout_ids(rollout_ids)?;
        let mut state = lock(&self.state);
        let (mut removed, mut absent) = (Vec::new(), Vec::new());
        for id in ids {
            match state.rollouts.pop(&id) {
                Some(index) => {
                    state.tokens = state.tokens.saturating_sub(lock(&index).tokens);
                    removed.push(id);
                }
                None => absent.push(id),
            }
        }
        Ok((removed, absent))
    }

    /// Tokens of the stored entries.
    /// Whether no thread holds any of this index's mutexes now; never waits. A forked child
    /// checks it before using an index it inherited: one a thread of the parent held at the
    /// fork stays locked in the child forever, while one nobody held is consistent there.
    pub fn idle(&self) -> bool {
        let state = match self.state.try_lock() {
            Ok(state) => state,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        let free = |rollout: &Arc<Mutex<RolloutIndex>>| {
            !matches!(rollout.try_lock(), Err(std::sync::TryLockError::WouldBlock))
        };
        state.rollouts.iter().all(|(_, rollout)| free(rollout)) && self.cache.idle()
    }

    pub fn stored_tokens(&self) -> u64 {
        lock(&self.state).tokens
    }

    pub fn rollout_count(&self) -> usize {
        lock(&self.state).rollouts.len()
    }

    pub fn cached_tokens(&self) -> usize {
        self.cache.tokens()
    }

    pub fn clear(&self) {
        let mut state = lock(&self.state);
        state.rollouts.clear();
        state.tokens = 0;
        self.cache.clear();
    }
}

/// Whether `ids` starts with `prefix`.
pub fn extends(prefix: &[u64], ids: &[u64]) -> bool {
    ids.len() >= prefix.len() && ids[..prefix.len()] == *prefix
}

/// The hashes of `stamp_continuation` by the Rust port: the fingerprint of `items` and the
/// conversation digest of `items[..context_len]`.
pub fn continuation_hashes(
    items: &[Value],
    context_len: usize,
) -> std::result::Result<(String, String), Unsupported> {
    let fingerprint = fingerprint::assistant_fingerprint(items)?;
    let digest = PrefixDigests::new().digest_of(items, context_len)?;
    Ok((fingerprint, digest))
}

#[cfg(test)]
mod tests;
