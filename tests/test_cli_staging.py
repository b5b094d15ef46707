"""`tokencapture ls/show/verify/retire/delete/copy --staging` on a FileStagingStore directory and a
PostgresStagingStore DSN."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.postgres_fixture import dsn, execute, pg_dsn, pg_server
from tests.staging_backends import chain, make_record

from tokencapture.cli import main
from tokencapture.postgres import PostgresStagingStore
from tokencapture.staging import FileStagingStore

__all__ = ["dsn", "pg_dsn", "pg_server"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--staging", "--json"])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if captured.out else captured.err)


@pytest.fixture(params=["file", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A staging store's location (a directory or a DSN) with two rollouts staged."""
    where = str(tmp_path / "staging") if request.param == "file" else request.getfixturevalue("dsn")
    store: Any = FileStagingStore(where) if request.param == "file" else PostgresStagingStore(where)
    for record in chain("a/b", 3):
        assert store.stage(record).ok
    extra = {"raw": b"\x01\x02", "logits": np.arange(6, dtype=np.float16).reshape(2, 3)}
    extra["view"] = memoryview(bytearray(range(8))).cast("H")
    assert store.stage(make_record("solo", extras={"k": 1}), attachments=extra).ok
    if hasattr(store, "close"):
        store.close()
    return where


