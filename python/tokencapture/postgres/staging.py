"""`PostgresStagingStore`: NeMo Gym 0.7.0's ``StagingSink`` and ``StagingSource`` on PostgreSQL.

The same contract as `tokencapture.staging.store.FileStagingStore` (the same verification, the
same stored bytes, the same `StageResult` reasons and exceptions); what differs is how a stage
becomes durable: a committed transaction (``synchronous_commit`` on, checked on every session
and, on Citus, on every worker) instead of a group-committed ``fdatasync``. The schema is
``sql/005_staging.sql``.

Threads. ``stage`` is synchronous and is called from many completion threads at once. Each
caller verifies and encodes its record in its own thread (`tokencapture._core.staging_encode`,
the GIL released for the hashing), then joins the store's group commit
(`tokencapture.postgres._client.GroupCommit`): the first caller to find fewer than
``stage_flushes`` (3) batches in flight becomes a leader, takes every queued stage (up to
``stage_batch_size``), sends them in one ``tokencapture.stage_batch`` call (one round trip, one
transaction, one WAL flush, each stage with its own status) on an event loop it runs in its own
thread, wakes their callers and hands the lead to the next queued caller. No stage is handed
to another thread and back. A caller that already runs an event loop in its thread goes
through the client's loop thread instead. On a Citus cluster each stage is its own call,
delegated to the worker that owns its rollout (a batch would run on the coordinator and tie
every stage in it to every worker it spans).

With ``native_group_commit=True`` the same group commit runs in Rust
(`tokencapture._core.PostgresStageGroup`, rust/src/staging/postgres.rs, connection
parameters from `tokencapture.postgres._native`): one native call per stage verifies, encodes,
queues and waits with the GIL released, its leader sending the batch on a native connection.
It serves the stages the Python group commit serves and falls back to it where it cannot
(TLS, Citus, ...: docs/postgres.md).

NeMo Gym constructs it as ``tokencapture:PostgresStagingStore`` with ``{"dsn": ...}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from functools import partial
from typing import Any

import asyncpg  # type: ignore[import-untyped, unused-ignore]

from tokencapture import _core
from tokencapture._core import staging_same_content
from tokencapture.forking import renew_after_fork
from tokencapture.postgres._client import (
    MAX_ARGUMENT_BYTES,
    CallBatcher,
    Client,
    GroupCommit,
    PostgresDurabilityError,
    PostgresUnavailableError,
    _copy_error,
    argument_byte_limit,
)
from tokencapture.postgres._native import native_group
from tokencapture.protocols import (
    RolloutRemovalPayload,
    TokenCaptureConflictError,
    TokenCaptureRetiredError,
)
from tokencapture.staging_attachments import (
    EncodedAttachment,
    StagedAttachment,
    encode_attachments,
)
from tokencapture.staging_errors import StagingKeyError, StagingKeyRetiredError
from tokencapture.staging_rows import (
    ModelsChoice,
    StagingModels,
    attachments_from_blob,
    checked_keys,
    checked_rollout_ids,
    failure_reason,
    records_from_rows,
    snapshots_from_rows,
)

__all__ = ["PostgresStagingStore"]

# Statuses of tokencapture.stage_call (sql/005_staging.sql).
_STORED, _DUPLICATE, _CONFLICT, _RETIRED = 0, 1, 2, 4

_STAGE = "SELECT tokencapture.stage_call($1, $2, $3, $4, $5)"
_STAGE_BATCH = "SELECT tokencapture.stage_batch($1, $2, $3, $4, $5)"
_FETCH_ROWS = (
    "SELECT staging_key, row_bytes FROM tokencapture.staged_calls WHERE staging_key = ANY($1)"
)
_FETCH_ATTACHMENTS = (
    "SELECT attachments FROM tokencapture.staged_calls WHERE staging_key = $1 LIMIT 1"
)
_STORED_CONTENT = (
    "SELECT row_bytes, attachments FROM tokencapture.staged_calls "
    "WHERE rollout_id = $1 AND staging_key = $2"
)
_RETIRED_AMONG = (
    "SELECT rollout_id FROM tokencapture.staging_rollouts WHERE retired AND rollout_id = ANY($1)"
)
_KEYS_ALL = "SELECT staging_key FROM tokencapture.staged_calls"
# A rollout's keys are those in [id || '/', id || '0') (the "C" collation: sql/005_staging.sql).
_KEYS_OF = (
    "SELECT staging_key FROM tokencapture.staged_calls WHERE rollout_id = $1 "
    "AND staging_key >= $1 || '/' AND staging_key < $1 || '0'"
)
_RETIRED_ALL = "SELECT rollout_id FROM tokencapture.staging_rollouts WHERE retired"
_RETIRE = "SELECT * FROM tokencapture.retire_staging($1)"
_DELETE = "SELECT * FROM tokencapture.delete_staging($1)"

# A failed or refused stage answers `StageResult(ok=False)` for any Exception (a record or an
# attachment that cannot be read included); only a BaseException that is not one (a
# KeyboardInterrupt, a cancellation) propagates. PostgresUnavailableError is an OSError, the
# durability and schema refusals RuntimeErrors; asyncpg.PostgresError is any other answer of
# the server.

# The largest key the server's btree indexes take for sure: an index entry holds at most 2704
# bytes (BTMaxItemSize, 8 kB pages), 8 of them the entry's header and 4 the text's length. A
# longer key is refused before it is sent (the server might take it compressed, or fail it).
_MAX_KEY_BYTES = 2692
# The most row and attachments bytes one stage sends (`argument_byte_limit`).
_MAX_STAGE_BYTES = MAX_ARGUMENT_BYTES
# A batch is one message and one transaction: a full batch of stages this large stays within
# half of the server's limit, so a stage of more (its row and attachments) is sent alone (its
# own round trip and commit; at that size the bytes, not the round trip, cost the time).
_BATCHED_BYTES_PER_BATCH = _MAX_STAGE_BYTES // 2

_StageArgs = tuple[str, str, str, bytes, bytes | None]  # rollout, key, content digest, row, blob


def _quoted(text: str) -> str:
    """`text` quoted as the Rust core quotes it in its messages (``{:?}`` of a str), so both
    backends word a refusal alike."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif char == "\0":
            out.append("\\0")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{{{ord(char):x}}}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _refusal(status: int, args: _StageArgs) -> Exception:
    """The exception of a stage the server refused, worded as the file store words it."""
    if status == _RETIRED:
        return TokenCaptureRetiredError(
            f"rollout {_quoted(args[0])} is retired: its staged calls are fenced until it is "
            "deleted"
        )
    if status == _CONFLICT:
        return TokenCaptureConflictError(
            f"staging key {_quoted(args[1])} is already staged with different content"
        )
    raise AssertionError(f"unexpected status {status} from the server")


