"""`PostgresTokenCaptureStore`: the token capture store on PostgreSQL.

The same contract as the file store (`tokencapture.store.TokenCaptureStore`): the same
canonical line bytes and payload digests (made here by the same functions), snapshot ids,
version numbering, incomplete rules, fences, results and exception types. What differs is how
a mutation becomes atomic and durable: one server-side function call per operation
(python/tokencapture/postgres/sql), committed and flushed before it returns, instead of flock,
fdatasync and atomic renames. Arguments are validated in Python, before any round trip.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Sequence
from functools import partial
from time import perf_counter
from typing import Any

from tokencapture import _core
from tokencapture import columnar as _columnar
from tokencapture.entries import as_token_entry, canonical_line, marker_line
from tokencapture.metrics import Metrics
from tokencapture.operations import Operation, Refusals, log_failure
from tokencapture.postgres._client import MAX_ARGUMENT_BYTES, Client, argument_byte_limit
from tokencapture.postgres._decode import decode_columns, decode_entries
from tokencapture.protocols import (
    RolloutRemovalPayload,
    TokenCaptureSnapshot,
)
from tokencapture.records import TokenEntry
from tokencapture.validation import (
    check_age,
    check_call_id,
    check_flag,
    check_snapshot_id,
    validate_rollout_id,
    validate_rollout_ids,
)

__all__ = ["PostgresTokenCaptureStore"]

# Status codes of the server functions (see sql/001_store.sql).
_DONE, _DUPLICATE, _CONFLICT, _FROZEN, _RETIRED = range(5)


def _refusal(status: int, rollout_id: str) -> Exception:
    """The file store's exception for a write the server refused (worded by the core)."""
    if status == _RETIRED:
        return _core.write_refusal("retired", rollout_id)
    if status == _FROZEN:
        return _core.write_refusal("frozen", rollout_id)
    raise AssertionError(f"unexpected status {status} from the server")


class _KeepStored(Exception):
    """`put_unless_stored` found another entry under the call id (its transaction's end)."""


_PUT = "SELECT tokencapture.put($1, $2, $3, $4)"
_PUT_BATCH = "SELECT tokencapture.put_batch($1, $2, $3, $4)"
_BEGIN_CALL = "SELECT tokencapture.begin_call($1, $2)"
_MARK_INCOMPLETE = "SELECT tokencapture.mark_incomplete($1, $2)"
# `mark_incomplete` unless the rollout is frozen or retired, in one statement (one
# transaction): `lock_rollout` (in FROM, so it runs first) locks the rollout's row, and the
# flags it returns are read under that lock, so no freeze can come between the check and the
# mark. 3 frozen, 4 retired: nothing was marked.
_MARK_INCOMPLETE_IF_OPEN = (
    "SELECT CASE WHEN r.retired THEN 4 WHEN r.frozen THEN 3"
    " ELSE tokencapture.mark_incomplete($1, $2) END"
    " FROM tokencapture.lock_rollout($1) AS r"
)
# The rollout's flags and the call ids whose intent has no entry (in flight, or lost); no row
# for a rollout the database has never seen (or deleted).
_CALL_STATE = """
SELECT r.frozen, r.retired, ARRAY(
    SELECT i.model_call_id FROM tokencapture.intents i
    WHERE i.rollout_id = $1 AND NOT EXISTS (
        SELECT 1 FROM tokencapture.entries e
        WHERE e.rollout_id = $1 AND e.model_call_id = i.model_call_id)
    ORDER BY i.model_call_id) AS dangling
FROM tokencapture.rollouts r WHERE r.rollout_id = $1
"""
# One stored entry's line and digest, by its primary key.
_READ_ONE = (
    "SELECT line, digest FROM tokencapture.entries WHERE rollout_id = $1 AND model_call_id = $2"
)
# `sweep_retired`: lock the old fences one rollout at a time, then delete them in the same call
# (`delete`'s removals); see sql/005_staging.sql (one FOR UPDATE over many rollouts is refused
# by Citus).
_SWEEP_RETIRED = "SELECT tokencapture.sweep_retired($1::float8, $2::boolean)"
# The lines come back as rows (see freeze_lines in sql/001_store.sql); a freeze's first row
# is its outcome.
_FREEZE = "SELECT * FROM tokencapture.freeze_lines($1, $2)"
_READ = "SELECT line, digest FROM tokencapture.read_lines($1)"
_IS_INCOMPLETE = "SELECT tokencapture.is_incomplete($1)"
_DROP = "SELECT tokencapture.drop_snapshot($1, $2, $3)"
_RETIRE = "SELECT * FROM tokencapture.retire($1)"
_DELETE = "SELECT * FROM tokencapture.delete($1)"


