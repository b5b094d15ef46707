"""`sweep_retired(older_than_seconds) -> int`, NeMo Gym 0.7.0's store method, on both backends.

It removes the fences (state, lock, intents and incomplete files; the rollout's row and what
hangs off it in PostgreSQL) of rollouts retired at least `older_than_seconds` ago, returns how
many, and never touches a rollout that is not retired. The file store is compared with NeMo
Gym's own store on the same directory layout, both ways; the PostgreSQL store with the file
store on the same story. The CLI's `sweep` is this method (tests/test_cli_*.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.nemo_oracle import import_nemo
from tests.postgres_fixture import dsn, execute, pg_dsn, pg_server

from tokencapture.postgres import PostgresTokenCaptureStore
from tokencapture.protocols import TokenCaptureRetiredError
from tokencapture.store import TokenCaptureStore

__all__ = ["dsn", "pg_dsn", "pg_server"]

nemo_store = import_nemo("store")
nemo_records = import_nemo("records")

HOUR = 3600.0

BAD_AGES: list[tuple[object, type[Exception]]] = [
    ("600", TypeError),
    (None, TypeError),
    (True, TypeError),
    ([600], TypeError),
    (math.nan, ValueError),
    (10**400, ValueError),
]


def files(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


def age_state(store: Any, rollout_id: str, seconds: float) -> None:
    """Make the rollout's state file `seconds` old."""
    at = time.time() - seconds
    os.utime(store.state_path_for(rollout_id), (at, at))