def _check_status(status: int, args: _StageArgs) -> None:
    if status not in (_STORED, _DUPLICATE):
        raise _refusal(status, args)


def _native_failure(failure: _core.PostgresStageError) -> BaseException:
    """The exception the asyncpg path raises for what failed a native batch."""
    kind, message, sqlstate, detail, hint = failure.args
    if kind == "unavailable":
        return PostgresUnavailableError(message)
    if kind == "durability":
        return PostgresDurabilityError(message)
    if kind == "server":
        fields = {"S": "ERROR", "C": sqlstate, "M": message}
        if detail is not None:
            fields["D"] = detail
        if hint is not None:
            fields["H"] = hint
        error: BaseException = asyncpg.PostgresError.new(fields)
        return error
    return RuntimeError(message)  # "closed": the store is closed


def _same_as_stored(stored: Sequence[Any], args: _StageArgs) -> bool:
    """Whether the row stored under a key whose content digest differs from this stage's still
    carries the same call (`_core.staging_same_content`: the same data in another bytes-like
    type, or an older build's encoding of it, such as its empty blob for ``attachments={}``)."""
    if not stored:
        return False
    row, blob = stored[0]["row_bytes"], stored[0]["attachments"]
    return staging_same_content(bytes(row), bytes(blob or b""), args[3], args[4] or b"")


