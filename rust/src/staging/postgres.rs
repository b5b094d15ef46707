//! The native group commit of `PostgresStagingStore.stage`: encoded rows sent to PostgreSQL by
//! the calling threads themselves, none of them holding the GIL.
//!
//! The shape of the Python `GroupCommit` (python/tokencapture/postgres/_client.py), in Rust: a
//! caller queues its encoded row; while fewer than `max_leaders` batches are in flight it
//! becomes a leader, takes every queued row (up to `max_batch`), sends them as one call of
//! `tokencapture.stage_batch` (one round trip, one transaction, one status per row) on a
//! connection of its own, answers and wakes the callers of its batch, and hands the lead to
//! the first caller still queued. The others sleep on their own condition variable. The queue
//! holds at most one row per calling thread; the connections are at most `max_leaders` (each
//! leader holds one, and only idle ones are kept).
//!
//! The client is `tokio-postgres`, driven by a current-thread runtime per connection (what the
//! blocking `postgres` crate does), so that every exchange runs under a client-side timeout
//! (the statement timeout, as asyncpg's `command_timeout`; the connect timeout for connecting):
//! a server that stops answering fails the batch, it never hangs its callers. The batch is one
//! unnamed statement with explicitly typed parameters (`query_typed`: Parse, Bind, Execute and
//! Sync in one round trip), so nothing prepared outlives a transaction (PgBouncer in
//! transaction mode).
//!
//! A batch that sends more than a threshold of row and attachment bytes gets a longer timeout,
//! by the rule of the asyncpg paths ([`SizeAllowance`], its numbers passed from Python): the
//! client's wait, and the server's `statement_timeout` set for that batch alone in a
//! transaction of its own (`BEGIN; SET LOCAL statement_timeout = ...`, the batch, `COMMIT`,
//! pipelined: still one round trip). A batch up to the threshold is sent as above.
//!
//! Every connection is checked as the asyncpg client checks its sessions: it refuses one whose
//! `synchronous_commit` is `off` (unless unflushed commits are allowed). What it cannot do as
//! asyncpg would (TLS: a TCP server that offers it under `sslmode=prefer`; an authentication
//! method the client lacks) is reported as [`PgStageError::Unsupported`] before anything is
//! sent, and the caller falls back to asyncpg.
//!
//! Fork: a [`StageGroup`] belongs to one process; the bindings hold it in a
//! [`crate::fork::PerProcess`], so a forked child makes its own and leaks the parent's (its
//! connections are the parent's sessions, its runtimes the parent's).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::future::join3;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::{Builder, Runtime};
use tokio_postgres::config::SslMode;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Config, NoTls, SimpleQueryMessage};

/// The batch call (sql/005_staging.sql): one status per row, in order.
const STAGE_BATCH: &str = "SELECT tokencapture.stage_batch($1, $2, $3, $4, $5)";
/// How a large batch's timeout grows with its size: the rule of the asyncpg paths
/// (`statement_timeout_for` in python/tokencapture/postgres/_client.py), whose two numbers the
/// binding receives from there (`SIZED_ABOVE_BYTES`, `ALLOWANCE_BYTES_PER_SECOND`), so the rule
/// has one home.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeAllowance {
    /// A batch sending up to this many bytes of rows and attachments keeps the plain timeout.
    pub above_bytes: u64,
    /// Over it, one more second per this many bytes sent (all of them). Positive.
    pub bytes_per_second: u64,
}

impl SizeAllowance {
    /// The timeout of a batch that sends `nbytes` under the configured `timeout`, or None when
    /// it keeps `timeout` (`nbytes` up to `above_bytes`): `timeout + nbytes / bytes_per_second`
    /// seconds, computed in `f64` as the Python rule computes it.
    pub fn raised(&self, timeout: Duration, nbytes: u64) -> Option<Duration> {
        if nbytes <= self.above_bytes {
            return None;
        }
        let seconds = timeout.as_secs_f64() + nbytes as f64 / self.bytes_per_second.max(1) as f64;
        Some(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
    }
}

/// A timeout as the server's `statement_timeout` takes it: whole milliseconds, truncated as
/// the Python side truncates them (`int(seconds * 1000)`), at most the server's maximum
/// (`INT_MAX` ms, ~24.8 days).
fn millis(timeout: Duration) -> u64 {
    (timeout.as_secs_f64() * 1000.0).min(f64::from(i32::MAX)) as u64
}

/// The row and attachment bytes a batch sends (what its size allowance counts; the text
/// arguments count nothing, as on the asyncpg paths).
fn batch_bytes(rows: &[&StageRow]) -> u64 {
    rows.iter()
        .map(|row| (row.row.len() + row.attachments.as_ref().map_or(0, Vec::len)) as u64)
        .sum()
}

/// The most row and attachment bytes one batch call sends (more than one stage's worth): the
/// call is one message, which the server holds to 1 GiB, and a message past it drops the
/// connection and fails every stage of the batch. Half of that leaves room for the rest.
const MAX_BATCH_BYTES: usize = 512 << 20;

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A host name or IP address and a TCP port.
    Tcp { host: String, port: u16 },
    /// A unix-socket directory and the port naming the socket in it (`.s.PGSQL.<port>`).
    Unix { dir: PathBuf, port: u16 },
}

