"""Request-time lineage (SPEC sections 4-5): stamping, the native matcher, both stores, deltas.

The pure-Python resolver in `tokencapture.reference.lineage` is the oracle of the differential
tests; expected fingerprints come from `tokencapture.fingerprint` (itself pinned by the golden
vectors) and expected tokens from the entries the tests build.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeAlias

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import GOLDEN

from tokencapture import _core
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.lineage import (
    AMBIGUOUS_REASON,
    DELTA_REFUSED,
    NO_MATCH_REASON,
    FileLineageStore,
    InMemoryLineageStore,
    LineageIntegrityError,
    encode_delta,
    stamp_continuation,
)
from tokencapture.protocols import (
    LineageMatch,
    LineageResolution,
    LineageResolver,
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
)
from tokencapture.records import ParentResolutionStatus, TokenEntry, compute_digest, stamp_lineage
from tokencapture.reference.lineage import FileLineageStore as ReferenceLineageStore
from tokencapture.reference.lineage import token_digest as reference_token_digest
from tokencapture.store import TokenCaptureStore

ROOT = ParentResolutionStatus.ROOT
RESOLVED = ParentResolutionStatus.RESOLVED
UNRESOLVED = ParentResolutionStatus.UNRESOLVED

Items: TypeAlias = list[dict[str, Any]]
Resolver: TypeAlias = FileLineageStore | InMemoryLineageStore | ReferenceLineageStore


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[tuple[TokenCaptureStore, list[Resolver]]]:
    """A capture store and three resolvers over it: native file, in-memory mirror, reference."""
    store = TokenCaptureStore(tmp_path)
    resolvers: list[Resolver] = [
        FileLineageStore(tmp_path),
        InMemoryLineageStore(),
        ReferenceLineageStore(tmp_path),
    ]
    yield store, resolvers
    for resolver in resolvers:
        await resolver.close()
        await resolver.close()  # idempotent


def put(store: TokenCaptureStore, resolvers: list[Resolver], entry: TokenEntry) -> None:
    store.append(entry)
    for resolver in resolvers:
        if isinstance(resolver, InMemoryLineageStore):
            resolver.put_now(entry)


def summary(resolution: LineageResolution) -> tuple[str, str, tuple[int, ...], str, str]:
    match = resolution.match
    if match is None:
        return (resolution.status.value, "", (), "", resolution.reason)
    return (
        resolution.status.value,
        match.model_call_id,
        match.cumulative_token_ids,
        match.digest,
        resolution.reason,
    )


# ---- golden vectors -------------------------------------------------------------------------


def golden_fingerprint_messages() -> dict[str, Items]:
    vectors = json.loads((GOLDEN / "fingerprints.json").read_text("utf-8"))["vectors"]
    return {vector["name"]: vector["messages"] for vector in vectors}


async def test_golden_entries_resolve(
    stores: tuple[TokenCaptureStore, list[Resolver]],
) -> None:
    store, resolvers = stores
    vectors = json.loads((GOLDEN / "entries.json").read_text("utf-8"))["vectors"]
    entries = [TokenEntry.model_validate(vector["entry"]) for vector in vectors]
    for entry in entries:
        put(store, resolvers, entry)
    messages = golden_fingerprint_messages()
    chat = messages["chat_text"]
    rain = [*chat, {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "more"}]
    delta = [*chat, {"role": "assistant", "content": "delta"}, {"role": "user", "content": "ok"}]
    third = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "z"},
    ]
    cases: list[tuple[Items, tuple[str, str, tuple[int, ...], str, str]]] = [
        (messages["user_only"], ("root", "", (), "", "")),
        (chat, ("resolved", "call-1", (101, 102, 103, 201, 202), entries[0].digest or "", "")),
        (
            rain,
            (
                "resolved",
                "call-2",
                (101, 102, 103, 201, 202, 104, 203),
                vectors[1]["entry"]["digest"],
                "",
            ),
        ),
        (third, ("resolved", "call-3", (7, 8, 9, 10), vectors[2]["entry"]["digest"], "")),
        # call-4 carries no lineage stamp: its full prompt is its cumulative sequence, and the
        # match carries the digest it records, none (as NeMo Gym's resolvers answer).
        (delta, ("resolved", "call-4", (203, 105, 204), "", "")),
        (messages["chat_empty_assistant"], ("unresolved", "", (), "", NO_MATCH_REASON)),
    ]
    for resolver in resolvers:
        for request, expected in cases:
            assert summary(await resolver.resolve("golden-r1", request)) == expected


def test_stamp_continuation_matches_the_python_hashes() -> None:
    messages = golden_fingerprint_messages()
    for name, items in messages.items():
        entry = TokenEntry(
            rollout_id="r",
            model_call_id="c",
            prompt_token_ids=[1],
            generation_token_ids=[],
            generation_log_probs=[],
            output_items=[{"role": "assistant", "content": f"out {name}"}],
        )
        assert stamp_continuation(entry, items) is entry
        assert entry.continuation_fingerprint == assistant_fingerprint(
            [*items, *entry.output_items]
        )
        assert entry.continuation_context_len == len(items)
        assert entry.continuation_context_digest == conversation_digest(items)
        assert entry.fingerprint_version == 2
    # Items the native port does not cover take the Python path and still stamp.
    odd: Items = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "t", "function": {"name": "f", "arguments": {"x": 1.5, "y": (1, 2)}}}
            ],
        }
    ]
    entry = stamp_continuation(
        TokenEntry(
            rollout_id="r",
            model_call_id="c",
            prompt_token_ids=[],
            generation_token_ids=[],
            generation_log_probs=[],
        ),
        odd,
    )
    assert entry.continuation_fingerprint == assistant_fingerprint(odd)
    with pytest.raises(ValueError):
        stamp_continuation(entry, [{"role": "assistant", "content": 42}])


# ---- native hashes against tokencapture.fingerprint -----------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        | st.tuples(inner)
    ),
    max_leaves=8,
)
roles = st.sampled_from(["user", "assistant", "tool", "system", "", None, 3])
types = st.sampled_from(
    [
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "text",
        "input_text",
        "output_text",
        "tool_use",
        "tool_result",
        "image_url",
        "",
        None,
        7,
    ]
)


def dumps_or_text(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # a big integer: orjson refuses it
        return "x"


arguments = st.one_of(
    json_values,
    json_values.map(dumps_or_text),
    st.sampled_from(
        [
            "",
            "  ",
            ' {"b": 1, "a": [2, 3]} ',
            "not json",
            '{"x": 1e400}',
            '"\\ud800"',
            "[1,]",
            "-0",
            "18446744073709551616",
            '{"a": 1, "a": 2}',
        ]
    ),
)
blocks = st.one_of(
    st.text(max_size=6),
    st.fixed_dictionaries(
        {"type": types},
        optional={
            "text": json_values,
            "id": json_values,
            "name": json_values,
            "input": arguments,
            "content": json_values,
            "tool_use_id": json_values,
        },
    ),
    json_values,
)
items = st.fixed_dictionaries(
    {},
    optional={
        "role": roles,
        "type": types,
        "content": st.one_of(
            st.none(), st.text(max_size=6), st.lists(blocks, max_size=3), json_values
        ),
        "tool_calls": st.one_of(
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "id": json_values,
                        "function": st.one_of(
                            st.none(),
                            st.fixed_dictionaries(
                                {}, optional={"name": json_values, "arguments": arguments}
                            ),
                            json_values,
                        ),
                    },
                ),
                max_size=2,
            ),
            json_values,
        ),
        "name": json_values,
        "namespace": st.sampled_from(["", "ns", None]),
        "call_id": json_values,
        "id": json_values,
        "arguments": arguments,
        "output": json_values,
        "tool_call_id": json_values,
    },
)


def python_hashes(request: list[Any], context_len: int) -> tuple[str, str] | str:
    try:
        return assistant_fingerprint(request), conversation_digest(request[:context_len])
    except (ValueError, TypeError):
        return "ValueError"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(items, json_values), max_size=4), st.integers(0, 5))
def test_native_hashes_agree_or_defer(request: list[Any], context_len: int) -> None:
    native = _core.continuation_hashes(request, context_len)
    expected = python_hashes(request, context_len)
    if native is not None:
        assert native == expected


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
well_formed_items = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(
                st.text(),
                st.lists(
                    st.one_of(
                        st.text(max_size=5),
                        st.fixed_dictionaries(
                            {
                                "type": st.sampled_from(["text", "output_text"]),
                                "text": st.text(max_size=5),
                            }
                        ),
                        st.fixed_dictionaries(
                            {"type": st.just("image_url"), "image_url": plain_values}
                        ),
                        st.fixed_dictionaries(
                            {
                                "type": st.just("tool_use"),
                                "id": st.text(max_size=3),
                                "name": st.text(max_size=3),
                                "input": st.dictionaries(st.text(max_size=3), plain_values),
                            }
                        ),
                        st.fixed_dictionaries(
                            {
                                "type": st.just("tool_result"),
                                "tool_use_id": st.text(max_size=3),
                                "content": plain_values,
                            }
                        ),
                    ),
                    max_size=3,
                ),
            ),
        },
        optional={
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.text(max_size=3),
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.text(max_size=3),
                                "arguments": plain_values.map(dumps_or_text),
                            }
                        ),
                    }
                ),
                max_size=2,
            )
        },
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.text(max_size=3),
            "name": st.text(max_size=3),
            "arguments": plain_values.map(dumps_or_text),
        },
        optional={"namespace": st.text(max_size=3)},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": st.text(max_size=3),
            "output": plain_values,
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": st.text(max_size=3),
            "content": st.text(max_size=5),
        }
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(well_formed_items, max_size=5), st.integers(0, 5))
def test_native_hashes_decide_well_formed_items(request: list[Any], context_len: int) -> None:
    native = _core.continuation_hashes(request, context_len)
    assert native is not None
    assert native == python_hashes(request, context_len)


def test_native_hashes_cover_the_common_dialects() -> None:
    for dialect in DIALECTS:
        request, _ = run_conversation_items(dialect, 4)
        native = _core.continuation_hashes(request, len(request) - 1)
        assert native == python_hashes(request, len(request) - 1), dialect


# ---- multi-turn conversations in three dialects ---------------------------------------------

Turn = tuple[Items, Items]  # (model output items, harness items that follow)


def chat_turn(i: int) -> Turn:
    if i % 2 == 0:
        output: Items = [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": "bash",
                            "arguments": json.dumps({"cmd": f"ls {i}", "all": True}),
                        },
                    }
                ],
            }
        ]
        return output, [{"role": "tool", "tool_call_id": f"call_{i}", "content": f"file{i}.txt"}]
    return [{"role": "assistant", "content": f"answer {i}"}], [
        {"role": "user", "content": f"q {i}"}
    ]


def responses_turn(i: int) -> Turn:
    if i % 2 == 0:
        output: Items = [
            {
                "type": "reasoning",
                "id": f"rs_{i}",
                "summary": [{"type": "summary_text", "text": "hm"}],
            },
            {
                "type": "function_call",
                "call_id": f"fc_{i}",
                "name": "search",
                "namespace": "web",
                "arguments": json.dumps({"q": f"term {i}"}),
            },
        ]
        return output, [
            {"type": "function_call_output", "call_id": f"fc_{i}", "output": {"hits": i}}
        ]
    output = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"answer {i}", "annotations": []}],
        }
    ]
    return output, [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"q {i}"}]}
    ]


def anthropic_turn(i: int) -> Turn:
    output: Items = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"let me compute {i}"},
                {
                    "type": "tool_use",
                    "id": f"tu_{i}",
                    "name": "calc",
                    "input": {"x": i, "op": "double"},
                },
            ],
        }
    ]
    follow: Items = [
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": f"tu_{i}",
                    "content": [{"type": "text", "text": str(2 * i)}],
                },
            ],
        }
    ]
    return output, follow


DIALECTS: dict[str, Callable[[int], Turn]] = {
    "chat": chat_turn,
    "responses": responses_turn,
    "anthropic": anthropic_turn,
}


def echo(items: Items) -> Items:
    """What a harness sends back: the same items, with JSON arguments re-serialized."""
    echoed = copy.deepcopy(items)
    for item in echoed:
        for call in item.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(
                json.loads(call["function"]["arguments"]), indent=1
            )
        if item.get("type") == "function_call":
            item["arguments"] = json.dumps(json.loads(item["arguments"]), separators=(", ", ": "))
    return echoed


def run_conversation_items(dialect: str, turns: int) -> tuple[Items, Items]:
    request: Items = [{"role": "user", "content": "start"}]
    output: Items = []
    for i in range(turns):
        output, follow = DIALECTS[dialect](i)
        request = [*request, *echo(output), *follow]
    return request, output


def new_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200_000) for _ in range(n)]


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_conversations_resolve_turn_by_turn(
    stores: tuple[TokenCaptureStore, list[Resolver]], dialect: str, delta: bool
) -> None:
    store, resolvers = stores
    if delta:  # the in-memory resolver refuses delta entries (NeMo Gym's rule), so not it
        resolvers = [r for r in resolvers if not isinstance(r, InMemoryLineageStore)]
    native = resolvers[0]
    rng = random.Random(dialect)
    request: Items = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "start"},
    ]
    cumulative: list[int] = []
    previous = ""
    for i in range(8):
        resolution = await native.resolve("conv", request)
        for other in resolvers[1:]:
            assert summary(await other.resolve("conv", request)) == summary(resolution)
        if i == 0:
            assert resolution.status is ROOT
        else:
            assert resolution.status is RESOLVED
            assert resolution.match is not None
            assert resolution.match.model_call_id == previous
            assert list(resolution.match.cumulative_token_ids) == cumulative
            assert resolution.match.digest == compute_digest(cumulative)
            # A tuple of ints, new (i == 1) or extending the last answer's: out of the cycle
            # collector's sight, as CPython would leave it after its first collection.
            assert not gc.is_tracked(resolution.match.cumulative_token_ids)
        output, follow = DIALECTS[dialect](i)
        prompt = [*cumulative, *new_tokens(rng, 20 + i)]
        generation = new_tokens(rng, 5)
        entry = TokenEntry(
            rollout_id="conv",
            model_call_id=f"{dialect}-{i}",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=[-0.1] * len(generation),
            output_items=output,
        )
        stamp_continuation(entry, request)
        if resolution.status is RESOLVED:
            entry = (
                encode_delta(entry, resolution)
                if delta
                else stamp_lineage(entry, previous, parent_resolution=RESOLVED)
            )
            assert entry.prompt_is_delta is delta
        else:
            stamp_lineage(entry, None, parent_resolution=ROOT)
        put(store, resolvers, entry)
        cumulative = [*prompt, *generation]
        previous = entry.model_call_id
        request = [*request, *echo(output), *follow]


async def test_rewritten_or_truncated_context_is_unresolved(
    stores: tuple[TokenCaptureStore, list[Resolver]],
) -> None:
    store, resolvers = stores
    request: Items = [{"role": "user", "content": "start"}]
    for i in range(3):
        output, follow = chat_turn(i)
        entry = TokenEntry(
            rollout_id="r",
            model_call_id=f"c{i}",
            prompt_token_ids=[i],
            generation_token_ids=[i + 100],
            generation_log_probs=[0.0],
            output_items=output,
        )
        stamp_lineage(stamp_continuation(entry, request), None, parent_resolution=ROOT)
        put(store, resolvers, entry)
        request = [*request, *output, *follow]
    rewritten = copy.deepcopy(request)
    rewritten[0]["content"] = "a different start"
    edited_tool_output = copy.deepcopy(request)
    edited_tool_output[2]["content"] = "tampered"
    truncated = request[2:]
    for resolver in resolvers:
        assert summary(await resolver.resolve("r", request))[1] == "c2"
        for bad in (rewritten, edited_tool_output, truncated):
            assert summary(await resolver.resolve("r", bad)) == (
                "unresolved",
                "",
                (),
                "",
                NO_MATCH_REASON,
            )


async def test_same_output_different_tokens_is_ambiguous_retries_collapse(
    stores: tuple[TokenCaptureStore, list[Resolver]],
) -> None:
    store, resolvers = stores
    request: Items = [{"role": "user", "content": "hi"}]
    output: Items = [{"role": "assistant", "content": "hello"}]
    nxt = [*request, *output, {"role": "user", "content": "again"}]

    def entry(call_id: str, generation: list[int], rollout: str) -> TokenEntry:
        made = TokenEntry(
            rollout_id=rollout,
            model_call_id=call_id,
            prompt_token_ids=[1, 2],
            generation_token_ids=generation,
            generation_log_probs=[0.0] * len(generation),
            output_items=output,
            created_at=len(call_id),
        )
        return stamp_lineage(stamp_continuation(made, request), None, parent_resolution=ROOT)

    put(store, resolvers, entry("b-first", [5, 6], "amb"))
    put(store, resolvers, entry("a-other", [5, 7], "amb"))
    put(store, resolvers, entry("b-first", [5, 6], "retry"))
    put(store, resolvers, entry("a-retry", [5, 6], "retry"))
    for resolver in resolvers:
        assert summary(await resolver.resolve("amb", nxt))[-1] == AMBIGUOUS_REASON
        resolved = summary(await resolver.resolve("retry", nxt))
        assert resolved[:3] == ("resolved", "a-retry", (1, 2, 5, 6))


async def test_items_outside_the_native_hashes_resolve_through_python(
    stores: tuple[TokenCaptureStore, list[Resolver]],
) -> None:
    """Floats in canonical JSON and tuples defer to tokencapture.fingerprint, same answers."""
    store, resolvers = stores
    request: Items = [{"role": "user", "content": "set the temperature"}]
    output: Items = [
        {"type": "function_call", "call_id": "f1", "name": "set", "arguments": '{"t": 0.5}'}
    ]
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c0",
        prompt_token_ids=[1, 2],
        generation_token_ids=[3],
        generation_log_probs=[0.0],
        output_items=output,
    )
    stamp_lineage(stamp_continuation(entry, request), None, parent_resolution=ROOT)
    put(store, resolvers, entry)
    follow: Items = [{"type": "function_call_output", "call_id": "f1", "output": {"ok": 1.0}}]
    nxt = [*request, *output, *follow]
    assert _core.continuation_hashes(nxt, 1) is None
    with_tuple = [*request, {**output[0], "extra": (1, 2)}, *follow]
    for resolver in resolvers:
        assert summary(await resolver.resolve("r", nxt))[:3] == ("resolved", "c0", (1, 2, 3))
        assert summary(resolver.resolve_now("r", nxt))[:3] == ("resolved", "c0", (1, 2, 3))
        assert summary(await resolver.resolve("r", with_tuple))[1] == "c0"


# ---- deltas ---------------------------------------------------------------------------------


async def test_fifty_link_delta_chain_materializes_like_full_prompts(tmp_path: Path) -> None:
    rng = random.Random(50)
    stores = {kind: TokenCaptureStore(tmp_path / kind) for kind in ("full", "delta")}
    native = {kind: FileLineageStore(tmp_path / kind, max_cached_tokens=0) for kind in stores}
    reference = ReferenceLineageStore(tmp_path / "delta")
    request: Items = [{"role": "user", "content": "go"}]
    cumulative: list[int] = []
    requests = []
    for i in range(50):
        output, follow = anthropic_turn(i)
        prompt = [*cumulative, *new_tokens(rng, 30)]
        generation = new_tokens(rng, 10)
        entry = TokenEntry(
            rollout_id="r",
            model_call_id=f"c{i:02}",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=[-0.5] * len(generation),
            output_items=output,
        )
        stamp_continuation(entry, request)
        resolution = await native["delta"].resolve("r", request)
        if i == 0:
            stamp_lineage(entry, None, parent_resolution=ROOT)
            stores["full"].append(entry)
            stores["delta"].append(entry)
        else:
            stores["full"].append(
                stamp_lineage(entry.model_copy(), f"c{i - 1:02}", parent_resolution=RESOLVED)
            )
            encoded = encode_delta(entry, resolution)
            assert encoded.prompt_is_delta and len(encoded.prompt_token_ids) == 30
            assert encoded.cum_len == len(prompt) + len(generation)
            stores["delta"].append(encoded)
        cumulative = [*prompt, *generation]
        request = [*request, *output, *follow]
        requests.append(request)
    for nxt in (requests[-1], requests[0], requests[24]):
        full = summary(await native["full"].resolve("r", nxt))
        delta = summary(await native["delta"].resolve("r", nxt))
        assert full == delta == summary(await reference.resolve("r", nxt))
    assert len(summary(await native["delta"].resolve("r", requests[-1]))[2]) == len(cumulative)
    delta_bytes = (tmp_path / "delta" / "r.tokens.jsonl").stat().st_size
    full_bytes = (tmp_path / "full" / "r.tokens.jsonl").stat().st_size
    assert delta_bytes * 5 < full_bytes
    await reference.close()


def test_encode_delta_only_when_the_prompt_extends_the_parent() -> None:
    parent = LineageMatch("p", (1, 2, 3), compute_digest([1, 2, 3]))
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c",
        prompt_token_ids=[1, 2, 3, 4],
        generation_token_ids=[9],
        generation_log_probs=[0.0],
    )
    encoded = encode_delta(entry, LineageResolution(RESOLVED, parent))
    assert encoded is not entry and entry.prompt_token_ids == [1, 2, 3, 4]
    assert encoded.prompt_token_ids == [4] and encoded.prompt_is_delta
    assert encoded.parent_call_id == "p" and encoded.parent_resolution is RESOLVED
    assert (encoded.cum_len, encoded.digest) == (5, compute_digest([1, 2, 3, 4, 9]))
    exact = encode_delta(entry.model_copy(update={"prompt_token_ids": [1, 2, 3]}), parent)
    assert exact.prompt_token_ids == [] and exact.prompt_is_delta
    for prompt in ([1, 2], [1, 3, 2, 4], [0, 1, 2, 3]):
        kept = encode_delta(entry.model_copy(update={"prompt_token_ids": prompt}), parent)
        assert kept.prompt_token_ids == prompt and not kept.prompt_is_delta
        assert kept.parent_resolution is RESOLVED and kept.digest == compute_digest([*prompt, 9])
    with pytest.raises(ValueError, match="RESOLVED"):
        encode_delta(entry, LineageResolution(UNRESOLVED, reason=NO_MATCH_REASON))
    with pytest.raises(ValueError, match="already"):
        encode_delta(encoded, parent)


# ---- integrity ------------------------------------------------------------------------------


def chain_entries(rollout: str = "r", *, delta: bool = True) -> tuple[list[TokenEntry], Items]:
    """Three stamped calls, each continuing the last: stored as deltas, or with full prompts
    (what an in-memory resolver takes: it refuses delta entries, as NeMo Gym's does)."""
    request: Items = [{"role": "user", "content": "go"}]
    entries = []
    parent: LineageMatch | None = None
    for i in range(3):
        output, follow = chat_turn(i)
        prompt = [*(parent.cumulative_token_ids if parent else ()), 10 + i]
        entry = stamp_continuation(
            TokenEntry(
                rollout_id=rollout,
                model_call_id=f"c{i}",
                prompt_token_ids=prompt,
                generation_token_ids=[20 + i],
                generation_log_probs=[0.0],
                output_items=output,
            ),
            request,
        )
        if parent is None:
            entry = stamp_lineage(entry, None, parent_resolution=ROOT)
        elif delta:
            entry = encode_delta(entry, parent)
        else:
            entry = stamp_lineage(entry, parent.model_call_id, parent_resolution=RESOLVED)
        entries.append(entry)
        parent = LineageMatch(entry.model_call_id, tuple([*prompt, 20 + i]), entry.digest or "")
        request = [*request, *output, *follow]
    return entries, request


@pytest.mark.parametrize(
    "corruption", ["winner_digest", "anchor_tokens", "cum_len", "missing_parent", "cycle"]
)
async def test_corrupted_chains_raise(tmp_path: Path, corruption: str) -> None:
    entries, request = chain_entries()
    if corruption == "winner_digest":
        entries[2].digest = compute_digest([1, 2, 3])
    elif corruption == "anchor_tokens":
        entries[0].generation_token_ids = [99]
    elif corruption == "cum_len":
        entries[2].cum_len = (entries[2].cum_len or 0) + 1
    elif corruption == "missing_parent":
        entries = entries[1:]
    elif corruption == "cycle":
        entries[0] = entries[0].model_copy(
            update={"prompt_is_delta": True, "parent_call_id": "c2", "parent_resolution": RESOLVED}
        )
    store = TokenCaptureStore(tmp_path)
    memory = InMemoryLineageStore()
    # The in-memory store refuses every delta entry at put (NeMo Gym's rule), so a broken chain
    # never reaches it.
    for entry in entries:
        store.append(entry)
        if entry.prompt_is_delta:
            with pytest.raises(ValueError, match=f"^{DELTA_REFUSED}$"):
                memory.put_now(entry)
        else:
            memory.put_now(entry)
    assert memory.stored_tokens() == sum(
        len(entry.prompt_token_ids) + len(entry.generation_token_ids)
        for entry in entries
        if not entry.prompt_is_delta
    )
    reference = ReferenceLineageStore(tmp_path)
    resolvers = (FileLineageStore(tmp_path), reference)
    for resolver in resolvers:
        with pytest.raises(LineageIntegrityError):
            await resolver.resolve("r", request)
    await reference.close()
    assert issubclass(LineageIntegrityError, ValueError)


def two_calls(
    second_prompt: list[int], second_digest: str | None = None
) -> tuple[list[TokenEntry], list[Items]]:
    """c0 (prompt [10], generation [20]) and c1 (full prompt `second_prompt`, generation [21]),
    stamped; and the requests continuing each."""
    request: Items = [{"role": "user", "content": "go"}]
    entries, continuations = [], []
    for i, prompt in enumerate(([10], second_prompt)):
        output, follow = chat_turn(i)
        entry = stamp_continuation(
            TokenEntry(
                rollout_id="r",
                model_call_id=f"c{i}",
                prompt_token_ids=prompt,
                generation_token_ids=[20 + i],
                generation_log_probs=[0.0],
                output_items=output,
            ),
            request,
        )
        entry = stamp_lineage(
            entry, f"c{i - 1}" if i else None, parent_resolution=RESOLVED if i else ROOT
        )
        entries.append(entry)
        request = [*request, *output, *follow]
        continuations.append(request)
    if second_digest is not None:
        entries[1].digest = second_digest
    return entries, continuations


async def test_an_answer_built_from_the_cached_parent_is_checked_before_it_is_handed_back(
    tmp_path: Path,
) -> None:
    """The async resolve builds an answer from its parent's cached tokens while its digest is
    checked on another thread: a wrong recorded digest still raises, and a prompt that does
    not extend the parent's tokens (same length) still answers its own tokens."""
    wrong, wrong_requests = two_calls([10, 20, 11], compute_digest([1, 2, 3]))
    store = TokenCaptureStore(tmp_path / "wrong")
    resolver = FileLineageStore(tmp_path / "wrong")
    store.append(wrong[0])
    first = await resolver.resolve("r", wrong_requests[0])
    assert summary(first)[1:3] == ("c0", (10, 20))  # c0's tokens are cached now
    store.append(wrong[1])
    for _ in range(2):
        with pytest.raises(LineageIntegrityError):
            await resolver.resolve("r", wrong_requests[1])
    await resolver.close()

    # c1's prompt starts with 77, not with c0's 10: taking c0's cached ids and the rest of the
    # prompt would build (10, 20, 11, 21), whose digest is not c1's.
    retokenized, requests = two_calls([77, 20, 11])
    store = TokenCaptureStore(tmp_path / "retokenized")
    resolver = FileLineageStore(tmp_path / "retokenized")
    store.append(retokenized[0])
    assert summary(await resolver.resolve("r", requests[0]))[1:3] == ("c0", (10, 20))
    store.append(retokenized[1])
    for _ in range(2):
        answer = await resolver.resolve("r", requests[1])
        assert summary(answer)[1:4] == ("c1", (77, 20, 11, 21), compute_digest([77, 20, 11, 21]))
    await resolver.close()


async def test_corrupt_lines_raise_corruption(tmp_path: Path) -> None:
    entries, request = chain_entries()
    store = TokenCaptureStore(tmp_path)
    store.append(entries[0])
    with open(store.path_for("r"), "ab") as log:
        log.write(b'{"model_call_id": 7}\n')
    reference = ReferenceLineageStore(tmp_path)
    for resolver in (FileLineageStore(tmp_path), reference):
        with pytest.raises(TokenCaptureCorruptionError, match="byte offset"):
            await resolver.resolve("r", request)
        # A root needs no file.
        assert (await resolver.resolve("r", request[:1])).status is ROOT
    await reference.close()


# ---- visibility across processes, lifecycle -------------------------------------------------

CHILD_RESOLVER = textwrap.dedent(
    """
    import json, sys
    from tokencapture.lineage import FileLineageStore
    resolver = FileLineageStore(sys.argv[1])
    request = json.loads(sys.argv[2])
    print(resolver.resolve_now("r", request).status.value, flush=True)  # before the put
    sys.stdin.readline()
    resolution = resolver.resolve_now("r", request)
    print(resolution.status.value, resolution.match.model_call_id if resolution.match else "",
          flush=True)
    """
)


def child_put(root: str, entry_json: bytes) -> None:
    TokenCaptureStore(root).append(TokenEntry.model_validate_json(entry_json))


async def test_a_put_is_visible_to_resolvers_in_other_processes(tmp_path: Path) -> None:
    entries, _ = chain_entries()
    request: Items = [{"role": "user", "content": "go"}, *chat_turn(0)[0], *chat_turn(0)[1]]
    # A resolver in another process, created and used before the put, sees it right after.
    with subprocess.Popen(
        [sys.executable, "-c", CHILD_RESOLVER, str(tmp_path), json.dumps(request)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().split() == ["unresolved"]
        TokenCaptureStore(tmp_path).append(entries[0])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["resolved", "c0"]
        assert child.wait(timeout=30) == 0
    # A put in another process is visible to a resolver created here before it.
    resolver = FileLineageStore(tmp_path)
    nxt = [*request, *chat_turn(1)[0], *chat_turn(1)[1]]
    assert (await resolver.resolve("r", nxt)).reason == NO_MATCH_REASON
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=child_put, args=(str(tmp_path), entries[1].model_dump_json().encode())
    )
    process.start()
    process.join(30)
    assert process.exitcode == 0
    assert summary(await resolver.resolve("r", nxt))[1] == "c1"


async def test_retire_and_delete_are_handled(
    stores: tuple[TokenCaptureStore, list[Resolver]],
) -> None:
    store, resolvers = stores
    file_resolvers = [r for r in resolvers if not isinstance(r, InMemoryLineageStore)]
    entries, request = chain_entries()
    for entry in entries:
        store.append(entry)
    for resolver in file_resolvers:
        assert summary(await resolver.resolve("r", request))[1] == "c2"
    store.retire_now(["r"])
    for resolver in file_resolvers:
        assert (await resolver.resolve("r", request)).reason == NO_MATCH_REASON
    store.delete_now(["r"])
    for resolver in file_resolvers:
        assert (await resolver.resolve("r", request)).reason == NO_MATCH_REASON
    # Reuse: the same call ids, different tokens. Only the new entries resolve.
    reused, _ = chain_entries()
    reused[0] = stamp_lineage(
        reused[0].model_copy(update={"generation_token_ids": [77]}), None, parent_resolution=ROOT
    )
    store.append(reused[0])
    first_request: Items = [{"role": "user", "content": "go"}, *chat_turn(0)[0], *chat_turn(0)[1]]
    for resolver in file_resolvers:
        assert summary(await resolver.resolve("r", first_request))[2] == (10, 77)
        assert (await resolver.resolve("r", request)).reason == NO_MATCH_REASON
    memory = resolvers[1]
    assert isinstance(memory, InMemoryLineageStore)
    for entry in chain_entries(delta=False)[0]:
        memory.put_now(entry)
    assert summary(await memory.resolve("r", request))[1] == "c2"
    assert memory.delete_now(["r", "gone"]) == {"removed": ["r"], "absent": ["gone"]}
    assert (await memory.resolve("r", request)).reason == NO_MATCH_REASON


# ---- the stores themselves ------------------------------------------------------------------


async def test_protocol_surface(tmp_path: Path) -> None:
    file_store = FileLineageStore(tmp_path)
    memory = InMemoryLineageStore()
    assert isinstance(file_store, LineageResolver) and isinstance(memory, LineageResolver)
    assert file_store.is_process_shared() is True
    assert memory.is_process_shared() is False
    for resolver in (file_store, memory):
        with pytest.raises(ValueError):
            await resolver.resolve("bad/id", [])
        assert (await resolver.resolve("r", [])).status is ROOT
        assert (
            await resolver.resolve("r", [{"role": "assistant", "content": "x"}])
        ).reason == NO_MATCH_REASON
        with pytest.raises(ValueError):
            await resolver.resolve("r", [{"role": "assistant", "content": 42}])
        with pytest.raises(ValueError):
            await resolver.resolve("r", ["not a dict"])  # type: ignore[list-item]
    assert list(tmp_path.iterdir()) == []  # resolving created nothing
    with pytest.raises(ValueError):
        FileLineageStore(tmp_path, max_cached_rollouts=0)
    with pytest.raises(ValueError):
        InMemoryLineageStore(max_rollouts=0)


async def test_in_memory_store_conflicts_and_bounds() -> None:
    entries, request = chain_entries(delta=False)
    memory = InMemoryLineageStore(max_rollouts=2, max_tokens=1)
    assert memory.put_now(entries[0]) is True
    assert memory.put_now(entries[0]) is False
    await memory.put(entries[1])
    memory.put_now(entries[2])
    assert memory.rollout_count() == 1  # over budget, but never the only rollout
    assert summary(await memory.resolve("r", request))[1] == "c2"
    changed = entries[2].model_copy(update={"created_at": 1.0})
    with pytest.raises(TokenCaptureConflictError):
        memory.put_now(changed)
    assert (await memory.resolve("r", request)).reason == NO_MATCH_REASON
    other, _ = chain_entries("s", delta=False)
    memory.put_now(other[0])
    assert memory.rollout_count() == 1 and memory.stored_tokens() == 2
    await memory.close()
    await memory.close()
    assert memory.rollout_count() == 0


async def test_file_store_bounds_its_caches(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    resolver = FileLineageStore(tmp_path, max_cached_rollouts=2, max_cached_tokens=5)
    for rollout in ("a", "b", "c"):
        entries, request = chain_entries(rollout)
        for entry in entries:
            store.append(entry)
        assert summary(await resolver.resolve(rollout, request))[1] == "c2"
    assert resolver.cached_rollouts() == 2
    assert resolver.cached_tokens() <= 5
    await resolver.close()
    assert (resolver.cached_rollouts(), resolver.cached_tokens()) == (0, 0)
    assert summary(await resolver.resolve("a", request))[1] == "c2"


async def test_concurrent_resolves_and_puts(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    resolver = FileLineageStore(tmp_path)
    entries, request = chain_entries()

    async def writer() -> None:
        for entry in entries:
            await store.put(entry)
            await asyncio.sleep(0)

    async def reader() -> list[str]:
        seen = []
        for _ in range(30):
            resolution = await resolver.resolve("r", request)
            seen.append(resolution.status.value)
        return seen

    results = await asyncio.gather(writer(), *(reader() for _ in range(4)))
    assert summary(await resolver.resolve("r", request))[1] == "c2"
    for seen in results[1:]:
        assert seen is not None and set(seen) <= {"unresolved", "resolved"}


# ---- differential: native against the reference --------------------------------------------


def random_rollout(
    rng: random.Random, rollout: str, *, deltas: bool = True
) -> tuple[list[TokenEntry], list[Items]]:
    """Branching conversations with retries, collisions, deltas (unless `deltas` is false) and
    unstamped entries."""
    entries: list[TokenEntry] = []
    queries: list[Items] = [[{"role": "user", "content": "root"}]]
    frontier: list[tuple[Items, list[int], str | None]] = [
        ([{"role": "user", "content": "root"}], [], None)
    ]
    for n in range(rng.randrange(3, 12)):
        request, cumulative, parent = rng.choice(frontier)
        dialect = rng.choice(list(DIALECTS))
        output, follow = DIALECTS[dialect](rng.randrange(4))
        prompt = [*cumulative, *new_tokens(rng, rng.randrange(1, 6))]
        if cumulative and rng.random() < 0.15:
            prompt = [*new_tokens(rng, 2), *prompt]  # re-tokenized: does not extend the parent
        generation = new_tokens(rng, rng.randrange(0, 4))
        entry = TokenEntry(
            rollout_id=rollout,
            model_call_id=f"c{n:02}",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=[-0.5] * len(generation),
            output_items=output,
        )
        roll = rng.random()
        if roll < 0.05:
            pass  # unstamped: invisible to resolution
        elif roll < 0.1:
            stamp_continuation(entry, request)
            entry.fingerprint_version = 1  # an older fingerprint: not indexed
        else:
            stamp_continuation(entry, request)
        if parent is None:
            stamp_lineage(entry, None, parent_resolution=ROOT)
        elif deltas and rng.random() < 0.5:
            entry = encode_delta(
                entry, LineageMatch(parent, tuple(cumulative), compute_digest(cumulative))
            )
        else:
            stamp_lineage(entry, parent, parent_resolution=RESOLVED)
        entries.append(entry)
        if rng.random() < 0.2:  # an identical retry under another call id
            entries.append(entry.model_copy(update={"model_call_id": f"c{n:02}-retry"}))
        if rng.random() < 0.15:  # same output, different tokens
            other = entry.model_copy(update={"model_call_id": f"c{n:02}-twin"})
            other.generation_token_ids = [*generation, 1]
            other.generation_log_probs = [*entry.generation_log_probs, 0.0]
            if not other.prompt_is_delta:
                stamp_lineage(
                    other, other.parent_call_id, parent_resolution=other.parent_resolution
                )
            else:
                other.cum_len, other.digest = None, None
            entries.append(other)
        nxt = [*request, *echo(output), *follow]
        frontier.append(
            (
                nxt,
                [
                    *(
                        prompt
                        if not entry.prompt_is_delta
                        else [*cumulative, *entry.prompt_token_ids]
                    ),
                    *generation,
                ],
                entry.model_call_id,
            )
        )
        queries.append(nxt)
        if len(nxt) > 2:
            mutated = copy.deepcopy(nxt)
            mutated[rng.randrange(len(mutated) - 1)]["content"] = "edited"
            queries.append(mutated)
            queries.append(nxt[rng.randrange(1, len(nxt)) :])
    return entries, queries


def outcome(resolver: Resolver, rollout: str, request: Items) -> tuple[Any, ...]:
    try:
        return summary(resolver.resolve_now(rollout, request))
    except (LineageIntegrityError, TokenCaptureCorruptionError) as exc:
        return (type(exc).__name__,)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1))
def test_differential_against_the_reference(
    tmp_path_factory: pytest.TempPathFactory, seed: int
) -> None:
    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("diff")
    store = TokenCaptureStore(root)
    native = FileLineageStore(root, max_cached_tokens=rng.choice([0, 50, 10_000]))
    memory = InMemoryLineageStore(max_cached_tokens=rng.choice([0, 10_000]))
    reference = ReferenceLineageStore(root)
    try:
        for rollout in ("a", "b"):
            # The in-memory resolver refuses delta entries (NeMo Gym's rule): it is compared on
            # the rollouts stored with full prompts, and refuses the stamped deltas of the rest.
            deltas = rng.random() < 0.5
            entries, queries = random_rollout(rng, rollout, deltas=deltas)
            resolvers = (native,) if deltas else (native, memory)
            order = list(range(len(entries)))
            for position, index in enumerate(order):
                entry = entries[index]
                store.append(entry)
                if (
                    entry.prompt_is_delta
                    and entry.continuation_fingerprint
                    and entry.fingerprint_version in (None, 2)
                ):
                    with pytest.raises(ValueError, match=f"^{DELTA_REFUSED}$"):
                        memory.put_now(entry)
                else:
                    memory.put_now(entry)
                if rng.random() < 0.5 or position == len(order) - 1:
                    for request in rng.sample(queries, min(4, len(queries))):
                        expected = outcome(reference, rollout, request)
                        for resolver in resolvers:
                            assert outcome(resolver, rollout, request) == expected
            for request in queries:
                expected = outcome(reference, rollout, request)
                for resolver in resolvers:
                    assert outcome(resolver, rollout, request) == expected
    finally:
        asyncio.run(reference.close())


def test_reference_token_digest_matches_the_golden_vectors() -> None:
    vectors = json.loads((GOLDEN / "token_digests.json").read_text("utf-8"))
    cases = vectors["vectors"] if isinstance(vectors, dict) else vectors
    for case in cases:
        ids = case.get("token_ids", case.get("ids"))
        if ids is None or "digest" not in case:
            continue
        assert reference_token_digest(ids) == case["digest"] == compute_digest(ids)


def test_lineage_module_is_importable_without_a_server_stack() -> None:
    code = (
        "import sys, tokencapture.lineage; "
        "print(sorted(m for m in ('fastapi', 'ray', 'torch', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ}
    )
    assert out.stdout.strip() == "[]"


POOL_THREADS = textwrap.dedent(
    """
    import os, sys
    from tokencapture.lineage import FileLineageStore
    def threads():
        return len(os.listdir("/proc/self/task"))
    before = threads()
    FileLineageStore(sys.argv[1])
    print(before, threads())
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_file_resolver_starts_the_worker_pool_when_made(tmp_path: Path) -> None:
    # A fresh process's first resolve does not pay for starting the native pool's threads:
    # making the resolver starts them (and creates no file).
    out = subprocess.run(
        [sys.executable, "-c", POOL_THREADS, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after - before >= 8, (before, after)
    assert list(tmp_path.iterdir()) == []


# ---- a reused rollout id, through the async resolve (deferred digest check, tuple memo) -----


def incarnation(
    new_ids: list[list[int]],
    generations: list[list[int]],
    retokenized: dict[int, int],
) -> tuple[list[TokenEntry], list[Items], list[tuple[int, ...]]]:
    """Full-prompt entries c0, c1, ... of rollout "r" (the requests are the same whatever the
    tokens, so two incarnations have the same call ids, fingerprints and contexts), the request
    continuing each, and each call's cumulative tokens. Turn i's prompt is the previous
    cumulative tokens and `new_ids[i]`; for i in `retokenized`, the previous tokens with the id
    at that position (mod their length) changed: a prompt sharing a prefix with its parent's
    tokens that does not extend them."""
    request: Items = [{"role": "user", "content": "go"}]
    entries, requests, cumulatives = [], [], []
    cumulative: list[int] = []
    for i, (new, generation) in enumerate(zip(new_ids, generations, strict=True)):
        before = list(cumulative)
        if i in retokenized and before:
            at = retokenized[i] % len(before)
            before[at] += 1
        prompt = [*before, *new]
        output, follow = chat_turn(i)
        entry = stamp_continuation(
            TokenEntry(
                rollout_id="r",
                model_call_id=f"c{i}",
                prompt_token_ids=prompt,
                generation_token_ids=generation,
                generation_log_probs=[0.0] * len(generation),
                output_items=output,
            ),
            request,
        )
        parent = f"c{i - 1}" if i else None
        entries.append(stamp_lineage(entry, parent, parent_resolution=RESOLVED if i else ROOT))
        request = [*request, *output, *follow]
        requests.append(request)
        cumulative = [*prompt, *generation]
        cumulatives.append(tuple(cumulative))
    return entries, requests, cumulatives


token_ids = st.lists(st.integers(0, 200_000), min_size=1, max_size=300)


@st.composite
def reused_rollouts(draw: st.DrawFn) -> dict[str, Any]:
    turns = draw(st.integers(2, 4))
    new_ids = [draw(token_ids) for _ in range(turns)]
    generations = [draw(st.lists(st.integers(0, 200_000), min_size=1, max_size=4))] * turns
    # The second incarnation: the first's ids with one changed (so its answers share a prefix
    # with the first's, up to that id), and now and then a retokenized turn.
    second_ids = [list(ids) for ids in new_ids]
    turn = draw(st.integers(0, turns - 1))
    at = draw(st.integers(0, len(second_ids[turn]) - 1))
    second_ids[turn][at] += 1
    retokenized = draw(st.dictionaries(st.integers(1, turns - 1), st.integers(0, 10_000)))
    order = draw(st.permutations(range(turns)))
    sync = draw(st.lists(st.booleans(), min_size=turns, max_size=turns))
    return {
        "resolve_between": draw(st.booleans()),
        "first": incarnation(new_ids, generations, {}),
        "second": incarnation(second_ids, generations, retokenized),
        "order": order,
        "sync": sync,
    }


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=reused_rollouts())
def test_a_deleted_and_reused_rollout_answers_only_its_new_tokens(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    """A rollout resolved turn by turn through the async resolve (each answer built from its
    parent's cached tokens, its digest checked on the worker, its tuple extended from the last
    answer's), deleted and written again under the same id with other tokens that share a
    prefix with the old ones (same call ids, requests and fingerprints; now and then a prompt
    that shares a prefix with its parent's tokens without extending them), with or without a
    resolve between the delete and the new puts: every answer, async or not, in any order, is
    the new incarnation's tokens with their digest, never the old one's, and never the old
    answer's tuple extended."""
    root = tmp_path_factory.mktemp("reused")
    first_entries, requests, first_tokens = case["first"]
    second_entries, _, second_tokens = case["second"]

    async def answer(resolver: FileLineageStore, turn: int, sync: bool) -> tuple[Any, ...]:
        if sync:
            resolution = resolver.resolve_now("r", requests[turn])
        else:
            resolution = await resolver.resolve("r", requests[turn])
        return summary(resolution)[1:4]

    async def scenario() -> None:
        store = TokenCaptureStore(root)
        resolver = FileLineageStore(root)
        for turn, entry in enumerate(first_entries):
            store.append(entry)
            expected = first_tokens[turn]
            assert await answer(resolver, turn, False) == (
                f"c{turn}",
                expected,
                compute_digest(expected),
            )
        store.delete_now(["r"])
        if case["resolve_between"]:
            assert (await resolver.resolve("r", requests[-1])).status is UNRESOLVED
        # Written again turn by turn, each new turn resolved at once (its parent's new tokens
        # cached by then), then every turn again in the drawn order.
        for turn, entry in enumerate(second_entries):
            store.append(entry)
            expected = second_tokens[turn]
            got = await answer(resolver, turn, case["sync"][turn])
            assert got == (f"c{turn}", expected, compute_digest(expected)), f"turn {turn}"
        for turn in case["order"]:
            expected = second_tokens[turn]
            for sync in (False, True):
                got = await answer(resolver, turn, sync)
                assert got == (f"c{turn}", expected, compute_digest(expected)), f"turn {turn}"
        await resolver.close()

    asyncio.run(scenario())


def damage_a_digit(log: Path, call_id: str, in_new_part: bool, skip: int) -> None:
    """Change one digit of `call_id`'s prompt in the log, in place (same length, valid JSON),
    after the first `skip` ids (`in_new_part`) or within them; its recorded digest is kept."""
    data = bytearray(log.read_bytes())
    line_start = data.index(f'"model_call_id":"{call_id}"'.encode())
    line_start = data.rindex(b"\n", 0, line_start) + 1 if b"\n" in data[:line_start] else 0
    prompt = data.index(b'"prompt_token_ids":[', line_start) + len(b'"prompt_token_ids":[')
    at = prompt
    for _ in range(skip if in_new_part else skip // 2):
        at = data.index(b",", at) + 1
    data[at] = ord("1") if data[at] != ord("1") else ord("2")
    log.write_bytes(bytes(data))


@pytest.mark.parametrize("in_new_part", [True, False], ids=["new-ids", "parent-ids"])
@pytest.mark.parametrize("parent_len", [8, 300_000], ids=["short", "long"])
async def test_a_damaged_answer_line_is_never_handed_back_whatever_the_timing(
    tmp_path: Path, parent_len: int, in_new_part: bool
) -> None:
    """c1's full prompt extends c0's cached tokens and its line is damaged on disk (one digit,
    its recorded digest kept). Async resolves, eight at a time so that the worker's check and
    the loop's tuple race each other (a long parent takes the worker milliseconds to hash,
    past the loop's 1 ms wait), and a sync one: a digit changed among the new ids must raise
    every time; one changed among the ids the parent covers (counted, not parsed) may only
    answer c1's true tokens, which its recorded digest names."""
    rng = random.Random(parent_len)
    c0_prompt = [rng.randrange(100_000) for _ in range(parent_len)]
    c0_tokens = [*c0_prompt, 7]
    c1_prompt = [*c0_tokens, *(rng.randrange(10, 100_000) for _ in range(40))]
    c1_tokens = (*c1_prompt, 8)
    request: Items = [{"role": "user", "content": "go"}]
    entries, requests = [], []
    for i, (prompt, generation) in enumerate([(c0_prompt, [7]), (c1_prompt, [8])]):
        output, follow = chat_turn(i)
        entry = stamp_continuation(
            TokenEntry(
                rollout_id="r",
                model_call_id=f"c{i}",
                prompt_token_ids=prompt,
                generation_token_ids=generation,
                generation_log_probs=[0.0],
                output_items=output,
            ),
            request,
        )
        entries.append(
            stamp_lineage(entry, "c0" if i else None, parent_resolution=RESOLVED if i else ROOT)
        )
        request = [*request, *output, *follow]
        requests.append(request)
    store = TokenCaptureStore(tmp_path)
    resolver = FileLineageStore(tmp_path)
    store.append(entries[0])
    assert summary(await resolver.resolve("r", requests[0]))[2] == tuple(c0_tokens)
    store.append(entries[1])
    damage_a_digit(store.path_for("r"), "c1", in_new_part, len(c0_tokens))
    for _ in range(3):
        answers = await asyncio.gather(
            *(resolver.resolve("r", requests[1]) for _ in range(8)), return_exceptions=True
        )
        try:
            answers.append(resolver.resolve_now("r", requests[1]))
        except LineageIntegrityError as exc:
            answers.append(exc)
        for answer in answers:
            if in_new_part:
                assert isinstance(answer, LineageIntegrityError), answer
            elif not isinstance(answer, LineageIntegrityError):
                assert isinstance(answer, LineageResolution), answer
                assert summary(answer)[1:4] == ("c1", c1_tokens, compute_digest(c1_tokens))
    await resolver.close()
