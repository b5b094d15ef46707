//! Request-time lineage (`rust/src/lineage.rs`). Request items are copied into JSON values with
//! the GIL held; anything but plain JSON types (exact dict/list/str/int/float/bool/None) yields
//! None so that Python's `tokencapture.fingerprint` decides. Hashing, file reads, locks and
//! materialization run detached (or, for `FileLineage.submit`, on the worker pool). An async
//! resolve is prepared when it is called (`prepare`: the items copied and fingerprinted, so
//! content the fingerprint refuses is refused then, by Python's fingerprint, which the port
//! defers every such item to) and resolved when it is awaited, without hashing the
//! fingerprint again. Answers carry
//! the cumulative tokens as a tuple of fresh ints, or from the rollout's previous
//! answer plus the new ids. Integrity failures raise `tokencapture.lineage.LineageIntegrityError`
//! (a `ValueError`); store errors map as in `errors`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use lru::LruCache;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

use super::bridge::{spawn_detached, start_pool, Completions, Report};
use super::decode::untrack_atomic;
use super::errors::{text, to_pyerr, ExceptionClass};
use super::records::token_ids;
use crate::fork::{current_pid, PerProcess};
use crate::lineage::verdict::Verdict;
use crate::lineage::{
    self, FileLineage, HashedRequest, ItemsRequest, LineageError, MemoryLineage, Missing, Outcome,
    Request, Step, Tokens, Unverified,
};

static INTEGRITY: ExceptionClass =
    ExceptionClass::in_module("tokencapture.lineage", "LineageIntegrityError");

fn lineage_err(py: Python<'_>, err: LineageError) -> PyErr {
    match err {
        LineageError::Store(err) => to_pyerr(py, err),
        LineageError::Integrity(message) => INTEGRITY.err(py, message),
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
            unverified: Unverified(Some(_)),
            ..
        }) => {
            // Only `FileLineage.finish` may take a deferred answer, after its check.
            return Err(PyRuntimeError::new_err(
                "an answer whose digest was not checked reached the bindings",
            ));
        }
        Step::Done(Outcome::Resolved {
            call_id,
            tokens,
            digest,
            base,
            unverified: Unverified(None),
        }) => {
            let tokens = memo.tuple(py, rollout_id, &tokens, &base)?;
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

    /// `base`: the sequence the answer was built by extending, when known (see
    /// [`lineage::Base`]): if the memo holds that very allocation, the answer extends it
    /// without comparing their ids.
    fn tuple<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &str,
        tokens: &Tokens,
        base: &lineage::Base,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let built = self.build(py, rollout_id, tokens, base)?;
        self.remember(rollout_id, tokens, &built);
        Ok(built)
    }

    /// The answer's tuple, from the rollout's memoized one where it extends it; the memo
    /// forgets that rollout until [`TupleMemo::remember`].
    fn build<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &str,
        tokens: &Tokens,
        base: &lineage::Base,
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
            Some((old, tuple)) if base.is(&old) || lineage::extends(&old, tokens) => {
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
        Ok(built)
    }

    /// Memoize `built` (the tuple of `tokens`) as the rollout's last answer.
    fn remember(&self, rollout_id: &str, tokens: &Tokens, built: &Bound<'_, PyTuple>) {
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
    }
}

/// A tuple of fresh Python ints (CPython shares the small ones itself). A process-wide table
/// of interned ints was measured slower: each id cost two dependent cache misses (its slot in
/// a 2 MB table, then the int), which a cold process also paid for in faults zeroing the
/// table; a fresh int is a bump allocation from Python's allocator. Answers of one rollout
/// still share their ints through `TupleMemo` (the next answer copies the references).
fn token_tuple<'py>(py: Python<'py>, tokens: &[u64]) -> PyResult<Bound<'py, PyTuple>> {
    // Built straight into the tuple (an exact-size iterator): no second array of references,
    // whose fresh pages a cold process would fault in (a 70k-token answer: 560 KB).
    let ints = tokens
        .iter()
        .map(|&id| -> PyResult<Py<PyAny>> { Ok(id.into_pyobject(py)?.into_any().unbind()) });
    let tuple = try_tuple(py, ints)?;
    untrack_atomic(tuple.as_any());
    Ok(tuple)
}

