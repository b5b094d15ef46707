"""Bad input gets a clear exception and writes nothing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry

from tokencapture import _core
from tokencapture.records import TokenEntry
from tokencapture.reference import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore, validate_rollout_id, validate_rollout_ids

BAD_IDS = [
    "",
    "a/b",
    "../x",
    "..\\x",
    "has space",
    "ümlaut",
    "tab\t",
    "x" * (_core.MAX_ROLLOUT_ID_LEN + 1),
    "a\nb",
    "nul\x00",
]


@pytest.fixture
def store(tmp_path: Path) -> TokenCaptureStore:
    return TokenCaptureStore(tmp_path / "capture")


def listing(store: TokenCaptureStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir())


@pytest.mark.parametrize("rollout_id", BAD_IDS)
def test_invalid_rollout_ids_are_refused_everywhere(
    store: TokenCaptureStore, rollout_id: str
) -> None:
    with pytest.raises(ValueError, match="rollout_id"):
        validate_rollout_id(rollout_id)
    with pytest.raises(ValueError):
        store.append(make_entry(rollout_id))
    for call in (
        lambda: store._begin_call(rollout_id, "c"),
        lambda: store._mark_incomplete(rollout_id, "c"),
        lambda: store.freeze_now(rollout_id),
        lambda: store.read_entries(rollout_id),
        lambda: store.retire_now([rollout_id]),
        lambda: store.delete_now([rollout_id]),
        lambda: store.path_for(rollout_id),
    ):
        with pytest.raises(ValueError):
            call()
    assert listing(store) == []


def test_valid_ids_and_batches() -> None:
    assert validate_rollout_id("Run_1.attempt-2") == "Run_1.attempt-2"
    assert validate_rollout_id("x" * _core.MAX_ROLLOUT_ID_LEN)
    assert validate_rollout_ids(["b", "a", "b"]) == ["b", "a"]
    assert validate_rollout_ids(("a",)) == ["a"]
    with pytest.raises(TypeError):
        validate_rollout_ids("ab")
    with pytest.raises(TypeError):
        validate_rollout_id(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"generation_log_probs": [math.nan, -0.1]},
        {"generation_log_probs": [-math.inf, -0.1]},
        {"created_at": math.inf},
        {"routed_experts": [[1.0, math.nan]]},
        {"output_items": [{"type": "message", "score": math.nan}]},
        {"extra_metric": {"deep": [math.inf]}},
    ],
    ids=["nan-logprob", "inf-logprob", "inf-created", "nan-experts", "nan-output", "inf-extra"],
)
def test_non_finite_floats_are_refused_before_writing(
    store: TokenCaptureStore, fields: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="finite"):
        store.append(make_entry(**fields))
    assert listing(store) == []


def test_integers_beyond_64_bits_are_refused(store: TokenCaptureStore) -> None:
    with pytest.raises(ValueError):
        store.append(make_entry(routed_experts=[2**70]))
    assert listing(store) == []


def test_newer_schema_and_mismatched_lengths_are_refused(store: TokenCaptureStore) -> None:
    entry = make_entry()
    for bad in (
        {**entry.model_dump(), "schema_version": 2},
        {**entry.model_dump(), "generation_log_probs": [-1.0]},
    ):
        with pytest.raises(ValueError):
            store.append(bad)  # type: ignore[arg-type]
    assert listing(store) == []


@pytest.mark.parametrize("bad", [None, 42, "entry", b"bytes", [1, 2], object()])
def test_objects_that_are_not_entries_are_refused(store: TokenCaptureStore, bad: object) -> None:
    with pytest.raises(TypeError, match="TokenEntry"):
        store.append(bad)  # type: ignore[arg-type]
    assert listing(store) == []


def test_dicts_missing_fields_are_refused(store: TokenCaptureStore) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        store.append({"rollout_id": "r1", "model_call_id": "c"})  # type: ignore[arg-type]
    assert listing(store) == []


def test_newline_call_id_refused_by_put_and_begin_call_but_mark_incomplete_records(
    store: TokenCaptureStore,
) -> None:
    with pytest.raises(ValueError, match="line break"):
        store.append(make_entry(call="bad\nid"))
    with pytest.raises(ValueError, match="line break"):
        store._begin_call("r1", "bad\nid")
    assert listing(store) == []
    store._mark_incomplete("r1", "bad\nid")
    assert store.is_incomplete("r1")
    assert store.freeze_now("r1").incomplete


@pytest.mark.parametrize("call_id", [" padded", "tab\t", "\x0bvt", "ff\x0c", " "])
@pytest.mark.parametrize(
    "implementation", [TokenCaptureStore, ReferenceStore], ids=["rust", "reference"]
)
def test_whitespace_edged_call_ids_are_refused_by_put_and_begin_call(
    tmp_path: Path, implementation: type[TokenCaptureStore], call_id: str
) -> None:
    """Readers of the intents file strip its lines (as NeMo Gym's store does), so such an
    intent could never match its entry."""
    store = implementation(tmp_path / "capture")
    with pytest.raises(ValueError, match="whitespace"):
        store.append(make_entry(call=call_id))
    with pytest.raises(ValueError, match="whitespace"):
        store._begin_call("r1", call_id)
    assert listing(store) in ([], ["r1.tokens.lock"])
    store.append(make_entry(call="inner space\tis fine"))


@pytest.mark.parametrize(
    "implementation", [TokenCaptureStore, ReferenceStore], ids=["rust", "reference"]
)
def test_freeze_matches_intent_lines_stripped(
    tmp_path: Path, implementation: type[TokenCaptureStore]
) -> None:
    """Intent lines as another writer (NeMo Gym) may have left them: matched stripped of
    ASCII whitespace, blank ones skipped."""
    for name, extra_lines, incomplete in [
        ("padded", b" call-1\t\n\x0b\x0c\n \n", False),
        ("missing", b" call-1\n\tcall-2 \n", True),
    ]:
        store = implementation(tmp_path / name)
        store._begin_call("r1", "call-1")
        store.append(make_entry(call="call-1"))
        with store.intents_path_for("r1").open("ab") as intents:
            intents.write(extra_lines)
        assert store.freeze_now("r1").incomplete is incomplete, name


def test_mutated_entry_with_nan_is_refused(store: TokenCaptureStore) -> None:
    entry = make_entry()
    entry.generation_log_probs[0] = math.nan  # mutation after validation
    with pytest.raises(ValueError, match="finite"):
        store.append(entry)
    assert listing(store) == []


def test_exotic_values_take_the_pydantic_path_identically(store: TokenCaptureStore) -> None:
    from tokencapture.store import canonical_line

    class Tag(str):
        pass

    entry = make_entry(output_items=[{"type": Tag("message"), "n": (1, 2)}], token_item_index=0)
    line = canonical_line(entry)
    assert b'"output_items":[{"n":[1,2],"type":"message"}]' in line
    store.append(entry)
    assert TokenEntry.model_validate_json(store.path_for("r1").read_bytes()).output_items == [
        {"n": [1, 2], "type": "message"}
    ]
