//! Async store, ledger and lineage jobs run on a native worker pool and report to a
//! `Completions` queue that the event loop watches (its doorbell is registered with
//! `loop.add_reader`). Workers never take the GIL; the first completion after a drain rings the
//! doorbell, so a burst of completions costs the loop one wake-up and one `drain` call.
//!
//! Jobs started while a `Completions` is held (`hold` ... `release`, on the loop's thread) go to
//! the pool together, as one job that runs them in order: one worker wake-up (a futex wake on
//! the loop's thread, a worker's wake and sleep) instead of one per job.

use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwapOption;
use pyo3::prelude::*;

use super::errors::to_pyerr;
use crate::doorbell::Doorbell;
use crate::error::Error;
use crate::fork::current_pid;
use crate::pool::{PoolBound, WorkerPool};

/// Workers of the process-wide pool: enough concurrent fsyncs to keep the disk busy, and no
/// more than the descriptor budget's gate (`descriptors::Budget::enter`, which Python's
/// threads and callers' own share) can admit at once: 64 at most, 4 at a low soft limit
/// (`descriptors::max_in_flight`, read again as the pool grows or idles, so a limit lowered
/// later shrinks it). A worker more would only wait at the gate.
const POOL_WORKERS: PoolBound = PoolBound::By(crate::descriptors::max_in_flight);

static POOL: ArcSwapOption<WorkerPool> = ArcSwapOption::const_empty();

/// The process-wide worker pool, started on first use; a forked child (which inherits no
/// threads) starts its own. Looked up lock-free: the parent's pool (its queue's mutex may be
/// held by a worker that does not exist in the child) is never touched there, and never
/// dropped (dropping it locks that queue): see `crate::fork`.
fn worker_pool() -> PyResult<Arc<WorkerPool>> {
    // Where threads of a child race, the pools not installed drop and their workers exit.
    Ok(crate::fork::this_process(
        &POOL,
        current_pid(),
        WorkerPool::pid,
        |_| WorkerPool::bounded(POOL_WORKERS, "tokencapture-io"),
    )?)
}

/// Start the process-wide pool ahead of its first job (a lineage resolver does, when it is
/// made, so that its first resolve does not start the pool's threads). A pool that cannot start now
/// is started again, or its failure reported, by the first job.
pub(super) fn start_pool() {
    let _ = worker_pool();
}

/// What a finished job hands back to the loop.
pub(super) enum Outcome {
    Unit,
    Bool(bool),
    Failed(Error),
    Panicked,
}

impl From<crate::Result<()>> for Outcome {
    fn from(result: crate::Result<()>) -> Self {
        result.map_or_else(Outcome::Failed, |()| Outcome::Unit)
    }
}

impl From<crate::Result<bool>> for Outcome {
    fn from(result: crate::Result<bool>) -> Self {
        result.map_or_else(Outcome::Failed, Outcome::Bool)
    }
}

/// A job for the worker pool.
type Task = Box<dyn FnOnce() + Send + 'static>;

/// A completion queue for one event loop.
#[pyclass(frozen, module = "tokencapture._core")]
pub(super) struct Completions {
    queue: Arc<Queue>,
    /// The jobs started since `hold`, until `release` submits them as one.
    held: Mutex<Option<Vec<Task>>>,
}

impl Completions {
    /// Keep `task` with the held jobs; given back when nothing is held.
    fn keep(&self, task: Task) -> Option<Task> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        match held.as_mut() {
            Some(tasks) => {
                tasks.push(task);
                None
            }
            None => Some(task),
        }
    }
}

/// What the workers hold of a completion queue: never a Python object, so a worker drops
/// nothing that needs the interpreter. (A Python reference dropped while detached goes to
/// PyO3's pool of deferred decrements, a process-wide mutex that every return from
/// `Python::detach` takes: a worker holding it when another thread forks would hang the
/// child's first native call.)
struct Queue {
    done: Mutex<Vec<(u64, Outcome)>>,
    doorbell: Doorbell,
}

impl Queue {
    fn complete(&self, token: u64, outcome: Outcome) {
        let first = {
            let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
            done.push((token, outcome));
            done.len() == 1
        };
        if first {
            self.doorbell.ring();
        }
    }
}

#[pymethods]
impl Completions {
    #[new]
    fn new() -> PyResult<Self> {
        Ok(Completions {
            queue: Arc::new(Queue {
                done: Mutex::new(Vec::new()),
                doorbell: Doorbell::new()
                    .map_err(|err| super::errors::os_error("make the completion queue", &err))?,
            }),
            held: Mutex::new(None),
        })
    }

    /// Hold the jobs started from now on (by the submit calls given this queue) until
    /// `release`. Holding already: no change.
    fn hold(&self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get_or_insert_with(Vec::new);
    }

