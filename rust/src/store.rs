//! Rollout operations: put, begin_call, mark_incomplete, freeze, drop, retire, delete, reads.
//!
//! Every mutation holds the rollout's exclusive flock for its whole duration, so writers to one
//! rollout are serialized across threads and processes while different rollouts never wait on
//! each other.
//!
//! **The per-process index cache.** A put must know the payload digests already stored for
//! the rollout. Rereading the state file (and re-folding the log) on every put would dominate
//! its cost, so each `Store` keeps the folded state of recently used rollouts, together with
//! open handles on the log and the state file it was built from. An open handle pins its inode
//! (an unlinked inode cannot be reused while open), so "the path still names the inode we hold"
//! proves the file was not replaced. Under the lock, a cached entry is used only if that holds
//! for both files, a file it holds no handle on (a rollout with no state index yet) counting
//! as unchanged only while its path still names nothing: a fence (retire, freeze, drop) or a
//! mark_incomplete, by another process or by NeMo Gym's store, always writes a state file, so
//! its appearance reloads. A log that grew behind our back (another process appended)
//! is folded incrementally, anything else reloads from disk. `begin_call`, which reads only
//! the state file's fences, checks only the state file; the next put checks the log.
//!
//! **What a put writes.** The line and its newline, then `fdatasync`; a put that created the
//! log (or the first through a freshly loaded index) also fsyncs the directory, coalesced with
//! other threads' (`Coalesced`). No put writes the state index except a checkpoint every
//! [`CHECKPOINT_ENTRIES`] entries or [`CHECKPOINT_BYTES`] bytes past the last one on disk,
//! which bounds how much a cold reader has to fold; so a rollout that has only been put to
//! has no state index until its 64th entry (or a conflict, mark_incomplete, freeze, drop or
//! retire, which write it durably). SPEC reads a missing state index as a fresh rollout and
//! log bytes past `indexed_size` as an acknowledged tail that every reader (NeMo Gym's store
//! too) folds identically, so a lagging or missing index loses nothing acknowledged. A first
//! put costs two syncs (the log's, the shared directory's) instead of three (the state's
//! temporary file and its rename were the third). What the index does not hold yet is not
//! checked against a digest at freeze: a line damaged on disk before the first checkpoint
//! reads as what it now says (as every line of the unindexed tail always has).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::TrySendError;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::SystemTime;

use lru::LruCache;

use crate::descriptors::{self, Account, FdCache, Kept};
use crate::digest::{payload_digest, payload_digest_pair, payload_digests};
use crate::error::{Error, IoContext, Result};
use crate::json::tape::{
    call_id_of, tape_channel, ChunkTaper, LineTape, SideWork, TapeFeed, TapeSink,
};
use crate::json::{extract_call_id, LineError, Repeats};
use crate::lock::{FileId, LockFile, LockMode, RolloutLock};
use crate::log::{
    append_line, append_lines, complete_lines, complete_prefix_len, read_at, read_into,
    reserve_exactly, reserve_past,
};
use crate::ring::{Chunk, LineBytes, Ring, Shared, CHUNK_BYTES};
use crate::spread;
use crate::state::{self, State};

/// Longest accepted rollout id: the longest file name we derive from it must fit in 255 bytes.
pub const MAX_ROLLOUT_ID_LEN: usize = 200;
/// Unindexed entries after which a put checkpoints the state index.
pub const CHECKPOINT_ENTRIES: usize = 64;
/// Unindexed log bytes after which a put checkpoints the state index.
pub const CHECKPOINT_BYTES: u64 = 4 << 20;
/// Default number of rollouts whose folded index a store keeps (up to three descriptors each:
/// the log and the state file, once it has one, that it pins, and the lock file kept open
/// between writes), within the process's descriptor budget (`descriptors`).
pub const DEFAULT_CACHED_ROLLOUTS: usize = 128;
/// Blocks a first freeze keeps reserved past the log's end for the rollout's fence (a state
/// file of a few hundred bytes): its retire or drop gives them back just before writing the
/// fence, so it lands on a full disk.
const FENCE_RESERVE: u64 = 4096;

/// Check a rollout id: non-empty, ASCII letters, digits, `.`, `_`, `-`, and short enough.
pub fn validate_rollout_id(rollout_id: &str) -> Result<()> {
    if rollout_id.is_empty() {
        return Err(Error::InvalidInput("rollout_id must not be empty".into()));
    }
    if rollout_id.len() > MAX_ROLLOUT_ID_LEN {
        return Err(Error::InvalidInput(format!(
            "rollout_id is {} bytes long; at most {MAX_ROLLOUT_ID_LEN} fit in the file names",
            rollout_id.len()
        )));
    }
    if let Some(bad) = rollout_id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Error::InvalidInput(format!(
            "rollout_id {rollout_id:?} contains {bad:?}; only ASCII letters, digits, '.', '_' \
             and '-' are allowed"
        )));
    }
    Ok(())
}

/// Validate a batch before anything changes; duplicates are dropped, first order kept.
pub fn validate_rollout_ids<S: AsRef<str>>(rollout_ids: &[S]) -> Result<Vec<String>> {
    let mut seen = HashSet::new();
    let mut unique = Vec::with_capacity(rollout_ids.len());
    for id in rollout_ids {
        let id = id.as_ref();
        validate_rollout_id(id)?;
        if seen.insert(id) {
            unique.push(id.to_owned());
        }
    }
    Ok(unique)
}

/// A call id must be one line of the intents file: non-empty, no line break.
pub fn validate_call_id(call_id: &str) -> Result<()> {
    if call_id.is_empty() {
        return Err(Error::InvalidInput(
            "model_call_id must not be empty".into(),
        ));
    }
    if call_id.contains(['\n', '\r']) {
        return Err(Error::InvalidInput(format!(
            "model_call_id {call_id:?} contains a line break"
        )));
    }
    if call_id.starts_with(is_line_space) || call_id.ends_with(is_line_space) {
        return Err(Error::InvalidInput(format!(
            "model_call_id {call_id:?} starts or ends with whitespace, which readers of the \
             intents file strip: its intent would not match its entry"
        )));
    }
    Ok(())
}

/// What readers strip from both ends of an intents line (Python's `bytes.strip()`, as
/// NeMo Gym's store reads them): ASCII space, tab, line feed, vertical tab, form feed, return.
fn is_line_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

fn validate_line(line: &[u8], what: &str) -> Result<()> {
    if memchr::memchr2(b'\n', b'\r', line).is_some() {
        return Err(Error::InvalidInput(format!("{what} must be a single line")));
    }
    Ok(())
}

/// The files of one rollout.
#[derive(Debug, Clone)]
pub struct RolloutPaths {
    pub log: PathBuf,
    pub state: PathBuf,
    pub state_tmp: PathBuf,
    pub intents: PathBuf,
    pub incomplete: PathBuf,
    pub lock: PathBuf,
}

impl RolloutPaths {
    pub fn new(root: &Path, rollout_id: &str) -> Self {
        let file = |suffix: &str| root.join(format!("{rollout_id}.tokens.{suffix}"));
        RolloutPaths {
            log: file("jsonl"),
            state: file("state.json"),
            state_tmp: file("state.json.tmp"),
            intents: file("intents"),
            incomplete: file("incomplete"),
            lock: file("lock"),
        }
    }

    /// The files that hold records (as opposed to the fence and the lock).
    fn records(&self) -> [&Path; 3] {
        [&self.log, &self.intents, &self.incomplete]
    }
}

/// What a put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Appended,
    /// The same call id with the same payload digest was already stored: nothing changed.
    Duplicate,
    /// A put made [`OnConflict::Keep`] found another entry under its call id: nothing was
    /// written or marked, the stored entry stands.
    Kept,
}

/// What a put does when its call id already holds another entry (a different payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnConflict {
    /// SPEC's rule: mark the rollout incomplete, persist that, and fail with
    /// [`Error::Conflict`].
    Mark,
    /// Keep the stored entry and report [`PutOutcome::Kept`]: for a second attempt of one
    /// call (a client's retry racing its first attempt through another process), whose
    /// answer is then the stored one, so the rollout stays whole.
    Keep,
}

/// What a put hands its outcome to (see [`Store::put_then`]).
pub type PutDone = Box<dyn FnOnce(Result<PutOutcome>) + Send + 'static>;

/// Most puts one group commit takes (each is two slices of one vectored write, well within
/// `IOV_MAX`), and the most line bytes it gathers beyond its first put.
const MAX_BATCH_PUTS: usize = 256;
const MAX_BATCH_BYTES: usize = 8 << 20;

/// A put waiting for its rollout's writer (its digest is computed by the writer, off the
/// caller's thread: an async put's caller holds the GIL).
struct QueuedPut {
    call_id: String,
    line: Vec<u8>,
    on_conflict: OnConflict,
    done: PutDone,
}

/// The first puts of a rollout's new writer (from [`Store::queue_put`]), to hand to
/// [`Store::write_puts`]. Dropped unwritten, its puts are never answered and the rollout's
/// later puts wait forever: always write it.
pub struct PutBatch(Vec<QueuedPut>);

impl std::fmt::Debug for PutBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PutBatch")
            .field("puts", &self.0.len())
            .finish()
    }
}

/// A put of a batch being committed (its `done` kept apart, to be called once decided).
struct PutItem {
    call_id: String,
    line: Vec<u8>,
    digest: String,
    on_conflict: OnConflict,
}

/// The rollouts with a writer in this process, each with the puts queued behind it.
#[derive(Default)]
struct Writers {
    queues: Mutex<Queues>,
}

/// Per store, so per process: a forked child never uses its parent's store (the bindings
/// open a fresh one in a child, see `crate::fork`), nor its queued puts (the parent's to
/// answer).
#[derive(Default)]
struct Queues {
    by_rollout: HashMap<String, Vec<QueuedPut>>,
}

impl std::fmt::Debug for Writers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writers")
            .field("rollouts", &self.lock().by_rollout.len())
            .finish()
    }
}

impl Writers {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // Only pushes and drains happen under it: a poisoned map is still consistent.
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue `put` behind the rollout's writer (`None`), or make the caller its writer, with
    /// `put` as its first batch.
    fn join(&self, rollout_id: &str, put: QueuedPut) -> Option<Vec<QueuedPut>> {
        let mut queues = self.lock();
        if let Some(waiting) = queues.by_rollout.get_mut(rollout_id) {
            waiting.push(put);
            return None;
        }
        queues.by_rollout.insert(rollout_id.to_owned(), Vec::new());
        Some(vec![put])
    }

    /// The writer's next batch: `rest` (puts to try again) first, then the queued ones in
    /// arrival order, within the batch limits; `None`, and the rollout has no writer, when
    /// nothing is left.
    fn next(&self, rollout_id: &str, mut rest: Vec<QueuedPut>) -> Option<Vec<QueuedPut>> {
        let mut queues = self.lock();
        let waiting = queues.by_rollout.get_mut(rollout_id);
        let Some(waiting) = waiting.filter(|w| !w.is_empty()) else {
            if rest.is_empty() {
                queues.by_rollout.remove(rollout_id);
                return None;
            }
            return Some(rest);
        };
        let mut bytes: usize = rest.iter().map(|put| put.line.len()).sum();
        let mut take = 0;
        for put in waiting.iter() {
            let full = rest.len() + take >= MAX_BATCH_PUTS || bytes >= MAX_BATCH_BYTES;
            if full && rest.len() + take > 0 {
                break;
            }
            bytes += put.line.len();
            take += 1;
        }
        rest.extend(waiting.drain(..take));
        Some(rest)
    }
}

/// The checks of a put's ids, made when it is queued (cheap: the caller may hold the GIL).
fn check_put(rollout_id: &str, call_id: &str) -> Result<()> {
    validate_rollout_id(rollout_id)?;
    validate_call_id(call_id)
}

/// The checks of a put's line (a scan of it), made by the writer before anything changes.
fn check_line(line: &[u8]) -> Result<()> {
    validate_line(line, "an entry line")?;
    if line.is_empty() {
        return Err(Error::InvalidInput(
            "an entry line must not be empty".into(),
        ));
    }
    Ok(())
}

/// What a put is told when the code committing it panicked (a bug; nothing was acknowledged).
fn panicked_put(log: &Path) -> Error {
    Error::Io {
        op: "put (the committing thread panicked)",
        path: log.to_path_buf(),
        source: io::Error::other("internal error: the put did not complete"),
    }
}

/// Unique records of a log, in file order: the byte ranges of their lines in the log (without
/// newlines), and the log's bytes they index when the read kept them (`Store::freeze`,
/// `Store::read_records` and small logs' reads do; a large log's streamed freeze or read goes
/// through the chunk ring, `crate::ring`, and keeps none: `buf` is then empty).
#[derive(Debug, Default)]
pub struct Records {
    pub buf: Vec<u8>,
    pub lines: Vec<Range<usize>>,
}

/// What freeze returns.
#[derive(Debug)]
pub struct Snapshot {
    pub records: Records,
    pub incomplete: bool,
    pub snapshot_id: String,
    pub version: u64,
}

/// A durable freeze, short of the log bytes its record ranges point into.
struct Settled {
    lines: Vec<Range<usize>>,
    incomplete: bool,
    snapshot_id: String,
    version: u64,
}

impl Settled {
    fn into_snapshot(self, buf: Vec<u8>) -> Snapshot {
        Snapshot {
            records: Records {
                buf,
                lines: self.lines,
            },
            incomplete: self.incomplete,
            snapshot_id: self.snapshot_id,
            version: self.version,
        }
    }
}

/// How a log's lines are hashed and walked.
enum Scan {
    /// On this thread.
    Serial,
    /// A large log on two threads (when the caller leaves the other core free).
    Parallel,
    /// Already done by the caller: each line's payload digest, and its call id as
    /// `json::extract_call_id` would answer it (see `Store::freeze_decoding`).
    Scanned {
        digests: Vec<String>,
        call_ids: Vec<std::result::Result<String, LineError>>,
    },
}

/// The complete lines of a log as a freeze, a read or an inspection checks them.
struct LogLines<'b> {
    /// `(file offset, length of the line without its newline)`, in file order.
    lines: Vec<(u64, usize)>,
    /// The bytes read, when they were kept whole; `None` for a streamed read, whose chunks
    /// went back to their ring as soon as their lines were hashed, walked and built.
    buf: Option<&'b [u8]>,
    /// The bytes read: the complete lines, then any torn tail.
    len: u64,
}

impl<'b> LogLines<'b> {
    fn of(buf: &'b [u8]) -> Self {
        LogLines {
            lines: complete_lines(buf, 0)
                .map(|(offset, line)| (offset, line.len()))
                .collect(),
            buf: Some(buf),
            len: buf.len() as u64,
        }
    }

    /// The bytes of a line of `lines`, if they were kept.
    fn bytes(&self, (offset, len): (u64, usize)) -> Option<&'b [u8]> {
        let start = offset as usize;
        self.buf.map(|buf| &buf[start..start + len])
    }

    /// Where the complete lines end (and a torn tail, if any, starts).
    fn complete_end(&self) -> u64 {
        self.lines
            .last()
            .map_or(0, |&(offset, len)| offset + len as u64 + 1)
    }

    fn ranges(&self) -> Vec<Range<usize>> {
        let range = |&(offset, len): &(u64, usize)| offset as usize..offset as usize + len;
        self.lines.iter().map(range).collect()
    }
}

/// The complete lines of a log, as `Store::freeze_decoding` and `Store::read_decoding` hand
/// them to their decoder.
pub enum LinesToDecode<'b> {
    /// A small log: the buffer and its complete lines.
    Whole {
        buf: &'b [u8],
        lines: &'b [Range<usize>],
    },
    /// A large log: each line with its tape, in order, sent as soon as it is read.
    Taped(TapeFeed<'b>),
}

/// Result of a batch retire or delete.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removal {
    pub removed: Vec<String>,
    pub absent: Vec<String>,
}

impl Removal {
    /// List `id` under `removed` if it had records, else under `absent`.
    pub(crate) fn note(&mut self, id: String, had: bool) {
        if had {
            self.removed.push(id);
        } else {
            self.absent.push(id);
        }
    }
}

/// An open handle and the identity it pins, with the size and modification time the file had
/// when pinned (a tool that rewrites a state file in place keeps its inode).
#[derive(Debug)]
struct Pinned {
    file: Kept<File>,
    id: FileId,
    len: u64,
    modified: Option<SystemTime>,
}

impl Pinned {
    fn new(file: File, path: &Path, account: &Account) -> Result<Self> {
        let meta = file.metadata().ctx("stat", path)?;
        Ok(Pinned {
            id: FileId::of(&meta),
            len: meta.len(),
            modified: meta.modified().ok(),
            file: account.keep(file),
        })
    }

    /// Whether `now` (the path's metadata) is this file, unchanged since it was pinned.
    fn unchanged(&self, now: &Metadata) -> bool {
        FileId::of(now) == self.id && now.len() == self.len && now.modified().ok() == self.modified
    }
}

/// A rollout's lock file, unlocked but kept open for its next write (see `lock.rs`).
#[derive(Debug)]
struct KeptLock {
    file: Kept<LockFile>,
    id: FileId,
    /// The process that opened it. A forked child shares the descriptor's open file
    /// description with its parent, so its flock would not exclude the parent: the child
    /// never locks an inherited descriptor.
    pid: u32,
}

/// What of a rollout's cached index an operation relies on (see `Store::checkout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Uses {
    /// The state file only: its fences and flags (`begin_call`).
    State,
    /// The state file and the log (everything that reads or writes the log's index).
    Log,
}

/// One rollout's folded index as this process last saw it.
#[derive(Debug, Default)]
struct Cached {
    lock: Option<KeptLock>,
    log: Option<Pinned>,
    state_file: Option<Pinned>,
    /// The folded state; `state.indexed_size` is how much of the log it covers.
    state: State,
    /// How much of the log, and how many entries, the state file on disk covers.
    disk_indexed_size: u64,
    disk_entries: usize,
    /// Whether this process has fsynced the directory since it opened the log. A log found on
    /// disk may have been created by a writer that crashed before making its name durable, so
    /// the first append through a freshly loaded index fsyncs the directory too.
    dir_synced: bool,
    /// How far this process has reserved the log's blocks (`log::reserve_past`), and whether
    /// its filesystem refused to.
    reserved_to: u64,
    cannot_reserve: bool,
    /// Whether `state.indexed_size` has been checked to end on a line boundary of the log.
    /// A state that points into a line (a damaged or foreign index) must not be appended to:
    /// the torn-line truncation would keep half a line and glue the next record onto it.
    boundary_checked: bool,
    /// The log's length as `checkout` (or `load`) found it under this operation's lock, for
    /// `fold_tail`, which takes it instead of asking the kernel again. Never kept between
    /// operations (`cache_back` clears it): another process may append as soon as the lock
    /// is released.
    log_len: Option<u64>,
}

