//! A parallel read's two threads on two cores: when the scheduler starts the helper on its
//! caller's core, the caller stays on that core and the helper runs on the others, for the
//! length of the read.
//!
//! A freeze (and a streamed read) spawns a thread that reads, walks and hashes the log while
//! the calling thread builds what it returns; the two hand lines to each other, so their
//! speed-up needs two cores. On this 2-core VM the scheduler counts a runnable task that never
//! runs (`/proc/loadavg` reads 2 runnable with one shell running while `/proc/stat` shows both
//! cores idle), so it judges the other core busy: after the caller had slept 0.3 s (a trainer
//! between reads) the helper started on its caller's core in 10-11 of 16 freezes, and when one
//! started elsewhere the wake-ups between the two brought them back together. They then took
//! turns on one core while the other idled (wall time = CPU time: ~3.7 ms a W2 freeze against
//! ~2.0 ms apart), and the load balancer does not move a thread that ran in the last half
//! millisecond, which both always had. Moving only the helper, once, did not hold; keeping each
//! on its own cores for the read did (every freeze ~2.0 ms).
//!
//! So a helper that starts on its caller's core moves itself to the caller's other allowed
//! cores and pins the caller to that one core; the caller's own mask is given back exactly when
//! the read ends. A helper that starts elsewhere leaves both alone (splitting there anyway cost
//! back-to-back freezes up to ~10%: neither thread may then move). Where the other cores are
//! really busy a split is a loss: the helper competes with another process's thread there
//! instead of taking turns with its own mostly waiting caller (a W2 freeze 1.6x as long at load
//! ~2.6). No cheap instant signal of an idle core was reliable here, so a split is judged by
//! its outcome: a split helper that waited on a run queue for over a quarter of its time
//! (`/proc/thread-self/schedstat`) makes the next [`SKIP_AFTER_A_BUSY_SPLIT`] reads leave both
//! threads alone. A caller confined by its own mask to one core is always left alone.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use rustix::process::Pid;
use rustix::thread::{gettid, sched_getaffinity, sched_getcpu, sched_setaffinity, CpuSet};

/// Reads that leave both threads alone after a split whose helper found its cores busy.
pub const SKIP_AFTER_A_BUSY_SPLIT: u32 = 32;

/// The calling thread's side of a read that may split: made before the helper is spawned,
/// held until it has been joined. Dropped, it gives the caller its own mask back if the
/// helper pinned it.
#[must_use = "the caller may stay pinned until this is dropped"]
pub struct Split {
    /// The caller's own mask and where it ran; None when the read may not split.
    caller: Option<Caller>,
    /// Set by the helper once it has pinned the caller.
    pinned: AtomicBool,
    policy: &'static Splits,
}

struct Caller {
    tid: Pid,
    core: usize,
    mask: CpuSet,
}

impl Split {
    /// Notes where the calling thread runs and what it may use, if the read may split: the
    /// caller may run on more than one core, and no recent split found the others busy.
    pub fn begin() -> Split {
        Self::begin_under(&SPLITS)
    }

    fn begin_under(policy: &'static Splits) -> Split {
        let caller = sched_getaffinity(None).ok().and_then(|mask| {
            let core = sched_getcpu();
            (mask.count() >= 2 && mask.is_set(core) && policy.may_split()).then(|| Caller {
                tid: gettid(),
                core,
                mask,
            })
        });
        Split {
            caller,
            pinned: AtomicBool::new(false),
            policy,
        }
    }

