"""Differential tests: the Rust-backed store against the pure-Python reference store.

* `DifferentialMachine` drives two directories with the same random operations, one through
  each implementation (swapping them mid-sequence), and compares every return value, exception
  type, snapshot and file of the two directories after every step.
* `SharedDirectoryMachine` drives ONE directory through several live instances of both
  implementations at random and checks every observation against a small in-test model.
* Plain tests cover concurrent writers of both implementations on one rollout, and the gaps the
  differential runs found in the Rust store (fixed; kept as regression tests).

The default run is sized for a 2-core machine; `TOKENCAPTURE_HYPOTHESIS_PROFILE=long` runs
about ten times as many examples.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tests.conftest import is_storable_call_id

from tokencapture import reference
from tokencapture.protocols import (
    TokenCaptureConflictError,
    TokenCaptureCorruptionError,
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
    TokenCaptureSnapshot,
)
from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore as RustStore
from tokencapture.store import canonical_line


def _quiet_hypothesis_failure_reports() -> None:
    """On a failure, Hypothesis's pytest plugin imports its patch writer, which imports libcst
    when that is installed, and libcst's import warns (mypy_extensions.TypedDict). With
    warnings as errors that turns the failure report into an INTERNALERROR that hides the
    failing example, so import it once here with that warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with contextlib.suppress(ImportError):
            importlib.import_module("hypothesis.extra._patching")


_quiet_hypothesis_failure_reports()

RefStore = reference.TokenCaptureStore
Store: TypeAlias = RustStore | RefStore

LONG = os.environ.get("TOKENCAPTURE_HYPOTHESIS_PROFILE", "") == "long"
MACHINE_SETTINGS = settings(
    max_examples=500 if LONG else 50,
    stateful_step_count=60 if LONG else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

ROLLOUTS = ("r0", "r1")
CALL_IDS = ("c0", "c1", "c2", 'q"\u00e9\u2028')
# Call ids that cannot be one line of the intents file, and some that can but look odd.
ODD_CALL_IDS = ("", "a\nb", "x\ry", "\ud800", "\x00nul", " ", "\tpad")
# Errors a store is expected to raise for some input; anything else fails the test at once.
EXPECTED_ERRORS = (ValueError, TypeError, TokenCaptureFrozenError)


def make_entry(rollout_id: str, call_id: str, variant: int = 0) -> TokenEntry:
    """A small valid entry; `variant` changes the payload (a conflicting re-put)."""
    seed = sum(call_id.encode("utf-8", "surrogatepass")) % 997
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model=f"model-{variant}",
        prompt_token_ids=[seed, seed + 1, variant],
        generation_token_ids=[seed + 2, 7],
        generation_log_probs=[-0.5 - variant / 4, -1e-9],
        created_at=1700000000.25 + seed,
        kept_extra={"variant": variant, "text": "caf\u00e9 \u2028 \U0001f600"},
    )


@dataclass(frozen=True)
class Outcome:
    """What one call did: its (normalized) value, or the type and text of its exception."""

    value: Any = None
    error: type[BaseException] | None = None
    message: str = ""

    def same_as(self, other: Outcome) -> bool:
        return self.error is other.error and (self.error is not None or self.value == other.value)


