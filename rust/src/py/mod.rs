//! The PyO3 bindings (`tokencapture._core`): argument conversion, GIL release and error
//! mapping, one file per domain: `errors` (exception classes, error mapping), `decode`
//! (stored lines into Python objects), `bridge` (the async bridge: worker pool and
//! completions), `store` (the `Store` class), `records` (digests, entry field checks,
//! rollout-id validation), `descriptors` (the descriptor budget), `lineage`, `ledger`,
//! `columnar` (Arrow snapshots), `staging` (worker-owned staging: digests, rows, the file
//! staging store) and `pg_stage` (the PostgreSQL staging store's native group commit). This module
//! only registers them.
//!
//! Every call that touches a file, waits for a lock or hashes runs detached from the
//! interpreter (`Python::detach`), so other Python threads and the event loop keep running.

use pyo3::prelude::*;

mod bridge;
mod columnar;
mod decode;
mod descriptors;
mod errors;
mod ledger;
mod lineage;
mod pg_stage;
mod records;
mod staging;
mod store;

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<store::PyStore>()?;
    module.add_class::<bridge::Completions>()?;
    module.add_function(wrap_pyfunction!(records::compute_digest, module)?)?;
    module.add_function(wrap_pyfunction!(records::payload_digest, module)?)?;
    module.add_function(wrap_pyfunction!(records::validate_rollout_id, module)?)?;
    module.add_class::<records::EntryFields>()?;
    module.add_function(wrap_pyfunction!(decode::decode_fetched_lines, module)?)?;
    module.add_function(wrap_pyfunction!(errors::write_refusal, module)?)?;
    module.add("MAX_ROLLOUT_ID_LEN", crate::store::MAX_ROLLOUT_ID_LEN)?;
    lineage::register(module)?;
    ledger::register(module)?;
    descriptors::register(module)?;
    columnar::register(module)?;
    staging::register(module)?;
    pg_stage::register(module)?;
    Ok(())
}
