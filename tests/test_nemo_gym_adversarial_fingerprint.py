"""An adversarial second differential of the fingerprints against NeMo Gym 0.7.0.

Written apart from `tests/test_nemo_gym_fingerprint.py`, with its own generator: a seeded
`random.Random` builds request item lists in the three dialects a model server sees (Chat
Completions messages with `tool_calls`, Responses items such as `function_call` /
`function_call_output` / `reasoning`, Anthropic `tool_use` / `tool_result` blocks), each field
now and then replaced by an awkward value: `null`, numbers and booleans where strings go,
containers, astral, combining, NUL, line-separator and lone-surrogate characters, floats that
orjson and Python format differently (``1e16``, ``1e-07``, ``-0.0``, ``5e-324``), integers at
and past the 64-bit edges, `NaN` / `Infinity`, and tool-argument strings with duplicate keys,
Python-only whitespace, too-deep nesting, and numbers `json.loads` reads but orjson cannot
write.

Every case is compared with NeMo Gym's own functions: the same value, or an error of the same
type where NeMo Gym raises (ours may stand a `TypeError` in for its `AttributeError`, and a
`ValueError` in for its `RecursionError`). The native port (`_core.continuation_hashes`) must
give NeMo Gym's pair or defer (None).

`TOKENCAPTURE_ADVERSARIAL_EXAMPLES` sets the number of generated request lists (default 8000,
a few seconds; run 50000 or more locally).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from tests.nemo_oracle import import_nemo

from tokencapture import _core
from tokencapture.fingerprint import (
    assistant_fingerprint,
    canonicalize_tool_arguments,
    conversation_digest,
)

nemo = import_nemo("fingerprint")

EXAMPLES = int(os.environ.get("TOKENCAPTURE_ADVERSARIAL_EXAMPLES", "8000"))

# Where NeMo Gym raises a stray error, ours raises the error named here.
STAND_INS: dict[str, str] = {
    "AttributeError": "TypeError",
    "KeyError": "TypeError",
    "RecursionError": "ValueError",
}

TEXTS: list[str] = [
    "",
    " ",
    "hello",
    "assistant",
    "user",
    "tool",
    "text",
    "input_text",
    "output_text",
    "tool_use",
    "tool_result",
    "function_call",
    "function_call_output",
    "image_url",
    "refusal",
    "None",
    "0",
    "NaN",
    "\x00",
    "nul\x00inside",
    "\ud800",
    "pair\ud83d\ude00",
    "e\u0301",
    "\U0001f600",
    "\u2028\u2029",
    "\x7f",
    "\u0085",
    "\x1c",
    "\ufeff",
    "</script>",
    "\\",
    '"',
    "/",
    "é",
    "\uffff",
    "\U00010000",
    "\t\n\r\x08\x0c",
]
NUMBERS: list[Any] = [
    0,
    1,
    -1,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**60,
    0.0,
    -0.0,
    1.5,
    1e16,
    1e15,
    123456789.123,
    1e-7,
    1e-5,
    0.0001,
    1e300,
    5e-324,
    float("inf"),
    float("-inf"),
    float("nan"),
    1 / 3,
    100.0,
    1e22,
    1e21,
    2.5e-5,
    True,
    False,
]
ARGUMENT_TEXTS: list[str] = [
    '{"b":1,"a":2}',
    '{"a":1,"a":2}',
    '{"a":{"x":1},"a":[2]}',
    ' {"x": [1, 2.0, 1e400]} ',
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "1" * 60,
    "-" + "9" * 25,
    '"\\ud800"',
    '"\\udc00x"',
    '"\\ud83d\\ude00"',
    '{"a":"\\u0000"}',
    "   ",
    '\x1c{"a":1}\x1f',
    '\u00a0{"a":1}\u3000',
    "\u180e{}\u200b",
    "not json",
    "",
    '{"a":1e16}',
    "[1.0, -0.0, 0.1, 1e-7, 1E+2, 5e-324]",
    '{"\\u00e9":1,"e\\u0301":2,"\\uffff":3,"\\ud800\\udc00":4,"Z":5,"_":6}',
    '{"a": {"b": {"c": [null, true, false]}}}',
    "[" * 300 + "]" * 300,
    "[" * 120 + "]" * 120,
    "[" * 5000 + "]" * 5000,
    "1" * 5000,
    '"\\u2028\\u007f"',
    '{"a":1}x',
    "-0",
    "18446744073709551616",
    "-9223372036854775809",
    "18446744073709551615",
    "1.7976931348623157e308",
    "2.2250738585072014e-308",
    "0.1e1",
    "\ufeff{}",
    '"\x01"',
    '{"a":"é\\n\\t\\b\\f\\r\\/"}',
    "{'a': 1}",
    "01",
    "[1,]",
    "\n\t {}\n",
]

BLOCK_TYPES: list[Any] = [
    *("text", "input_text", "output_text", "", None, "image_url", "tool_use", "tool_result"),
    *("refusal", "thinking", "input_image", 0, 1, True, ["x"], 2.5),
]


class Generator:
    """Request item lists of the three dialects, every field awkward now and then."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def scalar(self) -> Any:
        roll = self.rng.random()
        if roll < 0.5:
            return self.rng.choice(TEXTS)
        if roll < 0.85:
            return self.rng.choice(NUMBERS)
        return None

    def value(self, depth: int = 0) -> Any:
        roll = self.rng.random()
        if depth > 3 or roll < 0.5:
            return self.scalar()
        if roll < 0.75:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        size = self.rng.randint(0, 3)
        return {self.rng.choice(TEXTS): self.value(depth + 1) for _ in range(size)}

    def odd(self, usual: Any, odds: float = 0.15) -> Any:
        """`usual`, or now and then an awkward stand-in for it."""
        if self.rng.random() >= odds:
            return usual
        return self.rng.choice(
            [
                *(None, self.value(), self.scalar(), [], {}, [self.scalar()]),
                *({"a": self.scalar()}, (self.scalar(), "t"), b"bytes", {1: "int key"}),
                *({True: 1}, {"s": {1, 2}}),
            ]
        )

    def arguments(self) -> Any:
        roll = self.rng.random()
        if roll < 0.6:
            return self.rng.choice(ARGUMENT_TEXTS)
        if roll < 0.8:
            return self.value()
        try:
            text = json.dumps(self.value(), ensure_ascii=self.rng.random() < 0.5)
        except ValueError:
            text = "{}"
        return self.odd(text)

    def block(self) -> Any:
        kind = self.rng.choice(BLOCK_TYPES)
        block: dict[str, Any] = {}
        if self.rng.random() < 0.9:
            block["type"] = kind
        if kind == "tool_use":
            block["id"] = self.odd(self.rng.choice(["toolu_1", "call_2", ""]))
            block["input"] = self.odd(
                self.value() if self.rng.random() < 0.5 else {"q": self.rng.choice(NUMBERS)}
            )
            if self.rng.random() < 0.9:
                block["name"] = self.odd("search")
        elif kind == "tool_result":
            block["tool_use_id"] = self.odd("toolu_1")
            block["content"] = self.odd(
                self.rng.choice(
                    [self.rng.choice(TEXTS), [{"type": "text", "text": "r"}], self.value()]
                )
            )
            if self.rng.random() < 0.2:
                block["is_error"] = self.rng.choice([True, 1.0])
        else:
            if self.rng.random() < 0.85:
                block["text"] = self.odd(self.rng.choice(TEXTS))
            if self.rng.random() < 0.3:
                extra = self.rng.choice(["image_url", "cache_control", "annotations", "logprobs"])
                block[extra] = self.value()
        if self.rng.random() < 0.08:
            return self.rng.choice(TEXTS) if self.rng.random() < 0.8 else self.odd(None, 1.0)
        return block

    def content(self) -> Any:
        roll = self.rng.random()
        if roll < 0.35:
            return self.rng.choice(TEXTS)
        if roll < 0.85:
            return [self.block() for _ in range(self.rng.randint(0, 3))]
        return self.odd(None, 0.5)

    def item(self) -> Any:
        roll = self.rng.random()
        item: dict[str, Any]
        if roll < 0.2:
            role = self.odd(self.rng.choice(["user", "system", "developer"]))
            item = {"role": role, "content": self.content()}
        elif roll < 0.45:
            item = {"role": "assistant", "content": self.content()}
            if self.rng.random() < 0.5:
                calls = []
                for _ in range(self.rng.randint(0, 3)):
                    function = {"name": self.odd("get_weather"), "arguments": self.arguments()}
                    call: dict[str, Any] = {
                        "id": self.odd(f"call_{self.rng.randint(0, 9)}"),
                        "type": "function",
                        "function": self.odd(function),
                    }
                    if self.rng.random() < 0.1:
                        del call["function"]
                    calls.append(self.odd(call, 0.05))
                item["tool_calls"] = self.odd(calls, 0.1)
        elif roll < 0.6:
            item = {"role": "tool", "tool_call_id": self.odd("call_1"), "content": self.content()}
        elif roll < 0.8:
            item = {
                "type": "function_call",
                "call_id": self.odd("call_1"),
                "name": self.odd("fn"),
                "arguments": self.arguments(),
            }
            if self.rng.random() < 0.3:
                item["namespace"] = self.odd("mcp")
            if self.rng.random() < 0.3:
                item["id"] = self.odd("fc_1")
            if self.rng.random() < 0.1:
                del item["name"]
            if self.rng.random() < 0.1:
                item["status"] = "completed"
        elif roll < 0.92:
            output = self.rng.choice([self.rng.choice(TEXTS), self.value()])
            item = {"type": "function_call_output", "call_id": self.odd("call_1")}
            item["output"] = self.odd(output)
        else:
            item = {
                "type": self.rng.choice(["message", "reasoning", "web_search_call"]),
                "role": self.odd("assistant"),
                "content": self.content(),
            }
        if self.rng.random() < 0.1:
            keys = list(item)
            self.rng.shuffle(keys)
            item = {key: item[key] for key in keys}
        if self.rng.random() < 0.03:
            return self.odd(None, 1.0)
        return item

    def items(self) -> list[Any]:
        return [self.item() for _ in range(self.rng.randint(0, 5))]


