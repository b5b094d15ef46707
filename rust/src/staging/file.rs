//! The file staging store: append-only segments written by group commit.
//!
//! # Layout (one directory)
//!
//! | file | content |
//! | --- | --- |
//! | `control.log` | JSON lines: `{"op":"segment","name":N}` (a writer's segment exists), `{"op":"retire","rollout_id":R}`, `{"op":"delete","rollout_id":R}`, `{"op":"drop","name":N}` (a dead segment was removed) |
//! | `seg-<uuid>.tcs` | one writer's frames: `SEGMENT_MAGIC`, then frames (below), appended only by the store instance that created it |
//! | `store.lock` | the `flock` target: exclusive while a batch is checked, written and synced, or while the control log is appended; shared while a reader folds new bytes in |
//!
//! A frame is a 56-byte header (`FRAME_MAGIC`, `u32` row length, `u64` attachments length,
//! `u64` epoch, `u64` batch start, 16 bytes of SHA-256 over row and attachments, 8 bytes of
//! SHA-256 over the header before them) followed by the row and the attachments blob
//! (`row.rs`). The *batch start* is the segment offset of the first frame of the batch the
//! frame was written in (every frame of one batch carries the same one). The *epoch*
//! is the length of `control.log` when the frame was committed: a frame of rollout `R` is
//! visible when its epoch is at least the end of `R`'s last retire/delete line and `R` is not
//! retired, so a delete hides everything staged before it and nothing staged after it.
//!
//! # Commit (the write path)
//!
//! Each `stage` verifies and encodes its record on its own thread, then joins the store's
//! queue. One thread at a time is the *leader*: it takes every queued frame, locks
//! `store.lock` exclusively, folds in what other processes wrote (control lines, their
//! segments' new frames), refuses frames of retired rollouts and keys already staged with other
//! content, writes the rest in one `writev`, `fdatasync`s once, publishes them and wakes their
//! threads. Callers queued meanwhile form the next batch: one sync covers many stages.
//!
//! # Recovery rule
//!
//! A segment is read frame by frame from its start. A frame is valid when its header and body
//! are complete and both checksums match. A writer appends a batch only after the one before
//! it was synced (acknowledged), and cuts a failed batch off again (or, if that fails too,
//! never appends to the segment again), so damage can be one of two things:
//!
//! * **A torn tail**: the last batch, which its writer died (or failed) writing and never
//!   acknowledged. Every valid frame after the first invalid byte belongs to that batch (its
//!   batch start is at or before the damage). The bytes from the first invalid frame on are
//!   ignored, whole frames of the torn batch after it included (frames before it are whole
//!   and stay visible, acknowledged or not).
//! * **Corruption**: a valid frame after the damage whose batch started *after* the damage
//!   exists, so the damaged bytes were a batch that had been acknowledged (stray zeros or a
//!   bad sector mid-segment). They are never read as the segment's end: the reader skips to
//!   the next valid frame, keeps reading (everything after the damage stays fetchable), and
//!   records the damaged range; from then on a fetch of a key this store does not hold raises
//!   a corruption error naming the range (the key may have been there) instead of "not
//!   staged", and `damage()` lists the ranges.
//!
//! Control lines follow the token store's JSONL rule: a final line
//! without its newline is torn (ignored, truncated by the next appender), a complete line that
//! is not an operation is corruption.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};

use sha2::{Digest, Sha256};

use super::row::{self, StagedCall};
use super::StagingError;
use crate::descriptors::{self, FdCache, Kept};
use crate::error::Error;
use crate::lock::{FileId, LockFile, LockMode, RolloutLock};
use crate::log::reserve_past;
use crate::split::Split;
use crate::store::RootDir;

pub const SEGMENT_MAGIC: &[u8; 8] = b"TCSTAGE2";
pub const FRAME_MAGIC: &[u8; 4] = b"TCF2";
const HEADER_LEN: usize = 56;
/// Bytes of the header its check covers (all but the check itself).
const CHECKED_LEN: usize = HEADER_LEN - 8;
/// A segment stops taking batches past this size; the next batch starts a new one.
pub const SEGMENT_ROTATE_BYTES: u64 = 256 << 20;
/// Largest frame body accepted (a row plus its attachments).
pub const MAX_FRAME_BODY: u64 = 1 << 32;

type Result<T> = std::result::Result<T, StagingError>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn sha16(parts: &[&[u8]]) -> [u8; 16] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    let full: [u8; 32] = h.finalize().into();
    full[..16].try_into().expect("16")
}

/// One encoded stage, ready for a batch: the frame (header, row, attachments) and what the
/// checks need.
#[derive(Debug)]
pub struct Frame {
    pub key: String,
    pub rollout_id: String,
    pub model_call_id: String,
    bytes: Vec<u8>,
    row_len: usize,
    content: [u8; 16],
}

impl Frame {
    /// Encode a verified call and its attachments blob (the hashing runs here, on the
    /// caller's thread, not in the leader's batch).
    pub fn new(call: &StagedCall, attachments: &[u8]) -> Self {
        let row = row::encode_row(call);
        Self::from_parts(
            call.key(),
            call.fields.rollout_id.clone(),
            call.fields.model_call_id.clone(),
            &row,
            attachments,
        )
    }

