"""Every class that presents the capture-ledger surface presents all of it (issue 22, item 1).

A class presents the surface when it has any of the ledger's own methods (`record`,
`record_failure`, `manifest`, `has_rows`); it must then have the whole seed `CaptureLedger`
protocol, `retire` and `delete` included, and `isinstance(x, CaptureLedger)` must be true
exactly for those classes. Each of them passes the conformance suite's ledger checks with the
same semantics as `FileCaptureLedger` (tests/test_ledger.py runs its whole suite on
`FileLineageStore` too; the in-memory store's fence is checked here).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.test_conformance import LEDGER_CHECKS, STORE_CHECKS
from tests.test_ledger import make_commit

import tokencapture
from tokencapture.conformance import run_conformance
from tokencapture.ledger import CaptureLedgerConflictError, FileCaptureLedger
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore, stamp_continuation
from tokencapture.protocols import CaptureLedger, LineageResolver, RolloutRetiredError
from tokencapture.records import ParentResolutionStatus
from tokencapture.reference.lineage import FileLineageStore as ReferenceLineageStore
from tokencapture.staging.records import UNCOMMITTED_CALL_REASON
from tokencapture.store import TokenCaptureStore

# The seed's `CaptureLedger` (docs/compat-protocols.md): LineageResolver's methods and its own.
LEDGER_ONLY = ("record", "record_failure", "manifest", "has_rows", "retire", "delete")
PROTOCOL = ("resolve", "is_process_shared", "close", *LEDGER_ONLY)


def package_classes() -> Iterator[type]:
    """Every public class defined in a public module of the package (the PostgreSQL modules
    included; the native `_core` and the other private modules hold no surface)."""
    seen: set[type] = set()
    for info in pkgutil.walk_packages(tokencapture.__path__, "tokencapture."):
        if info.name.endswith("__main__") or any(
            part.startswith("_") for part in info.name.split(".")
        ):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            public = cls.__module__ == module.__name__ and not cls.__name__.startswith("_")
            if public and cls not in seen:
                seen.add(cls)
                yield cls


def presents_the_ledger_surface(cls: type) -> bool:
    return any(callable(getattr(cls, name, None)) for name in LEDGER_ONLY[:4])


def test_the_protocol_is_the_seeds() -> None:
    members = {name for name in vars(CaptureLedger) if not name.startswith("_")}
    members |= {name for name in vars(LineageResolver) if not name.startswith("_")}
    assert members == set(PROTOCOL)


def test_every_class_presenting_the_ledger_surface_has_all_of_it() -> None:
    presenting = {
        cls.__qualname__: cls for cls in package_classes() if presents_the_ledger_surface(cls)
    }
    # The protocol itself is the only non-implementation among them.
    presenting.pop("CaptureLedger")
    assert set(presenting) >= {
        "FileCaptureLedger",
        "FileLineageStore",
        "InMemoryLineageStore",
        "PostgresCaptureLedger",
    }
    incomplete = {
        name: [member for member in PROTOCOL if not callable(getattr(cls, member, None))]
        for name, cls in presenting.items()
    }
    assert {name: missing for name, missing in incomplete.items() if missing} == {}


def _instances(tmp_path: Path) -> dict[str, Any]:
    from tokencapture.postgres import (
        PostgresCaptureLedger,
        PostgresLineageStore,
        PostgresTokenCaptureStore,
    )

    dsn = "postgresql://nobody@127.0.0.1:1/none"  # never connected to: clients connect lazily
    return {
        "FileCaptureLedger": FileCaptureLedger(tmp_path),
        "FileLineageStore": FileLineageStore(tmp_path),
        "InMemoryLineageStore": InMemoryLineageStore(),
        "PostgresCaptureLedger": PostgresCaptureLedger(dsn),
        "TokenCaptureStore": TokenCaptureStore(tmp_path),
        "ReferenceLineageStore": ReferenceLineageStore(tmp_path),
        "PostgresLineageStore": PostgresLineageStore(dsn),
        "PostgresTokenCaptureStore": PostgresTokenCaptureStore(dsn),
    }


def test_isinstance_capture_ledger_is_true_exactly_for_the_complete_ones(tmp_path: Path) -> None:
    ledgers = {name for name, obj in _instances(tmp_path).items() if isinstance(obj, CaptureLedger)}
    assert ledgers == {
        "FileCaptureLedger",
        "FileLineageStore",
        "InMemoryLineageStore",
        "PostgresCaptureLedger",
    }
    for name, obj in _instances(tmp_path).items():
        assert isinstance(obj, CaptureLedger) is presents_the_ledger_surface(type(obj)), name


# ---- the ledger checks on every class that presents the surface ---------------------------


def _ledger_factories(tmp_path: Path) -> dict[str, Callable[[], Any]]:
    index = InMemoryLineageStore()  # one process-wide ledger: every client is the same one
    return {
        "FileCaptureLedger": lambda: FileCaptureLedger(tmp_path),
        "FileLineageStore": lambda: FileLineageStore(tmp_path),
        "InMemoryLineageStore": lambda: index,
    }


@pytest.mark.parametrize(
    "surface", ["FileCaptureLedger", "FileLineageStore", "InMemoryLineageStore"]
)
async def test_passes_the_ledger_conformance_checks(tmp_path: Path, surface: str) -> None:
    factory = _ledger_factories(tmp_path)[surface]
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        ledger_factory=factory,
    )
    assert passed == STORE_CHECKS + LEDGER_CHECKS


# ---- the in-memory ledger's fence, against FileCaptureLedger's -----------------------------


async def _fence_story(ledger: Any) -> list[object]:
    """One sequence of ledger calls; each step's answer (or its exception's type and words)."""
    answers: list[object] = []

    async def step(call: Callable[[], Any]) -> None:
        try:
            result = await call()
        except Exception as exc:
            answers.append((type(exc).__name__, str(exc)))
        else:
            if hasattr(result, "status"):
                result = (result.status, result.reason, getattr(result.match, "model_call_id", 0))
            answers.append(result)

    first, second = make_commit("c1", "r1"), make_commit("c2", "r1", parent="c1", prev_len=5)
    follow_up = [*first.request_items, *first.response_items, {"role": "user", "content": "go"}]
    await step(lambda: ledger.record(first))
    await step(lambda: ledger.record_failure("r1", "c9", UNCOMMITTED_CALL_REASON))
    await step(lambda: ledger.resolve("r1", follow_up))
    await step(lambda: ledger.retire(["r1", "r2"]))
    await step(lambda: ledger.retire(["r1"]))
    await step(lambda: ledger.record(second))  # discarded
    await step(lambda: ledger.record_failure("r1", "c3", UNCOMMITTED_CALL_REASON))  # discarded
    await step(lambda: ledger.manifest("r1"))
    await step(lambda: ledger.has_rows("r1"))
    await step(lambda: ledger.has_rows("r2"))
    await step(lambda: ledger.resolve("r1", follow_up))
    await step(lambda: ledger.resolve("r1", first.request_items[:1]))
    await step(lambda: ledger.delete(["r1", "r2", "r3"]))
    await step(lambda: ledger.delete(["r1"]))
    await step(lambda: ledger.has_rows("r1"))
    await step(lambda: ledger.record(second))
    await step(lambda: ledger.record(make_commit("c2", "r1", parent="c1", prev_len=5, delta_len=9)))
    await step(lambda: ledger.manifest("r1"))
    return answers


async def test_the_in_memory_fence_answers_as_the_file_ledgers(tmp_path: Path) -> None:
    expected = await _fence_story(FileCaptureLedger(tmp_path / "file"))
    assert await _fence_story(InMemoryLineageStore()) == expected
    assert await _fence_story(FileLineageStore(tmp_path / "lineage")) == expected
    # The story says what it should: the fence, then a fresh start.
    assert expected[3] == {"removed": ["r1"], "absent": ["r2"]}
    assert expected[4] == {"removed": [], "absent": ["r1"]}
    assert expected[7][0] == RolloutRetiredError.__name__
    assert expected[9][0] == RolloutRetiredError.__name__
    assert expected[10] == (ParentResolutionStatus.UNRESOLVED, "no_match", 0)
    assert expected[11] == (ParentResolutionStatus.ROOT, "", 0)
    assert expected[12] == {"removed": ["r1", "r2"], "absent": ["r3"]}
    assert expected[14] is False
    assert expected[16][0] == CaptureLedgerConflictError.__name__


async def test_the_in_memory_fence_discards_puts_and_resolves_nothing() -> None:
    index = InMemoryLineageStore()
    request = [{"role": "user", "content": "hi"}]
    output = [{"type": "message", "role": "assistant", "content": "ok"}]
    entry = stamp_continuation(make_entry("r1", 1, output_items=output), request)
    follow_up = [*request, *output, {"role": "user", "content": "more"}]
    await index.put(entry)
    assert (await index.resolve("r1", follow_up)).status is ParentResolutionStatus.RESOLVED
    assert index.retire_now(["r1"]) == {"removed": ["r1"], "absent": []}
    assert (await index.resolve("r1", follow_up)).status is ParentResolutionStatus.UNRESOLVED
    assert index.put_now(entry) is False  # discarded by the fence
    assert index.stored_tokens() == 0
    assert index.delete_now(["r1"]) == {"removed": ["r1"], "absent": []}
    assert index.put_now(entry) is True
    assert (await index.resolve("r1", follow_up)).status is ParentResolutionStatus.RESOLVED


async def test_a_retired_ledger_hides_token_entries_from_the_file_resolver(tmp_path: Path) -> None:
    """`FileLineageStore.retire` fences the ledger; a parent found among the token entries of a
    fenced rollout is not answered either (a retired rollout resolves nothing), until delete."""
    store = TokenCaptureStore(tmp_path)
    request = [{"role": "user", "content": "hi"}]
    entry = make_entry(
        "r1", 1, output_items=[{"type": "message", "role": "assistant", "content": "ok"}]
    )
    stamp_continuation(entry, request)
    store.append(entry)
    follow_up = [*request, *entry.output_items, {"role": "user", "content": "more"}]
    resolver = FileLineageStore(tmp_path)
    assert (await resolver.resolve("r1", follow_up)).status is ParentResolutionStatus.RESOLVED
    assert await resolver.retire(["r1"]) == {"removed": [], "absent": ["r1"]}  # no ledger rows
    fenced = resolver.resolve_now("r1", follow_up)
    assert (fenced.status, fenced.reason) == (ParentResolutionStatus.UNRESOLVED, "no_match")
    assert (await resolver.resolve("r1", follow_up)).status is ParentResolutionStatus.UNRESOLVED
    assert store.read_entries("r1") == [entry]  # the token store's files are not touched
    assert await resolver.delete(["r1"]) == {"removed": ["r1"], "absent": []}
    assert (await resolver.resolve("r1", follow_up)).status is ParentResolutionStatus.RESOLVED


def test_async_retire_and_delete_check_their_arguments_when_called(tmp_path: Path) -> None:
    for surface in (FileLineageStore(tmp_path), InMemoryLineageStore()):
        for method in (surface.retire, surface.delete):
            with pytest.raises(TypeError):
                method("r1")  # a bare string, refused before any coroutine exists
            with pytest.raises(ValueError, match="rollout_id"):
                method(["ok", "no spaces"])
