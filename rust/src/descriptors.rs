//! The process-wide descriptor budget, and what the core does when descriptors run out.
//!
//! The store lives inside inference servers that hold thousands of client sockets, so the
//! descriptors it keeps open between operations (a rollout's lock, log and state file in the
//! token store, its log and lock file in the lineage resolver, its log in the ledger, the
//! segment it writes and its store lock in the file staging store) are a small, bounded share
//! of the process's limit, never a cache that grows until `open` fails.
//!
//! # The budget
//!
//! Every cache that keeps descriptors between operations is an [`FdCache`]: an LRU of entries
//! keyed by rollout id whose descriptors are [`Kept`] (counted by the cache's [`Account`] and by
//! the process-wide [`Budget`]). After an operation puts its entry back ([`FdCache::settle`]),
//! the cache closes its least recently used entries while it holds more than its own cap
//! (`max_open_files` of the store's constructor, unlimited by default), and then, while the
//! process's caches together hold more than the budget, the cache holding the most gives up
//! its least recently used entry ([`Budget::trim`]). Entries in use are not in the cache and
//! are never closed under their user; their descriptors count towards what is held, so a
//! burst of concurrent operations is followed by evictions that bring the total back.
//!
//! The budget is [`DEFAULT_SHARE`] (1/16) of the soft `RLIMIT_NOFILE`, at least
//! [`MIN_BUDGET`] and at most [`MAX_BUDGET`], and never more than a quarter of the soft limit;
//! it is re-read from the limit whenever a cache is created (a server that raises its limit
//! at startup gets a larger budget for the stores it opens afterwards). The environment
//! variable [`ENV_VAR`] (`TOKENCAPTURE_MAX_OPEN_FILES`) or [`Budget::set_limit`] fixes it
//! instead. 256 → 16, 1024 → 64, 65536 → 4096.
//!
//! # Operations in flight
//!
//! An operation holds a few descriptors while it runs (a put: the lock, the log, the state
//! file, and a temporary file or the directory while it replaces or syncs them), whether or
//! not they are cached. So the number of file operations running at once in the process is
//! bounded too: each takes a permit ([`Budget::enter`]) for its duration, at most
//! [`Budget::in_flight_limit`] at a time (the budget, but never more than a sixteenth of the
//! soft limit, within [`MIN_IN_FLIGHT`] and [`MAX_IN_FLIGHT`]), granted in arrival order.
//! That keeps what running operations hold (about four descriptors each) to about a quarter
//! of the soft limit even where the budget's floor ([`MIN_BUDGET`]) is more than a sixteenth
//! (a limit under 256), and the worker pool's threads, Python's and the caller's own all wait
//! in one queue.
//!
//! # Running out
//!
//! Every descriptor the core opens goes through [`retry`]: when the open fails with `EMFILE`
//! (this process is at its limit) or `ENFILE` (the system is), every cached descriptor of every
//! cache of this process is closed ([`Budget::evict_all`]) and the open is tried once more;
//! only a second failure is returned (as an [`crate::Error::Io`] whose source keeps the errno,
//! raised in Python as `OSError` with `errno` 24 or 23). Whoever spent the descriptors (this
//! store, another one, the server's sockets), an operation that could succeed after the
//! caches are closed does. When the process has literally nothing to give back (the caches
//! are empty and a neighbour holds every descriptor), the operation fails cleanly before it
//! has changed anything durable, and the next one succeeds as soon as descriptors are free.
//!
//! Running out also teaches the gate its *room*: the operations running then hold what the
//! rest of the process leaves, so from then on one fewer runs at once
//! (`Budget::shrink_room`); the room grows back by one each time as many operations as it
//! admits (16 at least) have finished and the descriptors of one more can be opened
//! (`Budget::grow_room`). A server that keeps most of the limit for its sockets then costs
//! the store throughput, not failed operations: with 200 of 256 descriptors held all along,
//! 8,000 operations from 64 rollouts at a time failed 1,352 times without the room, none
//! with it.
//!
//! # Registering a new cache
//!
//! A backend that keeps descriptors between operations builds an `FdCache<V>` with
//! [`FdCache::new`] (which registers it), wraps every descriptor an entry keeps with
//! `cache.account().keep(file)`, opens files through [`retry`], and calls
//! [`FdCache::settle`] after putting an entry back. Nothing else is needed: dropping the cache
//! unregisters it.

use std::fmt;
use std::io;
use std::num::NonZeroUsize;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};

use arc_swap::ArcSwapOption;
use lru::LruCache;

/// The budget is this fraction (1/`DEFAULT_SHARE`) of the process's soft descriptor limit.
pub const DEFAULT_SHARE: u64 = 16;
/// The smallest default budget (unless a quarter of the soft limit is smaller still).
pub const MIN_BUDGET: usize = 16;
/// The largest default budget.
pub const MAX_BUDGET: usize = 4096;
/// The most descriptors an operation's entry keeps (the token store's lock, log and state).
pub const KEPT_PER_OPERATION: usize = 3;
/// Descriptors one running file operation holds at most (a put: its lock, log and state, and
/// a temporary file or the directory while it replaces or syncs them).
pub const HELD_PER_OPERATION: usize = KEPT_PER_OPERATION + 2;
/// Fewest file operations allowed in flight at once.
pub const MIN_IN_FLIGHT: usize = 4;
/// Most file operations allowed in flight at once (and most threads of the worker pool).
pub const MAX_IN_FLIGHT: usize = 64;
/// The environment variable that fixes the process-wide budget (a number of descriptors).
pub const ENV_VAR: &str = "TOKENCAPTURE_MAX_OPEN_FILES";
/// The soft limit assumed where it cannot be read (macOS's default).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const ASSUMED_SOFT_LIMIT: u64 = 256;

