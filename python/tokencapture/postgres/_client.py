"""Connections for the PostgreSQL backend: a bounded asyncpg pool per event loop and process,
timeouts on connect and on every statement, the durability check, a loop thread for the
synchronous methods, and the mapping of connection failures to `OSError`.

Fork: everything here is per process. A forked child's first call notices the process id
changed and starts over with its own pools, batchers, loop thread and group-commit loops; the
parent's are leaked there (`tokencapture.forking.leak`), never used, closed or collected: they
share sockets and epoll instances with the parent, which keeps using them. The locks are
renewed in the child at the fork itself (`tokencapture.forking.renew_after_fork`), since
another thread of the parent may have held one at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped, unused-ignore]

from tokencapture.forking import ProcessOwner, leak, renew_after_fork
from tokencapture.postgres._citus import describe, is_distributed
from tokencapture.postgres._schema import SCHEMA_VERSION, install_schema, schema_version

__all__ = [
    "ALLOWANCE_BYTES_PER_SECOND",
    "MAX_ARGUMENT_BYTES",
    "SIZED_ABOVE_BYTES",
    "CallBatcher",
    "Client",
    "GroupCommit",
    "PostgresDurabilityError",
    "PostgresSchemaError",
    "PostgresUnavailableError",
    "argument_byte_limit",
    "argument_bytes",
    "describe_distribution_sync",
    "install_schema_sync",
    "on_own_connection",
    "statement_timeout_for",
    "unavailable_error",
]

_T = TypeVar("_T")

# The most bytes one large argument (a token line, a staged row and its attachments) may
# carry: PostgreSQL holds at most 1 GiB in a field or a protocol message (a larger one drops
# the connection), less room for the rest of the statement.
MAX_ARGUMENT_BYTES = (1 << 30) - (1 << 20)


def argument_byte_limit(distributed: bool | None, plain: int = MAX_ARGUMENT_BYTES) -> int:
    """The most bytes of large arguments one call may send (`distributed`: whether the schema
    is distributed with Citus; None while not known yet).

    On Citus a call alone is delegated to its rollout's worker, and the coordinator sends it
    there as the text of a statement, its arguments as literals: `bytea` as hex, two
    characters a byte. The worker's parser grows its buffer for one literal in powers of two,
    and one of 1 GiB is over PostgreSQL's allocation limit, so a literal must stay under 512
    MiB of text: 256 MiB of bytes. The limit there is a quarter of the plain one, 268,173,312
    bytes (256 MiB - 256 KiB), so each of two arguments and the statement fit. Over it a call
    failed late, on the worker ("invalid memory alloc request size 1073741824"; measured with
    stages, 255.7 MiB stored, 256.1 MiB failed, and with a put of 257 MiB). A call over
    `SIZED_ABOVE_BYTES` runs in a transaction of its own (`Client.call`), not delegated: a
    put of 300 MiB failed the same way there, so the limit stands for it too."""
    return plain // 4 if distributed else plain


# A write that sends more than SIZED_ABOVE_BYTES of binary arguments (a put's line, a batch's
# lines, a stage's row and attachments) gets one more second of timeout per
# ALLOWANCE_BYTES_PER_SECOND bytes it sends, on the client and as the server's
# statement_timeout (`statement_timeout_for`, `Client.call`): a put just under the Citus limit
# took 26 s on the test cluster (~10 MiB/s delegated), and timed out under the default 30 s
# when the machine was loaded. 4 MiB/s is well below every rate measured (one server 67-95
# MiB/s, Citus 10-13 MiB/s delegated and ~20 MiB/s in a transaction; docs/postgres.md).
SIZED_ABOVE_BYTES = 1 << 20
ALLOWANCE_BYTES_PER_SECOND = 4 << 20


def statement_timeout_for(timeout: float, nbytes: int) -> float:
    """The timeout (seconds) of a write that sends `nbytes` bytes of binary arguments, for a
    configured `timeout`: `timeout` itself up to `SIZED_ABOVE_BYTES` (a small write keeps
    exactly the configured timeout), else `timeout` plus one second per
    `ALLOWANCE_BYTES_PER_SECOND` bytes (all of them, not only those over the threshold)."""
    if nbytes <= SIZED_ABOVE_BYTES:
        return timeout
    return timeout + nbytes / ALLOWANCE_BYTES_PER_SECOND


def _nbytes(value: Any) -> int:
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    return 0


def _column_bytes(column: Sequence[Any]) -> int:
    """The bytes of a batch's column: one type throughout (an array), None for NULL."""
    first = next((item for item in column if item is not None), None)
    if isinstance(first, bytes | bytearray):
        return sum(map(len, filter(None, column)))  # in C: a batch is counted in microseconds
    if isinstance(first, memoryview):
        return sum(_nbytes(item) for item in column)
    return 0