def _unknown(key: str, retired_rollout: str | None) -> StagingKeyError:
    if retired_rollout is not None:
        return StagingKeyRetiredError(
            f"staging key {_quoted(key)} belongs to retired rollout {_quoted(retired_rollout)}"
        )
    return StagingKeyError(f"staging key {_quoted(key)} is not staged")


def _nbytes(buffers: list[Any]) -> int:
    return sum(memoryview(buffer).nbytes for buffer in buffers)


def stage_byte_limit(distributed: bool | None) -> int:
    """The most row and attachments bytes one stage may send (`distributed`: whether the
    schema is distributed with Citus; None while not known yet): a quarter of the plain limit
    on Citus (`argument_byte_limit`)."""
    return argument_byte_limit(distributed, _MAX_STAGE_BYTES)


def _over_the_limit(distributed: bool | None) -> str:
    """Who refuses more than `stage_byte_limit(distributed)` bytes, for the refusal."""
    limit = stage_byte_limit(distributed)
    if distributed:
        return (
            f"on a Citus cluster PostgreSQL takes at most {limit} bytes of row and attachments "
            "in one stage (the call reaches the worker as hex text in a statement)"
        )
    return f"PostgreSQL takes at most {limit} bytes of row and attachments in one stage"


def _check_attachment_sizes(
    key: str | None, encoded: list[EncodedAttachment] | None, distributed: bool | None = None
) -> int:
    """The attachments' bytes; refused when PostgreSQL (on Citus when `distributed`) cannot
    take them in one stage (before the blob is built)."""
    if not encoded:
        return 0
    sizes = [(name, _nbytes(buffers)) for name, _, _, _, _, buffers in encoded]
    total = sum(size for _, size in sizes)
    if total > stage_byte_limit(distributed):
        name, size = max(sizes, key=lambda item: item[1])
        of_key = f" of staging key {_quoted(key)}" if key is not None else ""
        raise ValueError(
            f"the attachments{of_key} are {total} bytes, the largest {name!r} ({size} bytes): "
            + _over_the_limit(distributed)
        )
    return total


def _check_stage_size(args: _StageArgs, distributed: bool | None) -> None:
    """Refuse an encoded stage of more row and attachments bytes than one stage may send."""
    size = len(args[3]) + (len(args[4]) if args[4] is not None else 0)
    if size > stage_byte_limit(distributed):
        raise ValueError(
            f"staging key {_quoted(args[1])} is {size} bytes of row and attachments: "
            + _over_the_limit(distributed)
        )


def _record_key(record: Any) -> str | None:
    """The staging key `record` claims (None when it does not say): read before the native
    path to send a stage it would refuse anyway through the checks of `_stage_args`."""
    try:
        rollout_id = getattr(record, "rollout_id", None)
        call_id = getattr(record, "model_call_id", None)
    except Exception:
        return None
    if type(rollout_id) is not str or type(call_id) is not str:
        return None
    return f"{rollout_id}/{call_id}"


def _check_key(key: str) -> None:
    """Refuse a key PostgreSQL cannot store or index."""
    if "\0" in key:
        raise ValueError(
            f"staging key {_quoted(key)} holds NUL, which PostgreSQL text cannot store"
        )
    if len(key) <= _MAX_KEY_BYTES // 4:  # at most 4 bytes a character
        return
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > _MAX_KEY_BYTES:
        raise ValueError(
            f"staging key {_quoted(key[:64])}... is {size} bytes: PostgreSQL's btree index "
            f"takes keys (rollout id, '/', call id) of at most {_MAX_KEY_BYTES} bytes"
        )


def _rollout_list(rollout_ids: Sequence[str]) -> list[str]:
    """A batch of rollout ids, checked as the file store checks them; duplicates dropped."""
    return list(dict.fromkeys(checked_rollout_ids(rollout_ids)))


