"""Hostile inputs for the store, shared by `tests/test_reliability_hostile.py` and the table
script `hostile_table.py`.

Each case names one input, the call it goes through and what must happen:

* `REFUSED`: a `ValueError`/`TypeError` subclass whose message mentions the problem (every
  word of `words`, case-insensitive), with nothing written: the directory is byte-for-byte
  unchanged.
* `ACCEPTED`: the call succeeds and the entry reads back byte-identical (a put), or the
  rollout is marked (mark_incomplete, which must take any call id).
* `EITHER`: refused as above, or accepted and readable back; never accepted-but-unreadable.

`bugs` maps a store kind to the reason its behavior is a known bug (the test is an
`xfail(strict=True)` there).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import BaseModel
from tests.reliability.common import StoreLike, make_entry

from tokencapture.records import TokenEntry

__all__ = ["ACCEPTED", "CASES", "EITHER", "REFUSED", "Case", "nested"]

REFUSED = "refused"
ACCEPTED = "accepted"
EITHER = "either"

ROLLOUT = "r"  # the rollout that already holds one entry when a case runs


@dataclass(frozen=True)
class Case:
    id: str
    input: str  # for the table
    op: str  # for the table
    call: Callable[[StoreLike], object]
    expect: str
    words: tuple[str, ...] = ()
    puts: TokenEntry | Callable[[], TokenEntry] | None = None  # what an accepted put reads back
    marks: bool = False  # an accepted call that must mark ROLLOUT incomplete
    bugs: dict[str, str] = field(default_factory=dict)

    def expected_entry(self) -> TokenEntry | None:
        return self.puts() if callable(self.puts) else self.puts


@functools.lru_cache(maxsize=1)
def huge() -> TokenEntry:
    """A 2,000,000-token prompt (built once, on first use)."""
    return entry(prompt_token_ids=list(range(2_000_000)))


def nested(depth: int, leaf: Any = 1, kind: str = "dict") -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value} if kind == "dict" else [value]
    return value


def fields(**overrides: Any) -> dict[str, Any]:
    """The keyword arguments of a small valid entry of ROLLOUT, with overrides."""
    values: dict[str, Any] = {
        "rollout_id": ROLLOUT,
        "model_call_id": "hostile",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -0.25],
    }
    values.update(overrides)
    return values


def entry(**overrides: Any) -> TokenEntry:
    return TokenEntry(**fields(**overrides))


def put(**overrides: Any) -> Callable[[StoreLike], object]:
    built = entry(**overrides)
    return lambda store: store.append(built)


def put_dict(**overrides: Any) -> Callable[[StoreLike], object]:
    raw = fields(**overrides)
    return lambda store: store.append(cast(Any, raw))


def put_raw(value: object) -> Callable[[StoreLike], object]:
    return lambda store: store.append(cast(Any, value))


def put_async(built: TokenEntry) -> Callable[[StoreLike], object]:
    return lambda store: asyncio.run(store.put(built))


def mutated(name: str, value: Any) -> Callable[[StoreLike], object]:
    built = entry()
    setattr(built, name, value)  # pydantic models do not validate assignment by default
    return lambda store: store.append(built)


def constructed(**overrides: Any) -> Callable[[StoreLike], object]:
    built = TokenEntry.model_construct(**fields(**overrides))  # skips validation
    return lambda store: store.append(built)


class ForeignEntry(BaseModel):
    """A pydantic model that is not a TokenEntry and lacks its required fields."""

    rollout_id: str = ROLLOUT
    model_call_id: str = "foreign"


NAN = math.nan
INF = math.inf

CASES: list[Case] = [
    # Rollout ids --------------------------------------------------------------------------
    Case(
        "rid-dotdot-slash",
        "rollout_id `'../escape'`",
        "put",
        put(rollout_id="../escape"),
        REFUSED,
        ("rollout_id", "'/'"),
    ),
    Case(
        "rid-absolute",
        "rollout_id `'/etc/passwd'`",
        "put",
        put(rollout_id="/etc/passwd"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-backslash",
        "rollout_id `'a\\\\b'`",
        "put",
        put(rollout_id="a\\b"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-empty", "rollout_id `''`", "put", put(rollout_id=""), REFUSED, ("rollout_id", "empty")
    ),
    Case(
        "rid-201",
        "rollout_id of 201 chars",
        "put",
        put(rollout_id="x" * 201),
        REFUSED,
        ("rollout_id", "200"),
    ),
    Case(
        "rid-100k",
        "rollout_id of 100,000 chars",
        "put",
        put(rollout_id="x" * 100_000),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-nul", "rollout_id with NUL", "put", put(rollout_id="a\x00b"), REFUSED, ("rollout_id",)
    ),
    Case(
        "rid-unicode",
        "rollout_id `'rö'` (non-ASCII)",
        "put",
        put(rollout_id="rö"),
        REFUSED,
        ("rollout_id",),
    ),
    Case("rid-space", "rollout_id `'a b'`", "put", put(rollout_id="a b"), REFUSED, ("rollout_id",)),
    Case(
        "rid-surrogate",
        "rollout_id with a lone surrogate",
        "put",
        put(rollout_id="a\ud800"),
        REFUSED,
        ("surrogate",),
    ),
    Case(
        "rid-freeze",
        "rollout_id `'../x'`",
        "freeze_now",
        lambda s: s.freeze_now("../x"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-read",
        "rollout_id `'a/b'`",
        "read_entries",
        lambda s: s.read_entries("a/b"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-begin",
        "rollout_id `'../x'`",
        "begin_call",
        lambda s: s._begin_call("../x", "c"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-mark",
        "rollout_id `'../x'`",
        "mark_incomplete",
        lambda s: s._mark_incomplete("../x", "c"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-retire-batch",
        "batch `['r', '../x']`",
        "retire_now",
        lambda s: s.retire_now([ROLLOUT, "../x"]),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-delete-batch",
        "batch `['r', 'a/b']`",
        "delete_now",
        lambda s: s.delete_now([ROLLOUT, "a/b"]),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "rid-bare-str",
        "a bare str `'r'` as the batch",
        "retire_now",
        lambda s: s.retire_now(ROLLOUT),
        REFUSED,
        ("str",),
    ),
    Case(
        "rid-int",
        "rollout_id `5` (an int)",
        "freeze_now",
        lambda s: s.freeze_now(cast(Any, 5)),
        REFUSED,
        (),
    ),
    Case(
        "rid-dots",
        "rollout_id `'..'` (allowed characters only)",
        "put",
        put(rollout_id=".."),
        ACCEPTED,
        puts=entry(rollout_id=".."),
    ),
    # Call ids -----------------------------------------------------------------------------
    Case(
        "cid-empty",
        "model_call_id `''`",
        "put",
        put(model_call_id=""),
        REFUSED,
        ("model_call_id", "empty"),
    ),
    Case(
        "cid-newline",
        "model_call_id `'a\\nb'`",
        "put",
        put(model_call_id="a\nb"),
        REFUSED,
        ("model_call_id", "line break"),
    ),
    Case(
        "cid-cr",
        "model_call_id `'a\\rb'`",
        "put",
        put(model_call_id="a\rb"),
        REFUSED,
        ("model_call_id", "line break"),
    ),
    Case(
        "cid-surrogate",
        "model_call_id with a lone surrogate",
        "put",
        put(model_call_id="a\udc80"),
        REFUSED,
        ("surrogate",),
    ),
    Case(
        "cid-begin-empty",
        "model_call_id `''`",
        "begin_call",
        lambda s: s._begin_call(ROLLOUT, ""),
        REFUSED,
        ("model_call_id", "empty"),
    ),
    Case(
        "cid-begin-newline",
        "model_call_id `'a\\nb'`",
        "begin_call",
        lambda s: s._begin_call(ROLLOUT, "a\nb"),
        REFUSED,
        ("model_call_id", "line break"),
    ),
    Case(
        "cid-begin-surrogate",
        "model_call_id with a lone surrogate",
        "begin_call",
        lambda s: s._begin_call(ROLLOUT, "\ud800"),
        REFUSED,
        ("model_call_id", "surrogate"),
    ),
    Case(
        "cid-nul",
        "model_call_id `'a\\x00b'` (control character)",
        "put",
        put(model_call_id="a\x00b"),
        ACCEPTED,
        puts=entry(model_call_id="a\x00b"),
    ),
    Case(
        "cid-escape",
        "model_call_id `'\\x1b[31m'` (terminal escape)",
        "put",
        put(model_call_id="\x1b[31m"),
        ACCEPTED,
        puts=entry(model_call_id="\x1b[31m"),
    ),
    Case(
        "cid-u2028",
        "model_call_id `'a\\u2028b'` (Unicode line separator)",
        "put",
        put(model_call_id="a\u2028b"),
        ACCEPTED,
        puts=entry(model_call_id="a\u2028b"),
    ),
    Case(
        "cid-100k",
        "model_call_id of 100,000 chars",
        "put",
        put(model_call_id="c" * 100_000),
        ACCEPTED,
        puts=entry(model_call_id="c" * 100_000),
    ),
    Case(
        "mark-empty",
        "model_call_id `''`",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, ""),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-newline",
        "model_call_id `'a\\nb'`",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, "a\nb"),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-surrogate",
        "model_call_id with a lone surrogate",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, "\ud800"),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-nul",
        "model_call_id `'a\\x00b'`",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, "a\x00b"),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-int",
        "model_call_id `12` (an int)",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, cast(Any, 12)),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-none",
        "model_call_id `None`",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, cast(Any, None)),
        ACCEPTED,
        marks=True,
    ),
    Case(
        "mark-1m",
        "model_call_id of 1,000,000 chars",
        "mark_incomplete",
        lambda s: s._mark_incomplete(ROLLOUT, "m" * 1_000_000),
        ACCEPTED,
        marks=True,
    ),
    # Non-finite floats --------------------------------------------------------------------
    Case(
        "nan-logprob",
        "NaN in generation_log_probs",
        "put",
        put(generation_log_probs=[-0.5, NAN]),
        REFUSED,
        ("generation_log_probs", "nan"),
    ),
    Case(
        "inf-logprob",
        "inf in generation_log_probs",
        "put",
        put(generation_log_probs=[INF, -0.5]),
        REFUSED,
        ("generation_log_probs", "inf"),
    ),
    Case(
        "ninf-logprob",
        "-inf in generation_log_probs",
        "put",
        put(generation_log_probs=[-INF, -0.5]),
        REFUSED,
        ("generation_log_probs", "inf"),
    ),
    Case(
        "nan-created", "NaN created_at", "put", put(created_at=NAN), REFUSED, ("created_at", "nan")
    ),
    Case(
        "inf-created", "inf created_at", "put", put(created_at=INF), REFUSED, ("created_at", "inf")
    ),
    Case(
        "inf-routed",
        "inf inside routed_experts `[[1.0, inf]]`",
        "put",
        put(routed_experts=[[1.0, INF]]),
        REFUSED,
        ("routed_experts", "inf"),
    ),
    Case(
        "nan-routed-tuple",
        "NaN inside a tuple in routed_experts",
        "put",
        put(routed_experts=(0.5, NAN)),
        REFUSED,
        ("routed_experts", "nan"),
    ),
    Case(
        "nan-output",
        "NaN nested in output_items",
        "put",
        put(output_items=[{"content": [{"logprob": NAN}]}]),
        REFUSED,
        ("output_items", "nan"),
    ),
    Case(
        "nan-extra",
        "NaN in an extra field",
        "put",
        put(extra_score=NAN),
        REFUSED,
        ("extra_score", "nan"),
    ),
    Case(
        "inf-extra-nested",
        "-inf nested in an extra field",
        "put",
        put(extra={"a": [1, {"b": -INF}]}),
        REFUSED,
        ("extra", "inf"),
    ),
    Case(
        "nan-float-subclass",
        "NaN as a float subclass",
        "put",
        put(extra=type("F", (float,), {})(NAN)),
        REFUSED,
        ("extra", "nan"),
    ),
    Case(
        "nan-async",
        "NaN in generation_log_probs",
        "await put",
        put_async(entry(generation_log_probs=[NAN, 0.0])),
        REFUSED,
        ("generation_log_probs", "nan"),
    ),
    # Size and nesting ---------------------------------------------------------------------
    Case(
        "huge-2m",
        "a 2,000,000-token prompt (about 16 MB of JSON)",
        "put",
        lambda s: s.append(huge()),
        ACCEPTED,
        puts=huge,
    ),
    Case(
        "deep-output-10k",
        "output_items nested 10,000 levels",
        "put",
        put(output_items=[nested(10_000)]),
        REFUSED,
        ("output_items", "nested deeper"),
    ),
    Case(
        "deep-routed-10k",
        "routed_experts nested 10,000 lists",
        "put",
        put(routed_experts=nested(10_000, kind="list")),
        REFUSED,
        ("routed_experts", "nested deeper"),
    ),
    Case(
        "deep-extra-10k",
        "an extra field nested 10,000 levels",
        "put",
        put(extra=nested(10_000)),
        REFUSED,
        ("extra", "nested deeper"),
    ),
    Case(
        "deep-output-300",
        "output_items nested 300 levels",
        "put",
        put(output_items=[nested(300)]),
        REFUSED,
        ("nested deeper",),
    ),
    Case(
        "deep-output-220",
        "output_items nested 220 levels",
        "put",
        put(output_items=[nested(220)]),
        REFUSED,
        ("nested deeper",),
    ),
    Case(
        "deep-output-150",
        "output_items nested 150 levels",
        "put",
        put(output_items=[nested(150)]),
        REFUSED,
        ("nested deeper",),
    ),
    Case(
        "deep-output-100",
        "output_items nested 100 levels",
        "put",
        put(output_items=[nested(100)]),
        ACCEPTED,
        puts=entry(output_items=[nested(100)]),
    ),
    # Schema version -----------------------------------------------------------------------
    Case(
        "schema-2",
        "schema_version 2 (a dict)",
        "put",
        put_dict(schema_version=2),
        REFUSED,
        ("schema_version", "newer"),
    ),
    Case(
        "schema-0",
        "schema_version 0 (a dict)",
        "put",
        put_dict(schema_version=0),
        REFUSED,
        ("schema_version",),
    ),
    Case(
        "schema-2-construct",
        "schema_version 2 via `TokenEntry.model_construct`",
        "put",
        constructed(schema_version=2),
        REFUSED,
        ("schema_version",),
    ),
    # Wrong types --------------------------------------------------------------------------
    Case(
        "type-none",
        "`None` as the entry",
        "put",
        put_raw(None),
        REFUSED,
        ("TokenEntry", "NoneType"),
    ),
    Case("type-int", "`42` as the entry", "put", put_raw(42), REFUSED, ("TokenEntry", "int")),
    Case(
        "type-str",
        "a JSON string as the entry",
        "put",
        put_raw('{"rollout_id":"r"}'),
        REFUSED,
        ("TokenEntry", "str"),
    ),
    Case(
        "type-bytes", "bytes as the entry", "put", put_raw(b"{}"), REFUSED, ("TokenEntry", "bytes")
    ),
    Case(
        "type-list", "a list as the entry", "put", put_raw([1, 2]), REFUSED, ("TokenEntry", "list")
    ),
    Case(
        "type-object",
        "`object()` as the entry",
        "put",
        put_raw(object()),
        REFUSED,
        ("TokenEntry", "object"),
    ),
    Case(
        "type-foreign-model",
        "another pydantic model missing fields",
        "put",
        put_raw(ForeignEntry()),
        REFUSED,
        ("prompt_token_ids", "field required"),
    ),
    Case(
        "type-dict-missing",
        "a dict without prompt_token_ids",
        "put",
        put_raw({"rollout_id": ROLLOUT, "model_call_id": "x"}),
        REFUSED,
        ("prompt_token_ids", "field required"),
    ),
    Case(
        "type-tokens-str",
        "prompt_token_ids `'abc'` (a dict)",
        "put",
        put_dict(prompt_token_ids="abc"),
        REFUSED,
        ("prompt_token_ids",),
    ),
    Case(
        "type-tokens-float",
        "prompt_token_ids `[1.5]` (a dict)",
        "put",
        put_dict(prompt_token_ids=[1.5]),
        REFUSED,
        ("prompt_token_ids",),
    ),
    Case(
        "type-len-mismatch",
        "2 generated tokens, 1 log prob (a dict)",
        "put",
        put_dict(generation_log_probs=[-0.5]),
        REFUSED,
        ("generation_log_probs",),
    ),
    Case(
        "type-extra-object",
        "`object()` in an extra field",
        "put",
        put(extra=object()),
        REFUSED,
        ("serialize",),
    ),
    Case(
        "type-extra-bytes",
        "non-UTF-8 bytes in an extra field",
        "put",
        put(extra=b"\xff"),
        REFUSED,
        ("utf-8",),
    ),
    Case(
        "type-mutated-tokens",
        "prompt_token_ids set to `['x']` after construction",
        "put",
        mutated("prompt_token_ids", ["x"]),
        REFUSED,
        ("prompt_token_ids",),
    ),
    Case(
        "type-mutated-len",
        "generation_log_probs emptied after construction",
        "put",
        mutated("generation_log_probs", []),
        REFUSED,
        ("generation_log_probs",),
    ),
    Case(
        "type-construct-tokens",
        "prompt_token_ids `['x']` via `model_construct`",
        "put",
        constructed(prompt_token_ids=["x"]),
        REFUSED,
        ("prompt_token_ids",),
    ),
    Case(
        "type-mutated-rid",
        "rollout_id set to `'../x'` after construction",
        "put",
        mutated("rollout_id", "../x"),
        REFUSED,
        ("rollout_id",),
    ),
    Case(
        "type-mutated-cid",
        "model_call_id set to `'a\\nb'` after construction",
        "put",
        mutated("model_call_id", "a\nb"),
        REFUSED,
        ("model_call_id", "line break"),
    ),
    Case(
        "type-mutated-nan",
        "a log prob set to NaN after construction",
        "put",
        mutated("generation_log_probs", [NAN, 0.0]),
        REFUSED,
        ("nan",),
    ),
    # Integers beyond 64 bits --------------------------------------------------------------
    Case(
        "int-2**64", "token id `2**64`", "put", put(prompt_token_ids=[2**64]), REFUSED, ("64-bit",)
    ),
    Case(
        "int-below-i64",
        "token id `-2**63 - 1`",
        "put",
        put(prompt_token_ids=[-(2**63) - 1]),
        REFUSED,
        ("64-bit",),
    ),
    Case(
        "int-extra-2**100",
        "`2**100` in an extra field",
        "put",
        put(extra={"n": 2**100}),
        REFUSED,
        ("64-bit",),
    ),
    Case(
        "int-output-2**70",
        "`2**70` nested in output_items",
        "put",
        put(output_items=[{"n": 2**70}]),
        REFUSED,
        ("64-bit",),
    ),
    Case(
        "int-u64-max",
        "token id `2**64 - 1` (the largest that fits)",
        "put",
        put(prompt_token_ids=[2**64 - 1]),
        ACCEPTED,
        puts=entry(prompt_token_ids=[2**64 - 1]),
    ),
    Case(
        "int-async",
        "token id `2**64`",
        "await put",
        put_async(entry(prompt_token_ids=[2**64])),
        REFUSED,
        ("64-bit",),
    ),
    # Lone surrogates ----------------------------------------------------------------------
    Case("sur-model", "model `'\\ud800'`", "put", put(model="\ud800"), REFUSED, ("surrogates",)),
    Case(
        "sur-output",
        "a lone surrogate in output_items text",
        "put",
        put(output_items=[{"text": "x\udfff"}]),
        REFUSED,
        ("surrogates",),
    ),
    Case(
        "sur-extra-key",
        "a lone surrogate as an extra field's key",
        "put",
        put(extra={"\ud800": 1}),
        REFUSED,
        ("surrogates",),
    ),
    Case(
        "sur-async-cid",
        "model_call_id with a lone surrogate",
        "await put",
        put_async(entry(model_call_id="\ud800")),
        REFUSED,
        ("surrogate",),
    ),
]


def make_seed_entry() -> TokenEntry:
    """The entry ROLLOUT holds before each case (so "nothing written" covers existing files)."""
    return make_entry(ROLLOUT, "seed")
