"""Fingerprint version 2: the reference's golden vectors and hand-computed cases per dialect.

Expected values come from ``shared/golden/fingerprints.json`` or are built here with hashlib from
the field format of SPEC section 4, never from the functions under test.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import pytest
from tests.conftest import GOLDEN

from tokencapture.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    canonical_json,
    canonicalize_tool_arguments,
    conversation_digest,
)

FINGERPRINTS: dict[str, Any] = json.loads((GOLDEN / "fingerprints.json").read_text("utf-8"))

FP_DOMAIN = b"nemo-gym-lineage"
CTX_DOMAIN = b"nemo-gym-lineage-context"


def expected_hash(domain: bytes, *fields: tuple[int, str]) -> str:
    """SHA-256 of the domain then each field as tag byte + u64 BE length + UTF-8 bytes."""
    data = bytearray(domain)
    for tag, text in fields:
        raw = text.encode("utf-8")
        data += bytes([tag]) + len(raw).to_bytes(8, "big") + raw
    return hashlib.sha256(bytes(data)).hexdigest()


# --- golden vectors ---------------------------------------------------------------------------


def test_version_matches_golden() -> None:
    assert FINGERPRINT_VERSION == 2
    assert FINGERPRINTS["fingerprint_version"] == FINGERPRINT_VERSION


@pytest.mark.parametrize("vector", FINGERPRINTS["vectors"], ids=lambda v: v["name"])
def test_golden_vector(vector: dict[str, Any]) -> None:
    assert assistant_fingerprint(vector["messages"]) == vector["assistant_fingerprint"]
    assert conversation_digest(vector["messages"]) == vector["conversation_digest"]


# What each golden rejection is about, as our error message words it.
REJECTION_MESSAGES = {
    "non_dict_item": "item must be a dict",
    "content_not_list": "content must be a string, a list or None",
    "block_not_dict": "block must be a string or a dict",
    "block_without_type": "block without a type",
}


@pytest.mark.parametrize("vector", FINGERPRINTS["rejected"], ids=lambda v: v["name"])
def test_golden_rejection(vector: dict[str, Any]) -> None:
    assert vector["assistant_fingerprint"] == {"error": "ValueError"}
    assert vector["conversation_digest"] == {"error": "ValueError"}
    message = REJECTION_MESSAGES[vector["name"]]
    with pytest.raises(ValueError, match=message):
        assistant_fingerprint(vector["messages"])
    with pytest.raises(ValueError, match=message):
        conversation_digest(vector["messages"])


@pytest.mark.parametrize(
    "case", FINGERPRINTS["canonical_tool_arguments"], ids=lambda c: repr(c["value"])
)
def test_golden_canonical_tool_arguments(case: dict[str, Any]) -> None:
    assert canonicalize_tool_arguments(case["value"]) == case["canonical"]


def test_golden_files_are_not_trivial() -> None:
    # Guards the parametrization: an emptied golden file would otherwise pass vacuously.
    assert len(FINGERPRINTS["vectors"]) >= 18
    assert len(FINGERPRINTS["rejected"]) >= 4
    assert len(FINGERPRINTS["canonical_tool_arguments"]) >= 8


# --- canonical JSON -----------------------------------------------------------------------------


def test_canonical_json_sorts_keys_compactly() -> None:
    assert canonical_json({"b": [1, 2.5, None], "a": {"d": True, "c": "é"}}) == (
        '{"a":{"c":"é","d":true},"b":[1,2.5,null]}'
    )


@pytest.mark.parametrize("value", [{1, 2}, 2**70, {"k": object()}, "\ud800"])
def test_canonical_json_rejects_unserializable_with_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="not JSON serializable"):
        canonical_json(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('  {"z": 1, "a": 2}\n', '{"a":2,"z":1}'),
        ("\tnot json at all \n", "not json at all"),
        # Python's json module parses NaN, Infinity and out-of-range numbers to floats that
        # orjson writes as null (NeMo Gym's rule); "nan" is not JSON, so it stays text.
        ("NaN", "null"),
        ("[Infinity, -1e400]", "[null,null]"),
        (" nan ", "nan"),
        ("-0", "0"),
        ([{"b": 1, "a": 0}], '[{"a":0,"b":1}]'),
        (7, "7"),
        (False, "false"),
    ],
)
def test_canonicalize_tool_arguments(value: object, expected: str) -> None:
    assert canonicalize_tool_arguments(value) == expected


# --- hand-computed dialect cases ---------------------------------------------------------------


def test_chat_completions_tool_calls_and_tool_message() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "function": {"name": "lookup", "arguments": '{"b": 2, "a": 1}'}},
                {"function": {"name": "noargs"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert assistant_fingerprint(messages) == expected_hash(
        FP_DOMAIN,
        (0x00, "text"),
        (0x01, "Checking."),
        (0x02, "c1"),
        (0x03, "lookup"),
        (0x04, '{"a":1,"b":2}'),
        (0x02, ""),
        (0x03, "noargs"),
        (0x04, ""),
    )
    # The tool message's content is hashed both as a content part and as the tool result.
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "user"),
        (0x01, "text"),
        (0x02, "hi"),
        (0x00, "assistant"),
        (0x01, "text"),
        (0x02, "Checking."),
        (0x03, "c1"),
        (0x04, "lookup"),
        (0x05, '{"a":1,"b":2}'),
        (0x03, ""),
        (0x04, "noargs"),
        (0x05, ""),
        (0x00, "tool"),
        (0x01, "text"),
        (0x02, "42"),
        (0x06, "c1"),
        (0x07, "42"),
    )


def test_chat_tool_message_with_structured_content() -> None:
    messages = [{"role": "tool", "tool_call_id": "c9", "content": [{"type": "text", "text": "ok"}]}]
    assert assistant_fingerprint(messages) == ""
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "tool"),
        (0x01, "text"),
        (0x02, "ok"),
        (0x06, "c9"),
        (0x07, '[{"text":"ok","type":"text"}]'),
    )


def test_responses_function_call_with_namespace_and_id_fallbacks() -> None:
    messages = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {
            "type": "function_call",
            "call_id": "fc_1",
            "id": "item_1",
            "name": "exec",
            "namespace": "shell",
            "arguments": {"cmd": "ls", "all": True},
        },
        {
            "type": "function_call",
            "id": "item_2",
            "name": "plain",
            "namespace": "",
            "arguments": "",
        },
        {"type": "function_call_output", "id": "out_1", "output": ["a", 1]},
        {"type": "function_call_output", "call_id": "fc_1", "output": "done"},
    ]
    assert assistant_fingerprint(messages) == expected_hash(
        FP_DOMAIN,
        (0x02, "fc_1"),
        (0x03, "shell__exec"),
        (0x04, '{"all":true,"cmd":"ls"}'),
        (0x02, "item_2"),
        (0x03, "plain"),
        (0x04, ""),
    )
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "user"),  # role wins over type
        (0x01, "text"),
        (0x02, "go"),
        (0x00, "function_call"),
        (0x03, "fc_1"),
        (0x04, "shell__exec"),
        (0x05, '{"all":true,"cmd":"ls"}'),
        (0x00, "function_call"),
        (0x03, "item_2"),
        (0x04, "plain"),
        (0x05, ""),
        (0x00, "function_call_output"),
        (0x06, "out_1"),
        (0x07, '["a",1]'),
        (0x00, "function_call_output"),
        (0x06, "fc_1"),
        (0x07, "done"),
    )


def test_anthropic_tool_use_and_tool_result_blocks() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "add"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "tu_1", "name": "calc", "input": {"b": 2, "a": 1}},
                {"type": "tool_use", "name": "nothing", "input": None},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "tu_1", "content": "3"},
                {"type": "tool_result", "id": "tr_2", "content": [{"type": "text", "text": "x"}]},
                "thanks",
            ],
        },
    ]
    # tool_use blocks are tool calls, never content parts.
    assert assistant_fingerprint(messages) == expected_hash(
        FP_DOMAIN,
        (0x00, "text"),
        (0x01, "calling"),
        (0x02, "tu_1"),
        (0x03, "calc"),
        (0x04, '{"a":1,"b":2}'),
        (0x02, ""),
        (0x03, "nothing"),
        (0x04, ""),
    )
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "user"),
        (0x01, "text"),
        (0x02, "add"),
        (0x00, "assistant"),
        (0x01, "text"),
        (0x02, "calling"),
        (0x03, "tu_1"),
        (0x04, "calc"),
        (0x05, '{"a":1,"b":2}'),
        (0x03, ""),
        (0x04, "nothing"),
        (0x05, ""),
        (0x00, "user"),
        (0x01, "text"),
        (0x02, "thanks"),
        (0x06, "tu_1"),
        (0x07, "3"),
        (0x06, "tr_2"),
        (0x07, '[{"text":"x","type":"text"}]'),
    )


def test_typed_non_text_blocks_hash_as_canonical_json() -> None:
    messages = [
        {
            "role": "assistant",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "text", "text": None},  # text-typed without string text: a typed block
                {"type": "input_text", "text": ""},  # empty text: no part
                {"text": "bare"},  # no type reads as "" and carries text
                {"type": "", "text": "empty type"},
                {"type": "refusal", "refusal": "no"},
                "",
            ],
        }
    ]
    fields = [
        ("image_url", '{"image_url":{"url":"data:x"},"type":"image_url"}'),
        ("text", '{"text":null,"type":"text"}'),
        ("text", "bare"),
        ("text", "empty type"),
        ("refusal", '{"refusal":"no","type":"refusal"}'),
    ]
    assert assistant_fingerprint(messages) == expected_hash(
        FP_DOMAIN, *[f for kind, payload in fields for f in ((0x00, kind), (0x01, payload))]
    )
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "assistant"),
        *[f for kind, payload in fields for f in ((0x01, kind), (0x02, payload))],
    )


def test_authored_item_without_fields_is_not_a_root() -> None:
    messages = [{"role": "assistant", "content": None}, {"type": "reasoning", "summary": []}]
    assert assistant_fingerprint(messages) == hashlib.sha256(FP_DOMAIN).hexdigest()
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN, (0x00, "assistant"), (0x00, "reasoning")
    )


def test_no_authored_item_is_a_root() -> None:
    messages = [{"role": "system", "content": "be brief"}, {}, {"type": "function_call_output"}]
    assert assistant_fingerprint(messages) == ""
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "system"),
        (0x01, "text"),
        (0x02, "be brief"),
        (0x00, ""),
        (0x00, "function_call_output"),
        (0x06, ""),
        (0x07, "null"),
    )


def test_length_prefix_separates_field_boundaries() -> None:
    one = [{"role": "assistant", "content": ["ab", "c"]}]
    two = [{"role": "assistant", "content": ["a", "bc"]}]
    assert assistant_fingerprint(one) != assistant_fingerprint(two)
    assert conversation_digest(one) != conversation_digest(two)


def test_accepts_any_iterable_of_items() -> None:
    messages = ({"role": "assistant", "content": "y"},)
    expected = expected_hash(FP_DOMAIN, (0x00, "text"), (0x01, "y"))
    assert assistant_fingerprint(messages) == expected
    assert assistant_fingerprint(iter(messages)) == expected


# --- rejections ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"data": 1}, "without a type"),
        ({"type": "", "data": 1}, "without a type"),
        ({"type": None, "text": 5}, "without a type"),
        ({"type": "image", "blob": {1, 2}}, "not JSON serializable"),
        (12.5, "block must be a string or a dict"),
        (None, "block must be a string or a dict"),
    ],
    ids=repr,
)
def test_invalid_content_block_is_a_value_error(block: object, message: str) -> None:
    messages = [{"role": "assistant", "content": [block]}]
    with pytest.raises(ValueError, match=message):
        assistant_fingerprint(messages)
    with pytest.raises(ValueError, match=message):
        conversation_digest(messages)


@pytest.mark.parametrize(
    ("item", "error", "message"),
    [
        ({"role": "assistant", "content": {"type": "text", "text": "x"}}, ValueError, "content"),
        ({"role": "assistant", "content": "x", "tool_calls": {"id": "c"}}, TypeError, "tool call"),
        ({"role": "assistant", "tool_calls": ["c"]}, TypeError, "tool call must be a dict"),
        ({"role": "assistant", "tool_calls": 3}, TypeError, "not iterable"),
        ({"role": "assistant", "tool_calls": [{"function": "f"}]}, TypeError, "function must be"),
        ({"role": "assistant", "content": "lone \ud800 surrogate"}, UnicodeEncodeError, "utf-8"),
        ({"type": "function_call", "arguments": "1" * 60}, ValueError, "unsupported prompt"),
        ({"type": "function_call", "arguments": '"\\udfff"'}, ValueError, "unsupported prompt"),
        ({"type": "function_call", "arguments": "[" * 300 + "]" * 300}, ValueError, "unsupported"),
        # Deep enough that json.loads recurses out on every supported Python: from 3.12 on it
        # parses 5,000 levels (and reports an unterminated 5,000 as a plain decode error).
        ({"type": "function_call", "arguments": "[" * 100_000}, ValueError, "too deeply"),
    ],
    ids=lambda value: repr(value)[:40],
)
def test_invalid_authored_item_raises(
    item: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        assistant_fingerprint([item])
    with pytest.raises(error, match=message):
        conversation_digest([item])


def test_non_string_identifiers_are_rendered_with_str() -> None:
    # NeMo Gym renders ids, roles, types and names with str(): a null name is "None", a falsy id
    # or role is "", a missing name is "".
    messages = [
        {"role": 7, "content": [{"type": 3, "text": "x"}]},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": 12, "function": {"name": None, "arguments": None}},
                None,
                {"id": 0, "function": {"name": False}},
                {"id": ["a"], "function": {"name": 1.5}},
            ],
        },
        {"type": "function_call", "call_id": True, "name": None, "namespace": 2},
        {"role": 0, "type": "function_call_output", "call_id": 0, "id": 1e16, "output": 1},
    ]
    calls = [("12", "None", ""), ("", "", ""), ("", "False", ""), ("['a']", "1.5", "")]
    calls += [("True", "2__None", "")]
    assert assistant_fingerprint(messages) == expected_hash(
        FP_DOMAIN, *[f for call in calls for f in zip((0x02, 0x03, 0x04), call, strict=True)]
    )
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN,
        (0x00, "7"),
        (0x01, "3"),
        (0x02, '{"text":"x","type":3}'),
        (0x00, "assistant"),
        *[f for call in calls[:4] for f in zip((0x03, 0x04, 0x05), call, strict=True)],
        (0x00, "function_call"),
        *zip((0x03, 0x04, 0x05), calls[4], strict=True),
        (0x00, "function_call_output"),
        (0x06, "1e+16"),
        (0x07, "1"),
    )


def test_function_call_output_with_tool_role_is_one_result() -> None:
    # A Responses output item takes precedence: its role "tool" adds no second result.
    messages = [{"role": "tool", "type": "function_call_output", "call_id": "c", "output": "o"}]
    assert conversation_digest(messages) == expected_hash(
        CTX_DOMAIN, (0x00, "tool"), (0x06, "c"), (0x07, "o")
    )


def test_empty_or_none_messages() -> None:
    empties: tuple[Iterable[object] | None, ...] = (None, [], (), {})
    for messages in empties:
        assert assistant_fingerprint(messages) == ""
        assert conversation_digest(messages) == hashlib.sha256(CTX_DOMAIN).hexdigest()


@pytest.mark.parametrize("item", ["text", None, 3, ["role", "assistant"]], ids=repr)
def test_non_dict_item_is_a_value_error(item: object) -> None:
    with pytest.raises(ValueError, match="must be a dict"):
        assistant_fingerprint([{"role": "assistant", "content": "ok"}, item])
    with pytest.raises(ValueError, match="must be a dict"):
        conversation_digest([item])


def test_fingerprint_reads_only_model_authored_content() -> None:
    # A user item's content is not part of the fingerprint, so it is not validated there;
    # the context digest covers every item and refuses it.
    messages = [{"role": "user", "content": 42}, {"role": "assistant", "content": "y"}]
    assert assistant_fingerprint(messages) == expected_hash(FP_DOMAIN, (0x00, "text"), (0x01, "y"))
    with pytest.raises(ValueError, match="content must be"):
        conversation_digest(messages)


def test_tool_result_output_must_serialize() -> None:
    with pytest.raises(ValueError, match="not JSON serializable"):
        conversation_digest([{"type": "function_call_output", "call_id": "c", "output": {1j}}])