class PostgresStagingStore:
    """Worker-owned staging in PostgreSQL (many hosts; see docs/staging.md).

    The same methods, results and exceptions as `FileStagingStore`:

    * ``stage(record, *, attachments=None) -> StageResult``: thread-safe, synchronous; returns
      ``ok=True`` only once the transaction that stored the record and its attachments is
      committed and flushed. A record that does not verify, a retired rollout, a key already
      staged with other content, an attachment that cannot be stored, or an unavailable or
      refusing server return ``ok=False`` with the reason. Staging the same record (and
      attachments) again is idempotent.
    * ``fetch(keys)`` / ``fetch_records(keys)`` / ``fetch_attachments(key)``: verified, in the
      order asked; `StagingKeyError` / `StagingKeyRetiredError` (``KeyError``s) for keys that
      are not staged / belong to a retired rollout; `TokenCaptureCorruptionError` for damage.
    * ``retire(ids)`` / ``delete(ids)``: batched, all or nothing, ``{"removed", "absent"}``;
      ``retire_now``/``delete_now`` are the same calls; ``aretire``/``adelete`` (and
      ``astage``, ``afetch``, ``afetch_records``) run on the caller's event loop.

    Options: ``models`` (as for `FileStagingStore`), ``batch_stages`` (default True: stages
    that wait share one call and one commit), ``stage_batch_size`` (at most 256 stages per
    call), ``stage_flushes`` (such calls in flight at once, each on its own connection: by
    default 3 through asyncpg, 1 through the native client; fewer, larger batches; see
    docs/postgres.md), ``native_group_commit`` (default True: the group commit in Rust,
    without the GIL), and the connection options of
    every PostgreSQL class
    (``pool_size``, ``connect_timeout``, ``statement_timeout``, ``synchronous_commit``,
    ``allow_unflushed_commits``, ``install_schema``, ``statement_cache_size``; see
    docs/postgres.md).

    Limits (``ok=False`` here, where the file store stores the call): text cannot hold NUL, so
    a key holding one is refused; a key over 2,692 bytes (the btree index's limit) and a stage
    of over 1 GiB - 1 MiB of row and attachments (PostgreSQL's field and message limit; on a
    Citus cluster a quarter of that, 256 MiB - 256 KiB: `stage_byte_limit`) are refused
    before they are sent. A batch the server answers with an error rolled back: each
    of its stages is sent again alone (`_alone`), so each is refused only for its own reason.
    """

    def __init__(
        self,
        dsn: str,
        *,
        models: ModelsChoice = "auto",
        batch_stages: bool = True,
        stage_batch_size: int = 256,
        stage_flushes: int | None = None,
        native_group_commit: bool = True,
        **options: Any,
    ) -> None:
        if isinstance(stage_batch_size, bool) or not isinstance(stage_batch_size, int):
            raise TypeError("stage_batch_size must be an int")
        if stage_batch_size < 1:
            raise ValueError("stage_batch_size must be at least 1")
        if stage_flushes is not None:
            if isinstance(stage_flushes, bool) or not isinstance(stage_flushes, int):
                raise TypeError("stage_flushes must be an int or None")
            if stage_flushes < 1:
                raise ValueError("stage_flushes must be at least 1")
        StagingModels.resolve(models)  # refuse a bad choice now
        self._models_choice = models
        self._client = Client(dsn, **options)
        self._batch_stages = batch_stages
        self._stage_batch_size = stage_batch_size
        self._alone_above = _BATCHED_BYTES_PER_BATCH // stage_batch_size
        # Batches in flight at once: measured best at 3 for asyncpg, 1 for the native client
        # (docs/postgres.md, "Staging throughput").
        self._stage_flushes = 3 if stage_flushes is None else stage_flushes
        self._native_flushes = 1 if stage_flushes is None else stage_flushes
        self._group = GroupCommit(self._client, _STAGE_BATCH, stage_batch_size, self._stage_flushes)
        if not isinstance(native_group_commit, bool):
            raise TypeError("native_group_commit must be a bool")
        # The native group commit (made on the first stage that may use it), or why not.
        self._native: _core.PostgresStageGroup | None = None
        self._native_off: str | None = None if native_group_commit else "turned off"
        # Held by the one caller that makes the first round trip (the others wait for it).
        self._first = threading.Lock()
        renew_after_fork(self, "_first")
        self._first_failed: tuple[float, BaseException] | None = None

    def __repr__(self) -> str:
        return f"PostgresStagingStore({self._client.where!r})"

    @property
    def dsn(self) -> str:
        return self._client.dsn

    def _models(self) -> StagingModels:
        return StagingModels.resolve(self._models_choice)

    # ---- StagingSink --------------------------------------------------------------------

    def _stage_args(self, record: Any, encoded: list[EncodedAttachment] | None) -> _StageArgs:
        """Verify and encode one stage (natively, the GIL released), or refuse it: a record
        that does not verify, or what PostgreSQL cannot store (`_check_key`, the size limit,
        `stage_byte_limit`: a quarter on Citus; while the store does not know yet whether it is on
        Citus, `_store` checks again before it sends)."""
        distributed = self._client.distributed
        # Before the blob is built.
        _check_attachment_sizes(_record_key(record), encoded, distributed)
        row = _core.staging_encode(record, encoded)
        _check_key(row.key)
        blob = row.attachments if row.has_attachments else None
        args = row.rollout_id, row.key, row.content_digest, row.row, blob
        _check_stage_size(args, distributed)
        return args

    @property
    def native_group_commit(self) -> bool:
        """Whether stages go through the native group commit (false until the first stage
        found the server, and for good once it fell back to asyncpg; see
        `native_fallback_reason`)."""
        return self._native is not None

    @property
    def native_fallback_reason(self) -> str | None:
        """Why stages do not use the native group commit (None when they do or may)."""
        return self._native_off

    def _native_stager(self) -> _core.PostgresStageGroup | None:
        """The native group commit, made on first use; None when it cannot serve this store."""
        if self._native is not None or self._native_off is not None:
            return self._native
        made = native_group(self._client, self._stage_batch_size, self._native_flushes)
        if isinstance(made, str):
            self._native_off = made
            return None
        self._native = made
        return made

    def _first_round_trip(self) -> None:
        """Check the schema and learn whether it is distributed, once: one caller makes the
        round trip, the others wait for it; a caller that waited for one that failed raises
        that failure (so each caller waits for at most one failed attempt besides its own)."""
        waiting_since = time.monotonic()
        with self._first:
            if self._client.distributed is not None:
                return
            failed = self._first_failed
            if failed is not None and failed[0] >= waiting_since:
                raise _copy_error(failed[1])
            native = self._native_stager()
            if native is not None:
                # Its first connection opens meanwhile (the stages queue behind it).
                threading.Thread(
                    target=native.warm, name="tokencapture-pg-warm", daemon=True
                ).start()
            try:
                self._client.run_sync(self._client.fetch("val", "SELECT 1"))
            except BaseException as error:
                self._first_failed = (time.monotonic(), error)
                raise

    def _native_path(self) -> _core.PostgresStageGroup | None:
        """The native group commit for a stage from a thread that runs no event loop, or None
        where today's paths serve it (batching off, fallen back, a Citus cluster)."""
        if not self._batch_stages or self._native_off is not None:
            return None
        if self._client.distributed is None:
            # The first stage: one round trip through asyncpg (one connection) checks the
            # schema and whether it is distributed; the stages that come with it wait for it
            # rather than each take the loop thread's path (and a connection of its pool).
            self._first_round_trip()
        if self._client.distributed:
            self._native_off = "a Citus cluster: each stage is delegated to its rollout's worker"
            native, self._native = self._native, None
            if native is not None:
                native.close()
            return None
        return self._native_stager()

    def _stage_native(
        self,
        native: _core.PostgresStageGroup,
        record: Any,
        encoded: list[EncodedAttachment] | None,
    ) -> str | None:
        """One stage through the native group commit: its key, or None when the native client
        cannot serve this server (the store falls back to asyncpg; nothing was sent)."""
        try:
            status, key = native.stage(record, encoded)
        except _core.PostgresStageError as failure:
            if failure.args[0] == "unsupported":
                self._native_off = failure.args[1]
                self._native = None
                native.close()
                return None
            error = _native_failure(failure)
            if not isinstance(error, asyncpg.PostgresError):
                raise error from None
            # The server refused the batch: its transaction rolled back. Alone, this stage
            # gets its own answer (`_alone`).
            args = self._stage_args(record, encoded)
            status = self._client.run_sync(self._alone(args))
            key = args[1]
        else:
            if status in (_STORED, _DUPLICATE):
                return key
            args = self._stage_args(record, encoded)
        if status == _CONFLICT:
            status = self._client.run_sync(self._recheck_conflict(args))
        _check_status(status, args)
        return key

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Durably stage one call's token delta (and its attachments) before returning."""
        models = self._models()
        try:
            models = StagingModels.of_record(record, models)
            key = self._stage(record, attachments)
        except Exception as error:  # any failure is an answer (never a BaseException)
            return models.failed(failure_reason(error))
        return models.ok(key)

    def _stage(self, record: Any, attachments: Mapping[str, Any] | None) -> str:
        """`stage`'s work: the key staged, or the refusal raised."""
        encoded = encode_attachments(attachments)
        if (
            asyncio.events._get_running_loop() is None
            and self._fits(record, encoded)
            and (native := self._native_path()) is not None
        ):
            key = self._stage_native(native, record, encoded)
            if key is not None:
                return key
        args = self._stage_args(record, encoded)
        if self._batched(args):
            try:
                if asyncio.events._get_running_loop() is None:
                    # The hot path: group commit led by a calling thread (no loop-thread hop).
                    status = self._group.stage(args)
                else:
                    # A caller inside a running loop cannot drive another one: the loop thread.
                    answer: concurrent.futures.Future[int] = concurrent.futures.Future()
                    self._client.call_in_thread(self._submit, args, answer)
                    status = answer.result()
            except asyncpg.PostgresError:
                # The server refused the batch: its transaction rolled back (`_alone`).
                status = self._client.run_sync(self._alone(args))
            if status == _CONFLICT:
                status = self._client.run_sync(self._recheck_conflict(args))
            _check_status(status, args)
        else:
            self._client.run_sync(self._store(args))
        return args[1]

    def _fits(self, record: Any, encoded: list[EncodedAttachment] | None) -> bool:
        """Whether a stage may join a native batch: nothing of `record` that can be seen
        before it is encoded breaks the server's limits (a stage that does goes through
        `_stage_args`, which refuses it), and its attachments are not so large that it goes
        alone (`_batched`). Rows are only sized once encoded: the native group commit's
        leader keeps each batch under its own byte limit (`MAX_BATCH_BYTES`)."""
        key = _record_key(record)
        try:
            if key is not None:
                _check_key(key)
            return _check_attachment_sizes(key, encoded) <= self._alone_above
        except ValueError:
            return False

    def _batched(self, args: _StageArgs) -> bool:
        """Whether an encoded stage joins a batch: batching on, not on Citus (there a stage
        alone is delegated to its rollout's worker), and small enough that a full batch of
        such stages stays well within the server's limit of one message."""
        size = len(args[3]) + (len(args[4]) if args[4] is not None else 0)
        return (
            self._batch_stages and self._client.distributed is False and size <= self._alone_above
        )

    def _batcher(self, loop: asyncio.AbstractEventLoop) -> CallBatcher:
        return self._client.batcher(loop, _STAGE_BATCH, self._stage_batch_size, self._stage_flushes)

    def _submit(
        self,
        loop: asyncio.AbstractEventLoop,
        args: _StageArgs,
        answer: concurrent.futures.Future[int],
    ) -> None:
        """On the loop thread: queue one stage; its status (or failure) goes to `answer`."""

        def settle(done: asyncio.Future[int]) -> None:
            if done.cancelled():
                answer.cancel()
            elif (error := done.exception()) is not None:
                answer.set_exception(error)
            else:
                answer.set_result(done.result())

        try:
            self._batcher(loop).submit(args).add_done_callback(settle)
        except BaseException as error:
            answer.set_exception(error)

    def astage(
        self, record: Any, *, attachments: Mapping[str, Any] | None = None
    ) -> Coroutine[Any, Any, Any]:
        """`stage` on the caller's event loop (the record is verified and encoded now)."""
        models = self._models()
        try:
            models = StagingModels.of_record(record, models)
            args = self._stage_args(record, encode_attachments(attachments))
        except Exception as error:  # any failure is an answer (never a BaseException)
            failed = models.failed(failure_reason(error))

            async def refused() -> Any:
                return failed

            return refused()
        return self._astage(args, models)

    async def _astage(self, args: _StageArgs, models: StagingModels) -> Any:
        try:
            await self._store(args)
        except Exception as error:
            return models.failed(failure_reason(error))
        return models.ok(args[1])

    async def _store(self, args: _StageArgs) -> None:
        """Store one encoded stage (batched with others waiting, unless on Citus: there a
        stage alone is delegated to its rollout's worker); raises the refusal."""
        if self._batched(args):
            try:
                status = await self._batcher(asyncio.get_running_loop()).submit(args)
            except asyncpg.PostgresError:
                # The server refused the batch: its transaction rolled back (`_alone`).
                status = await self._alone(args)
        else:
            status = await self._client.on_connection(partial(self._alone_on, args))
        if status == _CONFLICT:
            status = await self._recheck_conflict(args)
        _check_status(status, args)

    async def _alone_on(self, args: _StageArgs, connection: Any) -> int:
        """One stage sent alone on `connection`; refused first (`ValueError`, nothing sent)
        when it is too large for a Citus cluster, which the client knows once it has a
        connection (`stage_byte_limit`)."""
        if self._client.distributed:
            _check_stage_size(args, True)
        # Its timeout allows for its size (`Client.call`).
        status: int = await self._client.call(connection, kind="val", sql=_STAGE, args=args)
        return status

    async def _alone(self, args: _StageArgs) -> int:
        """The status of one stage of a batch the server refused with an error (not a lost
        connection: that stays `PostgresUnavailableError`, its outcome unknown). The batch was
        one transaction and rolled back, so none of its stages is stored: each caller sends its
        own again, alone, in its own transaction, and gets its own answer (stored, or the
        server's error for this stage only). So one stage the server cannot take fails no
        other. Stages are idempotent, so this is safe whatever happened before."""
        status: int = await self._client.fetch("val", _STAGE, *args, sized=True)
        return status

    async def _recheck_conflict(self, args: _StageArgs) -> int:
        """The status of a stage the server found a conflict (the stored content digest
        differs): a duplicate when the stored row carries the same call in another encoding
        (`_same_as_stored`), a conflict otherwise. The stored row was committed before the
        server answered, so a duplicate is as durable as the first stage was."""
        stored = await self._client.fetch("rows", _STORED_CONTENT, args[0], args[1])
        return _DUPLICATE if _same_as_stored(stored, args) else _CONFLICT

    # ---- StagingSource ------------------------------------------------------------------

    async def _rows(self, keys: list[str]) -> list[bytes]:
        """The stored rows of `keys`, in order; the first missing key raises."""
        wanted = [key for key in dict.fromkeys(keys) if "\0" not in key]
        found = await self._client.fetch("rows", _FETCH_ROWS, wanted) if wanted else []
        by_key: dict[str, bytes] = {}
        for record in found:
            by_key.setdefault(record["staging_key"], record["row_bytes"])
        for key in keys:
            if key not in by_key:
                raise await self._missing(key)
        return [by_key[key] for key in keys]

    async def _missing(self, key: str) -> StagingKeyError:
        """The error for a key that is not stored: retired when a rollout it could belong to
        (a prefix of it before a '/') is fenced."""
        prefixes = [key[:at] for at, char in enumerate(key) if char == "/" and at > 0]
        prefixes = [p for p in prefixes if "\0" not in p]
        fenced: set[str] = set()
        if prefixes:
            rows = await self._client.fetch("rows", _RETIRED_AMONG, prefixes)
            fenced = {row["rollout_id"] for row in rows}
        return _unknown(key, next((p for p in prefixes if p in fenced), None))

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One digest-verified base snapshot per key, in the order asked."""
        keys = checked_keys(staging_keys)
        rows = self._client.run_sync(self._rows(keys))
        return snapshots_from_rows(rows, keys, self._models())

    def fetch_records(self, staging_keys: list[str]) -> list[Any]:
        """One digest-verified record (with its extras) per key, in the order asked."""
        keys = checked_keys(staging_keys)
        rows = self._client.run_sync(self._rows(keys))
        return records_from_rows(rows, keys, self._models())

    def afetch(self, staging_keys: list[str]) -> Coroutine[Any, Any, list[Any]]:
        """`fetch` on the caller's event loop (the keys are checked now)."""
        return self._afetch(checked_keys(staging_keys), False)

    def afetch_records(self, staging_keys: list[str]) -> Coroutine[Any, Any, list[Any]]:
        """`fetch_records` on the caller's event loop (the keys are checked now)."""
        return self._afetch(checked_keys(staging_keys), True)

    async def _afetch(self, keys: list[str], with_extras: bool) -> list[Any]:
        rows = await self._rows(keys)
        decode = records_from_rows if with_extras else snapshots_from_rows
        return decode(rows, keys, self._models())

    def fetch_attachments(self, staging_key: str) -> dict[str, StagedAttachment]:
        """The attachments staged with one key (empty if it had none)."""
        if type(staging_key) is not str:
            raise TypeError(f"staging_key must be a str, not {type(staging_key).__name__}")
        return self._client.run_sync(self._attachments(staging_key))

    async def _attachments(self, key: str) -> dict[str, StagedAttachment]:
        rows = await self._client.fetch("rows", _FETCH_ATTACHMENTS, key) if "\0" not in key else []
        if not rows:
            raise await self._missing(key)
        blob = rows[0]["attachments"]
        return attachments_from_blob(blob, key) if blob is not None else {}

    def keys(self, rollout_id: str | None = None) -> list[str]:
        """Every staged key (of one rollout, or all), sorted."""
        if rollout_id is not None and type(rollout_id) is not str:
            raise TypeError(f"rollout_id must be a str or None, not {type(rollout_id).__name__}")
        return self._client.run_sync(self._keys(rollout_id))

    async def _keys(self, rollout_id: str | None) -> list[str]:
        if rollout_id is None:
            rows = await self._client.fetch("rows", _KEYS_ALL)
        elif "\0" in rollout_id:
            rows = []
        else:
            rows = await self._client.fetch("rows", _KEYS_OF, rollout_id)
        return sorted(row["staging_key"] for row in rows)

    def retired(self) -> list[str]:
        """Every retired (fenced) rollout id, sorted: rollouts with no fetchable keys that no
        stage succeeds for until they are deleted."""
        rows = self._client.run_sync(self._client.fetch("rows", _RETIRED_ALL))
        return sorted(row["rollout_id"] for row in rows)

    # ---- lifecycle ----------------------------------------------------------------------

    async def _remove(self, sql: str, ids: list[str]) -> RolloutRemovalPayload:
        storable = [rollout_id for rollout_id in ids if "\0" not in rollout_id]
        if not storable:
            return {"removed": [], "absent": ids}
        row = await self._client.fetch("row", sql, storable)
        removed = set(row["removed"])
        return {
            "removed": [rollout_id for rollout_id in ids if rollout_id in removed],
            "absent": [rollout_id for rollout_id in ids if rollout_id not in removed],
        }

    def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Fence rollouts: their keys stop being fetchable and no later stage of them
        succeeds, from any process or host. Committed before it returns."""
        return self._client.run_sync(self._remove(_RETIRE, _rollout_list(rollout_ids)))

    def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' staged calls and any fence, so an id can be staged again."""
        return self._client.run_sync(self._remove(_DELETE, _rollout_list(rollout_ids)))

    retire_now = retire
    delete_now = delete

    def aretire(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`retire` on the caller's event loop (arguments checked now)."""
        return self._remove(_RETIRE, _rollout_list(rollout_ids))

    def adelete(self, rollout_ids: Sequence[str]) -> Coroutine[Any, Any, RolloutRemovalPayload]:
        """`delete` on the caller's event loop (arguments checked now)."""
        return self._remove(_DELETE, _rollout_list(rollout_ids))

    # ---- connections --------------------------------------------------------------------

    def close(self) -> None:
        """Close this store's connections (idempotent). Synchronous, as the staging protocols
        are (the other PostgreSQL classes' `close` is a coroutine; here that is `aclose`)."""
        if self._native is not None:
            self._native.close()
        self._group.close()
        self._client.close_sync()

    close_sync = close

    async def aclose(self) -> None:
        """`close` from a coroutine: this loop's connections closed without blocking it."""
        if self._native is not None:
            self._native.close()
        await self._client.close()
        self._group.close(graceful=False)
