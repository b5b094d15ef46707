"""The session's Citus cluster (a coordinator and two workers, tests/pg_server.py) for the
distributed PostgreSQL tests.

Import the fixtures into a test module (`from tests.citus_fixture import citus_cluster,
citus_db, citus_dsn`). With `TOKENCAPTURE_REQUIRE_CITUS=1` (set by scripts/test.sh) or in CI a
cluster that cannot start fails the tests; elsewhere they are skipped with the reason.

Setting up Citus in a database takes seconds (the extension on every node, the nodes
registered, the schema distributed over every shard), so the session shares one database:
`citus_dsn` gives each test that database with every table emptied.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from tests.pg_server import CitusCluster, PgServerUnavailable

__all__ = [
    "TABLES",
    "citus_cluster",
    "citus_db",
    "citus_dsn",
    "fresh_citus_database",
    "require_citus",
]

# Every table of the schema (emptied between tests).
TABLES = (
    "tokencapture.rollouts",
    "tokencapture.entries",
    "tokencapture.intents",
    "tokencapture.incomplete_marks",
    "tokencapture.ledger_rollouts",
    "tokencapture.ledger_rows",
    "tokencapture.staging_rollouts",
    "tokencapture.staged_calls",
)


def require_citus() -> bool:
    """Whether a cluster that cannot start must fail the run (CI) rather than skip."""
    return (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("TOKENCAPTURE_REQUIRE_CITUS") == "1"
    )


def _unavailable(reason: str) -> None:
    if require_citus():
        pytest.fail(f"a Citus cluster is required here but could not start: {reason}")
    pytest.skip(f"Citus unavailable: {reason}")


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[CitusCluster]:
    """A coordinator and two workers for the whole session (every node killed at the end)."""
    try:
        cluster = CitusCluster(workers=2)
    except (PgServerUnavailable, OSError) as exc:
        _unavailable(str(exc))
        raise  # unreachable
    try:
        cluster.start()
    except (PgServerUnavailable, OSError) as exc:
        cluster.cleanup()
        _unavailable(str(exc))
    try:
        yield cluster
    finally:
        cluster.cleanup()


def fresh_citus_database(cluster: CitusCluster) -> tuple[str, str]:
    """A new Citus database on every node of `cluster`, nothing installed: (name, DSN)."""
    for node in cluster.nodes:
        if not node.running:
            node.start()
    name = f"c_{uuid.uuid4().hex[:12]}"
    return name, cluster.create_database(name)


@pytest.fixture(scope="session")
def citus_db(citus_cluster: CitusCluster) -> tuple[str, str]:
    """The session's Citus database with the schema installed by `tokencapture db init`
    (distributed): (name, coordinator DSN)."""
    from tokencapture.postgres import install_schema_sync

    name, dsn = fresh_citus_database(citus_cluster)
    install_schema_sync(dsn)
    return name, dsn


@pytest.fixture
def citus_dsn(citus_cluster: CitusCluster, citus_db: tuple[str, str]) -> str:
    """The session's distributed database, every table emptied, every node running."""
    for node in citus_cluster.nodes:
        if not node.running:
            node.start()
    name, dsn = citus_db
    citus_cluster.coordinator.psql(f"TRUNCATE {', '.join(TABLES)}", name)
    return dsn
