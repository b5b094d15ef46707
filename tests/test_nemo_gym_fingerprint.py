"""Fingerprints against NeMo Gym 0.7.0's own `nemo_gym.token_id_capture.fingerprint`.

A fingerprint is a key shared across processes: ours must equal NeMo Gym's wherever NeMo Gym
returns one, and raise `ValueError`/`TypeError` wherever it raises. Every implementation we have
is compared: the Python module (`tokencapture.fingerprint`, the definition), the native port
(`_core.continuation_hashes`, which must return NeMo Gym's pair or defer with None) and the
lineage stores' `resolve` (native hashes with a Python fallback; the reference store's pure
Python). Expected values are NeMo Gym's
output, computed here by calling it.

`TOKENCAPTURE_FINGERPRINT_EXAMPLES` sets the differential's example count (default 300; run
3000 or more locally to hunt for differences).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import make_entry
from tests.nemo_oracle import import_nemo

from tokencapture import _core
from tokencapture.fingerprint import (
    assistant_fingerprint,
    canonicalize_tool_arguments,
    conversation_digest,
)
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.records import ParentResolutionStatus
from tokencapture.reference.lineage import FileLineageStore as ReferenceLineageStore
from tokencapture.store import TokenCaptureStore

nemo = import_nemo("fingerprint")

EXAMPLES = int(os.environ.get("TOKENCAPTURE_FINGERPRINT_EXAMPLES", "300"))

Outcome: TypeAlias = tuple[str, Any]  # ("ok", value) or ("error", exception type)

# The error of ours that stands in for a stray error of NeMo Gym's.
STAND_INS: dict[type[BaseException], type[BaseException]] = {
    AttributeError: TypeError,
    KeyError: TypeError,
    RecursionError: ValueError,
}


def outcome(function: Callable[[Any], str], value: Any) -> Outcome:
    try:
        return ("ok", function(value))
    except Exception as error:  # any error: its type is the outcome
        return ("error", type(error))


def assert_same(theirs: Outcome, ours: Outcome, what: str) -> None:
    if theirs[0] == "ok":
        assert ours == theirs, what
        return
    assert ours[0] == "error", f"{what}: NeMo Gym raised {theirs[1].__name__}, ours returned"
    assert issubclass(ours[1], (ValueError, TypeError)), what
    expected = STAND_INS.get(theirs[1], theirs[1])
    assert ours[1] is expected, f"{what}: {ours[1].__name__} for NeMo Gym's {theirs[1].__name__}"


# ---- strategies -------------------------------------------------------------------------------
#
# Mostly well-formed dialect items, each field awkward now and then: an input that always fails
# somewhere would only ever compare errors.


def mostly(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], odds: int = 6) -> Any:
    """`usual` about `odds` times as often as `odd` (a coin over 0..99, not `one_of`, whose
    branch choice favours the first and last branch)."""
    cut = 100 // (odds + 1)
    return st.integers(0, 99).flatmap(lambda n: odd if 1 <= n <= cut else usual)


LONE_SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\ud83d"])
clean_texts = st.text(max_size=6) | st.sampled_from(["", " ", "x", "é", "\x00", "'\"", "😀"])
texts = mostly(clean_texts, LONE_SURROGATES, 15)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1e16, 1e-5, 1.5, 1e308]
)
ints = (
    st.integers(-(2**65), 2**65)
    | st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1])
    | st.just(10**59 + 7)
)
scalars = st.none() | st.booleans() | ints | floats | texts
json_like = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
# Python values JSON has no words for: a tuple, a set, a non-string key, bytes.
exotic = st.sampled_from([(1, "a"), frozenset({1}), {1: "x"}, {"k": (1.5,)}, b"bytes"])


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


ARGUMENT_TEXTS = [
    "1e400",
    "-1e400",
    "[1e400, -1e400, 1e-400]",
    "NaN",
    "Infinity",
    "-Infinity",
    '{"x": NaN, "y": [Infinity, -Infinity]}',
    "nan",
    "+Infinity",
    "1" * 60,
    "-" + "9" * 60,
    '{"n": ' + "1" * 60 + "}",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "9" * 4301,
    "9" * 4300,
    '"\\ud800"',
    '{"\\udfff": 1}',
    '"\\ud83d\\ude00"',
    '"\\ud83d"',
    '"raw \ud800 inside"',
    " raw \ud800 outside ",
    "-0",
    "-0.0",
    "1E5",
    "1.0e+2",
    "01",
    "1.",
    ".5",
    "[1,]",
    '{"a": 1, "a": 2}',
    '{"b": 1, "a": {"d": [1, 2], "c": null}}',
    "  \t\n[1, 2]\r\n ",
    "\x1c[1]\x1f",
    "\u3000[1]\u3000",
    "\ufeff[1]",
    '"\\b\\f\\n\\r\\t\\u0000\\u001f\\u007f\\u2028"',
    '"a\tb"',
    "true",
    "null",
    '""',
    "",
    "   ",
    "not json",
    deep(127),
    deep(128),
    deep(129),
    deep(254),
    deep(255),
    deep(256),
    deep(3000),
    '{"a":' * 254 + "1" + "}" * 254,
    '{"a":' * 255 + "1" + "}" * 255,
]
argument_strings = (
    st.sampled_from(ARGUMENT_TEXTS)
    | texts
    | json_like.map(lambda value: _dumps_or_repr(value))
    | st.tuples(st.sampled_from(["", " ", "\n", "\x1c"]), st.sampled_from(ARGUMENT_TEXTS)).map(
        "".join
    )
)


def _dumps_or_repr(value: object) -> str:
    """JSON text of `value` in varied layouts: indented objects, raw non-ASCII in arrays (a lone
    surrogate then sits raw inside a JSON string), escaped elsewhere."""
    try:
        return json.dumps(
            value,
            allow_nan=True,
            indent=1 if isinstance(value, dict) else None,
            ensure_ascii=not isinstance(value, list),
        )
    except (TypeError, ValueError):
        return repr(value)


arguments = mostly(argument_strings, json_like | exotic | st.none(), 3)

ROLE_WORDS = st.sampled_from(["assistant", "user", "tool", "system", "developer"])
TYPE_WORDS = st.sampled_from(["message", "function_call", "function_call_output", "reasoning"])
BLOCK_WORDS = st.sampled_from(
    ["text", "input_text", "output_text", "", "tool_use", "tool_result", "image_url", "refusal"]
)
# Where NeMo Gym wants a string: anything at all, now and then.
awkward = scalars | st.lists(scalars, max_size=2) | st.dictionaries(texts, scalars, max_size=2)


def stringish(words: st.SearchStrategy[Any]) -> Any:
    return mostly(words, st.none() | awkward | exotic, 4)


MISSING = object()


def record(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts with each key possibly missing."""
    return st.fixed_dictionaries(
        {key: st.one_of(st.just(MISSING), value) for key, value in fields.items()}
    ).map(lambda found: {key: value for key, value in found.items() if value is not MISSING})


