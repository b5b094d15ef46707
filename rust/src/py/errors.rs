//! Exception classes and the mapping of the core's errors to Python exceptions.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};

use crate::error::Error;

/// An exception class defined in one of the package's Python modules, looked up once.
pub(super) struct ExceptionClass {
    cell: PyOnceLock<Py<PyType>>,
    module: &'static str,
    name: &'static str,
}

impl ExceptionClass {
    /// A class of `tokencapture.protocols`.
    pub(super) const fn new(name: &'static str) -> Self {
        Self::in_module("tokencapture.protocols", name)
    }

    pub(super) const fn in_module(module: &'static str, name: &'static str) -> Self {
        ExceptionClass {
            cell: PyOnceLock::new(),
            module,
            name,
        }
    }

    pub(super) fn err(&self, py: Python<'_>, message: String) -> PyErr {
        let class = self.cell.get_or_try_init(py, || {
            py.import(self.module)?
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

pub(super) fn to_pyerr(py: Python<'_>, err: Error) -> PyErr {
    let message = err.to_string();
    match err {
        // OSError(errno, strerror, filename) picks the matching subclass (FileNotFoundError,
        // PermissionError, ...) and keeps `errno` for callers. An exhaustion says whether every
        // cached descriptor was closed and the call retried (`descriptors::retry`) or not.
        Error::Io { op, path, source } => match crate::descriptors::exhaustion(&source) {
            Some((errno, _)) => {
                let words = crate::descriptors::exhaustion_message(op, &source)
                    .unwrap_or_else(|| format!("{op} failed: {source}"));
                PyOSError::new_err((errno, words, path))
            }
            None => match source.raw_os_error() {
                Some(errno) => PyOSError::new_err((errno, format!("{op} failed: {source}"), path)),
                None => PyOSError::new_err(message),
            },
        },
        Error::Frozen(_) => FROZEN.err(py, message),
        Error::Retired(_) => RETIRED.err(py, message),
        Error::Conflict { .. } => CONFLICT.err(py, message),
        Error::Corrupt { .. } => CORRUPT.err(py, message),
        Error::InvalidInput(_) => PyValueError::new_err(message),
    }
}

/// `OSError` for an open with no path (the completion queue's eventfd): its errno kept, and
/// an exhaustion worded as the store's opens word it (see [`to_pyerr`]).
pub(super) fn os_error(op: &'static str, source: &std::io::Error) -> PyErr {
    let words = crate::descriptors::exhaustion_message(op, source)
        .unwrap_or_else(|| format!("{op} failed: {source}"));
    match crate::descriptors::exhaustion(source) {
        Some((errno, _)) => PyOSError::new_err((errno, words)),
        None => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, words)),
            None => PyOSError::new_err(words),
        },
    }
}

/// The exception the file store raises for a refused write of `rollout_id`: `kind` is
/// `"frozen"`, `"retired"` or `"conflict"` (which names `model_call_id`). Another backend that
/// learns of the refusal from its server raises this, so every store words it as the core does.
#[pyfunction]
#[pyo3(signature = (kind, rollout_id, model_call_id = String::new()))]
pub(super) fn write_refusal(
    py: Python<'_>,
    kind: &str,
    rollout_id: String,
    model_call_id: String,
) -> PyResult<Py<PyAny>> {
    let err = match kind {
        "frozen" => Error::Frozen(rollout_id),
        "retired" => Error::Retired(rollout_id),
        "conflict" => Error::Conflict {
            rollout_id,
            call_id: model_call_id,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "kind must be \"frozen\", \"retired\" or \"conflict\", not {other:?}"
            )))
        }
    };
    Ok(to_pyerr(py, err).into_value(py).into_any())
}

/// Borrow a Python str as UTF-8, refusing lone surrogates with a plain `ValueError`.
pub(super) fn text<'a>(value: &'a Bound<'_, PyString>, what: &str) -> PyResult<&'a str> {
    value.to_str().map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be valid Unicode text (no lone surrogates)"
        ))
    })
}
