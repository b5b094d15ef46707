//! The file-backed capture ledger (`rust/src/ledger.rs`), wrapped by
//! `tokencapture.ledger.FileCaptureLedger`, which builds commit rows (with Python's own
//! `json.dumps`, so the bytes are NeMo Gym's) and interprets the rows handed back (manifest and
//! resolution follow NeMo Gym's Python rules). Row parsing, locks and file I/O run detached.
//! Reads of a retired rollout raise `tokencapture.protocols.RolloutRetiredError`; a conflicting
//! commit raises `tokencapture.ledger.CaptureLedgerConflictError` (a `ValueError`). The async
//! record jobs report through the shared `Completions` queue, whose outcomes carry only core
//! errors: there a conflict travels as `Error::Conflict` and the Python wrapper re-raises it as
//! the ledger's own exception.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use super::bridge::{spawn_job, Completions, Outcome};
use super::errors::{text, to_pyerr, ExceptionClass};
use super::store::batch_removal;
use crate::error::Error;
use crate::fork::PerProcess;
use crate::ledger::{self, Ledger, LedgerError, RecordOutcome, DEFAULT_CACHED_ROLLOUTS};

static ROLLOUT_RETIRED: ExceptionClass = ExceptionClass::new("RolloutRetiredError");
static LEDGER_CONFLICT: ExceptionClass =
    ExceptionClass::in_module("tokencapture.ledger", "CaptureLedgerConflictError");

fn ledger_err(py: Python<'_>, err: LedgerError) -> PyErr {
    let message = err.to_string();
    match err {
        LedgerError::Store(err) => to_pyerr(py, err),
        LedgerError::Retired(_) => ROLLOUT_RETIRED.err(py, message),
        LedgerError::Conflict { .. } => LEDGER_CONFLICT.err(py, message),
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
///
/// Per process: a forked child opens its own ledger on the same root at its first call and
/// never touches the parent's (see `crate::fork`).
#[pyclass(frozen, name = "Ledger", module = "tokencapture._core")]
struct PyLedger {
    handle: PerProcess<Ledger, crate::Error>,
}

impl PyLedger {
    /// This process's ledger.
    fn inner(&self, py: Python<'_>) -> PyResult<Arc<Ledger>> {
        self.handle.get().map_err(|e| to_pyerr(py, e))
    }
}

#[pymethods]
impl PyLedger {
    #[new]
    #[pyo3(signature = (root, cached_rollouts = DEFAULT_CACHED_ROLLOUTS, max_open_files = None))]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        cached_rollouts: usize,
        max_open_files: Option<usize>,
    ) -> PyResult<Self> {
        let handle = py
            .detach(|| {
                PerProcess::open(move || {
                    Ledger::open_with(root.clone(), cached_rollouts, max_open_files)
                })
            })
            .map_err(|e| to_pyerr(py, e))?;
        Ok(PyLedger { handle })
    }

    /// Descriptors this ledger keeps (cached between operations, or in use now).
    fn open_files(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.open_files())
    }

    /// This ledger's own cap on kept descriptors; None when only the process budget applies.
    fn max_open_files(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.inner(py)?.max_open_files())
    }

    /// Append one commit row (built as NeMo Gym writes it); see `stored` for the result.
    fn record(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<bool> {
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| inner.record(rollout_id, line))
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
        let inner = self.inner(completions.py())?;
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let line = line.to_vec();
        let ledger = inner;
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
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        let reason = text(reason, "reason")?;
        py.detach(|| inner.record_failure(rollout_id, call_id, reason))
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
        let inner = self.inner(completions.py())?;
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let call_id = text(model_call_id, "model_call_id")?.to_owned();
        let reason = text(reason, "reason")?.to_owned();
        let ledger = inner;
        spawn_job(completions, token, move || {
            job_outcome(ledger.record_failure(&rollout_id, &call_id, &reason))
        })
    }

    fn has_rows(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| inner.has_rows(rollout_id))
            .map_err(|e| ledger_err(py, e))
    }

    /// `[(offset, row_bytes)]` of the rows a manifest lists, in file order.
    fn manifest_rows<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let rows = py
            .detach(|| inner.manifest_rows(rollout_id))
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
        let inner = self.inner(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let fingerprint = text(fingerprint, "fingerprint")?;
        let found = py
            .detach(|| inner.candidate(rollout_id, fingerprint))
            .map_err(|e| ledger_err(py, e))?;
        Ok(found.map(|row| row_to_py(py, row)))
    }

    /// Fence, then remove the rows; returns `(removed, absent)`.
    fn retire(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.inner(py)?;
        batch_removal(py, || inner.retire(&rollout_ids))
    }

    /// Remove rows and fences; returns `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.inner(py)?;
        batch_removal(py, || inner.delete(&rollout_ids))
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner(py)?;
        py.detach(|| inner.clear());
        Ok(())
    }

    fn cached_rollouts(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.inner(py)?.cached_rollouts())
    }
}

pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyLedger>()?;
    Ok(())
}