    fn from_parts(
        key: String,
        rollout_id: String,
        model_call_id: String,
        row: &[u8],
        attachments: &[u8],
    ) -> Self {
        let content = sha16(&[row, attachments]);
        let mut bytes = Vec::with_capacity(HEADER_LEN + row.len() + attachments.len());
        bytes.extend_from_slice(FRAME_MAGIC);
        bytes.extend_from_slice(&(row.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(attachments.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes()); // epoch, set by the leader
        bytes.extend_from_slice(&0u64.to_le_bytes()); // batch start, set by the leader
        bytes.extend_from_slice(&content);
        bytes.extend_from_slice(&[0u8; 8]); // header check, set with the epoch
        bytes.extend_from_slice(row);
        bytes.extend_from_slice(attachments);
        Frame {
            key,
            rollout_id,
            model_call_id,
            bytes,
            row_len: row.len(),
            content,
        }
    }

    /// Stamp the batch's epoch and start offset, and the header check over them.
    fn set_batch(&mut self, epoch: u64, batch_start: u64) {
        self.bytes[16..24].copy_from_slice(&epoch.to_le_bytes());
        self.bytes[24..32].copy_from_slice(&batch_start.to_le_bytes());
        let check = sha16(&[&self.bytes[..CHECKED_LEN]]);
        self.bytes[CHECKED_LEN..HEADER_LEN].copy_from_slice(&check[..8]);
    }

    /// The row and the attachments blob.
    fn body(&self) -> (&[u8], &[u8]) {
        self.bytes[HEADER_LEN..].split_at(self.row_len)
    }

    /// The frame's total size in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// A parsed frame header.
struct Header {
    row_len: u64,
    att_len: u64,
    epoch: u64,
    batch_start: u64,
    content: [u8; 16],
}

fn parse_header(h: &[u8]) -> Option<Header> {
    if h.len() < HEADER_LEN || &h[..4] != FRAME_MAGIC {
        return None;
    }
    let check = sha16(&[&h[..CHECKED_LEN]]);
    if check[..8] != h[CHECKED_LEN..HEADER_LEN] {
        return None;
    }
    Some(Header {
        row_len: u64::from(u32::from_le_bytes(h[4..8].try_into().ok()?)),
        att_len: u64::from_le_bytes(h[8..16].try_into().ok()?),
        epoch: u64::from_le_bytes(h[16..24].try_into().ok()?),
        batch_start: u64::from_le_bytes(h[24..32].try_into().ok()?),
        content: h[32..48].try_into().ok()?,
    })
}

/// A damaged byte range of a segment (acknowledged data that no longer reads back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    pub segment: String,
    pub start: u64,
    pub end: u64,
}

/// Bytes of one row: a range of a buffer that may hold more (a segment tail a fold just read).
#[derive(Debug, Clone)]
pub struct RowBytes {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl std::ops::Deref for RowBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

impl AsRef<[u8]> for RowBytes {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl From<Vec<u8>> for RowBytes {
    fn from(bytes: Vec<u8>) -> Self {
        let range = 0..bytes.len();
        RowBytes {
            buf: Arc::new(bytes),
            range,
        }
    }
}

/// A row as [`FileStaging::fetch_stored_rows`] read it (unverified), with where it lives.
#[derive(Debug, Clone)]
pub struct StoredRow {
    pub bytes: RowBytes,
    /// The segment file.
    pub path: PathBuf,
    /// The row's offset in it.
    pub offset: u64,
    /// Whether the row's own checksum was matched over these very bytes, by the fold that
    /// read them during this fetch (its one hash pass over each frame body gives the content
    /// hash and the row checksum both: `check_body`). The row's other checks remain the
    /// caller's (`row::verify_stored_summed`); false: all of them (`row::verify_stored`).
    pub checksum_verified: bool,
}

/// One frame of a [`PendingFetch`]'s tails, as the walk of their headers found it.
struct PendingFrame {
    tail: usize,
    /// The frame's start in its tail.
    start: usize,
    body: Range<usize>,
    row_len: usize,
    content: [u8; 16],
    /// The key asked for (its first index) whose row this frame's row tentatively is.
    asked: Option<usize>,
}

/// What the helper checks of each frame of a [`PendingFetch`]: its body ([`check_body`]: the
/// content hash and the row's checksum in one pass) and, for a row a key asked for, every other
/// check of a fetch (`row::verify_stored_summed`: the staging digest, the extras digest, the
/// key).
type FrameVerdict = (BodyVerdict, Option<std::result::Result<(), String>>);

/// The bytes and frames a [`PendingFetch`] checks, shared with the helper.
struct PendingData {
    bufs: Vec<Arc<Vec<u8>>>,
    frames: Vec<PendingFrame>,
    keys: Vec<String>,
    with_extras: bool,
}

fn check_pending(data: &Arc<PendingData>, i: usize) -> FrameVerdict {
    let frame = &data.frames[i];
    let body = &data.bufs[frame.tail][frame.body.clone()];
    let verdict = check_body(body, frame.row_len, &frame.content);
    let rest = frame.asked.map(|k| {
        let key = &data.keys[k];
        row::verify_stored_summed(&body[..frame.row_len], key, data.with_extras)
            .map_err(|e| format!("staged row of {key:?} is damaged: {e}"))
    });
    (verdict, rest)
}

/// A fetch of keys this view held none of ([`FileStaging::begin_fetch`]): the segment tails
/// its fold needs, read under the shared store lock, and every check of their frames and of the
/// rows asked for running on the helper thread while the caller builds its answer from the rows
/// a walk of the frames' headers found ([`PendingFetch::rows`], unverified).
/// [`FileStaging::finish_fetch`] folds the tails in with those checks and says whether the rows
/// given were the keys' rows, every check passed; nothing built may be returned otherwise.
pub struct PendingFetch {
    /// Per tail: its segment (index in the view) and the segment offset it starts at.
    tails: Vec<(usize, u64)>,
    /// Per key asked: its frame (index into the frames).
    rows: Vec<usize>,
    data: Arc<PendingData>,
    checks: Split<Arc<PendingData>, FrameVerdict>,
}

impl PendingFetch {
    /// The rows of the keys asked for, in order, as the walk of the headers found them
    /// (nothing verified).
    pub fn rows(&self) -> Vec<&[u8]> {
        self.rows
            .iter()
            .map(|&f| {
                let frame = &self.data.frames[f];
                let body = &self.data.bufs[frame.tail][frame.body.clone()];
                &body[..frame.row_len]
            })
            .collect()
    }
}

/// How a [`PendingFetch`] ended.
#[derive(Debug)]
pub enum FetchOutcome {
    /// The rows it gave are the keys' rows as the fold indexed them, every check passed.
    Verified,
    /// The rows it gave are the keys' rows, and row `index` failed a check: where it lies
    /// (segment, offset) and what failed.
    Damaged {
        index: usize,
        path: PathBuf,
        offset: u64,
        message: String,
    },
    /// The rows it gave are not (all) the keys' rows as indexed (or a key was not found):
    /// fetch again the ordinary way ([`FileStaging::fetch_stored_rows`]).
    Redo,
}

/// A segment tail a fold read and checked for the fetch that asked for the fold: that fetch
/// serves its rows from these bytes instead of reading them again. Never kept past the call.
struct FoldedTail {
    segment: usize,
    /// Segment offset of `buf[0]`.
    from: u64,
    buf: Arc<Vec<u8>>,
    /// Segment offsets of the rows of valid frames whose row checksum matched, ascending.
    rows_summed: Vec<u64>,
}

/// Where a visible row lives.
#[derive(Debug, Clone)]
struct Loc {
    segment: usize,
    /// File offset of the row (just past the frame header).
    offset: u64,
    row_len: u64,
    att_len: u64,
    content: [u8; 16],
    rollout_id: String,
}

#[derive(Debug, Default, Clone)]
struct RolloutCtl {
    /// End offset (in `control.log`) of the rollout's last retire or delete line.
    fence_end: u64,
    retired: bool,
}

#[derive(Debug)]
struct SegmentView {
    name: String,
    path: PathBuf,
    /// Bytes folded in (the end of the last valid frame).
    scanned: u64,
    /// Written by this store instance.
    own: bool,
    /// Dropped from the directory (its rows were all gone).
    dropped: bool,
    /// Visible rows it holds.
    live: usize,
}

/// What this process knows of the directory: the control state, the segments and the index
/// of visible rows.
#[derive(Debug, Default)]
struct View {
    control_end: u64,
    rollouts: HashMap<String, RolloutCtl>,
    segments: Vec<SegmentView>,
    by_name: HashMap<String, usize>,
    keys: HashMap<String, Loc>,
    by_rollout: HashMap<String, Vec<String>>,
    /// Damaged ranges found mid-segment (see the recovery rule).
    damage: Vec<Damage>,
}

impl View {
    fn visible(&self, rollout_id: &str, epoch: u64) -> bool {
        match self.rollouts.get(rollout_id) {
            None => true,
            Some(ctl) => !ctl.retired && epoch >= ctl.fence_end,
        }
    }

    fn insert(&mut self, key: String, loc: Loc) {
        self.segments[loc.segment].live += 1;
        self.by_rollout
            .entry(loc.rollout_id.clone())
            .or_default()
            .push(key.clone());
        self.keys.insert(key, loc);
    }

    /// Hide every row of `rollout_id`; returns how many were visible.
    fn hide_rollout(&mut self, rollout_id: &str) -> usize {
        let Some(keys) = self.by_rollout.remove(rollout_id) else {
            return 0;
        };
        let mut hidden = 0;
        for key in keys {
            if let Some(loc) = self.keys.remove(&key) {
                self.segments[loc.segment].live -= 1;
                hidden += 1;
            }
        }
        hidden
    }

    fn retired_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        // A key is `rollout/call`; rollout ids may themselves hold '/'.
        key.match_indices('/').find_map(|(at, _)| {
            let rollout = &key[..at];
            self.rollouts
                .get(rollout)
                .filter(|ctl| ctl.retired)
                .map(|_| rollout)
        })
    }
}

/// The control log's operations.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum ControlOp {
    Segment { name: String },
    Retire { rollout_id: String },
    Delete { rollout_id: String },
    Drop { name: String },
}

/// A submitted stage waiting for its batch.
struct Pending {
    frame: Frame,
    slot: Arc<Slot>,
}

#[derive(Default)]
struct Slot {
    result: Mutex<Option<Result<()>>>,
}

/// The writer side of this store instance (one leader at a time).
struct Writer {
    queue: Vec<Pending>,
    leading: bool,
    /// The view index of the segment this instance writes, while it writes one. Between
    /// batches the segment itself is an entry of the store's descriptor cache, where the
    /// process budget may close it: the next leader then finds it gone and seals it (see
    /// [`FileStaging::take_cached`]).
    segment_index: Option<usize>,
}

/// Cache keys of what an instance keeps between batches (see [`Cached`]).
const SEGMENT_KEY: &str = "segment";
const LOCK_KEY: &str = "store.lock";

/// A descriptor an instance keeps between batches, as an entry of its [`FdCache`]: counted
/// in the process descriptor budget, and closed by it like any cache's entry (over the
/// budget, or every one when an open runs out of descriptors: `descriptors::retry`). The
/// leader takes both out while it commits a batch and puts them back after (the store lock
/// first: the least recently used entry, closed first).
enum Cached {
    /// The segment this instance writes. Closing it seals it: no batch is appended to it
    /// again, the next one starts a new segment.
    Segment(OwnSegment),
    /// The leader's kept `store.lock` descriptor (see `RolloutLock::unlock`).
    Lock(Kept<LockFile>, FileId),
}

struct OwnSegment {
    index: usize,
    /// Counted in the process descriptor budget; held while this instance writes the segment
    /// (its `flock` tells other processes the segment has a live writer), and closed only
    /// when the segment is sealed (rotated, closed by the budget, or the store dropped). A
    /// `LockFile`, so that a forked child gives up its copy (else a dead writer's segment
    /// would look live for as long as the child lived).
    file: Kept<LockFile>,
    len: u64,
    reserved: Option<u64>,
}

impl Drop for OwnSegment {
    fn drop(&mut self) {
        // Sealed: cut the blocks reserved past the data (fallocate KEEP_SIZE leaves the size
        // alone, but the space would stay taken for as long as the file lives). `len` is the
        // end of the last acknowledged batch (a failed one was cut off, or is cut here).
        if self.reserved.is_some() {
            let _ = self.file.set_len(self.len);
        }
    }
}

/// Counters of the write path (for tests and the benchmark).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CommitStats {
    pub batches: u64,
    pub frames: u64,
    pub syncs: u64,
}

/// The file staging store of one directory, shared by the threads of a process.
pub struct FileStaging {
    dir: RootDir,
    control_path: PathBuf,
    lock_path: PathBuf,
    writer: Mutex<Writer>,
    wake: Condvar,
    view: RwLock<View>,
    /// Serializes folding (so two threads never scan the same tail twice).
    folding: Mutex<()>,
    stats: Mutex<CommitStats>,
    /// The descriptors kept between calls (the segment being written and the store lock),
    /// a cache registered with the process budget (`crate::descriptors`), which closes them
    /// as it closes any cache's (over the budget, or after an open ran out of descriptors).
    fds: Arc<FdCache<Cached>>,
    /// This instance's own cap on kept descriptors (`max_open_files`; the segment counts
    /// first: the store lock is kept only below it).
    max_open: Option<usize>,
}

impl std::fmt::Debug for FileStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStaging")
            .field("root", &self.dir.path())
            .finish()
    }
}

/// What `retire` and `delete` report: ids that had something, ids that had nothing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removal {
    pub removed: Vec<String>,
    pub absent: Vec<String>,
}