/// How to connect: what asyncpg resolved from the DSN and the environment, and the client's
/// options.
#[derive(Debug, Clone)]
pub struct Target {
    /// Tried in order, as asyncpg tries them.
    pub addresses: Vec<Address>,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    /// Session settings sent at connect (`-c name=value` in the startup options), as asyncpg
    /// sends its `server_settings`: `statement_timeout`, `synchronous_commit` and the DSN's.
    pub settings: Vec<(String, String)>,
    pub application_name: Option<String>,
    pub connect_timeout: Duration,
    /// The client-side bound of one batch call (asyncpg's `command_timeout`), and the
    /// server's `statement_timeout` (in `settings`).
    pub statement_timeout: Duration,
    /// How a large batch's timeout grows, on both sides.
    pub allowance: SizeAllowance,
    pub allow_unflushed_commits: bool,
    /// What the DSN's `sslmode` leaves this client, which speaks no TLS, to do over TCP.
    pub sslmode: PlainSslMode,
    /// The server's address for messages (never the password).
    pub place: String,
}

/// The `sslmode`s under which asyncpg may talk plain text, and what each asks of a client
/// without TLS where asyncpg would use it ([`PgStageError::Unsupported`] then: the store
/// falls back to asyncpg).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainSslMode {
    /// Never TLS.
    Disable,
    /// Plain text first; asyncpg retries with TLS when a TCP server refuses the plain session
    /// before authenticating it (a `hostssl`-only `pg_hba.conf`): such a refusal is
    /// unsupported here.
    Allow,
    /// asyncpg's default: TLS when a TCP server offers it, so a server that does is refused
    /// before anything is sent.
    Prefer,
}

impl PlainSslMode {
    /// The mode of a DSN's `sslmode` name, if it is one that may talk plain text.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "disable" => Some(Self::Disable),
            "allow" => Some(Self::Allow),
            "prefer" => Some(Self::Prefer),
            _ => None,
        }
    }
}

/// One encoded stage.
#[derive(Debug, Clone)]
pub struct StageRow {
    pub rollout_id: String,
    pub key: String,
    pub content_digest: String,
    pub row: Vec<u8>,
    pub attachments: Option<Vec<u8>>,
}

/// Why a stage's batch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PgStageError {
    /// No answer: the server could not be reached, went away, or did not answer in time. The
    /// batch may or may not have committed. `kind` names the failure as the asyncpg path's
    /// exception types do (`ConnectionRefusedError`, `TimeoutError`, ...).
    #[error("PostgreSQL at {place} is unavailable: {kind}: {message}")]
    Unavailable {
        place: String,
        kind: String,
        message: String,
    },
    /// The session would acknowledge commits before they are flushed.
    #[error("the session at {0} has synchronous_commit=off: an acknowledged record could be lost in a crash; fix the server or role setting, or pass allow_unflushed_commits=True")]
    Durability(String),
    /// The server answered the call with an error (nothing was committed).
    #[error("{message}")]
    Server {
        sqlstate: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
    },
    /// This client cannot talk to the server as asyncpg would; nothing was sent.
    #[error("{0}")]
    Unsupported(String),
    /// The group was closed.
    #[error("the store is closed")]
    Closed,
}

impl PgStageError {
    fn unavailable(place: &str, kind: &str, message: impl Into<String>) -> Self {
        PgStageError::Unavailable {
            place: place.to_owned(),
            kind: kind.to_owned(),
            message: message.into(),
        }
    }

    /// Whether the same call may simply run again: a connection that failed before or while
    /// sending (not a timeout: the client's, whose call may still be running, nor the
    /// server's `statement_timeout` cancel, 57014, after which a retry would double the bound
    /// it sets), or a deadlock or serialization failure (nothing committed). The asyncpg
    /// client retries the same ones once.
    fn retryable(&self) -> bool {
        match self {
            PgStageError::Unavailable { kind, .. } => {
                kind != "TimeoutError" && kind != "QueryCanceledError"
            }
            PgStageError::Server { sqlstate, .. } => {
                sqlstate == SqlState::T_R_DEADLOCK_DETECTED.code()
                    || sqlstate == SqlState::T_R_SERIALIZATION_FAILURE.code()
            }
            _ => false,
        }
    }
}

/// The exception name asyncpg gives a server error of `code` that means "unavailable"
/// (SQLSTATE classes 08, 53 and 57), or None for an answer that refuses the call.
fn unavailable_kind(code: &str) -> Option<&'static str> {
    Some(match code {
        "57P01" => "AdminShutdownError",
        "57P02" => "CrashShutdownError",
        "57P03" => "CannotConnectNowError",
        "57014" => "QueryCanceledError",
        "53300" => "TooManyConnectionsError",
        _ if code.starts_with("08") => "PostgresConnectionError",
        _ if code.starts_with("57") => "OperatorInterventionError",
        _ if code.starts_with("53") => "InsufficientResourcesError",
        _ => return None,
    })
}