const EMFILE: i32 = 24; // the same number on Linux, macOS and the BSDs
const ENFILE: i32 = 23;

/// Whether `err` says the process (`EMFILE`) or the system (`ENFILE`) is out of descriptors.
pub fn is_exhausted(err: &io::Error) -> bool {
    exhaustion(err).is_some()
}

/// An `EMFILE`/`ENFILE` that [`retry`] got again after it closed every descriptor the
/// process's caches kept: what the error a retry gives up with carries, so that its message can
/// say so (an exhaustion met anywhere else closed nothing, or only its own store's).
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct ExhaustedAfterClosing {
    source: io::Error,
}

/// `err` (an exhaustion) as [`retry`] gives it up after closing every cached descriptor.
pub fn exhausted_after_closing(err: io::Error) -> io::Error {
    let kind = err.kind();
    io::Error::new(kind, ExhaustedAfterClosing { source: err })
}

/// The descriptor exhaustion `err` reports, if it is one: its errno, and whether it is what
/// [`retry`] got after closing every cached descriptor of the process and trying again.
pub fn exhaustion(err: &io::Error) -> Option<(i32, bool)> {
    match err.raw_os_error() {
        Some(code @ (EMFILE | ENFILE)) => Some((code, false)),
        Some(_) => None,
        None => err
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<ExhaustedAfterClosing>())
            .and_then(|after| after.source.raw_os_error())
            .map(|code| (code, true)),
    }
}

/// What an operation's error says when `source` is an exhaustion ([`exhaustion`]): after
/// [`retry`] closed every cached descriptor and tried again, that; otherwise only that the
/// process or the system is at its limit (nothing was closed for it). `None` for any other
/// error.
pub fn exhaustion_message(op: &str, source: &io::Error) -> Option<String> {
    let (_, after_closing) = exhaustion(source)?;
    Some(if after_closing {
        format!(
            "{op} failed: {source}, even after closing every descriptor tokencapture kept open \
             in this process and retrying (the process or the system is at its limit of open \
             files)"
        )
    } else {
        format!("{op} failed: {source} (the process or the system is at its limit of open files)")
    })
}

/// Run `open` (anything that creates a descriptor); if it fails because descriptors ran
/// out, close every cached descriptor of this process and try once more.
pub fn retry<T>(open: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    budget().retry(open)
}

/// The process's soft `RLIMIT_NOFILE`; `None` when unlimited.
pub fn soft_limit() -> Option<u64> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        Some(ASSUMED_SOFT_LIMIT)
    }
}

/// The default budget for a soft limit (`None`: unlimited). See the module documentation.
pub fn default_limit(soft: Option<u64>) -> usize {
    let Some(soft) = soft else {
        return MAX_BUDGET;
    };
    let share = usize::try_from(soft / DEFAULT_SHARE).unwrap_or(MAX_BUDGET);
    let quarter = usize::try_from(soft / 4).unwrap_or(MAX_BUDGET);
    share.clamp(MIN_BUDGET, MAX_BUDGET).min(quarter)
}

/// The most file operations in flight the soft limit allows (`None`: unlimited): a sixteenth
/// of it, so that running operations hold about a quarter of it whatever the budget is.
pub fn in_flight_cap(soft: Option<u64>) -> usize {
    soft.map_or(MAX_IN_FLIGHT, |soft| {
        usize::try_from(soft / DEFAULT_SHARE).unwrap_or(MAX_IN_FLIGHT)
    })
    .clamp(MIN_IN_FLIGHT, MAX_IN_FLIGHT)
}

fn env_limit() -> Option<usize> {
    std::env::var(ENV_VAR).ok()?.trim().parse().ok()
}

/// What a cache of descriptors must let the budget do.
pub trait Holder: Send + Sync {
    /// Descriptors this holder keeps (idle in its cache or in use).
    fn held(&self) -> usize;
    /// Close the least recently used idle entry; false when the cache is empty.
    fn shed_one(&self) -> bool;
    /// Close every idle entry.
    fn shed_all(&self);
}

/// The process-wide budget (see the module documentation); [`budget`] returns it.
pub struct Budget {
    /// An explicit limit (from [`ENV_VAR`] or [`Budget::set_limit`]), or `usize::MAX`.
    fixed: AtomicUsize,
    /// The default from the soft limit, refreshed when a cache is created or an open runs out.
    derived: AtomicUsize,
    /// [`in_flight_cap`] of the soft limit, refreshed with `derived`.
    in_flight_cap: AtomicUsize,
    held: AtomicUsize,
    holders: Mutex<Vec<Weak<dyn Holder>>>,
    trimming: Mutex<()>,
    gate: Mutex<Gate>,
    turn: Condvar,
    /// How many file operations the descriptors the rest of the process leaves have room for,
    /// learnt from running out (`usize::MAX`: no limit learnt, or grown back past the gate's
    /// own): see [`Budget::shrink_room`] and [`Budget::grow_room`].
    room: AtomicUsize,
    /// Operations finished since the room last changed.
    since_room_change: AtomicUsize,
    /// Opens that ran out of descriptors (`EMFILE`/`ENFILE`): each closed every cache and
    /// was retried once. A count of operations' opens, not of descriptors.
    exhausted: AtomicU64,
    /// Of those, the retries that ran out again (the open failed and its operation raised).
    failed: AtomicU64,
    /// Cache entries closed while idle, for any reason: to keep a cache within its own cap,
    /// the caches within the budget, or (after an exhausted open) every cache emptied. A
    /// count of entries (a token-store entry keeps up to [`KEPT_PER_OPERATION`]
    /// descriptors), not of descriptors, and not of opens.
    evicted: AtomicU64,
}

