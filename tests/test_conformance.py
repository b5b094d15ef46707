"""The conformance suite: real implementations pass, each broken double fails the right check."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from conformance_doubles import (
    BROKEN,
    BROKEN_LEDGERS,
    Backend,
    BareRuntimeErrorWhenFrozen,
    KeywordOnlyDrop,
    LedgerBackend,
    LedgerWithoutRemoval,
    MemoryLedger,
    ResolvesAcrossRollouts,
    ResolvesByFingerprintOnly,
    StoreClient,
    WithoutRemoval,
    backend_for,
    double_client,
)
from tokencapture.conformance import (
    CHECKS,
    ConformanceError,
    main,
    pytest_checks,
    run_check,
    run_conformance,
    run_conformance_sync,
)
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.protocols import (
    LineageResolution,
    RolloutRemovalPayload,
    TokenCaptureSnapshot,
)
from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore

TESTS = Path(__file__).resolve().parent

PROCESS_CHECKS = ["visible_across_processes"]
# What a run without a process_factory passes (other suites import these lists).
STORE_CHECKS = [
    name
    for name in CHECKS
    if not name.startswith(("lineage_", "ledger_")) and name not in PROCESS_CHECKS
]
LINEAGE_CHECKS = [name for name in CHECKS if name.startswith("lineage_")]
LEDGER_CHECKS = [name for name in CHECKS if name.startswith("ledger_")]


def test_check_names_are_stable() -> None:
    assert CHECKS == (
        "put_then_freeze",
        "idempotent_reput",
        "conflicting_reput_fails_closed",
        "freeze_idempotent",
        "conditional_drop",
        "write_after_freeze",
        "mark_incomplete_durable",
        "retire_fences",
        "delete_allows_reuse",
        "batch_validation",
        "dangling_intent_masks",
        "visible_across_processes",
        "lineage_visible_to_existing_and_fresh",
        "lineage_rewritten_context_unresolved",
        "lineage_root_without_history",
        "ledger_round_trip",
        "ledger_replay_and_conflict",
        "ledger_failure_rows",
        "ledger_fence_after_retire",
        "ledger_reuse_after_delete",
    )


# --- Real implementations pass ---------------------------------------------------------------


async def test_rust_store_passes(tmp_path: Path) -> None:
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        process_factory=functools.partial(TokenCaptureStore, tmp_path),
    )
    assert passed == [name for name in CHECKS if not name.startswith(("lineage_", "ledger_"))]


async def test_checks_without_a_process_factory_are_skipped_with_the_reason(
    tmp_path: Path,
) -> None:
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path), lambda: TokenCaptureStore(tmp_path)
    )
    assert passed == STORE_CHECKS
    assert "no process_factory was given" in passed.skipped["visible_across_processes"]
    assert "no lineage factory" in passed.skipped["lineage_root_without_history"]


async def test_reference_store_passes(tmp_path: Path) -> None:
    reference = pytest.importorskip("tokencapture.reference")
    passed = await run_conformance(
        lambda: reference.TokenCaptureStore(tmp_path),
        lambda: reference.TokenCaptureStore(tmp_path),
    )
    assert passed == STORE_CHECKS


@pytest.mark.parametrize("writer", ["rust", "reference"])
async def test_stores_interoperate_on_one_directory(tmp_path: Path, writer: str) -> None:
    """One implementation writes, the other reads: the on-disk format is the contract."""
    reference = pytest.importorskip("tokencapture.reference")
    implementations: dict[str, Any] = {
        "rust": TokenCaptureStore,
        "reference": reference.TokenCaptureStore,
    }
    reader = "reference" if writer == "rust" else "rust"
    passed = await run_conformance(
        lambda: implementations[writer](tmp_path), lambda: implementations[reader](tmp_path)
    )
    assert passed == STORE_CHECKS


# --- Lineage resolvers pass ------------------------------------------------------------------


async def test_file_lineage_passes(tmp_path: Path) -> None:
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        lambda: FileLineageStore(tmp_path),
    )
    assert passed == STORE_CHECKS + LINEAGE_CHECKS


async def test_reference_file_lineage_passes(tmp_path: Path) -> None:
    reference = pytest.importorskip("tokencapture.reference.lineage")
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        lambda: reference.FileLineageStore(tmp_path),
    )
    assert passed == STORE_CHECKS + LINEAGE_CHECKS


class _IndexingSink:
    """A serving-path sink for a single-process resolver: every entry the store committed is
    also indexed by the shared `InMemoryLineageStore`, before `put` returns."""

    def __init__(self, store: TokenCaptureStore, index: InMemoryLineageStore) -> None:
        self._store = store
        self._index = index

    async def put(self, entry: TokenEntry) -> None:
        await self._store.put(entry)
        await self._index.put(entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._store.begin_call(rollout_id, model_call_id)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self._store.mark_incomplete(rollout_id, model_call_id)

    async def close(self) -> None:
        await self._store.close()


class _SharedIndexView:
    """One worker's resolver client over the process-wide index; closing it keeps the index
    (`InMemoryLineageStore.close` forgets everything, which only its owner may do)."""

    def __init__(self, index: InMemoryLineageStore) -> None:
        self._index = index

    async def resolve(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> LineageResolution:
        return await self._index.resolve(rollout_id, request_items)

    def is_process_shared(self) -> bool:
        return self._index.is_process_shared()

    async def close(self) -> None:
        return None


class _ForgettingSource:
    """The trainer's source: whatever it drops, retires or deletes, the index forgets too, so
    retired rollouts resolve nothing and a reused id starts empty."""

    def __init__(self, store: TokenCaptureStore, index: InMemoryLineageStore) -> None:
        self._store = store
        self._index = index

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return await self._store.freeze(rollout_id)

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        dropped = await self._store.drop(rollout_id, snapshot_id, version)
        if dropped:
            await self._index.delete([rollout_id])
        return dropped

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        payload = await self._store.retire(rollout_ids)
        await self._index.delete(rollout_ids)
        return payload

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        payload = await self._store.delete(rollout_ids)
        await self._index.delete(rollout_ids)
        return payload

    async def close(self) -> None:
        await self._store.close()


async def test_in_memory_lineage_passes_all_but_the_delta_chain(tmp_path: Path) -> None:
    """The in-memory resolver refuses delta entries at put, as NeMo Gym 0.7.0's does (it keeps
    no token log to rebuild a chain from), so the one lineage check that stores a delta fails
    with NeMo Gym's error; every other check passes."""
    index = InMemoryLineageStore()
    try:
        outcomes = {}
        for check in CHECKS:
            try:
                outcomes[check] = await run_check(
                    check,
                    lambda: _IndexingSink(TokenCaptureStore(tmp_path), index),
                    lambda: _ForgettingSource(TokenCaptureStore(tmp_path), index),
                    lambda: _SharedIndexView(index),
                )
            except ConformanceError as error:
                outcomes[check] = str(error)
    finally:
        await index.close()
    delta_check = "lineage_visible_to_existing_and_fresh"
    assert outcomes.pop(delta_check) == (
        f"conformance check {delta_check!r} failed: the implementation raised ValueError: "
        "delta records require a durable-log-backed lineage store"
    )
    passed = [check for check, outcome in outcomes.items() if outcome is True]
    assert passed == [check for check in STORE_CHECKS + LINEAGE_CHECKS if check != delta_check]