impl Cached {
    fn needs_checkpoint(&self) -> bool {
        self.state.entry_digests.len() >= self.disk_entries + CHECKPOINT_ENTRIES
            || self.state.indexed_size >= self.disk_indexed_size + CHECKPOINT_BYTES
    }
}

/// The durable, rollout-keyed store over one directory.
pub struct Store {
    dir: RootDir,
    cache: Arc<FdCache<Cached>>,
    /// A whole-log read buffer kept between reads (see `read_whole_log`).
    spare_buffer: Mutex<Vec<u8>>,
    /// The chunk ring's buffers kept between streamed reads (see `crate::ring`).
    spare_chunks: Mutex<Vec<Vec<u8>>>,
    /// The length of a chunk of a streamed read (`CHUNK_BYTES`; tests make it small).
    chunk_bytes: usize,
    /// Whether a streamed freeze or read (a large log) maps the log (`crate::mapped`); tests
    /// turn it off to take the chunk ring, which a map that fails falls back to.
    map_logs: bool,
    /// Each rollout's one writer of puts, and the puts queued behind it (`put_then`).
    writers: Writers,
}

/// The largest read buffer a store keeps between reads.
const MAX_SPARE_BUFFER: usize = 16 << 20;

// By hand: the spare buffers are shown by their sizes (a derived `Debug` would print up to
// `MAX_SPARE_CHUNKS` chunks and the whole-log buffer byte by byte), and a buffer another
// thread holds is not waited for.
impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let spare_buffer = self.spare_buffer.try_lock().map(|buf| buf.capacity());
        let spare_chunks = self.spare_chunks.try_lock().map(|bufs| bufs.len());
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("cache", &self.cache)
            .field("spare_buffer_bytes", &spare_buffer.ok())
            .field("spare_chunks", &spare_chunks.ok())
            .field("chunk_bytes", &self.chunk_bytes)
            .field("writers", &self.writers)
            .finish()
    }
}

/// How many chunk-ring buffers a store keeps between streamed reads.
const MAX_SPARE_CHUNKS: usize = 8;

/// A store directory (the token store's or the ledger's): its path, by which creations,
/// renames and removals in it are made durable. No descriptor is kept: each fsync opens the
/// directory (a couple of microseconds, next to the fsync), so a store at rest holds only
/// what its cache keeps within the descriptor budget.
#[derive(Debug)]
pub(crate) struct RootDir {
    path: PathBuf,
    syncs: Coalesced,
}

/// Concurrent fsyncs of one directory, coalesced: a caller's sync is done once an fsync that
/// started after it asked has succeeded, so while one runs, everyone who asks meanwhile waits
/// for it and then shares the next one. The rollouts a store creates all live in its one
/// directory, and fsyncs of one directory do not overlap on this ext4 (each writes the
/// directory's block and flushes the disk's cache in turn): 64 first puts in flight paid for
/// 64 of them one after another.
#[derive(Debug, Default)]
struct Coalesced {
    state: Mutex<CoalescedState>,
    finished: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct CoalescedState {
    /// Tickets handed out (one per call), and the highest one a successful run covered.
    asked: u64,
    covered: u64,
    running: bool,
}

impl Coalesced {
    fn lock(&self) -> MutexGuard<'_, CoalescedState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `op` for this caller, or wait for a run of it that started after this call did.
    fn run(&self, op: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut state = self.lock();
        state.asked += 1;
        let ticket = state.asked;
        loop {
            if state.covered >= ticket {
                return Ok(());
            }
            if !state.running {
                state.running = true;
                let covers = state.asked; // every ticket so far asked before this run starts
                drop(state);
                let result = op();
                let mut state = self.lock();
                state.running = false;
                if result.is_ok() {
                    state.covered = state.covered.max(covers);
                }
                drop(state);
                // On failure the waiters run it again themselves, and see their own error.
                self.finished.notify_all();
                return result;
            }
            state = self.finished.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// fsync the directory at `path`.
pub(crate) fn sync_directory(path: &Path) -> Result<()> {
    descriptors::retry(|| File::open(path))
        .and_then(|dir| dir.sync_all())
        .ctx("fsync directory", path)
}

impl RootDir {
    /// Open the directory, creating it (durably) if needed.
    pub(crate) fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let path: PathBuf = root.into();
        if !path.is_dir() {
            std::fs::create_dir_all(&path).ctx("create directory", &path)?;
            // Make the new directory's own entry durable, or a crash could lose every record.
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                sync_directory(parent)?;
            }
        }
        // Fail now, not at the first put, if it is not a directory we can open.
        descriptors::retry(|| File::open(&path)).ctx("open directory", &path)?;
        Ok(RootDir {
            path,
            syncs: Coalesced::default(),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// fsync the directory (or wait for an fsync of it that started after this call: see
    /// `Coalesced`). Call after the creation, rename or removal to make durable.
    pub(crate) fn sync(&self) -> Result<()> {
        self.syncs.run(|| sync_directory(&self.path))
    }
}

/// A per-process cache of at most `entries` (at least one) rollouts' indexes, keeping at most
/// `max_open_files` descriptors (if given) within the process's descriptor budget.
pub(crate) fn rollout_cache<V: Send + 'static>(
    entries: usize,
    max_open_files: Option<usize>,
) -> Arc<FdCache<V>> {
    FdCache::new(entries, max_open_files)
}

/// Put `value` back into `cache` as its most recent entry, then keep the cache within its cap
/// and the process budget (whatever is closed, closes outside the cache's lock).
pub(crate) fn cache_put<V: Send + 'static>(cache: &FdCache<V>, key: &str, value: V) {
    let evicted = cache.lock().push(key.to_owned(), value);
    drop(evicted);
    cache.settle();
}

fn path_metadata(path: &Path) -> Result<Option<Metadata>> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(Some(meta)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err).ctx("stat", path),
    }
}

fn file_id(path: &Path) -> Result<Option<FileId>> {
    Ok(path_metadata(path)?.map(|meta| FileId::of(&meta)))
}

fn open_existing(options: &OpenOptions, path: &Path, op: &'static str) -> Result<Option<File>> {
    match descriptors::retry(|| options.open(path)) {
        Ok(file) => Ok(Some(file)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err).ctx(op, path),
    }
}

/// Give back the blocks reserved past a log's end (`log::reserve_past`, or a freeze's
/// `FENCE_RESERVE`) before a lifecycle write: a truncation to its own length frees them, and
/// on a full disk they are the room its state file needs. Failing only leaves them taken.
fn give_back_reserved(cached: &mut Cached) {
    if let Some(log) = &cached.log {
        if let Ok(meta) = log.file.metadata() {
            let _ = log.file.set_len(meta.len());
        }
    }
    cached.reserved_to = 0;
}

/// Whether `err` is a full disk (or quota).
fn is_full(err: &Error) -> bool {
    matches!(err, Error::Io { source, .. }
        if matches!(source.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded))
}

fn log_options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.read(true).append(true);
    options
}

/// Remove `path`; true when it existed.
pub(crate) fn remove_if_exists(path: &Path) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err).ctx("remove", path),
    }
}

fn check_writable(rollout_id: &str, state: &State) -> Result<()> {
    if state.retired {
        Err(Error::Retired(rollout_id.to_owned()))
    } else if state.frozen {
        Err(Error::Frozen(rollout_id.to_owned()))
    } else {
        Ok(())
    }
}

/// What one line does to the index.
enum Fold {
    New,
    Duplicate,
    Conflict,
}

/// Apply one acknowledged line (call id and payload digest) to the state.
fn fold_line(state: &mut State, call_id: String, digest: String) -> Fold {
    match state.entry_digests.get(&call_id) {
        None => {
            state.entry_digests.insert(call_id, digest);
            state.version += 1;
            Fold::New
        }
        Some(known) if *known == digest => Fold::Duplicate,
        Some(_) => {
            // Two committed payloads for one call id: the rollout has a hole it cannot repair.
            state.incomplete = true;
            state.version += 1;
            Fold::Conflict
        }
    }
}

impl Store {
    /// Open (creating if needed) the store directory.
    pub fn open(root: impl Into<PathBuf>, cached_rollouts: usize) -> Result<Self> {
        Self::open_with(root, cached_rollouts, None)
    }

    /// [`Store::open`], keeping at most `max_open_files` descriptors between operations (if
    /// given; the process's descriptor budget applies either way).
    pub fn open_with(
        root: impl Into<PathBuf>,
        cached_rollouts: usize,
        max_open_files: Option<usize>,
    ) -> Result<Self> {
        Ok(Store {
            dir: RootDir::open(root)?,
            cache: rollout_cache(cached_rollouts, max_open_files),
            spare_buffer: Mutex::new(Vec::new()),
            spare_chunks: Mutex::new(Vec::new()),
            chunk_bytes: CHUNK_BYTES,
            map_logs: true,
            writers: Writers::default(),
        })
    }

