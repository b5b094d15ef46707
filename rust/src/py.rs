//! The only PyO3 file: argument conversion, GIL release and error mapping.
//!
//! Every call that touches a file, waits for a lock or hashes runs detached from the
//! interpreter (`Python::detach`), so other Python threads and the event loop keep running.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple, PyType};

use crate::digest;
use crate::doorbell::Doorbell;
use crate::error::Error;
use crate::json::tape::TapeFeed;
use crate::pool::WorkerPool;
use crate::store::{self, LinesToDecode, Store, DEFAULT_CACHED_ROLLOUTS};

/// Exception classes defined in `tokencapture.protocols`, looked up once.
struct ExceptionClass {
    cell: PyOnceLock<Py<PyType>>,
    name: &'static str,
}

impl ExceptionClass {
    const fn new(name: &'static str) -> Self {
        ExceptionClass {
            cell: PyOnceLock::new(),
            name,
        }
    }

    fn err(&self, py: Python<'_>, message: String) -> PyErr {
        let class = self.cell.get_or_try_init(py, || {
            py.import("tokencapture.protocols")?
                .getattr(self.name)?
                .cast_into::<PyType>()
                .map(Bound::unbind)
                .map_err(PyErr::from)
        });
        match class {
            Ok(class) => PyErr::from_type(class.bind(py).clone(), message),
            Err(import_error) => import_error,
        }
    }
}

static FROZEN: ExceptionClass = ExceptionClass::new("TokenCaptureFrozenError");
static RETIRED: ExceptionClass = ExceptionClass::new("TokenCaptureRetiredError");
static CONFLICT: ExceptionClass = ExceptionClass::new("TokenCaptureConflictError");
static CORRUPT: ExceptionClass = ExceptionClass::new("TokenCaptureCorruptionError");

fn to_pyerr(py: Python<'_>, err: Error) -> PyErr {
    let message = err.to_string();
    match err {
        Error::Io { op, path, source } => match source.raw_os_error() {
            // OSError(errno, strerror, filename) picks the matching subclass
            // (FileNotFoundError, PermissionError, ...) and keeps `errno` for callers.
            Some(errno) => PyOSError::new_err((errno, format!("{op} failed: {source}"), path)),
            None => PyOSError::new_err(message),
        },
        Error::Frozen(_) => FROZEN.err(py, message),
        Error::Retired(_) => RETIRED.err(py, message),
        Error::Conflict { .. } => CONFLICT.err(py, message),
        Error::Corrupt { .. } => CORRUPT.err(py, message),
        Error::InvalidInput(_) => PyValueError::new_err(message),
    }
}

/// Borrow a Python str as UTF-8, refusing lone surrogates with a plain `ValueError`.
fn text<'a>(value: &'a Bound<'_, PyString>, what: &str) -> PyResult<&'a str> {
    value.to_str().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be valid Unicode text (no lone surrogates)"
        ))
    })
}

/// Run a batch retire or delete detached from the interpreter; `(removed, absent)`.
fn batch_removal(
    py: Python<'_>,
    op: impl FnOnce() -> crate::Result<store::Removal> + Send,
) -> PyResult<(Vec<String>, Vec<String>)> {
    py.detach(op)
        .map(|removal| (removal.removed, removal.absent))
        .map_err(|e| to_pyerr(py, e))
}

/// Decoded records and the byte offset of each line: the offsets let Python name the exact
/// place of a record that is not a valid entry.
type DecodedRecords<'py> = (Bound<'py, PyList>, Vec<usize>);

// ---- decoding stored lines --------------------------------------------------------------------
//
// Freeze hands back Python dicts built straight from the verified bytes by the same validating
// walk the store uses (`json::build`), with no intermediate tree. Token ids repeat heavily within
// a rollout (every prompt contains the previous prompt and answer): the walk carries a
// `json::Repeats`, so a repeated run of ids is copied from the earlier list (a C loop of
// increments) rather than parsed.

struct PyBuilder<'py> {
    py: Python<'py>,
}

impl From<crate::json::LineError> for PyErr {
    fn from(err: crate::json::LineError) -> PyErr {
        PyValueError::new_err(err.0)
    }
}

/// A decoded value, and whether it is a list of non-negative integers (the walk saw every item
/// take the integer fast path): token arrays are then known to be ints without a second pass.
type Decoded<'py> = (Bound<'py, PyAny>, bool);

/// Top-level fields whose types the decoder checks as it builds them, so freeze need not
/// walk the token arrays again in Python.
const TOKEN_ID_FIELDS: [&str; 2] = ["prompt_token_ids", "generation_token_ids"];

impl<'py> PyBuilder<'py> {
    fn plain(value: Bound<'py, PyAny>) -> Decoded<'py> {
        (value, false)
    }

    /// Refuse a top-level token field of the wrong shape, naming it.
    fn check_top_level(&self, key: &str, value: &Decoded<'py>) -> PyResult<()> {
        let (object, unsigned_list) = value;
        let list_of = |accept: fn(ItemType) -> bool, what: &str| -> PyResult<()> {
            let mut ok = false;
            if let Ok(list) = object.cast::<PyList>() {
                ok = true;
                for_each_item_type(list, |_, item_type| {
                    ok = accept(item_type);
                    ok
                });
            }
            if ok {
                Ok(())
            } else {
                Err(PyValueError::new_err(format!(
                    "{key} must be a list of {what}"
                )))
            }
        };
        if TOKEN_ID_FIELDS.contains(&key) && !unsigned_list {
            list_of(|item| item == ItemType::Int, "ints")?;
        } else if key == "generation_log_probs" {
            list_of(
                |item| matches!(item, ItemType::Int | ItemType::Float(_)),
                "floats",
            )?;
        }
        Ok(())
    }
}

impl<'py> crate::json::Builder<'_> for PyBuilder<'py> {
    type Value = Decoded<'py>;
    type Items = Bound<'py, PyList>;
    type Error = PyErr;

    fn null(&mut self) -> PyResult<Self::Value> {
        Ok(Self::plain(self.py.None().into_bound(self.py)))
    }

    fn boolean(&mut self, value: bool) -> PyResult<Self::Value> {
        let value = pyo3::types::PyBool::new(self.py, value)
            .to_owned()
            .into_any();
        Ok(Self::plain(value))
    }

    fn unsigned(&mut self, value: u64, _: &[u8]) -> PyResult<Self::Value> {
        Ok(Self::plain(value.into_pyobject(self.py)?.into_any()))
    }

    fn number(&mut self, text: &[u8], integer: bool) -> PyResult<Self::Value> {
        let text = std::str::from_utf8(text).map_err(|e| PyValueError::new_err(e.to_string()))?;
        if !integer {
            let value: f64 = text
                .parse()
                .map_err(|_| PyValueError::new_err("invalid float"))?;
            return Ok(Self::plain(
                pyo3::types::PyFloat::new(self.py, value).into_any(),
            ));
        }
        match text.parse::<u64>() {
            Ok(value) => self.unsigned(value, text.as_bytes()),
            Err(_) => match text.parse::<i64>() {
                Ok(value) => Ok(Self::plain(value.into_pyobject(self.py)?.into_any())),
                // Beyond 64 bits: Python's own int() parses any length.
                Err(_) => Ok(Self::plain(
                    self.py.get_type::<pyo3::types::PyInt>().call1((text,))?,
                )),
            },
        }
    }

    fn float(&mut self, value: f64, _: &[u8]) -> PyResult<Self::Value> {
        Ok(Self::plain(
            pyo3::types::PyFloat::new(self.py, value).into_any(),
        ))
    }