impl fmt::Debug for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Budget")
            .field("limit", &self.limit())
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

/// The process's budget. One per process: a forked child makes its own on first use and
/// never touches the parent's (whose gate and lists may be locked by threads the child does
/// not have; see [`crate::fork`]). The caches the child inherited stay registered with the
/// parent's budget, unused.
pub fn budget() -> &'static Budget {
    static BUDGETS: ArcSwapOption<ProcessBudget> = ArcSwapOption::const_empty();
    budget_in(&BUDGETS, crate::fork::current_pid())
}

/// A process's budget, and the process.
struct ProcessBudget {
    pid: u32,
    budget: &'static Budget,
}

/// The budget of process `pid` in `slot`, made if the slot holds none or another process's:
/// lock-free (an atomic load, and a compare-and-swap once per process).
fn budget_in(slot: &ArcSwapOption<ProcessBudget>, pid: u32) -> &'static Budget {
    let made = crate::fork::this_process(
        slot,
        pid,
        |current| current.pid,
        |parent| {
            // A child keeps the limit its parent fixed (`set_limit`): an atomic, read without
            // touching anything else of the parent's budget.
            let inherited = parent
                .map(|parent| parent.budget.fixed.load(Ordering::Relaxed))
                .filter(|&fixed| fixed != usize::MAX);
            // Leaked: `Account`s and permits refer to it for the rest of the process.
            // (Threads of one process racing here each leak one; one is installed.)
            Ok::<_, std::convert::Infallible>(ProcessBudget {
                pid,
                budget: Box::leak(Box::new(Budget::new(inherited.or_else(env_limit)))),
            })
        },
    );
    match made {
        Ok(current) => current.budget,
        Err(never) => match never {},
    }
}

/// A snapshot of the budget's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetStats {
    pub limit: usize,
    pub held: usize,
    /// Opens that found descriptors exhausted (and closed every cache before retrying once).
    pub exhausted: u64,
    /// Retries that found them exhausted still (the operation failed).
    pub failed: u64,
    /// Idle cache entries closed (each up to [`KEPT_PER_OPERATION`] descriptors): to keep
    /// within a cache's cap or the budget, or to free descriptors after an exhausted open.
    pub evicted: u64,
}

