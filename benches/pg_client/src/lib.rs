//! The `postgres` client driven from a fixed pool of native threads, for a paired comparison
//! with asyncpg (docs/postgres.md, "Client choice").
//!
//! It reproduces how the product's file store reaches its native worker pool: Python submits a
//! put (rollout id, call id bytes, payload digest, canonical line; all computed by the store's
//! own Python code) to a queue; a worker thread that owns one connection takes every put queued
//! so far (up to `max_batch`) and sends them as one `tokencapture.put_batch` call, the same
//! server function and batching rule the asyncpg store uses; the statuses go to a completion
//! list whose descriptor the event loop watches, and one wake-up drains every finished put.
//! No GIL is held while a worker waits on the server.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use postgres::{Client, Config, NoTls, Statement};
use pyo3::exceptions::{PyConnectionError, PyValueError};
use pyo3::prelude::*;

const PUT_BATCH: &str = "SELECT tokencapture.put_batch($1, $2, $3, $4)";

/// What Python submits: token, rollout id, call id (UTF-8), payload digest, canonical line.
type PutArgs = (u64, String, Vec<u8>, String, Vec<u8>);

struct Put {
    token: u64,
    rollout: String,
    call: Vec<u8>,
    digest: String,
    line: Vec<u8>,
}

impl From<PutArgs> for Put {
    fn from((token, rollout, call, digest, line): PutArgs) -> Self {
        Put {
            token,
            rollout,
            call,
            digest,
            line,
        }
    }
}

/// A put's status code (the server's), or the error that failed its batch.
type Outcome = Result<i16, String>;

struct Queue {
    jobs: VecDeque<Put>,
    open: bool,
    /// Idle workers, the most recently idle last: a job wakes that one, so a light load keeps
    /// reusing one connection (and one warm server backend), as asyncpg's LIFO pool does.
    idle: Vec<usize>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// One condition variable per worker, so the waker chooses which worker runs.
    ready: Vec<Condvar>,
    done: Mutex<Vec<(u64, Outcome)>>,
    ring: UnixStream,
    max_batch: usize,
}

impl Shared {
    /// The next batch for worker `me`: every queued put up to `max_batch`; None once closed
    /// and empty.
    fn take(&self, me: usize) -> Option<Vec<Put>> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        while queue.jobs.is_empty() && queue.open {
            if !queue.idle.contains(&me) {
                queue.idle.push(me);
            }
            queue = self.ready[me]
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
        queue.idle.retain(|&worker| worker != me); // a spurious wake-up left it there
        if queue.jobs.is_empty() {
            return None;
        }
        let count = queue.jobs.len().min(self.max_batch);
        Some(queue.jobs.drain(..count).collect())
    }

    /// Wake up to `count` idle workers, most recently idle first (the lock is held).
    fn wake(&self, queue: &mut Queue, count: usize) {
        for _ in 0..count {
            match queue.idle.pop() {
                Some(worker) => self.ready[worker].notify_one(),
                None => return, // the busy workers take the rest when they finish
            }
        }
    }

    fn complete(&self, outcomes: impl Iterator<Item = (u64, Outcome)>) {
        let first = {
            let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
            let was_empty = done.is_empty();
            done.extend(outcomes);
            was_empty
        };
        if first {
            // Fails only when the socket buffer is full, which already wakes the loop.
            let _ = (&self.ring).write(&[1]);
        }
    }
}

fn run_batch(
    client: &mut Client,
    statement: &Statement,
    batch: &[Put],
) -> Result<Vec<i16>, String> {
    let rollouts: Vec<&str> = batch.iter().map(|put| put.rollout.as_str()).collect();
    let calls: Vec<&[u8]> = batch.iter().map(|put| put.call.as_slice()).collect();
    let digests: Vec<&str> = batch.iter().map(|put| put.digest.as_str()).collect();
    let lines: Vec<&[u8]> = batch.iter().map(|put| put.line.as_slice()).collect();
    let row = client
        .query_one(statement, &[&rollouts, &calls, &digests, &lines])
        .map_err(|err| err.to_string())?;
    let statuses: Vec<i16> = row.try_get(0).map_err(|err| err.to_string())?;
    if statuses.len() != batch.len() {
        return Err(format!(
            "{} statuses for {} puts",
            statuses.len(),
            batch.len()
        ));
    }
    Ok(statuses)
}

fn worker(shared: &Shared, me: usize, mut client: Client, statement: Statement) {
    while let Some(batch) = shared.take(me) {
        match run_batch(&mut client, &statement, &batch) {
            Ok(statuses) => shared.complete(
                batch
                    .iter()
                    .zip(statuses)
                    .map(|(put, status)| (put.token, Ok(status))),
            ),
            Err(err) => shared.complete(batch.iter().map(|put| (put.token, Err(err.clone())))),
        }
    }
}