    fn string(&mut self, raw: &[u8], escaped: bool) -> PyResult<Self::Value> {
        if escaped {
            let text: String =
                serde_json::from_slice(raw).map_err(|e| PyValueError::new_err(e.to_string()))?;
            return Ok(Self::plain(PyString::new(self.py, &text).into_any()));
        }
        let inner = std::str::from_utf8(&raw[1..raw.len() - 1])
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self::plain(PyString::new(self.py, inner).into_any()))
    }

    fn items(&mut self) -> PyResult<Self::Items> {
        Ok(PyList::empty(self.py))
    }

    fn push(&mut self, items: &mut Self::Items, item: Self::Value) -> PyResult<()> {
        items.append(item.0)
    }

    fn reuse(
        &mut self,
        items: &mut Self::Items,
        earlier: &Self::Value,
        count: usize,
    ) -> PyResult<()> {
        // A slice copies the item pointers in one C loop.
        let run = earlier.0.cast::<PyList>()?.get_slice(0, count);
        if items.is_empty() {
            *items = run;
        } else {
            let end = items.len();
            items.as_sequence().set_slice(end, end, &run)?;
        }
        Ok(())
    }

    fn array(&mut self, items: Self::Items, all_unsigned: bool) -> PyResult<Self::Value> {
        if all_unsigned {
            untrack_atomic(items.as_any());
        }
        Ok((items.into_any(), all_unsigned))
    }

    fn object(
        &mut self,
        members: Vec<(Self::Value, Self::Value)>,
        depth: usize,
    ) -> PyResult<Self::Value> {
        let dict = pyo3::types::PyDict::new(self.py);
        for ((key, _), value) in members {
            if depth == 1 {
                self.check_top_level(key.cast::<PyString>()?.to_str()?, &value)?;
            }
            dict.set_item(key, value.0)?;
        }
        Ok(Self::plain(dict.into_any()))
    }
}

/// Take a list or tuple that holds only ints out of the cycle collector's sight.
///
/// A container of ints cannot be part of a reference cycle, yet every collection of its
/// generation visits each of its items: with the snapshots of a few long rollouts alive (a
/// trainer's batch), collections spent about a fifth of freeze's time walking token lists.
/// CPython makes the same call for tuples and dicts of atomic values (for tuples, lazily, at
/// their first collection); a list could later be made part of a cycle by the caller, which
/// would then only be reclaimed when it is broken by hand.
fn untrack_atomic(container: &Bound<'_, PyAny>) {
    // SAFETY: `container` is a live list or tuple (we hold a reference and are attached to the
    // interpreter), a GC type; `PyObject_GC_UnTrack` accepts tracked and untracked objects.
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(container.as_ptr().cast()) }
}

/// Decode `lines` into Python values in one walk (repeated token arrays are reused across
/// lines). A line that fails keeps its own error: it may be a duplicate that no snapshot
/// returns.
fn decode_lines<'b>(
    py: Python<'_>,
    lines: impl IntoIterator<Item = &'b [u8]>,
) -> Vec<PyResult<Py<PyAny>>> {
    let _paused = CollectorPause::new(py);
    let mut builder = PyBuilder { py };
    let mut repeats = crate::json::Repeats::new();
    lines
        .into_iter()
        .map(|line| {
            crate::json::build(line, &mut builder, Some(&mut repeats))
                .map(|(value, _)| value.unbind())
        })
        .collect()
}

/// The lines at `ranges` of `buf`.
fn lines_at<'b>(buf: &'b [u8], ranges: &'b [Range<usize>]) -> impl Iterator<Item = &'b [u8]> {
    ranges.iter().map(|range| &buf[range.clone()])
}

/// Decode the lines a store hands over (attaching to the interpreter): a small log's in one
/// walk, a large log's by replaying the tapes another thread makes while it reads (see
/// `json::tape`).
fn decode_in_python(lines: LinesToDecode<'_>) -> Vec<PyResult<Py<PyAny>>> {
    Python::attach(|py| match lines {
        LinesToDecode::Whole { buf, lines } => decode_lines(py, lines_at(buf, lines)),
        LinesToDecode::Taped(feed) => replay_lines(py, feed),
    })
}

/// Build lines from their tapes, which `tapes` yields in order.
fn replay_lines(py: Python<'_>, tapes: TapeFeed<'_>) -> Vec<PyResult<Py<PyAny>>> {
    let _paused = CollectorPause::new(py);
    let mut builder = PyBuilder { py };
    let mut replay = crate::json::tape::Replay::new();
    let mut decoded = Vec::new();
    let mut lines = tapes.iter();
    for taped in lines.by_ref() {
        let value = match &taped.tape {
            Ok(tape) => replay.value(tape, &mut builder),
            Err(err) => Err(PyErr::from(err.clone())),
        };
        tapes.give_back(taped);
        let failed = value.is_err();
        decoded.push(value.map(|(value, _)| value.unbind()));
        if failed {
            // A line that failed here may have left an array unbuilt that the tapes offer to
            // later lines: decode the rest directly, in one walk.
            decoded.extend(decode_lines(py, lines.map(|taped| taped.line)));
            break;
        }
    }
    decoded
}

/// Pauses CPython's cycle collector for a decode and restores its state when dropped.
///
/// A decode builds thousands of lists and dicts; the young-generation collections they
/// trigger walk token lists of up to tens of thousands of items before those lists are
/// untracked (about 5% of a freeze's decode here). The decode holds the GIL from start to end,
/// so no other Python code runs while collections are paused. If the `gc` module cannot be
/// reached, nothing is paused.
struct CollectorPause<'py> {
    gc: Option<Bound<'py, pyo3::types::PyModule>>,
}

impl<'py> CollectorPause<'py> {
    fn new(py: Python<'py>) -> Self {
        let gc = py.import("gc").ok().filter(|gc| {
            let enabled = gc
                .call_method0("isenabled")
                .and_then(|on| on.is_truthy())
                .unwrap_or(false);
            enabled && gc.call_method0("disable").is_ok()
        });
        CollectorPause { gc }
    }
}

impl Drop for CollectorPause<'_> {
    fn drop(&mut self) {
        if let Some(gc) = &self.gc {
            let _ = gc.call_method0("enable");
        }
    }
}

/// The decoded values of `records` (whose lines are a subsequence of `ranges`, which
/// `decoded` follows) and their byte offsets. A record line that did not decode is corruption.
fn select_records<'py>(
    py: Python<'py>,
    log: &Path,
    ranges: &[Range<usize>],
    decoded: Vec<PyResult<Py<PyAny>>>,
    records: &store::Records,
) -> PyResult<DecodedRecords<'py>> {
    let mut decoded = ranges.iter().zip(decoded);
    let mut values = Vec::with_capacity(records.lines.len());
    for wanted in &records.lines {
        let Some((_, value)) = decoded.find(|(range, _)| range.start == wanted.start) else {
            let detail = "the record's line was not decoded";
            return Err(to_pyerr(
                py,
                Error::corrupt(log, wanted.start as u64, detail),
            ));
        };
        values.push(value.map_err(|err| {
            let detail = format!("the line is not a valid entry: {}", err.value(py));
            to_pyerr(py, Error::corrupt(log, wanted.start as u64, detail))
        })?);
    }
    let offsets = records.lines.iter().map(|range| range.start).collect();
    Ok((PyList::new(py, values)?, offsets))
}

// ---- async bridge ----------------------------------------------------------------------------
//
// Async puts run on a native worker pool and report to a `Completions` queue that the event loop
// watches (its doorbell is registered with `loop.add_reader`). Workers never take the GIL; the
// first completion after a drain rings the doorbell, so a burst of completions costs the loop
// one wake-up and one `drain` call.

/// Workers of the process-wide pool: enough concurrent fsyncs to keep the disk busy.
const POOL_WORKERS: usize = 64;

static POOL: Mutex<Option<Arc<WorkerPool>>> = Mutex::new(None);

/// The process-wide worker pool, restarted in a forked child (which inherits no threads).
fn worker_pool() -> PyResult<Arc<WorkerPool>> {
    let mut slot = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(pool) = slot
        .as_ref()
        .filter(|pool| pool.pid() == std::process::id())
    {
        return Ok(Arc::clone(pool));
    }
    let pool = Arc::new(WorkerPool::new(POOL_WORKERS, "tokencapture-io")?);
    *slot = Some(Arc::clone(&pool));
    Ok(pool)
}

