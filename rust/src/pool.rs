//! A fixed pool of worker threads for blocking store calls.
//!
//! The async Python API hands each put to this pool instead of a Python thread pool: the
//! workers run the whole operation (lock, append, fdatasync) without ever taking the GIL, and
//! report back through a completion queue the event loop drains in batches. Many workers
//! matter: the disk completes concurrent fsyncs of different files far faster than serial ones.
//! The queue is a mutex-guarded deque with one condition variable: a job wakes exactly one
//! sleeping worker, and idle workers never spin. Spinning receivers (crossbeam-channel, which
//! spins and yields before it sleeps) measured ~10 us more worker CPU per put, and a single
//! receiver behind a mutex (`std::sync::mpsc`) needs a second wake-up per job.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// No worker is left to run jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the worker pool has shut down")]
pub struct PoolClosed;

/// The queue the workers share. Idle workers sleep on `ready` and never spin: a worker that
/// spins before sleeping burns CPU on every put of a workload whose jobs mostly wait on fsync.
#[derive(Debug, Default)]
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    open: bool,
    workers: usize,
}

impl std::fmt::Debug for QueueState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueState")
            .field("jobs", &self.jobs.len())
            .field("open", &self.open)
            .field("workers", &self.workers)
            .finish()
    }
}

/// A pool of named worker threads; dropping it lets the workers finish queued jobs and exit.
#[derive(Debug)]
pub struct WorkerPool {
    queue: Arc<Queue>,
    pid: u32,
}

impl WorkerPool {
    /// Start `workers` threads (at least one).
    pub fn new(workers: usize, name: &str) -> std::io::Result<Self> {
        let queue = Arc::new(Queue::default());
        queue.lock().open = true;
        let pool = WorkerPool {
            queue,
            pid: std::process::id(),
        };
        for index in 0..workers.max(1) {
            let queue = Arc::clone(&pool.queue);
            thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || work(&queue))?;
            pool.queue.lock().workers += 1;
        }
        Ok(pool)
    }

    /// The process that started the workers. A forked child inherits the pool but none of
    /// its threads, so it must start its own.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Queue a job; fails (dropping the job unrun) only if every worker has exited.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), PoolClosed> {
        {
            let mut state = self.queue.lock();
            if state.workers == 0 {
                return Err(PoolClosed);
            }
            state.jobs.push_back(Box::new(job));
        }
        self.queue.ready.notify_one();
        Ok(())
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.queue.lock().open = false;
        self.queue.ready.notify_all();
    }
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next job, waiting for one; `None` once the pool is dropped and the queue is empty.
    fn next(&self) -> Option<Job> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            if !state.open {
                state.workers -= 1;
                return None;
            }
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

fn work(queue: &Queue) {
    while let Some(job) = queue.next() {
        // A panicking job must not take its worker (or the process) down with it; the job's
        // own completion reporting turns the panic into an error for its caller.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    #[test]
    fn runs_jobs_concurrently() {
        let pool = WorkerPool::new(8, "test").unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        for _ in 0..8 {
            let done = Arc::clone(&done);
            pool.submit(move || {
                thread::sleep(Duration::from_millis(100));
                done.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        while done.load(Ordering::SeqCst) < 8 {
            thread::sleep(Duration::from_millis(5));
        }
        assert!(
            started.elapsed() < Duration::from_millis(700),
            "jobs ran serially"
        );
    }

    #[test]
    fn dropping_the_pool_runs_the_queued_jobs() {
        let done = Arc::new(AtomicUsize::new(0));
        let pool = WorkerPool::new(2, "test").unwrap();
        for _ in 0..20 {
            let done = Arc::clone(&done);
            pool.submit(move || {
                thread::sleep(Duration::from_millis(5));
                done.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        }
        drop(pool);
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.load(Ordering::SeqCst) < 20 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(done.load(Ordering::SeqCst), 20);
    }

    #[test]
    fn a_panicking_job_does_not_kill_its_worker() {
        let pool = WorkerPool::new(1, "test").unwrap();
        pool.submit(|| panic!("job failed")).unwrap();
        let (tx, rx) = mpsc::channel();
        pool.submit(move || tx.send(42).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 42);
    }
}