ids = stringish(st.sampled_from(["c1", "c2", "tu_1", "fc_1", ""]))
names = stringish(st.sampled_from(["lookup", "f", "shell", ""]))
text_blocks = record(type=stringish(BLOCK_WORDS), text=mostly(texts, awkward))
tool_use_blocks = record(type=st.just("tool_use"), id=ids, name=names, input=arguments)
tool_result_blocks = record(
    type=st.just("tool_result"),
    tool_use_id=ids,
    id=ids,
    content=mostly(texts, json_like) | st.lists(text_blocks, max_size=2),
)
other_blocks = record(type=stringish(BLOCK_WORDS), data=mostly(json_like, exotic), text=awkward)
blocks = mostly(
    texts | text_blocks | tool_use_blocks | tool_result_blocks,
    other_blocks | scalars | exotic,
    4,
)
contents = mostly(
    st.none() | texts | st.lists(blocks, max_size=4),
    json_like | exotic | st.dictionaries(texts, texts),
)
functions = mostly(record(name=names, arguments=arguments), awkward)
tool_call = mostly(
    record(id=ids, type=st.just("function"), function=functions), st.none() | awkward
)
tool_calls = mostly(st.lists(tool_call, max_size=3), awkward | exotic)
chat_items = record(
    role=stringish(ROLE_WORDS), content=contents, tool_calls=tool_calls, tool_call_id=ids
)
function_calls = record(
    type=st.just("function_call"),
    role=stringish(st.sampled_from(["assistant", ""])),
    name=names,
    namespace=stringish(st.sampled_from(["shell", ""])),
    call_id=ids,
    id=ids,
    arguments=arguments,
)
outputs = record(
    type=st.just("function_call_output"),
    role=stringish(st.sampled_from(["tool", "user"])),
    call_id=ids,
    id=ids,
    output=mostly(texts, json_like | exotic),
    content=contents,
)
anything = record(
    role=stringish(ROLE_WORDS),
    type=stringish(TYPE_WORDS),
    content=contents,
    tool_calls=tool_calls,
    name=names,
    namespace=names,
    call_id=ids,
    id=ids,
    arguments=arguments,
    output=json_like,
    tool_call_id=ids,
)
message_items = mostly(chat_items | function_calls | outputs | anything, awkward | exotic, 20)
message_lists = st.lists(message_items, max_size=5)