/// The name of an I/O failure as Python's exception types name it.
fn io_kind(err: &std::io::Error) -> &'static str {
    use std::io::ErrorKind::*;
    match err.kind() {
        ConnectionRefused => "ConnectionRefusedError",
        ConnectionReset => "ConnectionResetError",
        ConnectionAborted => "ConnectionAbortedError",
        BrokenPipe => "BrokenPipeError",
        TimedOut => "TimeoutError",
        NotFound => "FileNotFoundError",
        PermissionDenied => "PermissionError",
        _ => "OSError",
    }
}

/// A failure of the client library, classified.
fn classify(place: &str, err: &tokio_postgres::Error) -> PgStageError {
    if let Some(db) = err.as_db_error() {
        let code = db.code().code();
        if let Some(kind) = unavailable_kind(code) {
            return PgStageError::unavailable(place, kind, db.message());
        }
        if code == "XX000" && db.message().contains("postmaster was shut down") {
            return PgStageError::unavailable(place, "_PostmasterGone", db.message());
        }
        return PgStageError::Server {
            sqlstate: code.to_owned(),
            message: db.message().to_owned(),
            detail: db.detail().map(str::to_owned),
            hint: db.hint().map(str::to_owned),
        };
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return PgStageError::unavailable(place, io_kind(io), err.to_string());
        }
        source = cause.source();
    }
    PgStageError::unavailable(place, "ConnectionError", err.to_string())
}

/// One open connection and the runtime that drives it.
struct Connection {
    runtime: Runtime,
    client: Client,
    driver: tokio::task::JoinHandle<()>,
}

impl Connection {
    /// Say goodbye to the server (bounded), then drop everything.
    fn close(self) {
        let Connection {
            runtime,
            client,
            driver,
        } = self;
        drop(client); // the driver sends Terminate and ends
                      // The timer is made inside the runtime (it needs its time driver).
        let _ =
            runtime.block_on(async { tokio::time::timeout(Duration::from_secs(1), driver).await });
    }
}

