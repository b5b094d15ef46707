//! A fixed pool of worker threads for blocking store calls.
//!
//! The async Python API hands each put to this pool instead of a Python thread pool: the
//! workers run the whole operation (lock, append, fdatasync) without ever taking the GIL, and
//! report back through a completion queue the event loop drains in batches. Many workers
//! matter: the disk completes concurrent fsyncs of different files far faster than serial ones.
//! The queue is a multi-consumer channel on which each idle worker waits for itself, so a job
//! wakes exactly one worker (a single receiver behind a mutex, as `std::sync::mpsc` needs,
//! passes the mutex on with a second wake-up per job: measured ~15-25% more CPU per put).

use std::thread;

use crossbeam_channel::{Receiver, Sender};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// No worker is left to run jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the worker pool has shut down")]
pub struct PoolClosed;

/// A pool of named worker threads; dropping it lets the workers finish queued jobs and exit.
#[derive(Debug)]
pub struct WorkerPool {
    sender: Sender<Job>,
    pid: u32,
}

impl WorkerPool {
    /// Start `workers` threads (at least one).
    pub fn new(workers: usize, name: &str) -> std::io::Result<Self> {
        let (sender, receiver) = crossbeam_channel::unbounded::<Job>();
        for index in 0..workers.max(1) {
            let receiver = receiver.clone();
            thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || work(&receiver))?;
        }
        Ok(WorkerPool {
            sender,
            pid: std::process::id(),
        })
    }

    /// The process that started the workers. A forked child inherits the pool but none of
    /// its threads, so it must start its own.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Queue a job; fails (dropping the job unrun) only if every worker has exited.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), PoolClosed> {
        self.sender.send(Box::new(job)).map_err(|_| PoolClosed)
    }
}

fn work(receiver: &Receiver<Job>) {
    loop {
        match receiver.recv() {
            // A panicking job must not take its worker (or the process) down with it; the
            // job's own completion reporting turns the panic into an error for its caller.
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(_) => return, // every sender is gone
        }
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
    fn a_panicking_job_does_not_kill_its_worker() {
        let pool = WorkerPool::new(1, "test").unwrap();
        pool.submit(|| panic!("job failed")).unwrap();
        let (tx, rx) = mpsc::channel();
        pool.submit(move || tx.send(42).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 42);
    }
}