def observe(call: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(value=call())
    except EXPECTED_ERRORS as exc:
        return Outcome(error=type(exc), message=str(exc))


def lines_of(entries: list[TokenEntry] | tuple[TokenEntry, ...]) -> list[bytes]:
    return [canonical_line(entry) for entry in entries]


def run(store: Store, name: str, use_async: bool, *args: Any) -> Any:
    """Call a sync method, or its async twin through a fresh event loop."""
    sync_names = {
        "put": "append",
        "begin_call": "_begin_call",
        "mark_incomplete": "_mark_incomplete",
        "freeze": "freeze_now",
        "drop": "_drop",
        "retire": "retire_now",
        "delete": "delete_now",
    }
    if use_async:
        return asyncio.run(getattr(store, name)(*args))
    return getattr(store, sync_names[name])(*args)


def file_names(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def replace_file(path: Path, data: bytes) -> None:
    """Replace a file the way an outside writer would (a new inode, never in place)."""
    tmp = path.with_name(path.name + ".outside")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


TORN_TAILS = (
    b'{"model_call_id":"torn","prompt_token',
    # A complete JSON object without its newline is still a torn write.
    b'{"model_call_id":"c0","prompt_token_ids":[]}',
    b"garbage without newline",
)
BAD_LINES = (b"not json\n", b'{"no_call_id":1}\n', b'{"model_call_id":5}\n', b"[1,2]\n")
STATE_JUNK = (b"", b'{"frozen":', b"[]", b'{"version":-1}', b'{"frozen":1}')


class DifferentialMachine(RuleBasedStateMachine):
    """Two directories, the same operations, one implementation each (swapped at random)."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tc-diff-"))
        self.dirs = (self.tmp / "a", self.tmp / "b")
        self.impls: list[type[Store]] = [RustStore, RefStore]
        self.stores: list[Store] = [impl(d) for impl, d in zip(self.impls, self.dirs, strict=True)]
        # Per directory: the snapshot id of each frozen rollout, and the last freeze's result.
        self.sids: tuple[dict[str, str], dict[str, str]] = ({}, {})
        self.last: tuple[dict[str, tuple[str, int]], dict[str, tuple[str, int]]] = ({}, {})

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    # Helpers -----------------------------------------------------------------------------

    def both(self, what: str, call: Callable[[int, Store], Any]) -> tuple[Outcome, Outcome]:
        outcomes = (
            observe(lambda: call(0, self.stores[0])),
            observe(lambda: call(1, self.stores[1])),
        )
        a, b = outcomes
        assert a.same_as(b), (
            f"{what}: {self.impls[0].__module__} -> {a} but {self.impls[1].__module__} -> {b}"
        )
        return outcomes

    def reopen_stores(self) -> None:
        self.stores = [impl(d) for impl, d in zip(self.impls, self.dirs, strict=True)]

    def forget(self, rollout_id: str) -> None:
        for sids, last in zip(self.sids, self.last, strict=True):
            sids.pop(rollout_id, None)
            last.pop(rollout_id, None)

    # Writes ------------------------------------------------------------------------------

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALL_IDS),
        variant=st.sampled_from((0, 0, 0, 1)),
        use_async=st.booleans(),
    )
    def put(self, rollout_id: str, call_id: str, variant: int, use_async: bool) -> None:
        entry = make_entry(rollout_id, call_id, variant)
        self.both(f"put {call_id!r}/{variant}", lambda i, s: run(s, "put", use_async, entry))

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALL_IDS),
        variant=st.sampled_from((0, 0, 0, 1)),
    )
    def put_again(self, rollout_id: str, call_id: str, variant: int) -> None:
        """A second put rule: puts dominate real runs, and deep histories find more."""
        self.put(rollout_id, call_id, variant, use_async=False)

    @rule(rollout_id=st.sampled_from(ROLLOUTS), call_id=st.sampled_from(ODD_CALL_IDS))
    def put_odd_call_id(self, rollout_id: str, call_id: str) -> None:
        entry = make_entry(rollout_id, call_id)
        self.both(f"put {call_id!r}", lambda i, s: s.append(entry))

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALL_IDS + ODD_CALL_IDS),
        use_async=st.booleans(),
    )
    def begin_call(self, rollout_id: str, call_id: str, use_async: bool) -> None:
        self.both(
            f"begin_call {call_id!r}",
            lambda i, s: run(s, "begin_call", use_async, rollout_id, call_id),
        )

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from((None, *CALL_IDS, *ODD_CALL_IDS)),
        use_async=st.booleans(),
    )
    def mark_incomplete(self, rollout_id: str, call_id: str | None, use_async: bool) -> None:
        args = (rollout_id,) if call_id is None else (rollout_id, call_id)
        self.both(
            f"mark_incomplete {call_id!r}",
            lambda i, s: run(s, "mark_incomplete", use_async, *args),
        )

    # Lifecycle ---------------------------------------------------------------------------

    @rule(rollout_id=st.sampled_from(ROLLOUTS), use_async=st.booleans())
    def freeze(self, rollout_id: str, use_async: bool) -> None:
        def call(i: int, store: Store) -> tuple[list[bytes], bool, int]:
            snapshot: TokenCaptureSnapshot = run(store, "freeze", use_async, rollout_id)
            assert snapshot.rollout_id == rollout_id
            assert len(snapshot.snapshot_id) == 32
            int(snapshot.snapshot_id, 16)
            known = self.sids[i].setdefault(rollout_id, snapshot.snapshot_id)
            assert snapshot.snapshot_id == known, "snapshot id changed between freezes"
            self.last[i][rollout_id] = (snapshot.snapshot_id, snapshot.version)
            return lines_of(snapshot.entries), snapshot.incomplete, snapshot.version

        a, _ = self.both("freeze", call)
        if a.error is None:
            assert self.sids[0][rollout_id] != self.sids[1][rollout_id]

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        which=st.sampled_from(("last", "current", "current", "wrong_sid", "next_version")),
        use_async=st.booleans(),
    )
    def drop(self, rollout_id: str, which: str, use_async: bool) -> None:
        def call(i: int, store: Store) -> bool:
            if which == "current":
                seen = observe(lambda: store.inspect(rollout_id))
                state = seen.value or {}
                sid, version = state.get("snapshot_id", ""), state.get("version", 0)
            else:
                sid, version = self.last[i].get(rollout_id, ("", 0))
            if which == "wrong_sid":
                sid = "0" * 32
            elif which == "next_version":
                version += 1
            result: bool = run(store, "drop", use_async, rollout_id, sid, version)
            return result

        self.both(f"drop ({which})", call)

    @rule(
        method=st.sampled_from(("retire", "delete")),
        batch=st.one_of(
            st.lists(st.sampled_from((*ROLLOUTS, "r2")), max_size=3),
            st.sampled_from(("r0", ("r0", "bad id"), ("r1", ""), ("r0", "a/b"))),
        ),
        use_async=st.booleans(),
    )
    def remove(self, method: str, batch: Any, use_async: bool) -> None:
        """`retire` or `delete` a batch (invalid batches refuse everything, changing nothing)."""
        batch = batch if isinstance(batch, str | list) else list(batch)
        outcome, _ = self.both(f"{method} {batch!r}", lambda i, s: run(s, method, use_async, batch))
        if outcome.error is not None:
            assert outcome.error in (TypeError, ValueError)
        elif method == "delete":
            for rollout_id in batch:
                self.forget(rollout_id)

    # Instances and outside events --------------------------------------------------------

    @rule(swap=st.booleans())
    def reopen(self, swap: bool) -> None:
        """New store instances; with `swap`, each directory continues with the other kind."""
        if swap:
            self.impls.reverse()
        self.reopen_stores()

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        event=st.sampled_from(
            (
                *(("torn", tail) for tail in TORN_TAILS),
                *(("torn", tail) for tail in TORN_TAILS),
                *(("bad line", line) for line in BAD_LINES),
                *(("state junk", junk) for junk in STATE_JUNK),
                ("duplicate line", b""),
            )
        ),
    )
    def outside_event(self, rollout_id: str, event: tuple[str, bytes]) -> None:
        """A crash leaves a torn line; an outside writer appends a bad line or a copy of a good
        one, or replaces the state index with junk. The same bytes land in both directories."""
        kind, data = event
        # Junk replaces a state index only where both directories have one: the Rust store
        # has none for a rollout's first puts (see `directories_hold_the_same_files`).
        junk_state = kind == "state junk" and all(
            store.state_path_for(rollout_id).exists() for store in self.stores
        )
        for store in self.stores:
            if kind == "state junk":
                if junk_state:
                    replace_file(store.state_path_for(rollout_id), data)
            elif kind == "duplicate line":
                # A second copy of an acknowledged line (same payload): folded as a no-op.
                log = store.path_for(rollout_id)
                if log.exists():
                    content = log.read_bytes()
                    if b"\n" in content:
                        append_bytes(log, content[: content.index(b"\n") + 1])
            else:
                log = store.path_for(rollout_id)
                if log.exists():
                    append_bytes(log, data)

    # Invariants --------------------------------------------------------------------------

    @invariant()
    def directories_hold_the_same_files(self) -> None:
        names = [file_names(d) for d in self.dirs]
        # The reference rewrites the state index at every put (NeMo Gym's design); the Rust
        # store writes none for a rollout's first puts, until a checkpoint or a lifecycle
        # transition (a missing index is a fresh rollout; `readers_agree` compares what both
        # read). With the implementations swapped, either side may be the one without it.
        one_sided = set(names[0]) ^ set(names[1])
        assert all(name.endswith(".tokens.state.json") for name in one_sided), one_sided
        assert [n for n in names[0] if n not in one_sided] == [
            n for n in names[1] if n not in one_sided
        ]
        assert not [name for name in names[0] if name.endswith(".tmp")]
        for name in names[0]:
            if name.endswith((".jsonl", ".intents", ".incomplete")):
                assert (self.dirs[0] / name).read_bytes() == (self.dirs[1] / name).read_bytes()

    @invariant()
    def readers_agree(self) -> None:
        for rollout_id in (*ROLLOUTS, "r2"):
            self.readers_agree_on(rollout_id)

    def readers_agree_on(self, rollout_id: str) -> None:
        self.both("is_incomplete", lambda i, s: s.is_incomplete(rollout_id))
        self.both("read_entries", lambda i, s: lines_of(s.read_entries(rollout_id)))

        def inspected(i: int, store: Store) -> dict[str, Any] | None:
            state = store.inspect(rollout_id)
            if state is None:
                return None
            sid = state.pop("snapshot_id")
            if sid:
                assert sid == self.sids[i].get(rollout_id, sid)
            state["has_snapshot"] = bool(sid)
            return state

        self.both("inspect", inspected)


class SharedDirectoryMachine(RuleBasedStateMachine):
    """One directory, several live instances of both implementations, one in-test model."""

    @dataclass
    class Rollout:
        lines: dict[str, bytes] = field(default_factory=dict)
        intents: list[str] = field(default_factory=list)
        incomplete: bool = False
        frozen: bool = False
        retired: bool = False
        version: int = 0
        snapshot_id: str = ""
        files: set[str] = field(default_factory=set)

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tc-shared-"))
        self.stores: list[Store] = self.fresh_stores()
        self.model = {rollout_id: self.Rollout() for rollout_id in ROLLOUTS}

    def fresh_stores(self) -> list[Store]:
        return [
            RustStore(self.root),
            RustStore(self.root, cached_rollouts=1),
            RefStore(self.root),
            RefStore(self.root),
        ]

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def expect(self, call: Callable[[], Any], error: type[BaseException] | None) -> Any:
        outcome = observe(call)
        assert outcome.error is error, f"expected {error}, got {outcome}"
        return outcome.value

    def dangling(self, rollout: Rollout) -> bool:
        return any(call_id not in rollout.lines for call_id in rollout.intents)

    store_index = st.integers(0, 3)

    @rule(
        which=store_index,
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALL_IDS),
        variant=st.sampled_from((0, 0, 0, 1)),
    )
    def put(self, which: int, rollout_id: str, call_id: str, variant: int) -> None:
        model = self.model[rollout_id]
        entry = make_entry(rollout_id, call_id, variant)
        line = canonical_line(entry)
        model.files.add("lock")
        error: type[BaseException] | None = None
        if model.retired:
            error = TokenCaptureRetiredError
        elif model.frozen:
            error = TokenCaptureFrozenError
        elif call_id in model.lines and model.lines[call_id] != line:
            error = TokenCaptureConflictError
        self.expect(lambda: self.stores[which].append(entry), error)
        if error is TokenCaptureConflictError:
            model.incomplete = True
            model.version += 1
            model.files.add("state.json")  # persisted durably before raising
        elif error is None and call_id not in model.lines:
            model.lines[call_id] = line
            model.version += 1
            model.files.add("jsonl")
            if which >= 2:  # the reference's put rewrites the state index; the Rust one's not
                model.files.add("state.json")

    @rule(
        which=store_index,
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALL_IDS),
        variant=st.sampled_from((0, 0, 0, 1)),
    )
    def put_again(self, which: int, rollout_id: str, call_id: str, variant: int) -> None:
        self.put(which, rollout_id, call_id, variant)

    @rule(
        which=store_index,
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from((*CALL_IDS, "intent-only")),
    )
    def begin_call(self, which: int, rollout_id: str, call_id: str) -> None:
        model = self.model[rollout_id]
        model.files.add("lock")
        error: type[BaseException] | None = None
        if model.retired:
            error = TokenCaptureRetiredError
        elif model.frozen:
            error = TokenCaptureFrozenError
        self.expect(lambda: self.stores[which]._begin_call(rollout_id, call_id), error)
        if error is None:
            model.intents.append(call_id)
            model.files.add("intents")

    @rule(
        which=store_index,
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(("", "c1", "a\nb")),
    )
    def mark_incomplete(self, which: int, rollout_id: str, call_id: str) -> None:
        model = self.model[rollout_id]
        model.files.add("lock")
        error = TokenCaptureRetiredError if model.retired else None
        self.expect(lambda: self.stores[which]._mark_incomplete(rollout_id, call_id), error)
        if error is None:
            model.incomplete = True
            model.version += 1
            model.files |= {"incomplete", "state.json"}

    @rule(which=store_index, rollout_id=st.sampled_from(ROLLOUTS))
    def freeze(self, which: int, rollout_id: str) -> None:
        model = self.model[rollout_id]
        model.files.add("lock")
        if model.retired:
            self.expect(lambda: self.stores[which].freeze_now(rollout_id), TokenCaptureRetiredError)
            return
        snapshot: TokenCaptureSnapshot = self.expect(
            lambda: self.stores[which].freeze_now(rollout_id), None
        )
        if not model.frozen:
            model.frozen = True
            model.version += 1
            model.snapshot_id = snapshot.snapshot_id
            model.files.add("state.json")
        assert snapshot.snapshot_id == model.snapshot_id
        assert lines_of(snapshot.entries) == list(model.lines.values())
        assert snapshot.incomplete == (model.incomplete or self.dangling(model))
        assert snapshot.version == model.version

    @rule(which=store_index, rollout_id=st.sampled_from(ROLLOUTS), exact=st.booleans())
    def drop(self, which: int, rollout_id: str, exact: bool) -> None:
        model = self.model[rollout_id]
        version = model.version if exact else model.version + 1
        dropped = self.expect(
            lambda: self.stores[which]._drop(rollout_id, model.snapshot_id, version), None
        )
        assert dropped == (model.frozen and exact)
        if dropped:
            self.fence(model)

    def fence(self, model: Rollout) -> None:
        model.retired = True
        model.lines.clear()
        model.intents.clear()
        model.files -= {"jsonl", "intents", "incomplete"}
        model.files |= {"state.json", "lock"}

    @rule(
        which=store_index,
        method=st.sampled_from(("retire", "delete")),
        rollout_ids=st.lists(st.sampled_from(ROLLOUTS), max_size=2),
    )
    def remove(self, which: int, method: str, rollout_ids: list[str]) -> None:
        store = self.stores[which]
        call = store.retire_now if method == "retire" else store.delete_now
        result = self.expect(lambda: call(rollout_ids), None)
        unique = list(dict.fromkeys(rollout_ids))
        # retire reports what had records; delete what had any file besides the lock.
        kept = {"lock", "state.json"} if method == "retire" else {"lock"}
        removed = [r for r in unique if self.model[r].files - kept]
        assert result == {"removed": removed, "absent": [r for r in unique if r not in removed]}
        for rollout_id in unique:
            if method == "retire":
                self.fence(self.model[rollout_id])
            else:
                self.model[rollout_id] = self.Rollout()

    @rule(which=store_index)
    def reopen(self, which: int) -> None:
        self.stores[which] = type(self.stores[which])(self.root)

    @rule(rollout_id=st.sampled_from(ROLLOUTS), tail=st.sampled_from(TORN_TAILS))
    def crash_leaves_a_torn_line(self, rollout_id: str, tail: bytes) -> None:
        if "jsonl" in self.model[rollout_id].files:
            append_bytes(self.root / f"{rollout_id}.tokens.jsonl", tail)

    @invariant()
    def acknowledged_puts_are_stored_exactly_once(self) -> None:
        for rollout_id, model in self.model.items():
            log = self.root / f"{rollout_id}.tokens.jsonl"
            if "jsonl" not in model.files:
                assert not log.exists()
                continue
            data = log.read_bytes()
            complete = data[: data.rfind(b"\n") + 1]
            assert complete.split(b"\n")[:-1] == list(model.lines.values())

    @invariant()
    def files_and_readers_match_the_model(self) -> None:
        names = set(os.listdir(self.root))
        expected = {
            f"{rollout_id}.tokens.{suffix}"
            for rollout_id, model in self.model.items()
            for suffix in model.files
        }
        assert names == expected
        for index, (rollout_id, model) in enumerate(self.model.items()):
            store = self.stores[index % 2 * 2]  # one Rust, one reference reader
            assert lines_of(store.read_entries(rollout_id)) == list(model.lines.values())
            assert store.is_incomplete(rollout_id) == model.incomplete
            state = store.inspect(rollout_id)
            if not model.files:
                assert state is None
                continue
            assert state is not None
            assert (state["frozen"], state["retired"], state["incomplete"]) == (
                model.frozen,
                model.retired,
                model.incomplete,
            )
            assert state["snapshot_id"] == model.snapshot_id
            if not model.retired or model.frozen:
                assert state["version"] == model.version


TestDifferential = DifferentialMachine.TestCase
TestDifferential.settings = MACHINE_SETTINGS
TestSharedDirectory = SharedDirectoryMachine.TestCase
TestSharedDirectory.settings = MACHINE_SETTINGS


# Entries with arbitrary JSON read back identically ------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)


@given(
    prompt=st.lists(st.integers(0, 2**64 - 1), max_size=5),
    log_probs=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=4),
    extra=json_values,
    items=st.lists(st.dictionaries(st.text(max_size=4), json_values, max_size=2), max_size=2),
    call_id=st.text(min_size=1, max_size=6).filter(is_storable_call_id),
)
@settings(max_examples=200 if LONG else 25, deadline=None)
def test_entries_read_back_identically(
    prompt: list[int], log_probs: list[float], extra: Any, items: list[dict[str, Any]], call_id: str
) -> None:
    entry = TokenEntry(
        rollout_id="r",
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=list(range(len(log_probs))),
        generation_log_probs=log_probs,
        output_items=items,
        extra_value=extra,
    )
    line = canonical_line(entry)
    with tempfile.TemporaryDirectory() as tmp:
        stores: list[Store] = [RustStore(Path(tmp) / "rust"), RefStore(Path(tmp) / "reference")]
        read = []
        for store in stores:
            store.append(entry)
            store.append(entry)
            assert store.path_for("r").read_bytes() == line + b"\n"
            (stored,) = store.read_entries("r")
            (frozen,) = store.freeze_now("r").entries
            assert canonical_line(stored) == canonical_line(frozen) == line
            read.append(stored)
        assert read[0] == read[1] == entry


# Concurrency across implementations ----------------------------------------------------------


def test_writers_of_both_implementations_serialize_on_one_rollout(tmp_path: Path) -> None:
    stores: list[Store] = [RustStore(tmp_path), RefStore(tmp_path)] * 2
    puts = 15
    errors: list[BaseException] = []
    shared = make_entry("shared", "same-for-all")

    def writer(index: int) -> None:
        try:
            store = stores[index]
            for n in range(puts):
                call_id = f"w{index}-{n}"
                store._begin_call("shared", call_id)
                store.append(make_entry("shared", call_id))
                store.append(shared)  # every writer retries the same payload: one copy
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    expected = len(stores) * puts + 1
    for store in (RustStore(tmp_path), RefStore(tmp_path)):
        state = store.inspect("shared")
        assert state is not None and state["version"] == expected
        assert len(store.read_entries("shared")) == expected
    snapshot = RefStore(tmp_path).freeze_now("shared")
    assert len({e.model_call_id for e in snapshot.entries}) == expected
    assert not snapshot.incomplete and snapshot.version == expected + 1
    assert RustStore(tmp_path).freeze_now("shared") == snapshot


def test_deletes_racing_puts_across_implementations_never_corrupt(tmp_path: Path) -> None:
    """A delete unlinks the lock under waiters of both kinds: lock-then-verify must hold."""
    stores: list[Store] = [RustStore(tmp_path), RefStore(tmp_path)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            n = 0
            while not stop.is_set():
                stores[index].append(make_entry("x", f"w{index}-{n}"))
                n += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def deleter() -> None:
        try:
            for n in range(30):
                stores[n % 2].delete_now(["x"])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)]
    threads.append(threading.Thread(target=deleter))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    final = [make_entry("x", "final-rust"), make_entry("x", "final-ref")]
    stores[0].append(final[0])
    stores[1].append(final[1])
    for store in stores:
        entries = store.read_entries("x")
        assert {e.model_call_id for e in final} <= {e.model_call_id for e in entries}
        state = store.inspect("x")
        assert state is not None and state["version"] == len(entries)
    snapshot = stores[0].freeze_now("x")
    assert stores[1].freeze_now("x") == snapshot
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_long_rollouts_cross_rust_checkpoints_identically(tmp_path: Path) -> None:
    """The Rust store checkpoints its index every 64 entries; the reference after every put.
    A directory written by one kind, by the other, and by both in turns must read the same."""
    dirs = [tmp_path / "rust", tmp_path / "reference", tmp_path / "mixed"]
    stores: list[Store] = [RustStore(dirs[0]), RefStore(dirs[1])]
    mixed: list[Store] = [RustStore(dirs[2]), RefStore(dirs[2])]
    for n in range(140):
        entry = make_entry("long", f"call-{n}")
        for store in (*stores, mixed[(n // 9) % 2]):
            store.append(entry)
        if n % 23 == 0:
            mixed[n % 2]._mark_incomplete("long", f"lost-{n}")
            for store in stores:
                store._mark_incomplete("long", f"lost-{n}")
        if n % 10 == 0:
            states = [s.inspect("long") for s in (*stores, *mixed)]
            assert all(state == states[0] for state in states)
    logs = [(d / "long.tokens.jsonl").read_bytes() for d in dirs]
    assert logs[0] == logs[1] == logs[2]
    snapshots = [s.freeze_now("long") for s in (*stores, mixed[1])]
    assert all(
        (snap.entries, snap.incomplete, snap.version)
        == (snapshots[0].entries, snapshots[0].incomplete, snapshots[0].version)
        for snap in snapshots
    )
    assert mixed[0].freeze_now("long") == snapshots[2]


# Gaps of the Rust store found by the differential runs (fixed; kept as regressions) ----------


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(RefStore, id="reference"),
        pytest.param(RustStore, id="rust"),
    ],
)
def test_retire_fences_the_version_readers_saw(impl: type[Store], tmp_path: Path) -> None:
    """Gap 1: `retire` fences the *stored* state without folding the log tail, so the fence's
    version (and any flag only the tail carries) depends on when the Rust store last
    checkpointed its index. `drop` folds first; retire is "drop without the snapshot check"."""
    store = impl(tmp_path)
    for call_id in ("a", "b", "c"):
        store.append(make_entry("r", call_id))
    before = store.inspect("r")
    assert before is not None and before["version"] == 3
    store.retire_now(["r"])
    after = store.inspect("r")
    assert after is not None and after["retired"]
    assert after["version"] == before["version"]


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(RefStore, id="reference"),
        pytest.param(RustStore, id="rust"),
    ],
)
def test_drop_with_a_version_beyond_u64_is_false(impl: type[Store], tmp_path: Path) -> None:
    """Gap 2: `drop` answers False for any version that is not the current one, but the Rust
    store raises OverflowError for an int above 2**64-1 (negative ones already return False)."""
    store = impl(tmp_path)
    store.append(make_entry("r", "a"))
    snapshot = store.freeze_now("r")
    assert store._drop("r", snapshot.snapshot_id, 2**64) is False
    assert store._drop("r", snapshot.snapshot_id, -1) is False
    assert store._drop("r", snapshot.snapshot_id, snapshot.version) is True


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(RefStore, id="reference"),
        pytest.param(RustStore, id="rust"),
    ],
)
@pytest.mark.parametrize(
    "bad_line",
    [
        pytest.param(b'{"model_call_id":"x","n":01}\n', id="bad-number"),
        pytest.param(b'{"model_call_id":"x","n":[1,]}\n', id="trailing-comma"),
        pytest.param(b'{"model_call_id":"x","s":"\xff"}\n', id="invalid-utf8"),
    ],
)
def test_a_complete_line_that_is_not_json_is_corruption(
    impl: type[Store], bad_line: bytes, tmp_path: Path
) -> None:
    """Gap 3: the Rust store's structural scan accepts a line that is not JSON (number and
    comma syntax, UTF-8 inside strings are left to the reader). A put then folds it and
    succeeds, read_entries and freeze raise pydantic's ValidationError instead of
    TokenCaptureCorruptionError naming the file and offset, and freeze has already persisted
    frozen=True (with a snapshot id) before failing, leaving a frozen, unreadable rollout."""
    store = impl(tmp_path)
    store.append(make_entry("r", "a"))
    offset = store.path_for("r").stat().st_size
    append_bytes(store.path_for("r"), bad_line)
    where = rf"r\.tokens\.jsonl.*\(byte offset {offset}\)"
    with pytest.raises(TokenCaptureCorruptionError, match=where):
        store.append(make_entry("r", "b"))
    with pytest.raises(TokenCaptureCorruptionError, match=where):
        store.read_entries("r")
    with pytest.raises(TokenCaptureCorruptionError, match=where):
        store.freeze_now("r")
    with pytest.raises(TokenCaptureCorruptionError, match=where):
        store.inspect("r")
    state = store.state_path_for("r")  # the Rust store writes none for a first put
    assert not state.exists() or not orjson.loads(state.read_bytes())["frozen"]


@pytest.mark.parametrize("impl", [RefStore, RustStore], ids=["reference", "rust"])
def test_a_line_naming_two_call_ids_is_corruption(impl: type[Store], tmp_path: Path) -> None:
    store = impl(tmp_path)
    store.append(make_entry("r", "a"))
    append_bytes(store.path_for("r"), b'{"model_call_id":"x","model_call_id":"y"}\n')
    with pytest.raises(TokenCaptureCorruptionError, match="twice"):
        store.freeze_now("r")
    # A nested object may carry its own model_call_id key: that is no duplicate.
    other = impl(tmp_path / "nested")
    nested = make_entry("r", "n").model_copy(
        update={"output_items": [{"model_call_id": "inner"}, {"model_call_id": "again"}]}
    )
    other.append(nested)
    assert other.freeze_now("r").entries == (nested,)
