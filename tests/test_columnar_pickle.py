"""Pickling columnar snapshots (for trainers' multiprocessing data loaders).

`ColumnarEntries` and `ColumnarArray` pickle as their record batch written as an Arrow IPC
stream (docs/columnar.md, "Pickling"); a copy must hold the same columns, byte for byte in
every buffer (nulls, float bits, the shared-prefix list view), and work as the original does.
The constructors that unpickle refuse anything but a stream of one batch with exactly the
class's schema, with a `ValueError` naming what is wrong.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import pickle
import random
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from tests.conftest import make_entry
from tests.test_columnar import EXPECTED_SCHEMA, float_bits, lineage_rollout

from tokencapture import _core
from tokencapture.columnar import ColumnarArray, ColumnarEntries, ColumnarSnapshot
from tokencapture.records import ParentResolutionStatus, TokenEntry
from tokencapture.store import TokenCaptureStore

PROTOCOLS = range(2, pickle.HIGHEST_PROTOCOL + 1)
LIST_VIEW = pa.list_view(pa.field("item", pa.int64(), False))
CUMULATIVE_FIELD = pa.field(
    "cumulative_token_ids", pa.list_(pa.field("item", pa.int64(), False)), nullable=False
)


def snapshot_schema(shared: bool) -> pa.Schema:
    if not shared:
        return EXPECTED_SCHEMA
    at = EXPECTED_SCHEMA.get_field_index("prompt_token_ids")
    return EXPECTED_SCHEMA.set(at, pa.field("prompt_token_ids", LIST_VIEW, nullable=False))


def rollout_entries() -> list[TokenEntry]:
    """An agentic chain with long prompts (the shared layout reuses them), then entries with
    the nullable fields set and unset, -0.0 floats, int64's extremes, a delta-encoded prompt,
    empty token lists and an extra field."""
    entries = lineage_rollout("p", calls=5, prompt=200, turn=60, seed=11)
    last = entries[-1].model_call_id
    entries.append(
        make_entry(
            "p",
            "delta",
            prompt_token_ids=[2**63 - 1, 0],
            generation_token_ids=[1, -(2**63)],
            generation_log_probs=[-0.0, -1e-300],
            created_at=-0.0,
            prompt_is_delta=True,
            parent_call_id=last,
            parent_resolution=ParentResolutionStatus.RESOLVED,
            response_id="resp-1",
            routed_experts=[[1, 2], [3]],
            output_items=[{"type": "message"}],
            token_item_index=0,
            x_note={"k": [1.5, None]},
        )
    )
    entries.append(
        make_entry(
            "p", "empty", prompt_token_ids=[], generation_token_ids=[], generation_log_probs=[]
        )
    )
    return entries


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    store = TokenCaptureStore(tmp_path)
    for entry in rollout_entries():
        store.append(entry)
    return store


def roundtrip(value: Any, protocol: int) -> Any:
    return pickle.loads(pickle.dumps(value, protocol=protocol))


def layout(table: pa.Table) -> list[list[bytes | None]]:
    """Every buffer of every column (children included), as bytes: the exact layout, float
    bits and a list view's shared regions included. A validity buffer of a column without
    nulls may be present or absent; it means the same either way."""

    def buffers(array: pa.Array) -> list[bytes | None]:
        out = [None if buffer is None else buffer.to_pybytes() for buffer in array.buffers()]
        if array.null_count == 0:
            out[0] = None
        return out

    result = []
    for column in table.columns:
        assert column.num_chunks == 1
        chunk = column.chunk(0)
        parts = buffers(chunk)
        if pa.types.is_list(chunk.type) or pa.types.is_list_view(chunk.type):
            # buffers() flattens the child's buffers after the parent's; the child's
            # validity is normalised as the parent's is.
            child = chunk.values
            parts = [*parts[: len(parts) - len(child.buffers())], *buffers(child)]
        result.append(parts)
    return result


def assert_same_fields(copy: Any, original: ColumnarSnapshot) -> None:
    """The dataclass fields other than `entries` survive as they were."""
    assert isinstance(copy, ColumnarSnapshot)
    names = [field.name for field in dataclasses.fields(ColumnarSnapshot)]
    assert names == ["rollout_id", "entries", "incomplete", "snapshot_id", "version"]
    for name in names:
        if name != "entries":
            assert getattr(copy, name) == getattr(original, name), name
    assert copy.rollout_id == "p" and copy.snapshot_id and copy.version > 0


def assert_same_entries(copy: Any, original: Any, shared: bool) -> None:
    """The copy holds the original's columns exactly and works as it does."""
    assert type(copy) is type(original)
    expected_table = pa.table(original)
    table = pa.table(copy)
    assert table.schema == snapshot_schema(shared)
    assert table.equals(expected_table)
    assert layout(table) == layout(expected_table)
    assert float_bits(table.to_pylist()) == float_bits(expected_table.to_pylist())
    assert len(copy) == len(original) == table.num_rows
    assert copy.num_rows == original.num_rows
    entries = copy.entries if isinstance(copy, ColumnarSnapshot) else copy
    assert entries.column_names == snapshot_schema(shared).names
    assert pa.record_batch(entries).equals(expected_table.to_batches()[0])
    assert pa.schema(copy) == snapshot_schema(shared)
    (batch,) = list(pa.RecordBatchReader.from_stream(copy))
    assert batch.equals(expected_table.to_batches()[0])
    cumulative = pa.array(copy.cumulative_tokens())
    assert cumulative.equals(pa.array(original.cumulative_tokens()))
    assert cumulative.type == CUMULATIVE_FIELD.type


