//! The `Store` class: the file store's operations, blocking (detached from the interpreter)
//! or submitted to the worker pool.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use super::bridge::{spawn_detached, spawn_job, Completions, Report};
use super::decode::{decode_in_python, select_records, DecodedRecords};
use super::errors::{text, to_pyerr};
use crate::fork::PerProcess;
use crate::store::{self, Store, DEFAULT_CACHED_ROLLOUTS};

/// Run a batch retire or delete detached from the interpreter; `(removed, absent)`.
pub(super) fn batch_removal(
    py: Python<'_>,
    op: impl FnOnce() -> crate::Result<store::Removal> + Send,
) -> PyResult<(Vec<String>, Vec<String>)> {
    py.detach(op)
        .map(|removal| (removal.removed, removal.absent))
        .map_err(|e| to_pyerr(py, e))
}

/// The native store. The Python class `tokencapture.store.TokenCaptureStore` wraps it.
///
/// Per process: a forked child opens its own store on the same root at its first call and
/// never touches the parent's (see `crate::fork`).
#[pyclass(frozen, name = "Store", module = "tokencapture._core")]
pub(super) struct PyStore {
    handle: PerProcess<Store, crate::Error>,
}

impl PyStore {
    /// This process's store.
    pub(super) fn store(&self, py: Python<'_>) -> PyResult<Arc<Store>> {
        self.handle.get().map_err(|e| to_pyerr(py, e))
    }
}