impl Budget {
    /// A budget of its own (the process has one, [`budget`]; tests make others): `fixed`, or
    /// the default from the soft limit.
    pub fn new(fixed: Option<usize>) -> Self {
        Budget {
            fixed: AtomicUsize::new(fixed.map_or(usize::MAX, |fixed| fixed.min(usize::MAX - 1))),
            derived: AtomicUsize::new(default_limit(soft_limit())),
            in_flight_cap: AtomicUsize::new(in_flight_cap(soft_limit())),
            held: AtomicUsize::new(0),
            holders: Mutex::new(Vec::new()),
            trimming: Mutex::new(()),
            gate: Mutex::new(Gate::default()),
            turn: Condvar::new(),
            room: AtomicUsize::new(usize::MAX),
            since_room_change: AtomicUsize::new(0),
            exhausted: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// [`retry`] over this budget's caches.
    pub fn retry<T>(&self, mut open: impl FnMut() -> io::Result<T>) -> io::Result<T> {
        match open() {
            Err(err) if is_exhausted(&err) => {
                self.exhausted.fetch_add(1, Ordering::Relaxed);
                // The soft limit may have been lowered since the caches were made: size the
                // budget and the gate to the limit that just ran out, then close everything.
                self.refresh_from_soft_limit();
                self.shrink_room();
                self.evict_all();
                match open() {
                    Err(err) if is_exhausted(&err) => {
                        self.failed.fetch_add(1, Ordering::Relaxed);
                        Err(exhausted_after_closing(err))
                    }
                    again => again,
                }
            }
            other => other,
        }
    }

    /// Descriptors the process's caches may keep between operations.
    pub fn limit(&self) -> usize {
        match self.fixed.load(Ordering::Relaxed) {
            usize::MAX => self.derived.load(Ordering::Relaxed),
            fixed => fixed,
        }
    }

    /// Fix the limit (`None`: back to the default from the soft limit); trims at once.
    pub fn set_limit(&self, limit: Option<usize>) {
        let fixed = limit.map_or(usize::MAX, |limit| limit.min(usize::MAX - 1));
        self.fixed.store(fixed, Ordering::Relaxed);
        if limit.is_none() {
            self.refresh_from_soft_limit();
        }
        self.trim();
    }

    /// Re-read the soft limit: the default budget and the gate's cap follow it.
    fn refresh_from_soft_limit(&self) {
        let soft = soft_limit();
        self.derived.store(default_limit(soft), Ordering::Relaxed);
        self.in_flight_cap
            .store(in_flight_cap(soft), Ordering::Relaxed);
    }

    /// How many file operations may run at once: the limit, within [`MIN_IN_FLIGHT`] and
    /// [`MAX_IN_FLIGHT`], at most a sixteenth of the soft limit ([`in_flight_cap`]), and at
    /// most the room learnt from running out (at least one).
    pub fn in_flight_limit(&self) -> usize {
        self.natural_in_flight_limit()
            .min(self.room.load(Ordering::Relaxed))
            .max(1)
    }

    /// The most operations the gate can admit at once now: [`Budget::in_flight_limit`]
    /// before any room was learnt (a learnt room grows back to it). What the worker pool's
    /// threads are bounded by ([`max_in_flight`]).
    pub fn max_in_flight(&self) -> usize {
        self.natural_in_flight_limit().max(1)
    }

    /// [`Budget::in_flight_limit`] before any room was learnt.
    fn natural_in_flight_limit(&self) -> usize {
        self.limit()
            .clamp(MIN_IN_FLIGHT, MAX_IN_FLIGHT)
            .min(self.in_flight_cap.load(Ordering::Relaxed))
    }

    /// An open ran out of descriptors: the operations running now hold what the rest of the
    /// process (an inference server's sockets, say) leaves, so one fewer than run now is what
    /// fits. Later operations wait at the gate for that many instead of running out too;
    /// the room grows back as operations finish (`Budget::grow_room`).
    fn shrink_room(&self) {
        let fits = self.in_flight().saturating_sub(1).max(1);
        self.room.fetch_min(fits, Ordering::Relaxed);
        self.since_room_change.store(0, Ordering::Relaxed);
    }

    /// One operation finished under a learnt room: after as many as the room (16 at least)
    /// finished, it grows by one, unless opening the descriptors one more operation holds
    /// ([`HELD_PER_OPERATION`], closed again at once) runs out now; back at the gate's own
    /// limit, the learnt room is forgotten.
    fn grow_room(&self) {
        let room = self.room.load(Ordering::Relaxed);
        if room == usize::MAX {
            return;
        }
        let finished = self.since_room_change.fetch_add(1, Ordering::Relaxed) + 1;
        if finished < room.max(16) {
            return;
        }
        self.since_room_change.store(0, Ordering::Relaxed);
        let natural = self.natural_in_flight_limit();
        if room >= natural {
            // The gate's own limit is lower now (a lowered soft limit): the room no longer
            // binds, and probing for it would only take descriptors from running operations.
            let _ =
                self.room
                    .compare_exchange(room, usize::MAX, Ordering::Relaxed, Ordering::Relaxed);
            return;
        }
        let free: io::Result<Vec<std::fs::File>> = (0..HELD_PER_OPERATION)
            .map(|_| std::fs::File::open("/dev/null"))
            .collect();
        // Only running out says no: a sandbox without /dev/null must not keep the room low.
        if free.as_ref().is_err_and(is_exhausted) {
            return;
        }
        drop(free);
        let grown = if room + 1 >= natural {
            usize::MAX
        } else {
            room + 1
        };
        if self
            .room
            .compare_exchange(room, grown, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            let waiting = self
                .gate
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .waiting
                > 0;
            if waiting {
                self.turn.notify_all();
            }
        }
    }

    /// Wait for a permit to run one file operation (in arrival order); the operation runs
    /// while the returned guard lives. Never take a second permit while holding one.
    pub fn enter(&self) -> Permit<'_> {
        let mut gate = self.gate.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = gate.next_ticket;
        gate.next_ticket += 1;
        while !(gate.serving == ticket && gate.running < self.in_flight_limit()) {
            gate.waiting += 1;
            gate = self.turn.wait(gate).unwrap_or_else(PoisonError::into_inner);
            gate.waiting -= 1;
        }
        gate.serving += 1;
        gate.running += 1;
        let waiting = gate.waiting > 0;
        drop(gate);
        if waiting {
            // The next in line may be able to go too.
            self.turn.notify_all();
        }
        Permit { budget: self }
    }

    /// File operations running now (holding a permit).
    pub fn in_flight(&self) -> usize {
        self.gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .running
    }

    /// Descriptors kept by every cache of the process (idle or in use).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> BudgetStats {
        BudgetStats {
            limit: self.limit(),
            held: self.held(),
            exhausted: self.exhausted.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }

    /// Register a cache (done by [`FdCache::new`]); it is dropped from the list once gone.
    pub fn register(&self, holder: Weak<dyn Holder>) {
        self.refresh_from_soft_limit();
        let mut holders = self.holders();
        holders.retain(|h| h.strong_count() > 0);
        holders.push(holder);
    }

    fn holders(&self) -> MutexGuard<'_, Vec<Weak<dyn Holder>>> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn live(&self) -> Vec<Arc<dyn Holder>> {
        self.holders().iter().filter_map(Weak::upgrade).collect()
    }

    /// While the caches hold more than the limit (plus what the operations running now may
    /// keep in use: [`KEPT_PER_OPERATION`] each), the one holding most closes its least
    /// recently used entry. One thread trims at a time; others skip (it trims for them).
    /// Call without holding any cache's lock.
    pub fn trim(&self) {
        if self.held() <= self.limit() {
            return;
        }
        let allowed = || {
            self.limit()
                .saturating_add(KEPT_PER_OPERATION.saturating_mul(self.in_flight()))
        };
        while self.held() > allowed() {
            let Ok(trimming) = self.trimming.try_lock() else {
                return;
            };
            let mut holders = self.live();
            while self.held() > allowed() && !holders.is_empty() {
                // Not a sort: other threads change what the caches hold while this runs, and
                // a sort whose keys change under it panics (an inconsistent order).
                let largest = most_held(&holders);
                if !holders[largest].shed_one() {
                    holders.swap_remove(largest); // nothing idle left there
                }
            }
            if holders.is_empty() {
                return; // what is left is in use
            }
            drop(trimming);
            // Another thread may have skipped its trim while this one held the lock: look
            // again (the loop condition) now that it is released.
        }
    }