def test_ls_show_verify(location: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, rows = run(capsys, "ls", location)
    assert code == 0
    assert rows == [
        {
            "rollout_id": "a/b",
            "calls": 3,
            "tokens": 24,
            "max_cum_len": 24,
            "weight_versions": [1],
            "retired": False,
        },
        {
            "rollout_id": "solo",
            "calls": 1,
            "tokens": 3,
            "max_cum_len": 3,
            "weight_versions": [1],
            "retired": False,
        },
    ]
    code, shown = run(capsys, "show", location, "a/b")
    assert code == 0
    assert [(c["model_call_id"], c["parent_call_id"], c["prev_len"]) for c in shown["calls"]] == [
        ("c0", None, 0),
        ("c1", "c0", 8),
        ("c2", "c1", 16),
    ]
    code, solo = run(capsys, "show", location, "solo")
    assert solo["calls"][0]["attachments"] == ["logits", "raw", "view"]
    assert solo["calls"][0]["extras"] == ["k"]
    assert main(["show", location, "solo", "--staging"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == [
        "CALL",
        "PARENT",
        "MODE",
        "PREV",
        "DELTA",
        "CUM",
        "EXTRAS",
        "ATTACHMENTS",
    ]
    assert table[2].split()[-2:] == ["k", "logits,raw,view"]
    code, missing = run(capsys, "show", location, "nope")
    assert code == 2 and "has no staged calls" in missing
    code, verified = run(capsys, "verify", location)
    assert code == 0
    assert verified == {"keys": 4, "rollouts": 2, "damaged": [], "problems": {}, "ok": True}


def test_verify_finds_a_broken_chain(location: str, capsys: pytest.CaptureFixture[str]) -> None:
    store: Any = (
        PostgresStagingStore(location) if location.startswith("postgresql") else None
    ) or FileStagingStore(location)
    orphan = make_record("solo", "late", [5, 6], parent=chain("elsewhere", 1)[0])
    assert store.stage(orphan).ok
    # A call whose digests verify but whose cumulative hash covers only its own delta.
    last = chain("a/b", 3)[-1]
    assert store.stage(make_record("a/b", "c3", [1, 2], parent=last, prefix=[])).ok
    if hasattr(store, "close"):
        store.close()
    code, verified = run(capsys, "verify", location)
    assert code == 1 and not verified["ok"]
    assert verified["problems"] == {
        "a/b": ["a/b/c3: cumulative_hash is not the hash of its chain's tokens"],
        "solo": ["solo/late: parent 'c0' is not staged"],
    }


def test_verify_reports_damage_per_key(
    dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = PostgresStagingStore(dsn)
    for record in chain("r", 2):
        assert store.stage(record).ok
    store.close()
    execute(
        dsn,
        "UPDATE tokencapture.staged_calls SET row_bytes = "
        "overlay(row_bytes placing '\\xff'::bytea from 40 for 1) WHERE staging_key = 'r/c1'",
    )
    code, verified = run(capsys, "verify", dsn)
    assert code == 1
    (problem,) = verified["problems"]["r"]
    assert problem.startswith("r/c1: ") and "damaged" in problem


def test_verify_files_an_unreadable_key_under_its_own_rollout(
    dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unreadable key is reported under the rollout it belongs to, also when the rollout
    id (or the call id) holds ``/``: before, it was filed under the key's text before its first
    ``/`` (``"a"`` for rollout ``"a/b"``)."""
    store = PostgresStagingStore(dsn)
    for record in [*chain("a/b", 2), make_record("q", "x/y"), make_record("a", "z")]:
        assert store.stage(record).ok
    store.close()
    execute(
        dsn,
        "UPDATE tokencapture.staged_calls SET row_bytes = "
        "overlay(row_bytes placing '\\xff'::bytea from 40 for 1) "
        "WHERE staging_key IN ('a/b/c1', 'q/x/y')",
    )
    code, verified = run(capsys, "verify", dsn)
    assert code == 1
    assert sorted(verified["problems"]) == ["a/b", "q"]
    ((problem,),) = [verified["problems"]["a/b"]]
    assert problem.startswith("a/b/c1: ") and "damaged" in problem
    assert verified["problems"]["q"][0].startswith("q/x/y: ")


def damaged_leaf_then(where: Path, rollout_id: str, calls: int) -> tuple[Path, int]:
    """A staging store at `where` whose first call (`leaf/c1`) has a byte flipped in its frame,
    followed by a chain of `calls` calls of `rollout_id` in later batches (so the damage is not
    a torn tail): the segment and the offset of the flipped byte."""
    store = FileStagingStore(where)
    assert store.stage(make_record("leaf", extras={"k": "x" * 64})).ok
    for record in chain(rollout_id, calls):
        assert store.stage(record).ok
    del store
    (segment,) = where.glob("seg-*.tcs")
    data = bytearray(segment.read_bytes())
    at = data.index(b"x" * 64) + 10
    data[at] ^= 0xFF
    segment.write_bytes(bytes(data))
    return segment, at


def test_verify_reports_a_damaged_frame_whose_key_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call whose frame is damaged mid-segment is not listed by ``keys()`` at all: verify
    must report the damaged range itself (before, a damaged leaf call vanished and verify said
    ok)."""
    where = tmp_path / "staging"
    segment, at = damaged_leaf_then(where, "after", 2)
    code, verified = run(capsys, "verify", str(where))
    assert code == 1 and not verified["ok"]
    assert verified["keys"] == 2  # leaf/c1 is not listed
    ((name, start, end),) = verified["damaged"]
    assert name == segment.name and start <= at < end
    (problem,) = verified["problems"]["(damaged)"]
    assert problem.startswith(f"{segment.name}: bytes {start}..{end} ")


def test_retire_and_delete(location: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, retired = run(capsys, "retire", location, "a/b", "never")
    assert code == 0 and retired == {"removed": ["a/b"], "absent": ["never"]}
    # Retired rollouts stay listed (their fences), marked, with nothing fetchable.
    code, rows = run(capsys, "ls", location)
    assert [(row["rollout_id"], row["retired"], row["calls"]) for row in rows] == [
        ("a/b", True, 0),
        ("never", True, 0),
        ("solo", False, 1),
    ]
    assert main(["ls", location, "--staging"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in text[1:-1]] == ["a/b", "never", "solo"]
    assert text[1].endswith("(retired)") and text[2].endswith("(retired)")
    assert not text[3].endswith("(retired)")
    assert text[-1] == "1 staged rollout(s), 2 retired"
    code, deleted = run(capsys, "delete", location, "a/b", "solo")
    assert code == 0 and deleted == {"removed": ["a/b", "solo"], "absent": []}
    assert [(row["rollout_id"], row["retired"]) for row in run(capsys, "ls", location)[1]] == [
        ("never", True)
    ]


def test_copy_between_backends_both_ways(
    location: str,
    tmp_path: Path,
    dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # From the fixture's store into the other backend (a fresh directory, or the database)...
    target = dsn if not location.startswith("postgresql") else str(tmp_path / "copied")
    if target == location:  # pragma: no cover - the fixture's DSN is the test's database
        pytest.fail("source and target are the same store")
    code, copied = run(capsys, "copy", location, target)
    assert code == 0, copied
    assert copied == {
        "copied": {"a/b": 3, "solo": 1},
        "refused": [],
        "mismatched": [],
        "missing_in_source": [],
        "damaged_in_source": [],
    }
    # ... and back into a third store: identical records and attachments.
    back = str(tmp_path / "back")
    code, again = run(capsys, "copy", target, back, "solo", "nope")
    assert code == 1 and again["copied"] == {"solo": 1} and again["missing_in_source"] == ["nope"]
    original: Any = (
        PostgresStagingStore(location, models="tokencapture")
        if location.startswith("postgresql")
        else FileStagingStore(location, models="tokencapture")
    )
    returned = FileStagingStore(back, models="tokencapture")
    try:
        assert returned.fetch_records(["solo/c1"]) == original.fetch_records(["solo/c1"])
        assert returned.fetch_attachments("solo/c1") == original.fetch_attachments("solo/c1")
    finally:
        if hasattr(original, "close"):
            original.close()
    # Copying again is idempotent; a conflicting key in the target is refused, not replaced.
    assert run(capsys, "copy", location, target)[0] == 0
    conflicting = FileStagingStore(tmp_path / "conflicting")
    assert conflicting.stage(make_record("solo", "c1", [9, 9, 9])).ok
    code, refused = run(capsys, "copy", location, str(tmp_path / "conflicting"), "solo")
    assert code == 1
    assert refused["refused"] == [
        'solo/c1: TokenCaptureConflictError: staging key "solo/c1" is already staged with '
        "different content"
    ]


def test_copy_says_what_it_did_not_copy_and_leaves_no_broken_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frame damaged in the source is reported and the copy fails (before, it said it copied
    everything and exited 0, the damaged call missing from the target); a call the target
    refuses takes its descendants with it (before, they were staged on top of the target's
    other parent, a chain that does not verify)."""
    source = tmp_path / "source"
    segment, at = damaged_leaf_then(source, "r", 3)
    target = tmp_path / "target"
    assert FileStagingStore(target).stage(make_record("r", "c0", [9, 9, 9])).ok  # another c0
    code, report = run(capsys, "copy", str(source), str(target))
    assert code == 1
    ((name, start, end),) = report["damaged_in_source"]
    assert name == segment.name and start <= at < end
    assert report["copied"] == {}
    conflict, child, grandchild = report["refused"]
    assert conflict.startswith("r/c0: TokenCaptureConflictError")
    assert child == "r/c1: its parent call 'c0' was not copied"
    assert grandchild == "r/c2: its parent call 'c1' was not copied"
    code, verified = run(capsys, "verify", str(target))
    assert code == 0 and verified["ok"], verified
    assert main(["copy", str(source), str(tmp_path / "text"), "--staging"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"damaged in the source, not copied: segment {name} bytes {start}..{end}"


def test_reading_a_directory_that_holds_no_staging_store_is_refused_and_leaves_it_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ls`/`show`/`verify --staging` on a token store (or an empty directory) said "0 staged
    rollout(s)" and left a `store.lock` behind; now they say what the directory is not, and
    write nothing."""
    from tests.conftest import make_entry

    from tokencapture import TokenCaptureStore

    tokens = tmp_path / "tokens"
    TokenCaptureStore(tokens).append(make_entry("r", call=0))
    empty = tmp_path / "empty"
    empty.mkdir()
    for where, hint in ((tokens, True), (empty, False)):
        before = sorted(p.name for p in where.iterdir())
        for args in (["ls", str(where)], ["show", str(where), "r"], ["verify", str(where)]):
            assert main([*args, "--staging"]) == 2
            err = capsys.readouterr().err
            assert "holds no staging store" in err
            assert ("leave out --staging" in err) is hint
        assert sorted(p.name for p in where.iterdir()) == before
    # A staging store that exists is read as before.
    staging = tmp_path / "staging"
    assert FileStagingStore(staging).stage(make_record("solo")).ok
    code, rows = run(capsys, "ls", str(staging))
    assert code == 0 and [row["rollout_id"] for row in rows] == ["solo"]
