"""The session's PostgreSQL server for the PostgreSQL backend's tests.

Import the fixtures into a test module (`from tests.postgres_fixture import pg_server, pg_dsn`;
`dsn` and `store` need those two imported beside them).
In CI (`CI=true`) or with `TOKENCAPTURE_REQUIRE_POSTGRES=1` (set by scripts/test.sh) a server that
cannot start fails the tests; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from tests.pg_server import PgServer, PgServerUnavailable

if TYPE_CHECKING:
    from tokencapture.postgres import PostgresTokenCaptureStore

__all__ = [
    "dsn",
    "execute",
    "fetch",
    "pg_dsn",
    "pg_server",
    "require_postgres",
    "store",
    "unavailable",
]


def require_postgres() -> bool:
    """Whether a missing server must fail the run (CI) rather than skip."""
    return (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("TOKENCAPTURE_REQUIRE_POSTGRES") == "1"
    )


try:
    import asyncpg  # noqa: F401
except ImportError:
    # The modules that import these fixtures import the backend too: skip them whole here
    # (in CI the missing driver fails them at import instead).
    if not require_postgres():
        pytest.skip(
            "the asyncpg driver is not installed (pip install tokencapture[postgres])",
            allow_module_level=True,
        )


def unavailable(reason: str) -> None:
    """Fail (CI) or skip (elsewhere) a test that needs a server it cannot have."""
    if require_postgres():
        pytest.fail(f"PostgreSQL is required here but unavailable: {reason}")
    pytest.skip(f"PostgreSQL unavailable: {reason}")


def _started_server() -> Iterator[PgServer]:
    """A new server, started, and removed once the consumer is done with it (a machine
    without PostgreSQL: as `unavailable` says)."""
    try:
        server = PgServer()
    except (PgServerUnavailable, OSError) as exc:
        unavailable(str(exc))
        raise  # unreachable: unavailable raises
    try:
        server.start()
    except (PgServerUnavailable, OSError) as exc:
        server.cleanup()
        unavailable(str(exc))
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A throwaway server for the whole session (stopped and removed at the end)."""
    yield from _started_server()


@pytest.fixture
def own_server() -> Iterator[PgServer]:
    """A server of the test's own, which the test may stop, kill, restart or give another
    authentication (removed at the end)."""
    yield from _started_server()


@pytest.fixture
def pg_dsn(pg_server: PgServer) -> str:
    """The DSN of a fresh database on the session's server (isolates each test's schema)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    _psql(pg_server, f"CREATE DATABASE {name}")
    return pg_server.dsn_for(name)


@pytest.fixture
def dsn(pg_dsn: str) -> str:
    """`pg_dsn` with the schema installed (`tokencapture db init`)."""
    from tokencapture.postgres import install_schema_sync

    install_schema_sync(pg_dsn)
    return pg_dsn


@pytest.fixture
def store(pg_dsn: str) -> Iterator[PostgresTokenCaptureStore]:
    """A store on a fresh database that installs the schema on first use."""
    from tokencapture.postgres import PostgresTokenCaptureStore

    pg = PostgresTokenCaptureStore(pg_dsn, install_schema=True)
    yield pg
    pg.close_sync()


def execute(dsn: str, sql: str, *args: object) -> None:
    """Run one statement on a connection of its own, behind the stores' back (to damage what
    they stored)."""
    fetch(dsn, sql, *args)


def fetch(dsn: str, sql: str, *args: object) -> list[Any]:
    """The rows of one statement, on a connection of its own (to call the schema's functions
    directly)."""
    import asyncpg

    async def run() -> list[Any]:
        connection = await asyncpg.connect(dsn)
        try:
            return list(await connection.fetch(sql, *args))
        finally:
            await connection.close()

    return asyncio.run(run())


def _psql(server: PgServer, sql: str) -> None:
    import subprocess

    if not server.running:
        server.start()
    subprocess.run(
        [str(server.bindir / "psql"), "-qAt", "-v", "ON_ERROR_STOP=1", server.dsn, "-c", sql],
        check=True,
        capture_output=True,
    )