/// A tuple of the items of an exact-size iterator of fallible conversions (the first error
/// is returned).
fn try_tuple<'py>(
    py: Python<'py>,
    items: impl ExactSizeIterator<Item = PyResult<Py<PyAny>>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut failed: Option<PyErr> = None;
    let len = items.len();
    let tuple = PyTuple::new(
        py,
        items.map(|item| match item {
            Ok(int) => int,
            Err(err) => {
                failed.get_or_insert(err);
                py.None()
            }
        }),
    )?;
    debug_assert_eq!(tuple.len(), len);
    match failed {
        Some(err) => Err(err),
        None => Ok(tuple),
    }
}

fn hashed(fingerprint: String, n_items: usize, digests: HashMap<usize, String>) -> HashedRequest {
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
///
/// Per process: a forked child opens its own resolver on the same root at its first call and
/// never touches the parent's (see `crate::fork`). The tuple memo is only used attached to
/// the interpreter, so no other thread holds it while one forks.
#[pyclass(frozen, name = "FileLineage", module = "tokencapture._core")]
struct PyFileLineage {
    handle: PerProcess<FileLineage, std::convert::Infallible>,
    memo: TupleMemo,
}

impl PyFileLineage {
    /// This process's resolver.
    fn inner(&self, _py: Python<'_>) -> PyResult<Arc<FileLineage>> {
        let Ok(inner) = self.handle.get();
        Ok(inner)
    }
}

/// A prepared resolve (`prepare`): the request items copied and fingerprinted when the
/// resolve was called. `FileLineage` runs it on the worker pool (`submit` / `finish`: the
/// request goes in, the decision comes back here), `MemoryLineage` with `resolve_prepared`.
#[pyclass(frozen, name = "LineageJob", module = "tokencapture._core")]
struct PyLineageJob {
    rollout_id: String,
    /// The request's assistant fingerprint ("" for a root).
    #[pyo3(get)]
    fingerprint: String,
    request: Mutex<Option<ItemsRequest>>,
    result: Arc<Mutex<Option<lineage::Result<Step>>>>,
    verdict: Arc<Verdict>,
}

impl PyLineageJob {
    /// The prepared request, once (a job runs at most once).
    fn take_request(&self) -> PyResult<ItemsRequest> {
        self.request
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this lineage job was already submitted"))
    }
}

/// A job with the request items copied and fingerprinted (hashed detached), or None when
/// they need Python's hashes (`tokencapture.fingerprint` then decides, or refuses them). The
/// job needs no resolver state: it may run on any resolver of this process.
fn prepare_job(
    py: Python<'_>,
    rollout_id: &Bound<'_, PyString>,
    items: &Bound<'_, PyAny>,
) -> PyResult<Option<PyLineageJob>> {
    let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
    let Some(values) = request_values(items) else {
        return Ok(None);
    };
    let mut request = ItemsRequest::new(values);
    let Ok(fingerprint) = py.detach(|| request.fingerprint()) else {
        return Ok(None); // the port declined: Python's fingerprint decides
    };
    Ok(Some(PyLineageJob {
        rollout_id,
        fingerprint,
        request: Mutex::new(Some(request)),
        result: Arc::new(Mutex::new(None)),
        verdict: Arc::new(Verdict::default()),
    }))
}

#[pymethods]
impl PyFileLineage {
    #[new]
    #[pyo3(signature = (
        root,
        max_cached_rollouts = lineage::DEFAULT_CACHED_ROLLOUTS,
        max_cached_tokens = lineage::DEFAULT_CACHED_TOKENS,
        max_open_files = None,
    ))]
    fn new(
        root: PathBuf,
        max_cached_rollouts: usize,
        max_cached_tokens: usize,
        max_open_files: Option<usize>,
    ) -> Self {
        start_pool();
        let Ok(handle) = PerProcess::open(move || {
            Ok(FileLineage::with_max_open_files(
                root.clone(),
                max_cached_rollouts,
                max_cached_tokens,
                max_open_files,
            ))
        });
        PyFileLineage {
            handle,
            memo: TupleMemo::new(max_cached_tokens),
        }
    }

    /// Descriptors this resolver keeps (cached between resolves, or in use now).
    fn open_files(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.open_files())
    }

    /// This resolver's own cap on kept descriptors; None when only the process budget applies.
    fn max_open_files(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.inner(py)?.max_open_files())
    }

    /// Resolve with the native hashes; None when the items need Python's.
    fn resolve(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let inner = self.inner(py)?;
        resolve_items(py, &*inner, &self.memo, rollout_id, items)
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
        let inner = self.inner(py)?;
        let request = hashed(fingerprint, n_items, digests);
        resolve_request(py, &*inner, &self.memo, rollout_id, request)
    }

    /// A job for `submit`, with the request items copied and fingerprinted (None when they
    /// need Python's hashes). Called when the resolve is called; the event loop then waits
    /// for the worker pool instead of a thread hop.
    fn prepare(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PyLineageJob>> {
        prepare_job(py, rollout_id, items)
    }

    /// Run a prepared job on the worker pool; its completion is reported to `completions`.
    fn submit(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        job: &Bound<'_, PyLineageJob>,
    ) -> PyResult<()> {
        let inner = self.inner(completions.py())?;
        let job = job.get();
        let mut request = job.take_request()?;
        let rollout_id = job.rollout_id.clone();
        let slot = Arc::clone(&job.result);
        let verdict = Arc::clone(&job.verdict);
        let lineage = inner;
        let report = Report::new(completions, token);
        spawn_detached(completions, move || {
            let step = lineage.resolve_unverified(&rollout_id, &mut request);
            let deferred = match &step {
                Ok(Step::Done(Outcome::Resolved {
                    tokens,
                    unverified: Unverified(Some(digest)),
                    ..
                })) => Some((tokens.clone(), digest.clone())),
                _ => None,
            };
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(step);
            // The loop builds the answer while this thread checks its digest (`Verdict`).
            report.send(Ok::<(), crate::error::Error>(()));
            if let Some((tokens, digest)) = deferred {
                verdict.check_unless_claimed(|| lineage.verify(&tokens, &digest));
            }
            drop(request); // freed after the loop was told
        });
        Ok(())
    }

    /// The decision of a completed job, shaped like `resolve`'s. A deferred answer's tuple is
    /// built, then returned only once its digest check passed; if it failed, None (resolve
    /// again by the path that verifies as it goes: it answers or raises).
    fn finish(&self, py: Python<'_>, job: &Bound<'_, PyLineageJob>) -> PyResult<Py<PyAny>> {
        let job = job.get();
        let result = job
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this lineage job has not completed"))?;
        let step = result.map_err(|e| lineage_err(py, e))?;
        let Step::Done(Outcome::Resolved {
            call_id,
            tokens,
            digest,
            base,
            unverified: Unverified(Some(expected)),
        }) = step
        else {
            return step_to_py(py, step, &self.memo, &job.rollout_id);
        };
        let inner = self.inner(py)?;
        let tuple = self.memo.build(py, &job.rollout_id, &tokens, &base)?;
        let good = py.detach(|| job.verdict.result(|| inner.verify(&tokens, &expected)));
        if !good {
            return Ok(py.None());
        }
        self.memo.remember(&job.rollout_id, &tokens, &tuple);
        Ok(("resolved", call_id, tuple, digest, "")
            .into_pyobject(py)?
            .into_any()
            .unbind())
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.memo.clear();
        let inner = self.inner(py)?;
        py.detach(|| inner.clear());
        Ok(())
    }

    fn cached_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.cached_tokens())
    }

    fn cached_rollouts(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.cached_rollouts())
    }
}