/// What a finished job hands back to the loop.
enum Outcome {
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

/// A completion queue for one event loop.
#[pyclass(frozen, module = "tokencapture._core")]
struct Completions {
    done: Mutex<Vec<(u64, Outcome)>>,
    doorbell: Doorbell,
}

impl Completions {
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
            done: Mutex::new(Vec::new()),
            doorbell: Doorbell::new()?,
        })
    }

    /// The descriptor to watch for readability.
    fn fileno(&self) -> i32 {
        self.doorbell.fd()
    }

    /// Take every finished job: `[(token, value, failed)]`, `value` being the result or the
    /// exception to raise.
    fn drain<'py>(&self, py: Python<'py>) -> Vec<(u64, Bound<'py, PyAny>, bool)> {
        // Clear the doorbell before taking the queue, so a completion racing this drain either
        // lands in this batch or rings for the next one.
        self.doorbell.clear();
        let done = std::mem::take(&mut *self.done.lock().unwrap_or_else(PoisonError::into_inner));
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
fn spawn_job<T>(
    completions: &Bound<'_, Completions>,
    token: u64,
    op: impl FnOnce() -> T + Send + 'static,
) -> PyResult<()>
where
    T: Into<Outcome>,
{
    let completions: Py<Completions> = completions.clone().unbind();
    worker_pool()?
        .submit(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(op))
                .map_or(Outcome::Panicked, Into::into);
            completions.get().complete(token, outcome);
        })
        .map_err(|closed| pyo3::exceptions::PyRuntimeError::new_err(closed.to_string()))
}

/// The native store. The Python class `tokencapture.store.TokenCaptureStore` wraps it.
#[pyclass(frozen, name = "Store", module = "tokencapture._core")]
struct PyStore {
    inner: Arc<Store>,
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (root, cached_rollouts = DEFAULT_CACHED_ROLLOUTS))]
    fn new(py: Python<'_>, root: PathBuf, cached_rollouts: usize) -> PyResult<Self> {
        let inner = py
            .detach(|| Store::open(root, cached_rollouts))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(PyStore {
            inner: Arc::new(inner),
        })
    }

    /// Store one canonical line; True if appended, False if the same payload was already there.
    fn put(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<bool> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        py.detach(|| self.inner.put(rollout_id, call_id, line))
            .map(|outcome| outcome == store::PutOutcome::Appended)
            .map_err(|e| to_pyerr(py, e))
    }

    /// `put` on the worker pool; the outcome (True/False or the error) goes to `completions`.
    fn submit_put(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let call_id = text(model_call_id, "model_call_id")?.to_owned();
        let line = line.to_vec();
        let store = Arc::clone(&self.inner);
        spawn_job(completions, token, move || {
            store
                .put(&rollout_id, &call_id, &line)
                .map(|outcome| outcome == store::PutOutcome::Appended)
        })
    }

    /// `begin_call` on the worker pool.
    fn submit_begin_call(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let call_id = text(model_call_id, "model_call_id")?.to_owned();
        let store = Arc::clone(&self.inner);
        spawn_job(completions, token, move || {
            store.begin_call(&rollout_id, &call_id)
        })
    }

    /// `mark_incomplete` on the worker pool.
    fn submit_mark_incomplete(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let line = line.to_vec();
        let store = Arc::clone(&self.inner);
        spawn_job(completions, token, move || {
            store.mark_incomplete(&rollout_id, &line)
        })
    }

    fn begin_call(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        py.detach(|| self.inner.begin_call(rollout_id, call_id))
            .map_err(|e| to_pyerr(py, e))
    }

    fn mark_incomplete(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| self.inner.mark_incomplete(rollout_id, line))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Freeze and return `((records, offsets), incomplete, snapshot_id, version)`: each record
    /// is the decoded JSON object of a verified line, each offset where its line starts.
    fn freeze<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<(DecodedRecords<'py>, bool, String, u64)> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        // The lines are decoded (attached) while another thread verifies them and makes the
        // freeze durable (detached); for a large log that thread also parses each line into a
        // tape, and this one only builds (and then helps hash): see `Store::freeze_decoding`.
        let (snapshot, ranges, decoded) = py
            .detach(|| self.inner.freeze_decoding(rollout_id, decode_in_python))
            .map_err(|e| to_pyerr(py, e))?;
        let log = self.inner.paths(rollout_id).log;
        let selected = select_records(py, &log, &ranges, decoded, &snapshot.records);
        self.inner.recycle_buffer(snapshot.records.buf);
        Ok((
            selected?,
            snapshot.incomplete,
            snapshot.snapshot_id,
            snapshot.version,
        ))
    }

    fn drop_snapshot(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        snapshot_id: &Bound<'_, PyString>,
        version: u64,
    ) -> PyResult<bool> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let snapshot_id = text(snapshot_id, "snapshot_id")?;
        py.detach(|| self.inner.drop_snapshot(rollout_id, snapshot_id, version))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Retire a batch; returns `(removed, absent)`.
    fn retire(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        batch_removal(py, || self.inner.retire(&rollout_ids))
    }

    /// Delete a batch; returns `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        batch_removal(py, || self.inner.delete(&rollout_ids))
    }

    fn is_incomplete(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| self.inner.is_incomplete(rollout_id))
            .map_err(|e| to_pyerr(py, e))
    }

    /// The unique stored records of a rollout, decoded (torn tail ignored, nothing created).
    fn read_lines<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<DecodedRecords<'py>> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let (records, ranges, decoded) = py
            .detach(|| self.inner.read_decoding(rollout_id, decode_in_python))
            .map_err(|e| to_pyerr(py, e))?;
        let log = self.inner.paths(rollout_id).log;
        let selected = select_records(py, &log, &ranges, decoded, &records);
        self.inner.recycle_buffer(records.buf);
        selected
    }

    /// The verified state as readers see it (tail folded, nothing changed) as JSON, and the
    /// number of unique records; None if the rollout has no files.
    fn inspect<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, usize)>> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let found = py
            .detach(|| self.inner.inspect(rollout_id))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(found.map(|(state, records)| (PyBytes::new(py, &state.to_json()), records)))
    }
}

/// Token ids from a list/tuple of ints or a buffer of integers, as u64.
fn token_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let out_of_range = |item: &Bound<'_, PyAny>| {
        PyValueError::new_err(format!("token id {item} is outside 0..=2**64-1"))
    };
    let extract = |item: Bound<'_, PyAny>| -> PyResult<u64> {
        match item.extract::<u64>() {
            Ok(id) => Ok(id),
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyOverflowError>(item.py()) => {
                Err(out_of_range(&item))
            }
            Err(err) => Err(err),
        }
    };
    if let Ok(list) = ids.cast::<PyList>() {
        return list.iter().map(extract).collect();
    }
    if let Ok(tuple) = ids.cast::<PyTuple>() {
        return tuple.iter().map(extract).collect();
    }
    let py = ids.py();
    if let Ok(buffer) = PyBuffer::<u64>::get(ids) {
        return buffer.to_vec(py);
    }
    if let Ok(buffer) = PyBuffer::<u32>::get(ids) {
        return Ok(buffer.to_vec(py)?.into_iter().map(u64::from).collect());
    }
    if let Ok(buffer) = PyBuffer::<i64>::get(ids) {
        return buffer
            .to_vec(py)?
            .into_iter()
            .map(|id| {
                u64::try_from(id)
                    .map_err(|_| PyValueError::new_err(format!("token id {id} is negative")))
            })
            .collect();
    }
    if let Ok(buffer) = PyBuffer::<i32>::get(ids) {
        return buffer
            .to_vec(py)?
            .into_iter()
            .map(|id| {
                u64::try_from(id)
                    .map_err(|_| PyValueError::new_err(format!("token id {id} is negative")))
            })
            .collect();
    }
    ids.try_iter()?.map(|item| extract(item?)).collect()
}

/// Lowercase hex token digest of a sequence (list, tuple, buffer or iterable) of ids.
#[pyfunction]
fn compute_digest(py: Python<'_>, token_ids_: &Bound<'_, PyAny>) -> PyResult<String> {
    let ids = token_ids(token_ids_)?;
    Ok(py.detach(|| digest::token_digest(&ids)))
}

/// Lowercase hex SHA-256 of a canonical line (the payload digest).
#[pyfunction]
fn payload_digest(py: Python<'_>, line: &[u8]) -> String {
    py.detach(|| digest::payload_digest(line))
}

/// Deepest nesting a stored value may have. pydantic's JSON reader stops at about 200 levels,
/// so anything deeper would be acknowledged and then unreadable.
const MAX_JSON_DEPTH: usize = 128;

/// Why a value cannot be stored; `path` is filled in (innermost first) while unwinding, so
/// the common, valid case allocates nothing.
struct ScanError {
    path: Vec<String>,
    problem: String,
}

impl ScanError {
    fn at(mut self, segment: impl FnOnce() -> String) -> Self {
        self.path.push(segment());
        self
    }