# ---- the differential -------------------------------------------------------------------------


def compare_all(messages: list[Any]) -> None:
    theirs_fp = outcome(nemo.assistant_fingerprint, messages)
    assert_same(theirs_fp, outcome(assistant_fingerprint, messages), "assistant_fingerprint")
    theirs_digest = outcome(nemo.conversation_digest, messages)
    assert_same(theirs_digest, outcome(conversation_digest, messages), "conversation_digest")
    for context_len in sorted({0, len(messages) // 2, len(messages)}):
        native = _core.continuation_hashes(messages, context_len)
        prefix = outcome(nemo.conversation_digest, messages[:context_len])
        if native is not None:
            # The port answers only where it is sure; NeMo Gym must agree and not raise.
            assert ("ok", native[0]) == theirs_fp, "native assistant_fingerprint"
            assert ("ok", native[1]) == prefix, "native conversation_digest"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(message_lists)
def test_hashes_match_nemo_gym(messages: list[Any]) -> None:
    compare_all(messages)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arguments)
def test_canonicalize_tool_arguments_matches_nemo_gym(value: Any) -> None:
    assert_same(
        outcome(nemo.canonicalize_tool_arguments, value),
        outcome(canonicalize_tool_arguments, value),
        "canonicalize_tool_arguments",
    )
    # The same arguments inside each dialect's tool call, through every implementation.
    compare_all(
        [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": value},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": value}]},
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": value}}]},
        ]
    )


