"""Reading back rollouts whose prompts repeat earlier token arrays.

Readers reuse the ids of an array whose bytes repeat a recent array (an agentic prompt holds
the previous prompt and answer) instead of parsing them again. These tests aim at the edges
of that shortcut: a repeat that stops inside a number, a cut or edited history, arrays that
repeat only partly or several times over. Every snapshot must equal what was written, and what
the pure-Python reference reads from the same directory.
"""

from __future__ import annotations

import gc
import random
import tempfile
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import make_entry

from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.records import TokenEntry
from tokencapture.reference import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore, canonical_line


def entry(call: int, prompt: list[int], generation: list[int]) -> TokenEntry:
    return make_entry(
        "r",
        call,
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=[-0.5] * len(generation),
    )


def read_back(root: Path, entries: list[TokenEntry]) -> None:
    """Write `entries`, then freeze with a fresh Rust store and read with the reference."""
    writer = TokenCaptureStore(root)
    for item in entries:
        writer.append(item)
    expected = [canonical_line(item) for item in entries]
    reader = TokenCaptureStore(root)
    assert [canonical_line(e) for e in reader.read_entries("r")] == expected
    snapshot = reader.freeze_now("r")
    assert [canonical_line(e) for e in snapshot.entries] == expected
    assert [canonical_line(e) for e in ReferenceStore(root).read_entries("r")] == expected
    for got, wrote in zip(snapshot.entries, entries, strict=True):
        assert got.prompt_token_ids == wrote.prompt_token_ids
        assert got.generation_token_ids == wrote.generation_token_ids


def growing_rollout(seed: int, prompt: int, calls: int, answer: int, new: int) -> list[TokenEntry]:
    """An agentic rollout: each prompt is the previous prompt, its answer and `new` fresh ids."""
    rng = random.Random(seed)
    ids = [rng.randrange(150_000) for _ in range(prompt)]
    entries = []
    for call in range(calls):
        generation = [rng.randrange(150_000) for _ in range(answer)]
        entries.append(entry(call, list(ids), generation))
        ids = ids + generation + [rng.randrange(150_000) for _ in range(new)]
    return entries


def test_a_growing_agentic_prompt_reads_back_exactly(tmp_path: Path) -> None:
    read_back(tmp_path, growing_rollout(3, prompt=300, calls=8, answer=80, new=40))


def test_a_repeat_that_stops_inside_a_number_is_not_taken_whole(tmp_path: Path) -> None:
    base = [1000 + i for i in range(100)] + [12]
    entries = [
        entry(0, base, [7] * 70),
        entry(1, [*base[:-1], 123], [7] * 70),  # "...,12" then "...,123"
        entry(2, [*base[:-1], 1, 2], [7] * 70),  # "...,12" then "...,1,2"
        entry(3, [*base, 3], [7] * 70),  # "...,12" then "...,12,3"
        entry(4, [int(f"{base[0]}0"), *base[1:]], [7] * 70),  # the first id grows
    ]
    read_back(tmp_path, entries)


def test_cut_edited_and_doubled_histories_read_back_exactly(tmp_path: Path) -> None:
    rng = random.Random(5)
    history = [rng.randrange(150_000) for _ in range(500)]
    answer = [rng.randrange(150_000) for _ in range(100)]
    edited = list(history)
    edited[250] += 1
    entries = [
        entry(0, history, answer),
        entry(1, history[100:], answer),  # the context window dropped the start
        entry(2, edited, answer),  # one id changed in the middle
        entry(3, history + answer + history + answer, answer),  # repeats chained, twice over
        entry(4, history[:-1], []),  # stops one id short; no answer
        entry(5, answer + history, answer),  # the pieces in the other order
        entry(6, history, answer),  # identical to the first
    ]
    read_back(tmp_path, entries)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_prompts_built_from_earlier_pieces_read_back_exactly(data: st.DataObject) -> None:
    ids = st.integers(min_value=0, max_value=2**63)
    arrays: list[list[int]] = []
    entries = []
    for call in range(data.draw(st.integers(1, 6), label="calls")):
        prompt: list[int] = []
        for _ in range(data.draw(st.integers(1, 3))):
            if arrays and data.draw(st.booleans()):
                earlier = data.draw(st.sampled_from(arrays))
                start = data.draw(st.integers(0, len(earlier)))
                end = data.draw(st.integers(start, len(earlier)))
                prompt += earlier[start:end] if data.draw(st.booleans()) else earlier
            else:
                prompt += data.draw(st.lists(ids, min_size=0, max_size=150))
        if prompt and data.draw(st.booleans()):
            prompt[-1] = prompt[-1] * 10 + data.draw(st.integers(0, 9))  # continue a number
        generation = data.draw(st.lists(ids, min_size=0, max_size=150))
        arrays += [prompt, generation]
        entries.append(entry(call, [p % 2**64 for p in prompt], generation))
    with tempfile.TemporaryDirectory() as root:
        read_back(Path(root), entries)


