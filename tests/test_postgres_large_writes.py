"""A write's timeout allows for its size (`tokencapture.postgres._client.statement_timeout_for`):
a put (alone, batched, `put_unless_stored`) or a stage under the size limit must not time out
only because it is large. Measured on this machine: a put of a 64 MiB line takes ~0.8 s on one
server, ~5 s delegated on the test Citus cluster, so a timeout of a fraction of a second cut
it off before; over 1 MiB the client's wait and the server's statement_timeout now grow by
one second per 4 MiB sent."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from tests.conftest import make_entry
from tests.postgres_fixture import dsn, pg_dsn, pg_server
from tests.staging_backends import make_record

from tokencapture.postgres import (
    PostgresStagingStore,
    PostgresTokenCaptureStore,
    PostgresUnavailableError,
)
from tokencapture.postgres._client import (
    ALLOWANCE_BYTES_PER_SECOND,
    SIZED_ABOVE_BYTES,
    Client,
    argument_bytes,
    statement_timeout_for,
)

__all__ = ["dsn", "pg_dsn", "pg_server"]  # the fixtures, imported for pytest

MiB = 1 << 20
# Short enough that a put of a LINE_BYTES line took longer on this machine (~0.8 s); the
# allowance for it is 16 s.
SHORT = 0.2
LINE_BYTES = 64 * MiB


def _reader(dsn: str) -> PostgresTokenCaptureStore:
    """A store with the default timeout, to read back: a read's timeout does not allow for
    the size of what it fetches (it is not known before), so a read of a 64 MiB line under
    0.2 s may time out."""
    return PostgresTokenCaptureStore(dsn)


def test_the_rule_sizes_to_timeouts() -> None:
    """Expected values worked out by hand: timeout + bytes / (4 MiB/s) over 1 MiB."""
    assert SIZED_ABOVE_BYTES == 1_048_576
    assert ALLOWANCE_BYTES_PER_SECOND == 4_194_304
    # A small write keeps exactly the configured timeout, up to and including 1 MiB.
    assert statement_timeout_for(30.0, 0) == 30.0
    assert statement_timeout_for(30.0, 100_000) == 30.0
    assert statement_timeout_for(30.0, 1_048_576) == 30.0
    assert statement_timeout_for(0.2, 1_048_576) == 0.2
    # Over it, every byte counts: 1 MiB + 4 bytes is a quarter second and a bit more.
    assert statement_timeout_for(30.0, 1_048_580) == pytest.approx(30.250000954)
    assert statement_timeout_for(30.0, 16 * MiB) == 34.0
    assert statement_timeout_for(30.0, 64 * MiB) == 46.0
    assert statement_timeout_for(30.0, 128 * MiB) == 62.0
    assert statement_timeout_for(30.0, 255 * MiB) == 93.75
    assert statement_timeout_for(30.0, 268_173_312) == 93.9375  # the Citus limit
    assert statement_timeout_for(30.0, 1_072_693_248) == 285.75  # the single-server limit
    assert statement_timeout_for(0.2, 64 * MiB) == pytest.approx(16.2)
    assert statement_timeout_for(5.0, 512 * MiB) == 133.0


def test_argument_bytes_counts_binary_arguments_and_batch_columns() -> None:
    assert argument_bytes(("rollout", b"call", "digest", b"x" * 10)) == 14
    assert argument_bytes(("r", b"k", "d", b"row", None)) == 4
    assert argument_bytes((memoryview(b"abcdef"), bytearray(3), 7, 1.5)) == 9
    # A batch: one list per argument.
    columns = (["r1", "r2"], [b"c1", b"c22"], ["d", "d"], [b"l" * 5, b"l" * 6])
    assert argument_bytes(columns) == 2 + 3 + 5 + 6
    assert argument_bytes(([b"row", b"rows"], [None, b"blob"])) == 3 + 4 + 4
    assert argument_bytes(([None, None], [], ["text"], [memoryview(b"ab"), None])) == 2


# A statement that takes 0.6 s on the server whatever its argument: it shows which timeout
# applied, the client's or the server's, without depending on the machine's speed.
SLOW = "SELECT pg_sleep(0.6) IS NOT NULL AND length($1::bytea) > 0"


def test_a_large_statement_gets_the_allowance_on_both_sides_a_small_one_does_not(
    dsn: str,
) -> None:
    """The same slow statement under a 0.2 s timeout: with 1 MiB of argument it is cut off
    (today's timeout); with 2 MiB (0.5 s allowance) it completes. The server's cut is
    QueryCanceledError, the client's TimeoutError: each is checked alone. The SET LOCAL ends
    with the statement's transaction: the session's own timeout is still 200ms after it."""
    client = Client(dsn, statement_timeout=SHORT, pool_size=1)

    async def run() -> None:
        with pytest.raises(PostgresUnavailableError):
            await client.fetch("val", SLOW, b"x" * MiB, sized=True)
        assert await client.fetch("val", SLOW, b"x" * (2 * MiB), sized=True) is True
        # Not sized: today's timeout, whatever the size.
        with pytest.raises(PostgresUnavailableError):
            await client.fetch("val", SLOW, b"x" * (2 * MiB))

        async def on_one(connection: Any) -> tuple[Any, ...]:
            # The server's side alone: a client that waits long enough, the server's
            # statement_timeout raised only by the sized call.
            try:
                await connection.fetchval(SLOW, b"x" * (2 * MiB), timeout=5)
            except asyncpg.QueryCanceledError:
                server_cut = True
            else:
                server_cut = False
            sized = await client.call(connection, kind="val", sql=SLOW, args=(b"x" * (2 * MiB),))
            after = await connection.fetchval("SHOW statement_timeout")
            in_transaction = connection.is_in_transaction()
            return server_cut, sized, after, in_transaction

        assert await client.on_connection(on_one) == (True, True, "200ms", False)
        # The statement's transaction committed: a sized write is durable when it returns.
        rows = await client.fetch(
            "val",
            "SELECT count(*) FROM (SELECT tokencapture.put($1, $2, $3, $4)) AS put",
            "direct",
            b"call",
            "0" * 64,
            b"y",
        )
        assert rows == 1
        await client.close()

    asyncio.run(run())


def test_a_refused_large_write_rolls_back_its_transaction_and_keeps_the_connection(
    dsn: str,
) -> None:
    """A sized write the server answers with an error: raised as that error, its transaction
    rolled back, the pooled connection reusable (not left in a failed transaction)."""
    client = Client(dsn, statement_timeout=SHORT, pool_size=1)

    async def run() -> None:
        with pytest.raises(asyncpg.DivisionByZeroError):
            await client.fetch(
                "val", "SELECT 1 / (length($1::bytea) * 0)", b"x" * 2 * MiB, sized=True
            )

        async def state(connection: Any) -> tuple[bool, Any]:
            return connection.is_in_transaction(), await connection.fetchval("SELECT 1")

        assert await client.on_connection(state) == (False, 1)
        await client.close()

    asyncio.run(run())


def _line(size: int, seed: int = 0) -> str:
    """Incompressible text (PostgreSQL would compress a run of one character)."""
    import base64

    return base64.b64encode(os.urandom(size * 3 // 4)).decode()[: size - 4096 - seed]


def test_a_large_put_succeeds_under_a_timeout_shorter_than_it_takes(dsn: str) -> None:
    """A put of a 64 MiB line (a new store's first put: sent alone) takes ~0.8 s here; under a
    0.2 s timeout it failed, `PostgresUnavailableError`, the outcome unknown. With the
    allowance (16 s) it is stored, and read back whole."""
    entry = make_entry("big", blob=_line(LINE_BYTES))
    store = PostgresTokenCaptureStore(dsn, statement_timeout=SHORT)
    reader = _reader(dsn)
    try:
        started = time.monotonic()
        store.append(entry)
        took = time.monotonic() - started
        # It did take longer than the configured timeout: without the allowance, cut off.
        assert took > SHORT, took
        # A small put afterwards: the configured timeout, on a connection left as it was.
        store.append(make_entry("big", call=2))
        assert reader.read_entries("big") == [entry, make_entry("big", call=2)]
    finally:
        store.close_sync()
        reader.close_sync()


def test_large_put_unless_stored_and_a_large_batch_succeed_under_a_short_timeout(
    dsn: str,
) -> None:
    """`put_unless_stored` of a 64 MiB line (its own transaction: the allowance set in it),
    and four puts of 16 MiB lines sent as one batch (64 MiB in one `put_batch` call, with
    put_batch_size=4 a 16 MiB line joins a batch), under a 0.2 s timeout."""
    store = PostgresTokenCaptureStore(dsn, statement_timeout=SHORT, put_batch_size=4)

    async def run() -> None:
        await store.put(make_entry("warm"))  # the store knows it is not on Citus: batching
        big = make_entry("unless", blob=_line(LINE_BYTES))
        assert await store.put_unless_stored(big) is False
        assert await store.put_unless_stored(big) is False  # stored, byte for byte
        other = make_entry("unless", blob="other")
        assert await store.put_unless_stored(other) is True  # the stored entry stands
        del big, other
        batch = [make_entry("batch", call=n, blob=_line(16 * MiB, n)) for n in range(4)]
        await asyncio.gather(*(store.put(entry) for entry in batch))
        assert reader.read_entries("batch") == batch

    reader = _reader(dsn)
    try:
        store._client.run_sync(run())
        [stored] = reader.read_entries("unless")
        assert len(stored.blob) == LINE_BYTES - 4096  # type: ignore[attr-defined]
        assert store.stats()["put"]["count"] == 8
        assert store.stats()["put"]["failures"] == 0
    finally:
        store.close_sync()
        reader.close_sync()


def _four_stages_at_once(
    store: PostgresStagingStore, reader: PostgresStagingStore, rollout: str
) -> None:
    """Four stages of 16 MiB attachments from four threads (batched together where the store
    batches), each acknowledged and read back whole."""
    blobs = [os.urandom(16 * MiB) for _ in range(4)]
    records = [make_record(rollout, f"batch{n}") for n in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda n: store.stage(records[n], attachments={"blob": blobs[n]}),
                range(4),
            )
        )
    assert all(result.ok for result in results), results
    for n, record in enumerate(records):
        assert reader.fetch_attachments(record.staging_key)["blob"].data == blobs[n]


def test_large_stages_succeed_under_a_short_timeout(dsn: str) -> None:
    """A stage with 64 MiB of attachments (sent alone: `_alone_on`) and four stages of 16 MiB
    sent by four threads through the group commit (stage_batch_size=4: up to 128 MiB joins a
    batch), under a 0.2 s timeout (the asyncpg paths; the native group commit is Rust's)."""
    alone = PostgresStagingStore(dsn, statement_timeout=SHORT, native_group_commit=False)
    batched = PostgresStagingStore(
        dsn, statement_timeout=SHORT, native_group_commit=False, stage_batch_size=4
    )
    reader = PostgresStagingStore(dsn)  # reads under the default timeout (`_reader`)
    try:
        big = os.urandom(LINE_BYTES)
        record = make_record("s", "alone")
        result = alone.stage(record, attachments={"blob": big})
        assert result.ok, result
        assert reader.fetch_attachments(record.staging_key)["blob"].data == big
        del big
        assert batched.stage(make_record("s", "warm")).ok  # it knows it is not on Citus
        _four_stages_at_once(batched, reader, "s")
    finally:
        alone.close()
        batched.close()
        reader.close()


def test_a_large_rollout_copied_in_succeeds_under_a_short_timeout(dsn: str, tmp_path: Path) -> None:
    """`tokencapture copy` into PostgreSQL: a file-store rollout holding a 64 MiB line is
    imported in one call (`import_into_postgres`), which took longer than 0.2 s here and was
    cut off before; with the allowance it lands whole."""
    from tokencapture.postgres.transfer import import_into_postgres
    from tokencapture.store import TokenCaptureStore
    from tokencapture.transfer import export_from_directory

    entry = make_entry("copied", blob=_line(LINE_BYTES))
    files = TokenCaptureStore(tmp_path / "files")
    files.append(entry)
    image = export_from_directory(files, "copied")
    assert image is not None
    store = PostgresTokenCaptureStore(dsn, statement_timeout=SHORT)
    reader = _reader(dsn)
    try:
        client = store._client
        started = time.monotonic()
        assert client.run_sync(import_into_postgres(client, image)) is True
        assert time.monotonic() - started > SHORT  # without the allowance: cut off
        assert reader.read_entries("copied") == [entry]
    finally:
        store.close_sync()
        reader.close_sync()


def _native_calls(store: PostgresStagingStore) -> tuple[int, int]:
    """`(calls, stages)` of the store's native group commit (it must be the one in use)."""
    native = store._native
    assert native is not None, store.native_fallback_reason
    calls, stages, _ = native.stats()
    return calls, stages


def test_large_native_stages_succeed_under_a_short_timeout(dsn: str) -> None:
    """The native group commit (Rust): a stage with 64 MiB of attachments, then four stages of
    16 MiB from four threads batched together, under a 0.2 s timeout (stage_batch_size=4, so
    a stage of up to 128 MiB joins a native batch rather than going alone through asyncpg).
    A 64 MiB batch takes ~0.8 s here: without the allowance the client gave up at 0.2 s."""
    store = PostgresStagingStore(dsn, statement_timeout=SHORT, stage_batch_size=4)
    reader = PostgresStagingStore(dsn)  # reads under the default timeout (`_reader`)
    try:
        assert store.stage(make_record("n", "warm")).ok
        assert store.native_group_commit, store.native_fallback_reason
        big = os.urandom(LINE_BYTES)
        record = make_record("n", "alone")
        result = store.stage(record, attachments={"blob": big})
        assert result.ok, result
        assert _native_calls(store) == (2, 2)
        assert reader.fetch_attachments(record.staging_key)["blob"].data == big
        del big
        _four_stages_at_once(store, reader, "n")
        calls, stages = _native_calls(store)
        assert stages == 6
        assert calls < 6  # at least one batch of two or more stages (up to 64 MiB)
    finally:
        store.close()
        reader.close()


# On the server, every staged row records the statement_timeout it was inserted under (in
# ms) and the bytes its stage sent (row and attachments); a row of the rollout "slow" takes
# 0.6 s more, one of "refuse" is refused. A deterministic probe of both sides of the native
# group commit's allowance.
_PROBE = """
CREATE TABLE stage_probe (
    n serial PRIMARY KEY, rollout_id text, nbytes bigint, timeout_ms text);
CREATE FUNCTION stage_probe() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO stage_probe (rollout_id, nbytes, timeout_ms) VALUES (
        NEW.rollout_id,
        octet_length(NEW.row_bytes) + coalesce(octet_length(NEW.attachments), 0),
        (SELECT setting FROM pg_settings WHERE name = 'statement_timeout'));
    IF NEW.rollout_id = 'slow' THEN
        PERFORM pg_sleep(0.6);
    END IF;
    IF NEW.rollout_id = 'refuse' THEN
        RAISE EXCEPTION 'refused by the probe';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER stage_probe BEFORE INSERT ON tokencapture.staged_calls
    FOR EACH ROW EXECUTE FUNCTION stage_probe();
"""
_NATIVE_BATCH = "SELECT tokencapture.stage_batch($1, $2, $3, $4, $5)"


def test_a_large_native_batch_gets_the_allowance_on_both_sides_a_small_one_does_not(
    dsn: str,
) -> None:
    """Under a 0.2 s timeout, through the native group commit: a stage of a few bytes runs
    under the plain 200 ms, as one statement (the backend's last query is the batch call, no
    transaction around it); a stage of more than 1 MiB runs under the statement_timeout the
    Python rule gives for its bytes (`statement_timeout_for`: the Rust side agrees on
    several sizes), in a transaction of its own (its last query is the COMMIT), and the
    setting does not outlive it on the connection. A 4 MiB stage that sleeps 0.6 s on the
    server (allowance 1 s) is stored: neither the server (QueryCanceledError) nor the client
    (TimeoutError) cut it; a small one that sleeps is cut. A large batch the server refuses
    leaves its connection outside a transaction, kept for the next batch."""

    async def sql(query: str) -> list[Any]:
        connection = await asyncpg.connect(dsn)
        try:
            return list(await connection.fetch(query))
        finally:
            await connection.close()

    async def install_probe() -> None:
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(_PROBE)
        finally:
            await connection.close()

    asyncio.run(install_probe())

    def last_query() -> str:
        [row] = asyncio.run(
            sql(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
                f"AND pid <> pg_backend_pid() AND query IN ('COMMIT', '{_NATIVE_BATCH}')"
            )
        )
        return str(row["query"])

    def probed() -> tuple[int, str]:
        rows = asyncio.run(sql("SELECT nbytes, timeout_ms FROM stage_probe ORDER BY n"))
        return int(rows[-1]["nbytes"]), str(rows[-1]["timeout_ms"])

    store = PostgresStagingStore(dsn, statement_timeout=SHORT, stage_batch_size=4)
    try:
        assert store.stage(make_record("fast", "small")).ok
        assert store.native_group_commit, store.native_fallback_reason
        assert probed()[1] == "200"
        assert last_query() == _NATIVE_BATCH
        sizes = [SIZED_ABOVE_BYTES - 2048, SIZED_ABOVE_BYTES + 7, 3 * MiB + 5, 10 * MiB + 1]
        for n, size in enumerate(sizes):
            result = store.stage(
                make_record("fast", f"sized{n}"), attachments={"blob": os.urandom(size)}
            )
            assert result.ok, result
            nbytes, timeout_ms = probed()
            assert timeout_ms == str(int(statement_timeout_for(SHORT, nbytes) * 1000))
            expected = _NATIVE_BATCH if nbytes <= SIZED_ABOVE_BYTES else "COMMIT"
            assert last_query() == expected, (size, nbytes)
        # Slow on the server, large: 0.6 s under an allowance of 1.2 s on both sides.
        started = time.monotonic()
        result = store.stage(
            make_record("slow", "large"), attachments={"blob": os.urandom(4 * MiB)}
        )
        assert result.ok, result
        assert time.monotonic() - started > 0.6
        nbytes, timeout_ms = probed()
        assert timeout_ms == str(int(statement_timeout_for(SHORT, nbytes) * 1000))
        assert int(timeout_ms) >= 1200
        # The raised setting ended with that batch's transaction: the next one, on the same
        # connection, runs under the plain 200 ms.
        assert store.stage(make_record("fast", "after")).ok
        assert probed()[1] == "200"
        assert last_query() == _NATIVE_BATCH
        # Refused, large: the store's answer is the server's (its retry alone through asyncpg
        # is refused too); the native connection is kept and its next batch commits.
        native = store._native
        assert native is not None
        connects = native.stats()[2]
        result = store.stage(
            make_record("refuse", "large"), attachments={"blob": os.urandom(2 * MiB)}
        )
        assert not result.ok
        assert "refused by the probe" in str(result), result
        assert _native_calls(store)[1] == 7  # every stage so far went native
        assert store.stage(make_record("fast", "after refused")).ok
        assert probed()[1] == "200"
        assert _native_calls(store)[1] == 8  # answered natively, not by the asyncpg retry
        assert native.stats()[2] == connects
        # Slow and small: cut off at 0.2 s.
        result = store.stage(make_record("slow", "small"))
        assert not result.ok
        assert "TimeoutError" in str(result) or "QueryCanceledError" in str(result), result
        assert _native_calls(store)[1] == 8
    finally:
        store.close()