async def test_file_ledger_passes(tmp_path: Path) -> None:
    ledger = pytest.importorskip("tokencapture.ledger")
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        ledger_factory=lambda: ledger.FileCaptureLedger(tmp_path),
    )
    assert passed == STORE_CHECKS + LEDGER_CHECKS


# --- Broken doubles fail the expected check --------------------------------------------------


@pytest.mark.parametrize("name", sorted(BROKEN))
async def test_broken_double_fails_its_check(tmp_path: Path, name: str) -> None:
    make, expected = BROKEN[name]
    backend = Backend(str(tmp_path))
    with pytest.raises(ConformanceError) as info:
        await run_conformance(
            lambda: make(backend),
            lambda: make(backend),
            process_factory=functools.partial(double_client, name, str(tmp_path)),
        )
    assert info.value.check == expected, str(info.value)
    assert isinstance(info.value, AssertionError)
    assert backend.made > 0
    assert backend.closed == backend.made, "every client made must be closed, even on failure"


async def test_ledger_checks_pass_on_a_correct_ledger(tmp_path: Path) -> None:
    backend = LedgerBackend()
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        ledger_factory=lambda: MemoryLedger(backend),
    )
    assert passed == STORE_CHECKS + LEDGER_CHECKS
    assert backend.closed == backend.made


@pytest.mark.parametrize("name", sorted(BROKEN_LEDGERS))
async def test_broken_ledger_fails_its_check(tmp_path: Path, name: str) -> None:
    make, expected = BROKEN_LEDGERS[name]
    backend = LedgerBackend()
    with pytest.raises(ConformanceError) as info:
        for check in LEDGER_CHECKS:
            await run_check(
                check,
                lambda: TokenCaptureStore(tmp_path),
                lambda: TokenCaptureStore(tmp_path),
                ledger_factory=lambda: make(backend),
            )
    assert info.value.check == expected, str(info.value)
    assert backend.closed == backend.made


