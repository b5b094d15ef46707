"""The field type rules of `TokenEntry`, native (the store) and pure Python (the reference).

`put` re-checks an entry's current values (pydantic does not validate assignment) and readers
check every decoded record; both stores must refuse the same values with the same message.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from tests.conftest import make_entry

from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.records import ParentResolutionStatus, TokenEntry, check_field_types
from tokencapture.reference.store import canonical_line as reference_canonical_line
from tokencapture.store import TokenCaptureStore, canonical_line

# (field, a value of the wrong type, the message both stores give)
WRONG_VALUES: list[tuple[str, Any, str]] = [
    ("model", 5, "model must be a str, got int"),
    ("model_call_id", b"c", "model_call_id must be a str, got bytes"),
    ("response_id", 7, "response_id must be a str or None, got int"),
    ("schema_version", True, "schema_version must be an int, got bool"),
    ("schema_version", "1", "schema_version must be an int, got str"),
    ("cum_len", 1.5, "cum_len must be an int, got float"),
    ("prompt_is_delta", 1, "prompt_is_delta must be a bool, got int"),
    ("created_at", "now", "created_at must be a float, got str"),
    ("created_at", False, "created_at must be a float, got bool"),
    ("parent_resolution", "maybe", "parent_resolution 'maybe' is not one of"),
    ("output_items", [1], "output_items must be a list of dicts"),
    ("output_items", {"a": 1}, "output_items must be a list of dicts"),
]


@pytest.mark.parametrize(("field", "value", "message"), WRONG_VALUES)
def test_put_refuses_a_mutated_field_in_both_stores_alike(
    field: str, value: Any, message: str
) -> None:
    entry = make_entry("r", "c1")
    entry.__dict__[field] = value  # as an assignment after validation would
    assert_both_stores_refuse(entry, message)


def assert_both_stores_refuse(entry: TokenEntry, message: str) -> None:
    """Both stores refuse to serialize `entry`, with the same message, which says `message`."""
    errors = []
    for serialize in (canonical_line, reference_canonical_line):
        with pytest.raises(ValueError, match="cannot be stored") as raised:
            serialize(entry)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    assert message in errors[0]


class _Int(int):
    pass


class _Float(float):
    pass


# (token array, index, a wrong item, the message both stores give)
WRONG_ITEMS: list[tuple[str, int, Any, str]] = [
    ("prompt_token_ids", 0, True, "prompt_token_ids.0 must be an int, got bool"),
    ("prompt_token_ids", 3, "7", "prompt_token_ids.3 must be an int, got str"),
    ("generation_token_ids", 1, 2.0, "generation_token_ids.1 must be an int, got float"),
    ("generation_token_ids", 0, None, "generation_token_ids.0 must be an int, got NoneType"),
    ("generation_log_probs", 1, False, "generation_log_probs.1 must be a float, got bool"),
    ("generation_log_probs", 0, "-0.5", "generation_log_probs.0 must be a float, got str"),
    ("generation_log_probs", 1, float("inf"), "generation_log_probs.1 is inf"),
    ("generation_log_probs", 0, _Float("nan"), "generation_log_probs.0 is nan"),
    ("generation_log_probs", 1, -math.inf, "generation_log_probs.1 is -inf"),
]


@pytest.mark.parametrize(("field", "index", "item", "message"), WRONG_ITEMS)
def test_put_refuses_a_mutated_token_array_item_in_both_stores_alike(
    field: str, index: int, item: Any, message: str
) -> None:
    entry = make_entry("r", "c1", prompt_token_ids=[11, 12, 13, 14], generation_token_ids=[21, 22])
    getattr(entry, field)[index] = item  # lists stay mutable after validation
    assert_both_stores_refuse(entry, message)


def test_number_subclasses_and_ints_in_log_probs_are_stored_as_plain_numbers() -> None:
    entry = make_entry("r", "c1", prompt_token_ids=[11, 12, 13], generation_token_ids=[21, 22])
    entry.prompt_token_ids[1] = _Int(12)
    entry.generation_log_probs[0] = _Float(-0.25)
    entry.generation_log_probs[1] = -1
    line = canonical_line(entry)
    assert line == reference_canonical_line(entry)
    stored = orjson.loads(line)
    assert stored["prompt_token_ids"] == [11, 12, 13]
    assert stored["generation_log_probs"] == [-0.25, -1]


def test_the_status_message_names_every_status() -> None:
    values = make_entry("r", "c1").model_dump()
    values["parent_resolution"] = "maybe"
    with pytest.raises(ValueError) as raised:
        check_field_types(values)
    expected = sorted(status.value for status in ParentResolutionStatus)
    assert str(raised.value) == f"parent_resolution 'maybe' is not one of {expected}"


def test_a_missing_required_field_is_named() -> None:
    entry = make_entry("r", "c1")
    del entry.__dict__["prompt_token_ids"]
    for serialize in (canonical_line, reference_canonical_line):
        with pytest.raises(ValueError, match=r"missing field\(s\) prompt_token_ids"):
            serialize(entry)


# A stored line with a wrong-typed field (the call id must be a string to be a record at all).
# The reference reads back through pydantic's lax mode, which coerces some of these ("1" into
# 1, false into 0.0); the Rust-backed store holds stored lines to the rules put applies.
STORED_WRONG_VALUES = [case for case in WRONG_VALUES if case[0] != "model_call_id"]


@pytest.mark.parametrize(("field", "value", "message"), STORED_WRONG_VALUES)
def test_readers_refuse_a_stored_field_of_the_wrong_type(
    field: str, value: Any, message: str, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c0"))
    bad = make_entry("r", "c1")
    bad.__dict__[field] = value
    line = orjson.dumps(dict(bad.__dict__), option=orjson.OPT_SORT_KEYS, default=str)
    with (tmp_path / "r.tokens.jsonl").open("ab") as log:
        log.write(line + b"\n")
    reader = TokenCaptureStore(tmp_path)
    with pytest.raises(TokenCaptureCorruptionError, match="not a valid entry") as raised:
        reader.read_entries("r")
    assert message in str(raised.value)
    with pytest.raises(TokenCaptureCorruptionError, match="not a valid entry"):
        reader.freeze_now("r")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prompt_token_ids", [1, True], "prompt_token_ids must be a list of ints"),
        ("generation_token_ids", [1.5, 2], "generation_token_ids must be a list of ints"),
        ("generation_log_probs", [-0.5, "x"], "generation_log_probs must be a list of floats"),
        ("generation_log_probs", [None, -0.5], "generation_log_probs must be a list of floats"),
    ],
)
def test_readers_refuse_a_stored_token_array_with_a_wrong_item(
    field: str, value: Any, message: str, tmp_path: Path
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c0"))
    line = orjson.loads(canonical_line(make_entry("r", "c1")))
    line[field] = value
    with (tmp_path / "r.tokens.jsonl").open("ab") as log:
        log.write(orjson.dumps(line, option=orjson.OPT_SORT_KEYS) + b"\n")
    reader = TokenCaptureStore(tmp_path)
    with pytest.raises(TokenCaptureCorruptionError, match=message):
        reader.read_entries("r")
    with pytest.raises(TokenCaptureCorruptionError, match=message):
        reader.freeze_now("r")


def _records() -> list[dict[str, Any]]:
    base = orjson.loads(canonical_line(make_entry("r", "c1")))
    resolved = orjson.loads(
        canonical_line(
            make_entry(
                "r",
                "c2",
                parent_call_id="c1",
                parent_resolution=ParentResolutionStatus.RESOLVED,
            )
        )
    )
    with_extra = {**base, "model_call_id": "c3", "custom_tag": {"k": [1, 2]}}
    missing_default = {k: v for k, v in base.items() if k not in ("digest", "cum_len")}
    return [base, resolved, with_extra, missing_default]


@pytest.mark.parametrize("record", _records(), ids=["all", "resolved", "extra", "defaults"])
def test_entries_built_from_records_equal_model_construct(record: dict[str, Any]) -> None:
    """Readers build entries without `model_construct` when a record holds exactly the
    model's fields; the result must be indistinguishable from it."""
    from tokencapture.entries import entry_from_record

    built = entry_from_record(dict(record))
    expected_values = dict(record)
    if expected_values.get("parent_resolution") is not None:
        expected_values["parent_resolution"] = ParentResolutionStatus(
            expected_values["parent_resolution"]
        )
    expected = TokenEntry.model_construct(**expected_values)
    assert list(built.__dict__.items()) == list(expected.__dict__.items())
    assert built.__pydantic_fields_set__ == expected.__pydantic_fields_set__
    assert built.__pydantic_extra__ == expected.__pydantic_extra__
    assert built.__pydantic_private__ == expected.__pydantic_private__
    assert repr(built) == repr(expected)
    assert built.model_dump_json() == expected.model_dump_json()
    assert built == expected
    # Each entry owns its bookkeeping: changing one leaves the next untouched.
    again = entry_from_record(dict(record))
    built.model_call_id = "changed"
    assert again.model_call_id == record["model_call_id"]
    assert again.__pydantic_fields_set__ is not built.__pydantic_fields_set__