    fn into_pyerr(self) -> PyErr {
        let path: Vec<String> = self.path.into_iter().rev().collect();
        PyValueError::new_err(format!("{} {}", path.join("."), self.problem))
    }
}

/// Walk `value`: fail at the first non-finite float; return whether everything is a plain
/// JSON type (exact dict with str keys, list, tuple, str, int, float, bool, None). Plain values
/// serialize with orjson exactly as pydantic's JSON mode would; anything else takes the
/// pydantic path. The walk continues past exotic values so no visible NaN hides behind one.
fn scan_value(value: &Bound<'_, PyAny>, depth: usize) -> Result<bool, ScanError> {
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt};
    if value.is_exact_instance_of::<PyInt>()
        || value.is_exact_instance_of::<PyString>()
        || value.is_none()
        || value.is_exact_instance_of::<PyBool>()
    {
        return Ok(true);
    }
    if let Ok(float) = value.cast::<PyFloat>() {
        let number = float.value();
        if !number.is_finite() {
            return Err(ScanError {
                path: Vec::new(),
                problem: format!(
                    "is {}: JSON cannot carry non-finite floats, so the entry would not \
                     read back",
                    non_finite_text(number)
                ),
            });
        }
        return Ok(value.is_exact_instance_of::<PyFloat>());
    }
    if depth > MAX_JSON_DEPTH {
        return Err(ScanError {
            path: Vec::new(),
            problem: format!("is nested deeper than {MAX_JSON_DEPTH} levels"),
        });
    }
    let mut plain = true;
    if let Ok(list) = value.cast_exact::<PyList>() {
        for (index, item) in list.iter().enumerate() {
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| index.to_string()))?;
        }
    } else if let Ok(tuple) = value.cast_exact::<PyTuple>() {
        for (index, item) in tuple.iter().enumerate() {
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| index.to_string()))?;
        }
    } else if let Ok(dict) = value.cast_exact::<PyDict>() {
        for (key, item) in dict.iter() {
            plain &= key.is_exact_instance_of::<PyString>();
            plain &= scan_value(&item, depth + 1).map_err(|e| e.at(|| key.to_string()))?;
        }
    } else {
        plain = false;
    }
    Ok(plain)
}

/// A non-finite float as Python prints it (`nan`, `inf`, `-inf`), so both stores' messages match.
fn non_finite_text(number: f64) -> &'static str {
    if number.is_nan() {
        "nan"
    } else if number > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

/// What a top-level field of an entry must hold.
#[derive(Debug, Clone, Copy)]
enum FieldKind {
    Text,
    OptionalText,
    Int,
    OptionalInt,
    Bool,
    /// `created_at`: an int or a float.
    Timestamp,
    /// `parent_resolution`: None or one of the status values.
    Status,
    /// `output_items`: a list of dicts.
    Items,
}

impl FieldKind {
    /// Whether `value` is acceptable (a status is checked against the values by the caller).
    fn accepts(self, value: &Bound<'_, PyAny>) -> bool {
        use pyo3::types::{PyBool, PyDict, PyFloat, PyInt};
        let int = || value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>();
        match self {
            FieldKind::Text => value.is_instance_of::<PyString>(),
            FieldKind::OptionalText => value.is_none() || value.is_instance_of::<PyString>(),
            FieldKind::Int => int(),
            FieldKind::OptionalInt => value.is_none() || int(),
            FieldKind::Bool => value.is_instance_of::<PyBool>(),
            FieldKind::Timestamp => int() || value.is_instance_of::<PyFloat>(),
            FieldKind::Items => value
                .cast::<PyList>()
                .is_ok_and(|items| items.iter().all(|item| item.is_instance_of::<PyDict>())),
            FieldKind::Status => true, // checked against the status values by the caller
        }
    }

    fn expected(self) -> &'static str {
        match self {
            FieldKind::Text => "a str",
            FieldKind::OptionalText => "a str or None",
            FieldKind::Int | FieldKind::OptionalInt => "an int",
            FieldKind::Bool => "a bool",
            FieldKind::Timestamp => "a float",
            FieldKind::Items | FieldKind::Status => "",
        }
    }
}

/// A field name as Rust text (for messages) and as an interned Python string: dict lookups
/// with it hit CPython's identity fast path and cached hash instead of building and hashing a
/// new string per field per put.
#[derive(Debug)]
struct FieldName {
    text: String,
    key: Py<PyString>,
}

impl FieldName {
    fn new(py: Python<'_>, text: String) -> Self {
        let key = PyString::intern(py, &text).unbind();
        FieldName { text, key }
    }
}

/// The type rules of `TokenEntry`'s fields, checked on an entry's values before it is stored
/// and on every decoded record before it is built without a second pydantic validation. The
/// field lists come from the Python model (`tokencapture.records`); the pure-Python reference
/// store applies the same rules in Python.
#[pyclass(frozen, name = "EntryFields", module = "tokencapture._core")]
struct EntryFields {
    required: Vec<FieldName>,
    /// In the order the checks run, so the first problem reported is the same every time.
    fields: Vec<(FieldName, FieldKind)>,
    statuses: Vec<String>,
    /// The status values as Python prints a sorted list of them, for error messages.
    statuses_text: String,
}

#[pymethods]
impl EntryFields {
    #[new]
    #[pyo3(signature = (*, required, text, optional_text, ints, optional_ints, bools, statuses))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        required: Vec<String>,
        text: Vec<String>,
        optional_text: Vec<String>,
        ints: Vec<String>,
        optional_ints: Vec<String>,
        bools: Vec<String>,
        mut statuses: Vec<String>,
    ) -> PyResult<Self> {
        let groups = [
            (text, FieldKind::Text),
            (optional_text, FieldKind::OptionalText),
            (ints, FieldKind::Int),
            (optional_ints, FieldKind::OptionalInt),
            (bools, FieldKind::Bool),
        ];
        let mut fields: Vec<(String, FieldKind)> = groups
            .into_iter()
            .flat_map(|(names, kind)| names.into_iter().map(move |name| (name, kind)))
            .collect();
        fields.push(("created_at".to_owned(), FieldKind::Timestamp));
        fields.push(("parent_resolution".to_owned(), FieldKind::Status));
        fields.push(("output_items".to_owned(), FieldKind::Items));
        let fields = fields
            .into_iter()
            .map(|(name, kind)| (FieldName::new(py, name), kind))
            .collect();
        statuses.sort();
        let statuses_text = PyList::new(py, &statuses)?.repr()?.to_string();
        Ok(EntryFields {
            required: required
                .into_iter()
                .map(|name| FieldName::new(py, name))
                .collect(),
            fields,
            statuses,
            statuses_text,
        })
    }

    /// Refuse field values that would not read back as a valid entry (`ValueError`). With
    /// `deep`, also walk every value (non-finite floats, nesting, the token arrays' item types)
    /// and return whether all of it is plain JSON, which orjson serializes exactly as
    /// pydantic's JSON mode would.
    #[pyo3(signature = (values, deep = false))]
    fn check(&self, values: &Bound<'_, pyo3::types::PyDict>, deep: bool) -> PyResult<bool> {
        let py = values.py();
        let mut missing = Vec::new();
        for name in &self.required {
            if !values.contains(name.key.bind(py))? {
                missing.push(name.text.as_str());
            }
        }
        if !missing.is_empty() {
            return Err(PyValueError::new_err(format!(
                "missing field(s) {}",
                missing.join(", ")
            )));
        }
        for (name, kind) in &self.fields {
            let Some(value) = values.get_item(name.key.bind(py))? else {
                continue;
            };
            let name = &name.text;
            if let FieldKind::Status = kind {
                let known = value.is_none()
                    || value
                        .cast::<PyString>()
                        .ok()
                        .and_then(|status| status.to_str().ok())
                        .is_some_and(|status| self.statuses.iter().any(|known| known == status));
                if !known {
                    return Err(PyValueError::new_err(format!(
                        "parent_resolution {} is not one of {}",
                        value.repr()?,
                        self.statuses_text
                    )));
                }
            } else if !kind.accepts(&value) {
                return Err(PyValueError::new_err(match kind {
                    FieldKind::Items => "output_items must be a list of dicts".to_owned(),
                    _ => format!(
                        "{name} must be {}, got {}",
                        kind.expected(),
                        type_name(&value)
                    ),
                }));
            }
        }
        if deep {
            return scan_entry_values(values);
        }
        Ok(true)
    }
}