/// `-c name=value` options, spaces and backslashes escaped as libpq's `options` wants.
fn startup_options(settings: &[(String, String)]) -> String {
    let escape = |text: &str| text.replace('\\', "\\\\").replace(' ', "\\ ");
    settings
        .iter()
        .map(|(name, value)| format!("-c {}={}", escape(name), escape(value)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// An SSLRequest: length 8, then the code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

type Opened = (Client, tokio::task::JoinHandle<()>);

impl Target {
    fn config(&self, addresses: &[Address], with_options: bool) -> Config {
        let mut config = Config::new();
        for address in addresses {
            match address {
                Address::Tcp { host, port } => config.host(host).port(*port),
                Address::Unix { dir, port } => config.host_path(dir).port(*port),
            };
        }
        config
            .user(&self.user)
            .dbname(&self.database)
            .ssl_mode(SslMode::Disable)
            .connect_timeout(self.connect_timeout);
        if let Some(password) = &self.password {
            config.password(password);
        }
        if let Some(name) = &self.application_name {
            config.application_name(name);
        }
        if with_options && !self.settings.is_empty() {
            config.options(startup_options(&self.settings));
        }
        config
    }

    /// A new connection, its session checked.
    fn connect(&self) -> Result<Connection, PgStageError> {
        let runtime = Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|err| {
                PgStageError::unavailable(&self.place, io_kind(&err), err.to_string())
            })?;
        let connected = match self.open(&runtime, true) {
            // PgBouncer refuses `options`; asyncpg's startup settings, which it is configured to
            // ignore, are then the role's: connect without them (the session is checked below).
            Err(err) if err.to_string().contains("unsupported startup parameter") => {
                self.open(&runtime, false)
            }
            other => other,
        };
        let (client, driver) = connected?;
        let connection = Connection {
            runtime,
            client,
            driver,
        };
        match self.check_session(&connection) {
            Ok(()) => Ok(connection),
            Err(err) => {
                connection.close();
                Err(err)
            }
        }
    }

    /// Connect (the addresses in order), within the connect timeout.
    fn open(&self, runtime: &Runtime, with_options: bool) -> Result<Opened, PgStageError> {
        let over_tcp = self
            .addresses
            .iter()
            .any(|address| matches!(address, Address::Tcp { .. }));
        if !(over_tcp && self.sslmode == PlainSslMode::Prefer) {
            let config = self.config(&self.addresses, with_options);
            return runtime.block_on(async {
                self.timed(async {
                    let (client, connection) = config.connect(NoTls).await.map_err(|err| {
                        if over_tcp && self.sslmode == PlainSslMode::Allow {
                            self.refused_without_tls(&err)
                        } else {
                            self.connect_error(&err)
                        }
                    })?;
                    Ok((
                        client,
                        tokio::spawn(async move {
                            let _ = connection.await;
                        }),
                    ))
                })
                .await
            });
        }
        // sslmode=prefer over TCP: ask each server whether it speaks TLS on the very stream
        // the session then starts on (no second connection, no second server process).
        let mut last = None;
        for address in &self.addresses {
            let config = self.config(std::slice::from_ref(address), with_options);
            let attempt = runtime.block_on(async {
                self.timed(async {
                    let (client, driver) = match address {
                        Address::Tcp { host, port } => {
                            let stream = self.plain_stream(host, *port).await?;
                            let (client, connection) = config
                                .connect_raw(stream, NoTls)
                                .await
                                .map_err(|err| self.connect_error(&err))?;
                            (
                                client,
                                tokio::spawn(async move {
                                    let _ = connection.await;
                                }),
                            )
                        }
                        Address::Unix { .. } => {
                            let (client, connection) = config
                                .connect(NoTls)
                                .await
                                .map_err(|err| self.connect_error(&err))?;
                            (
                                client,
                                tokio::spawn(async move {
                                    let _ = connection.await;
                                }),
                            )
                        }
                    };
                    Ok((client, driver))
                })
                .await
            });
            match attempt {
                Ok(opened) => return Ok(opened),
                // Not something another address would change.
                Err(err @ (PgStageError::Unsupported(_) | PgStageError::Server { .. })) => {
                    return Err(err)
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| {
            PgStageError::unavailable(&self.place, "OSError", "no address to connect to")
        }))
    }

    /// `work` within the connect timeout.
    async fn timed<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, PgStageError>>,
    ) -> Result<T, PgStageError> {
        match tokio::time::timeout(self.connect_timeout, work).await {
            Ok(done) => done,
            Err(_) => Err(PgStageError::unavailable(
                &self.place,
                "TimeoutError",
                "connecting timed out",
            )),
        }
    }

    /// A TCP stream to a server that answered an SSLRequest with 'N' (no TLS), ready for the
    /// startup message; one that offers TLS is refused ([`PgStageError::Unsupported`]).
    async fn plain_stream(&self, host: &str, port: u16) -> Result<TcpStream, PgStageError> {
        let io = |err: std::io::Error| {
            PgStageError::unavailable(&self.place, io_kind(&err), err.to_string())
        };
        let mut stream = TcpStream::connect((host, port)).await.map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        stream.write_all(&SSL_REQUEST).await.map_err(io)?;
        let mut answer = [0u8; 1];
        stream.read_exact(&mut answer).await.map_err(io)?;
        match answer[0] {
            b'N' => Ok(stream),
            b'S' => Err(PgStageError::Unsupported(format!(
                "the server at {} offers TLS (sslmode=prefer): the native client speaks none",
                self.place
            ))),
            other => Err(PgStageError::unavailable(
                &self.place,
                "ConnectionError",
                format!("unexpected answer {other:#04x} to an SSLRequest"),
            )),
        }
    }

    /// A connect error under `sslmode=allow`: a server that refused the plain session (any
    /// error it answered before authenticating it) is one asyncpg would try again with TLS.
    fn refused_without_tls(&self, err: &tokio_postgres::Error) -> PgStageError {
        match err.as_db_error() {
            Some(db) => PgStageError::Unsupported(format!(
                "the server at {} refused a session without TLS (sslmode=allow: asyncpg tries \
                 again with TLS, which the native client does not speak): {}",
                self.place,
                db.message()
            )),
            None => self.connect_error(err),
        }
    }

    fn connect_error(&self, err: &tokio_postgres::Error) -> PgStageError {
        let text = err.to_string();
        if text.contains("unsupported authentication method") {
            return PgStageError::Unsupported(format!(
                "the server at {} asks for an authentication method the native client lacks: \
                 {text}",
                self.place
            ));
        }
        classify(&self.place, err)
    }

    /// `query`, run on `connection`'s runtime within `timeout`: its answer, the server's
    /// error (classified), or a `TimeoutError` saying `timed_out()`.
    fn bounded<T>(
        &self,
        connection: &Connection,
        timeout: Duration,
        query: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
        timed_out: impl FnOnce() -> String,
    ) -> Result<T, PgStageError> {
        let answer = connection
            .runtime
            .block_on(async { tokio::time::timeout(timeout, query).await });
        match answer {
            Err(_) => Err(PgStageError::unavailable(
                &self.place,
                "TimeoutError",
                timed_out(),
            )),
            Ok(Err(err)) => Err(classify(&self.place, &err)),
            Ok(Ok(found)) => Ok(found),
        }
    }

    fn check_session(&self, connection: &Connection) -> Result<(), PgStageError> {
        if self.allow_unflushed_commits {
            return Ok(());
        }
        let messages = self.bounded(
            connection,
            self.statement_timeout,
            connection.client.simple_query("SHOW synchronous_commit"),
            || "SHOW synchronous_commit timed out".to_owned(),
        )?;
        let off = messages.iter().any(
            |message| matches!(message, SimpleQueryMessage::Row(row) if row.get(0) == Some("off")),
        );
        if off {
            return Err(PgStageError::Durability(self.place.clone()));
        }
        Ok(())
    }

    /// One `stage_batch` call on `connection`: a status per row, or why it failed (and whether
    /// the connection is still fit for the next call).
    ///
    /// A batch over the allowance's threshold runs under its raised timeout
    /// ([`SizeAllowance::raised`]) on both sides: `BEGIN; SET LOCAL statement_timeout = ...`
    /// (one simple query), the call, and `COMMIT`, sent together (pipelined: one round trip),
    /// the three answers awaited within that timeout. The setting ends with the transaction,
    /// through PgBouncer's transaction mode too; a call the server refuses leaves the
    /// transaction failed, and the `COMMIT` behind it rolls it back (the connection is left
    /// outside a transaction, fit for the next call). A batch up to the threshold is the call
    /// alone, under the plain timeout.
    fn call(&self, connection: &Connection, rows: &[&StageRow]) -> Result<Vec<i16>, PgStageError> {
        let rollouts: Vec<&str> = rows.iter().map(|r| r.rollout_id.as_str()).collect();
        let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        let digests: Vec<&str> = rows.iter().map(|r| r.content_digest.as_str()).collect();
        let bodies: Vec<&[u8]> = rows.iter().map(|r| r.row.as_slice()).collect();
        let blobs: Vec<Option<&[u8]>> = rows.iter().map(|r| r.attachments.as_deref()).collect();
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 5] = [
            (&rollouts, Type::TEXT_ARRAY),
            (&keys, Type::TEXT_ARRAY),
            (&digests, Type::TEXT_ARRAY),
            (&bodies, Type::BYTEA_ARRAY),
            (&blobs, Type::BYTEA_ARRAY),
        ];
        let nbytes = batch_bytes(rows);
        let raised = self.allowance.raised(self.statement_timeout, nbytes);
        let timeout = raised.unwrap_or(self.statement_timeout);
        let timed_out = || {
            let allowing = match raised {
                Some(_) => format!(", allowing for the {nbytes} bytes sent"),
                None => String::new(),
            };
            format!("no answer within the statement timeout ({timeout:?}{allowing})")
        };
        let found = match raised {
            None => self.bounded(
                connection,
                timeout,
                connection.client.query_typed(STAGE_BATCH, &params),
                timed_out,
            )?,
            Some(timeout) => {
                let client = &connection.client;
                let setting = format!("BEGIN; SET LOCAL statement_timeout = {}", millis(timeout));
                let (begun, found, committed) = self.bounded(
                    connection,
                    timeout,
                    async {
                        // Polled together, first in this order: tokio-postgres sends a
                        // request when its future is first polled, so the three go out
                        // pipelined, in order.
                        Ok(join3(
                            client.batch_execute(&setting),
                            client.query_typed(STAGE_BATCH, &params),
                            client.batch_execute("COMMIT"),
                        )
                        .await)
                    },
                    timed_out,
                )?;
                // The first failure is the answer (one after it follows from it: a call in a
                // failed transaction is refused, and its COMMIT rolls back without an error).
                // Statuses count only once their transaction committed.
                begun.map_err(|err| classify(&self.place, &err))?;
                let found = found.map_err(|err| classify(&self.place, &err))?;
                committed.map_err(|err| classify(&self.place, &err))?;
                found
            }
        };
        let statuses: Vec<i16> = match found.first().map(|row| row.try_get(0)) {
            Some(Ok(statuses)) => statuses,
            Some(Err(err)) => return Err(classify(&self.place, &err)),
            None => Vec::new(),
        };
        if statuses.len() != rows.len() {
            return Err(PgStageError::Server {
                sqlstate: "XX000".into(),
                message: format!(
                    "stage_batch answered {} statuses for {} stages",
                    statuses.len(),
                    rows.len()
                ),
                detail: None,
                hint: None,
            });
        }
        Ok(statuses)
    }
}

/// A queued stage: its row until a leader takes it, its answer, and the condition its thread
/// sleeps on.
struct Waiter {
    slot: Mutex<Slot>,
    wake: Condvar,
}

#[derive(Default)]
struct Slot {
    answer: Option<Result<i16, PgStageError>>,
    /// Asked to lead the next batch.
    lead: bool,
}

impl Waiter {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn answer(&self, answer: Result<i16, PgStageError>) {
        self.slot().answer = Some(answer);
        self.wake.notify_one();
    }

    fn ask_to_lead(&self) {
        self.slot().lead = true;
        self.wake.notify_one();
    }
}

/// How many of the queued `rows` (in order) the next batch takes: at most `max_batch`, and
/// no more than `max_bytes` of rows and attachments, but always the first (alone, a row over
/// the limit gets its own answer).
fn batch_len<'a>(
    rows: impl Iterator<Item = &'a StageRow>,
    max_batch: usize,
    max_bytes: usize,
) -> usize {
    let mut bytes = 0usize;
    let mut count = 0;
    for row in rows.take(max_batch) {
        bytes += row.row.len() + row.attachments.as_ref().map_or(0, Vec::len);
        if count > 0 && bytes > max_bytes {
            break;
        }
        count += 1;
    }
    count
}