/// The bounded in-process resolver (`tokencapture.lineage.InMemoryLineageStore`).
///
/// In a forked child it is the parent's index, copied: usable if no thread of the parent held
/// any of its mutexes at the fork (checked without waiting at the child's first call, while
/// attached, so the child's own threads cannot race the check); otherwise every call raises
/// `RuntimeError` instead of hanging (its state is unknowable there: create a new one).
#[pyclass(frozen, name = "MemoryLineage", module = "tokencapture._core")]
struct PyMemoryLineage {
    inner: MemoryLineage,
    memo: TupleMemo,
    /// The process that may use `inner`: its creator, or a child that found it idle.
    adopted: AtomicU32,
}

impl PyMemoryLineage {
    /// The index, if this process may use it (see the type's documentation).
    fn inner(&self, _py: Python<'_>) -> PyResult<&MemoryLineage> {
        let pid = current_pid();
        if self.adopted.load(Ordering::Acquire) == pid {
            return Ok(&self.inner);
        }
        if !self.inner.idle() {
            return Err(PyRuntimeError::new_err(
                "this in-memory lineage index was in use by another thread when the process \
                 forked: its state in the child is unknown; create a new one in the child",
            ));
        }
        self.adopted.store(pid, Ordering::Release);
        Ok(&self.inner)
    }
}

