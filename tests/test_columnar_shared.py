"""`shared_prefixes=True`: the prompt column as a `list_view<int64>` that stores a prompt
repeating the previous prompt once (docs/columnar.md), with exactly the default column's ids."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from tests.conftest import make_entry
from tests.test_columnar import (
    DAMAGES,
    EXPECTED_SCHEMA,
    assert_rows_equal,
    damaged_pair,
    lineage_rollout,
    outcome,
)

from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore

LIST_VIEW = pa.list_view(pa.field("item", pa.int64(), False))


def rollout(rng: random.Random, rollout_id: str, calls: int, scale: int) -> list[TokenEntry]:
    """An agentic chain with, at random, forks (a shorter earlier prompt extended
    differently), re-renders (a changed first token), empty prompts and repeated prompts."""
    entries: list[TokenEntry] = []
    prompts: list[list[int]] = []
    tokens = [rng.randrange(151_936) for _ in range(rng.randrange(scale + 1))]
    for call in range(calls):
        kind = rng.choice(["extend", "extend", "extend", "fork", "rerender", "empty", "same"])
        if kind == "fork" and prompts:
            base = rng.choice(prompts)
            tokens = [*base[: rng.randrange(len(base) + 1)], *(rng.randrange(9) for _ in range(5))]
        elif kind == "rerender" and tokens:
            tokens = [tokens[0] + 1, *tokens[1:]]
        elif kind == "empty":
            tokens = []
        elif kind == "same" and prompts:
            tokens = list(prompts[-1])
        generation = [rng.randrange(151_936) for _ in range(rng.randrange(1, scale // 2 + 2))]
        entries.append(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"c{call:03d}",
                model="m",
                prompt_token_ids=tokens,
                generation_token_ids=generation,
                generation_log_probs=[-rng.expovariate(2.0) for _ in generation],
                created_at=1_760_000_000.0 + call,
            )
        )
        prompts.append(tokens)
        tokens = [*tokens, *generation, *(rng.randrange(151_936) for _ in range(scale // 4))]
    return entries


def assert_same_columns(shared: pa.Table, default: pa.Table) -> None:
    """The shared snapshot is the default one with the prompt column as a list view."""
    assert shared.schema == EXPECTED_SCHEMA.set(
        EXPECTED_SCHEMA.get_field_index("prompt_token_ids"),
        pa.field("prompt_token_ids", LIST_VIEW, nullable=False),
    )
    for name in default.column_names:
        if name != "prompt_token_ids":
            assert shared[name].equals(default[name]), name
    assert shared["prompt_token_ids"].to_pylist() == default["prompt_token_ids"].to_pylist()


def prompt_slices(table: pa.Table) -> list[np.ndarray]:
    """Every entry's prompt as a numpy view of the one values buffer (a trainer's read)."""
    column = table["prompt_token_ids"].chunk(0)
    values = column.values.to_numpy(zero_copy_only=True)
    offsets = column.offsets.to_numpy(zero_copy_only=True)
    sizes = column.sizes.to_numpy(zero_copy_only=True)
    return [values[o : o + s] for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)]


@pytest.mark.parametrize(
    ("seed", "calls", "scale"),
    [(seed, 1 + seed % 9, 300) for seed in range(12)]
    + [(100, 1, 0), (101, 14, 3000), (102, 20, 2000)],
)
def test_generated_rollouts_read_the_same_ids(
    tmp_path: Path, seed: int, calls: int, scale: int
) -> None:
    rng = random.Random(seed)
    entries = rollout(rng, "r", calls, scale)
    store = TokenCaptureStore(tmp_path / "a")
    for entry in entries:
        store.append(entry)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    twin = TokenCaptureStore(tmp_path / "b")
    frozen = store.freeze_now("r")
    default = pa.table(store.freeze_columns_now("r"))
    snapshot = twin.freeze_columns_now("r", shared_prefixes=True)
    again = twin.freeze_now("r")
    assert (snapshot.snapshot_id, snapshot.version) == (again.snapshot_id, again.version)
    assert snapshot.version == frozen.version
    shared = pa.table(snapshot)
    assert_same_columns(shared, default)
    assert shared["prompt_token_ids"].to_pylist() == [e.prompt_token_ids for e in frozen.entries]
    assert [part.tolist() for part in prompt_slices(shared)] == [
        e.prompt_token_ids for e in entries
    ]
    assert_same_columns(pa.table(twin.read_columns("r", shared_prefixes=True)), default)
    assert (
        pa.array(twin.freeze_columns_now("r", shared_prefixes=True).cumulative_tokens()).to_pylist()
        == pa.array(store.freeze_columns_now("r").cumulative_tokens()).to_pylist()
    )


@pytest.mark.parametrize("calls", [3, 14], ids=["small-log", "streamed-log"])
def test_a_chain_stores_each_prompt_once(tmp_path: Path, calls: int) -> None:
    store = TokenCaptureStore(tmp_path)
    entries = lineage_rollout("agentic", calls=calls, prompt=1500, turn=400, seed=calls)
    for entry in entries:
        store.append(entry)
    snapshot = store.freeze_columns_now("agentic", shared_prefixes=True)
    shared = pa.table(snapshot)
    # The batch's own export (`__arrow_c_array__`) carries the list view too.
    assert pa.record_batch(snapshot.entries).equals(shared.to_batches()[0])
    assert pa.schema(snapshot).field("prompt_token_ids").type == LIST_VIEW
    column = shared["prompt_token_ids"].chunk(0)
    # Every prompt extends the previous one: all views start at 0 and the buffer holds the
    # last prompt only.
    assert column.offsets.to_pylist() == [0] * calls
    assert len(column.values) == len(entries[-1].prompt_token_ids)
    assert column.sizes.to_pylist() == [len(e.prompt_token_ids) for e in entries]
    assert_same_columns(shared, pa.table(store.freeze_columns_now("agentic")))
    assert_rows_equal(pa.table(store.freeze_columns_now("agentic")), entries)


@pytest.mark.parametrize("damage", [*DAMAGES, *(f"{d}-large" for d in DAMAGES)])
def test_damaged_logs_give_the_default_outcome(tmp_path: Path, damage: str) -> None:
    default, shared = damaged_pair(tmp_path, damage)
    expected = outcome(lambda: pa.table(default.freeze_columns_now("r")))
    got = outcome(lambda: pa.table(shared.freeze_columns_now("r", shared_prefixes=True)))
    assert got[0] == expected[0], got
    if expected[0] == "ok":
        assert_same_columns(got[1], expected[1])
    else:
        assert got == expected
    read = outcome(lambda: pa.table(shared.read_columns("r", shared_prefixes=True)))
    read_default = outcome(lambda: pa.table(default.read_columns("r")))
    if read_default[0] == "ok":
        assert_same_columns(read[1], read_default[1])
    else:
        assert read == read_default


def test_async_freeze_columns_passes_the_option(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    for call in range(3):
        store.append(make_entry("r", call))

    async def freeze() -> pa.Table:
        return pa.table(await store.freeze_columns("r", shared_prefixes=True))

    table = asyncio.run(freeze())
    assert table.schema.field("prompt_token_ids").type == LIST_VIEW
    assert_same_columns(table, pa.table(store.freeze_columns_now("r")))


def test_the_option_takes_the_same_flags_sync_and_async(tmp_path: Path) -> None:
    """numpy's bool is a bool to every form of the call (the native ones took it, the async one
    refused it as "must be a bool, not bool"); an int or a str is refused by every form."""
    store = TokenCaptureStore(tmp_path)
    for call in range(3):
        store.append(make_entry("r", call))

    async def freeze(flag: object) -> pa.Table:
        return pa.table(await store.freeze_columns("r", shared_prefixes=flag))  # type: ignore[arg-type]

    for flag in (np.True_, np.bool_(True)):
        for table in (
            asyncio.run(freeze(flag)),
            pa.table(store.freeze_columns_now("r", shared_prefixes=flag)),  # type: ignore[arg-type]
            pa.table(store.read_columns("r", shared_prefixes=flag)),  # type: ignore[arg-type]
        ):
            assert table.schema.field("prompt_token_ids").type == LIST_VIEW
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="shared_prefixes"):
            store.freeze_columns("r", shared_prefixes=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.freeze_columns_now("r", shared_prefixes=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.read_columns("r", shared_prefixes=bad)  # type: ignore[arg-type]
