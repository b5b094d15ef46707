"""PostgresStagingStore: the file staging store's behaviour, test for test (each behavioural test
runs on both backends and the two must answer alike), plus what only a database has: the
schema upgrade, server-side damage, durability settings, an unavailable server and batching."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.pg_server import PgServer
from tests.postgres_fixture import dsn, execute, fetch, pg_dsn, pg_server  # noqa: F401
from tests.staging_backends import chain, make_record
from tests.staging_fixture import Store, staging_backend  # noqa: F401

import tokencapture
from tokencapture import FileStagingStore, StagingKeyError, StagingKeyRetiredError, _core
from tokencapture.postgres import (
    SCHEMA_VERSION,
    PostgresStagingStore,
    PostgresTokenCaptureStore,
    install_schema_sync,
)
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.staging.records import StageResult
from tokencapture.staging_attachments import StagedAttachment
from tokencapture.staging_rows import encode_stage


@pytest.fixture(params=["asyncpg", "native"])
def both(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    dsn: str,  # noqa: F811
) -> Iterator[tuple[FileStagingStore, PostgresStagingStore]]:
    """One store of each backend, to compare their answers (the PostgreSQL one staging
    through asyncpg, then through the native group commit)."""
    store = PostgresStagingStore(dsn, native_group_commit=request.param == "native")
    yield FileStagingStore(tmp_path / "staging"), store
    store.close_sync()


def test_exported_from_tokencapture_lazily() -> None:
    assert tokencapture.PostgresStagingStore is PostgresStagingStore
    assert SCHEMA_VERSION == 7


def test_stage_then_fetch_in_the_order_asked(staging: Store) -> None:
    records = chain("r", 5)
    for record in records:
        result = staging.stage(record)
        assert isinstance(result, StageResult)
        assert result.ok and result.staging_key == record.staging_key and result.error is None
    keys = [record.staging_key for record in reversed(records)]
    snapshots = staging.fetch(keys)
    assert [s.staging_key for s in snapshots] == keys
    for snapshot, record in zip(snapshots, reversed(records), strict=True):
        assert snapshot.token_ids_delta == record.token_ids_delta
        assert snapshot.generation_log_probs_delta == record.generation_log_probs_delta
        assert snapshot.chain_hash == record.chain_hash
        assert snapshot.digest == record.digest
    assert staging.fetch([keys[0], keys[0]])[1].staging_key == keys[0]
    assert staging.keys() == sorted(keys)
    assert staging.keys("r") == sorted(keys)
    assert staging.keys("other") == []


def test_fetch_records_carry_extras(staging: Store) -> None:
    record = make_record(extras={"a": [1, 2.5, "é"], "b": None})
    assert staging.stage(record).ok
    fetched = staging.fetch_records([record.staging_key])[0]
    assert fetched.extras == {"a": [1, 2.5, "é"], "b": None}
    assert fetched.model_dump() == record.model_dump()  # (models: "auto")


def test_restage_is_idempotent_and_a_changed_record_conflicts(staging: Store) -> None:
    record = make_record(tokens=[1, 2, 3])
    assert staging.stage(record).ok
    assert staging.stage(record).ok
    other = make_record(tokens=[1, 2, 4])
    result = staging.stage(other)
    assert not result.ok and result.staging_key is None
    assert result.error == (
        'TokenCaptureConflictError: staging key "r/c1" is already staged with different content'
    )
    assert staging.fetch(["r/c1"])[0].token_ids_delta == [1, 2, 3]
    # The same record with other attachments is other content too.
    assert not staging.stage(record, attachments={"x": b"1"}).ok


def test_unknown_keys_raise_a_key_error_naming_the_first(staging: Store) -> None:
    assert staging.stage(make_record()).ok
    with pytest.raises(StagingKeyError) as caught:
        staging.fetch(["r/c1", "r/nope", "q/also"])
    assert isinstance(caught.value, KeyError)
    assert not isinstance(caught.value, StagingKeyRetiredError)
    assert str(caught.value) == 'staging key "r/nope" is not staged'
    with pytest.raises(StagingKeyError, match="is not staged"):
        staging.fetch_attachments("r/nope")
    with pytest.raises(TypeError):
        staging.fetch("r/c1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        staging.fetch([b"r/c1"])  # type: ignore[list-item]


def test_retire_fences_and_delete_lifts_the_fence(staging: Store) -> None:
    first, second = chain("a/b", 2)
    assert staging.stage(first).ok
    assert staging.stage(make_record("q", "c1")).ok
    assert staging.retire(["a/b", "never", "a/b"]) == {"removed": ["a/b"], "absent": ["never"]}
    assert staging.retire(["a/b"]) == {"removed": [], "absent": ["a/b"]}
    refused = staging.stage(second)
    assert not refused.ok
    assert refused.error == (
        'TokenCaptureRetiredError: rollout "a/b" is retired: its staged calls are fenced until '
        "it is deleted"
    )
    with pytest.raises(StagingKeyRetiredError) as caught:
        staging.fetch([first.staging_key])
    assert str(caught.value) == 'staging key "a/b/c0" belongs to retired rollout "a/b"'
    with pytest.raises(StagingKeyRetiredError):
        staging.fetch_attachments(first.staging_key)
    assert staging.keys() == ["q/c1"]  # the other rollout is untouched
    assert staging.delete(["a/b", "gone"]) == {"removed": ["a/b"], "absent": ["gone"]}
    with pytest.raises(StagingKeyError) as unknown:
        staging.fetch([first.staging_key])
    assert not isinstance(unknown.value, StagingKeyRetiredError)
    assert staging.stage(second).ok  # staged again from scratch
    assert staging.delete(["q"]) == {"removed": ["q"], "absent": []}
    assert staging.keys() == [second.staging_key]
    with pytest.raises(TypeError):
        staging.retire("a/b")
    with pytest.raises(ValueError):
        staging.delete([""])


def test_async_lifecycle_checks_arguments_when_called(staging: Store) -> None:
    assert staging.stage(make_record("r")).ok

    async def run() -> None:
        with pytest.raises(TypeError):
            staging.aretire("r")
        with pytest.raises(ValueError):
            staging.adelete([""])
        assert await staging.aretire(["r"]) == {"removed": ["r"], "absent": []}
        assert await staging.adelete(["r"]) == {"removed": ["r"], "absent": []}
        if isinstance(staging, PostgresStagingStore):
            await staging.aclose()  # this loop's connections

    asyncio.run(run())


def test_attachments_are_stored_with_the_record(staging: Store) -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    record = make_record()
    assert staging.stage(record, attachments={"raw": b"\x00\x01", "logits": array}).ok
    found = staging.fetch_attachments(record.staging_key)
    assert list(found) == ["raw", "logits"]
    assert found["raw"].kind == "bytes" and found["raw"].data == b"\x00\x01"
    assert found["logits"].shape == (3, 4) and found["logits"].dtype == "<f4"
    assert np.array_equal(found["logits"].to_numpy(), array)
    plain = make_record(model_call_id="c2")
    assert staging.stage(plain).ok
    assert staging.fetch_attachments(plain.staging_key) == {}
    # Anything else is refused whole, naming the type: nothing staged.
    refused = staging.stage(make_record(model_call_id="c3"), attachments={"bad": object()})
    assert not refused.ok
    assert refused.error is not None and "builtins.object" in refused.error
    with pytest.raises(StagingKeyError):
        staging.fetch(["r/c3"])


def test_attachments_of_every_array_kind_round_trip_and_references_are_refused(
    staging: Store,
) -> None:
    """Typed arrays come back with their dtype and shape (a structured dtype with its fields,
    datetimes, which export no buffer format, as numpy's bytes); a buffer of Python object
    references holds no data and is refused, naming the attachment, never stored as pointers."""
    grid = np.arange(24, dtype=">i8").reshape(4, 6)
    arrays = {
        "strided": grid[:, ::2],
        "fortran": np.asfortranarray(grid),
        "scalar": np.array(3.5),
        "flags": np.array([True, False, True]),
        "when": np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
        "span": np.array([5, -1], dtype="timedelta64[ms]"),
        "pairs": np.array([(1, 2.5), (3, -0.0)], dtype=[("a", "<i4"), ("b", ">f8")]),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    record = make_record()
    assert staging.stage(record, attachments=arrays).ok
    found = staging.fetch_attachments(record.staging_key)
    for name, array in arrays.items():
        back = found[name].to_numpy()
        assert back.dtype == array.dtype and back.shape == array.shape, name
        assert back.tobytes() == np.ascontiguousarray(array).tobytes(), name
    assert found["pairs"].to_numpy()["b"].tolist() == [2.5, -0.0]
    pointers = (ctypes.py_object * 2)(1, 2)
    for n, (bad, words) in enumerate(
        [
            (np.array([1, "a"], dtype=object), "holds Python object references"),
            (np.zeros(2, dtype=[("a", "O")]), "holds Python object references"),
            (memoryview(pointers), "holds Python object references"),
        ]
    ):
        refused = staging.stage(make_record(model_call_id=f"o{n}"), attachments={"objs": bad})
        assert not refused.ok, bad
        assert refused.error is not None and "'objs'" in refused.error and words in refused.error
        with pytest.raises(StagingKeyError):
            staging.fetch([f"r/o{n}"])


def test_an_empty_attachments_mapping_is_no_attachments(staging: Store) -> None:
    """NeMo Gym's capture passes ``attachments`` whenever its caller gave a mapping, an empty one
    included: a retry with ``{}`` or ``None`` must be the same call (it was a conflict)."""
    first, second = make_record(), make_record(model_call_id="c2")
    assert staging.stage(first, attachments={}).ok
    assert staging.stage(first).ok
    assert staging.stage(second).ok
    assert staging.stage(second, attachments={}).ok
    assert staging.fetch_attachments(first.staging_key) == {}
    assert not staging.stage(first, attachments={"raw": b"x"}).ok  # still a conflict


def test_equal_attachments_in_another_bytes_like_type_are_the_same_call(staging: Store) -> None:
    """``bytes``, ``bytearray``, ``memoryview`` and ``array('B')`` of the same bytes are the
    same attachment: a restage with another of them is idempotent (it was a conflict: the
    kinds stored differed), and a fetch gives kind ``"bytes"`` back whichever staged it."""
    import array

    first, second = make_record(), make_record(model_call_id="c2")
    assert staging.stage(first, attachments={"raw": b"abc"}).ok
    for same in (bytearray(b"abc"), memoryview(b"abc"), array.array("B", b"abc")):
        assert staging.stage(first, attachments={"raw": same}).ok, type(same)
    assert staging.stage(second, attachments={"raw": bytearray(b"abc")}).ok
    assert staging.stage(second, attachments={"raw": b"abc"}).ok
    for key in (first.staging_key, second.staging_key):
        assert staging.fetch_attachments(key) == {"raw": StagedAttachment("bytes", b"abc")}
    assert not staging.stage(first, attachments={"raw": bytearray(b"abd")}).ok
    assert not staging.stage(first, attachments={"other": b"abc"}).ok
    assert list(staging.fetch_attachments(second.staging_key)["raw"].to_numpy()) == [97, 98, 99]
    # Stored as the same bytes (no re-read of the stored call needed to call it idempotent).
    encoded = {
        encode_stage(first, {"raw": same}).content_digest
        for same in (b"abc", bytearray(b"abc"), memoryview(b"abc"), array.array("B", b"abc"))
    }
    assert len(encoded) == 1


# An older build's attachments blob for ``attachments={}``: an empty list (u32 0) sealed with the
# first 16 bytes of its SHA-256 (`git show 8cd5810^:python/tokencapture/staging_attachments.py`:
# `encode_attachments` returned ``[]``, which the core encoded as this blob); today's build
# stores no blob at all.
_OLD_EMPTY_BLOB = bytes.fromhex("00000000df3f619804a92fdb4057192dc43dd748")
# An older build's blob for ``{"raw": bytearray(b"abc")}``: a buffer of format B, shape (3,).
_OLD_BYTEARRAY = ("raw", 1, "B", "", (3,), [b"abc"])


def _plant_older_row(staging: Store, record: Any, encoded: list[Any]) -> bytes:
    """Store `record` with an attachments blob as an older build encoded it (`encoded`, the
    tuples it handed the core), bypassing today's encoder; returns the stored blob."""
    stored = _core.staging_encode(record, encoded)
    if isinstance(staging, FileStagingStore):
        assert staging._native.stage(record, encoded) == record.staging_key
        segment = next(staging.root.glob("seg-*.tcs")).read_bytes()
        assert segment.endswith(stored.row + stored.attachments)
    else:
        execute(
            staging.dsn,
            "INSERT INTO tokencapture.staged_calls (rollout_id, staging_key, content_digest, "
            "row_bytes, attachments) VALUES ($1, $2, $3, $4, $5)",
            record.rollout_id,
            record.staging_key,
            stored.content_digest,
            stored.row,
            stored.attachments,
        )
    return stored.attachments


def test_a_restage_against_an_older_builds_encoding_is_idempotent(staging: Store) -> None:
    """Calls an older build stored with ``attachments={}`` (an empty blob where today's stores
    none) or a ``bytearray`` (kind ``"buffer"``) are the same calls as a restage of the same
    data now: idempotent, not a conflict (both were refused)."""
    empty, raw = make_record(), make_record(model_call_id="c2")
    assert _plant_older_row(staging, empty, []) == _OLD_EMPTY_BLOB
    assert _plant_older_row(staging, raw, [_OLD_BYTEARRAY]) != _OLD_EMPTY_BLOB
    for attachments in (None, {}):
        assert staging.stage(empty, attachments=attachments).ok, attachments
    for data in (b"abc", bytearray(b"abc")):
        assert staging.stage(raw, attachments={"raw": data}).ok, data
    assert staging.fetch_attachments(empty.staging_key) == {}
    assert staging.fetch_attachments(raw.staging_key) == {"raw": StagedAttachment("bytes", b"abc")}
    assert not staging.stage(empty, attachments={"raw": b"abc"}).ok  # still conflicts
    assert not staging.stage(raw, attachments={"raw": b"abd"}).ok
    assert not staging.stage(raw).ok
    assert [s.staging_key for s in staging.fetch([empty.staging_key, raw.staging_key])] == [
        empty.staging_key,
        raw.staging_key,
    ]


@pytest.mark.parametrize(
    "thing",
    [None, {"rollout_id": "r"}, "r/c1", 7, object()],
    ids=["none", "dict", "str", "int", "object"],
)
def test_something_that_is_not_a_record_is_refused_not_raised(staging: Store, thing: Any) -> None:
    result = staging.stage(thing)
    # Ours, or NeMo Gym's once its records are imported (the store's "auto" models).
    assert type(result).__name__ == "StageResult" and not result.ok
    assert result.error is not None and result.error.startswith(
        "TypeError: a staged record must be a StagedCallRecord"
    )
    # A model built without its fields (model_construct) is refused the same way.
    empty = staging.stage(type(make_record()).model_construct(rollout_id="r"))
    assert not empty.ok and empty.error is not None and "StagedCallRecord" in empty.error
    assert staging.keys() == []


def test_a_record_that_does_not_verify_is_refused(staging: Store) -> None:
    record = make_record()
    bad = record.model_copy(update={"token_ids_delta": [9, 9, 9]})
    result = staging.stage(bad)
    assert not result.ok
    assert result.error == "ValueError: digest does not match staged call contents"
    assert staging.keys() == []


def test_both_backends_answer_alike(
    both: tuple[FileStagingStore, PostgresStagingStore],
) -> None:
    """The same calls on both backends: the same results, errors and fetched models."""
    file_store, pg_store = both
    records = [*chain("x/y", 3), *chain("z", 2)]
    conflicting = make_record("z", "c0", [7, 7, 7, 7])
    quoted = make_record('q"\n\t', "c")
    # One key from two rollouts ("s" + "t/u" and "s/t" + "u"): the second conflicts.
    split = [make_record("s", "t/u"), make_record("s/t", "u")]

    def script(store: Store) -> list[Any]:
        out: list[Any] = [store.stage(r).model_dump() for r in records]
        out.append(store.stage(conflicting).model_dump())
        out.extend(store.stage(r).model_dump() for r in split)
        out.append([s.rollout_id for s in store.fetch(["s/t/u"])])
        out.append(store.stage(quoted).model_dump())
        out.append(store.retire(['q"\n\t']))
        out.append(store.stage(quoted).model_dump())
        out.append([s.model_dump() for s in store.fetch([r.staging_key for r in records])])
        out.append([s.model_dump() for s in store.fetch_records([records[0].staging_key])])
        for keys in (["x/y/nope"], [quoted.staging_key]):
            try:
                store.fetch(keys)
            except StagingKeyError as error:
                out.append((type(error).__name__, str(error)))
        out.append(store.retire(["x/y", "z", "none"]))
        out.append(store.delete(["x/y", "none", 'q"\n\t']))
        out.append(store.keys())
        return out

    assert script(file_store) == script(pg_store)


# ---- only PostgreSQL --------------------------------------------------------------------


def test_damaged_rows_raise_corruption(dsn: str) -> None:  # noqa: F811
    store = PostgresStagingStore(dsn)
    try:
        record = make_record()
        assert store.stage(record, attachments={"a": b"xyz"}).ok
        execute(
            dsn,
            "UPDATE tokencapture.staged_calls SET row_bytes = "
            "overlay(row_bytes placing '\\xff'::bytea from 40 for 1)",
        )
        with pytest.raises(TokenCaptureCorruptionError, match="r/c1"):
            store.fetch([record.staging_key])
        with pytest.raises(TokenCaptureCorruptionError):
            store.fetch_records([record.staging_key])
        execute(dsn, "UPDATE tokencapture.staged_calls SET attachments = '\\x0102'::bytea")
        with pytest.raises(TokenCaptureCorruptionError, match="attachments"):
            store.fetch_attachments(record.staging_key)
    finally:
        store.close_sync()


def test_upgrade_from_schema_version_4(pg_dsn: str) -> None:  # noqa: F811
    assert install_schema_sync(pg_dsn, upto=4)[-1] == "004_lineage_rows.sql"
    # Data of version 4 (clients of an older version would have written it).
    execute(pg_dsn, "SELECT tokencapture.begin_call('kept', 'c1'::bytea)")
    old = PostgresStagingStore(pg_dsn)
    refused = old.stage(make_record())
    assert not refused.ok
    assert refused.error is not None and "PostgresSchemaError" in refused.error
    assert "schema version 4" in refused.error
    old.close_sync()
    assert install_schema_sync(pg_dsn) == [
        "005_staging.sql",
        "006_staging_key_order.sql",
        "007_staging_fence_insert.sql",
    ]
    assert install_schema_sync(pg_dsn) == []
    store = PostgresStagingStore(pg_dsn)
    try:
        assert store.stage(make_record()).ok
        assert store.fetch(["r/c1"])[0].token_ids_delta == [1, 2, 3]
    finally:
        store.close_sync()
    intents = fetch(pg_dsn, "SELECT rollout_id, model_call_id FROM tokencapture.intents")
    assert [(r["rollout_id"], bytes(r["model_call_id"])) for r in intents] == [("kept", b"c1")]
    tokens = PostgresTokenCaptureStore(pg_dsn)
    try:
        assert tokens.is_incomplete("kept") is False  # the upgraded schema serves the old data
    finally:
        tokens.close_sync()


def test_a_session_without_flushed_commits_is_refused(dsn: str) -> None:  # noqa: F811
    execute(dsn, "ALTER ROLE CURRENT_USER SET synchronous_commit = off")
    try:
        store = PostgresStagingStore(dsn, synchronous_commit=None)
        result = store.stage(make_record())
        store.close_sync()
        assert not result.ok
        assert result.error is not None
        assert result.error.startswith("PostgresDurabilityError: ")
        assert "synchronous_commit=off" in result.error
    finally:
        execute(dsn, "ALTER ROLE CURRENT_USER RESET synchronous_commit")
    assert fetch(dsn, "SELECT count(*) AS n FROM tokencapture.staged_calls")[0]["n"] == 0


def test_an_unavailable_server_is_a_failed_stage_with_the_reason(
    pg_server: PgServer,  # noqa: F811
) -> None:
    store = PostgresStagingStore(
        pg_server.dsn_for("postgres").replace(str(pg_server.port), "1"), connect_timeout=2
    )
    try:
        result = store.stage(make_record())
    finally:
        store.close_sync()
    assert not result.ok
    assert result.error is not None
    assert result.error.startswith("PostgresUnavailableError: PostgreSQL at ")


def test_a_nul_in_a_key_is_refused_not_stored(dsn: str) -> None:  # noqa: F811
    store = PostgresStagingStore(dsn)
    try:
        result = store.stage(make_record("r\0x"))
        assert not result.ok and result.error is not None and "NUL" in result.error
        with pytest.raises(StagingKeyError):
            store.fetch(["r\0x/c1"])
        assert store.retire(["r\0x"]) == {"removed": [], "absent": ["r\0x"]}
    finally:
        store.close_sync()


@pytest.mark.parametrize("native", [False, True], ids=["asyncpg", "native"])
def test_stages_from_many_threads_share_commits(dsn: str, native: bool) -> None:  # noqa: F811
    store = PostgresStagingStore(dsn, pool_size=4, native_group_commit=native)
    records = [r for t in range(32) for r in chain(f"t{t}", 20, size=64)]
    results: list[Any] = [None] * len(records)
    barrier = threading.Barrier(32)

    def stage(t: int) -> None:
        barrier.wait()
        for i in range(t * 20, (t + 1) * 20):
            results[i] = store.stage(records[i])

    def commits() -> int:
        return int(
            fetch(
                dsn,
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
            )[0]["xact_commit"]
        )

    try:
        store.stage(make_record("warm"))
        before = commits()
        hops: list[object] = []
        client: Any = store._client
        for name in ("run_sync", "call_in_thread"):
            original = getattr(client, name)
            setattr(client, name, lambda *a, _o=original, **k: hops.append(a) or _o(*a, **k))
        threads = [threading.Thread(target=stage, args=(t,)) for t in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = commits()
        # Led by the calling threads themselves: no stage went through the loop thread.
        assert hops == []
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        fetched = store.fetch([r.staging_key for r in records])
        assert [s.digest for s in fetched] == [r.digest for r in records]
        # 640 stages in far fewer commits (the statistics count a few of their own).
        assert after - before < len(records) // 2
    finally:
        store.close_sync()


@pytest.mark.parametrize("native", [False, True], ids=["asyncpg", "native"])
def test_one_leader_hands_the_lead_on(dsn: str, native: bool) -> None:  # noqa: F811
    """With one batch in flight at a time, every stage that queued behind it is still sent:
    the leader passes the lead to a queued caller (none waits for a newcomer to lead), in
    either group commit."""
    store = PostgresStagingStore(dsn, stage_flushes=1, native_group_commit=native)
    records = [chain(f"h{t}", 10, size=16) for t in range(8)]
    barrier = threading.Barrier(8)
    results: list[list[Any]] = [[] for _ in records]

    def stage(t: int) -> None:
        barrier.wait()
        results[t] = [store.stage(r) for r in records[t]]

    try:
        store.stage(make_record("warm"))
        threads = [threading.Thread(target=stage, args=(t,), daemon=True) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "stages left waiting"
        assert all(r.ok for per in results for r in per)
        keys = [r.staging_key for per in records for r in per]
        assert len(store.fetch(keys)) == 80
    finally:
        store.close_sync()


def test_stage_from_inside_a_running_loop(dsn: str) -> None:  # noqa: F811
    """A synchronous stage called where an event loop runs (it cannot lead a batch on a loop
    of its own there) goes through the loop thread, with the same answers."""
    store = PostgresStagingStore(dsn)
    records = chain("in-loop", 3)

    async def run() -> list[Any]:
        return [store.stage(r) for r in [*records, records[0]]]

    try:
        results = asyncio.run(run())
        assert [r.ok for r in results] == [True] * 4
        assert store._client._thread is not None
        conflict = make_record("in-loop", "c0", [7, 8, 9])
        refused = asyncio.run(run_one(store, conflict))
        assert not refused.ok and refused.error.startswith("TokenCaptureConflictError")
        fetched = store.fetch([r.staging_key for r in records])
        assert [s.digest for s in fetched] == [r.digest for r in records]
    finally:
        store.close_sync()


async def run_one(store: PostgresStagingStore, record: Any) -> Any:
    return store.stage(record)


def test_async_stage_and_fetch(dsn: str) -> None:  # noqa: F811
    store = PostgresStagingStore(dsn)
    records = chain("r", 6)

    async def run() -> None:
        results = await asyncio.gather(*(store.astage(r) for r in records))
        assert all(r.ok for r in results)
        refused = await store.astage(records[0].model_copy(update={"digest": "0" * 64}))
        assert not refused.ok
        keys = [r.staging_key for r in records]
        assert [s.staging_key for s in await store.afetch(keys)] == keys
        fetched = (await store.afetch_records(keys[:1]))[0]
        assert fetched.model_dump() == records[0].model_dump()
        with pytest.raises(TypeError):
            store.afetch("r/c0")  # type: ignore[arg-type]
        await store.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("models", ["nemo_gym", "tokencapture"])
def test_staging_conformance(dsn: str, models: str) -> None:  # noqa: F811
    """tokencapture.conformance's staging checks, every one (across processes too), with NeMo
    Gym's models and ours."""
    from tests.nemo_oracle import import_nemo

    from tokencapture.conformance import STAGING_CHECKS, run_staging_conformance
    from tokencapture.staging import records as ours

    module = import_nemo("staging.records") if models == "nemo_gym" else ours
    factory = functools.partial(PostgresStagingStore, dsn)
    passed = run_staging_conformance(factory, process_factory=factory, records_module=module)
    assert tuple(passed) == STAGING_CHECKS


def test_stage_batch_statuses(dsn: str) -> None:  # noqa: F811
    """The server's batch function, called directly with every case one batch can hold; the
    statuses are written out by hand (0 stored, 1 duplicate, 2 conflict, 4 retired)."""
    store = PostgresStagingStore(dsn)
    try:
        assert store.stage(make_record("old", "c1")).ok
        assert store.stage(make_record("s", "t/u")).ok
        assert store.stage(make_record("fenced", "c1")).ok
        store.retire(["fenced"])
    finally:
        store.close()
    from tokencapture.staging_rows import encode_stage

    def row(record: Any) -> tuple[str, str, str, bytes, bytes | None]:
        encoded = encode_stage(record)
        return encoded.rollout_id, encoded.key, encoded.content_digest, encoded.row, None

    batch = [
        row(make_record("new", "a")),  # stored
        row(make_record("new", "b")),  # stored
        row(make_record("new", "b")),  # the same again in the batch: duplicate
        row(make_record("twice", "x", [1])),  # stored
        row(make_record("twice", "x", [2])),  # the same key, other content: conflict
        row(make_record("old", "c1")),  # stored before, same content: duplicate
        row(make_record("old", "c1", [4, 4])),  # stored before, other content: conflict
        row(make_record("s/t", "u")),  # the key "s/t/u" is another rollout's: conflict
        row(make_record("fenced", "c2")),  # retired
    ]
    columns = [list(column) for column in zip(*batch, strict=True)]
    statuses = fetch(dsn, "SELECT tokencapture.stage_batch($1, $2, $3, $4, $5) AS s", *columns)
    assert statuses[0]["s"] == [0, 0, 1, 0, 2, 1, 2, 2, 4]
    stored = fetch(dsn, "SELECT staging_key, rollout_id FROM tokencapture.staged_calls ORDER BY 1")
    assert [(r["staging_key"], r["rollout_id"]) for r in stored] == [
        ("new/a", "new"),
        ("new/b", "new"),
        ("old/c1", "old"),
        ("s/t/u", "s"),
        ("twice/x", "twice"),
    ]
    store = PostgresStagingStore(dsn)
    try:
        assert store.fetch(["twice/x"])[0].token_ids_delta == [1]
    finally:
        store.close()


class _HeldTransaction:
    """One statement run in a transaction left open on a connection of its own (in a thread
    with its own event loop) until `finish()` commits it: a retire or delete in flight."""

    def __init__(self, database: str, sql: str, *args: object) -> None:
        self._done = threading.Event()
        self._ran = threading.Event()
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._hold(database, sql, *args),), daemon=True
        )
        self._thread.start()
        assert self._ran.wait(30), self._failure

    async def _hold(self, database: str, sql: str, *args: object) -> None:
        import asyncpg

        connection = await asyncpg.connect(database)
        try:
            async with connection.transaction():
                await connection.fetch(sql, *args)
                self._ran.set()
                while not self._done.is_set():
                    await asyncio.sleep(0.01)
        except BaseException as error:
            self._failure.append(error)
            self._ran.set()
            raise
        finally:
            await connection.close()

    def finish(self) -> None:
        self._done.set()
        self._thread.join(30)
        assert not self._failure


@pytest.mark.parametrize("native", [False, True], ids=["asyncpg", "native"])
def test_a_stage_waits_for_a_retire_or_delete_in_flight(dsn: str, native: bool) -> None:  # noqa: F811
    """The fence of schema version 7: a stage inserts its rollout's fence row first and looks
    it up FOR KEY SHARE only when it was there. A retire in flight of a rollout never staged
    has inserted that row (uncommitted): the stage's insert waits for it, then finds the row
    and is refused. A delete in flight of a staged rollout has deleted the row: the stage's
    insert waits for it, then inserts the row again (a fresh rollout, unfenced) and stores the
    call. (The lookup's own loop, for a row deleted between the insert and the lookup, is a
    race this test does not time.)"""
    store = PostgresStagingStore(dsn, native_group_commit=native)
    try:
        assert store.stage(make_record("gone", "c1")).ok

        def staged_meanwhile(
            record: Any,
        ) -> tuple[list[StageResult], bool, threading.Thread]:
            """Stage `record` in a thread: where its result goes, whether it was still waiting
            after half a second, and the thread."""
            results: list[StageResult] = []
            thread = threading.Thread(target=lambda: results.append(store.stage(record)))
            thread.start()
            thread.join(0.5)
            return results, thread.is_alive(), thread

        retire = _HeldTransaction(dsn, "SELECT tokencapture.retire_staging($1)", ["fresh"])
        results, waited, thread = staged_meanwhile(make_record("fresh", "c1"))
        retire.finish()
        thread.join(30)
        assert waited, "a stage did not wait for the retire in flight of its rollout"
        assert not results[0].ok
        assert results[0].error is not None
        assert results[0].error.startswith('TokenCaptureRetiredError: rollout "fresh" is retired')

        delete = _HeldTransaction(dsn, "SELECT tokencapture.delete_staging($1)", ["gone"])
        results, waited, thread = staged_meanwhile(make_record("gone", "c2"))
        delete.finish()
        thread.join(30)
        assert waited, "a stage did not wait for the delete in flight of its rollout"
        assert results[0].ok, results[0].error
        assert store.keys() == ["gone/c2"]
        fences = fetch(dsn, "SELECT rollout_id, retired FROM tokencapture.staging_rollouts")
        assert sorted((r["rollout_id"], r["retired"]) for r in fences) == [
            ("fresh", True),
            ("gone", False),
        ]
    finally:
        store.close_sync()