    /// Submit the held jobs as one job of the pool, which runs them in the order they were
    /// started (a panic in one does not stop the next); stop holding. Where the pool cannot
    /// take it, they run on this thread, detached from the interpreter, so that each still
    /// reports its outcome. Returns how many there were.
    fn release(&self, py: Python<'_>) -> usize {
        let tasks = self
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        let count = tasks.len();
        match count {
            0 => {}
            1 => {
                if let Some(task) = tasks.into_iter().next() {
                    submit_or_run(py, task);
                }
            }
            _ => submit_or_run(
                py,
                Box::new(move || {
                    for task in tasks {
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
                    }
                }),
            ),
        }
        count
    }

    /// Whether jobs are being held.
    fn holding(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// The descriptor to watch for readability.
    fn fileno(&self) -> i32 {
        self.queue.doorbell.fd()
    }

    /// Take every finished job: `[(token, value, failed)]`, `value` being the result or the
    /// exception to raise.
    fn drain<'py>(&self, py: Python<'py>) -> Vec<(u64, Bound<'py, PyAny>, bool)> {
        // Clear the doorbell before taking the queue, so a completion racing this drain either
        // lands in this batch or rings for the next one.
        self.queue.doorbell.clear();
        let done = std::mem::take(
            &mut *self
                .queue
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        done.into_iter()
            .map(|(token, outcome)| {
                let (value, failed) = match outcome {
                    Outcome::Unit => (py.None().into_bound(py), false),
                    Outcome::Bool(flag) => (
                        pyo3::types::PyBool::new(py, flag).to_owned().into_any(),
                        false,
                    ),
                    Outcome::Failed(err) => (
                        to_pyerr(py, err).into_value(py).into_bound(py).into_any(),
                        true,
                    ),
                    Outcome::Panicked => (
                        pyo3::exceptions::PyRuntimeError::new_err(
                            "tokencapture worker panicked; the operation did not complete",
                        )
                        .into_value(py)
                        .into_bound(py)
                        .into_any(),
                        true,
                    ),
                };
                (token, value, failed)
            })
            .collect()
    }
}

/// Run `op` on the worker pool and report its outcome to `completions` under `token`.
pub(super) fn spawn_job<T>(
    completions: &Bound<'_, Completions>,
    token: u64,
    op: impl FnOnce() -> T + Send + 'static,
) -> PyResult<()>
where
    T: Into<Outcome>,
{
    let queue = Arc::clone(&completions.get().queue);
    let task: Task = Box::new(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(op))
            .map_or(Outcome::Panicked, Into::into);
        queue.complete(token, outcome);
    });
    let Some(task) = completions.get().keep(task) else {
        return Ok(());
    };
    worker_pool()?
        .submit(task)
        .map_err(|closed| pyo3::exceptions::PyRuntimeError::new_err(closed.to_string()))
}

/// Reports one job's outcome to its completion queue, exactly once: dropped unsent (the code
/// that was to send it panicked, or never ran), it reports the panic.
pub(super) struct Report {
    queue: Option<Arc<Queue>>,
    token: u64,
}

impl Report {
    pub(super) fn new(completions: &Bound<'_, Completions>, token: u64) -> Self {
        Report {
            queue: Some(Arc::clone(&completions.get().queue)),
            token,
        }
    }

    pub(super) fn send(mut self, outcome: impl Into<Outcome>) {
        if let Some(queue) = self.queue.take() {
            queue.complete(self.token, outcome.into());
        }
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        if let Some(queue) = self.queue.take() {
            queue.complete(self.token, Outcome::Panicked);
        }
    }
}

/// Run `job` on the worker pool (or keep it with `completions`' held jobs); it reports its own
/// outcomes (through [`Report`]s). Where the pool cannot take it (no worker could be started,
/// or every one has exited), `job` runs on this thread instead, detached from the
/// interpreter, so what it was to answer is answered.
pub(super) fn spawn_detached(
    completions: &Bound<'_, Completions>,
    job: impl FnOnce() + Send + 'static,
) {
    if let Some(task) = completions.get().keep(Box::new(job)) {
        submit_or_run(completions.py(), task);
    }
}

/// `task` on the worker pool, or on this thread (detached) where the pool cannot take it.
fn submit_or_run(py: Python<'_>, job: Task) {
    let job = Arc::new(Mutex::new(Some(job)));
    let queued = Arc::clone(&job);
    let submitted = worker_pool().map(|pool| {
        pool.submit(move || {
            if let Some(job) = queued.lock().unwrap_or_else(PoisonError::into_inner).take() {
                job();
            }
        })
    });
    if !matches!(submitted, Ok(Ok(()))) {
        if let Some(job) = job.lock().unwrap_or_else(PoisonError::into_inner).take() {
            py.detach(job);
        }
    }
}