#[pymethods]
impl PyMemoryLineage {
    #[new]
    fn new(max_rollouts: usize, max_tokens: u64, max_cached_tokens: usize) -> Self {
        PyMemoryLineage {
            inner: MemoryLineage::new(max_rollouts, max_tokens, max_cached_tokens),
            memo: TupleMemo::new(max_cached_tokens),
            adopted: AtomicU32::new(current_pid()),
        }
    }

    /// Index one canonical entry line; False when the same bytes were already there.
    fn put(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>, line: &[u8]) -> PyResult<bool> {
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| inner.put(rollout_id, line))
            .map_err(|e| lineage_err(py, e))
    }

    fn resolve(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let inner = self.inner(py)?;
        resolve_items(py, inner, &self.memo, rollout_id, items)
    }

    fn resolve_hashed(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        fingerprint: String,
        n_items: usize,
        digests: HashMap<usize, String>,
    ) -> PyResult<Py<PyAny>> {
        let inner = self.inner(py)?;
        let request = hashed(fingerprint, n_items, digests);
        resolve_request(py, inner, &self.memo, rollout_id, request)
    }

    /// A job for `resolve_prepared` (see `FileLineage.prepare`); it does not touch the index.
    fn prepare(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        items: &Bound<'_, PyAny>,
    ) -> PyResult<Option<PyLineageJob>> {
        prepare_job(py, rollout_id, items)
    }

    /// Resolve a prepared job (its fingerprint is not hashed again); shaped like `resolve`.
    fn resolve_prepared(
        &self,
        py: Python<'_>,
        job: &Bound<'_, PyLineageJob>,
    ) -> PyResult<Py<PyAny>> {
        let inner = self.inner(py)?;
        let job = job.get();
        let mut request = job.take_request()?;
        let rollout_id = job.rollout_id.as_str();
        let step = py
            .detach(|| inner.resolve(rollout_id, &mut request))
            .map_err(|e| lineage_err(py, e))?;
        step_to_py(py, step, &self.memo, rollout_id)
    }

    /// Forget rollouts; returns `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.inner(py)?;
        py.detach(|| inner.delete(&rollout_ids))
            .map_err(|e| lineage_err(py, e))
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.memo.clear();
        self.inner(py)?.clear();
        Ok(())
    }

    fn stored_tokens(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.inner(py)?.stored_tokens())
    }

    fn rollout_count(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.rollout_count())
    }

    fn cached_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.cached_tokens())
    }
}

/// `assistant_fingerprint(items)` by the native port, or None when the items need Python's
/// implementation (which then computes the same value, or raises).
#[pyfunction]
fn request_fingerprint(py: Python<'_>, items: &Bound<'_, PyAny>) -> Option<String> {
    let values = request_values(items)?;
    py.detach(|| lineage::fingerprint::assistant_fingerprint(&values).ok())
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
    module.add_function(wrap_pyfunction!(request_fingerprint, module)?)?;
    module.add_function(wrap_pyfunction!(tokens_extend, module)?)?;
    Ok(())
}
