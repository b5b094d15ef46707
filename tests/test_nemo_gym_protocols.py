"""Protocol and record types against NeMo Gym 0.7.0's own (`tests/nemo_oracle.py`).

NeMo Gym's objects are driven through our types and ours through NeMo Gym's: statuses compare
by value, so its `ParentResolutionStatus` members and plain strings work wherever NeMo Gym
accepts them, and become our enum. For every bad input both refuse, the error type is the same
and NeMo Gym's message text is contained in ours (ours may add detail). Expected outcomes come
from running NeMo Gym's code on the same values, never from constants worked out with ours.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from tests.nemo_oracle import import_nemo

nemo_records = import_nemo("records")
nemo_protocols = import_nemo("protocols")
nemo_lineage = import_nemo("lineage")
nemo_fingerprint = import_nemo("fingerprint")

from tokencapture import protocols, records  # noqa: E402
from tokencapture.lineage import InMemoryLineageStore, stamp_continuation  # noqa: E402
from tokencapture.protocols import LineageMatch, LineageResolution  # noqa: E402
from tokencapture.records import ParentResolutionStatus, TokenEntry  # noqa: E402

NemoStatus: Any = nemo_records.ParentResolutionStatus
NemoEntry: Any = nemo_records.TokenEntry
NemoMatch: Any = nemo_protocols.LineageMatch
NemoResolution: Any = nemo_protocols.LineageResolution

BASE: dict[str, Any] = {
    "rollout_id": "r",
    "model_call_id": "c",
    "prompt_token_ids": [1, 2],
    "generation_token_ids": [3],
    "generation_log_probs": [-0.5],
}


def outcome(run: Callable[[], object]) -> tuple[str, object]:
    """`("ok", value)` or `("error", exception)`."""
    try:
        return "ok", run()
    except Exception as exc:
        return "error", exc


def value_error_text(exc: BaseException) -> str:
    """The message a model validator raised, without pydantic's wrapping."""
    if isinstance(exc, ValidationError):
        return str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
    return str(exc)


# Statuses ---------------------------------------------------------------------------------


def status_spellings(name: str) -> list[Any]:
    """One status as our member, NeMo Gym's member and its plain string."""
    return [ParentResolutionStatus[name], NemoStatus[name], NemoStatus[name].value]


@pytest.mark.parametrize("name", ["ROOT", "RESOLVED", "UNRESOLVED"])
def test_lineage_resolution_takes_every_spelling_of_a_status(name: str) -> None:
    ours_match = LineageMatch("p", (1, 2), "d")
    nemo_match = NemoMatch("p", (1, 2), "d")
    for status in status_spellings(name):
        for match in (ours_match, nemo_match) if name == "RESOLVED" else (None,):
            nemo = NemoResolution(status, match)  # NeMo Gym accepts it ...
            ours = LineageResolution(status, match)  # ... and so do we, as our enum
            assert type(ours.status) is ParentResolutionStatus
            assert ours.status == nemo.status == NemoStatus[name]
            assert ours.status is ParentResolutionStatus[name]
            if match is not None:
                assert type(ours.match) is LineageMatch
                assert ours.match == ours_match
    # And NeMo Gym's dataclass takes ours.
    nemo_side = NemoResolution(
        ParentResolutionStatus[name], ours_match if name == "RESOLVED" else None
    )
    assert nemo_side.status == NemoStatus[name]


def nemo_match_or_none(status: Any) -> Any:
    return NemoMatch("p", (1,), "d") if status == "resolved" else None


# (status, give a match?) pairs NeMo Gym refuses with a ValueError.
REFUSED_RESOLUTIONS = [
    *((status, False) for status in status_spellings("RESOLVED")),
    *((status, True) for status in status_spellings("ROOT")[:2]),
    *((status, True) for status in status_spellings("UNRESOLVED")[:2]),
]