struct Queued {
    waiter: Arc<Waiter>,
    row: StageRow,
    /// Already asked to lead (not asked twice).
    asked: bool,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Queued>,
    idle: Vec<Connection>,
    leaders: usize,
    closed: bool,
}

/// Counters of a group's work (for benchmarks and tests).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GroupStats {
    /// `stage_batch` calls sent (retries included).
    pub calls: u64,
    /// Stages answered by those calls.
    pub stages: u64,
    /// Connections opened.
    pub connects: u64,
}

/// The group commit of one store in one process; see the module documentation.
pub struct StageGroup {
    target: Target,
    max_batch: usize,
    max_leaders: usize,
    state: Mutex<State>,
    stats: Mutex<GroupStats>,
}

impl StageGroup {
    /// A group sending at most `max_batch` rows per call, at most `max_leaders` calls at once.
    pub fn new(target: Target, max_batch: usize, max_leaders: usize) -> Self {
        StageGroup {
            target,
            max_batch: max_batch.max(1),
            max_leaders: max_leaders.max(1),
            state: Mutex::new(State::default()),
            stats: Mutex::new(GroupStats::default()),
        }
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn stats(&self) -> GroupStats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stage one row: the server's status once its batch committed (0 stored, 1 duplicate,
    /// 2 conflict, 4 retired), or why its batch failed. Blocks the calling thread.
    pub fn stage(&self, row: StageRow) -> Result<i16, PgStageError> {
        let me = Arc::new(Waiter {
            slot: Mutex::new(Slot::default()),
            wake: Condvar::new(),
        });
        let mut lead = {
            let mut state = self.state();
            if state.closed {
                return Err(PgStageError::Closed);
            }
            state.queue.push_back(Queued {
                waiter: Arc::clone(&me),
                row,
                asked: false,
            });
            let lead = state.leaders < self.max_leaders;
            if lead {
                state.leaders += 1;
            }
            lead
        };
        loop {
            if lead {
                self.lead();
            }
            let mut slot = me
                .wake
                .wait_while(me.slot(), |slot| slot.answer.is_none() && !slot.lead)
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(answer) = slot.answer.take() {
                // Asked to lead, then answered by another leader's batch (which took this row
                // before the lead came): the lead handed over is still this thread's to pass
                // on or give up, or the group would count a leader that never leads (and,
                // once `max_leaders` were lost that way, no stage would ever be sent again).
                let asked = std::mem::take(&mut slot.lead);
                drop(slot);
                if asked {
                    self.step_down(None);
                }
                return answer;
            }
            slot.lead = false;
            lead = true;
        }
    }

    /// Send one batch as its leader, answer it, and pass the lead on (or give it up).
    fn lead(&self) {
        let (batch, connection) = {
            let mut state = self.state();
            let count = batch_len(
                state.queue.iter().map(|queued| &queued.row),
                self.max_batch,
                MAX_BATCH_BYTES,
            );
            let batch: Vec<Queued> = state.queue.drain(..count).collect();
            (batch, state.idle.pop())
        };
        let (answer, connection) = if batch.is_empty() {
            (Ok(Vec::new()), connection)
        } else {
            let rows: Vec<&StageRow> = batch.iter().map(|q| &q.row).collect();
            match catch_unwind(AssertUnwindSafe(|| self.send(connection, &rows))) {
                Ok(done) => done,
                Err(_) => (
                    Err(PgStageError::unavailable(
                        &self.target.place,
                        "RuntimeError",
                        "the native client panicked",
                    )),
                    None,
                ),
            }
        };
        match &answer {
            Ok(statuses) => {
                for (queued, status) in batch.iter().zip(statuses) {
                    queued.waiter.answer(Ok(*status));
                }
            }
            Err(err) => {
                for queued in &batch {
                    queued.waiter.answer(Err(err.clone()));
                }
            }
        }
        self.step_down(connection);
    }

    /// The end of a lead: keep the connection (unless closed), and pass the lead to the first
    /// queued caller not yet asked, or give it up.
    fn step_down(&self, connection: Option<Connection>) {
        let closing = {
            let mut state = self.state();
            let closing = match connection {
                Some(connection) if state.closed => Some(connection),
                Some(connection) => {
                    state.idle.push(connection);
                    None
                }
                None => None,
            };
            match state.queue.iter_mut().find(|queued| !queued.asked) {
                Some(successor) => {
                    successor.asked = true;
                    successor.waiter.ask_to_lead();
                }
                None => state.leaders -= 1,
            }
            closing
        };
        if let Some(connection) = closing {
            connection.close();
        }
    }

    /// Open one connection ahead of the first stages, as a leader with nothing to send (so the
    /// connections stay at most `max_leaders`): the stages that queue meanwhile are led on it
    /// once it is open. Nothing happens when a leader is at work or a connection is idle; a
    /// failure is left for the first stage to meet.
    pub fn warm(&self) {
        {
            let mut state = self.state();
            if state.closed || state.leaders >= self.max_leaders || !state.idle.is_empty() {
                return;
            }
            state.leaders += 1;
        }
        self.count(|stats| stats.connects += 1);
        let connection = catch_unwind(AssertUnwindSafe(|| self.target.connect()))
            .ok()
            .and_then(Result::ok);
        self.step_down(connection);
    }

    /// The call of one batch, with one retry as the asyncpg client makes it; the connection to
    /// keep (None when its state is unknown).
    fn send(
        &self,
        connection: Option<Connection>,
        rows: &[&StageRow],
    ) -> (Result<Vec<i16>, PgStageError>, Option<Connection>) {
        let mut connection = connection;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let current = match connection.take() {
                Some(current) => current,
                None => {
                    self.count(|stats| stats.connects += 1);
                    match self.target.connect() {
                        Ok(current) => current,
                        Err(err) => {
                            if attempt < 2 && err.retryable() {
                                continue;
                            }
                            return (Err(err), None);
                        }
                    }
                }
            };
            self.count(|stats| stats.calls += 1);
            match self.target.call(&current, rows) {
                Ok(statuses) => {
                    self.count(|stats| stats.stages += rows.len() as u64);
                    return (Ok(statuses), Some(current));
                }
                Err(err) => {
                    // A server's refusal leaves the connection usable; anything else (a cut,
                    // a timeout) leaves it in an unknown state: drop it.
                    let keep =
                        matches!(err, PgStageError::Server { .. }) && !current.client.is_closed();
                    let kept = if keep {
                        Some(current)
                    } else {
                        drop(current.client);
                        None
                    };
                    if attempt < 2 && err.retryable() {
                        connection = kept;
                        continue;
                    }
                    return (Err(err), kept);
                }
            }
        }
    }