_PutArgs = tuple[str, bytes, str, bytes]  # rollout id, call id (UTF-8), digest, line

# The most bytes of one entry's line a put sends (`argument_byte_limit`: a quarter on Citus).
_MAX_LINE_BYTES = MAX_ARGUMENT_BYTES
# A batch of puts is one message: a full batch of lines this large stays within half of the
# server's limit, so a line of more is sent alone (its own round trip and commit).
_BATCHED_LINE_BYTES_PER_BATCH = _MAX_LINE_BYTES // 2


def _check_line_size(args: _PutArgs, distributed: bool | None) -> None:
    """Refuse a line the server cannot take in one put (`ValueError`, nothing sent), rather
    than a connection dropped mid-message (over 1 GiB) or a late failure on a Citus worker."""
    limit = argument_byte_limit(distributed, _MAX_LINE_BYTES)
    if len(args[3]) > limit:
        where = (
            "on a Citus cluster PostgreSQL takes at most"
            if distributed
            else "PostgreSQL takes at most"
        )
        raise ValueError(
            f"the entry of call {args[1].decode('utf-8')!r} of rollout {args[0]!r} is "
            f"{len(args[3])} bytes as a line: {where} {limit} bytes in one put"
            + (" (the call reaches the worker as hex text in a statement)" if distributed else "")
        )


def _log_of(rows: Sequence[Any]) -> tuple[list[bytes], list[str]]:
    """The lines (in commit order, as fetched: never joined into one buffer) and the stored
    digests of fetched line rows."""
    return [row["line"] for row in rows], [row["digest"] for row in rows]