@pytest.mark.parametrize(("status", "with_match"), REFUSED_RESOLUTIONS)
def test_lineage_resolution_refuses_what_nemo_refuses_in_its_words(
    status: Any, with_match: bool
) -> None:
    nemo_kind, nemo_error = outcome(
        lambda: NemoResolution(status, NemoMatch("p", (1,), "d") if with_match else None)
    )
    ours_kind, ours_error = outcome(
        lambda: LineageResolution(status, LineageMatch("p", (1,), "d") if with_match else None)
    )
    assert nemo_kind == ours_kind == "error"
    assert type(nemo_error) is ValueError and isinstance(ours_error, ValueError)
    assert str(nemo_error) in str(ours_error)


@pytest.mark.parametrize("status", ["root", "unresolved"])
def test_a_plain_string_status_with_a_match_is_a_clear_value_error(status: str) -> None:
    """NeMo Gym fails here with a stray AttributeError (it reads `.value` of a str); ours is the
    ValueError NeMo Gym raises for the enum member, in its words."""
    nemo_kind, nemo_error = outcome(lambda: NemoResolution(status, NemoMatch("p", (1,), "d")))
    assert nemo_kind == "error" and isinstance(nemo_error, AttributeError)
    _, for_member = outcome(lambda: NemoResolution(NemoStatus(status), NemoMatch("p", (1,), "d")))
    with pytest.raises(ValueError) as raised:
        LineageResolution(status, LineageMatch("p", (1,), "d"))  # type: ignore[arg-type]
    assert str(for_member) in str(raised.value)


@pytest.mark.parametrize(("status", "error"), [("bogus", ValueError), (1, TypeError)])
def test_a_value_that_is_no_status_is_refused(status: object, error: type[Exception]) -> None:
    """A documented difference: NeMo Gym stores any status it is given; we refuse what cannot
    become a `ParentResolutionStatus` instead of handing it on."""
    assert outcome(lambda: NemoResolution(status))[0] == "ok"
    with pytest.raises(error, match="ParentResolutionStatus"):
        LineageResolution(status)  # type: ignore[arg-type]


def test_nemo_resolver_answers_become_ours() -> None:
    """A resolution NeMo Gym's own resolver returns is taken as is by ours."""
    lineage = nemo_lineage.RolloutLineage()
    answer = lineage.resolve([{"role": "user", "content": "hi"}])
    ours = LineageResolution(answer.status, answer.match, answer.reason)
    assert ours.status is ParentResolutionStatus.ROOT
    unresolved = lineage.resolve(
        [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": "hello"},
        ]
    )
    ours = LineageResolution(unresolved.status, unresolved.match, unresolved.reason)
    assert (ours.status, ours.reason) == (ParentResolutionStatus.UNRESOLVED, unresolved.reason)


# TokenEntry -------------------------------------------------------------------------------

# Field values NeMo Gym's TokenEntry refuses, one failure each (its first rule to fail).
BAD_ENTRIES: list[dict[str, Any]] = [
    {"schema_version": 2},
    {"schema_version": 7},
    {"schema_version": 0},
    {"schema_version": -3},
    {"generation_log_probs": []},
    {"generation_log_probs": [-0.5, -0.25]},
    {"token_item_index": 0},
    {"token_item_index": -1},
    {"token_item_index": 1, "output_items": [{"type": "message"}]},
    {"parent_resolution": "resolved"},
    {"parent_resolution": NemoStatus.RESOLVED, "parent_call_id": ""},
    {"parent_resolution": ParentResolutionStatus.RESOLVED},
    {"parent_resolution": "root", "parent_call_id": "p"},
    {"parent_resolution": NemoStatus.ROOT, "parent_call_id": ""},
    {"parent_resolution": "unresolved", "parent_call_id": "p"},
    {"parent_resolution": NemoStatus.UNRESOLVED, "parent_call_id": "p"},
    {"prompt_is_delta": True},
    {"prompt_is_delta": True, "parent_call_id": "p"},
    {"prompt_is_delta": True, "parent_resolution": "root"},
    {"parent_resolution": "bogus"},
    {"prompt_token_ids": ["a"]},
    {"generation_token_ids": None},
    {"output_items": ["text"]},
    {"rollout_id": 5},
    {"schema_version": 2, "generation_log_probs": []},  # the first rule wins
]