@settings(
    max_examples=max(EXAMPLES // 3, 50), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(message_lists)
def test_resolve_uses_nemo_gym_fingerprints(messages: list[Any]) -> None:
    """An entry stamped with NeMo Gym's hashes of the request resolves through our store's
    hashes of that request, exactly when NeMo Gym's hashes exist."""
    check_resolve(InMemoryLineageStore(), messages, lambda store, entry: store.put_now(entry))


def check_resolve(
    store: InMemoryLineageStore | FileLineageStore | ReferenceLineageStore,
    messages: list[Any],
    put: Callable[[Any, Any], object],
) -> None:
    fingerprint = outcome(nemo.assistant_fingerprint, messages)
    if fingerprint[0] == "error":
        with pytest.raises((ValueError, TypeError)):
            store.resolve_now("r", messages)
        return
    context_len = len(messages) // 2
    digest = outcome(nemo.conversation_digest, messages[:context_len])
    if fingerprint[1] == "" or digest[0] == "error":
        # Nothing NeMo Gym could have stamped: a root, or an unhashable context.
        if fingerprint[1] == "":
            assert store.resolve_now("r", messages).status is ParentResolutionStatus.ROOT
        return
    entry = make_entry(
        "r",
        "c-1",
        continuation_fingerprint=fingerprint[1],
        continuation_context_len=context_len,
        continuation_context_digest=digest[1],
        fingerprint_version=2,
    )
    put(store, entry)
    resolution = store.resolve_now("r", messages)
    assert resolution.status is ParentResolutionStatus.RESOLVED, resolution
    assert resolution.match is not None and resolution.match.model_call_id == "c-1"


# ---- the cases issue 15 names -----------------------------------------------------------------


def chat(call: Any) -> list[Any]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]


TABLE: dict[str, list[Any]] = {
    "function name null": chat({"id": "c", "function": {"name": None, "arguments": "{}"}}),
    "function name missing": chat({"id": "c", "function": {"arguments": "{}"}}),
    "function name false": chat({"id": "c", "function": {"name": False}}),
    "function name int": chat({"id": "c", "function": {"name": 7}}),
    "function name float": chat({"id": "c", "function": {"name": 1e16}}),
    "function name list": chat({"id": "c", "function": {"name": ["a", "b'"]}}),
    "tool call id int": chat({"id": 7, "function": {"name": "f"}}),
    "tool call id float": chat({"id": 0.5, "function": {"name": "f"}}),
    "tool call id bool": chat({"id": True, "function": {"name": "f"}}),
    "tool call id list": chat({"id": ["x"], "function": {"name": "f"}}),
    "tool call null": chat(None),
    "tool call empty": chat({}),
    "tool call function null": chat({"id": "c", "function": None}),
    "tool call function empty list": chat({"id": "c", "function": []}),
    "tool call function string": chat({"id": "c", "function": "f"}),
    "tool call string": chat("call"),
    "tool_calls null": [{"role": "assistant", "content": "x", "tool_calls": None}],
    "tool_calls empty dict": [{"role": "assistant", "content": "x", "tool_calls": {}}],
    "tool_calls string": [{"role": "assistant", "tool_calls": "ab"}],
    "tool_calls dict": [{"role": "assistant", "tool_calls": {"id": "c"}}],
    "tool_calls int": [{"role": "assistant", "tool_calls": 3}],
    "role int": [{"role": 1, "content": "x"}],
    "role list": [{"role": ["assistant"], "content": "x"}],
    "role false falls to type": [{"role": False, "type": "message", "content": "x"}],
    "type bool": [{"type": True, "content": "x"}],
    "block type int": [{"role": "assistant", "content": [{"type": 3, "text": "x"}]}],
    "block type zero with text": [{"role": "assistant", "content": [{"type": 0, "text": "x"}]}],
    "block type list": [{"role": "assistant", "content": [{"type": ["t"], "v": 1}]}],
    "function_call name null": [{"type": "function_call", "name": None, "call_id": "c"}],
    "function_call name float": [{"type": "function_call", "name": 2.5}],
    "function_call namespace int": [{"type": "function_call", "name": "n", "namespace": 3}],
    "function_call call_id int": [{"type": "function_call", "name": "n", "call_id": 12}],
    "tool_use name null": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": 5, "name": None}]}
    ],
    "tool_result id int": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 9, "content": 1.5}]}
    ],
    "tool message with output type": [
        {
            "role": "tool",
            "type": "function_call_output",
            "call_id": "c",
            "output": "o",
            "content": "x",
        }
    ],
    "content dict (NeMo refuses)": [{"role": "assistant", "content": {"text": "x"}}],
    "content int (NeMo refuses)": [{"role": "user", "content": 5}],
    "block with non-string key (NeMo refuses)": [
        {"role": "assistant", "content": [{"type": "image", 1: "x"}]}
    ],
    "block with big int (NeMo refuses)": [
        {"role": "assistant", "content": [{"type": "image", "n": 2**64}]}
    ],
    "block with tuple": [{"role": "assistant", "content": [{"type": "image", "t": (1, 2)}]}],
    "block with nan": [{"role": "assistant", "content": [{"type": "image", "n": float("nan")}]}],
    "output set (NeMo refuses)": [{"type": "function_call_output", "output": {1}}],
    "raw lone surrogate text": [{"role": "assistant", "content": "a\ud800"}],
    "raw lone surrogate in a name list": chat({"function": {"name": ["\ud800"]}}),
    "messages None": None,  # type: ignore[dict-item]
    "messages empty dict": {},  # type: ignore[dict-item]
    "messages tuple": ({"role": "assistant", "content": "x"},),  # type: ignore[dict-item]
    **{
        f"arguments {text[:24]!r}": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": text}
        ]
        for text in ARGUMENT_TEXTS
    },
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_named_case_matches_nemo_gym(name: str) -> None:
    messages = TABLE[name]
    assert_same(
        outcome(nemo.assistant_fingerprint, messages),
        outcome(assistant_fingerprint, messages),
        f"{name}: assistant_fingerprint",
    )
    assert_same(
        outcome(nemo.conversation_digest, messages),
        outcome(conversation_digest, messages),
        f"{name}: conversation_digest",
    )
    if isinstance(messages, list):
        compare_all(messages)
        check_resolve(InMemoryLineageStore(), messages, lambda store, entry: store.put_now(entry))


