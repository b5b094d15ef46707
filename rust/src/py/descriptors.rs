//! The process-wide descriptor budget (`rust/src/descriptors.rs`): its counters, and setting
//! its limit at run time (the environment variable `TOKENCAPTURE_MAX_OPEN_FILES` sets it at
//! import); and the lock file descriptors a forked child inherited (`rust/src/lock.rs`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::descriptors::budget;

/// `{"limit", "held", "exhausted", "failed", "evicted"}`: the budget, the descriptors every
/// cache of the process keeps, opens that ran out (and closed every cache before retrying
/// once), retries that ran out again, and idle cache entries closed (entries, not
/// descriptors: see `descriptors::BudgetStats`).
#[pyfunction]
fn descriptor_budget(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let stats = budget().stats();
    let out = PyDict::new(py);
    out.set_item("limit", stats.limit)?;
    out.set_item("held", stats.held)?;
    out.set_item("exhausted", stats.exhausted)?;
    out.set_item("failed", stats.failed)?;
    out.set_item("evicted", stats.evicted)?;
    Ok(out)
}

/// Fix the process-wide budget (None: back to the share of the soft limit); the caches trim
/// to it at once.
#[pyfunction]
#[pyo3(signature = (limit))]
fn set_descriptor_budget(py: Python<'_>, limit: Option<usize>) {
    py.detach(|| budget().set_limit(limit));
}

/// Close every idle descriptor the process's caches keep (what an open that runs out of
/// descriptors does before its one retry), for a caller whose own open ran out: a server's
/// socket, say. Returns how many the caches held before less how many they hold after.
#[pyfunction]
fn close_cached_descriptors(py: Python<'_>) -> usize {
    py.detach(|| {
        let before = budget().held();
        budget().evict_all();
        before.saturating_sub(budget().held())
    })
}

/// In a forked child, first thing (`tokencapture.forking`'s after-fork hook): the numbers of
/// the lock file descriptors the parent had open, which the caller replaces with `/dev/null`
/// so that no lock of the parent's stays held through the child (`rust/src/lock.rs`).
#[pyfunction]
fn take_inherited_lock_files() -> Vec<i32> {
    crate::lock::take_inherited_lock_files()
}

pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(descriptor_budget, module)?)?;
    module.add_function(wrap_pyfunction!(take_inherited_lock_files, module)?)?;
    module.add_function(wrap_pyfunction!(set_descriptor_budget, module)?)?;
    module.add_function(wrap_pyfunction!(close_cached_descriptors, module)?)?;
    Ok(())
}
