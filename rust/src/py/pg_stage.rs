//! `PostgresStageGroup`: the binding of the PostgreSQL staging store's native group commit
//! (`crate::staging::postgres`). One call per stage: the record is read from Python, then
//! verified, encoded, queued, sent (by whichever caller leads its batch) and answered with the
//! GIL released once.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use super::staging::{attachments_of, call_of_record, staging_err, verified};
use crate::fork::PerProcess;
use crate::staging::postgres::{
    Address, PgStageError, PlainSslMode, SizeAllowance, StageGroup, StageRow, Target,
};
use crate::staging::row;
use crate::staging::StagingError;

pyo3::create_exception!(
    _core,
    PostgresStageError,
    PyException,
    "A failed native stage: args are (kind, message, sqlstate, detail, hint), kind one of \
     'unavailable', 'durability', 'server', 'unsupported', 'closed'."
);

fn pg_err(err: PgStageError) -> PyErr {
    let message = err.to_string();
    let (kind, sqlstate, detail, hint) = match err {
        PgStageError::Unavailable { .. } => ("unavailable", None, None, None),
        PgStageError::Durability(_) => ("durability", None, None, None),
        PgStageError::Server {
            sqlstate,
            detail,
            hint,
            ..
        } => ("server", Some(sqlstate), detail, hint),
        PgStageError::Unsupported(_) => ("unsupported", None, None, None),
        PgStageError::Closed => ("closed", None, None, None),
    };
    PostgresStageError::new_err((kind, message, sqlstate, detail, hint))
}

enum Failure {
    Staging(StagingError),
    Pg(PgStageError),
}

/// One address as Python passes it: (host or socket directory, port, is a socket directory).
type AddressTuple = (String, u16, bool);

/// The native group commit of one `PostgresStagingStore` (per process: a forked child makes
/// its own on first use and never touches the parent's connections).
#[pyclass(frozen, name = "PostgresStageGroup", module = "tokencapture._core")]
pub(super) struct PyStageGroup {
    handle: PerProcess<StageGroup, Infallible>,
}

impl PyStageGroup {
    fn group(&self) -> Arc<StageGroup> {
        match self.handle.get() {
            Ok(group) => group,
            Err(never) => match never {},
        }
    }
}

#[pymethods]
impl PyStageGroup {
    #[new]
    #[pyo3(signature = (
        addresses, user, password, database, settings, application_name, connect_timeout,
        statement_timeout, allow_unflushed_commits, sslmode, place, max_batch,
        max_leaders, sized_above_bytes, allowance_bytes_per_second
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        addresses: Vec<AddressTuple>,
        user: String,
        password: Option<String>,
        database: String,
        settings: Vec<(String, String)>,
        application_name: Option<String>,
        connect_timeout: f64,
        statement_timeout: f64,
        allow_unflushed_commits: bool,
        sslmode: &str,
        place: String,
        max_batch: usize,
        max_leaders: usize,
        sized_above_bytes: u64,
        allowance_bytes_per_second: u64,
    ) -> PyResult<Self> {
        let seconds = |value: f64, name: &str| {
            Duration::try_from_secs_f64(value).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "{name} must be a non-negative number of seconds"
                ))
            })
        };
        if allowance_bytes_per_second == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "allowance_bytes_per_second must be positive",
            ));
        }
        let sslmode = PlainSslMode::parse(sslmode).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "sslmode {sslmode:?}: the native client serves disable, allow or prefer"
            ))
        })?;
        let target = Target {
            addresses: addresses
                .into_iter()
                .map(|(host, port, unix)| {
                    if unix {
                        Address::Unix {
                            dir: PathBuf::from(host),
                            port,
                        }
                    } else {
                        Address::Tcp { host, port }
                    }
                })
                .collect(),
            user,
            password,
            database,
            settings,
            application_name,
            connect_timeout: seconds(connect_timeout, "connect_timeout")?,
            statement_timeout: seconds(statement_timeout, "statement_timeout")?,
            // A batch's timeout grows by the asyncpg paths' rule, whose numbers Python passes.
            allowance: SizeAllowance {
                above_bytes: sized_above_bytes,
                bytes_per_second: allowance_bytes_per_second,
            },
            allow_unflushed_commits,
            sslmode,
            place,
        };
        let reopen = target.clone();
        Ok(PyStageGroup {
            handle: PerProcess::new(StageGroup::new(target, max_batch, max_leaders), move || {
                Ok(StageGroup::new(reopen.clone(), max_batch, max_leaders))
            }),
        })
    }

    /// Verify and encode one record (as `staging_encode`) and stage it through the group
    /// commit: `(status, staging_key)` once its batch committed (0 stored, 1 duplicate,
    /// 2 conflict, 4 retired). Raises what `staging_encode` raises for a record that cannot be
    /// staged, and `PostgresStageError` for a batch that failed.
    #[pyo3(signature = (record, attachments = None))]
    fn stage(
        &self,
        py: Python<'_>,
        record: &Bound<'_, PyAny>,
        attachments: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(i16, String)> {
        let call = call_of_record(record)?;
        let none = py.None().into_bound(py);
        let attachments = attachments_of(attachments.unwrap_or(&none))?;
        let group = self.group();
        py.detach(|| {
            verified(&call).map_err(Failure::Staging)?;
            let key = call.key();
            if key.contains('\0') {
                return Err(Failure::Staging(StagingError::Invalid(format!(
                    "staging key {key:?} holds NUL, which PostgreSQL text cannot store"
                ))));
            }
            let body = row::encode_row(&call);
            let blob = attachments.as_deref().map(row::encode_attachments);
            let digest = hex::encode(row::content_digest(
                &body,
                blob.as_deref().unwrap_or_default(),
            ));
            let staged = StageRow {
                rollout_id: call.fields.rollout_id.clone(),
                key: key.clone(),
                content_digest: digest,
                row: body,
                attachments: blob,
            };
            group
                .stage(staged)
                .map(|status| (status, key))
                .map_err(Failure::Pg)
        })
        .map_err(|failure| match failure {
            Failure::Staging(err) => staging_err(py, err),
            Failure::Pg(err) => pg_err(err),
        })
    }

    /// Open one connection ahead of the first stages (the GIL released; see
    /// `StageGroup::warm`); errors are left for the first stage to meet.
    fn warm(&self, py: Python<'_>) {
        let group = self.group();
        py.detach(|| group.warm());
    }

    /// `(calls, stages, connects)`: `stage_batch` calls sent, stages they answered,
    /// connections opened (this process's).
    fn stats(&self) -> (u64, u64, u64) {
        let stats = self.group().stats();
        (stats.calls, stats.stages, stats.connects)
    }

    /// Open connections kept idle (this process's).
    fn idle_connections(&self) -> usize {
        self.group().idle_connections()
    }

    /// Refuse further stages and close this process's idle connections (idempotent).
    fn close(&self, py: Python<'_>) {
        let group = self.group();
        py.detach(|| group.close());
    }
}

pub(super) fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyStageGroup>()?;
    module.add(
        "PostgresStageError",
        module.py().get_type::<PostgresStageError>(),
    )?;
    Ok(())
}
