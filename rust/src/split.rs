//! Independent items shared between the calling thread and one helper thread, where the
//! caller never waits for work it could do itself.
//!
//! [`Split::start`] hands the items to a helper, which takes them in order (an atomic counter
//! hands out each index once) while the caller does something else; [`Split::finish`] takes
//! the items still unclaimed on the calling thread, then waits only for the ones the helper
//! is in the middle of. On an idle machine the two threads share the items; on a loaded one
//! the helper may not get to run at all and the caller does them all. The helper is one
//! process-wide thread (a [`WorkerPool`] of one, started on first use; a forked child starts
//! its own, see `crate::fork`), so a split costs a wake-up, not a thread start. A helper that
//! cannot be had is no error: the caller does everything.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use arc_swap::ArcSwapOption;

use crate::fork::{current_pid, this_process};
use crate::pool::WorkerPool;

static HELPER: ArcSwapOption<WorkerPool> = ArcSwapOption::const_empty();

/// This process's helper thread (`None` if none can be started).
fn helper() -> Option<Arc<WorkerPool>> {
    this_process(&HELPER, current_pid(), WorkerPool::pid, |_| {
        WorkerPool::new(1, "tokencapture-split")
    })
    .ok()
}

struct Inner<T, R> {
    data: T,
    work: fn(&T, usize) -> R,
    len: usize,
    next: AtomicUsize,
    /// The results so far, and how many there are.
    results: Mutex<(Vec<Option<R>>, usize)>,
    all_done: Condvar,
}

impl<T, R> Inner<T, R> {
    fn run(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.len {
                return;
            }
            // A panic in `work` is the caller's to see: it is re-raised on whichever thread
            // the item ran, and a helper's panic leaves its item unfinished, so `finish`
            // runs it again to raise it on the caller's thread.
            let result = (self.work)(&self.data, i);
            self.record(i, result);
        }
    }

    /// Keep item `i`'s result, unless it is there already: a helper too slow for `finish`
    /// has had its item run again on the calling thread, which may even have taken every
    /// result and returned (the vector is then empty) by the time the helper's comes in.
    fn record(&self, i: usize, result: R) {
        let mut guard = self.results.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(slot) = guard.0.get_mut(i) else {
            return; // taken by `finish`
        };
        if slot.is_some() {
            return;
        }
        *slot = Some(result);
        guard.1 += 1;
        if guard.1 == self.len {
            self.all_done.notify_all();
        }
    }
}

/// `work(data, i)` for every `i` below `len`, on the calling thread and a helper.
pub struct Split<T, R> {
    inner: Arc<Inner<T, R>>,
}

impl<T: Send + Sync + 'static, R: Send + 'static> Split<T, R> {
    fn unstarted(data: T, len: usize, work: fn(&T, usize) -> R) -> Self {
        let inner = Arc::new(Inner {
            data,
            work,
            len,
            next: AtomicUsize::new(0),
            results: Mutex::new(((0..len).map(|_| None).collect(), 0)),
            all_done: Condvar::new(),
        });
        Split { inner }
    }

    /// Start a helper thread on the items (none when `len` is 0).
    pub fn start(data: T, len: usize, work: fn(&T, usize) -> R) -> Self {
        let Split { inner } = Self::unstarted(data, len, work);
        if len > 1 {
            if let Some(pool) = helper() {
                let shared = Arc::clone(&inner);
                // Refused (no worker left): `finish` does every item.
                let _ = pool.submit(move || shared.run());
            }
        }
        Split { inner }
    }

    /// The data the items are of.
    pub fn data(&self) -> &T {
        &self.inner.data
    }

    /// Do the unclaimed items here, wait for the helper's, and give every result in order.
    pub fn finish(self) -> Vec<R> {
        self.inner.run();
        let mut guard = self
            .inner
            .results
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while guard.1 < self.inner.len {
            // An item the helper claimed but has not finished. If the helper panicked it
            // never will: wait a bounded time, then run the missing items here (a panic
            // then surfaces on this thread; a slow helper's late result is dropped: `record`).
            let (next, timeout) = self
                .inner
                .all_done
                .wait_timeout(guard, std::time::Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner);
            guard = next;
            if timeout.timed_out() && guard.1 < self.inner.len {
                let missing: Vec<usize> = (0..self.inner.len)
                    .filter(|i| guard.0[*i].is_none())
                    .collect();
                drop(guard);
                for i in missing {
                    self.inner.record(i, (self.inner.work)(&self.inner.data, i));
                }
                guard = self
                    .inner
                    .results
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        std::mem::take(&mut guard.0)
            .into_iter()
            .map(|r| r.expect("every item has a result"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_once_in_order() {
        for len in [0usize, 1, 2, 7, 100] {
            let split = Split::start((0..len as u64).collect::<Vec<u64>>(), len, |d, i| d[i] * 2);
            assert_eq!(split.data().len(), len);
            let out = split.finish();
            assert_eq!(out, (0..len as u64).map(|v| v * 2).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_helper_slower_than_finish_leaves_its_late_result_unused() {
        // The helper claims item 0 and is held up; `finish` runs item 1, waits its bounded
        // time, runs item 0 itself and returns. The helper's result then comes in: it once
        // indexed the vector `finish` had taken, and panicked on the helper thread.
        let split = Split::unstarted((), 2, |_, i| i * 10);
        let inner = Arc::clone(&split.inner);
        let claimed = inner.next.fetch_add(1, Ordering::Relaxed);
        assert_eq!(split.finish(), vec![0, 10]);
        inner.record(claimed, 99);
        // A late result for an item `finish` already has is not counted twice either.
        let split = Split::unstarted((), 2, |_, i| i + 1);
        let inner = Arc::clone(&split.inner);
        inner.next.fetch_add(1, Ordering::Relaxed);
        inner.record(0, 1);
        inner.record(0, 7);
        assert_eq!(split.finish(), vec![1, 2]);
    }

    #[test]
    fn a_helper_panic_is_raised_on_the_caller() {
        let split = Split::start((), 64, |_, i| {
            if i == 63 {
                panic!("item 63");
            }
            i
        });
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| split.finish()));
        assert!(caught.is_err());
    }
}