def test_frozen_token_lists_are_plain_independent_lists(tmp_path: Path) -> None:
    prompt = list(range(1000, 1200))
    entries = [entry(0, prompt, list(range(64))), entry(1, prompt + list(range(64)), [5])]
    store = TokenCaptureStore(tmp_path)
    for item in entries:
        store.append(item)
    first, second = TokenCaptureStore(tmp_path).freeze_now("r").entries
    assert type(first.prompt_token_ids) is list
    # A list of ints cannot be part of a cycle: the collector is told not to walk it.
    assert not gc.is_tracked(second.prompt_token_ids)
    # The second prompt reused the first one's ids, but not its list.
    assert second.prompt_token_ids[:200] == first.prompt_token_ids
    first.prompt_token_ids.append(7)
    first.prompt_token_ids[0] = -1
    assert second.prompt_token_ids == prompt + list(range(64))


def large_rollout(root: Path) -> list[TokenEntry]:
    """A log well past the size at which freeze verifies on a second thread while decoding."""
    entries = growing_rollout(11, prompt=8_000, calls=6, answer=300, new=0)
    store = TokenCaptureStore(root)
    for item in entries:
        store.append(item)
    assert (root / "r.tokens.jsonl").stat().st_size > 256 << 10  # the overlap threshold
    return entries


def test_a_large_log_freezes_exactly_with_a_torn_tail_cut(tmp_path: Path) -> None:
    entries = large_rollout(tmp_path)
    log = tmp_path / "r.tokens.jsonl"
    good = log.read_bytes()
    log.write_bytes(good + canonical_line(entries[0])[:5000])  # a torn, unacknowledged write
    snapshot = TokenCaptureStore(tmp_path).freeze_now("r")
    assert [canonical_line(e) for e in snapshot.entries] == [canonical_line(e) for e in entries]
    assert log.read_bytes() == good


def test_a_large_log_with_a_damaged_indexed_line_raises_and_stays_unfrozen(
    tmp_path: Path,
) -> None:
    entries = large_rollout(tmp_path)
    # Index the large lines: puts write no state index until the 64th entry's checkpoint.
    store = TokenCaptureStore(tmp_path)
    for n in range(len(entries), 64):
        assert not (tmp_path / "r.tokens.state.json").exists()
        store.append(make_entry("r", call=f"small-{n}"))
    assert (tmp_path / "r.tokens.state.json").exists()
    log = tmp_path / "r.tokens.jsonl"
    data = bytearray(log.read_bytes())
    at = data.index(b'"prompt_token_ids":[') + len(b'"prompt_token_ids":[')
    data[at] = ord("1") if data[at] != ord("1") else ord("2")  # still valid JSON, other bytes
    log.write_bytes(bytes(data))
    reader = TokenCaptureStore(tmp_path)
    with pytest.raises(TokenCaptureCorruptionError, match="payload digest"):
        reader.freeze_now("r")
    state = (tmp_path / "r.tokens.state.json").read_bytes()
    assert b'"frozen":false' in state


def test_decoding_leaves_the_cycle_collector_as_it_found_it(tmp_path: Path) -> None:
    """Readers pause the collector while they decode, and only restore what they paused."""
    store = TokenCaptureStore(tmp_path)
    for rollout_id in ("a", "b"):
        store.append(make_entry(rollout_id, call="c1", prompt_token_ids=list(range(200))))
    assert gc.isenabled()
    store.freeze_now("a")
    assert gc.isenabled()
    gc.disable()
    try:
        assert [e.model_call_id for e in store.read_entries("b")] == ["c1"]
        store.freeze_now("b")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_large_log_reads_exactly_past_a_duplicate_line_that_is_not_an_entry(
    tmp_path: Path,
) -> None:
    """A foreign writer's second line for a call id is not returned, and it need not be a
    valid entry; later lines that repeat its arrays must still read back exactly (a large log
    is parsed on a helper thread, and a line that fails to build must not break the rest)."""
    entries = large_rollout(tmp_path)
    log = tmp_path / "r.tokens.jsonl"
    prompt = entries[-1].prompt_token_ids + entries[-1].generation_token_ids
    bad = orjson.loads(canonical_line(entries[0]))
    bad["prompt_token_ids"] = prompt
    bad["generation_token_ids"] = ["not", "ids"]  # valid JSON, not an entry
    with log.open("ab") as out:
        out.write(orjson.dumps(bad, option=orjson.OPT_SORT_KEYS) + b"\n")
    store = TokenCaptureStore(tmp_path)
    later = [entry(call, [*prompt, call], [call]) for call in range(6, 9)]
    for item in later:
        store.append(item)
    expected = [canonical_line(e) for e in entries + later]
    reader = TokenCaptureStore(tmp_path)
    assert [canonical_line(e) for e in reader.read_entries("r")] == expected
    snapshot = reader.freeze_now("r")
    assert [canonical_line(e) for e in snapshot.entries] == expected
    assert snapshot.incomplete  # two payloads for one call id