@pytest.mark.parametrize("fields", BAD_ENTRIES)
def test_token_entry_refuses_what_nemo_refuses_in_its_words(fields: dict[str, Any]) -> None:
    values = {**BASE, **fields}
    with pytest.raises(ValidationError) as nemo:
        NemoEntry(**values)
    with pytest.raises(ValidationError) as ours:
        TokenEntry(**values)
    nemo_errors, our_errors = nemo.value.errors(), ours.value.errors()
    assert [(e["type"], e["loc"]) for e in our_errors] == [
        (e["type"], e["loc"]) for e in nemo_errors
    ]
    for nemo_error, our_error in zip(nemo_errors, our_errors, strict=True):
        assert str(nemo_error["msg"]) in str(our_error["msg"])


def test_the_message_table_covers_every_rule() -> None:
    """Each of NeMo Gym's validator messages is reached by a row above."""
    seen = set()
    for fields in BAD_ENTRIES:
        with pytest.raises(ValidationError) as raised:
            NemoEntry(**{**BASE, **fields})
        error = raised.value
        seen.add(re.sub(r"-?\d+", "N", value_error_text(error)).split(" (got")[0])
    for phrase in (
        "but this reader understands up to N",
        "below the supported minimum N",
        "generation_token_ids and generation_log_probs must have the same length",
        "token_item_index N is outside output_items of length N",
        "resolved parent metadata requires parent_call_id",
        "root parent metadata cannot carry parent_call_id",
        "unresolved parent metadata cannot carry parent_call_id",
        "a delta prompt requires a RESOLVED parent_call_id to reconstruct from",
    ):
        assert any(phrase in message for message in seen), phrase


def test_entries_cross_both_ways() -> None:
    nemo = NemoEntry(**BASE, parent_resolution=NemoStatus.RESOLVED, parent_call_id="p")
    ours = TokenEntry.model_validate(nemo.model_dump())
    assert type(ours.parent_resolution) is ParentResolutionStatus
    assert ours.model_dump(mode="json") == nemo.model_dump(mode="json")
    ours = TokenEntry(**BASE, parent_resolution=NemoStatus.ROOT)
    assert ours.parent_resolution is ParentResolutionStatus.ROOT
    back = NemoEntry.model_validate(ours.model_dump())
    assert back.model_dump(mode="json") == ours.model_dump(mode="json")
    # NeMo Gym's helpers read our entries.
    assert nemo_records.cumulative_tokens(ours) == records.cumulative_tokens(ours)


ids = st.lists(st.integers(-2, 5), max_size=3)
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "schema_version": st.sampled_from([-1, 0, 1, 2, "1", 1.0, 1.5, True, None]),
    "prompt_token_ids": st.one_of(ids, st.sampled_from([[2**70], [1.0], [True], ["a"], None])),
    "generation_token_ids": st.one_of(ids, st.sampled_from([["a"], None])),
    "generation_log_probs": st.one_of(
        st.lists(st.floats(allow_nan=False), max_size=3), st.sampled_from([["x"], None])
    ),
    "token_item_index": st.sampled_from([None, -1, 0, 1, 2, "0", True, 1.0]),
    "output_items": st.sampled_from(
        [[], [{}], [{"a": 1}, {}], [{1: 2}], ["x"], None, [[]], [{"type": "message"}] * 3]
    ),
    "parent_resolution": st.sampled_from(
        [
            None,
            "",
            "root",
            "resolved",
            "unresolved",
            "ROOT",
            "bogus",
            1,
            *NemoStatus,
            *ParentResolutionStatus,
        ]
    ),
    "parent_call_id": st.sampled_from([None, "", "p", 5]),
    "prompt_is_delta": st.sampled_from([False, True, "yes", 1, 0, None]),
    "rollout_id": st.sampled_from(["r", 5, None, ""]),
    "created_at": st.sampled_from([0.0, "1", None, True, float("inf")]),
    "routed_experts": st.sampled_from([None, [[1, 2]], "x"]),
    "extra_field": st.sampled_from([1, "x", None]),
}


