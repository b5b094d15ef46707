//! The only PyO3 file: argument conversion, GIL release and error mapping.
//!
//! Every call that touches a file, waits for a lock or hashes runs detached from the
//! interpreter (`Python::detach`), so other Python threads and the event loop keep running.

use std::path::PathBuf;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple, PyType};

use crate::digest;
use crate::error::Error;
use crate::store::{self, Store, DEFAULT_CACHED_ROLLOUTS};

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

fn bytes_list<'py>(py: Python<'py>, records: &store::Records) -> Bound<'py, PyList> {
    let items = records
        .lines
        .iter()
        .map(|range| PyBytes::new(py, &records.buf[range.clone()]));
    PyList::new(py, items).expect("a list of bytes builds")
}

/// The native store. The Python class `tokencapture.store.TokenCaptureStore` wraps it.
#[pyclass(frozen, name = "Store", module = "tokencapture._core")]
struct PyStore {
    inner: Store,
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (root, cached_rollouts = DEFAULT_CACHED_ROLLOUTS))]
    fn new(py: Python<'_>, root: PathBuf, cached_rollouts: usize) -> PyResult<Self> {
        let inner = py
            .detach(|| Store::open(root, cached_rollouts))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(PyStore { inner })
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

    /// Freeze and return `(lines, incomplete, snapshot_id, version)`.
    fn freeze<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<(Bound<'py, PyList>, bool, String, u64)> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let snapshot = py
            .detach(|| self.inner.freeze(rollout_id))
            .map_err(|e| to_pyerr(py, e))?;
        Ok((
            bytes_list(py, &snapshot.records),
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
        py.detach(|| self.inner.retire(&rollout_ids))
            .map(|r| (r.removed, r.absent))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Delete a batch; returns `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        py.detach(|| self.inner.delete(&rollout_ids))
            .map(|r| (r.removed, r.absent))
            .map_err(|e| to_pyerr(py, e))
    }

    fn is_incomplete(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| self.inner.is_incomplete(rollout_id))
            .map_err(|e| to_pyerr(py, e))
    }

    /// The unique stored lines of a rollout (torn tail ignored, nothing created).
    fn read_lines<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyList>> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let records = py
            .detach(|| self.inner.read_records(rollout_id))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(bytes_list(py, &records))
    }

    /// The state as readers see it (tail folded, nothing changed), as JSON; None if no files.
    fn inspect<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let state = py
            .detach(|| self.inner.inspect(rollout_id))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(state.map(|s| PyBytes::new(py, &s.to_json())))
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

/// Nesting the walk refuses (JSON readers refuse far less; this protects the native stack).
const MAX_JSON_DEPTH: usize = 512;

/// Walk `value`: raise ValueError at the first non-finite float; return whether everything is
/// a plain JSON type (exact dict with str keys, list, tuple, str, int, float, bool, None).
/// Plain values serialize with orjson exactly as pydantic's JSON mode would; anything else
/// takes the pydantic path. The walk continues past exotic values so no NaN hides behind one
/// that is visible to it.
fn scan_value(value: &Bound<'_, PyAny>, depth: usize, path: &mut Vec<String>) -> PyResult<bool> {
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt};
    if depth > MAX_JSON_DEPTH {
        return Err(PyValueError::new_err(format!(
            "value at {} is nested deeper than {MAX_JSON_DEPTH} levels",
            render_path(path)
        )));
    }
    if let Ok(float) = value.cast::<PyFloat>() {
        if !float.value().is_finite() {
            return Err(PyValueError::new_err(format!(
                "{} is {}: JSON cannot carry non-finite floats, so the entry would not read back",
                render_path(path),
                float.value()
            )));
        }
        return Ok(value.is_exact_instance_of::<PyFloat>());
    }
    if value.is_none()
        || value.is_exact_instance_of::<PyString>()
        || value.is_exact_instance_of::<PyInt>()
        || value.is_exact_instance_of::<PyBool>()
    {
        return Ok(true);
    }
    let mut plain = true;
    if let Ok(list) = value.cast_exact::<PyList>() {
        for (index, item) in list.iter().enumerate() {
            path.push(index.to_string());
            plain &= scan_value(&item, depth + 1, path)?;
            path.pop();
        }
        return Ok(plain);
    }
    if let Ok(tuple) = value.cast_exact::<PyTuple>() {
        for (index, item) in tuple.iter().enumerate() {
            path.push(index.to_string());
            plain &= scan_value(&item, depth + 1, path)?;
            path.pop();
        }
        return Ok(plain);
    }
    if let Ok(dict) = value.cast_exact::<PyDict>() {
        for (key, item) in dict.iter() {
            plain &= key.is_exact_instance_of::<PyString>();
            path.push(key.str().map(|k| k.to_string()).unwrap_or_default());
            plain &= scan_value(&item, depth + 1, path)?;
            path.pop();
        }
        return Ok(plain);
    }
    Ok(false)
}

fn render_path(path: &[String]) -> String {
    if path.is_empty() {
        "the value".to_owned()
    } else {
        path.join(".")
    }
}

/// Check an entry's field values before serialization (see `scan_value`).
#[pyfunction]
fn scan_json_values(values: &Bound<'_, pyo3::types::PyDict>) -> PyResult<bool> {
    let mut path = Vec::new();
    let mut plain = true;
    for (key, value) in values.iter() {
        path.push(key.str()?.to_string());
        let value_plain = scan_value(&value, 1, &mut path)?;
        plain &= value_plain && key.is_exact_instance_of::<PyString>();
        path.pop();
    }
    Ok(plain)
}

/// Raise ValueError unless `rollout_id` is a valid rollout id.
#[pyfunction]
fn validate_rollout_id(rollout_id: &Bound<'_, PyString>) -> PyResult<()> {
    let rollout_id = text(rollout_id, "rollout_id")?;
    store::validate_rollout_id(rollout_id).map_err(|e| PyValueError::new_err(e.to_string()))
}

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyStore>()?;
    module.add_function(wrap_pyfunction!(compute_digest, module)?)?;
    module.add_function(wrap_pyfunction!(payload_digest, module)?)?;
    module.add_function(wrap_pyfunction!(validate_rollout_id, module)?)?;
    module.add_function(wrap_pyfunction!(scan_json_values, module)?)?;
    module.add("MAX_ROLLOUT_ID_LEN", store::MAX_ROLLOUT_ID_LEN)?;
    Ok(())
}