    /// This store, reading large logs through chunks of `chunk_bytes` (tests: many chunk
    /// boundaries and lines longer than a chunk in small logs).
    #[cfg(test)]
    fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunk_bytes = chunk_bytes;
        self
    }

    /// This store, reading large logs through its chunk ring instead of a map.
    #[cfg(test)]
    fn without_maps(mut self) -> Self {
        self.map_logs = false;
        self
    }

    /// Descriptors this store keeps (cached between operations, or in use now).
    pub fn open_files(&self) -> usize {
        self.cache.held()
    }

    /// This store's own cap on kept descriptors, `None` when only the process budget applies.
    pub fn max_open_files(&self) -> Option<usize> {
        self.cache.max_open()
    }

    /// Close every descriptor this store keeps between operations.
    pub fn clear(&self) {
        self.cache.clear();
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn paths(&self, rollout_id: &str) -> RolloutPaths {
        RolloutPaths::new(self.dir.path(), rollout_id)
    }

    fn sync_dir(&self) -> Result<()> {
        self.dir.sync()
    }

    fn cache(&self) -> MutexGuard<'_, LruCache<String, Cached>> {
        // A panic elsewhere cannot leave a half-updated entry behind: entries are taken out
        // while in use, so a poisoned map is still consistent.
        self.cache.lock()
    }

    /// Return a rollout's index to the cache (which may close others to stay in budget).
    fn cache_back(&self, rollout_id: &str, mut cached: Cached) {
        cached.log_len = None; // another process may append once the lock is released
        cache_put(&self.cache, rollout_id, cached);
    }

    fn forget(&self, rollout_id: &str) {
        self.cache().pop(rollout_id);
    }

    /// The first `len` bytes of a log, read into the store's spare buffer when it has one.
    /// Freezes and reads take whole logs (megabytes for agentic rollouts): a fresh buffer each
    /// time costs a page fault per 4 KiB (about 1.5 ms of a 10 ms freeze of a 2.5 MB log here),
    /// since each log is a little longer than the allocator's last one and gets new pages.
    fn read_whole_log(&self, file: &File, len: u64, path: &Path) -> Result<Vec<u8>> {
        let mut buf = std::mem::take(&mut *self.spare());
        read_into(file, 0, len as usize, &mut buf).ctx("read log", path)?;
        Ok(buf)
    }

    /// Give a buffer from `read_whole_log` (a snapshot's or a read's records) back for the
    /// next read. The store keeps the largest one up to `MAX_SPARE_BUFFER`.
    pub fn recycle_buffer(&self, buf: Vec<u8>) {
        if buf.capacity() <= MAX_SPARE_BUFFER {
            let mut spare = self.spare();
            if buf.capacity() > spare.capacity() {
                *spare = buf;
            }
        }
    }

    /// A chunk ring for a streamed read, with the buffers an earlier one gave back.
    fn ring(&self) -> Ring {
        Ring::new(std::mem::take(&mut *self.spare_chunks()), self.chunk_bytes)
    }

    /// Keep a ring's buffers (those of the usual size, up to `MAX_SPARE_CHUNKS`) for the next
    /// streamed read.
    fn keep_ring(&self, ring: Ring) {
        let mut spare = self.spare_chunks();
        for buf in ring.into_spare() {
            if spare.len() < MAX_SPARE_CHUNKS && buf.len() <= self.chunk_bytes {
                spare.push(buf);
            }
        }
    }

    /// The first `len` bytes of a log as one chunk read in place, when the log maps (a
    /// filesystem that cannot map, or no address space left, reads through the chunk ring
    /// instead). The caller holds the rollout's lock, taken before `len` was, until every
    /// line of the chunk is dropped (see `crate::mapped`).
    fn map_log(&self, file: &File, len: u64) -> Option<Shared> {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if self.map_logs && len > 0 {
            return crate::mapped::Mapped::new(file, 0, len)
                .ok()
                .map(Chunk::mapped);
        }
        let _ = (file, len); // used only where logs map
        None
    }

    fn spare_chunks(&self) -> MutexGuard<'_, Vec<Vec<u8>>> {
        self.spare_chunks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn spare(&self) -> MutexGuard<'_, Vec<u8>> {
        self.spare_buffer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The rollout's cached index (taken out of the cache by the caller) if its files are
    /// still the ones it pins (and the state file unchanged), otherwise the index loaded from
    /// disk. Call only under the rollout's exclusive lock.
    ///
    /// `uses` says which files the operation relies on. The state file (which carries the
    /// fences: a retire or freeze by another process replaces it) is always checked. The log
    /// is checked, and its length noted for `fold_tail` (one `statx` gives both), unless the
    /// operation reads nothing the log decides ([`Uses::State`]: `begin_call`); the index it
    /// returns to the cache still pins the log it was built from, so the next operation that
    /// relies on the log checks it then.
    fn checkout(&self, cached: Option<Cached>, paths: &RolloutPaths, uses: Uses) -> Result<Cached> {
        if let Some(mut cached) = cached {
            let state_same = match (path_metadata(&paths.state)?, &cached.state_file) {
                (Some(now), Some(pinned)) => pinned.unchanged(&now),
                (None, None) => true,
                _ => false,
            };
            if state_same && uses == Uses::State {
                return Ok(cached);
            }
            if state_same {
                let log_now = path_metadata(&paths.log)?;
                let pinned = cached.log.as_ref().map(|p| p.id);
                if log_now.as_ref().map(FileId::of) == pinned {
                    cached.log_len = log_now.map(|meta| meta.len());
                    return Ok(cached);
                }
            }
        }
        self.load(paths)
    }

    fn load(&self, paths: &RolloutPaths) -> Result<Cached> {
        self.load_with(paths, &log_options())
    }

    /// [`Store::load`], opening the log with `log_options` (read-only for a reader, which
    /// must work on a read-only mount and for a user who may only read).
    fn load_with(&self, paths: &RolloutPaths, log_options: &OpenOptions) -> Result<Cached> {
        let account = self.cache.account();
        let (state_file, state) = match state::open_and_read(&paths.state)? {
            Some((file, state)) => (Some(Pinned::new(file, &paths.state, account)?), state),
            None => (None, State::default()),
        };
        let log = match open_existing(log_options, &paths.log, "open log")? {
            Some(file) => Some(Pinned::new(file, &paths.log, account)?),
            None => None,
        };
        Ok(Cached {
            lock: None,
            log_len: log.as_ref().map(|log| log.len),
            log,
            state_file,
            disk_indexed_size: state.indexed_size,
            disk_entries: state.entry_digests.len(),
            dir_synced: false,
            reserved_to: 0,
            cannot_reserve: false,
            boundary_checked: false,
            state,
        })
    }

    /// Run `op` under the exclusive lock with the rollout's index checked out. The index goes
    /// back to the cache unless the operation failed in a way that may have left it stale.
    fn exclusive<T>(
        &self,
        rollout_id: &str,
        uses: Uses,
        op: impl FnOnce(&mut Cached, &RolloutPaths) -> Result<T>,
    ) -> Result<T> {
        let _permit = self.cache.enter();
        let paths = self.paths(rollout_id);
        // Taken out of the cache before locking: from here on no other thread can use its
        // kept lock descriptor, so the flock below excludes this process's threads too.
        let mut taken = self.cache().pop(rollout_id);
        let kept = taken.as_mut().and_then(|cached| cached.lock.take());
        let pid = std::process::id();
        let lock = self.lock_exclusive(kept, pid, &paths)?;
        let mut cached = self.checkout(taken, &paths, uses)?;
        let result = op(&mut cached, &paths);
        if matches!(result, Err(Error::Io { .. } | Error::Corrupt { .. })) {
            return result; // dropping the lock closes its descriptor
        }
        // Unlocked before the index returns to the cache, where another thread may take it.
        let account = self.cache.account();
        cached.lock = lock.unlock().map(|(file, id)| KeptLock {
            file: account.keep(file),
            id,
            pid,
        });
        self.cache_back(rollout_id, cached);
        result
    }

    /// Lock the rollout exclusively, through its kept lock descriptor when this process
    /// opened one and the path still names that file.
    /// `pid` is this process's id (a kept descriptor from any other process is never locked).
    fn lock_exclusive(
        &self,
        kept: Option<KeptLock>,
        pid: u32,
        paths: &RolloutPaths,
    ) -> Result<RolloutLock> {
        if let Some(kept) = kept.filter(|kept| kept.pid == pid) {
            let file = kept.file.into_inner();
            let relocked = RolloutLock::relock(file, kept.id, &paths.lock, LockMode::Exclusive)?;
            if let Some(lock) = relocked {
                return Ok(lock);
            }
        }
        RolloutLock::acquire(&paths.lock, LockMode::Exclusive)
    }

    /// Whether a rollout whose lock file is absent has any other file (an operator removed
    /// the lock file: it is made again by the lock that follows).
    fn has_files(paths: &RolloutPaths) -> Result<bool> {
        for path in paths.records().into_iter().chain([paths.state.as_path()]) {
            if file_id(path)?.is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Lock a rollout only if it has any file; `None` (and nothing created) otherwise.
    fn lock_existing(&self, paths: &RolloutPaths, mode: LockMode) -> Result<Option<RolloutLock>> {
        if let Some(lock) = RolloutLock::acquire_if_exists(&paths.lock, mode)? {
            return Ok(Some(lock));
        }
        if !Self::has_files(paths)? {
            return Ok(None);
        }
        RolloutLock::acquire(&paths.lock, mode).map(Some)
    }

    /// What a reader holds while it reads a rollout: `None` when the rollout has no files
    /// (nothing is created), else its shared lock, taken on a read-only descriptor, or no lock
    /// at all on a read-only filesystem without a lock file (`RolloutLock::acquire_to_read`).
    fn lock_to_read(&self, paths: &RolloutPaths) -> Result<Option<Option<RolloutLock>>> {
        if let Some(lock) = RolloutLock::acquire_if_exists(&paths.lock, LockMode::Shared)? {
            return Ok(Some(Some(lock)));
        }
        if !Self::has_files(paths)? {
            return Ok(None);
        }
        RolloutLock::acquire_to_read(&paths.lock).map(Some)
    }

    /// Atomically write the cached state; with `sync_dir`, also make the rename durable.
    fn persist(&self, cached: &mut Cached, paths: &RolloutPaths, sync_dir: bool) -> Result<()> {
        // The state file it replaces is closed first: a put holds at most three descriptors.
        let file = match cached.state_file.take() {
            Some(old) => {
                drop(old);
                state::write_atomic(&paths.state, &paths.state_tmp, &cached.state)?
            }
            None => state::write_atomic(&paths.state, &paths.state_tmp, &cached.state)?,
        };
        cached.state_file = Some(Pinned::new(file, &paths.state, self.cache.account())?);
        cached.disk_indexed_size = cached.state.indexed_size;
        cached.disk_entries = cached.state.entry_digests.len();
        if sync_dir {
            self.sync_dir()?;
            cached.dir_synced = true;
        }
        Ok(())
    }

    /// Fold log bytes past the cached index into it (another process appended them), and
    /// truncate a torn final line (callers hold the exclusive lock).
    fn fold_tail(&self, cached: &mut Cached, paths: &RolloutPaths) -> Result<()> {
        let Some(log) = &cached.log else {
            return missing_log(cached, paths);
        };
        let len = match cached.log_len.take() {
            Some(len) => len,
            None => log.file.metadata().ctx("stat log", &paths.log)?.len(),
        };
        let covered = cached.state.indexed_size;
        if len < covered {
            return Err(Error::corrupt(
                &paths.log,
                len,
                format!("log ends at byte {len} but its state index covers {covered} bytes"),
            ));
        }
        if covered > 0 && !cached.boundary_checked {
            let last = read_at(&log.file, covered - 1, 1).ctx("read log", &paths.log)?;
            if last != b"\n" {
                return Err(Error::corrupt(
                    &paths.log,
                    covered,
                    format!(
                        "{} ends its index inside a line of the log",
                        paths.state.display()
                    ),
                ));
            }
            cached.boundary_checked = true;
        }
        if len == covered {
            return Ok(());
        }
        let tail =
            read_at(&log.file, covered, (len - covered) as usize).ctx("read log", &paths.log)?;
        let mut repeats = Repeats::new();
        for (offset, line) in complete_lines(&tail, covered) {
            let call_id = extract_call_id(line, Some(&mut repeats))
                .map_err(|e| Error::corrupt(&paths.log, offset, e.0))?;
            fold_line(&mut cached.state, call_id, payload_digest(line));
        }
        let complete_end = covered + complete_prefix_len(&tail) as u64;
        cached.state.indexed_size = complete_end;
        if complete_end < len {
            log.file
                .set_len(complete_end)
                .ctx("truncate torn line", &paths.log)?;
        }
        Ok(())
    }

    /// Durably append one line to an intents or incomplete file; true if the directory must be
    /// fsynced to make the file's name durable.
    fn append_marker(&self, path: &Path, line: &[u8]) -> Result<bool> {
        let mut options = OpenOptions::new();
        options.append(true);
        let (file, created) = match open_existing(&options, path, "open")? {
            Some(file) => (file, false),
            None => {
                options.create(true);
                let file = descriptors::retry(|| options.open(path)).ctx("create", path)?;
                (file, true)
            }
        };
        let before = file.metadata().ctx("stat", path)?.len();
        if let Err(err) = append_line(&file, line).and_then(|()| file.sync_data()) {
            let _ = file.set_len(before); // leave no partial line behind
            return Err(err).ctx("append", path);
        }
        // An empty file found on disk may come from a failed first append whose name was never
        // made durable: treat it like one we created.
        Ok(created || before == 0)
    }

    /// Durably store one entry line. `line` is the canonical JSON of the entry (one line).
    /// Blocks until the line is fdatasync'ed (or the put failed); see [`Store::put_then`].
    pub fn put(&self, rollout_id: &str, call_id: &str, line: &[u8]) -> Result<PutOutcome> {
        self.put_as(rollout_id, call_id, line, OnConflict::Mark)
    }

    /// [`Store::put`], with `on_conflict` deciding what another entry already stored under
    /// the call id does (see [`OnConflict`]).
    pub fn put_as(
        &self,
        rollout_id: &str,
        call_id: &str,
        line: &[u8],
        on_conflict: OnConflict,
    ) -> Result<PutOutcome> {
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        let done: PutDone = Box::new(move |outcome| {
            let _ = sender.send(outcome);
        });
        self.put_then(rollout_id, call_id, line.to_vec(), on_conflict, done);
        receiver
            .recv()
            .unwrap_or_else(|_| Err(panicked_put(&self.paths(rollout_id).log)))
    }

    /// Durably store one entry line (`on_conflict` as for [`Store::put_as`]) and call `done`
    /// with the outcome once the line is fdatasync'ed (or the put failed): on this thread, or
    /// on the thread of another put of the same rollout that commits it.
    ///
    /// **Group commit.** A rollout has at most one writer in this process at a time. A put
    /// that finds one queued behind it and returns at once (a worker thread is never parked on
    /// a rollout's lock); the writer takes everything queued, in arrival order, under one
    /// exclusive lock and commits the new lines with one vectored write and one fdatasync, then
    /// calls each put's `done` and takes the next batch, until the queue is empty. Every put
    /// is still acknowledged only after its own line is on disk; what changes is that the
    /// puts queued behind one fdatasync share the next one instead of waiting for one each.
    pub fn put_then(
        &self,
        rollout_id: &str,
        call_id: &str,
        line: Vec<u8>,
        on_conflict: OnConflict,
        done: PutDone,
    ) {
        if let Some(batch) = self.queue_put_as(rollout_id, call_id, line, on_conflict, done) {
            self.write_puts(rollout_id, batch);
        }
    }

    /// The first half of [`Store::put_then`], which never blocks on the disk and never reads
    /// the line: check the ids (a refused put gets its `done` at once), then queue the put
    /// behind the rollout's writer (which checks and hashes the line), or
    /// return it as the first batch of a new writer, which the caller must run with
    /// [`Store::write_puts`] (on a worker thread, say) for this and every later put of the
    /// rollout to complete.
    pub fn queue_put(
        &self,
        rollout_id: &str,
        call_id: &str,
        line: Vec<u8>,
        done: PutDone,
    ) -> Option<PutBatch> {
        self.queue_put_as(rollout_id, call_id, line, OnConflict::Mark, done)
    }

    /// [`Store::queue_put`], with `on_conflict` as for [`Store::put_as`].
    pub fn queue_put_as(
        &self,
        rollout_id: &str,
        call_id: &str,
        line: Vec<u8>,
        on_conflict: OnConflict,
        done: PutDone,
    ) -> Option<PutBatch> {
        if let Err(err) = check_put(rollout_id, call_id) {
            done(Err(err));
            return None;
        }
        let put = QueuedPut {
            call_id: call_id.to_owned(),
            line,
            on_conflict,
            done,
        };
        self.writers.join(rollout_id, put).map(PutBatch)
    }

    /// Be the rollout's writer: commit `batch` and every put queued behind it, batch after
    /// batch, until none is left (see [`Store::put_then`]).
    pub fn write_puts(&self, rollout_id: &str, batch: PutBatch) {
        let mut batch = batch.0;
        loop {
            let rest = self.commit_batch(rollout_id, batch);
            match self.writers.next(rollout_id, rest) {
                Some(next) => batch = next,
                None => return,
            }
        }
    }

    /// Commit a batch of one rollout's puts and report each outcome; the puts left
    /// undecided (behind an I/O failure, which dropped the cached index) are returned to be
    /// tried again, first in line, from a fresh load.
    fn commit_batch(&self, rollout_id: &str, batch: Vec<QueuedPut>) -> Vec<QueuedPut> {
        let mut items = Vec::with_capacity(batch.len());
        let mut dones: Vec<PutDone> = Vec::with_capacity(batch.len());
        for put in batch {
            // The line's own checks and its digest run here, on the writer's thread.
            if let Err(err) = check_line(&put.line) {
                (put.done)(Err(err));
                continue;
            }
            items.push(PutItem {
                digest: payload_digest(&put.line),
                call_id: put.call_id,
                line: put.line,
                on_conflict: put.on_conflict,
            });
            dones.push(put.done);
        }
        if items.is_empty() {
            return Vec::new(); // nothing to lock, or to create a lock file for
        }
        let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.put_batch(rollout_id, &items)
        }))
        .unwrap_or_else(|_| {
            let log = self.paths(rollout_id).log;
            items
                .iter()
                .map(|_| Some(Err(panicked_put(&log))))
                .collect()
        });
        let mut rest = Vec::new();
        for ((item, done), result) in items.into_iter().zip(dones).zip(results) {
            match result {
                Some(outcome) => done(outcome),
                None => rest.push(QueuedPut {
                    call_id: item.call_id,
                    line: item.line,
                    on_conflict: item.on_conflict,
                    done,
                }),
            }
        }
        rest
    }

    /// The puts of `items` (one rollout's, in arrival order) under one exclusive lock, with
    /// the outcome each would have had alone, one after another: `None` for those not reached
    /// (an I/O failure before them, whose error went to the puts it concerned).
    fn put_batch(&self, rollout_id: &str, items: &[PutItem]) -> Vec<Option<Result<PutOutcome>>> {
        let mut results: Vec<Option<Result<PutOutcome>>> = items.iter().map(|_| None).collect();
        // The puts an error of the operation belongs to: all of them until the rollout's tail
        // is folded and it is known to be writable, then the group being committed.
        let mut failing: Vec<usize> = (0..items.len()).collect();
        let outcome = self.exclusive(rollout_id, Uses::Log, |cached, paths| {
            self.fold_tail(cached, paths)?;
            check_writable(rollout_id, &cached.state)?;
            let mut group: Vec<usize> = Vec::new();
            let mut grouped: HashSet<&str> = HashSet::new();
            for (index, item) in items.iter().enumerate() {
                if grouped.contains(item.call_id.as_str()) {
                    // The same call again: commit the first before judging the second.
                    failing = std::mem::take(&mut group);
                    grouped.clear();
                    self.append_group(cached, paths, items, &failing)?;
                    for &i in &failing {
                        results[i] = Some(Ok(PutOutcome::Appended));
                    }
                }
                match cached.state.entry_digests.get(&item.call_id) {
                    Some(known) if *known == item.digest => {
                        results[index] = Some(Ok(PutOutcome::Duplicate));
                    }
                    // Nothing to write or mark, so the group need not be committed first.
                    Some(_) if item.on_conflict == OnConflict::Keep => {
                        results[index] = Some(Ok(PutOutcome::Kept));
                    }
                    Some(_) => {
                        if !group.is_empty() {
                            failing = std::mem::take(&mut group);
                            grouped.clear();
                            self.append_group(cached, paths, items, &failing)?;
                            for &i in &failing {
                                results[i] = Some(Ok(PutOutcome::Appended));
                            }
                        }
                        failing = vec![index];
                        cached.state.incomplete = true;
                        cached.state.version += 1;
                        if let Err(err) = self.persist(cached, paths, true) {
                            if !is_full(&err) {
                                return Err(err);
                            }
                            // A full disk: the log's reserved blocks are the mark's room (as
                            // for `mark_incomplete`); the next put reserves again.
                            give_back_reserved(cached);
                            self.persist(cached, paths, true)?;
                        }
                        results[index] = Some(Err(Error::Conflict {
                            rollout_id: rollout_id.to_owned(),
                            call_id: item.call_id.clone(),
                        }));
                    }
                    None => {
                        group.push(index);
                        grouped.insert(item.call_id.as_str());
                    }
                }
            }
            if !group.is_empty() {
                failing = group;
                self.append_group(cached, paths, items, &failing)?;
                for &i in &failing {
                    results[i] = Some(Ok(PutOutcome::Appended));
                }
            }
            Ok(())
        });
        if let Err(err) = outcome {
            for &i in &failing {
                results[i] = Some(Err(err.duplicate()));
            }
        }
        results
    }

    /// Append the lines of `items[group]` (new call ids, in order) with one write and one
    /// fdatasync, then index them (the lines are durable before the index says so).
    fn append_group(
        &self,
        cached: &mut Cached,
        paths: &RolloutPaths,
        items: &[PutItem],
        group: &[usize],
    ) -> Result<()> {
        let created = cached.log.is_none();
        let log = match &cached.log {
            Some(log) => log,
            None => {
                let mut options = log_options();
                options.create(true);
                let file = descriptors::retry(|| options.open(&paths.log))
                    .ctx("create log", &paths.log)?;
                cached
                    .log
                    .insert(Pinned::new(file, &paths.log, self.cache.account())?)
            }
        };
        let lines: Vec<&[u8]> = group.iter().map(|&i| items[i].line.as_slice()).collect();
        let before = cached.state.indexed_size;
        let end = before + lines.iter().map(|line| line.len() as u64 + 1).sum::<u64>();
        if end > cached.reserved_to && !cached.cannot_reserve {
            match reserve_past(&log.file, before, end) {
                Some(reserved_to) => cached.reserved_to = reserved_to,
                None => cached.cannot_reserve = true,
            }
        }
        if let Err(err) = append_lines(&log.file, &lines).and_then(|()| log.file.sync_data()) {
            // Leave no partial line: the callers are told these puts failed.
            let _ = log.file.set_len(before);
            return Err(err).ctx("append", &paths.log);
        }
        cached.state.indexed_size = end;
        cached.state.version += group.len() as u64;
        for &i in group {
            let item = &items[i];
            cached
                .state
                .entry_digests
                .insert(item.call_id.clone(), item.digest.clone());
        }
        // A rollout's first puts write no state index: a missing one is a fresh rollout
        // (SPEC) and the log alone reads the same, so the index waits for the first
        // checkpoint or lifecycle transition. That takes a temporary file, its fdatasync and
        // a rename off every new rollout's first put (3 syncs to 2, the directory's shared).
        if created || !cached.dir_synced {
            // Before any checkpoint below: a state index is never durable ahead of the name
            // of the log it indexes (a vanished log with an index is corruption).
            self.sync_dir()?;
            cached.dir_synced = true;
        }
        if cached.needs_checkpoint() {
            // The rename need not be durable: the older state (or none) plus the log reads
            // the same. Nor need it succeed: the lines are durable and every reader finds
            // them, so a checkpoint that fails (a full disk) must not tell these puts they
            // failed (a caller would regenerate the call and conflict with its own stored
            // line). The index stays behind, as it may, and the next put tries again.
            let _ = self.persist(cached, paths, false);
        }
        Ok(())
    }

    /// Durably record that a call is about to be dispatched.
    pub fn begin_call(&self, rollout_id: &str, call_id: &str) -> Result<()> {
        validate_rollout_id(rollout_id)?;
        validate_call_id(call_id)?;
        self.exclusive(rollout_id, Uses::State, |cached, paths| {
            self.append_intent(rollout_id, call_id, cached, paths)
        })
    }

    /// [`Store::begin_call`], unless the rollout already holds an entry of `call_id` (a retry
    /// of a call whose answer was lost): then nothing is written and `true` comes back, also
    /// once the rollout is frozen. The check and the intent are one step under the rollout's
    /// lock, against the log as every process has written it, so a caller needs no read of
    /// its own before deciding whether to dispatch.
    pub fn begin_call_unless_stored(&self, rollout_id: &str, call_id: &str) -> Result<bool> {
        validate_rollout_id(rollout_id)?;
        validate_call_id(call_id)?;
        self.exclusive(rollout_id, Uses::Log, |cached, paths| {
            self.fold_tail(cached, paths)?;
            if cached.state.entry_digests.contains_key(call_id) {
                return Ok(true);
            }
            self.append_intent(rollout_id, call_id, cached, paths)
                .map(|()| false)
        })
    }

    /// Append and sync `call_id`'s intent line (the rollout's lock held exclusively).
    fn append_intent(
        &self,
        rollout_id: &str,
        call_id: &str,
        cached: &Cached,
        paths: &RolloutPaths,
    ) -> Result<()> {
        check_writable(rollout_id, &cached.state)?;
        if self.append_marker(&paths.intents, call_id.as_bytes())? {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// Durably record that a call of this rollout failed to capture. `line` is the call id as
    /// one line (the Python layer encodes ids that cannot be one). Allowed after freeze.
    pub fn mark_incomplete(&self, rollout_id: &str, line: &[u8]) -> Result<()> {
        self.mark(rollout_id, line, false).map(|_| ())
    }

    /// [`Store::mark_incomplete`], unless the rollout is frozen or retired: then nothing is
    /// written and `false` comes back. The check and the mark are made under the rollout's
    /// exclusive lock, so no freeze lands between them. For a call that failed while its
    /// rollout was being frozen: the freeze already judged it (an intent without an entry),
    /// and a mark after it would only move the snapshot's version, so that the trainer's
    /// `drop` of the snapshot would fail.
    pub fn mark_incomplete_if_open(&self, rollout_id: &str, line: &[u8]) -> Result<bool> {
        self.mark(rollout_id, line, true)
    }

    fn mark(&self, rollout_id: &str, line: &[u8], only_open: bool) -> Result<bool> {
        validate_rollout_id(rollout_id)?;
        validate_line(line, "an incomplete-marker line")?;
        self.exclusive(rollout_id, Uses::Log, |cached, paths| {
            if only_open && (cached.state.frozen || cached.state.retired) {
                return Ok(false);
            }
            if cached.state.retired {
                return Err(Error::Retired(rollout_id.to_owned()));
            }
            if !cached.state.frozen {
                // Room for the marker and the state on a full disk (the rollout that failed
                // a put with ENOSPC is the one to mark); the next put reserves again. A frozen
                // rollout keeps its block for its fence.
                give_back_reserved(cached);
            }
            self.append_marker(&paths.incomplete, line)?;
            cached.state.incomplete = true;
            cached.state.version += 1;
            // One directory fsync covers both the marker file's creation and the rename.
            self.persist(cached, paths, true).map(|()| true)
        })
    }

    /// Freeze the rollout (first call mints the snapshot id) and return its records.
    pub fn freeze(&self, rollout_id: &str) -> Result<Snapshot> {
        validate_rollout_id(rollout_id)?;
        self.exclusive(rollout_id, Uses::Log, |cached, paths| {
            let len = self.log_len_for_freeze(rollout_id, cached, paths)?;
            let buf = self.read_for_freeze(cached, len, paths)?;
            let settled = self.settle_freeze(cached, paths, &LogLines::of(&buf), Scan::Parallel)?;
            Ok(settled.into_snapshot(buf))
        })
    }

    /// [`Store::freeze`], handing the log's complete lines to `decode` on this thread while
    /// another verifies them, folds the tail and makes the freeze durable: a reader's decoding
    /// then costs no wall time beyond the longer of the two. `decode` sees every complete
    /// line, in file order (a rare duplicate included: the snapshot's ranges say which lines
    /// are the records), and the ranges of those lines come back with the snapshot. If the
    /// freeze fails, what `decode` made is dropped.
    ///
    /// A large log is read by the verifying thread in chunks; it parses each line into a tape
    /// as soon as the line is read (the one walk it needs anyway for the call ids of lines
    /// past the index) and sends it to `decode`, which only builds. The hashing goes to
    /// whichever thread would otherwise wait: the verifying one while the tape channel is
    /// full, this one once `decode` has returned. The chunks are a few reused buffers (see
    /// `crate::ring`), not a copy of the whole log: the snapshot's `records.buf` is then
    /// empty (its ranges are still the lines' places in the log).
    pub fn freeze_decoding<D>(
        &self,
        rollout_id: &str,
        decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
    ) -> Result<(Snapshot, Vec<Range<usize>>, D)> {
        validate_rollout_id(rollout_id)?;
        self.exclusive(rollout_id, Uses::Log, |cached, paths| {
            let len = self.log_len_for_freeze(rollout_id, cached, paths)?;
            match &cached.log {
                Some(log) if len >= PARALLEL_SCAN_BYTES as u64 => {
                    let file =
                        descriptors::retry(|| log.file.try_clone()).ctx("open log", &paths.log)?;
                    self.freeze_streaming(cached, paths, &file, len, decode)
                }
                _ => {
                    let buf = self.read_for_freeze(cached, len, paths)?;
                    let log = LogLines::of(&buf);
                    let settled = self.settle_freeze(cached, paths, &log, Scan::Serial)?;
                    let lines = log.ranges();
                    let decoded = decode(LinesToDecode::Whole {
                        buf: &buf,
                        lines: &lines,
                    });
                    Ok((settled.into_snapshot(buf), lines, decoded))
                }
            }
        })
    }

    /// The large-log half of [`Store::freeze_decoding`]: `file` is the log, `len` its length.
    fn freeze_streaming<D>(
        &self,
        cached: &mut Cached,
        paths: &RolloutPaths,
        file: &File,
        len: u64,
        decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
    ) -> Result<(Snapshot, Vec<Range<usize>>, D)> {
        let mut ring = self.ring();
        // Under the exclusive lock this freeze holds (see `map_log`).
        let mapped = self.map_log(file, len);
        let unmapped = mapped.as_ref().map(Arc::downgrade);
        // Each line's digest, hashed by whichever thread has time for it: the verifying one
        // while the channel to `decode` is full (or before it takes a new buffer while every
        // chunk is still held), `decode`'s while it waits for a line and, once every line is
        // read, before it builds the next (so the verifying thread can verify and start the
        // freeze's syncs while the last lines are built), and this one once `decode` returns.
        let board = DigestBoard::default();
        let split = spread::Split::begin();
        let splitting = &split;
        let (verified, decoded) = std::thread::scope(|scope| {
            let (sink, feed) = tape_channel(TAPES_AHEAD);
            let feed = feed.with_side_work(&board);
            let board = &board;
            let ring = &mut ring;
            let verifying = scope.spawn(move || {
                let _cores = splitting.enter_helper();
                let add = |chunk: &Shared, range| board.add(LineBytes::Chunk(chunk.clone(), range));
                let (lines, call_ids) =
                    stream_lines(mapped, file, len, ring, &sink, add, || board.step())
                        .ctx("read log", &paths.log)?;
                board.all_read();
                drop(sink); // every line is sent: `decode` may finish and help
                let digests = board.collect();
                let log = LogLines {
                    lines,
                    buf: None,
                    len,
                };
                let scan = Scan::Scanned { digests, call_ids };
                let settled = self.settle_freeze(cached, paths, &log, scan)?;
                Ok::<_, Error>((settled, log.ranges()))
            });
            let decoded = decode(LinesToDecode::Taped(feed));
            while board.step() {}
            (verifying.join().expect("freeze thread"), decoded)
        });
        drop(split);
        drop(board);
        // Every line of a map is dropped by now (a decoder returns what it built, never a
        // line), so the map is gone before the lock is released.
        assert!(unmapped.is_none_or(|map| map.strong_count() == 0));
        self.keep_ring(ring);
        let (settled, lines) = verified?;
        Ok((settled.into_snapshot(Vec::new()), lines, decoded))
    }

    /// The length of the log of a rollout about to be frozen (0 when it has none).
    fn log_len_for_freeze(
        &self,
        rollout_id: &str,
        cached: &Cached,
        paths: &RolloutPaths,
    ) -> Result<u64> {
        if cached.state.retired {
            return Err(Error::Retired(rollout_id.to_owned()));
        }
        match &cached.log {
            Some(log) => Ok(log.file.metadata().ctx("stat log", &paths.log)?.len()),
            None => missing_log(cached, paths).map(|()| 0),
        }
    }

    /// The first `len` bytes of the log of a rollout about to be frozen.
    fn read_for_freeze(&self, cached: &Cached, len: u64, paths: &RolloutPaths) -> Result<Vec<u8>> {
        match &cached.log {
            Some(log) => self.read_whole_log(&log.file, len, &paths.log),
            None => Ok(Vec::new()),
        }
    }

    /// Verify the log's lines against the index, fold its tail, truncate a torn final line,
    /// and make the freeze durable (the first freeze mints the snapshot id).
    fn settle_freeze(
        &self,
        cached: &mut Cached,
        paths: &RolloutPaths,
        log_lines: &LogLines<'_>,
        scan: Scan,
    ) -> Result<Settled> {
        let lines = verify_and_fold(&mut cached.state, log_lines, paths, scan)?;
        if let Some(log) = &cached.log {
            if cached.state.indexed_size < log_lines.len {
                log.file
                    .set_len(cached.state.indexed_size)
                    .ctx("truncate torn line", &paths.log)?;
            } else if !cached.state.frozen {
                // A frozen log takes no more appends: the first freeze gives back the blocks
                // any writer reserved past its end (`log::reserve_past`; a truncation to the
                // size frees them, and failing to only wastes space until retire).
                let _ = log.file.set_len(cached.state.indexed_size);
            }
            cached.reserved_to = 0;
        }
        let first = !cached.state.frozen;
        let mut changed = cached.state.indexed_size != cached.disk_indexed_size;
        if first {
            cached.state.frozen = true;
            cached.state.snapshot_id = uuid::Uuid::new_v4().simple().to_string();
            cached.state.version += 1;
            changed = true;
        }
        if changed {
            self.persist(cached, paths, true)?;
        }
        if let (true, false, Some(log)) = (first, cached.cannot_reserve, &cached.log) {
            // One block kept for the fence (see `FENCE_RESERVE`), taken once the freeze's own
            // state is written (before, on a nearly full disk it took the block that state
            // needed, and the freeze could never succeed); only space if it fails.
            reserve_exactly(&log.file, cached.state.indexed_size, FENCE_RESERVE);
        }
        let dangling = has_dangling_intent(&paths.intents, &cached.state)?;
        Ok(Settled {
            lines,
            incomplete: cached.state.incomplete || dangling,
            snapshot_id: cached.state.snapshot_id.clone(),
            version: cached.state.version,
        })
    }

    /// Delete the frozen snapshot's records and keep the fence, only if `snapshot_id` and
    /// `version` are exactly the current ones.
    pub fn drop_snapshot(&self, rollout_id: &str, snapshot_id: &str, version: u64) -> Result<bool> {
        validate_rollout_id(rollout_id)?;
        let _permit = self.cache.enter();
        let paths = self.paths(rollout_id);
        let Some(_lock) = self.lock_existing(&paths, LockMode::Exclusive)? else {
            return Ok(false);
        };
        let taken = self.cache().pop(rollout_id);
        let mut cached = self.checkout(taken, &paths, Uses::Log)?;
        self.fold_tail(&mut cached, &paths)?;
        let state = &cached.state;
        if !(state.frozen && state.snapshot_id == snapshot_id && state.version == version) {
            self.cache_back(rollout_id, cached);
            return Ok(false);
        }
        if !state.retired {
            cached.state = state.fenced();
            // The records go: their reserved blocks are the fence's room on a full disk.
            give_back_reserved(&mut cached);
            // The fence must be durable before any removal can be.
            self.persist(&mut cached, &paths, true)?;
        }
        self.forget(rollout_id);
        self.remove_records(&paths)?;
        self.sync_dir()?;
        Ok(true)
    }

    fn remove_records(&self, paths: &RolloutPaths) -> Result<bool> {
        let mut had = false;
        for path in paths.records() {
            had |= remove_if_exists(path)?;
        }
        remove_if_exists(&paths.state_tmp)?;
        Ok(had)
    }

    /// Remove records and keep a fence, whatever the state. Two phases, each ending in one
    /// directory fsync: every missing fence first, then the removals, so a removal can never
    /// be durable before its fence.
    pub fn retire<S: AsRef<str>>(&self, rollout_ids: &[S]) -> Result<Removal> {
        let ids = validate_rollout_ids(rollout_ids)?;
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        let _permit = self.cache.enter();
        let mut full = Vec::new();
        for id in &ids {
            match self.fence(id) {
                Err(err) if is_full(&err) => full.push(id),
                other => other?,
            }
        }
        // The disk was full: once more now that every other rollout of the batch gave back its
        // reserved blocks (an open one's are 64 KiB or more).
        for id in full {
            self.fence(id)?;
        }
        // Even when no fence was written: one found may come from an overlapping retire that
        // has not synced yet, and this call must not return before it is durable.
        self.sync_dir()?;
        let mut removal = Removal::default();
        for id in ids {
            let paths = self.paths(&id);
            let _lock = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(&id);
            let had = self.remove_records(&paths)?;
            removal.note(id, had);
        }
        self.sync_dir()?;
        Ok(removal)
    }

    /// Write a retire's fence (not yet durable: the caller fsyncs the directory).
    fn fence(&self, id: &str) -> Result<()> {
        let paths = self.paths(id);
        let _lock = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
        // The fence keeps the version and flags readers saw: the tail folded in, up to a
        // corrupt line if there is one (the records are about to go). A corrupt state gives
        // a bare fence: retiring is how a damaged rollout gets cleaned up.
        let taken = self.cache().pop(id);
        let state = match self.checkout(taken, &paths, Uses::Log) {
            Ok(mut cached) => {
                let _partial = self.fold_tail(&mut cached, &paths);
                if !cached.state.retired {
                    give_back_reserved(&mut cached); // the records go: room for the fence
                }
                cached.state
            }
            Err(_) => State::default(),
        };
        self.forget(id);
        if !state.retired {
            state::write_atomic(&paths.state, &paths.state_tmp, &state.fenced())?;
        }
        Ok(())
    }

    /// Remove records, fences and lock files, so a reused id starts empty.
    pub fn delete<S: AsRef<str>>(&self, rollout_ids: &[S]) -> Result<Removal> {
        let ids = validate_rollout_ids(rollout_ids)?;
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        let _permit = self.cache.enter();
        let mut removal = Removal::default();
        for id in ids {
            let paths = self.paths(&id);
            let lock = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)?;
            self.forget(&id);
            let mut had = self.remove_records(&paths)?;
            had |= remove_if_exists(&paths.state)?;
            // Unlink the lock while holding it; a waiter on the old inode notices and retries.
            remove_if_exists(&paths.lock)?;
            drop(lock);
            removal.note(id, had);
        }
        // Always, even when nothing was found: an overlapping delete may not have synced yet.
        self.sync_dir()?;
        Ok(removal)
    }

    /// NeMo Gym's `sweep_retired`: remove every retired rollout whose state file was last
    /// modified at or before `cutoff` (seconds since the Unix epoch), with `delete`'s removals
    /// (state, records, lock). The check and the removal happen under the rollout's exclusive
    /// lock, so a rollout deleted and reused meanwhile is never touched. A state file that
    /// cannot be read is not a retired rollout's and is left alone. With `dry_run` nothing
    /// changes. Returns the swept rollout ids, sorted.
    pub fn sweep_retired(&self, cutoff: f64, dry_run: bool) -> Result<Vec<String>> {
        const SUFFIX: &str = ".tokens.state.json";
        let root = self.dir.path();
        let _permit = self.cache.enter();
        let mut candidates = Vec::new();
        // Listing opens the directory: through `retry`, like every other open of the core.
        for item in descriptors::retry(|| std::fs::read_dir(root)).ctx("list", root)? {
            let item = item.ctx("list", root)?;
            let name = item.file_name();
            let Some(id) = name.to_str().and_then(|name| name.strip_suffix(SUFFIX)) else {
                continue;
            };
            if validate_rollout_id(id).is_ok() {
                candidates.push(id.to_owned());
            }
        }
        candidates.sort_unstable();
        let mut swept = Vec::new();
        for id in candidates {
            let paths = self.paths(&id);
            let Some(lock) = self.lock_existing(&paths, LockMode::Exclusive)? else {
                continue;
            };
            let modified = path_metadata(&paths.state)?
                .and_then(|meta| meta.modified().ok())
                .and_then(|at| at.duration_since(SystemTime::UNIX_EPOCH).ok());
            let old = modified.is_some_and(|since| since.as_secs_f64() <= cutoff);
            let retired = old
                && matches!(state::open_and_read(&paths.state), Ok(Some((_, state))) if state.retired);
            if retired && !dry_run {
                self.forget(&id);
                self.remove_records(&paths)?;
                remove_if_exists(&paths.state)?;
                // Unlink the lock while holding it; a waiter on the old inode notices and retries.
                remove_if_exists(&paths.lock)?;
            }
            drop(lock);
            if retired {
                swept.push(id);
            }
        }
        if !swept.is_empty() && !dry_run {
            self.sync_dir()?;
        }
        Ok(swept)
    }

    /// The stored incomplete flag (a call in flight is not a hole until freeze judges it).
    pub fn is_incomplete(&self, rollout_id: &str) -> Result<bool> {
        validate_rollout_id(rollout_id)?;
        let _permit = self.cache.enter();
        let paths = self.paths(rollout_id);
        Ok(state::open_and_read(&paths.state)?.is_some_and(|(_, state)| state.incomplete))
    }

    /// The current state as readers see it, without changing anything: every indexed line is
    /// checked against its digest and the tail is folded in (a torn line is ignored). Returns
    /// the state and the number of unique records; `None` when the rollout has no files.
    pub fn inspect(&self, rollout_id: &str) -> Result<Option<(State, usize)>> {
        validate_rollout_id(rollout_id)?;
        let _permit = self.cache.enter();
        let paths = self.paths(rollout_id);
        let Some(_lock) = self.lock_to_read(&paths)? else {
            return Ok(None);
        };
        let mut loaded = self.load_with(&paths, OpenOptions::new().read(true))?;
        let records = match &loaded.log {
            Some(log) => {
                let len = log.file.metadata().ctx("stat log", &paths.log)?.len();
                let buf = self.read_whole_log(&log.file, len, &paths.log)?;
                let records = verify_and_fold(
                    &mut loaded.state,
                    &LogLines::of(&buf),
                    &paths,
                    Scan::Parallel,
                );
                self.recycle_buffer(buf);
                records?.len()
            }
            None => 0,
        };
        Ok(Some((loaded.state, records)))
    }

    /// The unique records of a rollout, under the shared lock; a torn tail is ignored.
    /// The log is read whole: the records' ranges index `buf`.
    pub fn read_records(&self, rollout_id: &str) -> Result<Records> {
        self.read_lines_with(rollout_id, true, |_| ())
            .map(|(records, _, ())| records)
    }

    /// [`Store::read_records`], handing every complete line to `decode` as
    /// [`Store::freeze_decoding`] does (a large log is read in chunks by a second thread,
    /// which tapes each line as soon as it is read), and returning the lines' ranges too. The
    /// shared lock is held until `decode` returns. A large log is read through the chunk ring
    /// (`crate::ring`), and the records' `buf` is then empty.
    pub fn read_decoding<D>(
        &self,
        rollout_id: &str,
        decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
    ) -> Result<(Records, Vec<Range<usize>>, D)> {
        self.read_lines_with(rollout_id, false, decode)
    }

    /// [`Store::read_decoding`]; `whole`: read the log into one buffer whatever its size, and
    /// return it with the records.
    fn read_lines_with<D>(
        &self,
        rollout_id: &str,
        whole: bool,
        decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
    ) -> Result<(Records, Vec<Range<usize>>, D)> {
        validate_rollout_id(rollout_id)?;
        let _permit = self.cache.enter();
        let paths = self.paths(rollout_id);
        let Some(_lock) = self.lock_to_read(&paths)? else {
            return Ok(no_records(decode));
        };
        let Some(log) = open_existing(OpenOptions::new().read(true), &paths.log, "open log")?
        else {
            return Ok(no_records(decode));
        };
        let len = log.metadata().ctx("stat log", &paths.log)?.len();
        if whole || len < PARALLEL_SCAN_BYTES as u64 {
            let buf = self.read_whole_log(&log, len, &paths.log)?;
            let all = LogLines::of(&buf);
            let mut repeats = Repeats::new();
            let call_ids =
                complete_lines(&buf, 0).map(|(_, line)| extract_call_id(line, Some(&mut repeats)));
            let lines = first_records(&paths.log, &all.lines, call_ids)?;
            let ranges = all.ranges();
            let decoded = decode(LinesToDecode::Whole {
                buf: &buf,
                lines: &ranges,
            });
            return Ok((Records { buf, lines }, ranges, decoded));
        }
        let mut ring = self.ring();
        // Under the shared lock this read holds (see `map_log`).
        let mapped = self.map_log(&log, len);
        let unmapped = mapped.as_ref().map(Arc::downgrade);
        let split = spread::Split::begin();
        let splitting = &split;
        let (read, decoded) = std::thread::scope(|scope| {
            let (sink, feed) = tape_channel(TAPES_AHEAD);
            let log = &log;
            let ring = &mut ring;
            let reading = scope.spawn(move || {
                let _cores = splitting.enter_helper();
                let (lines, call_ids) =
                    stream_lines(mapped, log, len, ring, &sink, |_, _| {}, || false)
                        .ctx("read log", &paths.log)?;
                drop(sink);
                let records = first_records(&paths.log, &lines, call_ids)?;
                let ranges = LogLines {
                    lines,
                    buf: None,
                    len,
                }
                .ranges();
                Ok::<_, Error>((records, ranges))
            });
            let decoded = decode(LinesToDecode::Taped(feed));
            (reading.join().expect("read thread"), decoded)
        });
        drop(split);
        // The map is gone before the lock is released (see `freeze_streaming`).
        assert!(unmapped.is_none_or(|map| map.strong_count() == 0));
        self.keep_ring(ring);
        let (lines, ranges) = read?;
        let records = Records {
            buf: Vec::new(),
            lines,
        };
        Ok((records, ranges, decoded))
    }
}