def argument_bytes(args: Sequence[Any]) -> int:
    """The bytes of a statement's binary arguments: each `bytes`-like argument, and the
    `bytes`-like items of a list argument (a batch's column); text and numbers count 0."""
    total = 0
    for arg in args:
        if isinstance(arg, list | tuple):
            total += _column_bytes(arg)
        else:
            total += _nbytes(arg)
    return total


async def _statement(
    connection: Any, kind: str, sql: str, args: Sequence[Any], timeout: float | None
) -> Any:
    """`connection.fetchval` ("val"), `fetch` ("rows") or `fetchrow` ("row") of `sql`, the
    client waiting at most `timeout` (None: the connection's `command_timeout`)."""
    if kind == "val":
        return await connection.fetchval(sql, *args, timeout=timeout)
    if kind == "rows":
        return await connection.fetch(sql, *args, timeout=timeout)
    return await connection.fetchrow(sql, *args, timeout=timeout)


class PostgresUnavailableError(ConnectionError):
    """The server could not be reached, went away mid-operation, or did not answer in time.

    An `OSError` (via `ConnectionError`): the operation may or may not have committed. Every
    write of the store is safe to retry except `mark_incomplete`, which records one more mark.
    """


class PostgresDurabilityError(RuntimeError):
    """The session would acknowledge commits before they are flushed (synchronous_commit=off)."""


class PostgresSchemaError(RuntimeError):
    """The database lacks the tokencapture schema (or has an older one): run `tokencapture db
    init DSN`, or construct the store with `install_schema=True`."""


# Failures that mean "no answer from the server", as opposed to an answer that refuses.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable; TimeoutError is one too
    asyncio.TimeoutError,
    asyncpg.InterfaceError,  # the connection was closed in the middle of an operation
    # SQLSTATE class 08; also what a Citus coordinator relays when a worker it needs is down
    # ("connection to the remote node ... failed", 08006), or restarted (its cached connection
    # fails once)
    asyncpg.PostgresConnectionError,
    # class 57: shutdown, starting up, canceled (57014: the statement_timeout, never retried:
    # see `_retried`); also a worker's backend terminated under a delegated call (57P01,
    # relayed by the coordinator)
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: too many connections
    asyncpg.exceptions.InternalClientError,  # a protocol state broken by a cut connection
)


class _PostmasterGone(ConnectionError):
    """A Citus coordinator whose own postmaster died under a delegated call: the backend
    reports it as an ERROR (XX000, "postmaster was shut down, exiting"), not as a lost
    connection, yet the worker may have committed the call, so its outcome is unknown."""


def _postmaster_gone(exc: asyncpg.exceptions.InternalServerError) -> bool:
    return "postmaster was shut down" in str(exc)


# Failures after which a connection's state is unknown: it is closed, not reused.
_BREAKS_CONNECTION: tuple[type[BaseException], ...] = (*_UNAVAILABLE, asyncio.CancelledError)
# Answers after which the same call can simply run again (nothing was committed).
_RETRYABLE: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
)


def _retried(exc: BaseException) -> bool:
    """Whether an idempotent call that failed with `exc` (one of `_UNAVAILABLE`) runs once more:
    after a lost connection, yes; not after a timeout, the client's (the call may still be
    running) or the server's (57014, `statement_timeout` or a cancel request: the call took
    its whole time already, and a retry would double the bound `statement_timeout` sets)."""
    return not isinstance(exc, asyncio.TimeoutError | asyncpg.exceptions.QueryCanceledError)


def unavailable_error(where: str, exc: BaseException) -> PostgresUnavailableError:
    """`exc` (one of `_UNAVAILABLE`) said as every PostgreSQL class and the CLI say it."""
    return PostgresUnavailableError(
        f"PostgreSQL at {where} is unavailable: {type(exc).__name__}: {exc}" + _hint(exc)
    )


def install_schema_sync(
    dsn: str, *, timeout: float = 30.0, citus: bool | None = None, upto: int | None = None
) -> list[str]:
    """`install_schema` from synchronous code, on its own connection (an unreachable server is
    `PostgresUnavailableError`)."""
    work = functools.partial(install_schema, citus=citus, upto=upto)
    return asyncio.run(on_own_connection(dsn, timeout, work))


