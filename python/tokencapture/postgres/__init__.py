"""The PostgreSQL backend: the token capture store, its lineage resolver, the capture ledger
and the staging store.

Install the driver with `pip install tokencapture[postgres]` (asyncpg). Every operation is one
call of a server-side function in the `tokencapture` schema (python/tokencapture/postgres/sql),
which `tokencapture db init DSN` installs and upgrades, or the store on first use when
`install_schema=True`. On a Citus coordinator `db init` distributes the schema by rollout id
(docs/citus.md). See docs/postgres.md.
"""

from __future__ import annotations

try:
    import asyncpg  # type: ignore[import-untyped, unused-ignore]  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "the PostgreSQL backend needs the asyncpg driver: pip install tokencapture[postgres]"
    ) from exc

from tokencapture.postgres._citus import PostgresCitusError
from tokencapture.postgres._client import (
    PostgresDurabilityError,
    PostgresSchemaError,
    PostgresUnavailableError,
    describe_distribution_sync,
    install_schema_sync,
)
from tokencapture.postgres._schema import SCHEMA_VERSION, install_schema
from tokencapture.postgres.ledger import PostgresCaptureLedger
from tokencapture.postgres.lineage import PostgresLineageStore
from tokencapture.postgres.staging import PostgresStagingStore
from tokencapture.postgres.store import PostgresTokenCaptureStore

__all__ = [
    "SCHEMA_VERSION",
    "PostgresCaptureLedger",
    "PostgresCitusError",
    "PostgresDurabilityError",
    "PostgresLineageStore",
    "PostgresSchemaError",
    "PostgresStagingStore",
    "PostgresTokenCaptureStore",
    "PostgresUnavailableError",
    "describe_distribution_sync",
    "install_schema",
    "install_schema_sync",
]