/// Connect, prepare, and run one put on the new connection, so that its backend compiles the
/// functions and caches the catalog before anything is timed.
fn connect(config: &Config, warm: Put) -> Result<(Client, Statement), String> {
    let mut client = config.connect(NoTls).map_err(|err| err.to_string())?;
    let statement = client.prepare(PUT_BATCH).map_err(|err| err.to_string())?;
    run_batch(&mut client, &statement, &[warm])?;
    Ok((client, statement))
}

/// `PutPool(dsn, workers, max_batch, warm)`: `workers` threads, one connection each; each
/// connection first stores one put of `warm` (`[(token, rollout, call, digest, line)]`).
#[pyclass(frozen)]
struct PutPool {
    shared: Arc<Shared>,
    watch: UnixStream,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[pymethods]
impl PutPool {
    #[new]
    fn new(
        py: Python<'_>,
        dsn: &str,
        workers: usize,
        max_batch: usize,
        warm: Vec<PutArgs>,
    ) -> PyResult<Self> {
        if workers == 0 || max_batch == 0 || warm.len() != workers {
            return Err(PyValueError::new_err(
                "workers and max_batch must be positive, with one warm-up put per worker",
            ));
        }
        let mut config =
            Config::from_str(dsn).map_err(|err| PyValueError::new_err(err.to_string()))?;
        // What the asyncpg store sends at connect (server_settings).
        config
            .application_name("tokencapture-rust-bench")
            .options("-c synchronous_commit=on -c statement_timeout=30000")
            .connect_timeout(Duration::from_secs(10));
        let connections = py
            .detach(|| {
                warm.into_iter()
                    .map(|args| connect(&config, Put::from(args)))
                    .collect::<Result<Vec<_>, _>>()
            })
            .map_err(PyConnectionError::new_err)?;
        let (ring, watch) = UnixStream::pair()?;
        ring.set_nonblocking(true)?;
        watch.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                open: true,
                idle: Vec::new(),
            }),
            ready: (0..workers).map(|_| Condvar::new()).collect(),
            done: Mutex::new(Vec::new()),
            ring,
            max_batch,
        });
        let threads = connections
            .into_iter()
            .enumerate()
            .map(|(me, (client, statement))| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name("pg-put".into())
                    .spawn(move || worker(&shared, me, client, statement))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PutPool {
            shared,
            watch,
            threads: Mutex::new(threads),
        })
    }

    /// The descriptor the event loop watches for readability.
    fn fileno(&self) -> i32 {
        self.watch.as_raw_fd()
    }

    /// Queue one put, waking the most recently idle worker; its outcome comes back from `drain` under `token`.
    fn submit(&self, token: u64, rollout: String, call: Vec<u8>, digest: String, line: Vec<u8>) {
        let mut queue = self
            .shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        queue
            .jobs
            .push_back(Put::from((token, rollout, call, digest, line)));
        self.shared.wake(&mut queue, 1);
    }

    /// Queue many puts at once, waking one idle worker per `max_batch` of them: puts submitted in
    /// one event-loop iteration share calls, as the asyncpg store's batcher makes them share.
    fn submit_many(&self, puts: Vec<PutArgs>) {
        let count = puts.len().div_ceil(self.shared.max_batch);
        let mut queue = self
            .shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        queue.jobs.extend(puts.into_iter().map(Put::from));
        self.shared.wake(&mut queue, count);
    }

    /// Every finished put: `[(token, status, error)]`, one of the last two being None.
    fn drain(&self) -> Vec<(u64, Option<i16>, Option<String>)> {
        // Clear the descriptor before taking the list: a completion racing this drain lands
        // in this batch or rings for the next one.
        let mut sink = [0u8; 256];
        while matches!((&self.watch).read(&mut sink), Ok(n) if n > 0) {}
        let done = std::mem::take(
            &mut *self
                .shared
                .done
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        done.into_iter()
            .map(|(token, outcome)| match outcome {
                Ok(status) => (token, Some(status), None),
                Err(err) => (token, None, Some(err)),
            })
            .collect()
    }

    /// Finish the queued puts, then stop the threads and close their connections.
    fn close(&self, py: Python<'_>) {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open = false;
        for ready in &self.shared.ready {
            ready.notify_all();
        }
        let threads =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        py.detach(|| {
            for thread in threads {
                let _ = thread.join();
            }
        });
    }
}

#[pymodule]
fn pg_client_bench(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PutPool>()
}
