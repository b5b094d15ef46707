"""Refusals of the staging stores: each stage is refused for its own reason only, as
`StageResult(ok=False)` (never an exception), with words that say what is wrong; and a restage
whose attachments come in another order is the same call. Both backends where both apply."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from tests.postgres_fixture import dsn, execute, pg_dsn, pg_server  # noqa: F401
from tests.staging_backends import make_record
from tests.staging_fixture import Store, staging_backend  # noqa: F401

import tokencapture.postgres.staging as pg_staging
from tokencapture.postgres import PostgresStagingStore


@pytest.fixture(params=["postgres", "postgres-native"])
def pg_staging_store(request: pytest.FixtureRequest) -> Iterator[PostgresStagingStore]:
    """The PostgreSQL store through each path, one batch in flight at a time."""
    database = request.getfixturevalue("dsn")
    store = PostgresStagingStore(
        database, native_group_commit=request.param == "postgres-native", stage_flushes=1
    )
    yield store
    store.close_sync()


# ---- a refused stage fails no other stage of its batch (PostgreSQL) ---------------------


def _poison(database: str) -> None:
    """A trigger that makes the server refuse the stages of rollout 'poison' (an error the
    client cannot foresee) and hold the stages of rollout 'slow' for a while (so the stages
    that come meanwhile queue into one batch)."""
    execute(
        database,
        """
        CREATE FUNCTION tokencapture.test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.rollout_id = 'poison' THEN
                RAISE EXCEPTION 'poisoned stage %', NEW.staging_key
                    USING ERRCODE = 'check_violation';
            END IF;
            IF NEW.rollout_id = 'slow' THEN
                PERFORM pg_sleep(1.0);
            END IF;
            RETURN NEW;
        END
        $$
        """,
    )
    execute(
        database,
        """
        CREATE TRIGGER test_poison BEFORE INSERT ON tokencapture.staged_calls
            FOR EACH ROW EXECUTE FUNCTION tokencapture.test_poison()
        """,
    )


def test_a_stage_the_server_refuses_fails_no_other_stage_of_its_batch(
    pg_staging_store: PostgresStagingStore,
    dsn: str,  # noqa: F811
) -> None:
    store = pg_staging_store
    _poison(dsn)
    assert store.stage(make_record("warm", "c0")).ok
    results: dict[str, Any] = {}

    def stage(rollout: str, call: str) -> None:
        results[f"{rollout}/{call}"] = store.stage(make_record(rollout, call))

    slow = threading.Thread(target=stage, args=("slow", "c0"))
    slow.start()
    time.sleep(0.3)  # the slow stage's batch is in flight: what follows queues behind it
    threads = [threading.Thread(target=stage, args=(f"r{n}", "c0")) for n in range(12)]
    threads.insert(6, threading.Thread(target=stage, args=("poison", "c0")))
    for thread in threads:
        thread.start()
    for thread in [slow, *threads]:
        thread.join()
    poisoned = results.pop("poison/c0")
    assert not poisoned.ok and "poisoned stage poison/c0" in poisoned.error
    assert all(result.ok for result in results.values()), {
        key: result.error for key, result in results.items() if not result.ok
    }
    assert len(results) == 13
    assert sorted(store.keys()) == sorted([*results, "warm/c0"])


def test_a_stage_the_server_refuses_fails_no_other_astage_of_its_batch(
    dsn: str,  # noqa: F811
) -> None:
    _poison(dsn)
    store = PostgresStagingStore(dsn, stage_flushes=1)

    async def run() -> list[Any]:
        records = [make_record(f"r{n}", "c0") for n in range(12)]
        records.insert(5, make_record("poison", "c0"))
        try:
            # The first call learns whether the server is a Citus cluster; batches follow.
            assert (await store.astage(make_record("warm", "c0"))).ok
            return list(await asyncio.gather(*(store.astage(r) for r in records)))
        finally:
            await store.aclose()

    results = asyncio.run(run())
    poisoned = results.pop(5)
    assert not poisoned.ok and "poisoned stage poison/c0" in poisoned.error
    assert all(result.ok for result in results), [r.error for r in results]
    store = PostgresStagingStore(dsn)
    try:
        assert len(store.keys()) == 13
    finally:
        store.close_sync()


# ---- attachments in another order are the same call (both stores) ----------------------


def test_restage_with_the_same_attachments_in_another_order_is_idempotent(
    staging: Store,
) -> None:
    record = make_record("r", "c1")
    first = staging.stage(record, attachments={"pixels": b"P", "mask": b"M"})
    assert first.ok, first.error
    again = staging.stage(record, attachments={"mask": b"M", "pixels": b"P"})
    assert again.ok, again.error
    assert again.staging_key == first.staging_key
    # Still a conflict when the content differs; what was stored first is what is fetched.
    other = staging.stage(record, attachments={"mask": b"M", "pixels": b"Q"})
    assert not other.ok and "TokenCaptureConflictError" in other.error
    fewer = staging.stage(record, attachments={"pixels": b"P"})
    assert not fewer.ok and "TokenCaptureConflictError" in fewer.error
    fetched = staging.fetch_attachments(first.staging_key)
    assert {name: bytes(a) for name, a in fetched.items()} == {"pixels": b"P", "mask": b"M"}
    assert list(fetched) == ["pixels", "mask"]  # the stored order is the first stage's


def test_restage_of_arrays_in_another_order_is_idempotent(staging: Store) -> None:
    record = make_record("r", "c2")
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = bytearray(b"bytes")
    assert staging.stage(record, attachments={"a": a, "b": b, "c": b"c"}).ok
    again = staging.stage(record, attachments={"c": b"c", "b": bytes(b), "a": a.copy()})
    assert again.ok, again.error


# ---- failures are answers, not exceptions (both stores) ---------------------------------


class _RaisesOnGetattr:
    def __getattr__(self, name: str) -> Any:
        raise ZeroDivisionError(f"no {name}")


class _ArrowRaises:
    def __arrow_c_array__(self, requested_schema: Any = None) -> Any:
        raise AttributeError("boom from __arrow_c_array__")


class _ItemsRaise(Mapping[str, Any]):
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        raise self.error

    def __len__(self) -> int:
        return 1

    def items(self) -> Any:
        raise self.error


def test_a_record_whose_attributes_raise_is_refused(staging: Store) -> None:
    result = staging.stage(_RaisesOnGetattr())
    assert type(result).__name__ == "StageResult" and not result.ok  # NeMo Gym's or ours
    assert result.error.startswith("ZeroDivisionError: no ")


def test_an_attachment_whose_arrow_export_raises_is_refused(staging: Store) -> None:
    result = staging.stage(make_record("r", "c1"), attachments={"a": _ArrowRaises()})
    assert not result.ok
    assert "'a'" in result.error and "_ArrowRaises" in result.error
    assert "AttributeError: boom from __arrow_c_array__" in result.error
    assert staging.keys() == []


def test_attachments_whose_items_raise_are_refused(staging: Store) -> None:
    result = staging.stage(make_record("r", "c1"), attachments=_ItemsRaise(OverflowError("big")))
    assert not result.ok and result.error == "OverflowError: big"
    assert staging.keys() == []


def test_a_keyboard_interrupt_is_not_swallowed(staging: Store) -> None:
    with pytest.raises(KeyboardInterrupt):
        staging.stage(make_record("r", "c1"), attachments=_ItemsRaise(KeyboardInterrupt()))
    assert staging.stage(make_record("r", "c1")).ok


def test_astage_answers_failures_too(dsn: str) -> None:  # noqa: F811
    store = PostgresStagingStore(dsn)

    async def run() -> None:
        try:
            refused = await store.astage(_RaisesOnGetattr())
            assert not refused.ok and refused.error.startswith("ZeroDivisionError: ")
            items = _ItemsRaise(OverflowError("big"))
            refused = await store.astage(make_record("r", "c1"), attachments=items)
            assert not refused.ok and refused.error == "OverflowError: big"
        finally:
            await store.aclose()

    asyncio.run(run())


class _BadArrow:
    def __arrow_c_array__(self, requested_schema: Any = None) -> Any:
        return (1, 2)


def test_refusals_from_deep_inside_name_the_attachment_and_its_type(staging: Store) -> None:
    odd = np.zeros(
        2, dtype=np.dtype({"names": ["a", "b"], "formats": ["<i4", "<i4"], "offsets": [4, 0]})
    )
    result = staging.stage(make_record("r", "c1"), attachments={"pixels": odd})
    assert not result.ok
    assert result.error.startswith("TypeError: attachment 'pixels' is a numpy.ndarray")
    assert "descr" in result.error  # numpy's own words are kept
    result = staging.stage(make_record("r", "c2"), attachments={"pixels": _BadArrow()})
    assert not result.ok
    assert result.error.startswith("TypeError: attachment 'pixels' is a ")
    assert "_BadArrow" in result.error
    assert staging.keys() == []


def test_a_masked_array_is_refused_not_stored_without_its_mask(staging: Store) -> None:
    """A numpy masked array exports its data's buffer alone: it was stored `ok=True` and came
    back a plain array, its mask dropped without a word (NeMo Gym's rule: an attachment is
    never silently dropped). A plain array and the mask as its own attachment still stage."""
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    result = staging.stage(make_record("r", "c1"), attachments={"scores": masked})
    assert not result.ok
    assert result.error.startswith("TypeError: attachment 'scores' is a numpy.ma.")
    assert "mask" in result.error and staging.keys() == []
    split = {"scores": masked.filled(0.0), "mask": np.ma.getmaskarray(masked)}
    assert staging.stage(make_record("r", "c1"), attachments=split).ok
    back = staging.fetch_attachments("r/c1")
    assert back["mask"].to_numpy().tolist() == [False, True, False]


# ---- PostgreSQL's limits are refused before anything is sent -----------------------------


def test_an_oversize_stage_is_refused_before_it_is_sent(
    pg_staging_store: PostgresStagingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = pg_staging_store
    assert pg_staging._MAX_STAGE_BYTES == (1 << 30) - (1 << 20)
    monkeypatch.setattr(pg_staging, "_MAX_STAGE_BYTES", 4096)
    record = make_record("r", "c1")
    result = store.stage(record, attachments={"small": b"s", "big": np.zeros(5000, np.uint8)})
    assert not result.ok
    assert result.error.startswith("ValueError: ")
    assert "'big' (5000 bytes)" in result.error and "4096 bytes" in result.error
    assert "Unavailable" not in result.error
    assert store.keys() == []
    if store.native_fallback_reason is not None:  # the asyncpg path
        # A row over the limit on its own too (the native path checks the attachments
        # before it encodes; a row of over 1 GiB, tens of millions of tokens, it does not).
        monkeypatch.setattr(pg_staging, "_MAX_STAGE_BYTES", 100)
        result = store.stage(make_record("r", "c2"))
        assert not result.ok and "100 bytes" in result.error
    monkeypatch.undo()
    assert store.stage(record, attachments={"big": np.zeros(5000, np.uint8)}).ok


def test_astage_refuses_an_oversize_stage_too(
    dsn: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pg_staging, "_MAX_STAGE_BYTES", 4096)
    store = PostgresStagingStore(dsn)

    async def run() -> None:
        try:
            result = await store.astage(make_record("r", "c1"), attachments={"big": b"x" * 5000})
            assert not result.ok and "'big' (5000 bytes)" in result.error
        finally:
            await store.aclose()

    asyncio.run(run())


def test_a_key_too_long_for_the_index_is_refused_with_the_limit(
    pg_staging_store: PostgresStagingStore,
) -> None:
    store = pg_staging_store
    # Incompressible (PostgreSQL compresses a long index entry when it can).
    longest = secrets.token_hex(2000)[: pg_staging._MAX_KEY_BYTES - 3]
    fits = store.stage(make_record(longest, "c1"))  # key: 2689 + 1 + 2 bytes
    assert fits.ok, fits.error
    assert store.fetch([fits.staging_key])[0].rollout_id == longest
    result = store.stage(make_record(longest, "c12"))
    assert not result.ok
    assert result.error.startswith("ValueError: staging key ")
    assert f"{pg_staging._MAX_KEY_BYTES + 1} bytes" in result.error
    assert f"at most {pg_staging._MAX_KEY_BYTES} bytes" in result.error
    long_id = secrets.token_hex(1500)
    result = store.stage(make_record(long_id, "c1"))
    assert not result.ok and "btree" in result.error and "ProgramLimit" not in result.error
    # Multi-byte characters count as their UTF-8 bytes.
    result = store.stage(make_record("é" * 1400, "c1"))
    assert not result.ok and "2803 bytes" in result.error
    assert store.keys() == [fits.staging_key]


def test_a_long_key_among_concurrent_stages_fails_only_itself(
    pg_staging_store: PostgresStagingStore,
) -> None:
    store = pg_staging_store
    results: dict[str, Any] = {}
    long_id = secrets.token_hex(1500)

    def stage(rollout: str, calls: int) -> None:
        for n in range(calls):
            results[f"{rollout}/c{n}"] = store.stage(make_record(rollout, f"c{n}"))

    threads = [threading.Thread(target=stage, args=(f"r{n}", 20)) for n in range(6)]
    threads.append(threading.Thread(target=stage, args=(long_id, 20)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = {key for key, result in results.items() if not result.ok}
    assert failed == {f"{long_id}/c{n}" for n in range(20)}


@pytest.mark.parametrize("native", [False, True])
def test_a_large_stage_is_sent_alone_so_no_batch_passes_the_message_limit(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A batch is one message, which PostgreSQL holds to 1 GiB: 256 stages of 5 MB each would
    pass it and fail all 256 as "unavailable". A stage larger than its share of half that
    limit goes alone; the others are batched as before. (The limit is scaled down here.)"""
    monkeypatch.setattr(pg_staging, "_BATCHED_BYTES_PER_BATCH", 4096)
    store = PostgresStagingStore(
        request.getfixturevalue("dsn"), stage_batch_size=4, native_group_commit=native
    )  # so a stage of more than 1,024 bytes goes alone
    batched: list[str] = []
    group_stage, native_stage = store._group.stage, store._stage_native

    def spy_group(args: Any) -> Any:
        batched.append(args[1])
        return group_stage(args)

    def spy_native(group: Any, record: Any, encoded: Any) -> Any:
        batched.append(f"{record.rollout_id}/{record.model_call_id}")
        return native_stage(group, record, encoded)

    monkeypatch.setattr(store._group, "stage", spy_group)
    monkeypatch.setattr(store, "_stage_native", spy_native)
    try:
        assert store.stage(make_record("warm")).ok  # the first stage learns the server's kind
        batched.clear()
        small = store.stage(make_record("small"), attachments={"a": b"x" * 100})
        large = store.stage(make_record("large"), attachments={"a": b"y" * 4000})
        assert small.ok and large.ok, (small.error, large.error)
        assert batched == ["small/c1"]
        (attachment,) = store.fetch_attachments("large/c1").values()
        assert bytes(attachment) == b"y" * 4000
        again = store.stage(make_record("large"), attachments={"a": b"y" * 4000})
        assert again.ok and again.staging_key == "large/c1"  # alone, still idempotent
    finally:
        store.close()