@pytest.mark.parametrize("shared", [False, True], ids=["list", "list-view"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_snapshot_round_trips_through_pickle(
    store: TokenCaptureStore, protocol: int, shared: bool
) -> None:
    snapshot = store.freeze_columns_now("p", shared_prefixes=shared)
    copy = roundtrip(snapshot, protocol)
    assert_same_fields(copy, snapshot)
    assert_same_entries(copy, snapshot, shared)
    # The rows are the entries that were put (the copy is not merely equal to a wrong original).
    rows = pa.table(copy).to_pylist()
    entries = rollout_entries()
    assert [row["model_call_id"] for row in rows] == [e.model_call_id for e in entries]
    assert [row["prompt_token_ids"] for row in rows] == [e.prompt_token_ids for e in entries]
    assert [row["response_id"] for row in rows] == [e.response_id for e in entries]
    assert struct.pack("<d", rows[-2]["created_at"]) == struct.pack("<d", -0.0)
    # A copy of a copy is still the same.
    assert_same_entries(roundtrip(copy, protocol), snapshot, shared)


def test_the_shared_prefix_layout_survives_unexpanded(store: TokenCaptureStore) -> None:
    snapshot = store.freeze_columns_now("p", shared_prefixes=True)
    prompts = pa.table(roundtrip(snapshot, 5))["prompt_token_ids"].chunk(0)
    assert pa.types.is_list_view(prompts.type)
    sizes = prompts.sizes.to_numpy()
    # Repeated prompts still point into one values buffer (fewer values than the rows hold).
    assert len(prompts.values) < sizes.sum()
    original = pa.table(snapshot)["prompt_token_ids"].chunk(0)
    assert prompts.offsets.equals(original.offsets)
    assert prompts.values.equals(original.values)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_entries_and_the_cumulative_array_pickle_on_their_own(
    store: TokenCaptureStore, protocol: int
) -> None:
    for shared in (False, True):
        entries = store.read_columns("p", shared_prefixes=shared)
        copy = roundtrip(entries, protocol)
        assert isinstance(copy, ColumnarEntries)
        assert_same_entries(copy, entries, shared)
    array = store.freeze_columns_now("p").cumulative_tokens()
    copied = roundtrip(array, protocol)
    assert isinstance(copied, ColumnarArray)
    assert len(copied) == len(array)
    assert pa.array(copied).equals(pa.array(array))
    assert pa.field(copied) == pa.field(array) == CUMULATIVE_FIELD
    rows = pa.array(copied).to_pylist()
    for row, entry in zip(rows, rollout_entries(), strict=True):
        if not entry.prompt_is_delta:
            assert row == [*entry.prompt_token_ids, *entry.generation_token_ids]
    # The delta entry is its parent's sequence, then its own prompt and generation.
    parent, delta = rows[-3], rows[-2]
    assert delta == [*parent, 2**63 - 1, 0, 1, -(2**63)]


def test_an_empty_snapshot_pickles(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    for shared in (False, True):
        entries = store.read_columns("never-written", shared_prefixes=shared)
        copy = roundtrip(entries, pickle.HIGHEST_PROTOCOL)
        assert len(copy) == 0
        assert pa.table(copy).schema == snapshot_schema(shared)
        assert len(pa.array(copy.cumulative_tokens())) == 0


def bits_of(value: float) -> int:
    (bits,) = struct.unpack("<q", struct.pack("<d", value))
    return int(bits)


def float_of(bits: int) -> float:
    (value,) = struct.unpack("<d", struct.pack("<q", bits))
    return float(value)


# NaNs with payloads and signs, -0.0 and infinities: values no JSON log holds, so they are
# written here with pyarrow into an IPC stream the constructor accepts like a pickled one.
ODD_FLOATS = [
    0x7FF8_0000_0000_0001,  # a quiet NaN with a payload
    -0x0007_FFFF_FFFF_FFFF,  # a negative NaN (0xFFF8_0000_0000_0001)
    0x7FF0_0000_0000_0001,  # a signalling NaN
    bits_of(-0.0),
    bits_of(float("inf")),
    bits_of(-float("inf")),
]


def foreign_table(**changes: Any) -> pa.Table:
    """A two-row table with exactly a snapshot's schema, written by pyarrow; `changes` replace
    columns (by name) with other arrays."""
    floats = pa.array(
        struct.unpack(f"<{len(ODD_FLOATS)}d", struct.pack(f"<{len(ODD_FLOATS)}q", *ODD_FLOATS)),
        pa.float64(),
    )
    item = pa.field("item", pa.int64(), False)
    columns: dict[str, pa.Array] = {
        "schema_version": pa.array([1, 1], pa.int64()),
        "rollout_id": pa.array(["f", "f"]),
        "model_call_id": pa.array(["a", "b"]),
        "model": pa.array(["m", "m"]),
        "prompt_token_ids": pa.array([[1, 2], []], pa.list_(item)),
        "generation_token_ids": pa.array([[3] * 4, [4, 5]], pa.list_(item)),
        "generation_log_probs": pa.ListArray.from_arrays(
            pa.array([0, 4, 6], pa.int32()),
            floats,
            type=pa.list_(pa.field("item", pa.float64(), False)),
        ),
        "routed_experts": pa.array([None, "[1]"]),
        "output_items": pa.array(["[]", "[]"]),
        "token_item_index": pa.array([None, 0], pa.int64()),
        "response_id": pa.array([None, "x"]),
        "created_at": pa.array([float_of(ODD_FLOATS[0]), -0.0]),
        "parent_call_id": pa.array([None, "a"]),
        "cum_len": pa.array([None, None], pa.int64()),
        "digest": pa.array([None, None], pa.utf8()),
        "parent_resolution": pa.array([None, "resolved"]),
        "continuation_fingerprint": pa.array(["", ""]),
        "continuation_context_len": pa.array([0, 0], pa.int64()),
        "continuation_context_digest": pa.array(["", ""]),
        "parent_resolution_reason": pa.array(["", ""]),
        "fingerprint_version": pa.array([None, 1], pa.int64()),
        "prompt_is_delta": pa.array([False, True]),
        "prefix_requested": pa.array([False, False]),
        "prefix_supplied": pa.array([False, False]),
        "extras": pa.array([None, "{}"]),
    }
    columns.update(changes)
    # The snapshot's fields, each with its (maybe changed) column's type.
    fields = [
        EXPECTED_SCHEMA.field(name).with_type(column.type) for name, column in columns.items()
    ]
    return pa.Table.from_arrays(list(columns.values()), schema=pa.schema(fields))


def ipc_stream(*batches: pa.RecordBatch | pa.Table, schema: pa.Schema | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    schema = schema if schema is not None else batches[0].schema
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write(batch)
    return bytes(sink.getvalue().to_pybytes())


def test_odd_float_bits_survive_a_pickle() -> None:
    table = foreign_table()
    assert table.schema == EXPECTED_SCHEMA
    entries = _core.columnar_entries_from_ipc(ipc_stream(table))
    for protocol in PROTOCOLS:
        copy = roundtrip(entries, protocol)
        got = pa.table(copy)
        assert got.schema == EXPECTED_SCHEMA
        values = got["generation_log_probs"].chunk(0).values.to_numpy(zero_copy_only=True)
        assert [int(bits) for bits in values.view("int64")] == ODD_FLOATS
        created_at = got["created_at"].chunk(0).to_numpy(zero_copy_only=True)
        assert [int(bits) for bits in created_at.view("int64")] == [ODD_FLOATS[0], bits_of(-0.0)]
        assert layout(got) == layout(pa.table(entries))
        assert got.column("response_id").to_pylist() == [None, "x"]
        assert pa.array(copy.cumulative_tokens()).to_pylist() == [
            [1, 2, 3, 3, 3, 3],
            [1, 2, 3, 3, 3, 3, 4, 5],
        ]


# A spawned worker: what a data loader's worker process sees --------------------------------


def worker_reads(snapshot: ColumnarSnapshot) -> tuple[pa.Table, list[Any], str, int, Any]:
    """In the spawned child: the table, the cumulative sequences, the fields, and the snapshot
    itself (pickled again on the way back)."""
    return (
        pa.table(snapshot),
        pa.array(snapshot.cumulative_tokens()).to_pylist(),
        snapshot.snapshot_id,
        len(snapshot),
        snapshot,
    )


@pytest.mark.parametrize("shared", [False, True], ids=["list", "list-view"])
def test_a_spawned_worker_reads_a_pickled_snapshot(store: TokenCaptureStore, shared: bool) -> None:
    snapshot = store.freeze_columns_now("p", shared_prefixes=shared)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        table, cumulative, snapshot_id, length, back = pool.apply(worker_reads, (snapshot,))
    assert table.equals(pa.table(snapshot))
    assert layout(table) == layout(pa.table(snapshot))
    assert cumulative == pa.array(snapshot.cumulative_tokens()).to_pylist()
    assert (snapshot_id, length) == (snapshot.snapshot_id, len(snapshot))
    assert_same_fields(back, snapshot)
    assert_same_entries(back, snapshot, shared)


# Damaged and foreign payloads: a ValueError naming what is wrong -----------------------------


def payload_of(value: Any) -> bytes:
    constructor, (data,) = value.__reduce__()
    assert constructor in (_core.columnar_entries_from_ipc, _core.columnar_array_from_ipc)
    assert isinstance(data, bytes)
    return data


def accepted_or_refused(data: bytes) -> str:
    """What a damaged payload gives: "refused" (a ValueError naming the class, returned as
    its message) or, where the damage hit only values, "accepted" (a valid batch). Anything
    else (another exception, a crash) fails the test."""
    try:
        entries = _core.columnar_entries_from_ipc(data)
    except ValueError as exc:
        return f"refused: {exc}"
    table = pa.table(entries)
    table.validate(full=True)
    assert table.schema in (EXPECTED_SCHEMA, snapshot_schema(True))
    # A flipped flag or call id may break a delta chain: refused as on any snapshot.
    with contextlib.suppress(ValueError):
        entries.cumulative_tokens()
    return "accepted"


@pytest.mark.parametrize("shared", [False, True], ids=["list", "list-view"])
def test_every_truncation_is_refused(store: TokenCaptureStore, shared: bool) -> None:
    data = payload_of(store.read_columns("p", shared_prefixes=shared))
    for end in range(len(data)):
        with pytest.raises(ValueError, match=r"not a pickled ColumnarEntries: .*(truncated|empty)"):
            _core.columnar_entries_from_ipc(data[:end])
    assert len(_core.columnar_entries_from_ipc(data)) == len(rollout_entries())


@pytest.mark.parametrize("shared", [False, True], ids=["list", "list-view"])
def test_flipped_bytes_are_refused_or_read_as_valid_data(
    store: TokenCaptureStore, shared: bool
) -> None:
    data = payload_of(store.read_columns("p", shared_prefixes=shared))
    rng = random.Random(5)
    outcomes = []
    # Every byte of the schema and batch headers, then a sample of the body.
    positions = [*range(min(len(data), 2048)), *rng.sample(range(len(data)), 400)]
    for at in positions:
        damaged = bytearray(data)
        damaged[at] ^= 1 << rng.randrange(8)
        outcomes.append(accepted_or_refused(bytes(damaged)))
        damaged[at] = rng.randrange(256)
        outcomes.append(accepted_or_refused(bytes(damaged)))
    refusals = [outcome for outcome in outcomes if outcome != "accepted"]
    assert all(r.startswith("refused: not a pickled ColumnarEntries: ") for r in refusals)
    # Damage arrow-ipc's reader would panic on (a buffer outside its body, a misaligned one,
    # a type the schema check has not seen yet) is refused before it gets there: its panic
    # guard (this message) stays unused.
    assert not [r for r in refusals if "the Arrow IPC reader failed" in r]
    assert len(refusals) > 100
    assert outcomes.count("accepted") > 100


def test_foreign_payloads_are_refused_by_name(store: TokenCaptureStore) -> None:
    data = payload_of(store.read_columns("p"))
    array_data = payload_of(store.freeze_columns_now("p").cumulative_tokens())
    table = foreign_table()
    swapped = table.select(
        [
            *table.column_names[:5],
            "generation_log_probs",
            "generation_token_ids",
            *table.column_names[7:],
        ]
    )
    int32_ids = pa.array([[1, 2], []], pa.list_(pa.field("item", pa.int32(), False)))
    nullable_items = pa.array([[1, 2], []], pa.list_(pa.int64()))
    file_sink = pa.BufferOutputStream()
    with pa.ipc.new_file(file_sink, table.schema) as writer:
        writer.write(table)
    null_in_non_null = pa.Table.from_arrays(
        [
            pa.array([None, "b"]) if n == "model_call_id" else c
            for n, c in zip(table.column_names, table.columns, strict=True)
        ],
        schema=table.schema,
    )
    cases: list[tuple[bytes, str]] = [
        (b"", "it is empty"),
        (b"\0\0\0\0", "before any schema message"),
        (b"not an Arrow IPC stream, just text", r"ends inside its first message|not a valid"),
        (pickle.dumps({"entries": [1, 2]}), r"ends inside its first message|not a valid"),
        (bytes(file_sink.getvalue().to_pybytes()), r"ends inside its first message|not a valid"),
        (data + b"\0", "9 bytes follow its record batch"),
        (data + data, r"bytes follow its record batch"),
        (data[:-8], "without the end-of-stream marker"),
        (ipc_stream(table, table), r"bytes follow its record batch.*second batch"),
        (ipc_stream(schema=table.schema), "after its schema, before any record batch"),
        (
            ipc_stream(swapped),
            r'column 5 is "generation_log_probs" .*where it should be "generation_token_ids"',
        ),
        (ipc_stream(table.drop_columns(["extras"])), "it has 24 columns where there should be 25"),
        (
            ipc_stream(table.append_column("more", pa.array([1, 2]))),
            "it has 26 columns where there should be 25",
        ),
        (
            ipc_stream(foreign_table(prompt_token_ids=int32_ids)),
            r'column 4 is "prompt_token_ids" .*Int32',
        ),
        (
            ipc_stream(foreign_table(prompt_token_ids=nullable_items)),
            r'column 4 is "prompt_token_ids"',
        ),
        (ipc_stream(table.replace_schema_metadata({"k": "v"})), "its schema has metadata"),
        (ipc_stream(null_in_non_null), r"not a valid Arrow IPC stream: .*model_call_id.*null"),
        (array_data, r'column 0 is "cumulative_token_ids" .*where it should be "schema_version"'),
    ]
    for payload, message in cases:
        with pytest.raises(ValueError, match=f"^not a pickled ColumnarEntries: .*({message})"):
            _core.columnar_entries_from_ipc(payload)
    # A list view whose items hold a null (Arrow's validation checks that for lists only).
    null_item = pa.ListViewArray.from_arrays(
        pa.array([0, 0], pa.int32()),
        pa.array([1, 0], pa.int32()),
        pa.array([None], pa.int64()),
        type=LIST_VIEW,
    )
    with pytest.raises(ValueError, match='column "prompt_token_ids" has null items'):
        _core.columnar_entries_from_ipc(ipc_stream(foreign_table(prompt_token_ids=null_item)))
    # The array's constructor takes only the cumulative array's one column.
    assert pa.array(_core.columnar_array_from_ipc(array_data)).to_pylist()[0] == (
        pa.table(store.read_columns("p"))["prompt_token_ids"][0].as_py()
        + pa.table(store.read_columns("p"))["generation_token_ids"][0].as_py()
    )
    with pytest.raises(
        ValueError, match=r"^not a pickled ColumnarArray: column 0 is \"schema_version\""
    ):
        _core.columnar_array_from_ipc(data)
    with pytest.raises(ValueError, match=r"^not a pickled ColumnarArray: .*truncated"):
        _core.columnar_array_from_ipc(array_data[:-20])
    # Through pickle itself, as a data loader's worker would meet it.

    class Tampered:
        def __reduce__(self) -> tuple[Any, tuple[bytes]]:
            return (_core.columnar_entries_from_ipc, (data[: len(data) // 2],))

    with pytest.raises(ValueError, match="truncated"):
        pickle.loads(pickle.dumps(Tampered()))