    /// Close every idle cached descriptor of the process. Call without holding any cache's
    /// lock.
    pub fn evict_all(&self) {
        for holder in self.live() {
            holder.shed_all();
        }
    }
}

/// The index of the holder keeping the most descriptors (each read once; `holders` not empty).
fn most_held(holders: &[Arc<dyn Holder>]) -> usize {
    let mut largest = (0, 0);
    for (index, holder) in holders.iter().enumerate() {
        let held = holder.held();
        if held > largest.1 {
            largest = (index, held);
        }
    }
    largest.0
}

/// Tickets of the in-flight gate: who is next, how many run, how many wait.
///
/// `waiting` counts the threads asleep on the gate's condition variable (changed only under
/// its mutex): the gate is notified only when one is. A notification is a system call whether
/// or not anyone waits (`futex` wake), and nearly every operation passes a gate that nobody
/// waits at: two of them per store operation were most of the `futex` calls of the workers.
/// Skipping it misses nobody: a thread about to wait counts itself and checks the gate under
/// the same mutex, so it either sees the change or is counted before it was made.
#[derive(Debug, Default)]
struct Gate {
    next_ticket: u64,
    serving: u64,
    running: usize,
    waiting: usize,
}

/// A permit to run one file operation (see [`Budget::enter`]).
#[derive(Debug)]
pub struct Permit<'b> {
    budget: &'b Budget,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut gate = self
            .budget
            .gate
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        gate.running -= 1;
        let waiting = gate.waiting > 0;
        drop(gate);
        if waiting {
            self.budget.turn.notify_all();
        }
        self.budget.grow_room();
        // What running operations may keep in use shrank: keep the caches within it, so at
        // rest they hold at most the budget.
        self.budget.trim();
    }
}

/// A permit of the process's budget: hold it for the duration of a file operation.
pub fn enter() -> Permit<'static> {
    budget().enter()
}

/// [`Budget::max_in_flight`] of the process budget.
pub fn max_in_flight() -> usize {
    budget().max_in_flight()
}

/// One cache's count of the descriptors it keeps (a share of its budget's).
#[derive(Debug, Clone)]
pub struct Account {
    held: Arc<AtomicUsize>,
    budget: &'static Budget,
}

impl Account {
    fn new(budget: &'static Budget) -> Self {
        Account {
            held: Arc::new(AtomicUsize::new(0)),
            budget,
        }
    }

    /// Count `descriptor` as kept by this cache until the returned [`Kept`] is dropped.
    pub fn keep<F>(&self, descriptor: F) -> Kept<F> {
        self.held.fetch_add(1, Ordering::Relaxed);
        self.budget.held.fetch_add(1, Ordering::Relaxed);
        Kept {
            inner: Some(descriptor),
            account: self.clone(),
        }
    }

    /// Descriptors this cache keeps.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// A descriptor a cache keeps, counted until dropped (or taken back with `into_inner`).
pub struct Kept<F> {
    inner: Option<F>,
    account: Account,
}

impl<F> Kept<F> {
    /// The descriptor, no longer counted.
    pub fn into_inner(mut self) -> F {
        self.inner.take().expect("a kept descriptor")
    }
}

impl<F> Drop for Kept<F> {
    fn drop(&mut self) {
        // The descriptor (if not taken back) closes right after this, as a field.
        self.account.held.fetch_sub(1, Ordering::Relaxed);
        self.account.budget.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<F> Deref for Kept<F> {
    type Target = F;
    fn deref(&self) -> &F {
        self.inner.as_ref().expect("a kept descriptor")
    }
}

impl<F> DerefMut for Kept<F> {
    fn deref_mut(&mut self) -> &mut F {
        self.inner.as_mut().expect("a kept descriptor")
    }
}

impl<F: fmt::Debug> fmt::Debug for Kept<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

/// An LRU of per-rollout entries whose descriptors count against the budget (see the module
/// documentation). Entries may be taken out while in use (`lock().pop(..)`) or shared
/// (`Arc` values); either way their [`Kept`] descriptors stay counted until dropped.
pub struct FdCache<V> {
    lru: Mutex<LruCache<String, V>>,
    account: Account,
    /// This cache's own cap on descriptors (`usize::MAX`: only the process budget).
    max_open: usize,
}

impl<V> fmt::Debug for FdCache<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FdCache")
            .field("held", &self.account.held())
            .field("max_open", &self.max_open)
            .finish_non_exhaustive()
    }
}

impl<V: Send + 'static> FdCache<V> {
    /// A cache registered with the process's budget, of at most `entries` (at least one)
    /// entries and, if given, at most `max_open` descriptors (0: none kept between operations).
    pub fn new(entries: usize, max_open: Option<usize>) -> Arc<Self> {
        Self::with_budget(entries, max_open, budget())
    }