    /// Called first in the helper thread: if it runs on its caller's core, moves itself onto
    /// the caller's other cores and pins the caller to that one. Hold the guard until the
    /// helper's work is done: dropped, it judges the split. Best effort: a failed call only
    /// leaves a thread where it is.
    pub fn enter_helper(&self) -> HelperGuard<'_> {
        let unsplit = HelperGuard {
            judged: None,
            split: self,
        };
        let Some(caller) = &self.caller else {
            return unsplit;
        };
        if sched_getcpu() != caller.core {
            return unsplit;
        }
        let mut helper = caller.mask;
        helper.unset(caller.core);
        if sched_setaffinity(None, &helper).is_err() {
            return unsplit;
        }
        let mut one = CpuSet::new();
        one.set(caller.core);
        if sched_setaffinity(Some(caller.tid), &one).is_ok() {
            self.pinned.store(true, Ordering::Release);
        }
        HelperGuard {
            judged: Some(Schedstat::now()),
            split: self,
        }
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        if let Some(caller) = &self.caller {
            if self.pinned.load(Ordering::Acquire) {
                let _ = sched_setaffinity(None, &caller.mask);
            }
        }
    }
}

/// The helper's side of a split read (see [`Split::enter_helper`]).
#[must_use = "the guard judges the split when the helper's work is done"]
pub struct HelperGuard<'s> {
    /// The helper's schedstat when it split; None when it did not.
    judged: Option<Option<Schedstat>>,
    split: &'s Split,
}

impl Drop for HelperGuard<'_> {
    fn drop(&mut self) {
        let Some(start) = self.judged.take() else {
            return;
        };
        if let (Some(start), Some(end)) = (start, Schedstat::now()) {
            self.split
                .policy
                .record(end.waited_over_a_quarter_since(&start));
        }
        if let Some(caller) = &self.split.caller {
            let _ = sched_setaffinity(None, &caller.mask);
        }
    }
}

/// Whether reads may split: a count of reads still to leave alone after a busy split.
pub struct Splits {
    skip: AtomicU32,
}

static SPLITS: Splits = Splits::new();

impl Splits {
    pub const fn new() -> Self {
        Splits {
            skip: AtomicU32::new(0),
        }
    }

    /// Whether this read may split (one of the reads to leave alone is used up if not).
    fn may_split(&self) -> bool {
        self.skip
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
    }

    /// A split read's outcome: a helper that found its cores busy makes the next reads leave
    /// both threads alone.
    fn record(&self, busy: bool) {
        if busy {
            self.skip.store(SKIP_AFTER_A_BUSY_SPLIT, Ordering::Relaxed);
        }
    }
}

impl Default for Splits {
    fn default() -> Self {
        Self::new()
    }
}

/// A thread's scheduler times so far (`/proc/thread-self/schedstat`: ns on a CPU, ns waiting
/// on a run queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Schedstat {
    ran_ns: u64,
    waited_ns: u64,
}

