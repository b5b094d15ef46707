"""Micro benchmarks of the hot paths, Rust-backed store side by side with the reference.

    python -m pytest benches --benchmark-only

Off in the normal test run (pytest's `testpaths` is `tests`). Every store benchmark writes to
a directory on the real disk under `benches/.scratch/`, so appends pay a real fsync.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import shutil
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench_data import AgenticShape, SmallShape, agentic_rollouts, small_rollouts
from tokencapture.records import TokenEntry, compute_digest
from tokencapture.reference import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore, canonical_line

STORES: dict[str, Callable[[Path], Any]] = {
    "tokencapture": TokenCaptureStore,
    "reference": ReferenceStore,
}
store_impl = pytest.mark.parametrize("impl", list(STORES))


def python_digest(token_ids: list[int]) -> str:
    """A pure-Python token digest (hashlib over a big-endian u64 array) for comparison."""
    if not token_ids:
        return hashlib.sha256(b"nemo-gym-tokens").hexdigest()
    body = array("Q", token_ids)
    if body.itemsize != 8:  # pragma: no cover - every supported platform has an 8-byte Q
        raise RuntimeError("array('Q') is not 64-bit here")
    body.byteswap()  # little-endian hosts: to big-endian
    header = b"nemo-gym-tokens\x01" + len(token_ids).to_bytes(8, "big")
    return hashlib.sha256(header + body.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def ids_32k() -> list[int]:
    rng = random.Random(32)
    return [rng.randrange(151_936) for _ in range(32_768)]


@pytest.fixture(scope="module")
def small_entry() -> TokenEntry:
    return small_rollouts(SmallShape(rollouts=1, calls=1))[0][0]


@pytest.fixture(scope="module")
def agentic_calls() -> list[TokenEntry]:
    """One 24-call agentic rollout (prompts 2k -> ~27.6k tokens, 512 generated per call)."""
    return agentic_rollouts(AgenticShape(rollouts=1), prefix="micro")[0]


@pytest.fixture(scope="module")
def large_entry(agentic_calls: list[TokenEntry]) -> TokenEntry:
    return agentic_calls[-1]


# Token digest --------------------------------------------------------------------------------


def test_digest_python_baseline_agrees(ids_32k: list[int]) -> None:
    assert python_digest(ids_32k) == compute_digest(ids_32k)
    assert python_digest([]) == compute_digest([])


@pytest.mark.benchmark(group="digest-32k")
def test_digest_list(benchmark: Any, ids_32k: list[int]) -> None:
    assert benchmark(compute_digest, ids_32k) == python_digest(ids_32k)


@pytest.mark.benchmark(group="digest-32k")
def test_digest_array_q(benchmark: Any, ids_32k: list[int]) -> None:
    ids = array("Q", ids_32k)
    assert benchmark(compute_digest, ids) == python_digest(ids_32k)


@pytest.mark.benchmark(group="digest-32k")
def test_digest_list_python_hashlib(benchmark: Any, ids_32k: list[int]) -> None:
    benchmark(python_digest, ids_32k)


# Canonical line ------------------------------------------------------------------------------


@pytest.mark.benchmark(group="canonical-line")
def test_canonical_line_small(benchmark: Any, small_entry: TokenEntry) -> None:
    assert benchmark(canonical_line, small_entry).startswith(b"{")


@pytest.mark.benchmark(group="canonical-line")
def test_canonical_line_large(benchmark: Any, large_entry: TokenEntry) -> None:
    assert benchmark(canonical_line, large_entry).startswith(b"{")


# Sync append (lock, tail check, digest, append + fsync, index) ------------------------------


def _append_rounds(
    benchmark: Any, store: Any, template: TokenEntry, calls_per_rollout: int, rounds: int
) -> None:
    """Each round appends a new call id; a new rollout every `calls_per_rollout` rounds."""
    counter = itertools.count()

    def setup() -> tuple[tuple[TokenEntry], dict[str, Any]]:
        n = next(counter)
        entry = template.model_copy(
            update={
                "rollout_id": f"append-r{n // calls_per_rollout:05d}",
                "model_call_id": f"append-c{n:06d}",
                "parent_call_id": None,
                "parent_resolution": None,
            }
        )
        return (entry,), {}

    benchmark.pedantic(store.append, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)


@pytest.mark.benchmark(group="append-small")
@store_impl
def test_append_small(
    benchmark: Any, scratch_dir: Path, small_entry: TokenEntry, impl: str
) -> None:
    _append_rounds(benchmark, STORES[impl](scratch_dir), small_entry, 16, rounds=300)


@pytest.mark.benchmark(group="append-large")
@store_impl
def test_append_large(
    benchmark: Any, scratch_dir: Path, large_entry: TokenEntry, impl: str
) -> None:
    _append_rounds(benchmark, STORES[impl](scratch_dir), large_entry, 24, rounds=60)


# Freeze of a 24-call agentic rollout ---------------------------------------------------------


@pytest.mark.benchmark(group="freeze-agentic-24")
@store_impl
def test_freeze_agentic(
    benchmark: Any, scratch_dir: Path, agentic_calls: list[TokenEntry], impl: str
) -> None:
    """A fresh store object each round freezes and materializes the rollout's 24 entries.

    The first (warm-up) round writes the frozen state; later rounds are the idempotent re-freeze
    a trainer does when it reads a snapshot again.
    """
    writer = STORES[impl](scratch_dir)
    for entry in agentic_calls:
        writer.append(entry)
    rollout_id = agentic_calls[0].rollout_id
    store: Any = None

    def setup() -> tuple[tuple[str], dict[str, Any]]:
        nonlocal store
        store = STORES[impl](scratch_dir)
        return (rollout_id,), {}

    def freeze(rollout_id: str) -> Any:
        return store.freeze_now(rollout_id)

    snapshot = benchmark.pedantic(freeze, setup=setup, rounds=20, iterations=1, warmup_rounds=1)
    assert len(snapshot.entries) == len(agentic_calls)
    assert snapshot.entries[-1] == agentic_calls[-1]


# Tail reconciliation -------------------------------------------------------------------------


def _tail_rounds(
    benchmark: Any, scratch_dir: Path, impl: str, calls: list[TokenEntry], rounds: int
) -> None:
    """A fresh store appends to a log another store wrote and never indexed (no state file).

    Each round copies the log into a new directory; the put folds every line in (digest,
    parse the call id, index) before it appends its own line.
    """
    source = scratch_dir / "source"
    writer = TokenCaptureStore(source)
    for entry in calls:
        writer.append(entry)
    rollout_id = calls[0].rollout_id
    log = writer.path_for(rollout_id)
    extra = calls[-1].model_copy(update={"model_call_id": "tail-new-call"})
    counter = itertools.count()
    store: Any = None

    def setup() -> tuple[tuple[TokenEntry], dict[str, Any]]:
        nonlocal store
        target = scratch_dir / f"copy-{next(counter)}"
        target.mkdir()
        shutil.copyfile(log, target / log.name)
        store = STORES[impl](target)
        return (extra,), {}

    def append(entry: TokenEntry) -> None:
        store.append(entry)

    benchmark.pedantic(append, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    assert len(store.read_entries(rollout_id)) == len(calls) + 1


@pytest.mark.benchmark(group="tail-small-64")
@store_impl
def test_tail_reconciliation_small(benchmark: Any, scratch_dir: Path, impl: str) -> None:
    calls = small_rollouts(SmallShape(rollouts=1, calls=64), prefix="tail")[0]
    _tail_rounds(benchmark, scratch_dir, impl, calls, rounds=40)


@pytest.mark.benchmark(group="tail-agentic-24")
@store_impl
def test_tail_reconciliation_agentic(
    benchmark: Any, scratch_dir: Path, agentic_calls: list[TokenEntry], impl: str
) -> None:
    _tail_rounds(benchmark, scratch_dir, impl, agentic_calls, rounds=20)