@settings(max_examples=600, deadline=None)
@given(
    st.dictionaries(st.sampled_from(sorted(FIELD_VALUES)), st.none(), max_size=5).flatmap(
        lambda keys: st.fixed_dictionaries({key: FIELD_VALUES[key] for key in keys})
    )
)
def test_token_entry_accepts_and_refuses_exactly_what_nemo_does(fields: dict[str, Any]) -> None:
    values = {**BASE, **fields}
    nemo_kind, nemo = outcome(lambda: NemoEntry(**values))
    ours_kind, ours = outcome(lambda: TokenEntry(**values))
    assert nemo_kind == ours_kind, (nemo, ours)
    if nemo_kind == "ok":
        assert isinstance(ours, TokenEntry)
        assert ours.model_dump(mode="json") == nemo.model_dump(mode="json")  # type: ignore[attr-defined]
        assert (
            ours.parent_resolution is None or type(ours.parent_resolution) is ParentResolutionStatus
        )
        return
    assert isinstance(nemo, ValidationError) and isinstance(ours, ValidationError)
    nemo_errors, our_errors = nemo.errors(), ours.errors()
    assert [(e["type"], e["loc"]) for e in our_errors] == [
        (e["type"], e["loc"]) for e in nemo_errors
    ]
    for nemo_error, our_error in zip(nemo_errors, our_errors, strict=True):
        assert str(nemo_error["msg"]) in str(our_error["msg"])


# Helpers of the records module ------------------------------------------------------------


def entry_pair(**fields: Any) -> tuple[Any, TokenEntry]:
    return NemoEntry(**{**BASE, **fields}), TokenEntry(**{**BASE, **fields})


HELPER_CASES: list[tuple[str, Callable[[Any, Any], object]]] = [
    ("negative token id", lambda module, entry: module.compute_digest([3, -4, -1])),
    (
        "cumulative tokens disagree",
        lambda module, entry: module.stamp_lineage(entry, None, cumulative=[9]),
    ),
    (
        "resolved without a parent",
        lambda module, entry: module.stamp_lineage(
            entry, None, parent_resolution=module.ParentResolutionStatus.RESOLVED
        ),
    ),
    (
        "root with a parent",
        lambda module, entry: module.stamp_lineage(
            entry, "p", parent_resolution=module.ParentResolutionStatus.ROOT
        ),
    ),
    (
        "unresolved with a parent",
        lambda module, entry: module.stamp_lineage(
            entry, "p", parent_resolution=module.ParentResolutionStatus.UNRESOLVED
        ),
    ),
]


@pytest.mark.parametrize(("what", "call"), HELPER_CASES, ids=[case[0] for case in HELPER_CASES])
def test_record_helpers_fail_in_nemos_words(what: str, call: Callable[[Any, Any], object]) -> None:
    nemo_entry, our_entry = entry_pair()
    nemo_kind, nemo_error = outcome(lambda: call(nemo_records, nemo_entry))
    ours_kind, ours_error = outcome(lambda: call(records, our_entry))
    assert nemo_kind == ours_kind == "error", what
    assert type(nemo_error) is ValueError and isinstance(ours_error, ValueError)
    assert str(nemo_error) in str(ours_error)


def test_cumulative_tokens_of_a_delta_fails_in_nemos_words() -> None:
    fields = {"prompt_is_delta": True, "parent_resolution": "resolved", "parent_call_id": "p"}
    nemo_entry, our_entry = entry_pair(**fields)
    _, nemo_error = outcome(lambda: nemo_records.cumulative_tokens(nemo_entry))
    with pytest.raises(ValueError) as ours:
        records.cumulative_tokens(our_entry)
    assert str(nemo_error) in str(ours.value)