def outcome(function: Callable[[Any], str], value: Any) -> tuple[str, Any]:
    try:
        return ("ok", function(value))
    except RecursionError:
        return ("error", "RecursionError")
    except Exception as error:  # any error: its type is the outcome
        return ("error", type(error).__name__)


def agrees(theirs: tuple[str, Any], ours: tuple[str, Any]) -> bool:
    if theirs[0] == "ok" or ours[0] == "ok":
        return theirs == ours
    return bool(ours[1] == STAND_INS.get(theirs[1], theirs[1]))


FUNCTIONS: list[tuple[str, Callable[[Any], str], Callable[[Any], str]]] = [
    ("assistant_fingerprint", nemo.assistant_fingerprint, assistant_fingerprint),
    ("conversation_digest", nemo.conversation_digest, conversation_digest),
]


@pytest.mark.parametrize("seed", range(4))
def test_generated_requests_hash_as_nemo_gym_hashes_them(seed: int) -> None:
    generator = Generator(seed)
    mismatches: list[str] = []
    ported = 0
    for _ in range(max(EXAMPLES // 4, 1)):
        items = generator.items()
        for name, theirs_fn, ours_fn in FUNCTIONS:
            theirs, ours = outcome(theirs_fn, items), outcome(ours_fn, items)
            if not agrees(theirs, ours):
                mismatches.append(f"{name}: NeMo {theirs} ours {ours} for {items!r:.400}")
        context_len = generator.rng.randint(0, len(items))
        native = _core.continuation_hashes(items, context_len)
        if native is not None:
            ported += 1
            expected = (
                outcome(nemo.assistant_fingerprint, items),
                outcome(nemo.conversation_digest, items[:context_len]),
            )
            if expected != (("ok", native[0]), ("ok", native[1])):
                mismatches.append(f"native: {native} NeMo {expected} for {items!r:.400}")
        value = generator.arguments() if generator.rng.random() < 0.7 else generator.value()
        theirs = outcome(nemo.canonicalize_tool_arguments, value)
        ours = outcome(canonicalize_tool_arguments, value)
        if not agrees(theirs, ours):
            mismatches.append(f"arguments: NeMo {theirs} ours {ours} for {value!r:.300}")
    assert not mismatches, "\n".join(mismatches[:10])
    # The generator must also reach the native port, not only the Python fallback.
    assert ported > 0


@pytest.mark.parametrize("text", ARGUMENT_TEXTS)
def test_every_awkward_argument_text_canonicalizes_as_nemo_gym_does(text: str) -> None:
    for value in (text, f"  {text}\n", {"nested": text}, [text]):
        theirs = outcome(nemo.canonicalize_tool_arguments, value)
        ours = outcome(canonicalize_tool_arguments, value)
        assert agrees(theirs, ours), (value, theirs, ours)
        items = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": value}]
        for _, theirs_fn, ours_fn in FUNCTIONS:
            assert agrees(outcome(theirs_fn, items), outcome(ours_fn, items)), items


@pytest.mark.parametrize("number", NUMBERS, ids=repr)
def test_numbers_in_content_blocks_are_written_as_orjson_writes_them(number: Any) -> None:
    """Floats in a non-text block are part of its canonical JSON: orjson's formatting, not
    Python's `repr` (``1e16``, not ``1e+16``), non-finite floats as ``null``."""
    items = [
        {"role": "user", "content": [{"type": "input_image", "detail": number}]},
        {"role": "assistant", "content": [{"type": "refusal", "score": [number, {"x": number}]}]},
        {"type": "function_call_output", "call_id": "c", "output": {"v": number}},
    ]
    for _, theirs_fn, ours_fn in FUNCTIONS:
        theirs, ours = outcome(theirs_fn, items), outcome(ours_fn, items)
        assert agrees(theirs, ours), (number, theirs, ours)
    native = _core.continuation_hashes(items, 2)
    if native is not None:
        assert native == (nemo.assistant_fingerprint(items), nemo.conversation_digest(items[:2]))


@pytest.mark.parametrize(
    "messages",
    [None, (), "", b"", {}, 0, False, "ab", {"role": "assistant"}, 5, b"x", iter([])],
    ids=repr,
)
def test_non_list_messages_are_read_as_nemo_gym_reads_them(messages: Any) -> None:
    for _, theirs_fn, ours_fn in FUNCTIONS:
        assert agrees(outcome(theirs_fn, messages), outcome(ours_fn, messages)), messages