/// Check every complete line of a whole log against the state: an indexed line must carry the
/// payload digest the index recorded for its call id; lines past the index are folded in.
/// Leaves `state.indexed_size` at the end of the complete lines and returns the ranges of the
/// unique records (the first line of each call id) in file order.
///
/// An indexed line is identified by its digest alone (SHA-256 of bytes that include the call
/// id), so only unindexed lines, and lines that fail that check, pay for the call-id walk.
/// Hashing and walking run on two threads for large logs with `Scan::Parallel`.
fn verify_and_fold(
    state: &mut State,
    log: &LogLines<'_>,
    paths: &RolloutPaths,
    scan: Scan,
) -> Result<Vec<Range<usize>>> {
    let complete_end = log.complete_end();
    let indexed = state.indexed_size;
    if indexed > complete_end {
        return Err(Error::corrupt(
            &paths.log,
            complete_end,
            format!(
                "{} covers {indexed} bytes but the log's complete lines end here",
                paths.state.display()
            ),
        ));
    }
    let scanned = scan_lines(log, indexed, scan);
    let by_digest: HashMap<String, String> = state
        .entry_digests
        .iter()
        .map(|(call_id, digest)| (digest.clone(), call_id.clone()))
        .collect();
    let mut lines = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for mut line in scanned {
        let call_id = match (&line.call_id, by_digest.get(&line.digest)) {
            (None, Some(call_id)) => call_id.clone(),
            (Some(Ok(call_id)), _) => call_id.clone(),
            (Some(Err(err)), _) => return Err(Error::corrupt(&paths.log, line.offset, &err.0)),
            (None, None) => line
                .fallback
                .call_id()
                .map_err(|e| Error::corrupt(&paths.log, line.offset, e.0))?,
        };
        if line.offset < indexed {
            if seen.contains(&call_id) {
                continue; // a later copy; the index judged it when it was folded
            }
            match state.entry_digests.get(&call_id) {
                Some(known) if *known == line.digest => {}
                Some(_) => {
                    return Err(Error::corrupt(
                        &paths.log,
                        line.offset,
                        format!(
                            "line of {call_id:?} does not match its payload digest in {}",
                            paths.state.display()
                        ),
                    ))
                }
                None => {
                    return Err(Error::corrupt(
                        &paths.log,
                        line.offset,
                        format!("{call_id:?} is missing from {}", paths.state.display()),
                    ))
                }
            }
        } else if !matches!(fold_line(state, call_id.clone(), line.digest), Fold::New) {
            continue;
        }
        seen.insert(call_id);
        let start = line.offset as usize;
        lines.push(start..start + line.len);
    }
    state.indexed_size = complete_end;
    Ok(lines)
}