class PostgresTokenCaptureStore:
    """Durable, rollout-keyed sink and source for `TokenEntry` records on PostgreSQL.

    Safe to share between tasks and threads; any number of processes on any number of hosts
    may use one database. Options: `pool_size` (connections per event loop, default 10),
    `connect_timeout` and `statement_timeout` (seconds), `synchronous_commit` (sent at connect;
    "off" is refused unless `allow_unflushed_commits=True`, and so is a session that reports
    it off), `install_schema` (install or upgrade the schema on first use) and
    `statement_cache_size` (0 behind a PgBouncer that does not track prepared statements).
    Puts waiting for a connection share one call and one commit (`put_batch_size`, default
    64; `batch_puts=False` sends each put alone).
    """

    def __init__(
        self, dsn: str, *, batch_puts: bool = True, put_batch_size: int = 64, **options: Any
    ) -> None:
        if isinstance(put_batch_size, bool) or not isinstance(put_batch_size, int):
            raise TypeError("put_batch_size must be an int")
        if put_batch_size < 1:
            raise ValueError("put_batch_size must be at least 1")
        self._client = Client(dsn, **options)
        self._metrics = Metrics("postgres")
        self._batch_puts = batch_puts
        self._put_batch_size = put_batch_size

    def __repr__(self) -> str:
        return f"PostgresTokenCaptureStore({self._client.where!r})"

    @property
    def dsn(self) -> str:
        return self._client.dsn

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per-operation counts, failures and latency histograms (see `tokencapture.metrics`)."""
        return self._metrics.snapshot()

    def _operation(self, name: str, rollout_id: object) -> Operation:
        return Operation(self._metrics, name, rollout_id)

    def _refusals(self, name: str, rollout_id: object) -> Refusals:
        return Refusals(self._metrics, name, rollout_id)

    # Writes ------------------------------------------------------------------------------

    @staticmethod
    def _put_args(entry: object) -> _PutArgs:
        # The file store's checks, in its order (the same functions).
        token_entry = as_token_entry(entry)
        line = canonical_line(token_entry)
        rollout_id = validate_rollout_id(token_entry.rollout_id)
        call_id = check_call_id(token_entry.model_call_id).encode("utf-8")
        return rollout_id, call_id, _core.payload_digest(line), line

    def _checked_put_args(self, entry: object, started: float) -> _PutArgs:
        """`_put_args` and the size limit (a quarter on Citus once the client knows it is
        there: `_put_alone` checks again), a refusal counted and logged as a failed put."""
        try:
            args = self._put_args(entry)
            _check_line_size(args, self._client.distributed)
            return args
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise

    def put(self, entry: TokenEntry) -> Coroutine[Any, Any, None]:
        """Store an entry; returns once its commit is flushed. Validated when called."""
        started = perf_counter()
        return self._put(self._checked_put_args(entry, started), entry, started)

    async def _put(self, args: _PutArgs, entry: object, started: float) -> None:
        try:
            # On Citus a put alone is delegated to the worker that owns its rollout; a batch
            # would run on the coordinator and tie every put in it to every worker it spans.
            # (`distributed` is None until the first connection checked the schema: alone.)
            if (
                self._batch_puts
                and self._client.distributed is False
                and len(args[3]) <= _BATCHED_LINE_BYTES_PER_BATCH // self._put_batch_size
            ):
                batcher = self._client.batcher(
                    asyncio.get_running_loop(), _PUT_BATCH, self._put_batch_size, None
                )
                status = await batcher.submit(args)
            else:
                status = await self._client.on_connection(partial(self._put_alone, args))
            self._put_status(status, args)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)

    def put_unless_stored(self, entry: TokenEntry) -> Coroutine[Any, Any, bool]:
        """`put`, unless the rollout already holds another entry under the entry's call id:
        then nothing is written or marked and the awaited result is True (the stored entry
        stands); False once this entry is committed (or was already stored, byte for byte).
        As the file store's `put_unless_stored` (for the capture gateway). One transaction:
        the server's `put`, whose conflict (SPEC: mark the rollout incomplete) is rolled
        back, so the check and the write are one step under the rollout's row lock.
        Validated when called."""
        started = perf_counter()
        return self._put_unless_stored(self._checked_put_args(entry, started), entry, started)

    async def _put_unless_stored(self, args: _PutArgs, entry: object, started: float) -> bool:
        async def put_or_roll_back(connection: Any) -> int:
            _check_line_size(args, self._client.distributed)
            async with connection.transaction():
                # A large line: the transaction's statement_timeout and the client's wait
                # allow for its size (`Client.call`).
                status: int = await self._client.call(connection, kind="val", sql=_PUT, args=args)
                if status == _CONFLICT:
                    raise _KeepStored  # rolls the conflict's mark back: nothing is written
                return status

        try:
            try:
                status = await self._client.on_connection(put_or_roll_back)
            except _KeepStored:
                self._metrics.observe("put", perf_counter() - started)
                return True
            self._put_status(status, args)
        except BaseException as exc:
            self._put_failed(entry, exc, started)
            raise
        self._metrics.observe("put", perf_counter() - started)
        return False

    async def _put_alone(self, args: _PutArgs, connection: Any) -> int:
        """One put sent alone on `connection`; refused first (`ValueError`, nothing sent) when
        its line is too large for a Citus cluster, which the client knows once it has a
        connection (a store's first put is checked against the plain limit when called).
        Its timeout allows for its size (`Client.call`: a line over 1 MiB goes in a
        transaction of its own, not delegated on Citus)."""
        _check_line_size(args, self._client.distributed)
        status: int = await self._client.call(connection, kind="val", sql=_PUT, args=args)
        return status

    def append(self, entry: TokenEntry) -> None:
        """Synchronous `put`."""
        self._client.run_sync(self.put(entry))

    def _put_status(self, status: int, args: _PutArgs) -> None:
        if status in (_DONE, _DUPLICATE):
            return
        rollout_id = args[0]
        if status == _CONFLICT:
            raise _core.write_refusal("conflict", rollout_id, args[1].decode("utf-8"))
        raise _refusal(status, rollout_id)

    def _put_failed(self, entry: object, exc: BaseException, started: float) -> None:
        self._metrics.observe("put", perf_counter() - started, failed=True)
        log_failure("put", getattr(entry, "rollout_id", None), exc)

    def begin_call(self, rollout_id: str, model_call_id: str) -> Coroutine[Any, Any, None]:
        """Durably record that a captured call is about to be dispatched. Validated when called.

        An intent with no entry at freeze masks the rollout.
        """
        with self._refusals("begin_call", rollout_id):
            rollout = validate_rollout_id(rollout_id)
            call_id = check_call_id(model_call_id).encode("utf-8")
        return self._begin_call_async(rollout, call_id)

    async def _begin_call_async(self, rollout_id: str, call_id: bytes) -> None:
        with self._operation("begin_call", rollout_id):
            status = await self._client.fetch("val", _BEGIN_CALL, rollout_id, call_id)
            if status != _DONE:
                raise _refusal(status, rollout_id)

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Synchronous `begin_call` (the reference's name)."""
        self._client.run_sync(self.begin_call(rollout_id, model_call_id))

    def mark_incomplete(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, None]:
        """Durably record that a call was lost (allowed after freeze, refused after retire).

        Not retried after a connection failure: a retry could record a second mark.
        """
        with self._refusals("mark_incomplete", rollout_id):
            rollout = validate_rollout_id(rollout_id)
        return self._mark_incomplete_async(rollout, marker_line(model_call_id))

    async def _mark_incomplete_async(self, rollout_id: str, marker: bytes) -> None:
        with self._operation("mark_incomplete", rollout_id):
            status = await self._client.fetch(
                "val", _MARK_INCOMPLETE, rollout_id, marker, idempotent=False
            )
            if status != _DONE:
                raise _refusal(status, rollout_id)

    def mark_incomplete_if_open(
        self, rollout_id: str, model_call_id: str = ""
    ) -> Coroutine[Any, Any, bool]:
        """`mark_incomplete`, unless the rollout is frozen or retired: then nothing is marked
        and False is returned. Atomic (one statement under the rollout's row lock): for a call
        that failed while its rollout was being frozen, a mark after the freeze would move the
        snapshot's version, and the trainer's `drop` of that snapshot would fail.

        Not retried after a connection failure, as `mark_incomplete`.
        """
        with self._refusals("mark_incomplete", rollout_id):
            rollout = validate_rollout_id(rollout_id)
        return self._mark_incomplete_if_open(rollout, marker_line(model_call_id))

    async def _mark_incomplete_if_open(self, rollout_id: str, marker: bytes) -> bool:
        with self._operation("mark_incomplete", rollout_id):
            status = await self._client.fetch(
                "val", _MARK_INCOMPLETE_IF_OPEN, rollout_id, marker, idempotent=False
            )
        if status not in (_DONE, _FROZEN, _RETIRED):
            raise AssertionError(f"unexpected status {status} from the server")
        return bool(status == _DONE)

    def _mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Synchronous `mark_incomplete` (the reference's name)."""
        self._client.run_sync(self.mark_incomplete(rollout_id, model_call_id))

    # Reads and lifecycle -----------------------------------------------------------------

    def _where(self, rollout_id: str) -> str:
        return f"rollout {rollout_id!r} in PostgreSQL at {self._client.where}"

    def _entries(
        self, rollout_id: str, log: list[bytes], digests: list[str]
    ) -> tuple[TokenEntry, ...]:
        """Entries from a fetched log (checked against the stored digests, decoded natively)."""
        return decode_entries(log, digests, self._where(rollout_id))

    def freeze(self, rollout_id: str) -> Coroutine[Any, Any, TokenCaptureSnapshot]:
        """Freeze one rollout (the first freeze mints the snapshot id) and return its snapshot."""
        with self._refusals("freeze", rollout_id):
            rollout = validate_rollout_id(rollout_id)
        return self._freeze(rollout)

    async def _freeze_rows(self, rollout_id: str) -> tuple[Any, list[Any]]:
        """Freeze: the outcome (status, incomplete, snapshot id, version) and the line rows;
        refused when the rollout is retired."""
        outcome, *lines = await self._client.fetch("rows", _FREEZE, rollout_id, uuid.uuid4().hex)
        if outcome["status"] != _DONE:
            raise _refusal(outcome["status"], rollout_id)
        return outcome, lines

    async def _freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        with self._operation("freeze", rollout_id):
            row, lines = await self._freeze_rows(rollout_id)
            entries = self._entries(rollout_id, *_log_of(lines))
            return TokenCaptureSnapshot(
                rollout_id, entries, row["incomplete"], row["snapshot_id"], row["version"]
            )

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Synchronous `freeze`."""
        return self._client.run_sync(self.freeze(rollout_id))

    def read_entries_async(self, rollout_id: str) -> Coroutine[Any, Any, list[TokenEntry]]:
        """`read_entries` for the event loop; the id is checked when this is called."""
        return self._read_entries(validate_rollout_id(rollout_id))

    async def _read_entries(self, rollout_id: str) -> list[TokenEntry]:
        rows = await self._client.fetch("rows", _READ, rollout_id)
        return list(self._entries(rollout_id, *_log_of(rows)))

    def read_entries(self, rollout_id: str) -> list[TokenEntry]:
        """The stored entries (nothing is created or changed)."""
        validate_rollout_id(rollout_id)
        return self._client.run_sync(self.read_entries_async(rollout_id))

    def read_entry_async(
        self, rollout_id: str, model_call_id: str
    ) -> Coroutine[Any, Any, TokenEntry | None]:
        """The stored entry of one call, or None (one primary-key lookup; nothing is created
        or changed). The ids are checked when this is called."""
        rollout = validate_rollout_id(rollout_id)
        call_id = check_call_id(model_call_id).encode("utf-8")
        return self._read_entry(rollout, call_id)

    async def _read_entry(self, rollout_id: str, call_id: bytes) -> TokenEntry | None:
        row = await self._client.fetch("row", _READ_ONE, rollout_id, call_id)
        if row is None:
            return None
        [entry] = self._entries(rollout_id, [row["line"]], [row["digest"]])
        return entry

    def call_state_async(self, rollout_id: str) -> Coroutine[Any, Any, dict[str, Any] | None]:
        """`{"frozen", "retired", "calls_without_entry"}` (the call ids whose intent has no
        entry: in flight, or lost, and then masking the rollout at freeze), or None for a
        rollout the database has no row of. One read; nothing is created or changed."""
        return self._call_state(validate_rollout_id(rollout_id))

    async def _call_state(self, rollout_id: str) -> dict[str, Any] | None:
        row = await self._client.fetch("row", _CALL_STATE, rollout_id)
        if row is None:
            return None
        return {
            "frozen": row["frozen"],
            "retired": row["retired"],
            "calls_without_entry": [
                bytes(call).decode("utf-8", "replace") for call in row["dangling"]
            ],
        }

    def is_incomplete_async(self, rollout_id: str) -> Coroutine[Any, Any, bool]:
        """`is_incomplete` for the event loop; the id is checked when this is called."""
        return self._is_incomplete(validate_rollout_id(rollout_id))

    async def _is_incomplete(self, rollout_id: str) -> bool:
        return bool(await self._client.fetch("val", _IS_INCOMPLETE, rollout_id))

    def is_incomplete(self, rollout_id: str) -> bool:
        """The stored flag: a call in flight is not a hole until freeze judges it."""
        validate_rollout_id(rollout_id)
        return self._client.run_sync(self.is_incomplete_async(rollout_id))

    # Columnar reads (tokencapture.columnar) -----------------------------------------------

    def freeze_columns(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> Coroutine[Any, Any, _columnar.ColumnarSnapshot]:
        """`freeze`, with the entries as Arrow columns instead of `TokenEntry` objects (the same
        round trip, fence, digest checks, incomplete rule, snapshot id and version).
        `shared_prefixes` as for the file store's (`prompt_token_ids` a list view)."""
        with self._refusals("freeze_columns", rollout_id):
            rollout = validate_rollout_id(rollout_id)
            shared = check_flag(shared_prefixes, "shared_prefixes")
        return self._freeze_columns(rollout, shared)

    async def _freeze_columns(
        self, rollout_id: str, shared_prefixes: bool
    ) -> _columnar.ColumnarSnapshot:
        with self._operation("freeze_columns", rollout_id):
            row, lines = await self._freeze_rows(rollout_id)
            entries = decode_columns(
                *_log_of(lines), self._where(rollout_id), shared_prefixes=shared_prefixes
            )
            return _columnar.ColumnarSnapshot(
                rollout_id, entries, row["incomplete"], row["snapshot_id"], row["version"]
            )

    def freeze_columns_now(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> _columnar.ColumnarSnapshot:
        """Synchronous `freeze_columns`."""
        return self._client.run_sync(
            self.freeze_columns(rollout_id, shared_prefixes=shared_prefixes)
        )

    def read_columns_async(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> Coroutine[Any, Any, _columnar.ColumnarEntries]:
        """`read_columns` for the event loop; the arguments are checked when this is called."""
        return self._read_columns(
            validate_rollout_id(rollout_id), check_flag(shared_prefixes, "shared_prefixes")
        )

    async def _read_columns(
        self, rollout_id: str, shared_prefixes: bool
    ) -> _columnar.ColumnarEntries:
        rows = await self._client.fetch("rows", _READ, rollout_id)
        return decode_columns(
            *_log_of(rows), self._where(rollout_id), shared_prefixes=shared_prefixes
        )

    def read_columns(
        self, rollout_id: str, *, shared_prefixes: bool = False
    ) -> _columnar.ColumnarEntries:
        """`read_entries` as Arrow columns (nothing is created or changed)."""
        validate_rollout_id(rollout_id)
        return self._client.run_sync(
            self.read_columns_async(rollout_id, shared_prefixes=shared_prefixes)
        )

    def drop(self, rollout_id: str, snapshot_id: str, version: int) -> Coroutine[Any, Any, bool]:
        """Delete the consumed snapshot's records and keep its fence, if nothing changed.

        The rollout id and the snapshot id's type are checked when this is called.
        """
        with self._refusals("drop", rollout_id):
            validate_rollout_id(rollout_id)
            check_snapshot_id(snapshot_id)
        return self._drop_async(rollout_id, snapshot_id, version)

    async def _drop_async(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        with self._operation("drop", rollout_id):
            if (
                isinstance(version, bool)
                or not isinstance(version, int)
                or not 0 <= version < 2**63  # a bigint; the file store's u64 never exceeds it
                or "\0" in snapshot_id  # minted ids are uuid hex; text cannot hold NUL
            ):
                return False  # no stored version or snapshot id can equal it (still a drop)
            return bool(await self._client.fetch("val", _DROP, rollout_id, snapshot_id, version))

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Synchronous `drop` (the reference's name)."""
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**64:
            with self._operation("drop", rollout_id):  # counted, as the file store counts it
                return False  # no stored version can equal it (checked first, as files do)
        return self._client.run_sync(self.drop(rollout_id, snapshot_id, version))

    def retire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Fence every rollout and remove its records, whatever its state, in one transaction."""
        with self._refusals("retire", rollout_ids):
            ids = validate_rollout_ids(rollout_ids)
        return self._batch("retire", _RETIRE, ids)

    def delete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """Remove records and fences in one transaction, so a reused id starts empty."""
        with self._refusals("delete", rollout_ids):
            ids = validate_rollout_ids(rollout_ids)
        return self._batch("delete", _DELETE, ids)

    async def _batch(self, name: str, sql: str, ids: list[str]) -> RolloutRemovalPayload:
        with self._operation(name, ids):  # an empty batch too, as the file store counts it
            if not ids:
                return {"removed": [], "absent": []}
            row = await self._client.fetch("row", sql, ids)
        return {"removed": list(row["removed"]), "absent": list(row["absent"])}

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return self._client.run_sync(self.retire(rollout_ids))

    def sweep_retired(self, older_than_seconds: float) -> int:
        """NeMo Gym 0.7.0's `sweep_retired` (synchronous, as NeMo Gym's is): remove the fences of
        rollouts retired at least `older_than_seconds` ago and return how many were removed.
        See `sweep_retired_ids`."""
        return len(self.sweep_retired_ids(older_than_seconds))

    def sweep_retired_ids(self, older_than_seconds: float, *, dry_run: bool = False) -> list[str]:
        """The rollouts `sweep_retired` removes, sorted (with `dry_run`, only listed).

        A rollout is swept when it is retired and was retired at least `older_than_seconds`
        ago by the server's clock (`now() - retired_at >= older_than_seconds`; a negative age
        sweeps every retired rollout). Each candidate is locked (one rollout at a time, so it
        runs on Citus too), checked again and deleted in one transaction, so a rollout deleted
        and reused meanwhile is never touched. The argument is
        checked as the file store checks it (`TypeError` / `ValueError`)."""
        with self._refusals("sweep_retired", None):
            age = check_age(older_than_seconds)
        return self._client.run_sync(self._sweep(age, dry_run))

    async def _sweep(self, age: float, dry_run: bool) -> list[str]:
        with self._operation("sweep_retired", None):
            ids = await self._client.fetch("val", _SWEEP_RETIRED, age, dry_run)
        return list(ids)

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        return self._client.run_sync(self.delete(rollout_ids))

    async def close(self) -> None:
        """Close this store's connections (idempotent)."""
        await self._client.close()

    def close_sync(self) -> None:
        self._client.close_sync()