    fn count(&self, update: impl FnOnce(&mut GroupStats)) {
        update(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Refuse new stages and close the idle connections; one in use is closed by its leader
    /// when its batch is done. Idempotent.
    pub fn close(&self) {
        let idle = {
            let mut state = self.state();
            state.closed = true;
            std::mem::take(&mut state.idle)
        };
        for connection in idle {
            connection.close();
        }
    }

    /// Open connections kept idle (tests).
    pub fn idle_connections(&self) -> usize {
        self.state().idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sized(row: usize, attachments: Option<usize>) -> StageRow {
        StageRow {
            rollout_id: "r".into(),
            key: "r/c".into(),
            content_digest: String::new(),
            row: vec![0; row],
            attachments: attachments.map(|n| vec![0; n]),
        }
    }

    #[test]
    fn a_batch_takes_rows_up_to_its_byte_limit_and_always_the_first() {
        let rows = [
            sized(40, None),
            sized(30, Some(30)),
            sized(10, None),
            sized(5, None),
        ];
        assert_eq!(batch_len(rows.iter(), 256, 1000), 4);
        assert_eq!(batch_len(rows.iter(), 2, 1000), 2);
        assert_eq!(batch_len(rows.iter(), 256, 100), 2); // 40 + 60 fits, + 10 does not
        assert_eq!(batch_len(rows.iter(), 256, 99), 1);
        assert_eq!(batch_len(rows.iter(), 256, 1), 1); // the first alone, whatever its size
        assert_eq!(batch_len([].iter(), 256, 1), 0);
    }

    #[test]
    fn options_are_escaped() {
        let settings = vec![
            ("statement_timeout".to_owned(), "30000".to_owned()),
            ("search_path".to_owned(), "a b\\c".to_owned()),
        ];
        assert_eq!(
            startup_options(&settings),
            "-c statement_timeout=30000 -c search_path=a\\ b\\\\c"
        );
    }

    #[test]
    fn timeouts_are_not_retried_lost_connections_are() {
        let unavailable = |kind: &str| PgStageError::Unavailable {
            place: "here".into(),
            kind: kind.into(),
            message: String::new(),
        };
        assert!(unavailable("PostgresConnectionError").retryable());
        assert!(unavailable("AdminShutdownError").retryable());
        // The client's timeout and the server's statement_timeout cancel (57014) took the
        // whole bound already: a retry would double it.
        assert!(!unavailable("TimeoutError").retryable());
        assert!(!unavailable(unavailable_kind("57014").unwrap()).retryable());
    }

    #[test]
    fn unavailable_classes() {
        assert_eq!(unavailable_kind("57P01"), Some("AdminShutdownError"));
        assert_eq!(unavailable_kind("08006"), Some("PostgresConnectionError"));
        assert_eq!(
            unavailable_kind("53100"),
            Some("InsufficientResourcesError")
        );
        assert_eq!(unavailable_kind("23505"), None);
    }

    const MIB: u64 = 1 << 20;
    /// The Python side's numbers (`SIZED_ABOVE_BYTES`, `ALLOWANCE_BYTES_PER_SECOND`).
    const ALLOWANCE: SizeAllowance = SizeAllowance {
        above_bytes: MIB,
        bytes_per_second: 4 * MIB,
    };

    #[test]
    fn a_large_batch_gets_one_more_second_per_4_mib_a_small_one_none() {
        // The values of `test_the_rule_sizes_to_timeouts` (tests/test_postgres_large_writes.py),
        // worked out by hand: timeout + bytes / (4 MiB/s) over 1 MiB.
        let secs = Duration::from_secs_f64;
        let thirty = secs(30.0);
        assert_eq!(ALLOWANCE.raised(thirty, 0), None);
        assert_eq!(ALLOWANCE.raised(thirty, 100_000), None);
        assert_eq!(ALLOWANCE.raised(thirty, MIB), None); // up to and including 1 MiB
        assert_eq!(ALLOWANCE.raised(secs(0.2), MIB), None);
        let just_over = ALLOWANCE.raised(thirty, MIB + 4).unwrap();
        assert!((just_over.as_secs_f64() - 30.250000954).abs() < 1e-9);
        assert_eq!(ALLOWANCE.raised(thirty, 16 * MIB), Some(secs(34.0)));
        assert_eq!(ALLOWANCE.raised(thirty, 64 * MIB), Some(secs(46.0)));
        assert_eq!(ALLOWANCE.raised(thirty, 255 * MIB), Some(secs(93.75)));
        assert_eq!(ALLOWANCE.raised(thirty, 268_173_312), Some(secs(93.9375)));
        assert_eq!(ALLOWANCE.raised(thirty, 1_072_693_248), Some(secs(285.75)));
        assert_eq!(ALLOWANCE.raised(secs(5.0), 512 * MIB), Some(secs(133.0)));
        // The server's setting, in whole milliseconds as Python's int(seconds * 1000).
        assert_eq!(millis(ALLOWANCE.raised(secs(0.2), 4 * MIB).unwrap()), 1200);
        assert_eq!(
            millis(ALLOWANCE.raised(secs(0.2), 64 * MIB).unwrap()),
            16200
        );
        assert_eq!(millis(ALLOWANCE.raised(thirty, MIB + 4).unwrap()), 30250);
        assert_eq!(millis(secs(0.2)), 200);
        assert_eq!(millis(Duration::MAX), 2_147_483_647); // the server's largest setting

        // The threshold and the rate are the caller's.
        let other = SizeAllowance {
            above_bytes: 10,
            bytes_per_second: 10,
        };
        assert_eq!(other.raised(secs(1.0), 10), None);
        assert_eq!(other.raised(secs(1.0), 25), Some(secs(3.5)));
        // An absurd size saturates rather than panics.
        let huge = SizeAllowance {
            above_bytes: 0,
            bytes_per_second: 1,
        };
        assert_eq!(huge.raised(secs(1.0), u64::MAX), Some(Duration::MAX));
    }

    #[test]
    fn a_batch_counts_its_rows_and_attachments() {
        let rows = [sized(40, None), sized(30, Some(30)), sized(0, Some(7))];
        let refs: Vec<&StageRow> = rows.iter().collect();
        assert_eq!(batch_bytes(&refs), 107);
        assert_eq!(batch_bytes(&[]), 0);
    }

    fn nowhere() -> Target {
        Target {
            addresses: vec![Address::Tcp {
                host: "127.0.0.1".into(),
                port: 9,
            }],
            user: "nobody".into(),
            password: None,
            database: "none".into(),
            settings: Vec::new(),
            application_name: None,
            connect_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(2),
            allowance: ALLOWANCE,
            allow_unflushed_commits: false,
            sslmode: PlainSslMode::Disable,
            place: "127.0.0.1:9/none".into(),
        }
    }

    fn row(key: &str) -> StageRow {
        StageRow {
            rollout_id: "r".into(),
            key: key.into(),
            content_digest: "00".into(),
            row: vec![1, 2, 3],
            attachments: None,
        }
    }

    #[test]
    fn an_unreachable_server_fails_every_stage_and_frees_the_lead() {
        let group = Arc::new(StageGroup::new(nowhere(), 8, 2));
        let threads: Vec<_> = (0..6)
            .map(|i| {
                let group = Arc::clone(&group);
                std::thread::spawn(move || group.stage(row(&format!("r/{i}"))))
            })
            .collect();
        for thread in threads {
            match thread.join().unwrap() {
                Err(PgStageError::Unavailable { place, kind, .. }) => {
                    assert_eq!(place, "127.0.0.1:9/none");
                    assert_eq!(kind, "ConnectionRefusedError");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(group.state().leaders, 0);
        assert!(group.state().queue.is_empty());
        assert_eq!(group.idle_connections(), 0);
        group.close();
        assert_eq!(group.stage(row("r/x")), Err(PgStageError::Closed));
    }

    #[test]
    fn a_lead_handed_to_a_stage_another_leader_answered_is_passed_on() {
        // Two leaders: one may hand its lead to a queued stage that the other's batch then
        // takes and answers. That stage must pass the lead on (or give it up): a lead lost
        // there is a leader slot lost for good, and with every slot lost nothing is sent.
        let group = Arc::new(StageGroup::new(nowhere(), 2, 2));
        for round in 0..1000 {
            let threads: Vec<_> = (0..8)
                .map(|i| {
                    let group = Arc::clone(&group);
                    std::thread::spawn(move || group.stage(row(&format!("r/{round}/{i}"))))
                })
                .collect();
            for thread in threads {
                assert!(thread.join().unwrap().is_err());
            }
            assert_eq!(group.state().leaders, 0, "round {round}");
            assert!(group.state().queue.is_empty());
        }
    }

    #[test]
    fn messages_match_the_asyncpg_path() {
        let err = PgStageError::unavailable("h:5432/db", "TimeoutError", "late");
        assert_eq!(
            err.to_string(),
            "PostgreSQL at h:5432/db is unavailable: TimeoutError: late"
        );
        assert_eq!(
            PgStageError::Durability("h:5432/db".into()).to_string(),
            "the session at h:5432/db has synchronous_commit=off: an acknowledged record could \
             be lost in a crash; fix the server or role setting, or pass \
             allow_unflushed_commits=True"
        );
    }
}