    /// [`FdCache::new`] under another budget.
    pub fn with_budget(
        entries: usize,
        max_open: Option<usize>,
        budget: &'static Budget,
    ) -> Arc<Self> {
        let capacity = NonZeroUsize::new(entries.max(1)).unwrap_or(NonZeroUsize::MIN);
        // Not `LruCache::new`, which allocates room for every entry up front (a generous
        // `cached_rollouts=` was gigabytes, or a capacity-overflow panic).
        let mut lru = LruCache::unbounded();
        lru.resize(capacity);
        let cache = Arc::new(FdCache {
            lru: Mutex::new(lru),
            account: Account::new(budget),
            max_open: max_open.unwrap_or(usize::MAX),
        });
        let weak: Weak<FdCache<V>> = Arc::downgrade(&cache);
        budget.register(weak);
        cache
    }

    /// The entries. A panic elsewhere cannot leave a half-updated entry behind (entries are
    /// taken out or locked while in use), so a poisoned map is still consistent.
    pub fn lock(&self) -> MutexGuard<'_, LruCache<String, V>> {
        self.lru.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn account(&self) -> &Account {
        &self.account
    }

    /// Descriptors this cache keeps (idle or in use).
    pub fn held(&self) -> usize {
        self.account.held()
    }

    /// This cache's own cap, `None` when only the process budget applies.
    pub fn max_open(&self) -> Option<usize> {
        (self.max_open != usize::MAX).then_some(self.max_open)
    }

    /// A permit of this cache's budget ([`Budget::enter`]): the process's budget when the
    /// cache was made, without looking it up again (a `getpid`) on every operation.
    pub fn enter(&self) -> Permit<'static> {
        self.account.budget.enter()
    }

    /// Keep within this cache's cap and the process budget, after an entry was put back.
    /// Call without holding the cache's lock.
    pub fn settle(&self) {
        while self.account.held() > self.max_open && self.pop_lru() {}
        self.account.budget.trim();
    }

    /// Drop every entry (and close what they keep, unless in use elsewhere).
    pub fn clear(&self) {
        let entries: Vec<(String, V)> = {
            let mut lru = self.lock();
            std::iter::from_fn(|| lru.pop_lru()).collect()
        };
        drop(entries); // closed outside the lock
    }

    fn pop_lru(&self) -> bool {
        let victim = self.lock().pop_lru();
        let found = victim.is_some();
        if found {
            self.account.budget.evicted.fetch_add(1, Ordering::Relaxed);
        }
        drop(victim); // closed outside the lock
        found
    }
}