def test_stamp_lineage_takes_nemo_statuses_and_strings() -> None:
    for status in status_spellings("ROOT"):
        entry = records.stamp_lineage(TokenEntry(**BASE), None, parent_resolution=status)
        assert entry.parent_resolution is ParentResolutionStatus.ROOT
    # The same stamp as NeMo Gym's, given NeMo Gym's status. (NeMo Gym's stamp_lineage
    # stores whatever status object it is given, unvalidated: hand it its own enum.)
    nemo_stamped = nemo_records.stamp_lineage(
        NemoEntry(**BASE), "p", parent_resolution=NemoStatus.RESOLVED
    )
    ours = records.stamp_lineage(TokenEntry(**BASE), "p", parent_resolution=NemoStatus.RESOLVED)
    assert ours.model_dump(mode="json") == nemo_stamped.model_dump(mode="json")


# Installing -------------------------------------------------------------------------------


def test_installing_a_sink_without_its_methods_fails_in_nemos_words() -> None:
    class PutOnly:
        async def put(self, entry: Any) -> None: ...

    _, nemo_error = outcome(lambda: nemo_protocols.install_token_sink(PutOnly()))
    try:
        with pytest.raises(TypeError) as ours:
            protocols.install_token_sink(PutOnly())  # type: ignore[arg-type]
    finally:
        nemo_protocols.install_token_sink(None)
        protocols.install_token_sink(None)
    assert type(nemo_error) is TypeError and str(nemo_error) in str(ours.value)


def test_nemo_gyms_own_store_installs_as_our_source(tmp_path: Path) -> None:
    """NeMo Gym 0.7.0's store (no retire) is a TokenSource by its own protocol."""
    nemo_store = import_nemo("store").TokenCaptureStore(tmp_path)
    try:
        protocols.install_token_source(nemo_store)
        protocols.install_token_sink(nemo_store)
        assert protocols.installed_token_source() is nemo_store
    finally:
        protocols.install_token_source(None)
        protocols.install_token_sink(None)


# The in-memory lineage store --------------------------------------------------------------


def delta_chain() -> tuple[TokenEntry, TokenEntry]:
    """A stamped root call and a stamped delta child of it."""
    request = [{"role": "user", "content": "go"}]
    output = [{"type": "message", "role": "assistant", "content": "ok"}]
    parent = stamp_continuation(
        TokenEntry(**{**BASE, "model_call_id": "c0", "output_items": output}), request
    )
    parent = records.stamp_lineage(parent, None, parent_resolution=ParentResolutionStatus.ROOT)
    child = stamp_continuation(
        TokenEntry(
            **{
                **BASE,
                "model_call_id": "c1",
                "prompt_token_ids": [4],
                "parent_call_id": "c0",
                "parent_resolution": "resolved",
                "prompt_is_delta": True,
                "output_items": output,
            }
        ),
        [*request, *output, {"role": "user", "content": "more"}],
    )
    return parent, records.stamp_lineage(
        child, "c0", parent_resolution=ParentResolutionStatus.RESOLVED, cumulative=[1, 2, 3, 4, 3]
    )


