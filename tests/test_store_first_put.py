"""A rollout's first puts write no state index (issue 24: the first put's latency tail).

A put writes its line and fdatasyncs it; the one that creates the log also fsyncs the
directory. No put writes the state index until a checkpoint (64 entries or 4 MiB past the last
one) or a lifecycle transition (conflict, mark_incomplete, freeze, drop, retire). SPEC reads a
missing index as a fresh rollout and the log as its acknowledged tail, so every reader (NeMo
Gym's store too) reads such a rollout exactly; and a per-process cache that holds no state file
must still see one that another process (a fence) writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.conftest import make_entry
from tests.nemo_oracle import import_nemo

from tokencapture.protocols import (
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
)
from tokencapture.store import TokenCaptureStore

nemo_store = import_nemo("store")

ROOT = Path(__file__).resolve().parents[1]


def same(ours: Sequence[Any], theirs: Sequence[Any]) -> bool:
    """Entry for entry equal, as NeMo Gym's model and ours dump them (the JSON also tells
    -0.0 from 0.0 and 1 from 1.0)."""
    dumps = [
        [orjson.dumps(e.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS) for e in side]
        for side in (ours, theirs)
    ]
    return [e.model_dump() for e in ours] == [e.model_dump() for e in theirs] and (
        dumps[0] == dumps[1]
    )


def names(root: Path) -> set[str]:
    return {path.name for path in root.iterdir()}


def test_no_put_writes_the_state_index_before_the_checkpoint_and_the_64th_does(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    for n in range(1, 64):
        store.append(make_entry("r", n))
        assert names(tmp_path) == {"r.tokens.jsonl", "r.tokens.lock"}, n
    store.append(make_entry("r", 64))
    state = json.loads(store.state_path_for("r").read_bytes())
    assert state["version"] == 64 and len(state["entry_digests"]) == 64
    assert state["indexed_size"] == store.path_for("r").stat().st_size
    # The next 63 leave it lagging again; the 128th checkpoints it once more.
    for n in range(65, 128):
        store.append(make_entry("r", n))
    assert json.loads(store.state_path_for("r").read_bytes())["version"] == 64
    store.append(make_entry("r", 128))
    assert json.loads(store.state_path_for("r").read_bytes())["version"] == 128


async def test_a_group_commit_of_first_puts_writes_no_state_index(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    await asyncio.gather(*(store.put(make_entry(f"r{r}", c)) for c in range(3) for r in range(8)))
    assert {n for n in names(tmp_path) if n.endswith(".state.json")} == set()
    for r in range(8):
        assert TokenCaptureStore(tmp_path).inspect(f"r{r}")["version"] == 3  # type: ignore[index]


@pytest.mark.parametrize("puts", [1, 2, 5, 63])
def test_nemo_gyms_store_reads_a_rollout_we_put_to_exactly(tmp_path: Path, puts: int) -> None:
    ours = TokenCaptureStore(tmp_path / "ours")
    entries = [make_entry("r", n) for n in range(1, puts + 1)]
    for entry in entries:
        ours.append(entry)
    assert not ours.state_path_for("r").exists()
    # NeMo Gym reads the log (no index: a fresh rollout with an unindexed tail) entry for entry.
    nemo = nemo_store.TokenCaptureStore(tmp_path / "ours")
    assert same(entries, nemo.read_entries("r"))
    assert not nemo.is_incomplete("r")
    # Frozen by NeMo Gym on one copy and by us on another, the snapshots agree, and so do the
    # state indexes each freeze writes.
    shutil.copytree(tmp_path / "ours", tmp_path / "copy")
    shutil.copytree(tmp_path / "ours", tmp_path / "copy2")
    theirs = nemo.freeze_now("r")
    mine = TokenCaptureStore(tmp_path / "copy").freeze_now("r")
    assert list(mine.entries) == entries and same(entries, theirs.entries)
    assert theirs.version == mine.version == puts + 1
    assert theirs.incomplete == mine.incomplete is False
    nemo_state = json.loads(nemo.state_path_for("r").read_bytes())
    our_state = json.loads((tmp_path / "copy" / "r.tokens.state.json").read_bytes())
    for state in (nemo_state, our_state):
        state.pop("snapshot_id")
    assert nemo_state == our_state
    # And NeMo Gym continues it: its put folds our log in first.
    nemo_after = nemo_store.TokenCaptureStore(tmp_path / "copy2")
    nemo_after.append(make_entry("r", "theirs"))
    assert json.loads(nemo_after.state_path_for("r").read_bytes())["version"] == puts + 1
    assert TokenCaptureStore(tmp_path / "copy2").read_entries("r") == [
        *entries,
        make_entry("r", "theirs"),
    ]


def run_elsewhere(root: Path, code: str) -> None:
    """Run `code` (with `store`, a TokenCaptureStore over `root`) in another process."""
    script = (
        "from tokencapture.store import TokenCaptureStore\n"
        f"store = TokenCaptureStore({os.fspath(root)!r})\n{code}\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)


def retire_in_another_process(root: Path) -> type[Exception]:
    run_elsewhere(root, "store.retire_now(['r'])")
    return TokenCaptureRetiredError


def freeze_in_another_process(root: Path) -> type[Exception]:
    run_elsewhere(root, "store.freeze_now('r')")
    return TokenCaptureFrozenError


def freeze_in_another_store(root: Path) -> type[Exception]:
    TokenCaptureStore(root).freeze_now("r")
    return TokenCaptureFrozenError


def retire_in_another_store(root: Path) -> type[Exception]:
    TokenCaptureStore(root).retire_now(["r"])
    return TokenCaptureRetiredError


def freeze_by_nemo_gym(root: Path) -> type[Exception]:
    nemo_store.TokenCaptureStore(root).freeze_now("r")
    return TokenCaptureFrozenError


def drop_by_nemo_gym(root: Path) -> type[Exception]:
    nemo = nemo_store.TokenCaptureStore(root)
    snapshot = nemo.freeze_now("r")
    assert nemo._drop("r", snapshot.snapshot_id, snapshot.version)
    return TokenCaptureRetiredError


FENCES: list[Callable[[Path], type[Exception]]] = [
    retire_in_another_process,
    freeze_in_another_process,
    freeze_in_another_store,
    retire_in_another_store,
    freeze_by_nemo_gym,
    drop_by_nemo_gym,
]


@pytest.mark.parametrize("fence", FENCES, ids=[f.__name__ for f in FENCES])
@pytest.mark.parametrize("then", ["put", "begin_call", "begin_call_unless_stored"])
def test_a_fence_written_elsewhere_after_our_first_put_is_seen(
    tmp_path: Path, fence: Callable[[Path], type[Exception]], then: str
) -> None:
    ours = TokenCaptureStore(tmp_path)
    ours.append(make_entry("r", 1))
    ours.append(make_entry("r", 2))  # through the cached index, which holds no state file
    assert not ours.state_path_for("r").exists()
    refused = fence(tmp_path)
    assert ours.state_path_for("r").exists()
    with pytest.raises(refused):
        if then == "put":
            ours.append(make_entry("r", 3))
        elif then == "begin_call":
            ours._begin_call("r", "call-3")
        else:
            asyncio.run(ours.begin_call_unless_stored("r", "call-3"))
    assert make_entry("r", 3) not in TokenCaptureStore(tmp_path).read_entries("r")
    assert not ours.intents_path_for("r").exists()


def test_a_mark_incomplete_by_nemo_gym_after_our_first_put_is_seen(tmp_path: Path) -> None:
    ours = TokenCaptureStore(tmp_path)
    ours.append(make_entry("r", 1))
    nemo_store.TokenCaptureStore(tmp_path)._mark_incomplete("r", "lost")
    ours.append(make_entry("r", 2))
    assert ours.is_incomplete("r")
    snapshot = ours.freeze_now("r")
    assert snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == [
        "call-1",
        "call-2",
    ]
    # NeMo Gym's state after its mark: version 1 folded + 1 mark; then our put and freeze.
    assert snapshot.version == 4


def test_a_delete_elsewhere_after_our_first_put_starts_the_rollout_afresh(tmp_path: Path) -> None:
    ours = TokenCaptureStore(tmp_path)
    ours.append(make_entry("r", 1))
    TokenCaptureStore(tmp_path).delete_now(["r"])
    # The call is no longer stored: an intent is written, and a put of it is new again.
    assert asyncio.run(ours.begin_call_unless_stored("r", "call-1")) is False
    ours.append(make_entry("r", 1))
    assert ours.freeze_now("r").version == 2


def test_a_line_damaged_before_the_first_checkpoint_reads_as_it_now_says(tmp_path: Path) -> None:
    """The price of no state index before the first checkpoint, pinned so that it stays a
    decision: a line's payload digest is checked at freeze only once an index holds it, so a
    changed digit in a line no index covers yet (as in any unindexed tail) is not caught.
    Once indexed (a checkpoint, a lifecycle transition), it is."""
    store = TokenCaptureStore(tmp_path / "open")
    for n in range(1, 4):
        store.append(make_entry("r", n))
    shutil.copytree(tmp_path / "open", tmp_path / "indexed")
    TokenCaptureStore(tmp_path / "indexed").freeze_now("r")  # writes the index
    for root in (tmp_path / "open", tmp_path / "indexed"):
        log = root / "r.tokens.jsonl"
        log.write_bytes(log.read_bytes().replace(b"-0.25", b"-0.75", 1))
    [first, *_] = TokenCaptureStore(tmp_path / "open").freeze_now("r").entries
    assert first.generation_log_probs == [-0.5, -0.75]
    with pytest.raises(TokenCaptureCorruptionError, match="digest"):
        TokenCaptureStore(tmp_path / "indexed").freeze_now("r")