async def test_faithful_double_passes_and_closes_every_client(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    passed = await run_conformance(
        lambda: StoreClient(backend),
        lambda: StoreClient(backend),
        process_factory=functools.partial(double_client, "faithful", str(tmp_path)),
    )
    assert passed == STORE_CHECKS + PROCESS_CHECKS
    assert backend.closed == backend.made > len(STORE_CHECKS)


async def test_resolver_matching_by_fingerprint_alone_fails(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    with pytest.raises(ConformanceError) as info:
        await run_conformance(
            lambda: StoreClient(backend),
            lambda: StoreClient(backend),
            lambda: ResolvesByFingerprintOnly(FileLineageStore(tmp_path), backend),
        )
    assert info.value.check == "lineage_rewritten_context_unresolved", str(info.value)


async def test_resolver_resolving_in_another_rollout_fails(tmp_path: Path) -> None:
    with pytest.raises(ConformanceError) as info:
        await run_conformance(
            lambda: TokenCaptureStore(tmp_path),
            lambda: TokenCaptureStore(tmp_path),
            lambda: ResolvesAcrossRollouts(str(tmp_path)),
        )
    assert info.value.check == "lineage_rewritten_context_unresolved", str(info.value)
    assert "asked in" in info.value.detail


async def test_keyword_only_drop_passes(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    passed = await run_conformance(
        lambda: KeywordOnlyDrop(backend), lambda: KeywordOnlyDrop(backend)
    )
    assert passed == STORE_CHECKS


async def test_optional_retire_and_delete_are_skipped_when_absent(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    passed = await run_conformance(lambda: WithoutRemoval(backend), lambda: WithoutRemoval(backend))
    removal = ["retire_fences", "delete_allows_reuse", "batch_validation"]
    assert passed == [name for name in STORE_CHECKS if name not in removal]
    for name in removal:
        assert "optional" in passed.skipped[name]
    ledger = LedgerBackend()
    passed = await run_conformance(
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        ledger_factory=lambda: LedgerWithoutRemoval(ledger),
    )
    assert [name for name in passed if name.startswith("ledger_")] == [
        "ledger_round_trip",
        "ledger_replay_and_conflict",
        "ledger_failure_rows",
    ]
    assert "no retire(rollout_ids)" in passed.skipped["ledger_fence_after_retire"]


async def test_a_bare_runtime_error_after_freeze_is_named(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    with pytest.raises(ConformanceError) as info:
        await run_check(
            "write_after_freeze",
            lambda: BareRuntimeErrorWhenFrozen(backend),
            lambda: StoreClient(backend),
        )
    assert "raised RuntimeError: " in info.value.detail
    assert "expected TokenCaptureFrozenError" in info.value.detail
    assert "NeMo Gym 0.7.0" in info.value.detail


def test_a_lambda_process_factory_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConformanceError) as info:
        run_conformance_sync(
            lambda: TokenCaptureStore(tmp_path),
            lambda: TokenCaptureStore(tmp_path),
            process_factory=lambda: TokenCaptureStore(tmp_path),
        )
    assert info.value.check == "visible_across_processes"
    assert "process_factory must be picklable" in info.value.detail
    assert info.value.__cause__ is not None


# --- Runner behaviour ------------------------------------------------------------------------


class _ExplodingFreeze(StoreClient):
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        raise RuntimeError("backend exploded")


class _ExplodingClose(StoreClient):
    async def close(self) -> None:
        await super().close()
        raise OSError("close failed")


class _NoBeginCall:
    """A sink without the optional begin_call extension."""

    def __init__(self, store: TokenCaptureStore) -> None:
        self.put = store.put
        self.mark_incomplete = store.mark_incomplete
        self.close = store.close


async def test_unexpected_exception_fails_the_check_with_the_cause(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    with pytest.raises(ConformanceError) as info:
        await run_conformance(lambda: StoreClient(backend), lambda: _ExplodingFreeze(backend))
    error = info.value
    assert error.check == "put_then_freeze"
    assert "RuntimeError" in error.detail
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error).startswith("conformance check 'put_then_freeze' failed: ")
    assert backend.closed == backend.made


async def test_close_failure_fails_the_check(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path))
    with pytest.raises(ConformanceError) as info:
        await run_conformance(lambda: _ExplodingClose(backend), lambda: StoreClient(backend))
    assert info.value.check == "put_then_freeze"
    assert "close() raised OSError" in info.value.detail
    assert backend.closed == backend.made


async def test_factory_failure_fails_the_check(tmp_path: Path) -> None:
    def broken_factory() -> TokenCaptureStore:
        raise ConnectionError("no server")

    with pytest.raises(ConformanceError) as info:
        await run_conformance(broken_factory, lambda: TokenCaptureStore(tmp_path))
    assert info.value.check == "put_then_freeze"
    assert "sink factory raised ConnectionError" in info.value.detail
    assert isinstance(info.value.__cause__, ConnectionError)


async def test_async_factories_and_optional_begin_call(tmp_path: Path) -> None:
    async def sink() -> _NoBeginCall:
        return _NoBeginCall(TokenCaptureStore(tmp_path))

    async def source() -> TokenCaptureStore:
        return TokenCaptureStore(tmp_path)

    passed = await run_conformance(sink, source)
    assert passed == [name for name in STORE_CHECKS if name != "dangling_intent_masks"]


async def test_rollout_ids_derive_from_the_prefix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rollout_id"):
        await run_conformance(
            lambda: TokenCaptureStore(tmp_path),
            lambda: TokenCaptureStore(tmp_path),
            rollout_id="bad/prefix",
        )
    assert await run_check(
        "put_then_freeze",
        lambda: TokenCaptureStore(tmp_path),
        lambda: TokenCaptureStore(tmp_path),
        rollout_id="my-run.1",
    )
    names = [path.name for path in tmp_path.iterdir()]
    assert names
    assert all(name.startswith("my-run.1-put_then_freeze-") for name in names), names


async def test_run_check_reports_skips_and_unknown_names(tmp_path: Path) -> None:
    def factory() -> TokenCaptureStore:
        return TokenCaptureStore(tmp_path)

    assert await run_check("conditional_drop", factory, factory) is True
    assert await run_check("lineage_root_without_history", factory, factory) is False
    assert await run_check("ledger_round_trip", factory, factory) is False
    with pytest.raises(ValueError, match="unknown conformance checks"):
        await run_check("no_such_check", factory, factory)


def test_run_conformance_sync(tmp_path: Path) -> None:
    passed = run_conformance_sync(
        lambda: TokenCaptureStore(tmp_path), lambda: TokenCaptureStore(tmp_path)
    )
    assert passed == STORE_CHECKS


# --- The pytest entry point ------------------------------------------------------------------

# What a framework author writes: one line, one test case per check (a factory taking one
# argument receives the test's tmp_path).
test_pytest_entry_point = pytest_checks(
    TokenCaptureStore, lineage_factory=FileLineageStore, process_factory=TokenCaptureStore
)


def test_pytest_entry_point_fails_and_skips(tmp_path: Path) -> None:
    def lossy(root: str) -> StoreClient:
        return BROKEN["loses_put"][0](backend_for(root))

    generated = pytest_checks(lossy, TokenCaptureStore)
    with pytest.raises(ConformanceError) as info:
        generated("put_then_freeze", tmp_path)
    assert info.value.check == "put_then_freeze"
    with pytest.raises(pytest.skip.Exception):
        generated("ledger_round_trip", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="no process_factory"):
        generated("visible_across_processes", tmp_path)


def test_pytest_entry_point_refuses_factories_with_two_parameters(tmp_path: Path) -> None:
    def two(root: str, other: str) -> TokenCaptureStore:
        return TokenCaptureStore(root)

    generated = pytest_checks(two)
    with pytest.raises(TypeError, match="one directory"):
        generated("put_then_freeze", tmp_path)


# --- The command line ------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "tokencapture.conformance", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _lines(output: str, status: str) -> list[str]:
    return [line.split()[1].rstrip(":") for line in output.splitlines() if line.startswith(status)]


def test_cli_passes_on_our_store(tmp_path: Path) -> None:
    pytest.importorskip("tokencapture.ledger")
    result = _cli(
        "tokencapture.store:TokenCaptureStore",
        "--lineage",
        "tokencapture.lineage:FileLineageStore",
        "--ledger",
        "tokencapture.ledger:FileCaptureLedger",
        "--process",
        "tokencapture.store:TokenCaptureStore",
        "--dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _lines(result.stdout, "PASS") == list(CHECKS)
    assert _lines(result.stdout, "FAIL") == []
    assert _lines(result.stdout, "SKIP") == []
    assert f"{len(CHECKS)} passed, 0 failed, 0 skipped" in result.stdout
    # `python -m` of a module the package imports eagerly would warn (runpy RuntimeWarning).
    assert "RuntimeWarning" not in result.stderr
    assert any(tmp_path.iterdir()), "--dir must be the directory handed to the factory"


def test_cli_reports_failures_and_runs_every_check() -> None:
    result = _cli(
        "conformance_doubles:lossy_store", "--source", "tokencapture.store:TokenCaptureStore"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    failed = _lines(result.stdout, "FAIL")
    assert "put_then_freeze" in failed
    assert len(_lines(result.stdout, "PASS")) + len(failed) == len(STORE_CHECKS)
    assert _lines(result.stdout, "SKIP")[0] == "visible_across_processes"
    assert "no process_factory was given" in result.stdout


@pytest.mark.parametrize(
    "args",
    [["no_such_module_xyz:factory"], ["tokencapture.store"], ["tokencapture.store:Nope"]],
)
def test_cli_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert "error:" in capsys.readouterr().err
