"""The versioned schema: python/tokencapture/postgres/sql/NNN_*.sql, applied in order, once.

`tokencapture.schema_migrations` records each applied version. An install takes a transaction
advisory lock, so concurrent installers (many workers starting at once) apply each file once.
On a Citus coordinator (the extension installed in the database) every file is followed by its
Citus bodies and the schema is distributed (tokencapture/postgres/_citus.py).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from tokencapture.postgres._citus import (
    PostgresCitusError,
    citus_companion,
    distribute,
    fully_distributed,
    has_citus,
    is_distributed,
)

__all__ = [
    "SCHEMA_VERSION",
    "install_schema",
    "migrations",
    "schema_version",
]

# pg_advisory_xact_lock key of the installer ("tokencap" in ASCII).
_INSTALL_LOCK = 0x746F6B656E636170

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS tokencapture;
CREATE TABLE IF NOT EXISTS tokencapture.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


def migrations() -> list[tuple[int, str, str]]:
    """`(version, file name, SQL)` of every schema file, in version order."""
    found = []
    for item in resources.files("tokencapture.postgres").joinpath("sql").iterdir():
        match = re.fullmatch(r"(\d{3})_[a-z0-9_]+\.sql", item.name)
        if match:
            found.append((int(match.group(1)), item.name, item.read_text(encoding="utf-8")))
    return sorted(found)


SCHEMA_VERSION = migrations()[-1][0]


async def schema_version(connection: Any) -> int:
    """The newest applied version (0 when the schema is not installed)."""
    exists = await connection.fetchval("SELECT to_regclass('tokencapture.schema_migrations')")
    if exists is None:
        return 0
    value = await connection.fetchval("SELECT max(version) FROM tokencapture.schema_migrations")
    return int(value or 0)


async def _installed_as_asked(connection: Any, *, citus: bool | None, upto: int | None) -> bool:
    """Whether `install_schema` has nothing to do (reads only): the schema is at the version
    wanted (or newer), and distributed, with nothing left for `distribute` to do, if `citus`
    asks for it (None: when the database has the Citus extension)."""
    wanted = SCHEMA_VERSION if upto is None else min(upto, SCHEMA_VERSION)
    if await schema_version(connection) < wanted:
        return False
    if citus is False:
        return True
    if not await has_citus(connection):
        return citus is None  # --citus without the extension: the installer says so
    return await fully_distributed(connection)


async def install_schema(
    connection: Any, *, citus: bool | None = None, upto: int | None = None
) -> list[str]:
    """Install or upgrade the schema on an open asyncpg connection; the files applied.

    `citus`: None distributes the schema when the database has the Citus extension; True
    requires it (`PostgresCitusError` otherwise); False never distributes. `upto` stops at that
    version (tests of upgrades).

    A schema already installed as asked (at the version wanted, distributed when it is to be)
    is found with reads alone, before any lock or DDL: the installer's DDL (even a `CREATE
    SCHEMA IF NOT EXISTS`) is propagated by Citus to every worker, so it fails while any one
    worker is down, and a client constructed with `install_schema=True` could then write
    nowhere. Anything else (to install, upgrade or distribute) takes the installer's lock and
    reads again under it."""
    if await _installed_as_asked(connection, citus=citus, upto=upto):
        return []
    applied: list[str] = []
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", _INSTALL_LOCK)
        found = await has_citus(connection)
        if citus and not found:
            raise PostgresCitusError(
                "--citus: the database has no Citus extension (CREATE EXTENSION citus on the "
                "coordinator and every worker, and register the workers, first; see "
                "docs/citus.md)"
            )
        distributed = found if citus is None else citus
        if distributed:
            # New objects reach the workers when distribute() distributes them, in dependency
            # order (tables first), not at CREATE time while the tables are still local.
            await connection.execute("SET LOCAL citus.create_object_propagation = 'deferred'")
            # Distributing functions in the transaction that distributed tables needs one
            # connection per node throughout.
            await connection.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
        await connection.execute(_BOOTSTRAP)
        current = await schema_version(connection)
        if distributed and current and not await is_distributed(connection):
            # Installed before Citus was: the Citus bodies of the applied versions first.
            for version, name, _ in migrations():
                companion = citus_companion(name) if version <= current else None
                if companion is not None:
                    await connection.execute(companion)
        for version, name, sql in migrations():
            if version <= current or (upto is not None and version > upto):
                continue
            await connection.execute(sql)
            companion = citus_companion(name) if distributed else None
            if companion is not None:
                await connection.execute(companion)
            await connection.execute(
                "INSERT INTO tokencapture.schema_migrations (version, name) VALUES ($1, $2)",
                version,
                name,
            )
            if distributed:
                await distribute(connection)
            applied.append(name)
        if distributed:
            await distribute(connection)  # a schema installed before Citus was
    return applied
