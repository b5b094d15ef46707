"""Damaged store files: each is repaired safely or refused with an error naming file and problem.

"Repaired safely" means only what is provably unacknowledged is dropped (a final line without
its newline). "Refused" means `TokenCaptureCorruptionError` (a `ValueError`) whose message
names the damaged file, with no file changed by the refused call. Never a silent skip, never
a silent reset. Each test asserts the behavior observed; where a store does something unsafe
the test is an `xfail(strict=True)` naming the bug (see the reliability report).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.reliability.common import (
    StoreLike,
    listing,
    make_entry,
    open_store,
    sha256,
)
from tests.reliability.params import NEEDS_REFERENCE, STORES

from tokencapture.protocols import (
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
)
from tokencapture.store import canonical_line

CALLS = ["c0", "c1", "c2"]


def write_exact_state(root: Path, rollout_id: str = "r", **overrides: Any) -> dict[str, Any]:
    """Write the state index exactly as a store would after indexing the whole log (fields
    in `overrides` replace the computed ones; with `entry_digests` given, the log is not
    parsed)."""
    log = (root / f"{rollout_id}.tokens.jsonl").read_bytes()
    complete = log[: log.rfind(b"\n") + 1]
    digests = overrides.get("entry_digests") or {
        json.loads(line)["model_call_id"]: sha256(line) for line in complete.splitlines()
    }
    state: dict[str, Any] = {
        "entry_digests": digests,
        "frozen": False,
        "incomplete": False,
        "indexed_size": len(complete),
        "retired": False,
        "snapshot_id": "",
        "version": len(digests),
    }
    state.update(overrides)
    (root / f"{rollout_id}.tokens.state.json").write_bytes(
        orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
    )
    return state


@pytest.fixture(params=STORES)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def root(kind: str, tmp_path: Path) -> Path:
    """Rollout "r" with three acknowledged entries and a state index covering all of them."""
    directory = tmp_path / "store"
    store = open_store(kind, directory)
    for call_id in CALLS:
        store.append(make_entry("r", call_id))
    write_exact_state(directory)
    return directory


def fresh(kind: str, root: Path) -> StoreLike:
    """A new store object: nothing cached from before the damage."""
    return open_store(kind, root)


def log_path(root: Path) -> Path:
    return root / "r.tokens.jsonl"


def state_path(root: Path) -> Path:
    return root / "r.tokens.state.json"


def expect_corruption(call: Callable[[], object], path: Path, *words: str) -> str:
    with pytest.raises(TokenCaptureCorruptionError) as caught:
        call()
    message = str(caught.value)
    assert str(path) in message, f"the error does not name {path.name}: {message}"
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    return message


def refused_without_change(root: Path, call: Callable[[], object], path: Path) -> str:
    before = listing(root)
    message = expect_corruption(call, path)
    assert listing(root) == before, "a refused call changed the store's files"
    return message


def ids(entries: Any) -> list[str]:
    return [e.model_call_id for e in entries]


def assert_original_entries(entries: Any) -> None:
    assert ids(entries) == CALLS
    for entry in entries:
        assert canonical_line(entry) == canonical_line(make_entry("r", entry.model_call_id))


# The state index ----------------------------------------------------------------------------


STATE_DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
    "not-json": lambda data: b"this is not json\n",
    "json-array": lambda data: b"[1, 2, 3]",
    "wrong-type": lambda data: data.replace(b'"version":3', b'"version":"three"'),
    "digest-not-hex": lambda data: data.replace(
        b'"entry_digests":{"c0":"', b'"entry_digests":{"c0":"zz'
    ),
    "binary": lambda data: b"\x00\xff" * 40,
}


@pytest.mark.parametrize("damage", sorted(STATE_DAMAGE))
def test_an_unreadable_state_index_is_refused_never_reset(
    kind: str, root: Path, damage: str
) -> None:
    state = state_path(root)
    damaged = STATE_DAMAGE[damage](state.read_bytes())
    assert damaged != state.read_bytes()
    state.write_bytes(damaged)
    store = fresh(kind, root)
    # Writes and lifecycle calls need the index: refused, nothing changed (a reset would
    # drop a fence or an incomplete flag).
    refused_without_change(root, lambda: store.append(make_entry("r", "c3")), state)
    refused_without_change(root, lambda: store._mark_incomplete("r", "c3"), state)
    refused_without_change(root, lambda: store.freeze_now("r"), state)
    refused_without_change(root, lambda: store._begin_call("r", "c3"), state)
    refused_without_change(root, lambda: store.is_incomplete("r"), state)
    # The log itself is intact and still readable: nothing acknowledged is hidden.
    assert_original_entries(store.read_entries("r"))
    # Retiring is how such a rollout is cleaned up: it leaves a well-formed fence.
    assert store.retire_now(["r"]) == {"removed": ["r"], "absent": []}
    assert json.loads(state.read_bytes())["retired"] is True
    with pytest.raises(TokenCaptureRetiredError):
        store.freeze_now("r")
    assert store.delete_now(["r"]) == {"removed": ["r"], "absent": []}
    assert not list(root.glob("r.tokens.*"))


def test_indexed_size_past_the_end_of_the_log_is_refused(kind: str, root: Path) -> None:
    size = log_path(root).stat().st_size
    write_exact_state(root, indexed_size=size + 100)
    store = fresh(kind, root)
    refused_without_change(root, lambda: store.append(make_entry("r", "c3")), log_path(root))
    refused_without_change(root, lambda: store.freeze_now("r"), log_path(root))
    assert_original_entries(store.read_entries("r"))


def test_an_emptied_log_under_an_index_is_refused(kind: str, root: Path) -> None:
    log_path(root).write_bytes(b"")
    store = fresh(kind, root)
    refused_without_change(root, lambda: store.append(make_entry("r", "c3")), log_path(root))
    refused_without_change(root, lambda: store.freeze_now("r"), log_path(root))


def test_a_missing_log_under_an_index_is_refused(kind: str, root: Path) -> None:
    """Not read as an empty, complete rollout: the index proves entries existed."""
    log_path(root).unlink()
    refused_without_change(root, lambda: fresh(kind, root).freeze_now("r"), log_path(root))


def test_a_put_over_a_missing_log_is_refused_not_acknowledged(kind: str, root: Path) -> None:
    """Acknowledging it would leave it behind an index every freeze refuses."""
    log_path(root).unlink()
    refused_without_change(
        root, lambda: fresh(kind, root).append(make_entry("r", "c3")), log_path(root)
    )


def test_indexed_size_inside_a_torn_tail_is_refused_by_freeze(kind: str, root: Path) -> None:
    size = log_path(root).stat().st_size
    with log_path(root).open("ab") as log:
        log.write(b'{"model_call_id":"torn","prompt_token_ids":[1,2,3')
    write_exact_state(root, indexed_size=size + 10)
    refused_without_change(root, lambda: fresh(kind, root).freeze_now("r"), log_path(root))


def test_indexed_size_inside_a_torn_tail_is_refused_by_put(kind: str, tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(kind, root)
    for call_id in CALLS:
        store.append(make_entry("r", call_id))
    size = log_path(root).stat().st_size
    with log_path(root).open("ab") as log:
        log.write(b'{"model_call_id":"torn","prompt_token_ids":[1,2,3')
    write_exact_state(root, indexed_size=size + 10)
    refused_without_change(
        root, lambda: fresh(kind, root).append(make_entry("r", "c3")), log_path(root)
    )


def test_indexed_size_in_the_middle_of_a_verified_line_is_repaired(kind: str, root: Path) -> None:
    """Every line that starts below the cut is verified against its digest, so freeze can
    re-index the log; a put (which only scans the unindexed tail) refuses instead."""
    size = log_path(root).stat().st_size
    write_exact_state(root, indexed_size=size - 5)
    store = fresh(kind, root)
    refused_without_change(root, lambda: store.append(make_entry("r", "c3")), log_path(root))
    snap = store.freeze_now("r")
    assert_original_entries(snap.entries)
    assert json.loads(state_path(root).read_bytes())["indexed_size"] == size
    assert snap.version == 4 and not snap.incomplete


def test_a_wrong_digest_for_an_indexed_line_is_refused(kind: str, root: Path) -> None:
    state = write_exact_state(root)
    state["entry_digests"]["c1"] = "0" * 64
    write_exact_state(root, entry_digests=state["entry_digests"])
    store = fresh(kind, root)
    refused_without_change(root, lambda: store.freeze_now("r"), log_path(root))
    message = expect_corruption(lambda: fresh(kind, root).freeze_now("r"), log_path(root))
    assert "c1" in message and "digest" in message


def test_an_indexed_entry_missing_from_the_index_is_refused(kind: str, root: Path) -> None:
    state = write_exact_state(root)
    del state["entry_digests"]["c2"]
    write_exact_state(root, entry_digests=state["entry_digests"], version=2)
    refused_without_change(root, lambda: fresh(kind, root).freeze_now("r"), log_path(root))


# The log ------------------------------------------------------------------------------------


def replace_line(root: Path, index: int, new: bytes) -> int:
    """Replace line `index` of the log; returns its byte offset."""
    lines = log_path(root).read_bytes().splitlines(keepends=True)
    offset = sum(len(line) for line in lines[:index])
    lines[index] = new + b"\n"
    log_path(root).write_bytes(b"".join(lines))
    return offset


BAD_LINES: dict[str, bytes] = {
    "garbage": b"garbage",
    "empty-line": b"",
    "truncated-json": b'{"model_call_id":"c1","prompt_token_ids":[1,2',
    "json-array": b'["model_call_id","c1"]',
    "no-call-id": b'{"rollout_id":"r","prompt_token_ids":[]}',
    "call-id-not-string": b'{"model_call_id":17}',
    "call-id-twice": b'{"model_call_id":"c1","model_call_id":"c9"}',
    "trailing-bytes": b'{"model_call_id":"c1"} {}',
    "nul-bytes": b"\x00" * 32,
}


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "unindexed-tail"])
@pytest.mark.parametrize("bad", sorted(BAD_LINES))
def test_a_corrupt_middle_line_is_refused_with_file_and_offset(
    kind: str, root: Path, bad: str, indexed: bool
) -> None:
    offset = replace_line(root, 1, BAD_LINES[bad])
    if indexed:
        # The index covers the damaged line (its digest is for the original bytes).
        digests = {c: sha256(canonical_line(make_entry("r", c))) for c in CALLS}
        write_exact_state(root, entry_digests=digests)
    else:
        # Only the first line is indexed: the damage sits in the acknowledged tail.
        first = log_path(root).read_bytes().split(b"\n")[0]
        write_exact_state(
            root, entry_digests={"c0": sha256(first)}, indexed_size=len(first) + 1, version=1
        )
    store = fresh(kind, root)
    where = f"byte offset {offset}"
    expect_corruption(lambda: store.read_entries("r"), log_path(root), where)
    refused_without_change(root, lambda: store.freeze_now("r"), log_path(root))
    if not indexed:
        refused_without_change(root, lambda: store.append(make_entry("r", "c3")), log_path(root))


STRUCTURAL_BUT_NOT_AN_ENTRY: dict[str, bytes] = {
    "bad-number": canonical_line(make_entry("r", "c1")).replace(
        b'"prompt_token_ids":[', b'"prompt_token_ids":[1x,'
    ),
    "not-an-entry": b'{"model_call_id":"c1"}',
    "string-token-id": canonical_line(make_entry("r", "c1")).replace(
        b'"prompt_token_ids":[', b'"prompt_token_ids":["x",'
    ),
    "newer-schema": canonical_line(make_entry("r", "c1")).replace(
        b'"schema_version":1', b'"schema_version":2'
    ),
}


def not_an_entry_params() -> list[Any]:
    params = []
    for name in sorted(STRUCTURAL_BUT_NOT_AN_ENTRY):
        params.append(pytest.param("rust", name, id=f"rust-{name}"))
        params.append(
            pytest.param("reference", name, id=f"reference-{name}", marks=[NEEDS_REFERENCE])
        )
    return params


@pytest.mark.parametrize(("store_kind", "bad"), not_an_entry_params())
def test_a_line_that_is_not_an_entry_is_corruption_naming_the_file(
    store_kind: str, bad: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    store = open_store(store_kind, root)
    for call_id in CALLS:
        store.append(make_entry("r", call_id))
    offset = replace_line(root, 1, STRUCTURAL_BUT_NOT_AN_ENTRY[bad])
    reader = fresh(store_kind, root)
    expect_corruption(lambda: reader.read_entries("r"), log_path(root), f"byte offset {offset}")
    expect_corruption(lambda: reader.freeze_now("r"), log_path(root))


def test_a_torn_final_line_is_dropped_and_truncated(kind: str, root: Path) -> None:
    good = log_path(root).read_bytes()
    log_path(root).write_bytes(good + canonical_line(make_entry("r", "c3")))  # no newline
    store = fresh(kind, root)
    assert_original_entries(store.read_entries("r"))
    assert log_path(root).read_bytes() != good  # readers ignore the tail, never cut it
    assert_original_entries(store.freeze_now("r").entries)
    assert log_path(root).read_bytes() == good


def test_an_identical_duplicate_line_in_the_tail_counts_once(kind: str, root: Path) -> None:
    first = log_path(root).read_bytes().split(b"\n")[0]
    with log_path(root).open("ab") as log:
        log.write(first + b"\n")
    store = fresh(kind, root)
    assert_original_entries(store.read_entries("r"))
    snap = store.freeze_now("r")
    assert_original_entries(snap.entries)
    assert not snap.incomplete and snap.version == 4


def test_a_conflicting_line_in_the_tail_keeps_the_first_and_masks_the_rollout(
    kind: str, root: Path
) -> None:
    other = make_entry("r", "c0", variant=1)
    with log_path(root).open("ab") as log:
        log.write(canonical_line(other) + b"\n")
    snap = fresh(kind, root).freeze_now("r")
    assert_original_entries(snap.entries)
    assert snap.incomplete
    assert fresh(kind, root).is_incomplete("r")


# Lock, temporary and foreign files ---------------------------------------------------------


def test_a_deleted_lock_file_is_recreated_and_nothing_is_lost(kind: str, root: Path) -> None:
    (root / "r.tokens.lock").unlink()
    store = fresh(kind, root)
    assert_original_entries(store.read_entries("r"))
    store.append(make_entry("r", "c3"))
    assert (root / "r.tokens.lock").exists()
    (root / "r.tokens.lock").unlink()
    snap = store.freeze_now("r")
    assert ids(snap.entries) == [*CALLS, "c3"] and not snap.incomplete


STRAY_TEMPS: dict[str, bytes] = {
    "junk": b"\x00garbage",
    "retired-fence": b'{"entry_digests":{},"frozen":true,"incomplete":true,"indexed_size":0,'
    b'"retired":true,"snapshot_id":"x","version":99}',
    "empty": b"",
}


@pytest.mark.parametrize("content", sorted(STRAY_TEMPS))
def test_a_stray_state_temp_file_is_never_mistaken_for_state(
    kind: str, root: Path, content: str
) -> None:
    tmp = root / "r.tokens.state.json.tmp"
    tmp.write_bytes(STRAY_TEMPS[content])
    store = fresh(kind, root)
    assert_original_entries(store.read_entries("r"))
    assert not store.is_incomplete("r")
    store.append(make_entry("r", "c3"))
    snap = store.freeze_now("r")
    assert ids(snap.entries) == [*CALLS, "c3"] and not snap.incomplete
    assert snap.version == 5
    # Retiring or deleting the rollout leaves no temporary file behind.
    store.retire_now(["r"])
    assert not tmp.exists()
    tmp.write_bytes(STRAY_TEMPS[content])
    store.delete_now(["r"])
    assert not list(root.glob("r.tokens.*"))


def test_foreign_files_are_ignored_and_never_removed(kind: str, root: Path) -> None:
    foreign = {
        "notes.txt": b"operator notes",
        "r.tokens.jsonl.bak": b"backup",
        "r.tokens.jsonl~": b"editor backup",
        "r.tokens.unknown": b"?",
        "r.tokens": b"no suffix",
        "other.tokens.state.json.tmp": b"junk",
        ".hidden": b"",
    }
    for name, data in foreign.items():
        (root / name).write_bytes(data)
    (root / "subdir").mkdir()
    store = fresh(kind, root)
    store.append(make_entry("r", "c3"))
    assert ids(store.freeze_now("r").entries) == [*CALLS, "c3"]
    assert store.read_entries("other") == []
    store.retire_now(["r", "other"])
    store.delete_now(["r", "other"])
    for name, data in foreign.items():
        if name == "other.tokens.state.json.tmp":
            continue  # the store's own temporary name for rollout "other": may be cleaned
        assert (root / name).read_bytes() == data, f"{name} was changed or removed"
    assert (root / "subdir").is_dir()


def test_torn_and_undecodable_intent_lines(kind: str, root: Path) -> None:
    intents = root / "r.tokens.intents"
    # A final intent line without its newline was never acknowledged: ignored.
    intents.write_bytes(b"c0\nc9")
    assert not fresh(kind, root).freeze_now("r").incomplete
    # An acknowledged line that is not a known call id (here not even UTF-8) masks the
    # rollout: the conservative reading.
    intents.write_bytes(b"c0\n\xff\xfe\n")
    assert fresh(kind, root).freeze_now("r").incomplete


def test_a_state_file_rewritten_in_place_is_noticed_by_a_live_store(kind: str, root: Path) -> None:
    """A tool that rewrites the state index in place (same inode) changes what a store that
    cached it must see: here, a freeze."""
    live = open_store(kind, root)
    live.append(make_entry("r", "c3"))  # the rollout is now in the live store's cache
    state_path = root / "r.tokens.state.json"
    inode = state_path.stat().st_ino
    write_exact_state(root, frozen=True, snapshot_id="f" * 32)
    assert state_path.stat().st_ino == inode
    with pytest.raises(TokenCaptureFrozenError):
        live.append(make_entry("r", "c4"))