/// Walk an entry's values before serialization (see `scan_value`). The token arrays get a
/// dedicated pass that also checks their item types: entries built with `model_construct`, or
/// mutated after validation, reach `put` unchecked otherwise, and a bool (`true`) would not
/// read back as the same bytes.
fn scan_entry_values(values: &Bound<'_, pyo3::types::PyDict>) -> PyResult<bool> {
    let mut plain = true;
    for (key, value) in values.iter() {
        let key_text = key.cast::<PyString>().ok();
        let name = key_text.and_then(|k| k.to_str().ok());
        let value_plain = match name {
            Some(field @ ("prompt_token_ids" | "generation_token_ids")) => {
                scan_token_ids(&value, field)?
            }
            Some("generation_log_probs") => scan_log_probs(&value)?,
            _ => scan_value(&value, 1).map_err(|e| e.at(|| key.to_string()).into_pyerr())?,
        };
        plain &= value_plain && key.is_exact_instance_of::<PyString>();
    }
    Ok(plain)
}

/// Token ids: a list of ints (bools refused). Plain when every item is an exact int.
fn scan_token_ids(value: &Bound<'_, PyAny>, field: &str) -> PyResult<bool> {
    use pyo3::types::{PyBool, PyInt};
    let list = as_list(value, field)?;
    let mut plain = true;
    let mut refused = None;
    for_each_item_type(list, |index, item_type| {
        if item_type == ItemType::Int {
            return true;
        }
        let Ok(item) = list.get_item(index) else {
            return false;
        };
        if !item.is_instance_of::<PyInt>() || item.is_instance_of::<PyBool>() {
            refused = Some(format!(
                "{field}.{index} must be an int, got {}",
                type_name(&item)
            ));
            return false;
        }
        plain = false;
        true
    });
    refused.map_or(Ok(plain), |problem| Err(PyValueError::new_err(problem)))
}

/// Log-probs: a list of finite floats or ints (bools refused).
fn scan_log_probs(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    use pyo3::types::{PyBool, PyFloat, PyInt};
    let field = "generation_log_probs";
    let list = as_list(value, field)?;
    let mut plain = true;
    let mut refused = None;
    for_each_item_type(list, |index, item_type| {
        if let ItemType::Float(number) = item_type {
            if number.is_finite() {
                return true;
            }
        } else if item_type == ItemType::Int {
            return true;
        }
        let Ok(item) = list.get_item(index) else {
            return false;
        };
        if let Ok(float) = item.cast::<PyFloat>() {
            let number = float.value();
            if !number.is_finite() {
                refused = Some(format!(
                    "{field}.{index} is {}: JSON cannot carry non-finite floats, so the \
                     entry would not read back",
                    non_finite_text(number)
                ));
                return false;
            }
            plain &= item.is_exact_instance_of::<PyFloat>();
        } else if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
            plain &= item.is_exact_instance_of::<PyInt>();
        } else {
            refused = Some(format!(
                "{field}.{index} must be a float, got {}",
                type_name(&item)
            ));
            return false;
        }
        true
    });
    refused.map_or(Ok(plain), |problem| Err(PyValueError::new_err(problem)))
}

/// The exact type of a list item, as far as the token-array scans care.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ItemType {
    /// Exactly `int`.
    Int,
    /// Exactly `float`, with its value.
    Float(f64),
    /// Anything else, subclasses included: the caller looks at the item itself.
    Other,
}

/// Call `visit(index, type)` for each item of `list` in order until it returns false.
///
/// Every put scans its token arrays (hundreds to tens of thousands of items), and readers
/// check decoded token fields the same way. Under abi3, PyO3's safe list iterator costs four
/// calls into libpython per item (size, get, incref, decref): ~6 us of a W1 put's ~10 us type
/// check. Reading each item's type through a borrowed reference costs one call per item
/// (~1 us for the same entry).
fn for_each_item_type(list: &Bound<'_, PyList>, mut visit: impl FnMut(usize, ItemType) -> bool) {
    use pyo3::ffi;
    let len = list.len();
    for index in 0..len {
        // SAFETY: we are attached to the interpreter and hold a reference to `list`, so it is
        // alive. `PyList_GetItem` checks the index (NULL if the list shrank) and returns a
        // borrowed reference; no Python code runs between taking it and the last read of the
        // item in this block, so the item is alive while we read its type and a float's value.
        let item_type = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), index as ffi::Py_ssize_t);
            if item.is_null() {
                ffi::PyErr_Clear();
                ItemType::Other
            } else {
                let object_type = ffi::Py_TYPE(item);
                if object_type == &raw mut ffi::PyLong_Type {
                    ItemType::Int
                } else if object_type == &raw mut ffi::PyFloat_Type {
                    ItemType::Float(ffi::PyFloat_AsDouble(item))
                } else {
                    ItemType::Other
                }
            }
        };
        if !visit(index, item_type) {
            return;
        }
    }
}

fn as_list<'a, 'py>(value: &'a Bound<'py, PyAny>, field: &str) -> PyResult<&'a Bound<'py, PyList>> {
    value.cast::<PyList>().map_err(|_| {
        PyValueError::new_err(format!("{field} must be a list, got {}", type_name(value)))
    })
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "an unknown type".to_owned(), |name| name.to_string())
}

/// Raise ValueError unless `rollout_id` is a valid rollout id.
#[pyfunction]
fn validate_rollout_id(rollout_id: &Bound<'_, PyString>) -> PyResult<()> {
    let rollout_id = text(rollout_id, "rollout_id")?;
    store::validate_rollout_id(rollout_id).map_err(|e| PyValueError::new_err(e.to_string()))
}