def describe_distribution_sync(dsn: str, *, timeout: float = 30.0) -> dict[str, Any]:
    """How the schema is distributed (`tokencapture.postgres._citus.describe`), from
    synchronous code, on its own connection (an unreachable server is
    `PostgresUnavailableError`)."""
    return asyncio.run(on_own_connection(dsn, timeout, describe))


async def on_own_connection(dsn: str, timeout: float, work: Callable[[Any], Awaitable[_T]]) -> _T:
    """`work(connection)` on a connection of its own (the schema's installer, the CLI's
    `db init`), no answer from the server said as the stores say it
    (`PostgresUnavailableError`)."""
    try:
        connection = await asyncpg.connect(dsn, timeout=timeout)
        try:
            return await work(connection)
        finally:
            await connection.close()
    except _UNAVAILABLE as exc:
        raise unavailable_error(_where(dsn), exc) from exc


def _where(dsn: str) -> str:
    """The server's address for messages (never the password)."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        return f"{host}:{parts.port or 5432}{parts.path}"
    except ValueError:
        return "the configured server"


def _hint(exc: BaseException) -> str:
    """What to do about a refusal whose cause is known (empty otherwise)."""
    if "unsupported startup parameter" in str(exc):
        # PgBouncer refuses a session parameter it cannot pass on.
        return (
            " (a pooler such as PgBouncer: set ignore_startup_parameters = "
            "statement_timeout,synchronous_commit in its configuration and both settings on "
            "the role; see docs/postgres.md)"
        )
    return ""


def _terminate(loop: asyncio.AbstractEventLoop, pool: _Pool) -> None:
    """Close a pool of another event loop without waiting (nothing to do if that loop is
    closed: its transports went with it)."""
    if not loop.is_closed():
        pool.terminate()


class _Pool:
    """At most `size` open connections of one event loop, reused last in, first out.

    asyncpg's own pool costs ~50 us of CPU per acquire and release here (an asyncio queue, a
    shielded release task, a proxy object per checkout), about three times a small query;
    this one is a list and a semaphore. A connection is made on demand (`connect` also checks
    the session); one that failed mid-operation is terminated by the caller, one found closed
    when taken is dropped, and one idle for `max_idle` seconds is closed when the pool next
    looks at it (as asyncpg's pool does after 300 s: a firewall or NAT may have forgotten it,
    and a statement on it would then hang until the statement timeout).
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        size: int,
        timeout: float,
        max_idle: float = 300.0,
    ) -> None:
        self._connect = connect
        self._timeout = timeout
        self._max_idle = max_idle
        self._slots = asyncio.Semaphore(size)
        self._idle: list[tuple[Any, float]] = []  # (connection, released at), oldest first
        self._open: set[Any] = set()
        self._closed = False

    async def acquire(self) -> Any:
        """An open connection (waiting at most the connect timeout for a free slot)."""
        if self._closed:
            raise asyncpg.InterfaceError("the connection pool is closed")
        if self._slots.locked():  # every connection is in use: wait, within the timeout
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        else:
            await self._slots.acquire()  # returns at once
        try:
            while self._idle:
                connection, released = self._idle.pop()
                if time.monotonic() - released > self._max_idle:
                    # This one and every one below it idled too long.
                    stale = [connection, *(older for older, _ in self._idle)]
                    self._idle.clear()
                    for old in stale:
                        self._open.discard(old)
                        old.terminate()
                    break
                if not connection.is_closed():
                    return connection
                self._open.discard(connection)
            connection = await self._connect()
            self._open.add(connection)
            return connection
        except BaseException:
            self._slots.release()
            raise

    def release(self, connection: Any) -> None:
        if self._closed or connection.is_closed():
            self._open.discard(connection)
            connection.terminate()
        else:
            self._idle.append((connection, time.monotonic()))
        self._slots.release()

    async def fetch(self, sql: str, *args: Any) -> Any:
        connection = await self.acquire()
        try:
            return await connection.fetch(sql, *args)
        finally:
            self.release(connection)

    async def close(self) -> None:
        """Close the idle connections; one in use is terminated when it is released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection, _ in idle:
            self._open.discard(connection)
            try:
                await connection.close(timeout=self._timeout)
            except Exception:
                connection.terminate()

    def terminate(self) -> None:
        """Close every connection at once, without a goodbye to the server."""
        self._closed = True
        self._idle = []
        for connection in self._open:
            connection.terminate()
        self._open.clear()


class _LoopThread:
    """An event loop on a daemon thread, for the synchronous twins of the async methods. The
    loop is closed by its own thread once stopped (`stop`, or a dropped client's `_reap`)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self._serve, name="tokencapture-postgres", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        # Submitted from an empty context: the caller's context variables (a timed method's
        # marker) would otherwise be copied into whatever the call schedules on this loop.
        submit = asyncio.run_coroutine_threadsafe
        return contextvars.Context().run(submit, coro, self.loop).result()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed already: stopped by a `_reap`
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def _weakly(connect: Callable[[], Awaitable[_T]]) -> Callable[[], Awaitable[_T]]:
    """The bound method `connect`, without keeping its client alive: a client's pools must not
    hold it back (a cycle is freed by the garbage collector on whichever thread runs it, and a
    connection freed there is torn down off its loop; see `_reap`)."""
    method = weakref.WeakMethod(connect)

    async def call() -> _T:
        bound = method()
        if bound is None:
            raise asyncpg.InterfaceError("the store was dropped")
        return await bound()

    return call


def _reap(state: dict[str, Any]) -> None:
    """A client dropped without `close` (its `__dict__`, kept by its finalizer): tear its pools
    down on their own loops and stop its loop thread. Without it the thread, its loop's
    descriptors and the server sessions stayed for the life of the process, and connections
    freed by the garbage collector off their loop raced the loop in asyncio's transport."""
    if state.get("closed") or not state["_owner"].is_current():
        return  # closed, or the parent's (a forked child never touches those)
    thread: _LoopThread | None = state.get("_thread")
    pools = list(state["_pools"].items())
    for loop, pool in pools:
        if thread is not None and loop is thread.loop:
            continue
        if not loop.is_closed() and not loop.is_running():
            pool.terminate()  # an idle loop (a group commit's): nothing runs on it now
    if thread is None or thread.loop.is_closed():
        return
    loop = thread.loop

    def shutdown() -> None:
        for owner, pool in pools:
            if owner is loop:
                pool.terminate()
        loop.call_soon(loop.stop)  # after the callbacks the terminations queued

    with contextlib.suppress(RuntimeError):  # closed meanwhile
        loop.call_soon_threadsafe(shutdown)


class Client:
    """The connection side of one store object: pools per event loop, timeouts, checks."""

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 10,
        connect_timeout: float = 10.0,
        statement_timeout: float = 30.0,
        synchronous_commit: str | None = "on",
        allow_unflushed_commits: bool = False,
        install_schema: bool = False,
        statement_cache_size: int = 100,
    ) -> None:
        if not isinstance(dsn, str) or not dsn:
            raise TypeError("dsn must be a non-empty postgresql:// connection string")
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise ValueError(f"pool_size must be a positive integer, not {pool_size!r}")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("statement_timeout", statement_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if synchronous_commit == "off" and not allow_unflushed_commits:
            raise PostgresDurabilityError(
                "synchronous_commit='off' acknowledges commits before they are flushed; pass "
                "allow_unflushed_commits=True to accept losing acknowledged records"
            )
        self.dsn = dsn
        self.where = _where(dsn)
        self.pool_size = pool_size
        self.connect_timeout = float(connect_timeout)
        self.statement_timeout = float(statement_timeout)
        self.synchronous_commit = synchronous_commit
        self.allow_unflushed_commits = allow_unflushed_commits
        self.install_schema = install_schema
        self.statement_cache_size = statement_cache_size
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = (
            weakref.WeakKeyDictionary()
        )
        self._creating: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        # Per event loop, one batcher per batched statement.
        self._batchers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, CallBatcher]
        ] = weakref.WeakKeyDictionary()
        self._owner = ProcessOwner()
        self._schema_checked = False
        # Whether the schema is distributed with Citus (None until the first pool is made).
        self.distributed: bool | None = None
        # Whether some Citus worker has not yet told its synchronous_commit (see _check_workers).
        self._workers_unchecked = True
        self._thread: _LoopThread | None = None
        self._thread_lock = threading.Lock()
        renew_after_fork(self, "_thread_lock")
        self.closed = False
        # Dropped without `close`: its connections and loop thread are let go (`_reap`). The
        # finalizer keeps the state, not the client.
        weakref.finalize(self, _reap, self.__dict__).atexit = False  # exit ends them anyway

    def this_process(self) -> None:
        """In a forked child, on its first call: forget the parent's pools, batchers and loop
        thread (made anew on demand). They are leaked, not closed: their connections are the
        parent's sessions and their loops share the parent's epoll instances."""
        self._owner.start_over_in_child(self._thread_lock, self._start_over)

    def _start_over(self) -> None:
        leak(dict(self._pools), dict(self._creating), dict(self._batchers), self._thread)
        self._pools = weakref.WeakKeyDictionary()
        self._creating = weakref.WeakKeyDictionary()
        self._batchers = weakref.WeakKeyDictionary()
        self._thread = None

    # Pools -----------------------------------------------------------------------------------

    def _server_settings(self) -> dict[str, str]:
        settings = {
            "application_name": "tokencapture",
            "statement_timeout": str(int(self.statement_timeout * 1000)),
        }
        if self.synchronous_commit is not None:
            settings["synchronous_commit"] = self.synchronous_commit
        return settings

    async def _connect(self) -> Any:
        """A new connection with this client's settings, its session checked."""
        connection = await asyncpg.connect(
            self.dsn,
            timeout=self.connect_timeout,
            command_timeout=self.statement_timeout,
            server_settings=self._server_settings(),
            statement_cache_size=self.statement_cache_size,
        )
        try:
            await self._check_session(connection)
            if self.distributed and self._workers_unchecked:
                await self._check_workers(connection)
        except BaseException:
            connection.terminate()
            raise
        return connection

    async def _check_session(self, connection: Any) -> None:
        """Run on every new connection: refuse one that would not flush commits."""
        if self.allow_unflushed_commits:
            return
        setting = await connection.fetchval("SHOW synchronous_commit")
        if setting == "off":
            raise PostgresDurabilityError(
                f"the session at {self.where} has synchronous_commit=off: an acknowledged "
                "record could be lost in a crash; fix the server or role setting, or pass "
                "allow_unflushed_commits=True"
            )

    async def _check_workers(self, connection: Any) -> None:
        """On a Citus coordinator: refuse workers that would not flush commits.

        A delegated call commits on the worker under the worker's own synchronous_commit (the
        coordinator does not pass the session's on), so the workers' setting is read over the
        coordinator's own connections to them. A worker that does not answer (down) is asked
        again on the next new connection; one that answers "off" is refused as a session
        reporting "off" is."""
        if self.allow_unflushed_commits:
            self._workers_unchecked = False
            return
        rows = await connection.fetch(
            "SELECT nodename, nodeport, success, result "
            "FROM run_command_on_workers('SHOW synchronous_commit')"
        )
        unanswered = False
        for row in rows:
            if not row["success"]:
                unanswered = True
            elif row["result"] == "off":
                raise PostgresDurabilityError(
                    f"the Citus worker {row['nodename']}:{row['nodeport']} behind {self.where} "
                    "has synchronous_commit=off: a call delegated to it is acknowledged before "
                    "its commit is flushed, and could be lost in a crash; set it on for the "
                    "worker (ALTER SYSTEM, or on the role or database there), or pass "
                    "allow_unflushed_commits=True"
                )
        self._workers_unchecked = unanswered

    async def pool(self) -> _Pool:
        """This event loop's pool (created, and the schema checked, on first use)."""
        if self.closed:
            raise RuntimeError("the store is closed")
        self.this_process()
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is not None:
            return pool
        lock = self._creating.setdefault(loop, asyncio.Lock())
        async with lock:
            pool = self._pools.get(loop)
            if pool is None:
                pool = _Pool(_weakly(self._connect), self.pool_size, self.connect_timeout)
                if not self._schema_checked:
                    try:
                        await self._check_schema(pool)
                    except BaseException:
                        await pool.close()
                        raise
                self._pools[loop] = pool
            return pool

    async def _check_schema(self, pool: _Pool) -> None:
        connection = await pool.acquire()
        try:
            if self.install_schema:
                await install_schema(connection)
            else:
                found = await schema_version(connection)
                if found < SCHEMA_VERSION:
                    raise PostgresSchemaError(
                        f"the database at {self.where} has tokencapture schema version {found}, "
                        f"this client needs {SCHEMA_VERSION}: run `tokencapture db init DSN` "
                        "or pass install_schema=True"
                    )
            self.distributed = await is_distributed(connection)
            if self.distributed:
                await self._check_workers(connection)
        finally:
            pool.release(connection)
        self._schema_checked = True

    # Calls -----------------------------------------------------------------------------------

    async def fetch(
        self, kind: str, sql: str, *args: Any, idempotent: bool = True, sized: bool = False
    ) -> Any:
        """Run one statement (`kind` is "val", "row" or "rows"); one retry of an idempotent call
        whose connection failed (a pooled connection that died with a restarted server) or that
        lost a deadlock. `sized`: a write whose timeout allows for its size (`call`)."""
        if not sized:

            async def statement(connection: Any) -> Any:
                return await _statement(connection, kind, sql, args, None)

            return await self.on_connection(statement, idempotent=idempotent)
        return await self.on_connection(
            functools.partial(self.call, kind=kind, sql=sql, args=args),
            idempotent=idempotent,
        )

    async def call(self, connection: Any, *, kind: str, sql: str, args: Sequence[Any]) -> Any:
        """One write on `connection`, within a timeout that allows for its size: over
        `SIZED_ABOVE_BYTES` of binary arguments (`argument_bytes`), `statement_timeout_for`
        the configured `statement_timeout`, both as the client's wait and as the server's
        `statement_timeout` for it (`SET LOCAL`, so nothing outlives its transaction: the
        caller's when it runs in one, else one of its own, `BEGIN; SET LOCAL ...`, the
        statement, `COMMIT`, each within that timeout). A small write is sent as it is, under
        the configured timeout. A failure that breaks the connection (a timeout, a cut) leaves
        its transaction to the connection's end (`on_connection` terminates it); any other
        rolls back its own transaction first.

        A write of its own transaction is not a top-level call: on Citus it runs on the
        coordinator, not delegated (measured twice as fast for large lines: docs/citus.md)."""
        timeout = statement_timeout_for(self.statement_timeout, argument_bytes(args))
        if timeout == self.statement_timeout:
            return await _statement(connection, kind, sql, args, None)
        setting = f"SET LOCAL statement_timeout = {int(timeout * 1000)}"
        if connection.is_in_transaction():
            await connection.execute(setting)
            return await _statement(connection, kind, sql, args, timeout)
        try:
            await connection.execute(f"BEGIN; {setting}")
            result = await _statement(connection, kind, sql, args, timeout)
            await connection.execute("COMMIT", timeout=timeout)
        except _BREAKS_CONNECTION:
            raise
        except BaseException:
            if not connection.is_closed() and connection.is_in_transaction():
                try:
                    await connection.execute("ROLLBACK")
                except BaseException as failure:
                    # Never back to the pool inside a transaction; the write's own failure
                    # is the answer (a cancellation still cancels).
                    connection.terminate()
                    if not isinstance(failure, Exception):
                        raise
            raise
        return result

    async def on_connection(
        self, work: Callable[[Any], Awaitable[_T]], *, idempotent: bool = True
    ) -> _T:
        """`work(connection)` on a pooled connection (a transaction of several statements,
        say), with `fetch`'s retry and errors: `work` runs again after a failed connection
        or a lost deadlock only when `idempotent` (never after a timeout: `_retried`)."""
        attempts = 2 if idempotent else 1
        for attempt in range(attempts):
            try:
                pool = await self.pool()
                connection = await pool.acquire()
                try:
                    return await work(connection)
                except _BREAKS_CONNECTION:
                    # The connection's state is unknown (a cut mid-statement, a timeout, a
                    # cancelled await): close it rather than reset it for the next caller.
                    connection.terminate()
                    raise
                except asyncpg.exceptions.InternalServerError as exc:
                    if not _postmaster_gone(exc):
                        raise
                    connection.terminate()
                    # An OSError, so it is retried and reported as any unavailable server is.
                    raise _PostmasterGone(str(exc)) from exc
                finally:
                    pool.release(connection)
            except _RETRYABLE:
                if attempt + 1 == attempts:
                    raise
            except (PostgresDurabilityError, PostgresSchemaError):
                raise
            except _UNAVAILABLE as exc:
                if attempt + 1 < attempts and _retried(exc):
                    continue
                raise unavailable_error(self.where, exc) from exc
        raise AssertionError("unreachable")

    def _loop_thread(self) -> _LoopThread:
        """This client's loop thread (started on first use; a forked child starts its own)."""
        self.this_process()
        thread = self._thread
        if thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = _LoopThread()
                thread = self._thread
        return thread

    def batcher(
        self, loop: asyncio.AbstractEventLoop, sql: str, max_batch: int, max_flushing: int | None
    ) -> CallBatcher:
        """This process's `CallBatcher` of `sql` on `loop` (made by the first call that asks;
        `max_batch` and `max_flushing` are that call's)."""
        self.this_process()
        batchers = self._batchers.setdefault(loop, {})
        batcher = batchers.get(sql)
        if batcher is None:
            batcher = batchers[sql] = CallBatcher(self, loop, max_batch, sql, max_flushing)
        return batcher

    def run_sync(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run a coroutine of this client on its own loop thread, from synchronous code."""
        return self._loop_thread().run(coro)

    def call_in_thread(
        self, callback: Callable[..., object], *args: Any
    ) -> asyncio.AbstractEventLoop:
        """Schedule `callback(loop, *args)` on this client's loop thread (from any thread),
        without the task a coroutine would need; the loop it will run on."""
        loop = self._loop_thread().loop
        loop.call_soon_threadsafe(callback, loop, *args)
        return loop

    async def close(self) -> None:
        """Close this loop's pool and the loop thread's; terminate pools of other loops."""
        if self.closed:
            return
        self.this_process()  # a child closes its own connections, never the parent's
        self.closed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        thread, self._thread = self._thread, None
        for owner, pool in list(self._pools.items()):
            if owner is loop:
                await pool.close()
            elif thread is not None and owner is thread.loop:
                closing = asyncio.run_coroutine_threadsafe(pool.close(), thread.loop)
                await asyncio.wrap_future(closing)  # without blocking this loop
            else:
                _terminate(owner, pool)
        self._pools = weakref.WeakKeyDictionary()
        if thread is not None:
            thread.stop()

    def close_sync(self) -> None:
        """`close` from synchronous code."""
        if self.closed:
            return
        self.this_process()
        thread = self._thread
        if thread is not None:
            self._thread = None
            thread.run(self._close_on(thread.loop))
            thread.stop()
        self.closed = True
        for owner, pool in list(self._pools.items()):
            _terminate(owner, pool)
        self._pools = weakref.WeakKeyDictionary()

    async def _close_on(self, loop: asyncio.AbstractEventLoop) -> None:
        self.this_process()
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()


def _copy_error(exc: BaseException) -> BaseException:
    """A failure of a shared batch, as one exception object per waiting put."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:
        return exc
    copy.__cause__ = exc.__cause__ or exc
    return copy


class CallBatcher:
    """Calls waiting on one event loop, sent together: whenever a flush may start (fewer than
    `max_flushing` in flight), every call queued since the last one (up to `max_batch`) goes
    in one call of `sql`, whose
    parameters are the queued calls' arguments as arrays (one array per argument) and whose
    answer is one status per call. `tokencapture.put_batch` and `tokencapture.stage_batch`."""

    __slots__ = (
        "client",
        "flushing",
        "loop",
        "max_batch",
        "max_flushing",
        "pending",
        "scheduled",
        "sql",
    )

    def __init__(
        self,
        client: Client,
        loop: asyncio.AbstractEventLoop,
        max_batch: int,
        sql: str,
        max_flushing: int | None = None,
    ) -> None:
        self.client = client
        self.loop = loop
        self.max_batch = max_batch
        self.sql = sql
        # Calls in flight at once (at most the pool's connections): fewer, larger batches
        # cost the server less per call; what waits meanwhile joins the next batch.
        self.max_flushing = min(max_flushing or client.pool_size, client.pool_size)
        self.pending: list[tuple[tuple[Any, ...], asyncio.Future[int]]] = []
        self.flushing = 0
        self.scheduled = False

    def submit(self, args: tuple[Any, ...]) -> asyncio.Future[int]:
        future: asyncio.Future[int] = self.loop.create_future()
        self.pending.append((args, future))
        self._schedule()
        return future

    def _schedule(self) -> None:
        if not self.scheduled and self.flushing < self.max_flushing:
            self.scheduled = True
            self.loop.call_soon(self._start)

    def _start(self) -> None:
        self.scheduled = False
        while self.pending and self.flushing < self.max_flushing:
            batch = self.pending[: self.max_batch]
            del self.pending[: self.max_batch]
            self.flushing += 1
            self.loop.create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[int]]]) -> None:
        try:
            columns = [list(column) for column in zip(*(args for args, _ in batch), strict=True)]
            statuses = await self.client.fetch("val", self.sql, *columns, sized=True)
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(_copy_error(exc))
            if not isinstance(exc, Exception):
                raise
        else:
            for (_, future), status in zip(batch, statuses, strict=True):
                if not future.done():  # the awaiting task was cancelled; the call stands
                    future.set_result(status)
        finally:
            self.flushing -= 1
            if self.pending:
                self._schedule()