async def _refusal(call: Any, *args: Any) -> tuple[str, str] | None:
    """What `call(*args)` raises when called, as (type name, words); None when it does not (an
    awaitable it returns is then awaited, and must not raise either)."""
    try:
        result = call(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    if inspect.isawaitable(result):
        await result
    return None


async def test_in_memory_put_refuses_a_delta_entry_as_nemos_does() -> None:
    """NeMo Gym's in-memory resolver keeps no token log, so its `put` refuses every delta entry
    it would index, its parent held or not; ours refuses the same entries with the same
    exception and words (when `put` is called rather than when it is awaited), and takes the
    same others. Nothing refused is indexed."""
    parent, child = delta_chain()
    unstamped = child.model_copy(update={"continuation_fingerprint": ""})
    other_version = child.model_copy(update={"fingerprint_version": 1})
    unversioned = child.model_copy(update={"fingerprint_version": None})
    for entry, refused in (
        (parent, False),
        (child, True),
        (unversioned, True),
        (unstamped, False),
        (other_version, False),
    ):
        nemo_store = nemo_lineage.InMemoryLineageStore()
        await nemo_store.put(NemoEntry.model_validate(parent.model_dump()))  # the parent is held
        try:
            await nemo_store.put(NemoEntry.model_validate(entry.model_dump()))
            nemo: tuple[str, str] | None = None
        except Exception as exc:
            nemo = type(exc).__name__, str(exc)
        ours = InMemoryLineageStore()
        await ours.put(parent)
        before = ours.stored_tokens()
        assert (nemo is not None) is refused, entry.model_call_id
        assert await _refusal(ours.put, entry) == nemo  # when called
        assert await _refusal(ours.put_now, entry) == nemo
        if refused:
            assert nemo == (
                "ValueError",
                "delta records require a durable-log-backed lineage store",
            )
            assert ours.stored_tokens() == before


async def test_in_memory_resolve_answers_as_nemos_in_memory_resolver() -> None:
    """The same stamped entries in NeMo Gym's in-memory resolver and ours: the same decision
    and the same match, field by field (NeMo's reports the parent's cumulative length as
    `prev_len`, unlike its file resolver)."""
    parent, _ = delta_chain()
    follow_up = [
        {"role": "user", "content": "go"},
        {"type": "message", "role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    nemo_store = nemo_lineage.InMemoryLineageStore()
    await nemo_store.put(NemoEntry.model_validate(parent.model_dump()))
    ours = InMemoryLineageStore()
    await ours.put(parent)
    for request in (follow_up, follow_up[:1], [{"role": "assistant", "content": "x"}]):
        expected = await nemo_store.resolve("r", request)
        got = await ours.resolve("r", request)
        assert (got.status.value, got.reason) == (expected.status.value, expected.reason)
        if expected.match is None:
            assert got.match is None
            continue
        assert got.match is not None
        cumulative = len(parent.prompt_token_ids) + len(parent.generation_token_ids)
        assert got.match.prev_len == expected.match.prev_len == cumulative
        assert dataclasses.asdict(got.match) == dataclasses.asdict(expected.match)


@pytest.mark.parametrize("kind", ["file", "memory"])
async def test_a_match_on_an_entry_without_a_digest_carries_none_as_nemos(
    kind: str, tmp_path: Path
) -> None:
    """Entries stamped for continuation only (no `stamp_lineage`, so no digest), as the quick
    start writes them: NeMo Gym's resolvers and ours resolve the follow-up to the same match,
    whose digest is the entry's own, "" (not one computed from the rebuilt tokens)."""
    from tokencapture.lineage import FileLineageStore
    from tokencapture.store import TokenCaptureStore

    request = [{"role": "user", "content": "go"}]
    output = [{"type": "message", "role": "assistant", "content": "ok"}]
    entry = stamp_continuation(
        TokenEntry(**{**BASE, "model_call_id": "c0", "output_items": output}), request
    )
    assert entry.digest is None
    follow_up = [*request, *output, {"role": "user", "content": "more"}]
    if kind == "file":
        nemo_dir, our_dir = tmp_path / "nemo", tmp_path / "ours"
        await (
            import_nemo("store")
            .TokenCaptureStore(nemo_dir)
            .put(NemoEntry.model_validate(entry.model_dump()))
        )
        await TokenCaptureStore(our_dir).put(entry)
        expected = await nemo_lineage.FileLineageStore(nemo_dir).resolve("r", follow_up)
        got = await FileLineageStore(our_dir).resolve("r", follow_up)
    else:
        nemo_memory = nemo_lineage.InMemoryLineageStore()
        await nemo_memory.put(NemoEntry.model_validate(entry.model_dump()))
        ours = InMemoryLineageStore()
        await ours.put(entry)
        expected = await nemo_memory.resolve("r", follow_up)
        got = await ours.resolve("r", follow_up)
    assert expected.match is not None and got.match is not None
    assert expected.match.digest == ""
    assert dataclasses.asdict(got.match) == dataclasses.asdict(expected.match)
