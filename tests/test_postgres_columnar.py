"""Columnar snapshots on PostgreSQL: `freeze_columns` / `freeze_columns_now` / `read_columns` of
`PostgresTokenCaptureStore` with exactly its `freeze`'s semantics (fence, digest checks,
incomplete rule, snapshot id, version), and columns equal to the `TokenEntry` snapshot field by
field (on golden rollouts, generated and agentic ones, and damaged lines)."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from tests.conftest import make_entry
from tests.postgres_fixture import execute, pg_dsn, pg_server, store
from tests.test_columnar import GOLDEN_ROLLOUTS, assert_rows_equal, entries_of, lineage_rollout
from tests.test_columnar_shared import LIST_VIEW, assert_same_columns
from tests.test_columnar_shared import rollout as shared_rollout

from tokencapture import _core
from tokencapture.columnar import ColumnarSnapshot
from tokencapture.postgres import PostgresTokenCaptureStore
from tokencapture.postgres.transfer import export_from_directory, import_into_postgres
from tokencapture.protocols import (
    TokenCaptureCorruptionError,
    TokenCaptureRetiredError,
)
from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore

__all__ = ["pg_dsn", "pg_server", "store"]  # the fixtures, imported for pytest


def load_golden(golden_store: Path, pg: PostgresTokenCaptureStore) -> TokenCaptureStore:
    """The golden rollouts copied into the database (`tokencapture copy`'s path)."""
    files = TokenCaptureStore(golden_store)
    for rollout_id in [*GOLDEN_ROLLOUTS, "golden-dropped"]:
        image = export_from_directory(files, rollout_id)
        assert image is not None
        assert pg._client.run_sync(import_into_postgres(pg._client, image))
    return files


def test_golden_columns_equal_the_object_snapshot(
    golden_store: Path, store: PostgresTokenCaptureStore
) -> None:
    files = load_golden(golden_store, store)
    for rollout_id in GOLDEN_ROLLOUTS:
        expected = files.freeze_now(rollout_id)  # the file store's answer on the same data
        read = store.read_columns(rollout_id)
        assert_rows_equal(pa.table(read), store.read_entries(rollout_id))
        snapshot = store.freeze_columns_now(rollout_id)  # columns first: it freezes
        frozen = store.freeze_now(rollout_id)
        assert isinstance(snapshot, ColumnarSnapshot) and snapshot.rollout_id == rollout_id
        assert (snapshot.snapshot_id, snapshot.version) == (frozen.snapshot_id, frozen.version)
        assert snapshot.version == expected.version
        assert snapshot.incomplete == frozen.incomplete == expected.incomplete
        assert frozen.entries == expected.entries
        assert_rows_equal(pa.table(snapshot), expected.entries)
        again = store.freeze_columns_now(rollout_id)
        assert (again.snapshot_id, again.version) == (frozen.snapshot_id, frozen.version)
    with pytest.raises(TokenCaptureRetiredError) as objects:
        store.freeze_now("golden-dropped")
    with pytest.raises(TokenCaptureRetiredError) as columns:
        store.freeze_columns_now("golden-dropped")
    assert str(objects.value) == str(columns.value)
    assert len(store.read_columns("golden-dropped")) == 0
    assert len(store.read_columns("never-written")) == 0


def test_freeze_columns_mints_the_snapshot_and_judges_intents(
    store: PostgresTokenCaptureStore,
) -> None:
    store.append(make_entry("r", 1))
    store._begin_call("r", "call-9")  # an intent without an entry masks the snapshot
    assert len(store.read_columns("r")) == 1
    store.append(make_entry("r", 2))  # read_columns did not freeze
    snapshot = store.freeze_columns_now("r")
    assert snapshot.incomplete and snapshot.version == 3 and len(snapshot.snapshot_id) == 32
    frozen = store.freeze_now("r")
    assert (frozen.snapshot_id, frozen.version, frozen.incomplete) == (
        snapshot.snapshot_id,
        snapshot.version,
        True,
    )
    assert_rows_equal(pa.table(snapshot), frozen.entries)
    assert store.stats()["freeze_columns"]["count"] == 1
    store.retire_now(["r"])
    with pytest.raises(TokenCaptureRetiredError):
        store.freeze_columns_now("r")


async def test_async_freeze_columns_validates_when_called(
    store: PostgresTokenCaptureStore,
) -> None:
    with pytest.raises(ValueError):
        _ = store.freeze_columns("../escape")
    with pytest.raises(TypeError):
        _ = store.freeze_columns(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.read_columns_async("../escape")
    await store.put(make_entry("r", 1))
    assert_rows_equal(pa.table(await store.read_columns_async("r")), [make_entry("r", 1)])
    snapshot = await store.freeze_columns("r")
    frozen = await store.freeze("r")
    assert (snapshot.snapshot_id, snapshot.version) == (frozen.snapshot_id, frozen.version)
    assert_rows_equal(pa.table(snapshot), frozen.entries)
    await store.close()


@given(entries=entries_of())
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_generated_entries_read_back_as_columns(
    entries: list[TokenEntry], store: PostgresTokenCaptureStore
) -> None:
    rollout_id = f"gen-{uuid.uuid4().hex}"
    for entry in entries:
        store.append(entry.model_copy(update={"rollout_id": rollout_id}))
    assert_rows_equal(pa.table(store.read_columns(rollout_id)), store.read_entries(rollout_id))
    snapshot = store.freeze_columns_now(rollout_id)
    frozen = store.freeze_now(rollout_id)
    assert (snapshot.snapshot_id, snapshot.version) == (frozen.snapshot_id, frozen.version)
    assert_rows_equal(pa.table(snapshot), frozen.entries)


def test_an_agentic_rollout_streams_into_columns(store: PostgresTokenCaptureStore) -> None:
    """A log past 256 KiB: taped on a second thread while the columns are built."""
    entries = lineage_rollout("agentic", calls=14, prompt=1500, turn=400, seed=3)
    for entry in entries:
        store.append(entry)
    snapshot = store.freeze_columns_now("agentic")
    assert_rows_equal(pa.table(snapshot), entries)
    cumulative = pa.array(snapshot.cumulative_tokens()).to_pylist()
    last = entries[-1]
    assert cumulative[-1] == [*last.prompt_token_ids, *last.generation_token_ids]


@pytest.mark.parametrize(
    "stored",
    [
        b'{"model_call_id":"call-1","rollout_id":"r1"}',
        b"not json",
        b'{"model_call_id":"call-1",',
        b'{"model_call_id":"call-1","prompt_token_ids":[18446744073709551615]}',
    ],
)
def test_a_damaged_line_is_refused_as_freeze_refuses_it(
    store: PostgresTokenCaptureStore, pg_dsn: str, stored: bytes
) -> None:
    store.append(make_entry())
    execute(
        pg_dsn,
        "UPDATE tokencapture.entries SET line = $1, digest = $2",
        stored,
        _core.payload_digest(stored),
    )
    for objects, columns in (
        (lambda: store.read_entries("r1"), lambda: store.read_columns("r1")),
        (lambda: store.freeze_now("r1"), lambda: store.freeze_columns_now("r1")),
    ):
        with pytest.raises(TokenCaptureCorruptionError, match="in PostgreSQL") as refused:
            objects()
        with pytest.raises(TokenCaptureCorruptionError) as refused_columns:
            columns()
        assert str(refused_columns.value) == str(refused.value)


@pytest.mark.parametrize(("seed", "calls"), [(1, 1), (2, 9), (3, 20)])
async def test_shared_prefixes_give_the_default_ids_as_a_list_view(
    store: PostgresTokenCaptureStore, seed: int, calls: int
) -> None:
    """`shared_prefixes=True` on PostgreSQL: the file store's list view, over chains with
    forks, re-renders and empty prompts, with exactly the default columns' ids."""
    try:
        rollout_id = f"shared-{seed}"
        entries = shared_rollout(random.Random(seed), rollout_id, calls, 400)
        for entry in entries:
            await store.put(entry)
        default = pa.table(await store.read_columns_async(rollout_id))
        assert_same_columns(
            pa.table(await store.read_columns_async(rollout_id, shared_prefixes=True)), default
        )
        assert_same_columns(pa.table(store.read_columns(rollout_id, shared_prefixes=True)), default)
        snapshot = await store.freeze_columns(rollout_id, shared_prefixes=True)
        frozen = await store.freeze(rollout_id)
        assert (snapshot.snapshot_id, snapshot.version) == (frozen.snapshot_id, frozen.version)
        shared = pa.table(snapshot)
        assert shared.schema.field("prompt_token_ids").type == LIST_VIEW
        assert_same_columns(shared, default)
        assert shared["prompt_token_ids"].to_pylist() == [e.prompt_token_ids for e in entries]
        assert_same_columns(
            pa.table(store.freeze_columns_now(rollout_id, shared_prefixes=True)), default
        )
        # A flag that is not a bool is refused when called, before any round trip.
        with pytest.raises(TypeError, match="shared_prefixes"):
            _ = store.freeze_columns(rollout_id, shared_prefixes=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="shared_prefixes"):
            _ = store.read_columns_async(rollout_id, shared_prefixes="yes")  # type: ignore[arg-type]
    finally:
        await store.close()