// ---- lineage ----------------------------------------------------------------------------------
//
// Request-time lineage (`rust/src/lineage.rs`). Request items are copied into JSON values with
// the GIL held; anything but plain JSON types (exact dict/list/str/int/float/bool/None) yields
// None so that Python's `tokencapture.fingerprint` decides. Hashing, file reads, locks and
// materialization run detached (or, for `FileLineage.submit`, on the worker pool). Answers carry
// the cumulative tokens as a tuple built from interned ints, or from the rollout's previous
// answer plus the new ids. Integrity failures raise `tokencapture.lineage.LineageIntegrityError`
// (a `ValueError`); store errors map as above.
mod lineage_py {
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex, PoisonError};

    use lru::LruCache;
    use pyo3::exceptions::PyRuntimeError;
    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
    use serde_json::Value;

    use super::{spawn_job, text, to_pyerr, token_ids, untrack_atomic, Completions};
    use crate::lineage::{
        self, FileLineage, HashedRequest, ItemsRequest, LineageError, MemoryLineage, Missing,
        Outcome, Step, Tokens,
    };

    static INTEGRITY: PyOnceLock<Py<PyType>> = PyOnceLock::new();

    fn lineage_err(py: Python<'_>, err: LineageError) -> PyErr {
        match err {
            LineageError::Store(err) => to_pyerr(py, err),
            LineageError::Integrity(message) => {
                let class = INTEGRITY.get_or_try_init(py, || {
                    py.import("tokencapture.lineage")?
                        .getattr("LineageIntegrityError")?
                        .cast_into::<PyType>()
                        .map(Bound::unbind)
                        .map_err(PyErr::from)
                });
                match class {
                    Ok(class) => PyErr::from_type(class.bind(py).clone(), message),
                    Err(import_error) => import_error,
                }
            }
        }
    }

    /// Nesting deeper than this defers to Python (orjson refuses far deeper values itself).
    const MAX_DEPTH: usize = 128;

    /// A plain-JSON Python value as a JSON value; None for anything else.
    fn json_value(value: &Bound<'_, PyAny>, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Ok(text) = value.cast_exact::<PyString>() {
            return text.to_str().ok().map(|s| Value::String(s.to_owned()));
        }
        if let Ok(dict) = value.cast_exact::<PyDict>() {
            let mut map = serde_json::Map::new();
            for (key, item) in dict.iter() {
                let key = key.cast_exact::<PyString>().ok()?.to_str().ok()?;
                map.insert(key.to_owned(), json_value(&item, depth + 1)?);
            }
            return Some(Value::Object(map));
        }
        if let Ok(list) = value.cast_exact::<PyList>() {
            return list
                .iter()
                .map(|item| json_value(&item, depth + 1))
                .collect::<Option<Vec<_>>>()
                .map(Value::Array);
        }
        if value.is_none() {
            return Some(Value::Null);
        }
        if let Ok(flag) = value.cast_exact::<PyBool>() {
            return Some(Value::Bool(flag.is_true()));
        }
        if value.is_exact_instance_of::<PyInt>() {
            if let Ok(int) = value.extract::<i64>() {
                return Some(Value::from(int));
            }
            return value.extract::<u64>().ok().map(Value::from);
        }
        if let Ok(float) = value.cast_exact::<PyFloat>() {
            return serde_json::Number::from_f64(float.value()).map(Value::Number);
        }
        None
    }

    /// Request items (an exact list of plain-JSON values), or None to defer to Python.
    fn request_values(items: &Bound<'_, PyAny>) -> Option<Vec<Value>> {
        let list = items.cast_exact::<PyList>().ok()?;
        list.iter().map(|item| json_value(&item, 1)).collect()
    }

    /// `None` (defer to Python), a list of prefix lengths whose digests are needed, or
    /// `(status, model_call_id, cumulative_token_ids, digest, reason)`.
    fn step_to_py(
        py: Python<'_>,
        step: Step,
        memo: &TupleMemo,
        rollout_id: &str,
    ) -> PyResult<Py<PyAny>> {
        Ok(match step {
            Step::Missing(Missing::Fallback) => py.None(),
            Step::Missing(Missing::Need(lens)) => PyList::new(py, lens)?.into_any().unbind(),
            Step::Done(Outcome::Root) => ("root", py.None(), py.None(), "", "")
                .into_pyobject(py)?
                .into_any()
                .unbind(),
            Step::Done(Outcome::Unresolved { reason }) => {
                ("unresolved", py.None(), py.None(), "", reason)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind()
            }
            Step::Done(Outcome::Resolved {
                call_id,
                tokens,
                digest,
            }) => {
                let tokens = memo.tuple(py, rollout_id, &tokens)?;
                ("resolved", call_id, tokens, digest, "")
                    .into_pyobject(py)?
                    .into_any()
                    .unbind()
            }
        })
    }

    /// The last answer's tuple per rollout, bounded by tokens. The next answer of a rollout
    /// usually extends the last one (its parent's cumulative tokens plus the new turn), so its
    /// tuple is the memoized one concatenated with the new ids: copied references instead of a
    /// lookup per id. A repeated answer returns the same (immutable) tuple.
    struct TupleMemo {
        inner: Mutex<MemoInner>,
        budget: usize,
    }

    struct MemoInner {
        lru: LruCache<String, (Tokens, Py<PyTuple>)>,
        tokens: usize,
    }

    impl TupleMemo {
        fn new(budget: usize) -> Self {
            TupleMemo {
                inner: Mutex::new(MemoInner {
                    lru: LruCache::unbounded(),
                    tokens: 0,
                }),
                budget,
            }
        }

        fn lock(&self) -> std::sync::MutexGuard<'_, MemoInner> {
            self.inner.lock().unwrap_or_else(PoisonError::into_inner)
        }

        fn clear(&self) {
            let mut inner = self.lock();
            inner.lru.clear();
            inner.tokens = 0;
        }

        fn tuple<'py>(
            &self,
            py: Python<'py>,
            rollout_id: &str,
            tokens: &Tokens,
        ) -> PyResult<Bound<'py, PyTuple>> {
            // The entry is taken out while the tuple is built: building allocates, which may
            // run the garbage collector and other threads, so no lock is held across it.
            let previous = {
                let mut inner = self.lock();
                let taken = inner.lru.pop(rollout_id);
                if let Some((old, _)) = &taken {
                    inner.tokens -= old.len();
                }
                taken
            };
            let built = match previous {
                Some((old, tuple)) if Arc::ptr_eq(&old, tokens) => tuple.into_bound(py),
                Some((old, tuple)) if lineage::extends(&old, tokens) => {
                    let suffix = token_tuple(py, &tokens[old.len()..])?;
                    let joined = tuple
                        .bind(py)
                        .as_sequence()
                        .concat(suffix.as_sequence())?
                        .into_any()
                        .cast_into::<PyTuple>()?;
                    untrack_atomic(joined.as_any());
                    joined
                }
                _ => token_tuple(py, tokens)?,
            };
            if tokens.len() <= self.budget {
                let mut inner = self.lock();
                inner.tokens += tokens.len();
                if let Some((_, (old, _))) = inner.lru.push(
                    rollout_id.to_owned(),
                    (tokens.clone(), built.clone().unbind()),
                ) {
                    inner.tokens -= old.len();
                }
                while inner.tokens > self.budget {
                    match inner.lru.pop_lru() {
                        Some((_, (old, _))) => inner.tokens -= old.len(),
                        None => break,
                    }
                }
            }
            Ok(built)
        }
    }

    /// Token ids below this share one interned Python int each (every vocabulary in use fits).
    const INTERNED_IDS: usize = 1 << 18;

    /// One Python int per small token id, created on first use. Building a 30k-token tuple
    /// then costs a reference count per id instead of an allocation (and its later free).
    /// Bounded: at most `INTERNED_IDS` ints (about 10 MB) per process.
    static INTERNED: Mutex<Vec<Option<Py<PyAny>>>> = Mutex::new(Vec::new());

    /// The interned ints, unless another thread holds them. Never waits: creating an int may
    /// run the cycle collector, whose finalizers may let another thread take the interpreter
    /// while this one holds the table; that thread, waiting for the table while attached,
    /// would deadlock both. The caller makes fresh ints instead.
    fn interned_ints() -> Option<std::sync::MutexGuard<'static, Vec<Option<Py<PyAny>>>>> {
        let mut table = match INTERNED.try_lock() {
            Ok(table) => table,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if table.is_empty() {
            table.resize_with(INTERNED_IDS, || None);
        }
        Some(table)
    }

    fn token_tuple<'py>(py: Python<'py>, tokens: &[u64]) -> PyResult<Bound<'py, PyTuple>> {
        let mut table = interned_ints();
        let mut items = Vec::with_capacity(tokens.len());
        for &id in tokens {
            let slot = table
                .as_mut()
                .and_then(|table| usize::try_from(id).ok().and_then(|i| table.get_mut(i)));
            let Some(slot) = slot else {
                items.push(id.into_pyobject(py)?.into_any().unbind());
                continue;
            };
            let int = match slot {
                Some(int) => int.clone_ref(py),
                None => slot
                    .insert(id.into_pyobject(py)?.into_any().unbind())
                    .clone_ref(py),
            };
            items.push(int);
        }
        drop(table);
        let tuple = PyTuple::new(py, items)?;
        untrack_atomic(tuple.as_any());
        Ok(tuple)
    }

    fn hashed(
        fingerprint: String,
        n_items: usize,
        digests: HashMap<usize, String>,
    ) -> HashedRequest {
        HashedRequest {
            fingerprint,
            len: n_items,
            digests,
        }
    }

    /// The two native resolvers, behind one signature for the bindings below.
    trait Resolve: Sync {
        fn resolve_request(
            &self,
            rollout_id: &str,
            request: &mut dyn lineage::Request,
        ) -> lineage::Result<Step>;
    }

    impl Resolve for FileLineage {
        fn resolve_request(
            &self,
            rollout_id: &str,
            request: &mut dyn lineage::Request,
        ) -> lineage::Result<Step> {
            self.resolve(rollout_id, request)
        }
    }

    impl Resolve for MemoryLineage {
        fn resolve_request(
            &self,
            rollout_id: &str,
            request: &mut dyn lineage::Request,
        ) -> lineage::Result<Step> {
            self.resolve(rollout_id, request)
        }
    }

    /// Resolve request items with the native hashes; None when they need Python's.
    fn resolve_items(
        py: Python<'_>,
        resolver: &dyn Resolve,
        memo: &TupleMemo,
        rollout_id: &Bound<'_, PyString>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let Some(values) = request_values(items) else {
            return Ok(py.None());
        };
        resolve_request(py, resolver, memo, rollout_id, ItemsRequest::new(values))
    }

    /// Run one resolve detached from the interpreter and convert its step.
    fn resolve_request<R: lineage::Request + Send>(
        py: Python<'_>,
        resolver: &dyn Resolve,
        memo: &TupleMemo,
        rollout_id: &Bound<'_, PyString>,
        mut request: R,
    ) -> PyResult<Py<PyAny>> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let step = py
            .detach(|| resolver.resolve_request(rollout_id, &mut request))
            .map_err(|e| lineage_err(py, e))?;
        step_to_py(py, step, memo, rollout_id)
    }

    /// The lineage resolver over a store directory (`tokencapture.lineage.FileLineageStore`).
    #[pyclass(frozen, name = "FileLineage", module = "tokencapture._core")]
    struct PyFileLineage {
        inner: Arc<FileLineage>,
        memo: TupleMemo,
    }

    /// A resolve submitted to the worker pool (`FileLineage.prepare` / `submit` / `finish`):
    /// the request goes in, the decision comes back here.
    #[pyclass(frozen, name = "LineageJob", module = "tokencapture._core")]
    struct PyLineageJob {
        rollout_id: String,
        request: Mutex<Option<ItemsRequest>>,
        result: Arc<Mutex<Option<lineage::Result<Step>>>>,
    }

    #[pymethods]
    impl PyFileLineage {
        #[new]
        #[pyo3(signature = (
            root,
            max_cached_rollouts = lineage::DEFAULT_CACHED_ROLLOUTS,
            max_cached_tokens = lineage::DEFAULT_CACHED_TOKENS,
        ))]
        fn new(root: PathBuf, max_cached_rollouts: usize, max_cached_tokens: usize) -> Self {
            PyFileLineage {
                inner: Arc::new(FileLineage::new(
                    root,
                    max_cached_rollouts,
                    max_cached_tokens,
                )),
                memo: TupleMemo::new(max_cached_tokens),
            }
        }

        /// Resolve with the native hashes; None when the items need Python's.
        fn resolve(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            items: &Bound<'_, PyAny>,
        ) -> PyResult<Py<PyAny>> {
            resolve_items(py, &*self.inner, &self.memo, rollout_id, items)
        }

        /// Resolve with hashes computed by the caller; a list of prefix lengths means
        /// "call again with their digests added".
        fn resolve_hashed(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            fingerprint: String,
            n_items: usize,
            digests: HashMap<usize, String>,
        ) -> PyResult<Py<PyAny>> {
            let request = hashed(fingerprint, n_items, digests);
            resolve_request(py, &*self.inner, &self.memo, rollout_id, request)
        }

        /// A job for `submit`, with the request items copied (None when they need Python's
        /// hashes). The event loop then waits for the worker pool instead of a thread hop.
        fn prepare(
            &self,
            rollout_id: &Bound<'_, PyString>,
            items: &Bound<'_, PyAny>,
        ) -> PyResult<Option<PyLineageJob>> {
            let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
            Ok(request_values(items).map(|values| PyLineageJob {
                rollout_id,
                request: Mutex::new(Some(ItemsRequest::new(values))),
                result: Arc::new(Mutex::new(None)),
            }))
        }

        /// Run a prepared job on the worker pool; its completion is reported to `completions`.
        fn submit(
            &self,
            completions: &Bound<'_, Completions>,
            token: u64,
            job: &Bound<'_, PyLineageJob>,
        ) -> PyResult<()> {
            let job = job.get();
            let mut request = job
                .request
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .ok_or_else(|| PyRuntimeError::new_err("this lineage job was already submitted"))?;
            let rollout_id = job.rollout_id.clone();
            let slot = Arc::clone(&job.result);
            let lineage = Arc::clone(&self.inner);
            spawn_job(completions, token, move || {
                let step = lineage.resolve(&rollout_id, &mut request);
                *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
                Ok::<(), crate::error::Error>(())
            })
        }

        /// The decision of a completed job, shaped like `resolve`'s.
        fn finish(&self, py: Python<'_>, job: &Bound<'_, PyLineageJob>) -> PyResult<Py<PyAny>> {
            let job = job.get();
            let result = job
                .result
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
                .ok_or_else(|| PyRuntimeError::new_err("this lineage job has not completed"))?;
            let step = result.map_err(|e| lineage_err(py, e))?;
            step_to_py(py, step, &self.memo, &job.rollout_id)
        }

        fn clear(&self, py: Python<'_>) {
            self.memo.clear();
            py.detach(|| self.inner.clear());
        }

        fn cached_tokens(&self) -> usize {
            self.inner.cached_tokens()
        }

        fn cached_rollouts(&self) -> usize {
            self.inner.cached_rollouts()
        }
    }

    /// The bounded in-process resolver (`tokencapture.lineage.InMemoryLineageStore`).
    #[pyclass(frozen, name = "MemoryLineage", module = "tokencapture._core")]
    struct PyMemoryLineage {
        inner: MemoryLineage,
        memo: TupleMemo,
    }

    #[pymethods]
    impl PyMemoryLineage {
        #[new]
        fn new(max_rollouts: usize, max_tokens: u64, max_cached_tokens: usize) -> Self {
            PyMemoryLineage {
                inner: MemoryLineage::new(max_rollouts, max_tokens, max_cached_tokens),
                memo: TupleMemo::new(max_cached_tokens),
            }
        }

        /// Index one canonical entry line; False when the same bytes were already there.
        fn put(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            line: &[u8],
        ) -> PyResult<bool> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            py.detach(|| self.inner.put(rollout_id, line))
                .map_err(|e| lineage_err(py, e))
        }

        fn resolve(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            items: &Bound<'_, PyAny>,
        ) -> PyResult<Py<PyAny>> {
            resolve_items(py, &self.inner, &self.memo, rollout_id, items)
        }

        fn resolve_hashed(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            fingerprint: String,
            n_items: usize,
            digests: HashMap<usize, String>,
        ) -> PyResult<Py<PyAny>> {
            let request = hashed(fingerprint, n_items, digests);
            resolve_request(py, &self.inner, &self.memo, rollout_id, request)
        }

        /// Forget rollouts; returns `(removed, absent)`.
        fn delete(
            &self,
            py: Python<'_>,
            rollout_ids: Vec<String>,
        ) -> PyResult<(Vec<String>, Vec<String>)> {
            py.detach(|| self.inner.delete(&rollout_ids))
                .map_err(|e| lineage_err(py, e))
        }

        fn clear(&self) {
            self.memo.clear();
            self.inner.clear();
        }

        fn stored_tokens(&self) -> u64 {
            self.inner.stored_tokens()
        }

        fn rollout_count(&self) -> usize {
            self.inner.rollout_count()
        }

        fn cached_tokens(&self) -> usize {
            self.inner.cached_tokens()
        }
    }

    /// `(assistant_fingerprint(items), conversation_digest(items[:context_len]))` by the
    /// native port, or None when the items need Python's implementation.
    #[pyfunction]
    fn continuation_hashes(
        py: Python<'_>,
        items: &Bound<'_, PyAny>,
        context_len: usize,
    ) -> Option<(String, String)> {
        let values = request_values(items)?;
        py.detach(|| lineage::continuation_hashes(&values, context_len).ok())
    }

    /// Whether the token ids `ids` start with `prefix` (both lists, tuples or buffers).
    #[pyfunction]
    fn tokens_extend(
        py: Python<'_>,
        prefix: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let prefix = token_ids(prefix)?;
        let ids = token_ids(ids)?;
        Ok(py.detach(|| lineage::extends(&prefix, &ids)))
    }

    pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
        module.add_class::<PyFileLineage>()?;
        module.add_class::<PyMemoryLineage>()?;
        module.add_class::<PyLineageJob>()?;
        module.add_function(wrap_pyfunction!(continuation_hashes, module)?)?;
        module.add_function(wrap_pyfunction!(tokens_extend, module)?)?;
        Ok(())
    }
}
// ---- end lineage ------------------------------------------------------------------------------