#[pymethods]
impl PyStore {
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
                    Store::open_with(root.clone(), cached_rollouts, max_open_files)
                })
            })
            .map_err(|e| to_pyerr(py, e))?;
        Ok(PyStore { handle })
    }

    /// Descriptors this store keeps (cached between operations, or in use now).
    fn open_files(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.store(py)?.open_files())
    }

    /// This store's own cap on kept descriptors; None when only the process budget applies.
    fn max_open_files(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        Ok(self.store(py)?.max_open_files())
    }

    /// Close every descriptor this store keeps between operations.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.store(py)?.clear();
        Ok(())
    }

    /// Store one canonical line; True if appended, False if the same payload was already there.
    fn put(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<bool> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        py.detach(|| inner.put(rollout_id, call_id, line))
            .map(|outcome| outcome == store::PutOutcome::Appended)
            .map_err(|e| to_pyerr(py, e))
    }

    /// `put` on the worker pool; the outcome (True/False or the error) goes to `completions`.
    /// With `unless_stored`, a put that leaves another entry stored under the call id standing
    /// (nothing written or marked), and the outcome says whether it did.
    #[pyo3(signature = (completions, token, rollout_id, model_call_id, line, unless_stored = false))]
    fn submit_put(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
        line: &[u8],
        unless_stored: bool,
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        let store = self.store(completions.py())?;
        let report = Report::new(completions, token);
        let (on_conflict, answer) = if unless_stored {
            (store::OnConflict::Keep, store::PutOutcome::Kept)
        } else {
            (store::OnConflict::Mark, store::PutOutcome::Appended)
        };
        let done = move |outcome: crate::Result<store::PutOutcome>| {
            report.send(outcome.map(|outcome| outcome == answer));
        };
        // Queued here, on the caller's thread (a mutex, never the disk): a put behind the
        // rollout's writer is in its queue at once, so the writer's next batch takes it. Only
        // a new writer goes to the worker pool.
        let queued = store.queue_put_as(
            rollout_id,
            call_id,
            line.to_vec(),
            on_conflict,
            Box::new(done),
        );
        let Some(batch) = queued else {
            return Ok(());
        };
        let rollout_id = rollout_id.to_owned();
        spawn_detached(completions, move || store.write_puts(&rollout_id, batch));
        Ok(())
    }

    /// `begin_call` on the worker pool; with `unless_stored`, `begin_call_unless_stored` (its
    /// result: whether the entry was already stored, so that no intent was written).
    fn submit_begin_call(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
        unless_stored: bool,
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let call_id = text(model_call_id, "model_call_id")?.to_owned();
        let store = self.store(completions.py())?;
        spawn_job(completions, token, move || {
            if unless_stored {
                store.begin_call_unless_stored(&rollout_id, &call_id)
            } else {
                store.begin_call(&rollout_id, &call_id).map(|()| false)
            }
        })
    }

    /// `mark_incomplete` on the worker pool; with `only_open`, `mark_incomplete_if_open`
    /// (its result: whether it marked).
    fn submit_mark_incomplete(
        &self,
        completions: &Bound<'_, Completions>,
        token: u64,
        rollout_id: &Bound<'_, PyString>,
        line: &[u8],
        only_open: bool,
    ) -> PyResult<()> {
        let rollout_id = text(rollout_id, "rollout_id")?.to_owned();
        let line = line.to_vec();
        let store = self.store(completions.py())?;
        spawn_job(completions, token, move || {
            if only_open {
                store.mark_incomplete_if_open(&rollout_id, &line)
            } else {
                store.mark_incomplete(&rollout_id, &line).map(|()| true)
            }
        })
    }

    fn begin_call(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        model_call_id: &Bound<'_, PyString>,
    ) -> PyResult<()> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let call_id = text(model_call_id, "model_call_id")?;
        py.detach(|| inner.begin_call(rollout_id, call_id))
            .map_err(|e| to_pyerr(py, e))
    }

    fn mark_incomplete(
        &self,
        py: Python<'_>,
        rollout_id: &Bound<'_, PyString>,
        line: &[u8],
    ) -> PyResult<()> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| inner.mark_incomplete(rollout_id, line))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Freeze and return `((records, offsets), incomplete, snapshot_id, version)`: each record
    /// is the decoded JSON object of a verified line, each offset where its line starts.
    fn freeze<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<(DecodedRecords<'py>, bool, String, u64)> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        // The lines are decoded (attached) while another thread verifies them and makes the
        // freeze durable (detached); for a large log that thread also parses each line into a
        // tape, and this one only builds (and then helps hash): see `Store::freeze_decoding`.
        let (snapshot, ranges, decoded) = py
            .detach(|| inner.freeze_decoding(rollout_id, decode_in_python))
            .map_err(|e| to_pyerr(py, e))?;
        let log = inner.paths(rollout_id).log;
        let selected = select_records(py, &log, &ranges, decoded, &snapshot.records);
        inner.recycle_buffer(snapshot.records.buf);
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
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let snapshot_id = text(snapshot_id, "snapshot_id")?;
        py.detach(|| inner.drop_snapshot(rollout_id, snapshot_id, version))
            .map_err(|e| to_pyerr(py, e))
    }

    /// Retire a batch; returns `(removed, absent)`.
    fn retire(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.store(py)?;
        batch_removal(py, || inner.retire(&rollout_ids))
    }

    /// Delete a batch; returns `(removed, absent)`.
    fn delete(
        &self,
        py: Python<'_>,
        rollout_ids: Vec<String>,
    ) -> PyResult<(Vec<String>, Vec<String>)> {
        let inner = self.store(py)?;
        batch_removal(py, || inner.delete(&rollout_ids))
    }

    /// Remove the retired rollouts whose state was last modified at or before `cutoff` (Unix
    /// seconds); the swept ids, sorted (`dry_run`: only listed).
    #[pyo3(signature = (cutoff, dry_run = false))]
    fn sweep_retired(&self, py: Python<'_>, cutoff: f64, dry_run: bool) -> PyResult<Vec<String>> {
        let inner = self.store(py)?;
        py.detach(|| inner.sweep_retired(cutoff, dry_run))
            .map_err(|e| to_pyerr(py, e))
    }

    fn is_incomplete(&self, py: Python<'_>, rollout_id: &Bound<'_, PyString>) -> PyResult<bool> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        py.detach(|| inner.is_incomplete(rollout_id))
            .map_err(|e| to_pyerr(py, e))
    }

    /// The unique stored records of a rollout, decoded (torn tail ignored, nothing created).
    fn read_lines<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<DecodedRecords<'py>> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let (records, ranges, decoded) = py
            .detach(|| inner.read_decoding(rollout_id, decode_in_python))
            .map_err(|e| to_pyerr(py, e))?;
        let log = inner.paths(rollout_id).log;
        let selected = select_records(py, &log, &ranges, decoded, &records);
        inner.recycle_buffer(records.buf);
        selected
    }

    /// The verified state as readers see it (tail folded, nothing changed) as JSON, and the
    /// number of unique records; None if the rollout has no files.
    fn inspect<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &Bound<'py, PyString>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, usize)>> {
        let inner = self.store(py)?;
        let rollout_id = text(rollout_id, "rollout_id")?;
        let found = py
            .detach(|| inner.inspect(rollout_id))
            .map_err(|e| to_pyerr(py, e))?;
        Ok(found.map(|(state, records)| (PyBytes::new(py, &state.to_json()), records)))
    }
}