impl FileStaging {
    /// Open (creating if needed) a staging directory. Nothing of it is read yet: every call
    /// folds in what it needs first (a fetch of keys this view does not hold, a stage's leader,
    /// `keys`, `retired`, `damage`), so an open costs the same on any directory and the first
    /// fetch serves its rows from the bytes its fold reads.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        Self::open_with(root, None)
    }

    /// [`FileStaging::open`] keeping at most `max_open_files` descriptors between calls (the
    /// segment being written, then the store lock; `None`: only the process budget applies).
    pub fn open_with(root: impl Into<PathBuf>, max_open_files: Option<usize>) -> Result<Self> {
        let dir = RootDir::open(root).map_err(StagingError::Io)?;
        let control_path = dir.path().join("control.log");
        let lock_path = dir.path().join("store.lock");
        let store = FileStaging {
            dir,
            control_path,
            lock_path,
            writer: Mutex::new(Writer {
                queue: Vec::new(),
                leading: false,
                segment_index: None,
            }),
            wake: Condvar::new(),
            view: RwLock::new(View::default()),
            folding: Mutex::new(()),
            stats: Mutex::new(CommitStats::default()),
            // The cap is kept by `put_back` (the segment is never closed for it); the
            // process budget applies to both entries.
            fds: FdCache::new(2, None),
            max_open: max_open_files,
        };
        Ok(store)
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn stats(&self) -> CommitStats {
        *lock(&self.stats)
    }

    /// Descriptors this instance keeps between calls (its segment, its store lock).
    pub fn open_files(&self) -> usize {
        self.fds.held()
    }

    /// This instance's own cap on kept descriptors, `None` when only the process budget applies.
    pub fn max_open_files(&self) -> Option<usize> {
        self.max_open
    }

    /// Take what the last batch left in the cache for this one: the segment this instance
    /// writes and the kept store lock (either may be gone: never kept, or closed by the
    /// process budget meanwhile). A segment the budget closed is sealed here (`written` is
    /// the index this instance was writing): the batch starts a new one.
    fn take_cached(
        &self,
        written: Option<usize>,
    ) -> (Option<OwnSegment>, Option<(LockFile, FileId)>) {
        let (segment, kept) = {
            let mut cache = self.fds.lock();
            (cache.pop(SEGMENT_KEY), cache.pop(LOCK_KEY))
        };
        let segment = match segment {
            Some(Cached::Segment(segment)) => Some(segment),
            _ => None,
        };
        let kept = match kept {
            Some(Cached::Lock(file, id)) => Some((file.into_inner(), id)),
            _ => None,
        };
        if let (None, Some(index)) = (&segment, written) {
            self.view_write().segments[index].own = false;
        }
        (segment, kept)
    }

    /// Put back what a batch leaves for the next one (the store lock only within this
    /// instance's cap, the segment counting first), then keep within the process budget.
    fn put_back(&self, segment: Option<OwnSegment>, kept: Option<(LockFile, FileId)>) {
        let lock = kept.and_then(|(file, id)| {
            let room = self.max_open.is_none_or(|cap| self.fds.held() < cap);
            room.then(|| Cached::Lock(self.fds.account().keep(file), id))
        });
        {
            let mut cache = self.fds.lock();
            // The lock first: the least recently used entry is the first the budget closes.
            if let Some(lock) = lock {
                cache.put(LOCK_KEY.to_owned(), lock);
            }
            if let Some(segment) = segment {
                cache.put(SEGMENT_KEY.to_owned(), Cached::Segment(segment));
            }
        }
        self.fds.settle();
    }

    fn view_read(&self) -> std::sync::RwLockReadGuard<'_, View> {
        self.view.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn view_write(&self) -> std::sync::RwLockWriteGuard<'_, View> {
        self.view.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lock `store.lock` (its open goes through `descriptors::retry`: when the process is
    /// out of descriptors, every cache of the process, this store's included, is closed and
    /// the open tried once more).
    fn lock_store(&self, mode: LockMode) -> Result<RolloutLock> {
        RolloutLock::acquire(&self.lock_path, mode).map_err(StagingError::Io)
    }

    /// The shared lock a reader holds while it folds, taken on a read-only descriptor: every
    /// read works on a read-only mount and for a user who may only read. `None`: no
    /// `store.lock` on a read-only filesystem, where nothing writes (see
    /// `RolloutLock::acquire_to_read`).
    fn lock_store_to_read(&self) -> Result<Option<RolloutLock>> {
        RolloutLock::acquire_to_read(&self.lock_path).map_err(StagingError::Io)
    }

    /// Close the kept store lock. The segment being written stays open (the process budget
    /// closes it too when it must: the next batch then starts a new segment).
    pub fn release_cached_fds(&self) {
        let kept = self.fds.lock().pop(LOCK_KEY);
        drop(kept); // closed outside the cache's lock
    }

    /// Fold in new control lines and new frames of every segment, under the shared lock.
    pub fn refresh(&self) -> Result<()> {
        let _permit = self.fds.enter();
        self.refresh_keeping(None)
    }

    /// [`FileStaging::refresh`], keeping the segment tails it reads in `keep`.
    fn refresh_keeping(&self, keep: Option<&mut Vec<FoldedTail>>) -> Result<()> {
        let _guard = lock(&self.folding);
        let _lock = self.lock_store_to_read()?;
        self.fold_keeping(keep)
    }

    /// Fold while holding `store.lock` (either mode) and `folding`.
    fn fold_locked(&self) -> Result<()> {
        self.fold_keeping(None)
    }

    /// Fold in the control log's lines past this view's end (callers hold the store lock);
    /// gives back the view, write-locked, for the segments' tails next.
    fn fold_control(&self) -> Result<std::sync::RwLockWriteGuard<'_, View>> {
        let (control_bytes, start) = {
            let view = self.view_read();
            (self.read_control_tail(view.control_end)?, view.control_end)
        };
        let mut view = self.view_write();
        if !control_bytes.is_empty() {
            self.apply_control(&mut view, &control_bytes, start)?;
        }
        Ok(view)
    }

    /// [`FileStaging::fold_locked`], keeping the segment tails it reads in `keep`.
    fn fold_keeping(&self, mut keep: Option<&mut Vec<FoldedTail>>) -> Result<()> {
        let mut view = self.fold_control()?;
        for index in 0..view.segments.len() {
            if view.segments[index].own || view.segments[index].dropped {
                continue;
            }
            self.fold_segment(&mut view, index, keep.as_deref_mut())?;
        }
        Ok(())
    }

    fn read_control_tail(&self, from: u64) -> Result<Vec<u8>> {
        let file = match descriptors::retry(|| File::open(&self.control_path)) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => {
                return Err(StagingError::io(
                    "open control log",
                    &self.control_path,
                    err,
                ))
            }
        };
        let len = file
            .metadata()
            .map_err(|e| StagingError::io("stat control log", &self.control_path, e))?
            .len();
        if len <= from {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (len - from) as usize];
        file.read_exact_at(&mut buf, from)
            .map_err(|e| StagingError::io("read control log", &self.control_path, e))?;
        Ok(buf)
    }

    fn apply_control(&self, view: &mut View, bytes: &[u8], base: u64) -> Result<()> {
        for (offset, line) in crate::log::complete_lines(bytes, base) {
            let end = offset + line.len() as u64 + 1;
            let op: ControlOp = serde_json::from_slice(line).map_err(|err| {
                StagingError::Corrupt(Error::corrupt(
                    &self.control_path,
                    offset,
                    format!("not a staging control operation: {err}"),
                ))
            })?;
            match op {
                ControlOp::Segment { name } => {
                    if !view.by_name.contains_key(&name) {
                        let path = self.dir.path().join(&name);
                        view.by_name.insert(name.clone(), view.segments.len());
                        view.segments.push(SegmentView {
                            name,
                            path,
                            scanned: 0,
                            own: false,
                            dropped: false,
                            live: 0,
                        });
                    }
                }
                ControlOp::Retire { rollout_id } => {
                    view.hide_rollout(&rollout_id);
                    view.rollouts.insert(
                        rollout_id,
                        RolloutCtl {
                            fence_end: end,
                            retired: true,
                        },
                    );
                }
                ControlOp::Delete { rollout_id } => {
                    view.hide_rollout(&rollout_id);
                    view.rollouts.insert(
                        rollout_id,
                        RolloutCtl {
                            fence_end: end,
                            retired: false,
                        },
                    );
                }
                ControlOp::Drop { name } => {
                    if let Some(&index) = view.by_name.get(&name) {
                        view.segments[index].dropped = true;
                    }
                }
            }
            view.control_end = end;
        }
        Ok(())
    }

    /// Fold a foreign segment's new valid frames into the index.
    fn fold_segment(
        &self,
        view: &mut View,
        index: usize,
        keep: Option<&mut Vec<FoldedTail>>,
    ) -> Result<()> {
        let Some((from, buf)) = self.read_tail(view, index)? else {
            return Ok(());
        };
        let buf = Arc::new(buf);
        let checks = BodyChecks::ahead(&buf, first_frame(from));
        self.fold_tail(view, index, from, buf, &checks, keep)
    }

    /// The bytes of segment `index` past what this view has folded in (`None`: nothing new,
    /// or the segment is not there), and the segment offset they start at.
    fn read_tail(&self, view: &View, index: usize) -> Result<Option<(u64, Vec<u8>)>> {
        let path = &view.segments[index].path;
        let file = match descriptors::retry(|| File::open(path)) {
            Ok(file) => file,
            // Registered but not created yet (its writer died in between), or dropped.
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(StagingError::io("open segment", path, err)),
        };
        let len = file
            .metadata()
            .map_err(|e| StagingError::io("stat segment", path, e))?
            .len();
        let from = view.segments[index].scanned;
        if len <= from {
            return Ok(None);
        }
        let mut buf = vec![0u8; (len - from) as usize];
        file.read_exact_at(&mut buf, from)
            .map_err(|e| StagingError::io("read segment", path, e))?;
        Ok(Some((from, buf)))
    }

    /// Fold in `buf`, segment `index`'s bytes from offset `from` (what [`Self::read_tail`]
    /// read), under the recovery rule, with the body checks `checks` made ahead where it has
    /// them; keeps the tail in `keep`.
    fn fold_tail(
        &self,
        view: &mut View,
        index: usize,
        from: u64,
        buf: Arc<Vec<u8>>,
        checks: &BodyChecks,
        keep: Option<&mut Vec<FoldedTail>>,
    ) -> Result<()> {
        let path = view.segments[index].path.clone();
        let mut at = 0usize;
        if from == 0 {
            if buf.len() < SEGMENT_MAGIC.len() {
                return Ok(()); // torn at creation
            }
            if &buf[..SEGMENT_MAGIC.len()] != SEGMENT_MAGIC {
                return Err(StagingError::Corrupt(Error::corrupt(
                    &path,
                    0,
                    "not a staging segment (bad magic)",
                )));
            }
            at = SEGMENT_MAGIC.len();
        }
        let mut rows_summed = Vec::new();
        loop {
            while let Some((header, body_end, row_summed)) = checks.valid_frame(&buf, at) {
                let row_at = at + HEADER_LEN;
                let row = &buf[row_at..row_at + header.row_len as usize];
                let offset = from + row_at as u64;
                if header.row_len > 0 {
                    self.index_frame(view, index, &path, row, offset, &header)?;
                }
                if row_summed && keep.is_some() {
                    rows_summed.push(offset);
                }
                at = body_end;
            }
            if at >= buf.len() {
                break;
            }
            // Invalid bytes at `at`: a torn tail, or damage with acknowledged frames after it.
            let damaged_from = from + at as u64;
            match damage_end(&buf, at, from, damaged_from) {
                None => break, // a torn tail: ignored (re-read by the next fold)
                Some(next) => {
                    let damage = Damage {
                        segment: view.segments[index].name.clone(),
                        start: damaged_from,
                        end: from + next as u64,
                    };
                    if !view.damage.contains(&damage) {
                        view.damage.push(damage);
                    }
                    at = next;
                }
            }
        }
        view.segments[index].scanned = from + at as u64;
        if let Some(keep) = keep {
            keep.push(FoldedTail {
                segment: index,
                from,
                buf,
                rows_summed,
            });
        }
        Ok(())
    }

    fn index_frame(
        &self,
        view: &mut View,
        segment: usize,
        path: &Path,
        row: &[u8],
        offset: u64,
        header: &Header,
    ) -> Result<()> {
        let (rollout_id, call_id) = row_ids(row).ok_or_else(|| {
            StagingError::Corrupt(Error::corrupt(path, offset, "a row without its ids"))
        })?;
        if !view.visible(&rollout_id, header.epoch) {
            return Ok(());
        }
        let key = row::staging_key(&rollout_id, &call_id);
        if let Some(existing) = view.keys.get(&key) {
            if existing.content != header.content {
                return Err(StagingError::Corrupt(Error::corrupt(
                    path,
                    offset,
                    format!("key {key:?} is stored twice with different content"),
                )));
            }
            return Ok(());
        }
        view.insert(
            key,
            Loc {
                segment,
                offset,
                row_len: header.row_len,
                att_len: header.att_len,
                content: header.content,
                rollout_id,
            },
        );
        Ok(())
    }

    // ---- staging --------------------------------------------------------------------------

    /// Stage one encoded frame: returns once it is durable (or refused).
    pub fn stage(&self, frame: Frame) -> Result<()> {
        if frame.bytes.len() as u64 - HEADER_LEN as u64 > MAX_FRAME_BODY {
            return Err(StagingError::Invalid(format!(
                "staged call {:?} is {} bytes with its attachments, over the {} byte limit",
                frame.key,
                frame.bytes.len(),
                MAX_FRAME_BODY
            )));
        }
        // Every check runs in the leader, under the exclusive lock and on a freshly folded view:
        // a local view may be stale (another process may have retired or deleted the rollout).
        let slot = Arc::new(Slot::default());
        let mut writer = lock(&self.writer);
        writer.queue.push(Pending {
            frame,
            slot: Arc::clone(&slot),
        });
        loop {
            if let Some(result) = lock(&slot.result).take() {
                return result;
            }
            if !writer.leading && !writer.queue.is_empty() {
                writer.leading = true;
                let batch = std::mem::take(&mut writer.queue);
                let written = writer.segment_index;
                drop(writer);
                let (mut segment, kept) = {
                    // One file operation of the process's in-flight gate, as a token store's.
                    let _permit = self.fds.enter();
                    let (segment, kept) = self.take_cached(written);
                    let mut segment = segment;
                    let kept = self.commit(batch, &mut segment, kept);
                    (segment, kept)
                };
                writer = lock(&self.writer);
                // Put back before the next leader can look for them.
                writer.segment_index = segment.as_ref().map(|s| s.index);
                self.put_back(segment.take(), kept);
                writer.leading = false;
                self.wake.notify_all();
                continue;
            }
            writer = self
                .wake
                .wait(writer)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Lead one batch: lock, fold, check, write, sync, publish, fill every slot.
    fn commit(
        &self,
        batch: Vec<Pending>,
        segment: &mut Option<OwnSegment>,
        kept: Option<(LockFile, FileId)>,
    ) -> Option<(LockFile, FileId)> {
        let locked = match kept {
            Some((file, id)) => {
                match RolloutLock::relock(file, id, &self.lock_path, LockMode::Exclusive) {
                    Ok(Some(lock)) => Ok(lock),
                    Ok(None) => self.lock_store(LockMode::Exclusive),
                    Err(err) => Err(StagingError::Io(err)),
                }
            }
            None => self.lock_store(LockMode::Exclusive),
        };
        let store_lock = match locked {
            Ok(lock) => lock,
            Err(err) => {
                let message = err.to_string();
                for pending in batch {
                    *lock(&pending.slot.result) = Some(Err(StagingError::Failed(message.clone())));
                }
                return None;
            }
        };
        let outcome = self.commit_locked(batch, segment);
        for (slot, result) in outcome {
            *lock(&slot.result) = Some(result);
        }
        store_lock.unlock()
    }

    /// Whether the stored frame at `loc`, whose content hash differs from `frame`'s, still
    /// carries the same call ([`row::same_content`]: the same data in another bytes-like type,
    /// or an older build's encoding of it). Read from its segment and checked against its
    /// content hash first; a frame that cannot be read or does not match is not the same.
    fn stored_same(&self, view: &View, loc: &Loc, frame: &Frame) -> bool {
        let path = &view.segments[loc.segment].path;
        let Ok(body) = self.read_span(path, loc.offset, loc.row_len + loc.att_len, &mut None)
        else {
            return false;
        };
        if sha16(&[&body]) != loc.content {
            return false;
        }
        let (row, attachments) = body.split_at(loc.row_len as usize);
        let (new_row, new_attachments) = frame.body();
        row::same_content(row, attachments, new_row, new_attachments)
    }

    fn commit_locked(
        &self,
        batch: Vec<Pending>,
        segment: &mut Option<OwnSegment>,
    ) -> Vec<(Arc<Slot>, Result<()>)> {
        let mut results = Vec::with_capacity(batch.len());
        {
            let _guard = lock(&self.folding);
            if let Err(err) = self.fold_locked() {
                let message = err.to_string();
                return batch
                    .into_iter()
                    .map(|p| (p.slot, Err(StagingError::Failed(message.clone()))))
                    .collect();
            }
        }
        // Check each frame against the folded view and the frames before it in the batch.
        let mut accepted: Vec<Pending> = Vec::with_capacity(batch.len());
        let mut duplicates: Vec<Pending> = Vec::new();
        let epoch;
        {
            let view = self.view_read();
            epoch = view.control_end;
            let mut in_batch: HashMap<&str, usize> = HashMap::new();
            let mut keep = vec![0u8; batch.len()]; // 0 refuse, 1 write, 2 duplicate of a write
            for (i, pending) in batch.iter().enumerate() {
                let frame = &pending.frame;
                if view
                    .rollouts
                    .get(&frame.rollout_id)
                    .is_some_and(|ctl| ctl.retired)
                {
                    continue;
                }
                if let Some(loc) = view.keys.get(&frame.key) {
                    let same = loc.content == frame.content || self.stored_same(&view, loc, frame);
                    keep[i] = if same { 3 } else { 0 };
                    continue;
                }
                match in_batch.get(frame.key.as_str()) {
                    Some(&first) => {
                        let earlier = &batch[first].frame;
                        let same = earlier.content == frame.content || {
                            let ((row_a, att_a), (row_b, att_b)) = (earlier.body(), frame.body());
                            row::same_content(row_a, att_a, row_b, att_b)
                        };
                        keep[i] = if same { 2 } else { 0 };
                    }
                    None => {
                        in_batch.insert(&frame.key, i);
                        keep[i] = 1;
                    }
                }
            }
            let refusal = |frame: &Frame| {
                if view
                    .rollouts
                    .get(&frame.rollout_id)
                    .is_some_and(|ctl| ctl.retired)
                {
                    StagingError::Retired(frame.rollout_id.clone())
                } else {
                    StagingError::Conflict(frame.key.clone())
                }
            };
            for (pending, mode) in batch.into_iter().zip(keep) {
                match mode {
                    0 => {
                        let err = refusal(&pending.frame);
                        results.push((pending.slot, Err(err)));
                    }
                    1 => accepted.push(pending),
                    2 => duplicates.push(pending),
                    _ => results.push((pending.slot, Ok(()))),
                }
            }
        }
        if accepted.is_empty() {
            results.extend(duplicates.into_iter().map(|p| (p.slot, Ok(()))));
            return results;
        }
        match self.write_batch(&mut accepted, epoch, segment) {
            Ok((index, start)) => {
                let mut view = self.view_write();
                let mut at = start;
                for pending in &accepted {
                    let frame = &pending.frame;
                    view.insert(
                        frame.key.clone(),
                        Loc {
                            segment: index,
                            offset: at + HEADER_LEN as u64,
                            row_len: frame.row_len as u64,
                            att_len: (frame.bytes.len() - HEADER_LEN - frame.row_len) as u64,
                            content: frame.content,
                            rollout_id: frame.rollout_id.clone(),
                        },
                    );
                    at += frame.bytes.len() as u64;
                }
                view.segments[index].scanned = at;
                drop(view);
                let mut stats = lock(&self.stats);
                stats.batches += 1;
                stats.syncs += 1;
                stats.frames += accepted.len() as u64;
                drop(stats);
                results.extend(accepted.into_iter().map(|p| (p.slot, Ok(()))));
                results.extend(duplicates.into_iter().map(|p| (p.slot, Ok(()))));
            }
            Err(err) => {
                let message = err.to_string();
                for pending in accepted.into_iter().chain(duplicates) {
                    results.push((pending.slot, Err(StagingError::Failed(message.clone()))));
                }
            }
        }
        results
    }

    /// Append the frames to this instance's segment (creating or rotating it first) and sync.
    /// On failure the segment is truncated back (or abandoned if that fails too).
    fn write_batch(
        &self,
        frames: &mut [Pending],
        epoch: u64,
        segment: &mut Option<OwnSegment>,
    ) -> Result<(usize, u64)> {
        self.write_batch_into(frames, epoch, segment, true)
    }

    /// [`FileStaging::write_batch`]; `may_rotate`: on `EFBIG` (the process's file size limit,
    /// `RLIMIT_FSIZE`, reached by a segment that holds frames) seal the segment and write the
    /// batch once more into a new one, or every later batch of this instance would fail too.
    fn write_batch_into(
        &self,
        frames: &mut [Pending],
        epoch: u64,
        segment: &mut Option<OwnSegment>,
        may_rotate: bool,
    ) -> Result<(usize, u64)> {
        if segment
            .as_ref()
            .is_some_and(|s| s.len >= SEGMENT_ROTATE_BYTES)
        {
            if let Some(old) = segment.take() {
                self.seal(old);
            }
        }
        if segment.is_none() {
            *segment = Some(self.new_segment()?);
        }
        let own = segment.as_mut().expect("segment just made");
        let path = self.view_read().segments[own.index].path.clone();
        let total: u64 = frames.iter().map(|p| p.frame.bytes.len() as u64).sum();
        let start = own.len;
        for pending in frames.iter_mut() {
            pending.frame.set_batch(epoch, start);
        }
        if own.reserved.is_some_and(|r| start + total > r) || own.reserved.is_none() {
            own.reserved = reserve_past(&own.file, start, start + total);
        }
        let slices: Vec<IoSlice<'_>> = frames
            .iter()
            .map(|p| IoSlice::new(&p.frame.bytes))
            .collect();
        let written = write_all_vectored(&own.file, slices).and_then(|()| own.file.sync_data());
        match written {
            Ok(()) => {
                own.len = start + total;
                Ok((own.index, start))
            }
            Err(err) => {
                // Nothing of a failed batch may come back: cut it off and make the cut durable.
                let undone = own.file.set_len(start).and_then(|()| own.file.sync_data());
                if undone.is_err() {
                    // The file may hold part of the batch: never append after it again.
                    *segment = None;
                }
                let rotate = may_rotate
                    && err.kind() == io::ErrorKind::FileTooLarge
                    && start > SEGMENT_MAGIC.len() as u64;
                if rotate {
                    if let Some(old) = segment.take() {
                        self.seal(old);
                    }
                    return self.write_batch_into(frames, epoch, segment, false);
                }
                Err(StagingError::io("write staged batch to", &path, err))
            }
        }
    }

    /// Create this instance's next segment: the file (with its magic, synced), its directory
    /// entry (synced), then its control line (so readers never look for a missing file).
    fn new_segment(&self) -> Result<OwnSegment> {
        let name = format!("seg-{}.tcs", uuid::Uuid::new_v4().simple());
        let path = self.dir.path().join(&name);
        let open = || {
            OpenOptions::new()
                .read(true)
                .append(true)
                .create_new(true)
                .open(&path)
        };
        let mut file =
            descriptors::retry(open).map_err(|e| StagingError::io("create segment", &path, e))?;
        // The writer holds its segment locked while it lives: a segment nobody holds has no
        // writer (see `collect_dead_segments`).
        let made = file
            .try_lock()
            .map_err(|e| match e {
                std::fs::TryLockError::Error(err) => err,
                std::fs::TryLockError::WouldBlock => io::Error::other("new segment is locked"),
            })
            .and_then(|()| file.write_all(SEGMENT_MAGIC))
            .and_then(|()| file.sync_data());
        if let Err(err) = made {
            let _ = std::fs::remove_file(&path);
            return Err(StagingError::io("write segment", &path, err));
        }
        self.dir.sync().map_err(StagingError::Io)?;
        self.append_control(&[ControlOp::Segment { name: name.clone() }])?;
        let mut view = self.view_write();
        let index = match view.by_name.get(&name) {
            Some(&index) => index,
            None => {
                let index = view.segments.len();
                view.by_name.insert(name.clone(), index);
                view.segments.push(SegmentView {
                    name,
                    path,
                    scanned: 0,
                    own: true,
                    dropped: false,
                    live: 0,
                });
                view.segments.len() - 1
            }
        };
        view.segments[index].own = true;
        view.segments[index].scanned = SEGMENT_MAGIC.len() as u64;
        Ok(OwnSegment {
            index,
            file: self.fds.account().keep(LockFile::new(file)),
            len: SEGMENT_MAGIC.len() as u64,
            reserved: None,
        })
    }

    /// Stop writing a segment (it is complete; readers fold it like any other). Dropping it
    /// cuts what was reserved past its end.
    fn seal(&self, old: OwnSegment) {
        let index = old.index;
        drop(old);
        self.view_write().segments[index].own = false;
    }

    /// Append control operations durably (callers hold the exclusive lock and `folding` is
    /// not needed: control lines are folded by the next `fold_locked`).
    fn append_control(&self, ops: &[ControlOp]) -> Result<()> {
        let mut bytes = Vec::new();
        for op in ops {
            serde_json::to_writer(&mut bytes, op).map_err(|e| {
                StagingError::Invalid(format!("cannot encode a control operation: {e}"))
            })?;
            bytes.push(b'\n');
        }
        let created = !self.control_path.exists();
        let mut options = OpenOptions::new();
        options.read(true).append(true).create(true);
        let file = descriptors::retry(|| options.open(&self.control_path))
            .map_err(|e| StagingError::io("open control log", &self.control_path, e))?;
        // A torn final line (a crashed appender) is cut before anything is appended after it.
        let mut end = file
            .metadata()
            .map_err(|e| StagingError::io("stat control log", &self.control_path, e))?
            .len();
        if end > 0 {
            let tail_from = end.saturating_sub(64 << 10);
            let mut tail = vec![0u8; (end - tail_from) as usize];
            file.read_exact_at(&mut tail, tail_from)
                .map_err(|e| StagingError::io("read control log", &self.control_path, e))?;
            if tail.last() != Some(&b'\n') {
                let keep = match memchr::memrchr(b'\n', &tail) {
                    Some(at) => tail_from + at as u64 + 1,
                    None if tail_from == 0 => 0,
                    None => {
                        return Err(StagingError::Corrupt(Error::corrupt(
                            &self.control_path,
                            tail_from,
                            "a control line over 64 KiB",
                        )))
                    }
                };
                file.set_len(keep)
                    .map_err(|e| StagingError::io("truncate control log", &self.control_path, e))?;
                end = keep;
            }
        }
        let mut writer = &file;
        let written = writer.write_all(&bytes).and_then(|()| file.sync_data());
        if let Err(err) = written {
            let _ = file.set_len(end);
            return Err(StagingError::io(
                "append control log",
                &self.control_path,
                err,
            ));
        }
        if created {
            self.dir.sync().map_err(StagingError::Io)?;
        }
        // Blocks reserved past the end (size unchanged) take the next control lines without
        // allocating, so a retire or delete, the operator's way to free space, still lands on
        // a full disk. Failing to reserve only loses that.
        let appended = end + bytes.len() as u64;
        let _ = reserve_past(&file, appended, appended);
        Ok(())
    }

    // ---- lifecycle ------------------------------------------------------------------------

    /// Fence rollouts: hide their rows and refuse later stages, from every process.
    pub fn retire(&self, rollout_ids: &[String]) -> Result<Removal> {
        self.remove(rollout_ids, true)
    }

    /// Hide rollouts' rows and lift any fence, so an id can be staged again from scratch.
    pub fn delete(&self, rollout_ids: &[String]) -> Result<Removal> {
        self.remove(rollout_ids, false)
    }

    fn remove(&self, rollout_ids: &[String], retire: bool) -> Result<Removal> {
        if let Some(bad) = rollout_ids.iter().find(|id| id.is_empty()) {
            let _ = bad;
            return Err(StagingError::Invalid(
                "rollout ids must be non-empty".into(),
            ));
        }
        let mut ids: Vec<&String> = Vec::new();
        for id in rollout_ids {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        if ids.is_empty() {
            return Ok(Removal::default());
        }
        let _permit = self.fds.enter();
        let _lock = self.lock_store(LockMode::Exclusive)?;
        let _guard = lock(&self.folding);
        self.fold_locked()?;
        let had: Vec<bool> = {
            let view = self.view_read();
            ids.iter()
                .map(|id| {
                    let visible = view
                        .by_rollout
                        .get(id.as_str())
                        .is_some_and(|k| !k.is_empty());
                    let fenced = view.rollouts.get(id.as_str()).is_some_and(|c| c.retired);
                    visible || (!retire && fenced)
                })
                .collect()
        };
        let ops: Vec<ControlOp> = ids
            .iter()
            .map(|id| {
                let rollout_id = (*id).clone();
                if retire {
                    ControlOp::Retire { rollout_id }
                } else {
                    ControlOp::Delete { rollout_id }
                }
            })
            .collect();
        self.append_control(&ops)?;
        self.fold_locked()?;
        self.collect_dead_segments()?;
        let mut removal = Removal::default();
        for (id, had) in ids.into_iter().zip(had) {
            if had {
                removal.removed.push(id.clone());
            } else {
                removal.absent.push(id.clone());
            }
        }
        Ok(removal)
    }

    /// Unlink segments that hold no visible row and that nobody writes any more (callers hold
    /// the exclusive lock and `folding`).
    fn collect_dead_segments(&self) -> Result<()> {
        let candidates: Vec<(String, PathBuf)> = {
            let view = self.view_read();
            view.segments
                .iter()
                .filter(|s| !s.own && !s.dropped && s.live == 0)
                .map(|s| (s.name.clone(), s.path.clone()))
                .collect()
        };
        let mut dropped = Vec::new();
        for (name, path) in candidates {
            // Its writer holds the segment open with a lock while it lives; a segment we can
            // lock exclusively has no writer. One that cannot be opened (even after the
            // process's cached descriptors were closed) is left for a later removal.
            let Ok(file) = descriptors::retry(|| File::open(&path)) else {
                continue;
            };
            if file.try_lock().is_err() {
                continue;
            }
            if crate::store::remove_if_exists(&path).map_err(StagingError::Io)? {
                dropped.push(ControlOp::Drop { name });
            }
        }
        if !dropped.is_empty() {
            self.dir.sync().map_err(StagingError::Io)?;
            self.append_control(&dropped)?;
            self.fold_locked()?;
        }
        Ok(())
    }

    // ---- reading --------------------------------------------------------------------------

    fn locate(&self, keys: &[String]) -> Result<Vec<(Loc, PathBuf)>> {
        self.locate_keeping(keys, None)
    }

    /// [`FileStaging::locate`]; a fold it needs keeps the tails it reads in `keep`.
    fn locate_keeping(
        &self,
        keys: &[String],
        keep: Option<&mut Vec<FoldedTail>>,
    ) -> Result<Vec<(Loc, PathBuf)>> {
        let found = |view: &View| -> std::result::Result<Vec<(Loc, PathBuf)>, usize> {
            keys.iter()
                .enumerate()
                .map(|(i, key)| {
                    view.keys
                        .get(key)
                        .map(|loc| (loc.clone(), view.segments[loc.segment].path.clone()))
                        .ok_or(i)
                })
                .collect()
        };
        if let Ok(locs) = found(&self.view_read()) {
            return Ok(locs);
        }
        self.refresh_keeping(keep)?;
        let view = self.view_read();
        found(&view).map_err(|i| {
            let key = keys[i].clone();
            match view.retired_key(&key).map(str::to_owned) {
                Some(rollout_id) => StagingError::RetiredKey { key, rollout_id },
                None => match view.damage.first() {
                    None => StagingError::UnknownKey(key),
                    Some(d) => StagingError::Corrupt(Error::corrupt(
                        &self.dir.path().join(&d.segment),
                        d.start,
                        format!(
                            "staging key {key:?} is not found, and {} damaged range(s) of \
                             acknowledged frames may have held it (the first: bytes {}..{})",
                            view.damage.len(),
                            d.start,
                            d.end
                        ),
                    )),
                },
            }
        })
    }

    /// Read `len` bytes at `offset` of the segment at `path`, through `open`: the one segment
    /// a read keeps open between spans (another segment's replaces it, closed first, so a
    /// read holds one segment descriptor at a time). The open goes through
    /// `descriptors::retry`.
    fn read_span(
        &self,
        path: &Path,
        offset: u64,
        len: u64,
        open: &mut Option<(PathBuf, File)>,
    ) -> Result<Vec<u8>> {
        if open.as_ref().is_none_or(|(at, _)| at != path) {
            *open = None;
            let file = descriptors::retry(|| File::open(path))
                .map_err(|e| StagingError::io("open segment", path, e))?;
            *open = Some((path.to_path_buf(), file));
        }
        let Some((_, file)) = open.as_ref() else {
            unreachable!("a segment was just opened");
        };
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, offset)
            .map_err(|e| StagingError::io("read segment", path, e))?;
        Ok(buf)
    }

    /// The rows of `keys`, in order, as stored (nothing verified: see
    /// [`FileStaging::fetch_stored_rows`]); for tests.
    #[cfg(test)]
    pub fn fetch_rows(&self, keys: &[String]) -> Result<Vec<Vec<u8>>> {
        Ok(self
            .fetch_stored_rows(keys)?
            .into_iter()
            .map(|row| row.bytes.to_vec())
            .collect())
    }

    /// The rows of `keys`, in order, with where they were read: the row bytes only (a frame's
    /// attachments are neither read nor hashed). Nothing is verified here: the caller must
    /// verify each row before using it (`row::verify_stored`: the row's own checksum, its
    /// staging digest, and `row::check_key`, that it is the row of the key asked for). The
    /// frame's content hash covered the same row bytes plus the attachments, so checking it
    /// too would hash every row twice. At most the segments these keys live in are opened, and
    /// closed again before returning.
    ///
    /// When this view does not hold every key, the fold that looks for them reads the new
    /// tails of the segments; rows in those tails are served from the bytes it read and
    /// checked (no second read), with `checksum_verified` where the fold's hash pass matched
    /// the row's checksum too. Rows indexed by an earlier call are read from their segment
    /// again, so damage after indexing is seen.
    pub fn fetch_stored_rows(&self, keys: &[String]) -> Result<Vec<StoredRow>> {
        let _permit = self.fds.enter();
        let mut tails = Vec::new();
        let locs = self.locate_keeping(keys, Some(&mut tails))?;
        // Read segment by segment, in file order: one segment descriptor open at a time.
        let mut order: Vec<usize> = (0..locs.len()).collect();
        order.sort_by_key(|&i| (locs[i].0.segment, locs[i].0.offset));
        let mut locs: Vec<Option<(Loc, PathBuf)>> = locs.into_iter().map(Some).collect();
        let mut open = None;
        let mut rows: Vec<Option<StoredRow>> = (0..locs.len()).map(|_| None).collect();
        for i in order {
            let Some((loc, path)) = locs[i].take() else {
                continue;
            };
            let end = loc.offset + loc.row_len;
            let tail = tails.iter().find(|t| {
                t.segment == loc.segment
                    && t.from <= loc.offset
                    && end <= t.from + t.buf.len() as u64
            });
            let (bytes, checksum_verified) = match tail {
                Some(t) => {
                    let start = (loc.offset - t.from) as usize;
                    let bytes = RowBytes {
                        buf: Arc::clone(&t.buf),
                        range: start..start + loc.row_len as usize,
                    };
                    (bytes, t.rows_summed.binary_search(&loc.offset).is_ok())
                }
                None => (
                    RowBytes::from(self.read_span(&path, loc.offset, loc.row_len, &mut open)?),
                    false,
                ),
            };
            rows[i] = Some(StoredRow {
                bytes,
                path,
                offset: loc.offset,
                checksum_verified,
            });
        }
        Ok(rows.into_iter().flatten().collect())
    }

    /// Begin a fetch of `keys` when this view holds none of them ([`PendingFetch`]): fold in
    /// the control log, read the new segment tails (both under the shared store lock) and start
    /// their checks on the helper thread. `None`: the view holds some of the keys, a key is in
    /// none of the tails read, or nothing new was read; fetch the ordinary way
    /// ([`FileStaging::fetch_stored_rows`]).
    pub fn begin_fetch(&self, keys: &[String], with_extras: bool) -> Result<Option<PendingFetch>> {
        if keys.is_empty() {
            return Ok(None);
        }
        {
            let view = self.view_read();
            if keys.iter().any(|key| view.keys.contains_key(key)) {
                return Ok(None);
            }
        }
        let mut tails = Vec::new();
        let mut bufs = Vec::new();
        {
            let _permit = self.fds.enter();
            let _guard = lock(&self.folding);
            let _lock = self.lock_store_to_read()?;
            let view = self.fold_control()?;
            for index in 0..view.segments.len() {
                if view.segments[index].own || view.segments[index].dropped {
                    continue;
                }
                if let Some((from, buf)) = self.read_tail(&view, index)? {
                    tails.push((index, from));
                    bufs.push(Arc::new(buf));
                }
            }
        }
        // The first index of each key asked (keys may repeat).
        let mut asked: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            asked.entry(key.as_str()).or_insert(i);
        }
        let mut found: HashMap<usize, usize> = HashMap::with_capacity(asked.len());
        let mut frames = Vec::new();
        for (tail, ((_, from), buf)) in tails.iter().zip(&bufs).enumerate() {
            let mut at = first_frame(*from);
            if *from == 0 && buf.get(..SEGMENT_MAGIC.len()) != Some(&SEGMENT_MAGIC[..]) {
                continue; // torn at creation or not a segment: the fold will say
            }
            while let Some((header, body)) = frame_at(buf, at) {
                let row_len = header.row_len as usize;
                let row = &buf[body.start..body.start + row_len];
                let key = row_ids(row).map(|(r, c)| row::staging_key(&r, &c));
                let first = key
                    .as_deref()
                    .and_then(|key| asked.get(key).copied())
                    .filter(|first| !found.contains_key(first));
                if let Some(first) = first {
                    found.insert(first, frames.len());
                }
                frames.push(PendingFrame {
                    tail,
                    start: at,
                    body: body.clone(),
                    row_len,
                    content: header.content,
                    asked: first,
                });
                at = body.end;
            }
        }
        let Some(rows) = keys
            .iter()
            .map(|key| {
                asked
                    .get(key.as_str())
                    .and_then(|first| found.get(first))
                    .copied()
            })
            .collect::<Option<Vec<usize>>>()
        else {
            // A key in none of the tails: let the ordinary fetch fold them and answer.
            let _guard = lock(&self.folding);
            let mut view = self.view_write();
            for ((index, from), buf) in tails.into_iter().zip(bufs) {
                if view.segments[index].scanned == from {
                    let checks = BodyChecks::ahead(&buf, first_frame(from));
                    self.fold_tail(&mut view, index, from, buf, &checks, None)?;
                }
            }
            return Ok(None);
        };
        let count = frames.len();
        let data = Arc::new(PendingData {
            bufs,
            frames,
            keys: keys.to_vec(),
            with_extras,
        });
        let checks = Split::start(Arc::clone(&data), count, check_pending);
        Ok(Some(PendingFetch {
            tails,
            rows,
            data,
            checks,
        }))
    }

    /// End a [`PendingFetch`]: wait for its checks, fold its tails in with them (those no
    /// other fold of this view took meanwhile), then compare what the fold indexed for each key
    /// with the row given for it.
    pub fn finish_fetch(&self, pending: PendingFetch) -> Result<FetchOutcome> {
        let PendingFetch {
            tails,
            rows,
            data,
            checks,
        } = pending;
        let verdicts = checks.finish();
        {
            let _guard = lock(&self.folding);
            let mut view = self.view_write();
            for (t, &(index, from)) in tails.iter().enumerate() {
                if view.segments[index].scanned != from {
                    continue; // another fold of this view read these bytes meanwhile
                }
                let checks = BodyChecks(
                    data.frames
                        .iter()
                        .zip(&verdicts)
                        .filter(|(frame, _)| frame.tail == t)
                        .map(|(frame, verdict)| (frame.start, verdict.0))
                        .collect(),
                );
                self.fold_tail(
                    &mut view,
                    index,
                    from,
                    Arc::clone(&data.bufs[t]),
                    &checks,
                    None,
                )?;
            }
        }
        let view = self.view_read();
        let mut damaged = None;
        for (i, (key, &f)) in data.keys.iter().zip(&rows).enumerate() {
            let frame = &data.frames[f];
            let (segment, from) = tails[frame.tail];
            let offset = from + frame.body.start as u64;
            let indexed = view.keys.get(key).is_some_and(|loc| {
                loc.segment == segment
                    && loc.offset == offset
                    && loc.row_len == frame.row_len as u64
            });
            if !indexed {
                return Ok(FetchOutcome::Redo);
            }
            if damaged.is_some() {
                continue;
            }
            let (body, rest) = &verdicts[f];
            let failure = if !body.row {
                Some(format!(
                    "staged row of {key:?} is damaged: the row does not match its checksum"
                ))
            } else {
                match rest {
                    Some(Err(message)) => Some(message.clone()),
                    Some(Ok(())) => None,
                    None => Some(format!("staged row of {key:?} was not verified")),
                }
            };
            if let Some(message) = failure {
                damaged = Some(FetchOutcome::Damaged {
                    index: i,
                    path: view.segments[segment].path.clone(),
                    offset,
                    message,
                });
            }
        }
        Ok(damaged.unwrap_or(FetchOutcome::Verified))
    }

    /// The attachments blob of one key.
    pub fn fetch_attachments_blob(&self, key: &str) -> Result<Vec<u8>> {
        let _permit = self.fds.enter();
        let keys = [key.to_owned()];
        let (loc, path) = self.locate(&keys)?.remove(0);
        let body = self.read_span(&path, loc.offset, loc.row_len + loc.att_len, &mut None)?;
        if sha16(&[&body]) != loc.content {
            return Err(StagingError::Corrupt(Error::corrupt(
                &path,
                loc.offset,
                format!("the stored bytes of {key:?} no longer match their checksum"),
            )));
        }
        Ok(body[loc.row_len as usize..].to_vec())
    }

    /// Every visible key (of one rollout, or all), sorted.
    pub fn keys(&self, rollout_id: Option<&str>) -> Result<Vec<String>> {
        self.refresh()?;
        let view = self.view_read();
        let mut keys: Vec<String> = match rollout_id {
            Some(id) => view.by_rollout.get(id).cloned().unwrap_or_default(),
            None => view.keys.keys().cloned().collect(),
        };
        keys.sort();
        Ok(keys)
    }

    /// Every retired (fenced) rollout id, sorted.
    pub fn retired(&self) -> Result<Vec<String>> {
        self.refresh()?;
        let view = self.view_read();
        let mut ids: Vec<String> = view
            .rollouts
            .iter()
            .filter(|(_, ctl)| ctl.retired)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Damaged ranges of acknowledged frames found so far (see the recovery rule).
    pub fn damage(&self) -> Result<Vec<Damage>> {
        self.refresh()?;
        Ok(self.view_read().damage.clone())
    }

    /// The segment files this view knows and has not seen dropped.
    pub fn segment_names(&self) -> Vec<String> {
        self.view_read()
            .segments
            .iter()
            .filter(|s| !s.dropped)
            .map(|s| s.name.clone())
            .collect()
    }
}

/// The ids at the start of a row (rollout, call), without decoding the rest.
fn row_ids(row: &[u8]) -> Option<(String, String)> {
    if row.len() < 7 || &row[..4] != row::ROW_MAGIC {
        return None;
    }
    let mut at = 7;
    let mut text = || -> Option<String> {
        let len = u32::from_le_bytes(row.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4;
        let s = std::str::from_utf8(row.get(at..at + len)?).ok()?.to_owned();
        at += len;
        Some(s)
    };
    let rollout = text()?;
    let call = text()?;
    Some((rollout, call))
}

/// Where the damage starting at `at` (buffer offset; `base` is the buffer's segment offset and
/// `damaged_from` the damage's) ends, if it is corruption: the offset of the next valid frame,
/// when some valid frame after the damage belongs to a batch that began after it. `None`: a
/// torn tail (no valid frame after the damage, or only frames of the damaged batch itself).
fn damage_end(buf: &[u8], at: usize, base: u64, damaged_from: u64) -> Option<usize> {
    let mut first: Option<usize> = None;
    let mut pos = at + 1;
    while pos < buf.len() {
        let Some(found) = memchr::memmem::find(&buf[pos..], FRAME_MAGIC) else {
            break;
        };
        let candidate = pos + found;
        match valid_frame(buf, candidate) {
            Some((header, body_end)) => {
                first.get_or_insert(candidate);
                // A batch that began after the damage (and, sanely, not after this frame).
                if header.batch_start > damaged_from
                    && header.batch_start <= base + candidate as u64
                {
                    return first;
                }
                pos = body_end;
            }
            None => pos = candidate + 1,
        }
    }
    None
}

/// The frame at `at` if it is complete and both its checksums match: its header and the end
/// of its body.
fn valid_frame(buf: &[u8], at: usize) -> Option<(Header, usize)> {
    BodyChecks::default()
        .valid_frame(buf, at)
        .map(|(header, end, _)| (header, end))
}

/// A frame body's checks from one SHA-256 pass: whether it matches the frame's content hash
/// (SHA-256 of row and attachments) and whether its row matches the row's own checksum
/// (SHA-256 of the row before its last 16 bytes, which are that checksum: a prefix of what
/// the content hash covers, so the hasher's state at the prefix's end gives it).
fn check_body(body: &[u8], row_len: usize, content: &[u8; 16]) -> BodyVerdict {
    const CHECK: usize = 16;
    if row_len < CHECK || row_len > body.len() {
        let content_ok = sha16(&[body]) == *content;
        return BodyVerdict {
            content: content_ok,
            row: false,
        };
    }
    let mut hasher = Sha256::new();
    hasher.update(&body[..row_len - CHECK]);
    let row_sum: [u8; 32] = hasher.clone().finalize().into();
    hasher.update(&body[row_len - CHECK..]);
    let full: [u8; 32] = hasher.finalize().into();
    BodyVerdict {
        content: full[..16] == content[..],
        row: row_sum[..CHECK] == body[row_len - CHECK..row_len],
    }
}

/// What [`check_body`] found.
#[derive(Debug, Clone, Copy)]
struct BodyVerdict {
    content: bool,
    row: bool,
}

/// Where a segment tail read from segment offset `from` has its first frame (past the
/// segment's magic at the start).
fn first_frame(from: u64) -> usize {
    if from == 0 {
        SEGMENT_MAGIC.len()
    } else {
        0
    }
}

/// The frame at `at` if its header is whole and valid: the header and its body's range.
fn frame_at(buf: &[u8], at: usize) -> Option<(Header, Range<usize>)> {
    let header = parse_header(buf.get(at..at.checked_add(HEADER_LEN)?)?)?;
    let body_len = usize::try_from(header.row_len.checked_add(header.att_len)?).ok()?;
    let body_at = at + HEADER_LEN;
    let body_end = body_at
        .checked_add(body_len)
        .filter(|end| *end <= buf.len())?;
    Some((header, body_at..body_end))
}

/// Body checksums of a segment tail's frames computed ahead of the fold, half of them on a
/// second thread, when the tail is large: the frames a walk of whole, valid headers finds,
/// by start offset. The fold still takes frames one by one under the recovery rule (what
/// is valid does not change, only where its body was hashed); a frame not found here is
/// checked when it is reached.
#[derive(Default)]
struct BodyChecks(Vec<(usize, BodyVerdict)>);

impl BodyChecks {
    /// Tails shorter than this are checked on the folding thread only.
    const PARALLEL_BYTES: usize = 128 << 10;

    fn ahead(buf: &Arc<Vec<u8>>, from: usize) -> Self {
        if buf.len().saturating_sub(from) < Self::PARALLEL_BYTES {
            return Self::default();
        }
        let mut frames = Vec::new();
        let mut at = from;
        while let Some((header, body)) = frame_at(buf, at) {
            let start = std::mem::replace(&mut at, body.end);
            frames.push((start, body, header.content, header.row_len as usize));
        }
        let starts: Vec<usize> = frames.iter().map(|(start, ..)| *start).collect();
        let split = Split::start(
            (Arc::clone(buf), frames),
            starts.len(),
            |(buf, frames), i| {
                let (_, body, content, row_len) = &frames[i];
                check_body(&buf[body.clone()], *row_len, content)
            },
        );
        BodyChecks(starts.into_iter().zip(split.finish()).collect())
    }

    /// [`valid_frame`], with the body checks taken from those made ahead when there are
    /// some for `at`; also whether the row matched its own checksum ([`check_body`]).
    fn valid_frame(&self, buf: &[u8], at: usize) -> Option<(Header, usize, bool)> {
        let (header, body) = frame_at(buf, at)?;
        let verdict = match self.0.binary_search_by_key(&at, |(start, _)| *start) {
            Ok(i) => self.0[i].1,
            Err(_) => check_body(&buf[body.clone()], header.row_len as usize, &header.content),
        };
        verdict.content.then_some((header, body.end, verdict.row))
    }
}

fn write_all_vectored(mut file: &File, mut slices: Vec<IoSlice<'_>>) -> io::Result<()> {
    let mut pending: &mut [IoSlice<'_>] = &mut slices;
    while !pending.is_empty() {
        // IOV_MAX is 1024 on Linux.
        let take = pending.len().min(1024);
        match file.write_vectored(&pending[..take]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote 0 bytes")),
            Ok(n) => IoSlice::advance_slices(&mut pending, n),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::digest::{self, CallFields, Mode};

    pub(crate) fn call(rollout: &str, call_id: &str, ids: Vec<u64>) -> StagedCall {
        let n = ids.len();
        let fields = CallFields {
            schema_version: 2,
            digest_version: 2,
            extras_digest_version: 1,
            rollout_id: rollout.into(),
            model_call_id: call_id.into(),
            parent_call_id: None,
            mode: Mode::Text,
            prev_len: 0,
            delta_len: n as u64,
            cum_len: n as u64,
            weight_version: 1,
            chain_hash: digest::chain_hash(None, &ids),
            cumulative_hash: digest::hash_token_ids(&ids),
            token_ids: ids,
            token_mask: vec![1.0; n],
            log_probs: vec![-0.5; n],
            extras_digest: digest::empty_extras_digest(),
        };
        let d = digest::staging_digest(&fields).unwrap();
        StagedCall {
            fields,
            digest: d,
            extras: None,
        }
    }

    #[test]
    fn a_first_fetch_serves_the_rows_its_fold_read_and_summed() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileStaging::open(dir.path()).unwrap();
        let calls: Vec<StagedCall> = (0..3)
            .map(|i| call("r", &format!("c{i}"), vec![i, i + 1]))
            .collect();
        for c in &calls {
            a.stage(Frame::new(c, b"att")).unwrap();
        }
        let keys: Vec<String> = calls.iter().map(StagedCall::key).collect();
        let b = FileStaging::open(dir.path()).unwrap();
        assert!(b.view_read().keys.is_empty(), "an open reads nothing");
        let first = b.fetch_stored_rows(&keys).unwrap();
        assert!(first.iter().all(|r| r.checksum_verified));
        // One buffer (the fold's), no second read.
        assert!(first
            .windows(2)
            .all(|w| Arc::ptr_eq(&w[0].bytes.buf, &w[1].bytes.buf)));
        for (row, c) in first.iter().zip(&calls) {
            assert_eq!(row::decode_verified(&row.bytes).unwrap(), *c);
            row::verify_stored_summed(&row.bytes, &c.key(), true).unwrap();
        }
        // Indexed now: read from the segment again, every check left to the caller.
        let again = b.fetch_stored_rows(&keys).unwrap();
        assert!(again.iter().all(|r| !r.checksum_verified));
        assert_eq!(again[1].bytes.to_vec(), first[1].bytes.to_vec());
    }

    #[test]
    fn a_pending_fetch_builds_from_rows_it_checks_while_folding() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileStaging::open(dir.path()).unwrap();
        let calls: Vec<StagedCall> = (0..4)
            .map(|i| call("r", &format!("c{i}"), vec![i, i + 1, i + 2]))
            .collect();
        for c in &calls {
            a.stage(Frame::new(c, b"att")).unwrap();
        }
        let keys: Vec<String> = [2, 0, 2, 3].iter().map(|&i| calls[i].key()).collect();
        // A fresh view: the rows as the header walk found them, then verified and indexed.
        let b = FileStaging::open(dir.path()).unwrap();
        let pending = b
            .begin_fetch(&keys, true)
            .unwrap()
            .expect("a fresh view folds");
        let rows: Vec<Vec<u8>> = pending.rows().iter().map(|r| r.to_vec()).collect();
        for (row, &i) in rows.iter().zip(&[2, 0, 2, 3]) {
            assert_eq!(row::decode_verified(row).unwrap(), calls[i]);
        }
        assert!(matches!(
            b.finish_fetch(pending).unwrap(),
            FetchOutcome::Verified
        ));
        assert_eq!(b.keys(None).unwrap().len(), 4);
        // Indexed now: the ordinary fetch.
        assert!(b.begin_fetch(&keys, false).unwrap().is_none());
        // Another fold of the same view between begin and finish: still the rows indexed.
        let c = FileStaging::open(dir.path()).unwrap();
        let pending = c.begin_fetch(&keys[..1], false).unwrap().unwrap();
        c.refresh().unwrap();
        assert!(matches!(
            c.finish_fetch(pending).unwrap(),
            FetchOutcome::Verified
        ));
        // A key in no tail: the ordinary fetch answers (and the tails are folded in).
        let d = FileStaging::open(dir.path()).unwrap();
        let unknown = vec!["r/nope".to_string()];
        assert!(d.begin_fetch(&unknown, false).unwrap().is_none());
        assert_eq!(d.view_read().keys.len(), 4);
        assert!(matches!(
            d.fetch_stored_rows(&unknown),
            Err(StagingError::UnknownKey(_))
        ));
    }

    #[test]
    fn a_pending_fetch_refuses_a_row_whose_checks_fail() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileStaging::open(dir.path()).unwrap();
        let calls: Vec<StagedCall> = (0..3)
            .map(|i| call("r", &format!("c{i}"), vec![i, 7]))
            .collect();
        for c in &calls {
            a.stage(Frame::new(c, b"")).unwrap();
        }
        let keys: Vec<String> = calls.iter().map(StagedCall::key).collect();
        let rows = a.fetch_stored_rows(&keys).unwrap();
        let seg = dir.path().join(&a.segment_names()[0]);
        // Damage a token id of c1's row, with the frame's content hash (and header check)
        // recomputed: the fold takes the frame, the row's checksum does not match.
        let mut bytes = std::fs::read(&seg).unwrap();
        let row_at = rows[1].offset as usize;
        let row_len = rows[1].bytes.len();
        let header_at = row_at - HEADER_LEN;
        bytes[row_at + row_len - 40] ^= 1;
        let content = sha16(&[&bytes[row_at..row_at + row_len]]);
        bytes[header_at + 32..header_at + 48].copy_from_slice(&content);
        let check = sha16(&[&bytes[header_at..header_at + CHECKED_LEN]]);
        bytes[header_at + CHECKED_LEN..header_at + HEADER_LEN].copy_from_slice(&check[..8]);
        std::fs::write(&seg, &bytes).unwrap();
        let b = FileStaging::open(dir.path()).unwrap();
        let pending = b.begin_fetch(&keys, false).unwrap().unwrap();
        match b.finish_fetch(pending).unwrap() {
            FetchOutcome::Damaged {
                index,
                offset,
                message,
                ..
            } => {
                assert_eq!((index, offset), (1, rows[1].offset));
                assert!(
                    message.contains("r/c1") && message.contains("checksum"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_body_pass_checks_content_and_row() {
        let c = call("r", "c1", vec![1, 2, 3]);
        let row = row::encode_row(&c);
        let frame = Frame::new(&c, b"attachments");
        let body = &frame.bytes[HEADER_LEN..];
        let verdict = check_body(body, row.len(), &frame.content);
        assert!(verdict.content && verdict.row);
        // A row whose checksum no longer matches, under a recomputed content hash.
        let mut damaged = body.to_vec();
        damaged[10] ^= 1;
        let content = sha16(&[&damaged]);
        let verdict = check_body(&damaged, row.len(), &content);
        assert!(verdict.content && !verdict.row);
        // Damaged attachments: the content hash fails, the row is still its own.
        let mut damaged = body.to_vec();
        *damaged.last_mut().unwrap() ^= 1;
        let verdict = check_body(&damaged, row.len(), &frame.content);
        assert!(!verdict.content && verdict.row);
    }

    #[test]
    fn restage_of_the_same_call_in_another_encoding_is_idempotent() {
        use row::{Attachment, AttachmentKind};
        let dir = tempfile::tempdir().unwrap();
        let a = FileStaging::open(dir.path()).unwrap();
        let bytes = row::encode_attachments(&[Attachment {
            name: "a".into(),
            kind: AttachmentKind::Bytes,
            format: String::new(),
            dtype: String::new(),
            shape: None,
            buffers: vec![b"abc".to_vec()],
        }]);
        let bytearray = row::encode_attachments(&[Attachment {
            name: "a".into(),
            kind: AttachmentKind::Buffer,
            format: "B".into(),
            dtype: String::new(),
            shape: Some(vec![3]),
            buffers: vec![b"abc".to_vec()],
        }]);
        // An older build's `attachments={}`: an empty list, sealed.
        let old_empty = row::encode_attachments(&[]);
        let c1 = call("r", "c1", vec![1, 2, 3]);
        let c2 = call("r", "c2", vec![4]);
        a.stage(Frame::new(&c1, &bytearray)).unwrap();
        a.stage(Frame::new(&c2, &old_empty)).unwrap();
        a.stage(Frame::new(&c1, &bytes)).unwrap();
        a.stage(Frame::new(&c2, b"")).unwrap();
        assert!(matches!(
            a.stage(Frame::new(&c2, &bytes)),
            Err(StagingError::Conflict(_))
        ));
        // From another instance too, and within one batch.
        let b = FileStaging::open(dir.path()).unwrap();
        b.stage(Frame::new(&c1, &bytes)).unwrap();
        b.stage(Frame::new(&c2, b"")).unwrap();
        let c3 = call("r", "c3", vec![5]);
        let slots = [Arc::new(Slot::default()), Arc::new(Slot::default())];
        let batch = vec![
            Pending {
                frame: Frame::new(&c3, &bytes),
                slot: Arc::clone(&slots[0]),
            },
            Pending {
                frame: Frame::new(&c3, &bytearray),
                slot: Arc::clone(&slots[1]),
            },
        ];
        b.commit(batch, &mut None, None);
        for slot in &slots {
            assert!(matches!(lock(&slot.result).take(), Some(Ok(()))));
        }
        assert_eq!(b.keys(None).unwrap().len(), 3);
    }

    #[test]
    fn stage_fetch_across_instances_and_lifecycle() {
        let dir = tempfile::tempdir().unwrap();
        let a = FileStaging::open(dir.path()).unwrap();
        let c1 = call("r", "c1", vec![1, 2, 3]);
        a.stage(Frame::new(&c1, b"")).unwrap();
        // Idempotent, then a conflict.
        a.stage(Frame::new(&c1, b"")).unwrap();
        let other = call("r", "c1", vec![9]);
        assert!(matches!(
            a.stage(Frame::new(&other, b"")),
            Err(StagingError::Conflict(_))
        ));
        // Another instance (as another process would) sees it and refuses the conflict too.
        let b = FileStaging::open(dir.path()).unwrap();
        let rows = b.fetch_rows(&["r/c1".to_string()]).unwrap();
        assert_eq!(row::decode_verified(&rows[0]).unwrap(), c1);
        assert!(matches!(
            b.stage(Frame::new(&other, b"")),
            Err(StagingError::Conflict(_))
        ));
        // Retire from b fences a.
        let removal = b.retire(&["r".to_string(), "q".to_string()]).unwrap();
        assert_eq!(removal.removed, vec!["r".to_string()]);
        assert_eq!(removal.absent, vec!["q".to_string()]);
        assert!(matches!(
            a.stage(Frame::new(&call("r", "c2", vec![4]), b"")),
            Err(StagingError::Retired(_))
        ));
        assert!(matches!(
            a.fetch_rows(&["r/c1".to_string()]),
            Err(StagingError::RetiredKey { .. })
        ));
        // Delete lifts the fence; the id starts empty.
        b.delete(&["r".to_string()]).unwrap();
        assert!(matches!(
            a.fetch_rows(&["r/c1".to_string()]),
            Err(StagingError::UnknownKey(_))
        ));
        a.stage(Frame::new(&other, b"")).unwrap();
        let rows = b.fetch_rows(&["r/c1".to_string()]).unwrap();
        assert_eq!(row::decode_verified(&rows[0]).unwrap(), other);
    }

    #[test]
    fn a_torn_tail_is_ignored_and_many_threads_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStaging::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    for i in 0..20 {
                        let c = call(&format!("r{t}"), &format!("c{i}"), vec![t, i]);
                        store.stage(Frame::new(&c, b"att")).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let stats = store.stats();
        assert_eq!(stats.frames, 320);
        assert!(stats.syncs <= stats.frames);
        let seg = store.segment_names()[0].clone();
        drop(store);
        // Tear the last frame: the rest stays readable, the torn key is not there.
        let path = dir.path().join(&seg);
        let len = std::fs::metadata(&path).unwrap().len();
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 3).unwrap();
        let reader = FileStaging::open(dir.path()).unwrap();
        assert_eq!(reader.keys(None).unwrap().len(), 319);
        assert_eq!(
            reader.fetch_attachments_blob("r0/c0").unwrap(),
            b"att".to_vec()
        );
    }

    fn frame_starts(path: &Path) -> Vec<usize> {
        let bytes = std::fs::read(path).unwrap();
        memchr::memmem::find_iter(&bytes, FRAME_MAGIC).collect()
    }

    fn zero(path: &Path, from: usize, to: usize) {
        let f = OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(&vec![0u8; to - from], from as u64).unwrap();
    }

    #[test]
    fn zeros_mid_segment_are_damage_not_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStaging::open(dir.path()).unwrap();
        for i in 0..5u64 {
            // One thread, one stage at a time: five batches of one frame.
            store
                .stage(Frame::new(&call("r", &format!("c{i}"), vec![i, 7]), b""))
                .unwrap();
        }
        let seg = dir.path().join(&store.segment_names()[0]);
        drop(store);
        let starts = frame_starts(&seg);
        assert_eq!(starts.len(), 5);
        zero(&seg, starts[2], starts[3]);
        let reader = FileStaging::open(dir.path()).unwrap();
        // Everything after the damage is still there; the damage is reported.
        assert_eq!(reader.keys(None).unwrap(), ["r/c0", "r/c1", "r/c3", "r/c4"]);
        let damage = reader.damage().unwrap();
        assert_eq!(damage.len(), 1);
        assert_eq!(
            (damage[0].start, damage[0].end),
            (starts[2] as u64, starts[3] as u64)
        );
        assert!(matches!(
            reader.fetch_rows(&["r/c2".to_string()]),
            Err(StagingError::Corrupt(_))
        ));
        assert_eq!(reader.fetch_rows(&["r/c4".to_string()]).unwrap().len(), 1);
    }

    /// A segment tail large enough that the fold checks bodies ahead on two threads
    /// (`BodyChecks`): a bad body mid-segment is still damage, a bad last body a torn tail.
    #[test]
    fn large_tails_fold_like_small_ones() {
        for (victim, torn) in [(4usize, false), (9, true)] {
            let dir = tempfile::tempdir().unwrap();
            let store = FileStaging::open(dir.path()).unwrap();
            for i in 0..10u64 {
                let ids = (0..2000).map(|t| t * 10 + i).collect();
                store
                    .stage(Frame::new(&call("r", &format!("c{i}"), ids), b""))
                    .unwrap();
            }
            let seg = dir.path().join(&store.segment_names()[0]);
            drop(store);
            let mut starts = frame_starts(&seg);
            assert_eq!(starts.len(), 10);
            let len = std::fs::metadata(&seg).unwrap().len() as usize;
            assert!(len > 2 * BodyChecks::PARALLEL_BYTES);
            starts.push(len);
            // One flipped bit in the victim's body: its header stays valid.
            let mut bytes = std::fs::read(&seg).unwrap();
            bytes[starts[victim] + HEADER_LEN + 200] ^= 0x10;
            std::fs::write(&seg, &bytes).unwrap();
            let reader = FileStaging::open(dir.path()).unwrap();
            let expected: Vec<String> = (0..10)
                .filter(|i| *i != victim)
                .map(|i| format!("r/c{i}"))
                .collect();
            assert_eq!(reader.keys(None).unwrap(), expected);
            let damage = reader.damage().unwrap();
            if torn {
                assert!(damage.is_empty());
            } else {
                assert_eq!(
                    damage.iter().map(|d| (d.start, d.end)).collect::<Vec<_>>(),
                    [(starts[victim] as u64, starts[victim + 1] as u64)]
                );
                assert!(matches!(
                    reader.fetch_rows(&[format!("r/c{victim}")]),
                    Err(StagingError::Corrupt(_))
                ));
            }
            let rows = reader.fetch_rows(&["r/c8".to_string()]).unwrap();
            assert_eq!(row::decode_verified(&rows[0]).unwrap().key(), "r/c8");
        }
    }

    #[test]
    fn a_segment_the_budget_closes_is_sealed_and_the_next_batch_starts_another() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store = FileStaging::open(dir.path()).unwrap();
        store
            .stage(Frame::new(&call("r", "c0", vec![1]), b""))
            .unwrap();
        assert_eq!(store.open_files(), 2); // the segment and the store lock, cached
        let first = dir.path().join(&store.segment_names()[0]);
        // What the process budget does to any cache (over the budget, or an exhausted open).
        store.fds.clear();
        assert_eq!(store.open_files(), 0);
        // Sealed: cut back to its data, nothing left reserved past it.
        let meta = std::fs::metadata(&first).unwrap();
        assert!(meta.blocks() * 512 < 64 << 10, "{} blocks", meta.blocks());
        store
            .stage(Frame::new(&call("r", "c1", vec![2]), b""))
            .unwrap();
        assert_eq!(store.segment_names().len(), 2);
        assert_eq!(store.open_files(), 2);
        assert_eq!(std::fs::metadata(&first).unwrap().len(), meta.len());
        // Rows of both segments, asked out of file order (read one segment at a time), come
        // back in the order asked, in this store and in a fresh one.
        let asked: Vec<String> = ["r/c1", "r/c0", "r/c1"].map(String::from).to_vec();
        for reader in [&store, &FileStaging::open(dir.path()).unwrap()] {
            let keys: Vec<String> = reader
                .fetch_rows(&asked)
                .unwrap()
                .iter()
                .map(|row| row::decode_verified(row).unwrap().key())
                .collect();
            assert_eq!(keys, asked);
        }
    }

    #[test]
    fn a_hole_in_the_last_batch_is_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStaging::open(dir.path()).unwrap();
        store
            .stage(Frame::new(&call("r", "c0", vec![1]), b""))
            .unwrap();
        // One batch of three frames, as a leader writes them (never acknowledged here: the
        // test tears it after the fact, as a crash before its sync would).
        let batch: Vec<Pending> = (1..4u64)
            .map(|i| Pending {
                frame: Frame::new(&call("r", &format!("c{i}"), vec![i]), b""),
                slot: Arc::new(Slot::default()),
            })
            .collect();
        let written = lock(&store.writer).segment_index;
        let (mut segment, kept) = store.take_cached(written);
        let kept = store.commit(batch, &mut segment, kept);
        lock(&store.writer).segment_index = segment.as_ref().map(|s| s.index);
        store.put_back(segment, kept);
        let seg = dir.path().join(&store.segment_names()[0]);
        drop(store);
        let starts = frame_starts(&seg);
        assert_eq!(starts.len(), 4);
        zero(&seg, starts[2], starts[3]); // the batch's middle frame
        let reader = FileStaging::open(dir.path()).unwrap();
        // The torn batch is ignored whole (its last frame is valid but unacknowledged).
        assert_eq!(reader.keys(None).unwrap(), ["r/c0", "r/c1"]);
        assert!(reader.damage().unwrap().is_empty());
        assert!(matches!(
            reader.fetch_rows(&["r/c3".to_string()]),
            Err(StagingError::UnknownKey(_))
        ));
    }
}