/// One complete line with its payload digest and, past the index, its call id.
struct ScannedLine<'a> {
    offset: u64,
    len: usize,
    digest: String,
    call_id: Option<std::result::Result<String, LineError>>,
    /// Where an indexed line's call id comes from if its digest names no entry.
    fallback: CallIdFallback<'a>,
}

/// How `verify_and_fold` finds the call id of an indexed line whose digest names no entry
/// (to word its refusal).
enum CallIdFallback<'a> {
    /// A walk of the line's bytes.
    Walk(&'a [u8]),
    /// The walk a streamed read made of the line (whose bytes are gone): `extract_call_id`'s
    /// verdict on it (see `json::tape::call_id_of`).
    Walked(Option<std::result::Result<String, LineError>>),
}

impl CallIdFallback<'_> {
    fn call_id(&mut self) -> std::result::Result<String, LineError> {
        match self {
            CallIdFallback::Walk(bytes) => extract_call_id(bytes, None),
            CallIdFallback::Walked(walked) => walked
                .take()
                .unwrap_or_else(|| Err(LineError("the line's call id was taken".to_owned()))),
        }
    }
}

/// How many lines a streamed freeze or read may tape ahead of the decoder.
pub(crate) const TAPES_AHEAD: usize = 8;

/// Read the first `len` bytes of `file` on this thread through the chunks of `ring`, tape
/// each complete line as soon as it is read and send it through `sink` (after showing it to
/// `each`: its chunk and its range there); while the channel is full, or while every chunk is
/// held and a new one would be allocated, `when_full` does other work, and answers false when
/// it has none left. A closed channel (the decoder stopped early) drops the tapes: the reading
/// and walking go on. Returns the lines (`(file offset, length)`) and their call ids as
/// `json::extract_call_id` would answer them. A file shorter than `len` is an error, as
/// `read_exact_at` would make it.
///
/// A chunk is filled whole (the first read is small, so that the first lines go out at once);
/// the bytes after its last newline are carried to the start of the next one. A line longer
/// than a chunk grows its chunk until it fits (the grown buffer is then that line's own).
fn stream_taped_lines(
    file: &File,
    len: u64,
    ring: &mut Ring,
    sink: &TapeSink<'_>,
    each: impl FnMut(&Shared, Range<usize>),
    mut when_full: impl FnMut() -> bool,
) -> io::Result<StreamedLines> {
    /// The first read: small, so that the first lines go out at once.
    const FIRST_READ: usize = 64 << 10;
    let mut stream = LineStream::new(sink, each);
    let next_buffer = |ring: &mut Ring, when_full: &mut dyn FnMut() -> bool| loop {
        if let Some(buf) = ring.reuse() {
            return buf;
        }
        // Every chunk is held: hash a line (it may give one back) before allocating.
        if !when_full() {
            return ring.allocate();
        }
    };
    let mut buf = next_buffer(ring, &mut when_full);
    let mut base = 0u64; // the file offset of `buf[0]`
    let mut filled = 0; // bytes of `buf` read, all past its last complete line
    let mut first = true;
    loop {
        let left = (len - base) as usize - filled;
        if left == 0 {
            break;
        }
        if filled == buf.len() {
            // A line longer than the buffer: grow it.
            buf.resize(buf.len().max(ring.chunk_bytes()) * 2, 0);
        }
        let mut want = (buf.len() - filled).min(left);
        if std::mem::take(&mut first) {
            want = want.min(FIRST_READ);
        }
        file.read_exact_at(&mut buf[filled..filled + want], base + filled as u64)?;
        let new = filled..filled + want;
        filled += want;
        let Some(last) = memchr::memrchr(b'\n', &buf[new.clone()]) else {
            continue;
        };
        let cut = new.start + last + 1;
        let chunk = ring.share(std::mem::take(&mut buf), filled);
        stream.send(&chunk, cut, base, &mut when_full);
        // The bytes past the last newline start the next buffer.
        buf = next_buffer(ring, &mut when_full);
        let rest = &chunk.bytes()[cut..];
        if buf.len() < rest.len() {
            buf.resize(rest.len(), 0);
        }
        buf[..rest.len()].copy_from_slice(rest);
        filled = rest.len();
        base += cut as u64;
    }
    ring.give_back(buf);
    Ok(stream.into_lines())
}

/// [`stream_mapped_lines`] when the log is mapped, else [`stream_taped_lines`].
fn stream_lines(
    mapped: Option<Shared>,
    file: &File,
    len: u64,
    ring: &mut Ring,
    sink: &TapeSink<'_>,
    each: impl FnMut(&Shared, Range<usize>),
    when_full: impl FnMut() -> bool,
) -> io::Result<StreamedLines> {
    match mapped {
        Some(log) => Ok(stream_mapped_lines(log, sink, each, when_full)),
        None => stream_taped_lines(file, len, ring, sink, each, when_full),
    }
}

/// [`stream_taped_lines`] over a map of the whole log (`Chunk::mapped`), read in place: the
/// same lines, call ids and tapes, with no copy out of the page cache. A torn final line
/// (bytes past the last newline) is left out, as a streamed read leaves it.
fn stream_mapped_lines(
    log: Shared,
    sink: &TapeSink<'_>,
    each: impl FnMut(&Shared, Range<usize>),
    mut when_full: impl FnMut() -> bool,
) -> StreamedLines {
    let mut stream = LineStream::new(sink, each);
    let cut = complete_prefix_len(log.bytes());
    stream.send(&log, cut, 0, &mut when_full);
    stream.into_lines()
}

/// The lines of a streamed read (`(file offset, length)`) and their call ids as
/// `json::extract_call_id` would answer them.
type StreamedLines = (
    Vec<(u64, usize)>,
    Vec<std::result::Result<String, LineError>>,
);

/// What a streamed read does with each complete line: show it to `each`, tape it, note its
/// place and call id, and send it on through `sink` (while the channel is full, `when_full`
/// does other work; a closed channel drops the tapes).
struct LineStream<'s, 'a, E> {
    sink: &'s TapeSink<'a>,
    each: E,
    taper: ChunkTaper,
    lines: Vec<(u64, usize)>,
    call_ids: Vec<std::result::Result<String, LineError>>,
}

impl<'s, 'a, E: FnMut(&Shared, Range<usize>)> LineStream<'s, 'a, E> {
    fn new(sink: &'s TapeSink<'a>, each: E) -> Self {
        LineStream {
            sink,
            each,
            taper: ChunkTaper::new(),
            lines: Vec::new(),
            call_ids: Vec::new(),
        }
    }

    /// The complete lines of `chunk[..cut]`, whose first byte is at file offset `base`.
    fn send(
        &mut self,
        chunk: &Shared,
        cut: usize,
        base: u64,
        when_full: &mut impl FnMut() -> bool,
    ) {
        for (offset, line) in complete_lines(&chunk.bytes()[..cut], 0) {
            let range = offset as usize..offset as usize + line.len();
            (self.each)(chunk, range.clone());
            self.taper.floats_as_text(self.sink.floats_as_text());
            let tape = self.taper.tape(chunk, range.clone());
            self.call_ids.push(call_id_of(line, &tape));
            self.lines.push((base + offset, line.len()));
            let mut item = LineTape {
                line: LineBytes::Chunk(chunk.clone(), range),
                tape,
            };
            loop {
                match self.sink.try_send(item) {
                    Ok(()) | Err(TrySendError::Disconnected(_)) => break,
                    Err(TrySendError::Full(back)) if when_full() => item = back,
                    Err(TrySendError::Full(back)) => {
                        self.sink.send(back);
                        break;
                    }
                }
            }
        }
    }

    fn into_lines(self) -> StreamedLines {
        (self.lines, self.call_ids)
    }
}

/// The payload digests of a streamed freeze's lines (see `Store::freeze_streaming`), hashed
/// by whichever threads take steps: lines are added as they are read, and each step claims
/// the first unclaimed one. A line is dropped once hashed (its chunk may go back to its ring).
#[derive(Default)]
struct DigestBoard<'b> {
    board: Mutex<Board<'b>>,
    stored: Condvar,
}

#[derive(Default)]
struct Board<'b> {
    /// The lines read and not yet claimed, oldest first, with their index.
    waiting: VecDeque<(usize, LineBytes<'b>)>,
    /// Every line's digest once hashed, in line order.
    digests: Vec<Option<String>>,
    /// How many digests are stored.
    hashed: usize,
    read_all: bool,
}

impl<'b> DigestBoard<'b> {
    fn lock(&self) -> MutexGuard<'_, Board<'b>> {
        self.board
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The next line read.
    fn add(&self, line: LineBytes<'b>) {
        let mut board = self.lock();
        let index = board.digests.len();
        board.digests.push(None);
        board.waiting.push_back((index, line));
    }

    /// No line will be added.
    fn all_read(&self) {
        self.lock().read_all = true;
    }

    /// Every digest in line order, once every line is added: hashes what is unclaimed and
    /// waits for the lines other threads are hashing.
    fn collect(&self) -> Vec<String> {
        while self.step() {}
        let mut board = self.lock();
        while board.hashed < board.digests.len() {
            board = self
                .stored
                .wait(board)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        let digests = std::mem::take(&mut board.digests);
        board.hashed = 0;
        digests.into_iter().flatten().collect()
    }
}

impl SideWork for DigestBoard<'_> {
    fn urgent(&self) -> bool {
        let board = self.lock();
        board.read_all && !board.waiting.is_empty()
    }

    fn step(&self) -> bool {
        // Two lines at a time: hashed together, ~1.4x as fast. A line alone is left for the
        // next one until every line is read (profiled on W2 freezes, lines claimed alone as
        // they came were a quarter of the bytes hashed); then the last is hashed alone.
        let (first, second) = {
            let mut board = self.lock();
            if board.waiting.len() < 2 && !board.read_all {
                return false;
            }
            let Some(first) = board.waiting.pop_front() else {
                return false;
            };
            (first, board.waiting.pop_front())
        };
        // Hashing neither fails nor panics: a claimed line always gets its digest stored, so
        // `collect` never waits for a line no thread will hash.
        let (digest, second) = match second {
            Some((index, line)) => {
                let (a, b) = payload_digest_pair(first.1.bytes(), line.bytes());
                (a, Some((index, b)))
            }
            None => (payload_digest(first.1.bytes()), None),
        };
        let index = first.0;
        drop(first); // the line's chunk goes back to the reader before the board is locked
        let mut board = self.lock();
        for (index, digest) in std::iter::once((index, digest)).chain(second) {
            board.digests[index] = Some(digest);
            board.hashed += 1;
        }
        drop(board);
        self.stored.notify_all();
        true
    }
}

/// The ranges of the first line of each call id, in file order; the first line without a
/// call id (as `call_ids` answers for each of `lines`) is corruption.
pub(crate) fn first_records(
    log: &Path,
    lines: &[(u64, usize)],
    call_ids: impl IntoIterator<Item = std::result::Result<String, LineError>>,
) -> Result<Vec<Range<usize>>> {
    let mut seen = HashSet::new();
    let mut records = Vec::new();
    for (&(offset, len), call_id) in lines.iter().zip(call_ids) {
        let call_id = call_id.map_err(|e| Error::corrupt(log, offset, e.0))?;
        if seen.insert(call_id) {
            let start = offset as usize;
            records.push(start..start + len);
        }
    }
    Ok(records)
}

/// What a read of a rollout without a log returns (its decoder sees no lines).
fn no_records<D>(
    decode: impl for<'b> FnOnce(LinesToDecode<'b>) -> D,
) -> (Records, Vec<Range<usize>>, D) {
    let decoded = decode(LinesToDecode::Whole {
        buf: &[],
        lines: &[],
    });
    (Records::default(), Vec::new(), decoded)
}

/// Logs at least this large are hashed and walked on two threads (and freezes and reads of
/// them stream: see `stream_taped_lines`).
pub(crate) const PARALLEL_SCAN_BYTES: usize = 256 << 10;