def write_story(store: Any, entry_type: Any) -> None:
    """Rollouts in every state the sweep must tell apart, with their state files' ages:
    retired two hours ago (dropped, and retired), retired a minute ago, frozen two hours ago
    (not retired) and live."""
    for rollout_id in ("dropped-old", "retired-old", "recent", "frozen-old", "live"):
        entry = entry_type.model_validate(make_entry(rollout_id, 1).model_dump())
        nemo_records.stamp_lineage(
            entry, None, parent_resolution=nemo_records.ParentResolutionStatus.ROOT
        )
        store.append(entry)
    snapshot = store.freeze_now("dropped-old")
    assert asyncio.run(
        store.drop("dropped-old", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    )
    store.freeze_now("frozen-old")
    retire = getattr(store, "retire_now", None)
    for rollout_id in ("retired-old", "recent"):
        if retire is not None:
            retire([rollout_id])
        else:  # NeMo Gym's store retires by dropping its consumed snapshot
            snapshot = store.freeze_now(rollout_id)
            assert asyncio.run(
                store.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
            )
    for rollout_id in ("dropped-old", "retired-old", "frozen-old"):
        age_state(store, rollout_id, 2 * HOUR)


# ---- the file store --------------------------------------------------------------------------


def test_only_old_retired_rollouts_are_swept(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    write_story(store, nemo_records.TokenEntry)
    before = files(tmp_path)
    assert store.sweep_retired_ids(HOUR, dry_run=True) == ["dropped-old", "retired-old"]
    assert files(tmp_path) == before  # a dry run changes nothing
    swept = store.sweep_retired(HOUR)
    assert swept == 2 and type(swept) is int
    left = files(tmp_path)
    assert not any(name.startswith(("dropped-old.", "retired-old.")) for name in left)
    assert [name for name in before if name not in left] == [
        name for name in before if name.startswith(("dropped-old.", "retired-old."))
    ]
    assert store.sweep_retired(HOUR) == 0  # nothing left that old
    # A negative age reaches into the future: every retired rollout goes, the rest stay.
    assert store.sweep_retired(-HOUR) == 1
    assert store.sweep_retired(-math.inf) == 0
    assert [entry.model_call_id for entry in store.read_entries("live")] == ["call-1"]
    assert store.freeze_now("frozen-old").entries[0].model_call_id == "call-1"
    # A swept id starts empty, as after delete.
    store.append(make_entry("recent", 2))
    assert [entry.model_call_id for entry in store.read_entries("recent")] == ["call-2"]


def test_a_reused_rollout_is_not_swept(tmp_path: Path) -> None:
    """Deleted after retiring and written again: no longer retired, whatever its state's age."""
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", 1))
    store.retire_now(["r"])
    store.delete_now(["r"])
    store.append(make_entry("r", 2))
    # The put wrote no state index (none before the first checkpoint): nothing to sweep.
    assert not store.state_path_for("r").exists()
    assert store.sweep_retired(-math.inf) == 0
    store.freeze_now("r")  # writes one, not retired
    age_state(store, "r", 2 * HOUR)
    assert store.sweep_retired(-math.inf) == 0
    assert [entry.model_call_id for entry in store.read_entries("r")] == ["call-2"]


@pytest.mark.parametrize(("age", "error"), BAD_AGES)
def test_a_bad_age_is_refused_and_nothing_changes(
    tmp_path: Path, age: object, error: type[Exception]
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", 1))
    store.retire_now(["r"])
    before = files(tmp_path)
    with pytest.raises(error):
        store.sweep_retired(age)  # type: ignore[arg-type]
    assert files(tmp_path) == before
    assert store.sweep_retired(-HOUR) == 1


# ---- against NeMo Gym's store, on one directory layout ---------------------------------------


@pytest.mark.parametrize("writer", ["nemo", "ours"])
@pytest.mark.parametrize("age", [HOUR, 60.0, 0.0, -HOUR])
def test_sweeps_as_nemo_gyms_store_does_on_the_same_files(
    tmp_path: Path, writer: str, age: float
) -> None:
    """One implementation writes the story; NeMo Gym's store sweeps one copy, ours another:
    the same count and the same files left (both directions of the shared format)."""
    outcome = {}
    for sweeper in ("nemo", "ours"):
        root = tmp_path / sweeper
        if writer == "nemo":
            write_story(nemo_store.TokenCaptureStore(root), nemo_records.TokenEntry)
        else:
            write_story(TokenCaptureStore(root), nemo_records.TokenEntry)
        store = nemo_store.TokenCaptureStore(root) if sweeper == "nemo" else TokenCaptureStore(root)
        outcome[sweeper] = (store.sweep_retired(age), files(root))
    assert outcome["ours"] == outcome["nemo"]
    assert outcome["nemo"][0] == {HOUR: 2, 60.0: 2, 0.0: 3, -HOUR: 3}[age]


# ---- PostgreSQL ------------------------------------------------------------------------------


def _pg_story(dsn: str) -> PostgresTokenCaptureStore:
    store = PostgresTokenCaptureStore(dsn)
    for rollout_id in ("retired-old", "recent", "frozen-old", "live"):
        store.append(make_entry(rollout_id, 1))
    store.freeze_now("frozen-old")
    assert store.retire_now(["retired-old", "recent", "never-written"]) == {
        "removed": ["retired-old", "recent"],
        "absent": ["never-written"],
    }
    execute(
        dsn,
        "UPDATE tokencapture.rollouts SET retired_at = now() - interval '2 hours' "
        "WHERE rollout_id IN ('retired-old', 'never-written')",
    )
    return store


def test_postgres_sweeps_only_old_retired_rollouts(dsn: str) -> None:
    store = _pg_story(dsn)
    try:
        assert store.sweep_retired_ids(HOUR, dry_run=True) == ["never-written", "retired-old"]
        assert store.sweep_retired(math.inf) == 0
        swept = store.sweep_retired(HOUR)
        assert swept == 2 and type(swept) is int
        assert store.sweep_retired(HOUR) == 0
        # Swept ids start empty; the young fence still refuses writes.
        store.append(make_entry("retired-old", 2))
        assert [e.model_call_id for e in store.read_entries("retired-old")] == ["call-2"]
        with pytest.raises(TokenCaptureRetiredError):
            store.append(make_entry("recent", 2))
        assert store.sweep_retired(-HOUR) == 1
        store.append(make_entry("recent", 2))
        assert store.sweep_retired(-math.inf) == 0  # nothing retired is left
        assert [e.model_call_id for e in store.read_entries("live")] == ["call-1"]
        assert store.freeze_now("frozen-old").entries[0].model_call_id == "call-1"
    finally:
        store.close_sync()


@pytest.mark.parametrize(("age", "error"), BAD_AGES)
def test_postgres_refuses_a_bad_age_as_the_file_store_does(
    dsn: str, tmp_path: Path, age: object, error: type[Exception]
) -> None:
    store = _pg_store_with_fence(dsn)
    try:
        with pytest.raises(error) as theirs:
            store.sweep_retired(age)  # type: ignore[arg-type]
        with pytest.raises(error) as ours:
            TokenCaptureStore(tmp_path).sweep_retired(age)  # type: ignore[arg-type]
        assert str(theirs.value) == str(ours.value)
        assert store.sweep_retired(-HOUR) == 1  # nothing was swept by the refused call
    finally:
        store.close_sync()


def _pg_store_with_fence(dsn: str) -> PostgresTokenCaptureStore:
    store = PostgresTokenCaptureStore(dsn)
    store.append(make_entry("r", 1))
    store.retire_now(["r"])
    return store


def test_both_backends_sweep_the_same_story_alike(dsn: str, tmp_path: Path) -> None:
    """The same operations on files and on PostgreSQL: the same swept ids at each step."""
    backends: dict[str, Any] = {
        "file": TokenCaptureStore(tmp_path),
        "pg": PostgresTokenCaptureStore(dsn),
    }
    steps: dict[str, list[object]] = {}
    try:
        for name, store in backends.items():
            answers: list[object] = []
            for rollout_id in ("a", "b", "c"):
                store.append(make_entry(rollout_id, 1))
            store.retire_now(["a", "b", "d"])
            answers.append(store.sweep_retired_ids(HOUR, dry_run=True))
            answers.append(store.sweep_retired_ids(-HOUR, dry_run=True))
            answers.append(store.sweep_retired(-HOUR))
            store.append(make_entry("a", 2))
            store.retire_now(["a"])
            answers.append(store.sweep_retired_ids(-HOUR))
            answers.append(store.sweep_retired(-HOUR))
            answers.append([e.model_call_id for e in store.read_entries("c")])
            steps[name] = answers
    finally:
        backends["pg"].close_sync()
    assert steps["pg"] == steps["file"]
    assert steps["file"] == [[], ["a", "b", "d"], 3, ["a"], 0, ["call-1"]]