class _Waiter:
    """One stage waiting in a `GroupCommit`: its arguments, its answer, and the lock its thread
    sleeps on (held from birth; released once per signal: answered, or asked to lead)."""

    __slots__ = ("answered", "args", "error", "lead", "signalled", "status", "wake")

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args
        self.wake = threading.Lock()
        self.wake.acquire()
        self.status = 0
        self.error: BaseException | None = None
        self.answered = False
        self.lead = False
        self.signalled = False


class GroupCommit:
    """Synchronous calls batched by the calling threads themselves (a leader-thread group
    commit), for `PostgresStagingStore.stage`.

    A caller queues its arguments; while fewer than `max_leaders` batches are in flight it
    becomes a leader: it takes every queued call (up to `max_batch`), sends them as one call of
    `sql` (arrays, one status per call: `tokencapture.stage_batch`) on a private event loop it
    runs in its own thread (each leader holds one such loop and its pool; a loop is only ever
    run by one thread at a time), answers and wakes the callers of its batch, and hands the
    lead to the first caller still queued, if any. The others sleep on their own lock. So a
    stage costs no hop to a loop thread and back (measured at ~80 us per stage on the shared
    2-core machine with the loop-thread `CallBatcher`), and every stage still returns only
    after the commit of its batch answered."""

    def __init__(self, client: Client, sql: str, max_batch: int, max_leaders: int) -> None:
        self.client = client
        self.sql = sql
        self.max_batch = max_batch
        self.max_leaders = min(max_leaders, client.pool_size)
        self._lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self._idle: list[asyncio.AbstractEventLoop] = []
        self._leaders = 0
        self._closed = False
        self._owner = ProcessOwner()
        renew_after_fork(self, "_lock")

    def _this_process(self) -> None:
        """In a forked child, on its first call: start with no queue, no leader and no loop.
        The parent's waiters (their threads are not here) and loops (sharing the parent's
        epoll instances, with the parent's connections) are leaked, never run or closed."""
        self._owner.start_over_in_child(self._lock, self._start_over)

    def _start_over(self) -> None:
        leak(self._queue, self._idle)
        self._queue, self._idle, self._leaders = [], [], 0

    def stage(self, args: tuple[Any, ...]) -> int:
        """The server's status of one call (or its failure raised), once its batch committed."""
        waiter = _Waiter(args)
        self._this_process()  # before anything of the parent's is touched
        with self._lock:
            if self._closed:
                raise RuntimeError("the store is closed")
            self._queue.append(waiter)
            lead = self._leaders < self.max_leaders
            if lead:
                self._leaders += 1
        while True:
            if lead:
                self._lead(waiter)
            if waiter.answered:
                break
            waiter.wake.acquire()
            with self._lock:
                waiter.signalled = False
                lead, waiter.lead = waiter.lead, False
        if waiter.error is not None:
            raise waiter.error
        return waiter.status

    @staticmethod
    def _signal(waiter: _Waiter) -> None:
        """Wake `waiter` (under the lock; at most one pending wake per waiter)."""
        if not waiter.signalled:
            waiter.signalled = True
            waiter.wake.release()

    def _lead(self, me: _Waiter) -> None:
        """Send one batch as its leader, answer it, and pass the lead on (or give it up)."""
        with self._lock:
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
            loop = self._idle.pop() if self._idle else None
        if loop is None:
            loop = asyncio.new_event_loop()
        statuses: list[int] = []
        failure: BaseException | None = None
        try:
            if batch:
                columns = [list(column) for column in zip(*(w.args for w in batch), strict=True)]
                statuses = loop.run_until_complete(
                    self.client.fetch("val", self.sql, *columns, sized=True)
                )
        except BaseException as exc:
            failure = exc
        with self._lock:
            for index, waiter in enumerate(batch):
                if failure is None:
                    waiter.status = statuses[index]
                else:
                    waiter.error = _copy_error(failure)
                waiter.answered = True
                if waiter is not me:
                    self._signal(waiter)
            if self._closed:
                loop.close()
            else:
                self._idle.append(loop)
            successor = next((w for w in self._queue if not w.lead), None)
            if successor is None:
                self._leaders -= 1
            else:
                successor.lead = True
                self._signal(successor)
        if failure is not None and not isinstance(failure, Exception):
            raise failure

    def close(self, *, graceful: bool = True) -> None:
        """Close the idle loops (their connections first when `graceful` and no loop runs in
        this thread); a loop in use is closed by its leader when its batch is done."""
        self._this_process()  # a child closes its own loops, never the parent's
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for loop in idle:
            if graceful and asyncio.events._get_running_loop() is None:
                # What fails to close here, the client's close terminates.
                with contextlib.suppress(Exception):
                    loop.run_until_complete(self.client._close_on(loop))
            loop.close()