// ---- ledger -----------------------------------------------------------------------------------
//
// The file-backed capture ledger (`rust/src/ledger.rs`), wrapped by
// `tokencapture.ledger.FileCaptureLedger`, which builds commit rows (with Python's own
// `json.dumps`, so the bytes are NeMo Gym's) and interprets the rows handed back (manifest and
// resolution follow NeMo Gym's Python rules). Row parsing, locks and file I/O run detached.
// Reads of a retired rollout raise `tokencapture.protocols.RolloutRetiredError`; a conflicting
// commit raises `tokencapture.ledger.CaptureLedgerConflictError` (a `ValueError`). The async
// record jobs report through the shared `Completions` queue, whose outcomes carry only core
// errors: there a conflict travels as `Error::Conflict` and the Python wrapper re-raises it as
// the ledger's own exception.
mod ledger_py {
    use std::path::PathBuf;
    use std::sync::Arc;

    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::{PyBytes, PyString, PyType};

    use super::{batch_removal, spawn_job, text, to_pyerr, Completions, ExceptionClass, Outcome};
    use crate::error::Error;
    use crate::ledger::{self, Ledger, LedgerError, RecordOutcome, DEFAULT_CACHED_ROLLOUTS};

    static ROLLOUT_RETIRED: ExceptionClass = ExceptionClass::new("RolloutRetiredError");
    static LEDGER_CONFLICT: PyOnceLock<Py<PyType>> = PyOnceLock::new();

