"""The schema on a Citus cluster: every table distributed by rollout id, co-located, so one
rollout's rows live on one worker, and the per-operation functions delegated to that worker.

What is distributed how is data, here, in one place:

- `DISTRIBUTED_TABLES`: (table, distribution column); all co-located with the first.
- `REFERENCE_TABLES`: copied whole to every node (the installer's own bookkeeping).
- `DELEGATED_FUNCTIONS`: (function, distribution argument): a top-level `SELECT f(...)` or
  `SELECT ... FROM f(...)` outside a transaction block runs on the worker that owns the rollout
  its argument names, in one round trip from the coordinator.
- Every other function of the schema is propagated to every node (create_distributed_function
  without an argument): the delegated functions call them on the worker.

A table of the schema that is in neither table list makes the installer fail (a new table must
say how it is distributed). `distribute` runs after every migration file and once more at the
end of every install: it only acts on what Citus's catalog does not yet show, so it upgrades a
distributed schema, and distributes a schema that was installed before Citus was.

Some functions need a different body on Citus (see docs/citus.md): SQL-language functions with
parameters that read distributed tables cannot be planned by Citus and are PL/pgSQL there, and
a batch locks its rollouts one at a time (`FOR UPDATE` on a distributed table needs equality on
the distribution column). Those bodies are in `sql/citus/NNN_*.sql`, applied on a Citus
deployment right after the plain file of the same number; a plain PostgreSQL server keeps the
plain bodies.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

__all__ = [
    "COLOCATION_TABLE",
    "DELEGATED_FUNCTIONS",
    "DISTRIBUTED_TABLES",
    "REFERENCE_TABLES",
    "PostgresCitusError",
    "citus_companion",
    "describe",
    "distribute",
    "fully_distributed",
    "has_citus",
    "is_distributed",
]


class PostgresCitusError(RuntimeError):
    """The database is not set up for Citus as asked (no extension, or a table of the schema
    that has no distribution)."""


# (table, distribution column), schema `tokencapture`. Every table keyed by rollout id.
DISTRIBUTED_TABLES: tuple[tuple[str, str], ...] = (
    ("rollouts", "rollout_id"),
    ("entries", "rollout_id"),
    ("intents", "rollout_id"),
    ("incomplete_marks", "rollout_id"),
    ("ledger_rollouts", "rollout_id"),
    ("ledger_rows", "rollout_id"),
    ("staging_rollouts", "rollout_id"),
    ("staged_calls", "rollout_id"),
)
REFERENCE_TABLES: tuple[str, ...] = ("schema_migrations",)
COLOCATION_TABLE = "tokencapture." + DISTRIBUTED_TABLES[0][0]

# (function, distribution argument): the per-operation functions, each of one rollout.
DELEGATED_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("put", "p_rollout"),
    ("begin_call", "p_rollout"),
    ("mark_incomplete", "p_rollout"),
    ("freeze_lines", "p_rollout"),
    ("read_lines", "p_rollout"),
    ("is_incomplete", "p_rollout"),
    ("drop_snapshot", "p_rollout"),
    ("export_rollout", "p_rollout"),
    ("import_rollout", "p_rollout"),
    ("lineage_tail", "p_rollout"),
    ("lineage_lines", "p_rollout"),
    ("record_ledger_row", "p_rollout"),
    ("ledger_manifest", "p_rollout"),
    ("ledger_candidate", "p_rollout"),
    ("stage_call", "p_rollout"),
)


async def has_citus(connection: Any) -> bool:
    """Whether the Citus extension is installed in the connection's database."""
    return bool(
        await connection.fetchval(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')"
        )
    )


async def is_distributed(connection: Any) -> bool:
    """Whether the schema in the connection's database is distributed with Citus."""
    if not await has_citus(connection):
        return False
    return bool(
        await connection.fetchval(
            "SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = $1::regclass)",
            COLOCATION_TABLE,
        )
    )


def citus_companion(name: str) -> str | None:
    """The Citus bodies that go with schema file `name` (`sql/citus/<name>`), if any."""
    item = resources.files("tokencapture.postgres").joinpath("sql", "citus", name)
    return item.read_text(encoding="utf-8") if item.is_file() else None


# One step of `distribute`: (statement, its arguments, what it does).
_Step = tuple[str, tuple[str, ...], str]