impl<V: Send + 'static> Holder for FdCache<V> {
    fn held(&self) -> usize {
        self.account.held()
    }

    fn shed_one(&self) -> bool {
        self.pop_lru()
    }

    fn shed_all(&self) {
        while self.pop_lru() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    /// A budget of the test's own (the process's is shared with every other test).
    fn own_budget(limit: Option<usize>) -> &'static Budget {
        Box::leak(Box::new(Budget::new(limit)))
    }

    fn open(cache: &FdCache<Vec<Kept<File>>>, key: &str, files: usize) {
        let kept = (0..files)
            .map(|_| cache.account().keep(File::open("/dev/null").unwrap()))
            .collect();
        cache.lock().put(key.to_owned(), kept);
        cache.settle();
    }

    #[test]
    fn the_default_is_a_sixteenth_of_the_soft_limit_within_bounds() {
        assert_eq!(default_limit(Some(256)), 16);
        assert_eq!(default_limit(Some(1024)), 64);
        assert_eq!(default_limit(Some(65_536)), 4096);
        assert_eq!(default_limit(Some(1 << 20)), MAX_BUDGET);
        assert_eq!(default_limit(None), MAX_BUDGET);
        // Small limits: the floor, but never more than a quarter.
        assert_eq!(default_limit(Some(128)), 16);
        assert_eq!(default_limit(Some(32)), 8);
    }

    #[test]
    fn operations_in_flight_hold_about_a_quarter_of_a_small_soft_limit() {
        assert_eq!(in_flight_cap(Some(256)), 16);
        assert_eq!(in_flight_cap(Some(1024)), 64);
        assert_eq!(in_flight_cap(None), MAX_IN_FLIGHT);
        // Under 256 the budget's floor (16) is more than a sixteenth: the gate is not.
        assert_eq!(in_flight_cap(Some(128)), 8);
        assert_eq!(in_flight_cap(Some(64)), MIN_IN_FLIGHT);
        for soft in [64_u64, 100, 128, 200, 256, 1024] {
            let cap = in_flight_cap(Some(soft));
            assert!(
                cap * HELD_PER_OPERATION <= usize::try_from(soft).unwrap() / 3,
                "{soft}"
            );
        }
    }

    #[test]
    fn a_cache_keeps_within_its_own_cap() {
        let budget = own_budget(Some(1000));
        let cache = FdCache::with_budget(100, Some(5), budget);
        for key in ["a", "b", "c"] {
            open(&cache, key, 2);
        }
        // 6 > 5: the least recently used entry went.
        assert_eq!((cache.held(), budget.held()), (4, 4));
        assert!(cache.lock().peek("a").is_none());
        assert!(cache.lock().peek("c").is_some());
        cache.clear();
        assert_eq!((cache.held(), budget.held()), (0, 0));
        // Cap 0: nothing is kept between operations.
        let none = FdCache::with_budget(100, Some(0), budget);
        open(&none, "a", 3);
        assert_eq!(none.held(), 0);
        // One entry evicted by each cap ('a' above, 'a' here): the counter counts entries (of
        // two and three descriptors), not descriptors.
        assert_eq!(budget.stats().evicted, 2);
    }

    #[test]
    fn the_process_budget_sheds_from_the_largest_holder() {
        let budget = own_budget(Some(6));
        let big = FdCache::with_budget(100, None, budget);
        let small = FdCache::with_budget(100, None, budget);
        open(&small, "s", 1);
        for key in ["a", "b", "c", "d", "e"] {
            open(&big, key, 1);
        }
        assert_eq!(budget.held(), 6);
        open(&small, "t", 1);
        // Over by one: the holder with most gave up its oldest entry.
        assert_eq!(budget.held(), 6);
        assert_eq!((big.held(), small.held()), (4, 2));
        assert!(big.lock().peek("a").is_none());
        // A lower limit trims at once.
        budget.set_limit(Some(4));
        assert_eq!((big.held(), small.held()), (2, 2));
        // Entries in use are counted, never closed under their user.
        let in_use = big.lock().pop("d").unwrap();
        budget.evict_all();
        assert_eq!((big.held(), small.held(), budget.held()), (1, 0, 1));
        drop(in_use);
        assert_eq!(budget.held(), 0);
    }

    /// A holder whose count changes every time it is read (as a cache's does while other
    /// threads use it), and that gives back one descriptor per shed while it has any.
    struct Busy {
        budget: &'static Budget,
        reads: AtomicUsize,
        seed: usize,
        left: AtomicUsize,
    }

    impl Holder for Busy {
        fn held(&self) -> usize {
            let read = self.reads.fetch_add(1, Ordering::Relaxed);
            (read * 7919 + self.seed * 104_729) % 101
        }
        fn shed_one(&self) -> bool {
            let shed = self
                .left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                    left.checked_sub(1)
                })
                .is_ok();
            if shed {
                self.budget.held.fetch_sub(1, Ordering::Relaxed);
            }
            shed
        }
        fn shed_all(&self) {}
    }

    #[test]
    fn trimming_copes_with_counts_that_change_while_it_chooses() {
        let budget = own_budget(Some(0));
        let holders: Vec<Arc<dyn Holder>> = (0..64)
            .map(|seed| {
                let holder: Arc<dyn Holder> = Arc::new(Busy {
                    budget,
                    reads: AtomicUsize::new(0),
                    seed,
                    left: AtomicUsize::new(10),
                });
                budget.register(Arc::downgrade(&holder));
                holder
            })
            .collect();
        budget.held.store(640, Ordering::Relaxed);
        budget.trim();
        assert_eq!(budget.held(), 0);
        drop(holders);
    }

    #[test]
    fn a_dropped_cache_gives_back_its_count_and_leaves_the_registry() {
        let budget = own_budget(None);
        let cache = FdCache::with_budget(10, None, budget);
        open(&cache, "a", 3);
        assert_eq!(budget.held(), 3);
        drop(cache);
        assert_eq!(budget.held(), 0);
        assert!(budget.live().is_empty());
        budget.evict_all(); // a dead holder is skipped
    }

    #[test]
    fn retry_evicts_every_cache_and_tries_once_more() {
        let budget = own_budget(None);
        let first = FdCache::with_budget(10, None, budget);
        let second = FdCache::with_budget(10, None, budget);
        open(&first, "a", 2);
        open(&second, "b", 1);
        let mut calls = 0;
        let result = budget.retry(|| {
            calls += 1;
            if calls == 1 {
                Err(io::Error::from_raw_os_error(EMFILE))
            } else {
                Ok(budget.held())
            }
        });
        // The second attempt ran after every cache was emptied: one open exhausted, the two
        // entries (three descriptors) it closed counted as evictions.
        assert_eq!((calls, result.unwrap()), (2, 0));
        assert_eq!((budget.stats().exhausted, budget.stats().evicted), (1, 2));
        // Only once: a second exhaustion is returned with its errno.
        let mut calls = 0;
        let err = budget
            .retry(|| -> io::Result<()> {
                calls += 1;
                Err(io::Error::from_raw_os_error(ENFILE))
            })
            .unwrap_err();
        assert_eq!((calls, exhaustion(&err)), (2, Some((ENFILE, true))));
        assert_eq!(
            err.to_string(),
            io::Error::from_raw_os_error(ENFILE).to_string()
        );
        let words = exhaustion_message("open", &err).unwrap();
        assert!(
            words.contains("even after closing every descriptor"),
            "{words}"
        );
        // An exhaustion met outside `retry` closed nothing: its words do not say it did.
        let raw = io::Error::from_raw_os_error(EMFILE);
        assert_eq!(exhaustion(&raw), Some((EMFILE, false)));
        let words = exhaustion_message("open", &raw).unwrap();
        assert!(!words.contains("closing"), "{words}");
        assert!(words.contains("at its limit of open files"), "{words}");
        assert_eq!(
            exhaustion_message("open", &io::ErrorKind::NotFound.into()),
            None
        );
        // Duplicated for another waiter, it stays what it was.
        let copy = crate::Error::Io {
            op: "open",
            path: "x".into(),
            source: err,
        }
        .duplicate();
        match copy {
            crate::Error::Io { source, .. } => {
                assert_eq!(exhaustion(&source), Some((ENFILE, true)));
            }
            other => panic!("{other:?}"),
        }
        let stats = budget.stats();
        assert_eq!((stats.exhausted, stats.failed), (2, 1));
        // Other errors are not retried.
        let mut calls = 0;
        let _ = budget.retry(|| -> io::Result<()> {
            calls += 1;
            Err(io::ErrorKind::NotFound.into())
        });
        assert_eq!(calls, 1);
    }

    #[test]
    fn running_out_teaches_the_gate_its_room_which_grows_back_when_descriptors_are_free() {
        let budget = own_budget(Some(32));
        assert_eq!(budget.in_flight_limit(), 32);
        // Six operations run; the sixth one's open runs out: five fit.
        let held: Vec<Permit<'_>> = (0..6).map(|_| budget.enter()).collect();
        let _ = budget.retry(|| -> io::Result<()> { Err(io::Error::from_raw_os_error(EMFILE)) });
        assert_eq!(budget.in_flight_limit(), 5);
        drop(held); // six operations finished
                    // One more fits after 16 operations finished with descriptors to spare (this test's
                    // process has plenty), up to the gate's own limit, where the room is forgotten.
        for _ in 0..9 {
            drop(budget.enter());
        }
        assert_eq!(budget.in_flight_limit(), 5);
        drop(budget.enter());
        assert_eq!(budget.in_flight_limit(), 6);
        for _ in 0..16 * 40 {
            drop(budget.enter());
        }
        assert_eq!(budget.in_flight_limit(), 32);
        assert_eq!(budget.room.load(Ordering::Relaxed), usize::MAX);
        // Running out with one operation running still lets one run.
        let one = budget.enter();
        let _ = budget.retry(|| -> io::Result<()> { Err(io::Error::from_raw_os_error(EMFILE)) });
        assert_eq!(budget.in_flight_limit(), 1);
        drop(one);
    }

    #[test]
    fn the_gate_counts_its_sleepers_and_wakes_them_only_when_there_are_some() {
        let budget = own_budget(Some(MIN_IN_FLIGHT));
        // Uncontended: nobody sleeps, so nobody is notified (no futex call).
        drop(budget.enter());
        assert_eq!(budget.gate.lock().unwrap().waiting, 0);
        let mut held: Vec<Permit<'_>> = (0..MIN_IN_FLIGHT).map(|_| budget.enter()).collect();
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| drop(budget.enter()));
            while budget.gate.lock().unwrap().waiting == 0 {
                std::thread::yield_now();
            }
            // The sleeper was counted, so the permit given back wakes it.
            drop(held.pop());
            waiter.join().unwrap();
        });
        assert_eq!(budget.gate.lock().unwrap().waiting, 0);
        drop(held);
        assert_eq!(budget.in_flight(), 0);
    }

    #[test]
    fn the_gate_admits_at_most_its_limit_in_arrival_order() {
        use std::sync::atomic::AtomicUsize;
        let budget = own_budget(Some(MIN_IN_FLIGHT));
        assert_eq!(budget.in_flight_limit(), MIN_IN_FLIGHT);
        let mut held: Vec<Permit<'_>> = (0..MIN_IN_FLIGHT).map(|_| budget.enter()).collect();
        assert_eq!(budget.in_flight(), MIN_IN_FLIGHT);
        let order = Mutex::new(Vec::new());
        let most = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for waiter in 0..6 {
                let (order, most) = (&order, &most);
                scope.spawn(move || {
                    let _permit = budget.enter();
                    most.fetch_max(budget.in_flight(), Ordering::SeqCst);
                    order.lock().unwrap().push(waiter);
                    std::thread::sleep(std::time::Duration::from_millis(5));
                });
                // Each waiter has taken its ticket before the next starts.
                while budget.gate.lock().unwrap().next_ticket < (MIN_IN_FLIGHT + waiter + 1) as u64
                {
                    std::thread::yield_now();
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(
                order.lock().unwrap().is_empty(),
                "a waiter ran past the limit"
            );
            // One slot frees: the waiters pass through it one at a time, in ticket order.
            drop(held.pop());
        });
        drop(held);
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4, 5]);
        assert!(most.load(Ordering::SeqCst) <= MIN_IN_FLIGHT);
        assert_eq!(budget.in_flight(), 0);
    }

    #[test]
    fn a_forked_child_gets_a_budget_of_its_own() {
        let slot = ArcSwapOption::const_empty();
        let parent = budget_in(&slot, 100);
        assert!(std::ptr::eq(parent, budget_in(&slot, 100)));
        parent.set_limit(Some(7));
        // The parent's gate is held by a thread a forked child does not have: locked forever.
        std::mem::forget(parent.gate.lock().unwrap());
        assert!(parent.gate.try_lock().is_err());
        let child = budget_in(&slot, 101);
        assert!(!std::ptr::eq(parent, child));
        assert_eq!(
            child.limit(),
            7,
            "the limit the parent fixed is the child's too"
        );
        // The child's budget works without ever touching the parent's mutexes.
        drop(child.enter());
        let cache = FdCache::<Vec<Kept<File>>>::with_budget(4, None, child);
        open(&cache, "a", 2);
        assert_eq!((child.held(), child.in_flight()), (2, 0));
        assert!(std::ptr::eq(child, budget_in(&slot, 101)));
        // Threads of a grandchild agree on one budget.
        let seen: Vec<usize> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| std::ptr::from_ref(budget_in(&slot, 102)) as usize))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let installed = std::ptr::from_ref(budget_in(&slot, 102)) as usize;
        assert!(seen.iter().all(|&b| b == installed));
    }

    #[test]
    fn a_real_exhaustion_is_recognised() {
        // Whatever the limit, EMFILE is what `open` reports at it.
        assert!(is_exhausted(&io::Error::from_raw_os_error(EMFILE)));
        assert!(!is_exhausted(&io::Error::from_raw_os_error(2)));
    }
}