    fn ledger_err(py: Python<'_>, err: LedgerError) -> PyErr {
        let message = err.to_string();
        match err {
            LedgerError::Store(err) => to_pyerr(py, err),
            LedgerError::Retired(_) => ROLLOUT_RETIRED.err(py, message),
            LedgerError::Conflict { .. } => {
                let class = LEDGER_CONFLICT.get_or_try_init(py, || {
                    py.import("tokencapture.ledger")?
                        .getattr("CaptureLedgerConflictError")?
                        .cast_into::<PyType>()
                        .map(Bound::unbind)
                        .map_err(PyErr::from)
                });
                match class {
                    Ok(class) => PyErr::from_type(class.bind(py).clone(), message),
                    Err(import_error) => import_error,
                }
            }
        }
    }

    /// True when the row is stored (appended now or already there), False when the fence
    /// discarded it.
    fn stored(outcome: RecordOutcome) -> bool {
        outcome != RecordOutcome::Discarded
    }

    fn job_outcome(result: ledger::Result<RecordOutcome>) -> Outcome {
        match result {
            Ok(outcome) => Outcome::Bool(stored(outcome)),
            Err(LedgerError::Store(err)) => Outcome::Failed(err),
            Err(LedgerError::Conflict {
                rollout_id,
                call_id,
            }) => Outcome::Failed(Error::Conflict {
                rollout_id,
                call_id,
            }),
            // Writes never read a fence as an error; keep the mapping total anyway.
            Err(LedgerError::Retired(rollout_id)) => Outcome::Failed(Error::Retired(rollout_id)),
        }
    }

    fn row_to_py(py: Python<'_>, (offset, line): (u64, Vec<u8>)) -> (u64, Bound<'_, PyBytes>) {
        (offset, PyBytes::new(py, &line))
    }

    /// The native ledger (`tokencapture.ledger.FileCaptureLedger`).
    #[pyclass(frozen, name = "Ledger", module = "tokencapture._core")]
    struct PyLedger {
        inner: Arc<Ledger>,
    }

    #[pymethods]
    impl PyLedger {
        #[new]
        #[pyo3(signature = (root, cached_rollouts = DEFAULT_CACHED_ROLLOUTS))]
        fn new(py: Python<'_>, root: PathBuf, cached_rollouts: usize) -> PyResult<Self> {
            let inner = py
                .detach(|| Ledger::open(root, cached_rollouts))
                .map_err(|e| to_pyerr(py, e))?;
            Ok(PyLedger {
                inner: Arc::new(inner),
            })
        }

        /// Append one commit row (built as NeMo Gym writes it); see `stored` for the result.
        fn record(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            line: &[u8],
        ) -> PyResult<bool> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            py.detach(|| self.inner.record(rollout_id, line))
                .map(stored)
                .map_err(|e| ledger_err(py, e))
        }

        /// `record` on the worker pool; the outcome goes to `completions`.
        fn submit_record(
            &self,
            completions: &Bound<'_, Completions>,
            token: u64,
            rollout_id: &Bound<'_, PyString>,
            line: &[u8],
        ) -> PyResult<()> {
            let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
            let line = line.to_vec();
            let ledger = Arc::clone(&self.inner);
            spawn_job(completions, token, move || {
                job_outcome(ledger.record(&rollout_id, &line))
            })
        }

        fn record_failure(
            &self,
            py: Python<'_>,
            rollout_id: &Bound<'_, PyString>,
            model_call_id: &Bound<'_, PyString>,
            reason: &Bound<'_, PyString>,
        ) -> PyResult<bool> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            let call_id = text(model_call_id, "model_call_id")?;
            let reason = text(reason, "reason")?;
            py.detach(|| self.inner.record_failure(rollout_id, call_id, reason))
                .map(stored)
                .map_err(|e| ledger_err(py, e))
        }

        fn submit_record_failure(
            &self,
            completions: &Bound<'_, Completions>,
            token: u64,
            rollout_id: &Bound<'_, PyString>,
            model_call_id: &Bound<'_, PyString>,
            reason: &Bound<'_, PyString>,
        ) -> PyResult<()> {
            let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
            let call_id = text(model_call_id, "model_call_id")?.to_owned();
            let reason = text(reason, "reason")?.to_owned();
            let ledger = Arc::clone(&self.inner);
            spawn_job(completions, token, move || {
                job_outcome(ledger.record_failure(&rollout_id, &call_id, &reason))
            })
        }

        fn has_rows(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>) -> PyResult<bool> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            py.detach(|| self.inner.has_rows(rollout_id))
                .map_err(|e| ledger_err(py, e))
        }

        /// `[(offset, row_bytes)]` of the rows a manifest lists, in file order.
        fn manifest_rows<'py>(
            &self,
            py: Python<'py>,
            rollout_id: &Bound<'py, PyString>,
        ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            let rows = py
                .detach(|| self.inner.manifest_rows(rollout_id))
                .map_err(|e| ledger_err(py, e))?;
            Ok(rows.into_iter().map(|row| row_to_py(py, row)).collect())
        }

        /// `(offset, row_bytes)` of the only row with this fingerprint, or None.
        fn candidate<'py>(
            &self,
            py: Python<'py>,
            rollout_id: &Bound<'py, PyString>,
            fingerprint: &Bound<'py, PyString>,
        ) -> PyResult<Option<(u64, Bound<'py, PyBytes>)>> {
            let rollout_id = text(rollout_id, "rollout_id")?;
            let fingerprint = text(fingerprint, "fingerprint")?;
            let found = py
                .detach(|| self.inner.candidate(rollout_id, fingerprint))
                .map_err(|e| ledger_err(py, e))?;
            Ok(found.map(|row| row_to_py(py, row)))
        }

        /// Fence, then remove the rows; returns `(removed, absent)`.
        fn retire(
            &self,
            py: Python<'_>,
            rollout_ids: Vec<String>,
        ) -> PyResult<(Vec<String>, Vec<String>)> {
            batch_removal(py, || self.inner.retire(&rollout_ids))
        }

        /// Remove rows and fences; returns `(removed, absent)`.
        fn delete(
            &self,
            py: Python<'_>,
            rollout_ids: Vec<String>,
        ) -> PyResult<(Vec<String>, Vec<String>)> {
            batch_removal(py, || self.inner.delete(&rollout_ids))
        }

        fn clear(&self, py: Python<'_>) {
            py.detach(|| self.inner.clear());
        }

        fn cached_rollouts(&self) -> usize {
            self.inner.cached_rollouts()
        }
    }

    pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
        module.add_class::<PyLedger>()?;
        Ok(())
    }
}
// ---- end ledger -------------------------------------------------------------------------------

// Columnar snapshots through the Arrow PyCapsule interface.
#[path = "py_columnar.rs"]
mod columnar;

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyStore>()?;
    module.add_class::<Completions>()?;
    module.add_function(wrap_pyfunction!(compute_digest, module)?)?;
    module.add_function(wrap_pyfunction!(payload_digest, module)?)?;
    module.add_function(wrap_pyfunction!(validate_rollout_id, module)?)?;
    module.add_class::<EntryFields>()?;
    module.add("MAX_ROLLOUT_ID_LEN", store::MAX_ROLLOUT_ID_LEN)?;
    lineage_py::register(module)?;
    ledger_py::register(module)?;
    columnar::register(module)?;
    Ok(())
}
