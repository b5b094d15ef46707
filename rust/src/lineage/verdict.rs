//! The digest check of a deferred answer ([`super::FileLineage::resolve_unverified`]), shared
//! by the worker that resolved it and the event loop that builds its Python tuple: whoever
//! claims it first makes it, the other takes its result, the loop waiting at most
//! `WAIT_FOR_VERDICT` for the worker before checking itself. Nothing is handed back before a
//! check passed, whatever the timing.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

/// How long the loop waits for the worker's check of a deferred answer before hashing the
/// tokens itself (the worker is mid-hash; this bounds what a descheduled worker can cost it).
const WAIT_FOR_VERDICT: Duration = Duration::from_millis(1);

/// The digest check of a deferred answer (`FileLineage::resolve_unverified`): made by the
/// worker that resolved it, right after it told the loop, or by the loop once it has built the
/// answer's tuple, whichever claims it first, so hashing and building overlap. Nothing is
/// handed back before a check passed.
#[derive(Default)]
pub struct Verdict {
    state: Mutex<Check>,
    done: Condvar,
}

#[derive(Default, Clone, Copy)]
enum Check {
    #[default]
    Unclaimed,
    Claimed,
    Done(bool),
}

impl Verdict {
    fn state(&self) -> std::sync::MutexGuard<'_, Check> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Record a result (the first one stands: every check of the same tokens agrees).
    fn record(&self, good: bool) {
        let mut state = self.state();
        if !matches!(*state, Check::Done(_)) {
            *state = Check::Done(good);
        }
        drop(state);
        self.done.notify_all();
    }

    /// The worker's side: check unless the loop already claimed it; never waits.
    pub fn check_unless_claimed(&self, check: impl FnOnce() -> bool) {
        {
            let mut state = self.state();
            if !matches!(*state, Check::Unclaimed) {
                return;
            }
            *state = Check::Claimed;
        }
        self.record(check());
    }

    /// The loop's side: the result, checking here if nobody has claimed it, else waiting for
    /// the claimer (at most `WAIT_FOR_VERDICT`, then checking here too).
    pub fn result(&self, check: impl FnOnce() -> bool) -> bool {
        let state = self.state();
        let state = match *state {
            Check::Done(good) => return good,
            Check::Unclaimed => {
                let mut state = state;
                *state = Check::Claimed;
                drop(state);
                let good = check();
                self.record(good);
                return good;
            }
            Check::Claimed => {
                self.done
                    .wait_timeout_while(state, WAIT_FOR_VERDICT, |s| matches!(s, Check::Claimed))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
        if let Check::Done(good) = *state {
            return good;
        }
        drop(state);
        let good = check();
        self.record(good);
        good
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Instant;

    /// A check that answers `good` after `delay`, counting its calls.
    fn check(calls: &AtomicUsize, delay: Duration, good: bool) -> impl FnOnce() -> bool + '_ {
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(delay);
            good
        }
    }

    #[test]
    fn a_slow_worker_never_lets_a_failed_check_pass_and_never_holds_the_loop_long() {
        // The worker claims the check and takes 300 ms over it; the loop, past its 1 ms wait,
        // checks the tokens itself and answers with its own result: the same verdict as the
        // worker's, passed or failed, never a guess.
        for good in [false, true] {
            let verdict = Verdict::default();
            let (worker_calls, loop_calls) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let (claimed, is_claimed) = mpsc::channel();
            let (answer, took) = std::thread::scope(|scope| {
                scope.spawn(|| {
                    verdict.check_unless_claimed(|| {
                        claimed.send(()).unwrap();
                        check(&worker_calls, Duration::from_millis(300), good)()
                    })
                });
                is_claimed.recv().unwrap();
                let start = Instant::now();
                let answer = verdict.result(check(&loop_calls, Duration::ZERO, good));
                (answer, start.elapsed())
            });
            assert_eq!(answer, good);
            assert_eq!(worker_calls.load(Ordering::SeqCst), 1);
            // Only a loop descheduled for the worker's whole 300 ms finds its result instead.
            if took < Duration::from_millis(250) {
                assert_eq!(loop_calls.load(Ordering::SeqCst), 1, "{took:?}");
            }
        }
    }

    #[test]
    fn whoever_claims_first_checks_and_the_other_takes_its_result() {
        for good in [false, true] {
            // The loop first: it checks; the worker then leaves it alone.
            let verdict = Verdict::default();
            let calls = AtomicUsize::new(0);
            assert_eq!(verdict.result(check(&calls, Duration::ZERO, good)), good);
            verdict.check_unless_claimed(check(&calls, Duration::ZERO, !good));
            assert_eq!(calls.load(Ordering::SeqCst), 1);
            assert_eq!(verdict.result(check(&calls, Duration::ZERO, !good)), good);
            // The worker first and done: the loop takes its result without checking.
            let verdict = Verdict::default();
            let calls = AtomicUsize::new(0);
            verdict.check_unless_claimed(check(&calls, Duration::ZERO, good));
            assert_eq!(verdict.result(check(&calls, Duration::ZERO, !good)), good);
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        }
    }

    #[test]
    fn racing_checks_always_answer_the_checks_verdict() {
        // Worker and loop released together, the worker's check taking 0-3 ms and the loop
        // arriving 0-2 ms late: whichever path each round takes (the loop first, the worker
        // done, the worker still busy past the loop's wait), the answer is the check's.
        let mut rng = crate::json::tests::Lcg(5);
        let mut paths = [0usize; 3];
        for round in 0..200 {
            let good = round % 2 == 0;
            let delay = Duration::from_micros(rng.next(3_000));
            let late = Duration::from_micros(rng.next(2_000));
            let verdict = Verdict::default();
            let (worker_calls, loop_calls) = (AtomicUsize::new(0), AtomicUsize::new(0));
            let go = std::sync::Barrier::new(2);
            let answer = std::thread::scope(|scope| {
                scope.spawn(|| {
                    go.wait();
                    verdict.check_unless_claimed(check(&worker_calls, delay, good))
                });
                go.wait();
                std::thread::sleep(late);
                verdict.result(check(&loop_calls, Duration::ZERO, good))
            });
            assert_eq!(
                answer, good,
                "round {round}, worker {delay:?}, loop {late:?}"
            );
            let calls = (
                worker_calls.load(Ordering::SeqCst),
                loop_calls.load(Ordering::SeqCst),
            );
            match calls {
                (0, 1) => paths[0] += 1,
                (1, 0) => paths[1] += 1,
                (1, 1) => paths[2] += 1,
                other => panic!("round {round}: checks made {other:?}"),
            }
        }
        // Which paths ran depends on the scheduler; shown with --nocapture.
        println!("loop first, worker done, worker busy: {paths:?}");
    }
}
