"""The lineage stamp of a captured chat call's entry, as the gateway stores it.

Every stamped field must be what `stamp_continuation` of the conversation the call was stamped
with gives (an untyped part read with its type, `_stampable`), for each call, never another
call's, whichever of the native port or `tokencapture.fingerprint` hashes it, whole or
streamed, with calls in flight together. A guard for any change that computes a hash of the
conversation once and reuses it (the check before the intent, the resolve and the stamp each
hash it today). In process, against the fake upstream (tests/fake_upstream.py)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from tests.test_gateway import Harness, _user, gw

from tokencapture import _core
from tokencapture.fingerprint import conversation_digest
from tokencapture.lineage import stamp_continuation
from tokencapture.records import TokenEntry

__all__ = ["gw"]  # the shared fixture, imported for pytest

_URL = {"url": "https://example.com/cat.png"}
_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def _tool_turns(turns: int) -> list[dict[str, Any]]:
    """An agent's conversation: system, user, then assistant tool calls and their results."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        _user("Fix the failing test."),
    ]
    for i in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": f"Reading file {i}.",
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": f'{{"path": "f{i}.py"}}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"x = {i}\n"})
    return messages


# Conversations as a client sends them, and as they are stamped (an untyped part gets its type).
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "plain": (p := [{"role": "system", "content": "Be brief."}, _user("Weather in Paris?")], p),
    "tool_turns": (t := _tool_turns(9), t),
    "untyped_part": (
        [{"role": "user", "content": [{"image_url": _URL}, {"type": "text", "text": "?"}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": _URL},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
    ),
    # A float in a part the digest reads: the native digest defers to tokencapture.fingerprint.
    "digest_in_python": (
        d := [{"role": "user", "content": [{"type": "input_image", "detail": 1.5}]}],
        d,
    ),
    # A float in a tool call's arguments: both native hashes defer.
    "both_in_python": (
        b := [
            _user("set it"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "set", "arguments": '{"t": 0.5}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "ok"},
            _user("again"),
        ],
        b,
    ),
}


def test_the_conversations_cover_both_hashers() -> None:
    """The cases below reach every path: the native pair, a digest only Python computes, and
    a fingerprint only Python computes."""
    _, plain = CONVERSATIONS["plain"]
    assert _core.continuation_hashes(plain, len(plain)) is not None
    _, digest_only = CONVERSATIONS["digest_in_python"]
    assert _core.continuation_hashes(digest_only, 1) is None
    assert _core.request_fingerprint(digest_only) is not None
    _, both = CONVERSATIONS["both_in_python"]
    assert _core.request_fingerprint(both) is None


def _expected_stamp(entry: TokenEntry, stamped: list[dict[str, Any]]) -> tuple[Any, ...]:
    again = stamp_continuation(entry.model_copy(), stamped)
    return (
        again.continuation_fingerprint,
        again.continuation_context_len,
        again.continuation_context_digest,
        again.fingerprint_version,
    )


def _stamp_of(entry: TokenEntry) -> tuple[Any, ...]:
    return (
        entry.continuation_fingerprint,
        entry.continuation_context_len,
        entry.continuation_context_digest,
        entry.fingerprint_version,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_each_captured_entry_is_stamped_with_its_own_conversation(
    gw: Harness, stream: bool
) -> None:
    """Calls in flight together, with conversations of one length and of others, each
    stamped as `stamp_continuation` stamps its own conversation (a digest cached across calls,
    or taken from the wrong list, shows here)."""
    names = sorted(CONVERSATIONS)
    same_length = [[_user(f"question {i}")] for i in range(4)]
    sent = [CONVERSATIONS[n][0] for n in names] + same_length
    stamped = [CONVERSATIONS[n][1] for n in names] + same_length
    answers = await asyncio.gather(
        *(
            gw.chat(f"r{i}", copy.deepcopy(messages), call=f"c{i}", tools=_TOOLS, stream=stream)
            for i, messages in enumerate(sent)
        )
    )
    assert [a.status_code for a in answers] == [200] * len(sent), [a.text for a in answers]
    for i, messages in enumerate(stamped):
        [entry] = gw.store.read_entries(f"r{i}")
        assert entry.output_items[0].get("tool_calls") or messages[-1]["role"] != "user"
        assert _stamp_of(entry) == _expected_stamp(entry, messages), i
        assert entry.continuation_context_digest == conversation_digest(messages)
    digests = {
        gw.store.read_entries(f"r{i}")[0].continuation_context_digest for i in range(len(sent))
    }
    assert len(digests) == len(sent)


async def test_a_continuation_resolves_to_its_stamped_parent(gw: Harness) -> None:
    """The stamp is what the resolver finds: each turn of an agent's loop (tool calls and
    their results) continues the one before."""
    messages = copy.deepcopy(CONVERSATIONS["tool_turns"][0])
    for turn in range(3):
        answer = await gw.chat("loop", messages, call=f"t{turn}", tools=_TOOLS)
        assert answer.status_code == 200, answer.text
        message = answer.json()["choices"][0]["message"]
        messages = [*messages, {k: v for k, v in message.items() if v is not None}]
        messages.append(_user(f"go on {turn}"))
    entries = gw.store.read_entries("loop")
    assert [e.parent_call_id for e in entries] == [None, "t0", "t1"]
    assert [e.continuation_context_len for e in entries] == [20, 22, 24]