fn scan_lines<'b>(log: &LogLines<'b>, indexed: u64, scan: Scan) -> Vec<ScannedLine<'b>> {
    let all = &log.lines;
    if let Scan::Scanned { digests, call_ids } = scan {
        // A streamed read: every line was walked (its bytes may be gone).
        debug_assert!(digests.len() == all.len() && call_ids.len() == all.len());
        return all
            .iter()
            .zip(digests.into_iter().zip(call_ids))
            .map(|(&(offset, len), (digest, call_id))| {
                let (call_id, walked) = if offset >= indexed {
                    (Some(call_id), None)
                } else {
                    (None, Some(call_id))
                };
                ScannedLine {
                    offset,
                    len,
                    digest,
                    call_id,
                    fallback: CallIdFallback::Walked(walked),
                }
            })
            .collect();
    }
    let whole: Vec<(u64, &'b [u8])> = all
        .iter()
        .map(|&line| (line.0, log.bytes(line).expect("a whole log's bytes")))
        .collect();
    let work = |chunk: &[(u64, &'b [u8])]| {
        let mut repeats = Repeats::new();
        let digests = payload_digests(chunk.iter().map(|&(_, line)| line));
        chunk
            .iter()
            .zip(digests)
            .map(|(&(offset, line), digest)| {
                let call_id =
                    (offset >= indexed).then(|| extract_call_id(line, Some(&mut repeats)));
                (digest, call_id)
            })
            .collect::<Vec<(String, Option<std::result::Result<String, LineError>>)>>()
    };
    let parallel = matches!(scan, Scan::Parallel) && log.len >= PARALLEL_SCAN_BYTES as u64;
    let results = if parallel && whole.len() > 1 {
        // Split by bytes, not lines: one huge line must not leave the other thread idle.
        let half = log.len / 2;
        let split = whole.partition_point(|&(offset, _)| offset < half).max(1);
        let (first, second) = whole.split_at(split);
        let cores = spread::Split::begin();
        let splitting = &cores;
        std::thread::scope(|scope| {
            let other = scope.spawn(move || {
                let _cores = splitting.enter_helper();
                work(second)
            });
            let mut results = work(first);
            results.extend(other.join().expect("scan thread"));
            results
        })
    } else {
        work(&whole)
    };
    whole
        .iter()
        .zip(results)
        .map(|(&(offset, bytes), (digest, call_id))| ScannedLine {
            offset,
            len: bytes.len(),
            digest,
            call_id,
            fallback: CallIdFallback::Walk(bytes),
        })
        .collect()
}

/// A rollout without a log is fine unless its state index says the log held records: then
/// acknowledged entries vanished, and carrying on would index new lines at wrong offsets.
fn missing_log(cached: &Cached, paths: &RolloutPaths) -> Result<()> {
    if cached.state.indexed_size > 0 {
        return Err(Error::corrupt(
            &paths.log,
            0,
            format!(
                "the log is missing but {} indexes {} bytes of it",
                paths.state.display(),
                cached.state.indexed_size
            ),
        ));
    }
    Ok(())
}

/// True when an acknowledged intent has no stored entry.
fn has_dangling_intent(path: &Path, state: &State) -> Result<bool> {
    let bytes = match descriptors::retry(|| std::fs::read(path)) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(err).ctx("read intents", path),
    };
    // Lines are matched as NeMo Gym's store matches them: stripped, blank ones skipped.
    let dangling = complete_lines(&bytes, 0).any(|(_, line)| match std::str::from_utf8(line) {
        Ok(id) => {
            let id = id.trim_matches(is_line_space);
            !id.is_empty() && !state.entry_digests.contains_key(id)
        }
        Err(_) => true,
    });
    Ok(dangling)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn coalesced_syncs_cover_every_caller_with_a_run_started_after_it_asked() {
        use std::time::Instant;
        let syncs = Arc::new(Coalesced::default());
        let runs = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
        let callers: Vec<_> = (0..12)
            .map(|i| {
                let (syncs, runs) = (Arc::clone(&syncs), Arc::clone(&runs));
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(3 * (i % 4)));
                    let asked = Instant::now();
                    syncs
                        .run(|| {
                            let started = Instant::now();
                            std::thread::sleep(Duration::from_millis(20));
                            runs.lock().unwrap().push((started, Instant::now()));
                            Ok(())
                        })
                        .unwrap();
                    (asked, Instant::now())
                })
            })
            .collect();
        let calls: Vec<_> = callers.into_iter().map(|t| t.join().unwrap()).collect();
        let runs = runs.lock().unwrap();
        // Each call returned only after a run that began after it asked had ended.
        for (asked, returned) in &calls {
            let covered = runs
                .iter()
                .any(|(started, ended)| started >= asked && ended <= returned);
            assert!(
                covered,
                "a call returned before any run that started after it"
            );
        }
        // And they shared: runs never overlapped, and fewer ran than were asked for.
        let mut sorted = runs.clone();
        sorted.sort();
        assert!(
            sorted.windows(2).all(|w| w[0].1 <= w[1].0),
            "runs overlapped"
        );
        assert!(
            runs.len() < calls.len(),
            "{} runs for {} calls",
            runs.len(),
            calls.len()
        );
    }

    #[test]
    fn a_failed_coalesced_run_fails_its_runner_and_the_waiters_run_again() {
        let syncs = Coalesced::default();
        let failed = syncs.run(|| Err(Error::InvalidInput("disk on fire".into())));
        assert!(matches!(failed, Err(Error::InvalidInput(_))));
        // Nothing was covered: the next caller runs it itself.
        let mut ran = false;
        syncs
            .run(|| {
                ran = true;
                Ok(())
            })
            .unwrap();
        assert!(ran);
    }

    /// Append `bytes` to the file at `path` as they are (a torn or foreign line, no put).
    fn append_raw(path: &Path, bytes: &[u8]) {
        let mut file = OpenOptions::new().append(true).open(path).unwrap();
        file.write_all(bytes).unwrap();
    }

    /// A rollout whose log is at least `bytes` long: prompts that grow by repeating the
    /// previous prompt and answer, as an agentic rollout's do.
    fn growing_log(store: &Store, rollout_id: &str, bytes: u64) -> usize {
        let log_len = || {
            store
                .paths(rollout_id)
                .log
                .metadata()
                .map_or(0, |m| m.len())
        };
        let mut prompt: Vec<String> = Vec::new();
        let mut calls = 0;
        while log_len() < bytes {
            prompt.extend((0..700).map(|i| ((calls * 7919 + i * 104_729) % 151_936).to_string()));
            let line = format!(
                r#"{{"generation_log_probs":[-0.5,-1.25e-3],"model_call_id":"c{calls}","prompt_token_ids":[{}]}}"#,
                prompt.join(",")
            );
            store
                .put(rollout_id, &format!("c{calls}"), line.as_bytes())
                .unwrap();
            calls += 1;
        }
        calls
    }

    /// The feed of a large log's freeze.
    fn taped(lines: LinesToDecode<'_>) -> TapeFeed<'_> {
        match lines {
            LinesToDecode::Taped(feed) => feed,
            LinesToDecode::Whole { .. } => panic!("a large log comes with tapes"),
        }
    }

    /// Every line `feed` hands out, in order, with the value its tape replays to (or its tape's
    /// error); each line is given back to the ring once replayed.
    fn replay_feed(
        feed: &TapeFeed<'_>,
        replayed: &mut crate::json::tests::Echo,
    ) -> Vec<(Vec<u8>, std::result::Result<String, LineError>)> {
        let mut replay = crate::json::tape::Replay::new();
        let mut got = Vec::new();
        for sent in feed.iter() {
            let value = match &sent.tape {
                Ok(tape) => replay.value(tape, sent.line(), replayed),
                Err(err) => Err(err.clone()),
            };
            got.push((sent.line().to_vec(), value));
            feed.give_back(sent);
        }
        got
    }

    /// Each line a freeze sent, built from its tape and, for comparison, by one walk over the
    /// lines (repeats reused) as a decoder without tapes builds them.
    fn replayed_and_walked(lines: LinesToDecode<'_>) -> (Vec<String>, Vec<String>) {
        let mut replay = crate::json::tape::Replay::new();
        let mut replayed = crate::json::tests::Echo::default();
        let feed = taped(lines);
        let mut built = Vec::new();
        let mut copies = Vec::new();
        for sent in feed.iter() {
            let tape = sent.tape.as_ref().unwrap();
            built.push(replay.value(tape, sent.line(), &mut replayed).unwrap());
            copies.push(sent.line().to_vec());
            feed.give_back(sent); // its chunk may be reused
        }
        let mut repeats = Repeats::new();
        let mut walked = crate::json::tests::Echo::default();
        let walks = copies
            .iter()
            .map(|line| crate::json::build(line, &mut walked, Some(&mut repeats)).unwrap())
            .collect();
        (built, walks)
    }

    #[test]
    fn sweep_retired_removes_old_fences_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        store.retire(&["b", "a"]).unwrap();
        store.begin_call("live", "c1").unwrap();
        // No fence was written before the epoch.
        assert!(store.sweep_retired(0.0, false).unwrap().is_empty());
        let later = f64::INFINITY;
        assert_eq!(store.sweep_retired(later, true).unwrap(), ["a", "b"]);
        assert!(store.paths("a").state.exists(), "a dry run changes nothing");
        assert_eq!(store.sweep_retired(later, false).unwrap(), ["a", "b"]);
        for id in ["a", "b"] {
            let paths = store.paths(id);
            assert!(!paths.state.exists() && !paths.lock.exists());
        }
        let live = store.paths("live");
        assert!(live.intents.exists() && live.lock.exists());
        assert!(store.sweep_retired(later, false).unwrap().is_empty());
    }

    #[test]
    fn begin_call_unless_stored_writes_no_intent_for_a_call_already_stored() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let line = |call: &str| format!(r#"{{"model_call_id":"{call}","n":1}}"#).into_bytes();
        let intents = |store: &Store| std::fs::read(store.paths("r").intents).unwrap();
        assert!(!store.begin_call_unless_stored("r", "c1").unwrap());
        assert_eq!(intents(&store), b"c1\n");
        store.put("r", "c1", &line("c1")).unwrap();
        assert!(store.begin_call_unless_stored("r", "c1").unwrap());
        assert_eq!(
            intents(&store),
            b"c1\n",
            "a stored call's retry wrote an intent"
        );
        // Another process's put (another store on the directory) is seen: the log is folded.
        let other = Store::open(dir.path(), 8).unwrap();
        other.begin_call("r", "c2").unwrap();
        other.put("r", "c2", &line("c2")).unwrap();
        assert!(store.begin_call_unless_stored("r", "c2").unwrap());
        assert!(!store.begin_call_unless_stored("r", "c3").unwrap());
        assert_eq!(intents(&store), b"c1\nc2\nc3\n");
        // Frozen: a stored call is still found (its answer can be given again), a new one is
        // refused as begin_call refuses it; retired: nothing is stored any more.
        store.freeze("r").unwrap();
        assert!(store.begin_call_unless_stored("r", "c1").unwrap());
        assert!(matches!(
            store.begin_call_unless_stored("r", "c4"),
            Err(Error::Frozen(_))
        ));
        store.retire(&["r"]).unwrap();
        assert!(matches!(
            store.begin_call_unless_stored("r", "c1"),
            Err(Error::Retired(_))
        ));
    }

    #[test]
    fn a_put_that_keeps_the_stored_entry_writes_and_marks_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let line = |call: &str, n: u32| format!(r#"{{"model_call_id":"{call}","n":{n}}}"#);
        let log = |store: &Store| std::fs::read_to_string(store.paths("r").log).unwrap();
        let keep = |store: &Store, call: &str, n: u32| {
            store.put_as("r", call, line(call, n).as_bytes(), OnConflict::Keep)
        };
        assert_eq!(keep(&store, "c1", 1).unwrap(), PutOutcome::Appended);
        // Another attempt of c1 with another answer: the first stands, nothing is marked.
        assert_eq!(keep(&store, "c1", 2).unwrap(), PutOutcome::Kept);
        assert_eq!(keep(&store, "c1", 1).unwrap(), PutOutcome::Duplicate);
        assert_eq!(log(&store), format!("{}\n", line("c1", 1)));
        assert!(!store.is_incomplete("r").unwrap());
        // Stored by another process (another store on the directory): folded in, then kept.
        let other = Store::open(dir.path(), 8).unwrap();
        other.put("r", "c2", line("c2", 1).as_bytes()).unwrap();
        assert_eq!(keep(&store, "c2", 2).unwrap(), PutOutcome::Kept);
        // Queued behind one writer in one batch: the first of the two is stored, then the
        // second is judged against it.
        let (sender, receiver) = mpsc::channel();
        let mut batches = Vec::new();
        for (call, n) in [("c3", 1), ("c3", 2)] {
            let sender = sender.clone();
            let done: PutDone = Box::new(move |outcome| sender.send(outcome).unwrap());
            let queued = store.queue_put_as(
                "r",
                call,
                line(call, n).into_bytes(),
                OnConflict::Keep,
                done,
            );
            batches.extend(queued);
        }
        assert_eq!(
            batches.len(),
            1,
            "the second put did not queue behind the first"
        );
        store.write_puts("r", batches.pop().unwrap());
        let outcomes: Vec<_> = receiver.try_iter().map(Result::unwrap).collect();
        assert_eq!(outcomes, [PutOutcome::Appended, PutOutcome::Kept]);
        assert!(!store.is_incomplete("r").unwrap());
        let snapshot = store.freeze("r").unwrap();
        assert!(!snapshot.incomplete);
        // SPEC's rule is unchanged for an ordinary put: the conflict marks the rollout.
        store.delete(&["r"]).unwrap();
        store.put("r", "c1", line("c1", 1).as_bytes()).unwrap();
        assert!(matches!(
            store.put("r", "c1", line("c1", 2).as_bytes()),
            Err(Error::Conflict { .. })
        ));
        assert!(store.is_incomplete("r").unwrap());
    }

    #[test]
    fn puts_write_no_state_index_before_the_first_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let paths = store.paths("r");
        let line = |n: usize| format!(r#"{{"model_call_id":"c{n}","n":{n}}}"#).into_bytes();
        for n in 1..CHECKPOINT_ENTRIES {
            store.put("r", &format!("c{n}"), &line(n)).unwrap();
            assert!(!paths.state.exists(), "put {n} wrote the state index");
        }
        let n = CHECKPOINT_ENTRIES;
        store.put("r", &format!("c{n}"), &line(n)).unwrap();
        let (_, state) = state::open_and_read(&paths.state).unwrap().unwrap();
        assert_eq!(state.entry_digests.len(), CHECKPOINT_ENTRIES);
        assert_eq!(state.version, CHECKPOINT_ENTRIES as u64);
        assert_eq!(state.indexed_size, paths.log.metadata().unwrap().len());
        assert!(!paths.state_tmp.exists());
    }

    #[test]
    fn a_fence_another_store_writes_after_a_first_put_is_seen() {
        let line = |call: &str| format!(r#"{{"model_call_id":"{call}","n":1}}"#).into_bytes();
        // Each fence, then each operation that must see it through an index cached with no
        // state file.
        for fence in ["freeze", "retire"] {
            for then in ["put", "begin_call"] {
                let dir = tempfile::tempdir().unwrap();
                let store = Store::open(dir.path(), 8).unwrap();
                store.put("r", "c1", &line("c1")).unwrap();
                store.put("r", "c2", &line("c2")).unwrap();
                assert!(!store.paths("r").state.exists());
                let other = Store::open(dir.path(), 8).unwrap();
                match fence {
                    "freeze" => drop(other.freeze("r").unwrap()),
                    _ => drop(other.retire(&["r"]).unwrap()),
                }
                let refused = match then {
                    "put" => store.put("r", "c3", &line("c3")).map(|_| ()),
                    _ => store.begin_call("r", "c3"),
                };
                match (fence, refused) {
                    ("freeze", Err(Error::Frozen(_))) | ("retire", Err(Error::Retired(_))) => {}
                    (_, other) => panic!("{then} after another store's {fence}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_store_shows_its_spare_read_buffers_by_size_not_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap().without_maps();
        growing_log(&store, "r", 4 * CHUNK_BYTES as u64);
        store.freeze_decoding("r", |_| ()).unwrap();
        assert!(
            !store.spare_chunks().is_empty(),
            "the ring's chunks are kept"
        );
        let shown = format!("{store:?}");
        assert!(shown.contains("spare_chunks: Some("), "{shown}");
        // Four 512 KiB chunks printed byte by byte would be megabytes.
        assert!(shown.len() < 2_000, "{} bytes: {shown:.300}", shown.len());
    }

    #[test]
    fn a_large_freeze_hands_its_decoder_one_tape_per_line_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let calls = growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 + 1);
        // A second copy of the last line (a writer's retry that crashed before its index
        // update): decoded, not a record.
        let log = store.paths("r").log;
        let bytes = std::fs::read(&log).unwrap();
        let last = bytes[..bytes.len() - 1]
            .rsplit(|&b| b == b'\n')
            .next()
            .unwrap();
        let mut copy = last.to_vec();
        copy.push(b'\n');
        append_raw(&log, &copy);
        let bytes = std::fs::read(&log).unwrap();
        let (snapshot, ranges, (replayed, walked)) =
            store.freeze_decoding("r", replayed_and_walked).unwrap();
        assert_eq!(snapshot.records.lines.len(), calls);
        assert_eq!(replayed.len(), calls + 1);
        assert_eq!(replayed, walked);
        let expected: Vec<Range<usize>> = complete_lines(&bytes, 0)
            .map(|(offset, line)| offset as usize..offset as usize + line.len())
            .collect();
        assert_eq!(ranges, expected);
        // Read through the chunk ring: the snapshot keeps no copy of the log.
        assert!(snapshot.records.buf.is_empty());
    }

    #[test]
    fn a_large_freeze_truncates_a_torn_tail_it_read_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let calls = growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 * 3);
        let log = store.paths("r").log;
        let complete = std::fs::metadata(&log).unwrap().len();
        append_raw(
            &log,
            b"{\"model_call_id\":\"torn\",\"prompt_token_ids\":[1,2",
        );
        let (snapshot, ranges, (replayed, _)) =
            store.freeze_decoding("r", replayed_and_walked).unwrap();
        assert_eq!(snapshot.records.lines.len(), calls);
        assert_eq!(ranges.len(), calls);
        assert_eq!(replayed.len(), calls);
        assert_eq!(std::fs::metadata(&log).unwrap().len(), complete);
    }

    #[test]
    fn a_large_freeze_refuses_a_line_past_its_index_without_a_call_id() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 + 1);
        let log = store.paths("r").log;
        append_raw(&log, b"{\"prompt_token_ids\":[1,2]}\n");
        let frozen = store.freeze_decoding("r", |lines| taped(lines).iter().count());
        assert!(
            matches!(&frozen, Err(Error::Corrupt { detail, .. }) if detail.contains("no model_call_id")),
            "{frozen:?}"
        );
    }

    fn slow_decode(lines: LinesToDecode<'_>) {
        for sent in taped(lines).iter() {
            std::thread::sleep(Duration::from_millis(2));
            drop(sent);
        }
    }

    fn quitting_decode(lines: LinesToDecode<'_>) {
        drop(lines);
    }

    /// Takes every line as the real decoders do (the urgent side work first), builds nothing.
    fn replaying_decode(lines: LinesToDecode<'_>) {
        let feed = taped(lines);
        let mut lines = feed.iter();
        loop {
            if let Some(side) = feed.urgent_side_work() {
                while side.step() {}
            }
            let Some(sent) = lines.next() else {
                return;
            };
            feed.give_back(sent);
        }
    }

    /// Lines for the chunk-ring tests: records whose prompts grow by repeating the previous
    /// prompt (so repeated arrays span chunk boundaries), one line that is not JSON, one
    /// without a call id, and lines of a few bytes.
    fn ring_test_lines() -> Vec<String> {
        let mut rng = crate::json::tests::Lcg(7);
        let mut prompt: Vec<String> = Vec::new();
        let mut lines = Vec::new();
        for i in 0..90 {
            let add = rng.next(300) as usize;
            prompt.extend((0..add).map(|k| ((k * 7919 + i * 31) % 151_936).to_string()));
            lines.push(format!(
                r#"{{"model_call_id":"c{i}","prompt_token_ids":[{}],"generation_log_probs":[-0.5,1e-3],"n":-{i}}}"#,
                prompt.join(",")
            ));
            match i {
                10 => lines.push("not json".to_owned()),
                20 => lines.push(r#"{"prompt_token_ids":[1,2]}"#.to_owned()),
                30 => lines.push("{}".to_owned()),
                40 => lines.push(String::new()),
                _ => {}
            }
        }
        lines
    }

    #[test]
    fn a_streamed_read_hands_out_each_line_and_its_tape_whatever_the_chunk_size() {
        // The expected values come from the file's bytes alone: `complete_lines`, one direct
        // walk (repeats carried across lines) and `extract_call_id` per line.
        let lines = ring_test_lines();
        let mut content = lines.join("\n").into_bytes();
        content.push(b'\n');
        let longest = lines.iter().map(String::len).max().unwrap();
        assert!(
            longest > 8_000 && content.len() > 400_000,
            "{longest} {}",
            content.len()
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.jsonl");
        for torn in [
            &b""[..],
            b"{\"model_call_id\":\"torn\",\"prompt_token_ids\":[1,",
        ] {
            let mut bytes = content.clone();
            bytes.extend_from_slice(torn);
            std::fs::write(&path, &bytes).unwrap();
            let expected_lines: Vec<(u64, usize)> = complete_lines(&bytes, 0)
                .map(|(offset, line)| (offset, line.len()))
                .collect();
            assert_eq!(expected_lines.len(), lines.len());
            let expected_ids: Vec<_> = lines
                .iter()
                .map(|line| extract_call_id(line.as_bytes(), None))
                .collect();
            let mut direct = crate::json::tests::Echo::default();
            let mut repeats = Repeats::new();
            let walked: Vec<_> = lines
                .iter()
                .map(|line| crate::json::build(line.as_bytes(), &mut direct, Some(&mut repeats)))
                .collect();
            // The integers a replay of one walk over the whole buffer is handed one by one (a
            // tape walk forgets its repeats after a line that fails, a direct walk does not).
            let ranges: Vec<Range<usize>> = expected_lines
                .iter()
                .map(|&(offset, len)| offset as usize..offset as usize + len)
                .collect();
            let mut whole_replayed = crate::json::tests::Echo::default();
            let mut whole_replay = crate::json::tape::Replay::new();
            crate::json::tape::tape_lines(&bytes, &ranges, |sent| {
                if let Ok(tape) = &sent.tape {
                    let _ = whole_replay.value(tape, sent.line(), &mut whole_replayed);
                }
                true
            });
            let mut plain = crate::json::tests::Echo::default();
            for line in &lines {
                let _ = crate::json::build(line.as_bytes(), &mut plain, None);
            }
            assert!(whole_replayed.parsed_unsigned * 5 < plain.parsed_unsigned);
            // 1 and 7: every line is longer than a chunk; 4096: most are; the default: one.
            for chunk_bytes in [1, 7, 4_096, 65_536 + 3, CHUNK_BYTES] {
                let file = File::open(&path).unwrap();
                let mut ring = Ring::new(Vec::new(), chunk_bytes);
                let mut shown = Vec::new();
                let (sink, feed) = tape_channel(TAPES_AHEAD);
                let mut replayed = crate::json::tests::Echo::default();
                let len = bytes.len() as u64;
                let (streamed, got) = std::thread::scope(|scope| {
                    let ring = &mut ring;
                    let shown = &mut shown;
                    let reading = scope.spawn(move || {
                        let each = |chunk: &Shared, range: Range<usize>| {
                            shown.push(chunk.bytes()[range].to_vec())
                        };
                        let read = stream_taped_lines(&file, len, ring, &sink, each, || false);
                        drop(sink);
                        read.unwrap()
                    });
                    let got = replay_feed(&feed, &mut replayed);
                    (reading.join().unwrap(), got)
                });
                let (read_lines, call_ids) = streamed;
                assert_eq!(read_lines, expected_lines, "chunk {chunk_bytes}");
                assert_eq!(call_ids, expected_ids, "chunk {chunk_bytes}");
                let expected_bytes: Vec<Vec<u8>> =
                    lines.iter().map(|line| line.as_bytes().to_vec()).collect();
                assert_eq!(shown, expected_bytes, "chunk {chunk_bytes}");
                let (sent_bytes, values): (Vec<_>, Vec<_>) = got.into_iter().unzip();
                assert_eq!(sent_bytes, expected_bytes, "chunk {chunk_bytes}");
                assert_eq!(values, walked, "chunk {chunk_bytes}");
                // Repeated arrays were reused across chunks as a direct walk reuses them.
                assert_eq!(
                    replayed.parsed_unsigned, whole_replayed.parsed_unsigned,
                    "chunk {chunk_bytes}"
                );
                assert!(replayed.parsed_unsigned < direct.parsed_unsigned * 2);
                // The buffers are recycled: a bounded few, whatever the number of chunks.
                let chunks = bytes.len() / chunk_bytes.max(longest);
                assert!(
                    ring.allocated <= 30,
                    "chunk {chunk_bytes}: {}",
                    ring.allocated
                );
                if chunk_bytes == 4_096 {
                    assert!(chunks > 30 && ring.allocated < chunks, "{chunks}");
                }
            }
            // A file shorter than the length asked for is an error (a log cut under a read).
            let file = File::open(&path).unwrap();
            let (sink, _feed) = tape_channel(lines.len() + 1);
            let short = stream_taped_lines(
                &file,
                bytes.len() as u64 + 1,
                &mut Ring::new(Vec::new(), 4_096),
                &sink,
                |_, _| {},
                || false,
            );
            assert_eq!(short.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        }
    }

    #[test]
    fn a_freeze_reads_a_line_longer_than_its_chunk_and_checks_its_digest() {
        // A 2.6 MB line among lines that cross the chunk boundaries (`CHUNK_BYTES`), frozen
        // through the chunk ring and, for comparison, through one whole-log buffer
        // (`Store::freeze`).
        let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let store = Store::open(first.path(), 8).unwrap();
        let mut prompt: Vec<String> = Vec::new();
        for call in 0..40usize {
            let add: usize = if call == 17 { 400_000 } else { 6_000 };
            prompt.extend((0..add).map(|i| ((call * 7919 + i * 104_729) % 151_936).to_string()));
            let tokens = if call == 17 {
                prompt.join(",")
            } else {
                prompt[prompt.len() - 6_000..].join(",")
            };
            let line = format!(r#"{{"model_call_id":"c{call}","prompt_token_ids":[{tokens}]}}"#);
            store
                .put("r", &format!("c{call}"), line.as_bytes())
                .unwrap();
        }
        let log = store.paths("r").log;
        let bytes = std::fs::read(&log).unwrap();
        let longest = complete_lines(&bytes, 0)
            .map(|(_, l)| l.len())
            .max()
            .unwrap();
        assert!(longest > 2 * CHUNK_BYTES && bytes.len() > 4 * CHUNK_BYTES);
        for name in ["r.tokens.jsonl", "r.tokens.state.json"] {
            std::fs::copy(first.path().join(name), second.path().join(name)).unwrap();
        }
        let (snapshot, ranges, (replayed, walked)) =
            store.freeze_decoding("r", replayed_and_walked).unwrap();
        let expected: Vec<Range<usize>> = complete_lines(&bytes, 0)
            .map(|(offset, line)| offset as usize..offset as usize + line.len())
            .collect();
        assert_eq!(ranges, expected);
        assert_eq!(snapshot.records.lines, expected);
        assert_eq!(replayed, walked);
        assert_eq!(replayed.len(), 40);
        let whole = Store::open(second.path(), 8).unwrap().freeze("r").unwrap();
        assert_eq!(whole.records.lines, snapshot.records.lines);
        assert_eq!(whole.version, snapshot.version);
        // Every line is indexed now; one digit changed in the middle of the long line (still
        // valid JSON, same length) must be refused by the next freeze.
        let long = &expected[17];
        let mut damaged = bytes.clone();
        let at = (long.start + long.len() / 2..long.end)
            .find(|&i| damaged[i].is_ascii_digit() && damaged[i - 1].is_ascii_digit())
            .unwrap();
        damaged[at] = if damaged[at] == b'9' {
            b'1'
        } else {
            damaged[at] + 1
        };
        std::fs::write(&log, &damaged).unwrap();
        let store = Store::open(first.path(), 8).unwrap();
        let frozen = store.freeze_decoding("r", replaying_decode);
        assert!(
            matches!(&frozen, Err(Error::Corrupt { offset, detail, .. })
                if detail.contains("payload digest") && *offset == long.start as u64),
            "{frozen:?}"
        );
    }

    /// A log whose line lengths are picked around `chunk` (empty lines, `chunk - 1`, `chunk`,
    /// `chunk + 1`, several chunks, a few bytes), so that lines end exactly at a chunk's end,
    /// a newline is the first or the last byte of a read, and a line spans several chunks;
    /// some end in `\r` (JSON whitespace, part of the line), some are not JSON, some repeat
    /// the previous long token array (repeats across chunks); then a torn tail of any length.
    fn boundary_log(rng: &mut crate::json::tests::Lcg, chunk: usize) -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut ids: Vec<String> = Vec::new();
        for call in 0..12 + rng.next(12) as usize {
            let target = match rng.next(9) {
                0 => 0,
                1 => chunk.saturating_sub(1),
                2 => chunk,
                3 => chunk + 1,
                4 => 2 * chunk,
                5 => 3 * chunk + 1,
                6 => rng.next(40) as usize,
                _ => chunk * (1 + rng.next(3) as usize) - 1 + rng.next(3) as usize,
            };
            let mut line = match rng.next(10) {
                0 => b"not json".to_vec(),
                1 if target > 0 => Vec::new(), // an empty line: no record
                2..=4 => {
                    // The previous prompt and a few more ids: a repeat of a long array.
                    let start = ids.len() as u64;
                    ids.extend((0..64 + rng.next(40)).map(|k| (k * 7919 + start).to_string()));
                    format!(
                        r#"{{"model_call_id":"c{call}","prompt_token_ids":[{}]}}"#,
                        ids.join(",")
                    )
                    .into_bytes()
                }
                _ => format!(r#"{{"model_call_id":"c{call}","pad":""}}"#).into_bytes(),
            };
            if line.ends_with(br#""pad":""}"#) && line.len() < target {
                // Pad the string up to the target length.
                let fill = target - line.len();
                let at = line.len() - 2;
                line.splice(at..at, std::iter::repeat_n(b'x', fill));
            }
            if rng.next(5) == 0 {
                line.push(b'\r');
            }
            bytes.extend_from_slice(&line);
            bytes.push(b'\n');
        }
        let torn = match rng.next(4) {
            0 => 0,
            1 => 1 + rng.next(chunk as u64) as usize,
            2 => chunk,
            _ => 2 * chunk + 1,
        };
        bytes.extend(std::iter::repeat_n(b'7', torn));
        bytes
    }

    #[test]
    fn a_streamed_read_agrees_with_the_whole_log_at_every_chunk_boundary() {
        // Chunk sizes from 1 byte up, rings that start with spare buffers of any size whose
        // stale bytes are all newlines (a reused buffer is never cleared, so a read that looked
        // past what it filled would cut phantom lines), and a `when_full` that has work to do
        // now and then: every complete line comes out once, in order, with its call id and its
        // value as a direct walk of the whole log gives them, and nothing of the torn tail.
        let mut rng = crate::json::tests::Lcg(2024);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.jsonl");
        for case in 0..160 {
            let chunk = match case % 4 {
                0 => 1 + rng.next(8) as usize,
                1 => 8 + rng.next(64) as usize,
                2 => 64 + rng.next(512) as usize,
                _ => 1_000 + rng.next(3_000) as usize,
            };
            let bytes = boundary_log(&mut rng, chunk);
            std::fs::write(&path, &bytes).unwrap();
            let expected_lines: Vec<(u64, usize)> = complete_lines(&bytes, 0)
                .map(|(offset, line)| (offset, line.len()))
                .collect();
            let expected_bytes: Vec<Vec<u8>> = complete_lines(&bytes, 0)
                .map(|(_, line)| line.to_vec())
                .collect();
            let expected_ids: Vec<_> = complete_lines(&bytes, 0)
                .map(|(_, line)| extract_call_id(line, None))
                .collect();
            let mut direct = crate::json::tests::Echo::default();
            let mut repeats = Repeats::new();
            let walked: Vec<_> = expected_bytes
                .iter()
                .map(|line| crate::json::build(line, &mut direct, Some(&mut repeats)))
                .collect();
            let spare: Vec<Vec<u8>> = (0..rng.next(4))
                .map(|_| {
                    let len = match rng.next(5) {
                        0 => 0,
                        1 => 1,
                        2 => chunk / 2,
                        3 => chunk,
                        _ => 3 * chunk,
                    };
                    vec![b'\n'; len]
                })
                .collect();
            let mut ring = Ring::new(spare, chunk);
            let file = File::open(&path).unwrap();
            let len = bytes.len() as u64;
            let (sink, feed) = tape_channel(1 + rng.next(3) as usize);
            let mut busy = 0u32;
            let ((read_lines, call_ids), got) = std::thread::scope(|scope| {
                let ring = &mut ring;
                let reading = scope.spawn(move || {
                    let when_full = || {
                        busy += 1;
                        !busy.is_multiple_of(3)
                    };
                    let read = stream_taped_lines(&file, len, ring, &sink, |_, _| {}, when_full);
                    drop(sink);
                    read.unwrap()
                });
                let got = replay_feed(&feed, &mut crate::json::tests::Echo::default());
                (reading.join().unwrap(), got)
            });
            let what = format!("case {case}, chunk {chunk}, {} bytes", bytes.len());
            assert_eq!(read_lines, expected_lines, "{what}");
            assert_eq!(call_ids, expected_ids, "{what}");
            let (sent_bytes, values): (Vec<_>, Vec<_>) = got.into_iter().unzip();
            assert_eq!(sent_bytes, expected_bytes, "{what}");
            // A replay stops reusing after a line that fails, so compare the values of lines
            // that built (their errors are the walk's, checked through the call ids).
            for (value, walk) in values.iter().zip(&walked) {
                if let (Ok(value), Ok(walk)) = (value, walk) {
                    assert_eq!(value, walk, "{what}");
                }
                assert_eq!(value.is_ok(), walk.is_ok(), "{what}");
            }
        }
    }

    #[test]
    fn a_streamed_freeze_racing_another_processes_puts_holds_exactly_the_acknowledged_ones() {
        // Puts through a second store (another process: its own cache and kept descriptors)
        // run while this store freezes a large log through the chunk ring. A put acknowledged
        // before the freeze took the lock must be a record of the snapshot; one after it is
        // refused as frozen. So: acknowledged <=> in the snapshot, and a second freeze agrees.
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let other = Store::open(dir.path(), 8).unwrap();
        let before = growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 * 2);
        let started = std::sync::Barrier::new(2);
        let (acknowledged, frozen) = std::thread::scope(|scope| {
            let putting = scope.spawn(|| {
                let mut acknowledged = Vec::new();
                for n in 0.. {
                    let call = format!("late{n}");
                    let line = format!(r#"{{"model_call_id":"{call}","n":{n}}}"#);
                    match other.put("r", &call, line.as_bytes()) {
                        Ok(_) => acknowledged.push(call),
                        Err(Error::Frozen(_)) => break,
                        Err(err) => panic!("{err}"),
                    }
                    if n == 3 {
                        started.wait();
                    }
                }
                acknowledged
            });
            started.wait();
            let frozen = store.freeze_decoding("r", replaying_decode).unwrap();
            (putting.join().unwrap(), frozen)
        });
        let (snapshot, ranges, ()) = frozen;
        assert!(acknowledged.len() >= 4);
        let log = std::fs::read(store.paths("r").log).unwrap();
        let records: Vec<String> = snapshot
            .records
            .lines
            .iter()
            .map(|range| extract_call_id(&log[range.clone()], None).unwrap())
            .collect();
        let expected: Vec<String> = (0..before)
            .map(|call| format!("c{call}"))
            .chain(acknowledged.iter().cloned())
            .collect();
        assert_eq!(records, expected);
        assert_eq!(ranges, snapshot.records.lines);
        // Nothing past the records is left in the log, and both stores freeze to the same.
        let end = snapshot.records.lines.last().unwrap().end + 1;
        assert_eq!(log.len(), end);
        for again in [&store, &other] {
            let (second, _, ()) = again.freeze_decoding("r", replaying_decode).unwrap();
            assert_eq!(second.records.lines, snapshot.records.lines);
            assert_eq!(
                (second.snapshot_id.as_str(), second.version),
                (snapshot.snapshot_id.as_str(), snapshot.version)
            );
        }
    }

    #[test]
    fn a_store_keeps_at_most_eight_chunks_of_its_chunk_size_between_reads() {
        // A decoder that holds every line until it returns makes the ring allocate a chunk
        // for every few lines (300 KB of ~1 KB lines in 4 KiB chunks), and one 20 KB line grows
        // its own buffer: between reads the store keeps at most `MAX_SPARE_CHUNKS` of them,
        // none grown (the bound on what an idle store holds, 4 MiB at the default size).
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8)
            .unwrap()
            .with_chunk_bytes(4_096)
            .without_maps();
        let mut call = 0;
        while store.paths("r").log.metadata().map_or(0, |m| m.len()) < 300_000 {
            let pad = if call == 150 { 20_000 } else { 1_000 };
            let line = format!(
                r#"{{"model_call_id":"c{call}","pad":"{}"}}"#,
                "x".repeat(pad)
            );
            store
                .put("r", &format!("c{call}"), line.as_bytes())
                .unwrap();
            call += 1;
        }
        let hold_all = |lines: LinesToDecode<'_>| taped(lines).iter().collect::<Vec<_>>().len();
        let kept = |store: &Store| {
            let spare = store.spare_chunks();
            assert!(spare.len() <= MAX_SPARE_CHUNKS, "{} kept", spare.len());
            assert!(spare.iter().all(|buf| buf.len() == 4_096));
            spare.len()
        };
        let (_, _, held) = store.read_decoding("r", hold_all).unwrap();
        assert_eq!(held, call);
        assert_eq!(kept(&store), MAX_SPARE_CHUNKS);
        let (_, _, held) = store.freeze_decoding("r", hold_all).unwrap();
        assert_eq!(held, call);
        assert_eq!(kept(&store), MAX_SPARE_CHUNKS);
        // A decoder that gives each line back at once: a few buffers go round, the grown one
        // among them once its line is built; it is not kept.
        for _ in 0..2 {
            store.read_decoding("r", replaying_decode).unwrap();
            assert!(kept(&store) > 0);
        }
    }

    #[test]
    fn a_digest_board_hashes_lines_in_pairs_and_the_last_alone() {
        let lines: Vec<Vec<u8>> = (0..3)
            .map(|i| format!("{{\"model_call_id\":\"c{i}\"}}").into_bytes())
            .collect();
        let board = DigestBoard::default();
        board.add(LineBytes::Borrowed(&lines[0]));
        assert!(!board.step(), "a lone line waits for the next");
        board.add(LineBytes::Borrowed(&lines[1]));
        assert!(board.step());
        assert_eq!(board.lock().hashed, 2, "the two hashed in one step");
        board.add(LineBytes::Borrowed(&lines[2]));
        assert!(!board.step());
        board.all_read();
        assert!(
            board.urgent() && board.step(),
            "the last line, once every line is read"
        );
        let expected: Vec<String> = lines.iter().map(|line| payload_digest(line)).collect();
        assert_eq!(board.collect(), expected);
    }

    #[test]
    fn a_digest_board_hashes_every_line_once_whichever_threads_step() {
        // Lines are added one at a time while another thread takes every step it can; the
        // adding thread steps now and then, and collects: each digest is its line's, in order.
        let lines: Vec<Vec<u8>> = (0..300)
            .map(|i| format!("{{\"model_call_id\":\"c{i}\",\"n\":{}}}", i * 7919).into_bytes())
            .collect();
        let expected: Vec<String> = lines.iter().map(|line| payload_digest(line)).collect();
        for round in 0..20 {
            let board = DigestBoard::default();
            let stepped = std::thread::scope(|scope| {
                let other = scope.spawn(|| {
                    let mut stepped = 0;
                    while !board.lock().read_all || board.urgent() {
                        if board.step() {
                            stepped += 1;
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    stepped
                });
                for (i, line) in lines.iter().enumerate() {
                    board.add(LineBytes::Borrowed(line));
                    if (i + round) % 5 == 0 {
                        board.step();
                    }
                }
                board.all_read();
                assert_eq!(board.collect(), expected, "round {round}");
                other.join().unwrap()
            });
            assert!(stepped <= lines.len());
            assert!(!board.step() && !board.urgent());
        }
    }

    #[test]
    fn a_large_freeze_checks_every_digest_whichever_thread_hashes_it() {
        // A slow decoder leaves the verifying thread hashing while the tape channel is full; a
        // decoder that stops at once leaves the lines to its own thread's help.
        // A decoder shaped like the real ones hashes lines itself: while it waits for a line
        // and, once every line is read, before it builds the next.
        for decode in [slow_decode, quitting_decode, replaying_decode] {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(dir.path(), 8).unwrap();
            let calls = growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 * 2);
            store.freeze("r").unwrap(); // every line indexed: each digest is checked
            let (snapshot, _, ()) = store.freeze_decoding("r", decode).unwrap();
            assert_eq!(snapshot.records.lines.len(), calls);
            // One digit changed inside the last line (still valid JSON, same length).
            let log = store.paths("r").log;
            let mut bytes = std::fs::read(&log).unwrap();
            let at = (bytes.len() - 100..bytes.len())
                .rev()
                .find(|&i| bytes[i].is_ascii_digit() && bytes[i - 1].is_ascii_digit())
                .unwrap();
            bytes[at] = if bytes[at] == b'9' {
                b'1'
            } else {
                bytes[at] + 1
            };
            std::fs::write(&log, &bytes).unwrap();
            let frozen = store.freeze_decoding("r", decode);
            assert!(
                matches!(&frozen, Err(Error::Corrupt { detail, .. }) if detail.contains("payload digest")),
                "{frozen:?}"
            );
        }
    }

    /// Damage a large log as the differential tests do: `kind` 0 leaves it whole, 1 appends a
    /// torn line of `torn` bytes, 2 changes a digit (still valid JSON), 3 makes the line at
    /// `line` not JSON, 4 appends a copy of that line (a crashed retry), 5 appends a line
    /// without a call id.
    fn damage(bytes: &mut Vec<u8>, kind: u64, line: usize, torn: usize) {
        match kind {
            0 => {}
            1 => bytes.extend_from_slice(&b"{\"model_call_id\":\"torn\",\"prompt"[..torn]),
            2 => {
                let at = (line + 60..bytes.len())
                    .find(|&i| bytes[i].is_ascii_digit() && bytes[i - 1].is_ascii_digit())
                    .unwrap();
                bytes[at] = if bytes[at] == b'0' { b'7' } else { b'0' };
            }
            3 => bytes[line] = b'x',
            4 => {
                let end = line + bytes[line..].iter().position(|&b| b == b'\n').unwrap();
                let copy = bytes[line..=end].to_vec();
                bytes.extend_from_slice(&copy);
            }
            _ => bytes.extend_from_slice(b"{\"prompt_token_ids\":[1]}\n"),
        }
    }

    /// A freeze's result with what differs between two copies of one rollout left out (their
    /// directory, the fresh snapshot id).
    fn freeze_outcome(frozen: Result<Snapshot>, dir: &Path) -> String {
        let outcome = match frozen {
            Ok(snapshot) => format!(
                "records {:?} incomplete {} version {}",
                snapshot.records.lines, snapshot.incomplete, snapshot.version
            ),
            Err(err) => err.to_string(),
        };
        outcome.replace(&dir.display().to_string(), "<dir>")
    }

    #[test]
    fn a_streamed_freeze_agrees_with_a_whole_buffer_freeze_on_damaged_logs() {
        // Three copies of one large rollout, damaged alike: the freezes that hand tapes to a
        // decoder, reading the log through a map or in chunks, and the one that reads the
        // whole log first, must return the same, leave the same files, and refuse the same
        // damage the same way.
        let mut rng = crate::json::tests::Lcg(29);
        let mut outcomes = HashSet::new();
        for round in 0..12 {
            let dirs = [(); 3].map(|()| tempfile::tempdir().unwrap());
            let writer = Store::open(dirs[0].path(), 8).unwrap();
            growing_log(&writer, "r", PARALLEL_SCAN_BYTES as u64 + rng.next(400_000));
            if round < 6 {
                writer.freeze("r").unwrap(); // every line indexed
            }
            let log = writer.paths("r").log;
            drop(writer); // every freeze starts from the files alone
            let mut bytes = std::fs::read(&log).unwrap();
            let starts: Vec<usize> = complete_lines(&bytes, 0).map(|(o, _)| o as usize).collect();
            let line = starts[rng.next(starts.len() as u64) as usize];
            // A torn line, once of a single byte.
            let torn = if round < 6 {
                1
            } else {
                2 + rng.next(30) as usize
            };
            damage(&mut bytes, round % 6, line, torn);
            std::fs::write(&log, &bytes).unwrap();
            for name in ["r.tokens.jsonl", "r.tokens.state.json"] {
                let from = dirs[0].path().join(name);
                if from.exists() {
                    for to in &dirs[1..] {
                        std::fs::copy(&from, to.path().join(name)).unwrap();
                    }
                }
            }
            // Chunks from a few hundred bytes (every line longer than one) to the default.
            let chunk_bytes = match round % 3 {
                0 => CHUNK_BYTES,
                1 => 200 + rng.next(2_000) as usize,
                _ => 10_000 + rng.next(200_000) as usize,
            };
            let mapped = Store::open(dirs[0].path(), 8).unwrap();
            let chunked = Store::open(dirs[1].path(), 8)
                .unwrap()
                .with_chunk_bytes(chunk_bytes)
                .without_maps();
            let whole = Store::open(dirs[2].path(), 8).unwrap();
            let streamed = |store: &Store, dir: &Path| {
                let frozen = store.freeze_decoding("r", replaying_decode);
                freeze_outcome(frozen.map(|(snapshot, _, _)| snapshot), dir)
            };
            let whole_outcome = freeze_outcome(whole.freeze("r"), dirs[2].path());
            let state = |dir: &Path| {
                let bytes = std::fs::read(dir.join("r.tokens.state.json")).ok()?;
                let mut state: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                state["snapshot_id"] = serde_json::Value::Null;
                Some(state)
            };
            for (store, dir, how) in [
                (&mapped, &dirs[0], "mapped"),
                (&chunked, &dirs[1], "chunked"),
            ] {
                let outcome = streamed(store, dir.path());
                assert_eq!(outcome, whole_outcome, "round {round}, {how}");
                let left_alike = std::fs::read(dir.path().join("r.tokens.jsonl")).unwrap()
                    == std::fs::read(dirs[2].path().join("r.tokens.jsonl")).unwrap();
                assert!(
                    left_alike,
                    "round {round}, {how}: the freezes left different logs"
                );
                assert_eq!(
                    state(dir.path()),
                    state(dirs[2].path()),
                    "round {round}, {how}"
                );
            }
            outcomes.insert(whole_outcome.split(' ').next().unwrap().to_owned());
        }
        // Both successes and refusals were compared.
        assert!(outcomes.len() > 1, "{outcomes:?}");
    }

    #[test]
    fn a_mapped_freeze_cuts_a_long_torn_tail_while_its_decoder_still_reads() {
        // The freeze cuts a torn tail of several pages off the mapped log as soon as every
        // line is sent, while a slow decoder still builds the last ones from the map: those
        // lie before the cut, so they read whole (a page past the new end would raise SIGBUS
        // and end this test's process).
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 + 100_000);
        let log = store.paths("r").log;
        let whole = std::fs::read(&log).unwrap();
        let torn = format!(
            r#"{{"model_call_id":"torn","pad":"{}"#,
            "x".repeat(5 * 4096)
        );
        append_raw(&log, torn.as_bytes());
        let cut_len = whole.len() as u64;
        // Each line built after a pause, with the log's length at that moment.
        let slow = |lines: LinesToDecode<'_>| {
            taped(lines)
                .iter()
                .map(|line| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    let len = std::fs::metadata(&log).unwrap().len();
                    (line.line().to_vec(), len)
                })
                .collect::<Vec<_>>()
        };
        let (snapshot, _, built) = store.freeze_decoding("r", slow).unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), whole, "the torn tail is cut");
        let lines: Vec<&[u8]> = complete_lines(&whole, 0).map(|(_, line)| line).collect();
        let built_lines: Vec<&[u8]> = built.iter().map(|(line, _)| line.as_slice()).collect();
        assert_eq!(built_lines, lines, "every line built whole");
        assert_eq!(snapshot.records.lines.len(), lines.len());
        let after_cut = built.iter().filter(|(_, len)| *len == cut_len).count();
        let lens: Vec<u64> = built.iter().map(|(_, len)| *len).collect();
        assert!(after_cut > 0, "no line was built after the cut: {lens:?}");
    }

    #[test]
    fn a_large_read_finds_the_records_a_line_by_line_walk_finds() {
        // The read that streams (tapes, call ids from them) against the plain rule, on large
        // logs undamaged and damaged, mapped or read in chunks; a read never changes the log.
        let mut rng = crate::json::tests::Lcg(31);
        let mut refusals = 0;
        for round in 0..12 {
            let dir = tempfile::tempdir().unwrap();
            let writer = Store::open(dir.path(), 8).unwrap();
            growing_log(&writer, "r", PARALLEL_SCAN_BYTES as u64 + rng.next(300_000));
            let log = writer.paths("r").log;
            drop(writer);
            let mut bytes = std::fs::read(&log).unwrap();
            let starts: Vec<usize> = complete_lines(&bytes, 0).map(|(o, _)| o as usize).collect();
            let line = starts[rng.next(starts.len() as u64) as usize];
            damage(&mut bytes, round % 6, line, 1 + rng.next(30) as usize);
            std::fs::write(&log, &bytes).unwrap();
            // The plain rule: the first line of each call id; the first line without one is
            // corruption at its offset.
            let mut seen = HashSet::new();
            let expected: std::result::Result<Vec<Range<usize>>, (u64, String)> =
                complete_lines(&bytes, 0)
                    .filter_map(|(offset, line)| match extract_call_id(line, None) {
                        Ok(call_id) => seen
                            .insert(call_id)
                            .then(|| Ok(offset as usize..offset as usize + line.len())),
                        Err(err) => Some(Err((offset, err.0))),
                    })
                    .collect();
            // Through a map, and in every other round through the chunk ring.
            let store = Store::open(dir.path(), 8).unwrap();
            let store = if round % 2 == 0 {
                store
            } else {
                store.without_maps()
            };
            let read = store.read_decoding("r", |lines| taped(lines).iter().count());
            let complete = complete_lines(&bytes, 0).count();
            match (read, expected) {
                (Ok((records, ranges, decoded)), Ok(expected)) => {
                    assert_eq!(records.lines, expected, "round {round}");
                    assert_eq!(
                        (ranges.len(), decoded),
                        (complete, complete),
                        "round {round}"
                    );
                }
                (Err(Error::Corrupt { offset, detail, .. }), Err(expected)) => {
                    assert_eq!((offset, detail), expected, "round {round}");
                    refusals += 1;
                }
                (read, expected) => panic!("round {round}: {read:?} against {expected:?}"),
            }
            assert!(
                std::fs::read(&log).unwrap() == bytes,
                "round {round}: the read wrote"
            );
        }
        assert!(refusals > 0);
    }

    #[test]
    fn a_small_freeze_decodes_without_tapes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let calls = growing_log(&store, "r", 1);
        let (snapshot, ranges, lines) = store
            .freeze_decoding("r", |lines| match lines {
                LinesToDecode::Whole { lines, .. } => lines.to_vec(),
                LinesToDecode::Taped(_) => panic!("a small log needs no tapes"),
            })
            .unwrap();
        assert_eq!(snapshot.records.lines.len(), calls);
        assert_eq!(lines, ranges);
        assert_eq!(ranges.len(), calls);
    }

    #[test]
    fn a_freeze_whose_decoder_stops_early_still_settles() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let calls = growing_log(&store, "r", PARALLEL_SCAN_BYTES as u64 * 2);
        assert!(
            calls > TAPES_AHEAD + 2,
            "{calls} lines cannot fill the tape channel"
        );
        // The decoder takes one tape and drops the rest: the verifying thread, blocked on a
        // full channel, must see it closed and finish.
        let (snapshot, _, first) = store
            .freeze_decoding("r", |lines| taped(lines).iter().next().is_some())
            .unwrap();
        assert!(first);
        assert_eq!(snapshot.records.lines.len(), calls);
        assert_eq!(store.freeze("r").unwrap().snapshot_id, snapshot.snapshot_id);
    }

    #[test]
    fn intent_lines_are_matched_stripped_and_edged_call_ids_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        for edged in [" a", "a\t", "\x0ba", "a\x0c", " "] {
            assert!(matches!(
                store.begin_call("r", edged),
                Err(Error::InvalidInput(_))
            ));
        }
        store
            .put("r", "a b", br#"{"model_call_id":"a b"}"#)
            .unwrap();
        let state = store.cache().get("r").unwrap().state.clone();
        let intents = dir.path().join("intents");
        let dangling = |lines: &[u8]| {
            std::fs::write(&intents, lines).unwrap();
            has_dangling_intent(&intents, &state).unwrap()
        };
        assert!(!dangling(b" a b\t\n\x0b\x0c\n\n"));
        assert!(dangling(b"a b\n a\n"));
        assert!(!dangling(b"a b\nnot a complete line"));
    }

    #[test]
    fn a_lock_descriptor_inherited_from_another_process_is_never_locked() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let paths = store.paths("r");
        let (file, id) = RolloutLock::acquire(&paths.lock, LockMode::Exclusive)
            .unwrap()
            .unlock()
            .unwrap();
        // After a fork, parent and child share the descriptor's open file description: the
        // parent locking it through its copy must still exclude the child.
        let parent = file.try_clone().unwrap();
        parent.lock().unwrap();
        let kept = KeptLock {
            file: store.cache.account().keep(file),
            id,
            pid: std::process::id().wrapping_add(1),
        };
        let (locked, waiting) = mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let lock = store
                    .lock_exclusive(Some(kept), std::process::id(), &paths)
                    .unwrap();
                locked.send(()).unwrap();
                drop(lock);
            });
            assert!(
                waiting.recv_timeout(Duration::from_millis(300)).is_err(),
                "the child locked the description its parent holds"
            );
            parent.unlock().unwrap();
            waiting.recv_timeout(Duration::from_secs(10)).unwrap();
        });
    }

    /// A forked child holds a copy of the lock descriptor the store keeps (the same open file
    /// description). A later write in the parent that locks it and fails in a way that drops
    /// the cached index (here: the log cut below its index, `Error::Corrupt`) must release the
    /// exclusive lock, not just close its descriptor: the child's copy would hold it for as
    /// long as the child lives, and every read, resolve and write of the rollout in every
    /// process would wait for it.
    #[test]
    fn a_failed_write_releases_its_lock_though_a_forked_child_shares_the_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let line = |call: &str| format!(r#"{{"model_call_id":"{call}","n":1}}"#).into_bytes();
        store.put("r", "c1", &line("c1")).unwrap();
        // The fork: the child's copy of the kept descriptor (after a repeat of the last put,
        // a no-op, if another test's trim of the process budget closed the entry meanwhile).
        let childs_copy = (0..100)
            .find_map(|_| {
                store.put("r", "c2", &line("c2")).unwrap();
                let cache = store.cache();
                cache.peek("r")?.lock.as_ref()?.file.try_clone().ok()
            })
            .expect("a kept lock after a put");
        let paths = store.paths("r");
        OpenOptions::new()
            .write(true)
            .open(&paths.log)
            .unwrap()
            .set_len(5)
            .unwrap();
        assert!(matches!(
            store.put("r", "c3", &line("c3")),
            Err(Error::Corrupt { .. })
        ));
        assert!(
            RolloutLock::try_acquire(&paths.lock, LockMode::Shared)
                .unwrap()
                .is_some(),
            "the failed put left the rollout locked through the child's copy"
        );
        drop(childs_copy);
    }

    #[test]
    fn a_kept_lock_is_reused_until_its_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 8).unwrap();
        let paths = store.paths("r");
        let kept = |lock: RolloutLock| {
            let (file, id) = lock.unlock().unwrap();
            let pid = std::process::id();
            let file = store.cache.account().keep(file);
            (KeptLock { file, id, pid }, id)
        };
        let (first, first_id) =
            kept(RolloutLock::acquire(&paths.lock, LockMode::Exclusive).unwrap());
        let first_fd = first.file.as_raw_fd();
        let again = store
            .lock_exclusive(Some(first), std::process::id(), &paths)
            .unwrap();
        assert_eq!(
            again.file_fd(),
            first_fd,
            "the kept descriptor was not reused"
        );
        let (second, _) = kept(again);
        // Holds the old inode, so the new lock file cannot reuse its number.
        let _old = second.file.try_clone().unwrap();
        // `delete` unlinks the lock file: the kept descriptor then guards nothing.
        std::fs::remove_file(&paths.lock).unwrap();
        let fresh = store
            .lock_exclusive(Some(second), std::process::id(), &paths)
            .unwrap();
        let (_, fresh_id) = kept(fresh);
        assert_eq!(
            fresh_id,
            FileId::of(&std::fs::metadata(&paths.lock).unwrap())
        );
        assert_ne!(fresh_id, first_id);
        assert!(RolloutLock::try_acquire(&paths.lock, LockMode::Exclusive)
            .unwrap()
            .is_some());
    }
}