async def _undistributed_tables(connection: Any) -> list[_Step]:
    """The tables `distribute` would distribute, read from the catalog only, in order;
    `PostgresCitusError` for a table of the schema in neither list."""
    steps: list[_Step] = []
    distributed = {
        row["name"]: row["method"]
        for row in await connection.fetch(
            "SELECT c.relname AS name, p.partmethod::text AS method FROM pg_dist_partition p "
            "JOIN pg_class c ON c.oid = p.logicalrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'tokencapture'"
        )
    }
    tables = [
        row["relname"]
        for row in await connection.fetch(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'tokencapture' AND c.relkind IN ('r', 'p') ORDER BY c.relname"
        )
    ]
    columns = dict(DISTRIBUTED_TABLES)
    unknown = [t for t in tables if t not in columns and t not in REFERENCE_TABLES]
    if unknown:
        raise PostgresCitusError(
            f"table(s) {', '.join('tokencapture.' + t for t in unknown)} have no distribution: "
            "list them in DISTRIBUTED_TABLES or REFERENCE_TABLES (tokencapture/postgres/_citus.py)"
        )
    for table in REFERENCE_TABLES:
        if table in tables and table not in distributed:
            steps.append(
                (
                    "SELECT create_reference_table($1::regclass)",
                    (f"tokencapture.{table}",),
                    f"reference table tokencapture.{table}",
                )
            )
    for table, column in DISTRIBUTED_TABLES:
        if table in tables and table not in distributed:
            anchor = COLOCATION_TABLE if f"tokencapture.{table}" != COLOCATION_TABLE else "none"
            steps.append(
                (
                    "SELECT create_distributed_table($1::regclass, $2, colocate_with => $3)",
                    (f"tokencapture.{table}", column, anchor),
                    f"distributed tokencapture.{table} by {column}",
                )
            )
    return steps


async def _undistributed_functions(connection: Any) -> list[_Step]:
    """The functions `distribute` would propagate or delegate, read from the catalog only
    (what pg_dist_object records: distributed at all, and by which argument)."""
    steps: list[_Step] = []
    functions = await connection.fetch(
        "SELECT p.oid::regprocedure::text AS signature, p.proname AS name, "
        "d.objid IS NOT NULL AS propagated, d.distribution_argument_index AS arg "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "LEFT JOIN pg_dist_object d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid "
        "WHERE n.nspname = 'tokencapture' ORDER BY p.proname"
    )
    delegated = dict(DELEGATED_FUNCTIONS)
    for function in functions:
        argument = delegated.get(function["name"])
        if argument is None:
            if not function["propagated"]:
                steps.append(
                    (
                        "SELECT create_distributed_function($1::regprocedure)",
                        (function["signature"],),
                        f"propagated {function['signature']}",
                    )
                )
        elif function["arg"] is None:
            steps.append(
                (
                    "SELECT create_distributed_function($1::regprocedure, $2, colocate_with => $3)",
                    (function["signature"], argument, COLOCATION_TABLE),
                    f"delegated {function['signature']} by {argument}",
                )
            )
    return steps


async def fully_distributed(connection: Any) -> bool:
    """Whether the schema is distributed and `distribute` has nothing left to do (catalog
    reads only: no DDL, which Citus would propagate to every worker)."""
    if not await is_distributed(connection):
        return False
    try:
        return not await _undistributed_tables(connection) and not (
            await _undistributed_functions(connection)
        )
    except PostgresCitusError:
        return False  # the installer says so


async def distribute(connection: Any) -> list[str]:
    """Distribute what the catalog shows is not yet distributed; what it did (one line each).
    The functions are read once the tables are distributed (distributing a table may
    propagate what it depends on)."""
    done: list[str] = []
    for steps in (_undistributed_tables, _undistributed_functions):
        for statement, arguments, what in await steps(connection):
            await connection.execute(statement, *arguments)
            done.append(what)
    return done


async def describe(connection: Any) -> dict[str, Any]:
    """How the schema is distributed, from Citus's catalog: `{"citus": bool, "tables":
    {table: "distributed by <column>" | "reference"}, "delegated": {function: argument}}`."""
    if not await has_citus(connection):
        return {"citus": False, "tables": {}, "delegated": {}}
    tables = {
        row["name"]: ("reference" if row["method"] == "n" else f"distributed by {row['column']}")
        for row in await connection.fetch(
            "SELECT c.relname AS name, p.partmethod::text AS method, "
            "column_to_column_name(p.logicalrelid, p.partkey) AS column "
            "FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'tokencapture' "
            "ORDER BY c.relname"
        )
    }
    delegated = {
        row["name"]: row["argument"]
        for row in await connection.fetch(
            "SELECT p.proname AS name, p.proargnames[d.distribution_argument_index + 1] "
            "AS argument FROM pg_dist_object d JOIN pg_proc p ON p.oid = d.objid "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE d.classid = 'pg_proc'::regclass AND n.nspname = 'tokencapture' "
            "AND d.distribution_argument_index IS NOT NULL ORDER BY p.proname"
        )
    }
    return {"citus": True, "tables": tables, "delegated": delegated}