@pytest.mark.parametrize("text", ARGUMENT_TEXTS, ids=lambda text: repr(text[:24]))
def test_named_arguments_match_nemo_gym(text: str) -> None:
    assert_same(
        outcome(nemo.canonicalize_tool_arguments, text),
        outcome(canonicalize_tool_arguments, text),
        "canonicalize_tool_arguments",
    )


# Hand-checked answers for the oddest cases, so a reader sees what NeMo Gym does (and a change
# in the oracle itself would show).
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1e400", "null"),
        ("[NaN, Infinity, -Infinity, -1e400]", "[null,null,null,null]"),
        ("-0", "0"),
        ("1e16", "1e+16"),
        ("1e-5", "0.00001"),
        ("9" * 4301, "9" * 4301),  # over Python's int-string limit: not JSON, kept as text
        ("\x1c[1]\x1f", "[1]"),  # not JSON whitespace, but str.strip() whitespace
        ("\ufeff[1]", "\ufeff[1]"),
        (" raw \ud800 outside ", "raw \ud800 outside"),
    ],
    ids=repr,
)
def test_odd_arguments_canonicalize_as_nemo_gym_does(text: str, expected: str) -> None:
    assert nemo.canonicalize_tool_arguments(text) == expected
    assert canonicalize_tool_arguments(text) == expected


@pytest.mark.parametrize(
    "text", ["1" * 60, '"\\ud800"', '"raw \ud800 inside"', deep(255), "18446744073709551616"]
)
def test_parsed_but_unserializable_arguments_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        nemo.canonicalize_tool_arguments(text)
    with pytest.raises(ValueError):
        canonicalize_tool_arguments(text)


def test_null_function_name_hashes_as_none() -> None:
    messages = chat({"id": "c", "function": {"name": None}})
    assert assistant_fingerprint(messages) == nemo.assistant_fingerprint(messages)
    named = chat({"id": "c", "function": {"name": "None"}})
    assert assistant_fingerprint(messages) == assistant_fingerprint(named)
    assert assistant_fingerprint(messages) != assistant_fingerprint(chat({"id": "c"}))


@pytest.mark.parametrize("resolver", ["native", "reference"])
@pytest.mark.parametrize(
    "name",
    [
        "function name null",
        "tool call id int",
        "tool call null",
        "arguments '1e400'",
        "role int",
        "tool message with output type",
        "tool_calls string",
    ],
)
async def test_file_stores_resolve_with_nemo_gym_fingerprints(
    tmp_path: Path, name: str, resolver: str
) -> None:
    store = TokenCaptureStore(tmp_path)
    lineage = (
        FileLineageStore(tmp_path) if resolver == "native" else ReferenceLineageStore(tmp_path)
    )
    try:
        check_resolve(lineage, TABLE[name], lambda _, entry: store.append(entry))
    finally:
        await lineage.close()
