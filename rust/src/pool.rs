//! A bounded pool of worker threads for blocking store calls.
//!
//! The async Python API hands each put to this pool instead of a Python thread pool: the
//! workers run the whole operation (lock, append, fdatasync) without ever taking the GIL, and
//! report back through a completion queue the event loop drains in batches. Many workers
//! matter: the disk completes concurrent fsyncs of different files far faster than serial ones.
//! The queue is a mutex-guarded deque with one condition variable: a job wakes exactly one
//! sleeping worker, and idle workers never spin. Spinning receivers (crossbeam-channel, which
//! spins and yields before it sleeps) measured ~10 us more worker CPU per put, and a single
//! receiver behind a mutex (`std::sync::mpsc`) needs a second wake-up per job.
//!
//! A pool runs at most its bound's threads, which may be a function read again whenever it
//! matters (the store pool's is what the descriptor budget's in-flight gate can admit: more
//! workers would only wait at the gate, and threads are a bounded resource in a server
//! process). They start with the pool (so that its first jobs do not pay for starting them);
//! a job that finds no idle worker while the pool is under its bound (the bound grew) starts
//! one more, and a worker that finds the pool over its bound when it would go idle exits.

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
#[derive(Debug)]
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
    bound: PoolBound,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    open: bool,
    /// Threads started and not exited.
    workers: usize,
    /// Of those, the ones waiting for a job.
    idle: usize,
    /// Threads started ever (for their names).
    started: usize,
}

impl std::fmt::Debug for QueueState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueState")
            .field("jobs", &self.jobs.len())
            .field("open", &self.open)
            .field("workers", &self.workers)
            .field("idle", &self.idle)
            .finish()
    }
}

/// How many threads a pool may run: a number, or a function read whenever it matters.
#[derive(Debug, Clone, Copy)]
pub enum PoolBound {
    Fixed(usize),
    By(fn() -> usize),
}

impl PoolBound {
    fn get(self) -> usize {
        match self {
            PoolBound::Fixed(n) => n,
            PoolBound::By(bound) => bound(),
        }
        .max(1)
    }
}

/// A pool of named worker threads; dropping it lets the workers finish queued jobs and exit.
#[derive(Debug)]
pub struct WorkerPool {
    queue: Arc<Queue>,
    pid: u32,
    name: String,
}

impl WorkerPool {
    /// A pool of `workers` threads (at least one).
    pub fn new(workers: usize, name: &str) -> std::io::Result<Self> {
        Self::bounded(PoolBound::Fixed(workers), name)
    }

    /// A pool of up to `bound` threads (at least one), as many as the bound is now started at
    /// once (fails only if not even one can start; the others are started later, when a job
    /// finds no idle worker).
    pub fn bounded(bound: PoolBound, name: &str) -> std::io::Result<Self> {
        let queue = Arc::new(Queue {
            state: Mutex::default(),
            ready: Condvar::new(),
            bound,
        });
        queue.lock().open = true;
        let pool = WorkerPool {
            queue,
            pid: std::process::id(),
            name: name.to_owned(),
        };
        let mut state = pool.queue.lock();
        pool.spawn(&mut state)?;
        while state.workers < bound.get() && pool.spawn(&mut state).is_ok() {}
        drop(state);
        Ok(pool)
    }

    /// Start one more worker (counted before it runs, so that racing submits see it).
    fn spawn(&self, state: &mut QueueState) -> std::io::Result<()> {
        let queue = Arc::clone(&self.queue);
        thread::Builder::new()
            .name(format!("{}-{}", self.name, state.started))
            .spawn(move || work(&queue))?;
        state.workers += 1;
        state.started += 1;
        Ok(())
    }

    /// Threads running now (for tests and stats).
    pub fn workers(&self) -> usize {
        self.queue.lock().workers
    }

    /// The process that started the workers. A forked child inherits the pool but none of
    /// its threads, so it must start its own.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Queue a job, starting a worker for it when none is idle and the pool is under its
    /// bound; fails (dropping the job unrun) only if no worker runs and none can be started.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), PoolClosed> {
        {
            let mut state = self.queue.lock();
            let waiting = state.jobs.len();
            if state.idle <= waiting && state.workers < self.queue.bound.get() {
                // A worker that cannot start now leaves the job to the running ones.
                let _ = self.spawn(&mut state);
            }
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

    /// The next job, waiting for one; `None` once the pool is dropped and the queue is empty,
    /// or when the queue is empty and the pool has more workers than its bound (this one
    /// exits).
    fn next(&self) -> Option<Job> {
        let mut state = self.lock();
        loop {
            if let Some(job) = state.jobs.pop_front() {
                return Some(job);
            }
            if !state.open || state.workers > self.bound.get() {
                state.workers -= 1;
                return None;
            }
            state.idle += 1;
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.idle -= 1;
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
    use std::sync::{mpsc, Arc, Mutex};
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

    static BOUND: AtomicUsize = AtomicUsize::new(3);

    #[test]
    fn threads_start_on_demand_within_a_bound_read_again() {
        let pool =
            WorkerPool::bounded(PoolBound::By(|| BOUND.load(Ordering::SeqCst)), "test").unwrap();
        assert_eq!(pool.workers(), 3, "started with the pool");
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Arc::new(Mutex::new(rx));
        let done = Arc::new(AtomicUsize::new(0));
        let blocked = |pool: &WorkerPool| {
            let (rx, done) = (Arc::clone(&rx), Arc::clone(&done));
            pool.submit(move || {
                rx.lock().unwrap().recv().unwrap();
                done.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        };
        for _ in 0..10 {
            blocked(&pool);
        }
        assert_eq!(pool.workers(), 3, "never more threads than the bound");
        for _ in 0..10 {
            tx.send(()).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while done.load(Ordering::SeqCst) < 10 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(done.load(Ordering::SeqCst), 10);
        // The bound shrinks: the workers over it exit when they would go idle.
        BOUND.store(1, Ordering::SeqCst);
        pool.submit(|| {}).unwrap();
        pool.queue.ready.notify_all();
        while pool.workers() > 1 && Instant::now() < deadline {
            pool.queue.ready.notify_all();
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.workers(), 1);
        let (tx, rx2) = mpsc::channel();
        pool.submit(move || tx.send(7).unwrap()).unwrap();
        assert_eq!(rx2.recv_timeout(Duration::from_secs(5)).unwrap(), 7);
        // It grows back: a job that finds no idle worker starts one, up to the bound.
        BOUND.store(2, Ordering::SeqCst);
        let (tx, rx3) = mpsc::channel::<()>();
        let rx3 = Arc::new(Mutex::new(rx3));
        for _ in 0..3 {
            let rx3 = Arc::clone(&rx3);
            pool.submit(move || rx3.lock().unwrap().recv().unwrap())
                .unwrap();
        }
        assert_eq!(pool.workers(), 2);
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
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