impl Schedstat {
    fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/thread-self/schedstat").ok()?)
    }

    fn parse(text: &str) -> Option<Self> {
        let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
        Some(Schedstat {
            ran_ns: fields.next()?.ok()?,
            waited_ns: fields.next()?.ok()?,
        })
    }

    /// Whether the thread waited on a run queue for over a quarter of its time since `start`.
    fn waited_over_a_quarter_since(&self, start: &Schedstat) -> bool {
        let ran = self.ran_ns.saturating_sub(start.ran_ns);
        let waited = self.waited_ns.saturating_sub(start.waited_ns);
        waited.saturating_mul(4) > ran.saturating_add(waited)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only(core: usize) -> CpuSet {
        let mut set = CpuSet::new();
        set.set(core);
        set
    }

    /// In a caller thread of its own (the test harness's threads keep their masks): a read
    /// whose helper starts on `start` (pinned there, then given its mask back, as a scheduler
    /// placing it there would leave it); returns (where the helper ran after entering, the
    /// caller's mask while the helper ran, the helper's mask after its guard, the caller's
    /// mask after the read).
    fn read_with_helper_on(
        policy: &'static Splits,
        start: impl FnOnce(usize) -> Option<usize> + Send,
    ) -> Option<(usize, CpuSet, CpuSet, CpuSet, usize)> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let mask = sched_getaffinity(None).expect("affinity");
                    let split = Split::begin_under(policy);
                    let core = sched_getcpu();
                    let start = start(core)?;
                    let (ran, caller_during, helper_after) = std::thread::scope(|inner| {
                        inner
                            .spawn(|| {
                                sched_setaffinity(None, &only(start)).expect("pin");
                                sched_setaffinity(None, &mask).expect("unpin");
                                let guard = split.enter_helper();
                                let ran = sched_getcpu();
                                let caller_during = sched_getaffinity(Some(
                                    split.caller.as_ref().map_or(gettid(), |c| c.tid),
                                ))
                                .expect("affinity");
                                drop(guard);
                                (
                                    ran,
                                    caller_during,
                                    sched_getaffinity(None).expect("affinity"),
                                )
                            })
                            .join()
                            .expect("helper")
                    });
                    drop(split);
                    let caller_after = sched_getaffinity(None).expect("affinity");
                    Some((ran, caller_during, helper_after, caller_after, core))
                })
                .join()
                .expect("caller")
        })
    }

    #[test]
    fn a_helper_on_its_callers_core_splits_the_two_until_the_read_ends() {
        static FRESH: Splits = Splits::new();
        let mask = sched_getaffinity(None).expect("affinity");
        if mask.count() < 2 {
            return; // one core: nothing to split
        }
        let (ran, caller_during, helper_after, caller_after, core) =
            read_with_helper_on(&FRESH, Some).expect("a read");
        assert!(
            ran != core && mask.is_set(ran),
            "the helper stayed on its caller's core"
        );
        assert!(
            caller_during == only(core),
            "the caller was not kept on its core"
        );
        assert!(helper_after == mask, "the helper's mask was not given back");
        assert!(caller_after == mask, "the caller's mask was not given back");
    }

    #[test]
    fn a_helper_elsewhere_leaves_both_alone() {
        static FRESH: Splits = Splits::new();
        let mask = sched_getaffinity(None).expect("affinity");
        let elsewhere = |core| (0..CpuSet::MAX_CPU).find(|&c| c != core && mask.is_set(c));
        let Some((ran, caller_during, _, caller_after, core)) =
            read_with_helper_on(&FRESH, elsewhere)
        else {
            return; // one core: nowhere else to start
        };
        assert_ne!(ran, core);
        assert!(caller_during == mask, "the caller was pinned");
        assert!(caller_after == mask);
    }

    #[test]
    fn after_a_busy_split_reads_leave_both_alone_for_a_while() {
        static AFTER_BUSY: Splits = Splits::new();
        let mask = sched_getaffinity(None).expect("affinity");
        if mask.count() < 2 {
            return;
        }
        AFTER_BUSY.record(true);
        for _ in 0..SKIP_AFTER_A_BUSY_SPLIT {
            let (_, caller_during, ..) = read_with_helper_on(&AFTER_BUSY, Some).expect("a read");
            assert!(caller_during == mask, "a read split while splits were off");
        }
        assert!(AFTER_BUSY.may_split());
        AFTER_BUSY.record(false); // a split that paid changes nothing
        assert!(AFTER_BUSY.may_split());
    }

    #[test]
    fn schedstat_is_read_and_a_wait_over_a_quarter_is_busy() {
        assert_eq!(
            Schedstat::parse("343312982 240228 25\n"),
            Some(Schedstat {
                ran_ns: 343312982,
                waited_ns: 240228
            })
        );
        assert_eq!(Schedstat::parse("12"), None);
        assert_eq!(Schedstat::parse("x 1 2"), None);
        assert!(Schedstat::now().is_some());
        let start = Schedstat {
            ran_ns: 1_000,
            waited_ns: 500,
        };
        let quiet = Schedstat {
            ran_ns: 4_000,
            waited_ns: 1_400,
        }; // ran 3,000, waited 900: 23%
        let busy = Schedstat {
            ran_ns: 4_000,
            waited_ns: 1_600,
        }; // ran 3,000, waited 1,100: 27%
        assert!(!quiet.waited_over_a_quarter_since(&start));
        assert!(busy.waited_over_a_quarter_since(&start));
    }
}
