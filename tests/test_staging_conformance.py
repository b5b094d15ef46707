"""The staging conformance checks: real stores pass, each broken double fails its own check."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from tests.nemo_oracle import import_nemo

import staging_doubles
from staging_doubles import BROKEN, MemoryStagingStore

nemo_records = import_nemo("staging.records")

from tokencapture import FileStagingStore  # noqa: E402
from tokencapture.conformance import (  # noqa: E402
    STAGING_CHECKS,
    StagingConformanceError,
    pytest_staging_checks,
    run_staging_check,
    run_staging_conformance,
)
from tokencapture.staging import records as ours  # noqa: E402

PROCESS_CHECKS = ("retire_fences_other_processes", "acknowledged_survives_sigkill")


def test_check_names_are_stable() -> None:
    assert STAGING_CHECKS == (
        "stage_visible_before_return",
        "fetch_in_order",
        "stage_idempotent",
        "stage_conflict_refused",
        "invalid_record_refused",
        "attachment_rule",
        "attachments_round_trip",
        "extras_round_trip",
        "concurrent_stages",
        "retire_fences",
        "retire_fences_other_processes",
        "acknowledged_survives_sigkill",
    )


@pytest.mark.parametrize("models", [nemo_records, ours], ids=["nemo-models", "our-models"])
def test_file_staging_store_passes_every_check(tmp_path: Path, models: Any) -> None:
    factory = functools.partial(FileStagingStore, tmp_path)
    passed = run_staging_conformance(factory, process_factory=factory, records_module=models)
    assert passed == list(STAGING_CHECKS)


# Each check as its own test case, the way a framework would run them.
test_file_store_check = pytest_staging_checks(FileStagingStore, process_factory=FileStagingStore)


def test_the_in_memory_double_passes_all_but_the_process_checks(tmp_path: Path) -> None:
    passed = run_staging_conformance(functools.partial(MemoryStagingStore, str(tmp_path)))
    assert passed == [name for name in STAGING_CHECKS if name not in PROCESS_CHECKS]
    # The checks that did not run are listed with the reason, not silently left out.
    assert set(passed.skipped) == set(PROCESS_CHECKS)
    assert all("no process_factory" in reason for reason in passed.skipped.values())


@pytest.mark.parametrize(
    ("double", "check"), list(BROKEN.items()), ids=lambda v: getattr(v, "__name__", v)
)
def test_each_broken_double_fails_its_check(
    tmp_path: Path, double: type, check: str, capfd: pytest.CaptureFixture[str]
) -> None:
    factory = functools.partial(double, str(tmp_path))
    with pytest.raises(StagingConformanceError) as caught:
        run_staging_conformance(factory)
    assert caught.value.check == check, str(caught.value)
    assert capfd.readouterr().err == "", "a failing check must not print (thread tracebacks)"
    # ...and the correct double passes that very check.
    assert run_staging_check(check, functools.partial(MemoryStagingStore, str(tmp_path) + "ok"))


def test_unknown_check_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown staging checks"):
        run_staging_check("nope", lambda: None)


# --- How failures are reported ----------------------------------------------------------------


def _fails(check: str, factory: Any, **kwargs: Any) -> StagingConformanceError:
    with pytest.raises(StagingConformanceError) as caught:
        run_staging_check(check, factory, **kwargs)
    assert caught.value.check == check, str(caught.value)
    return caught.value


def test_concurrent_failures_name_the_real_problem(tmp_path: Path) -> None:
    raised = _fails(
        "concurrent_stages", functools.partial(staging_doubles.RaisesWhenConcurrent, str(tmp_path))
    )
    assert "stage raised RuntimeError: connection is busy" in raised.detail
    assert isinstance(raised.__cause__, RuntimeError)
    none = _fails(
        "concurrent_stages",
        functools.partial(staging_doubles.ReturnsNoneWhenConcurrent, str(tmp_path) + "n"),
    )
    assert "stage returned None, expected a StageResult" in none.detail
    assert "KeyError" not in none.detail


def test_unverifiable_attachments_are_skipped_not_passed(tmp_path: Path) -> None:
    results = run_staging_conformance(
        functools.partial(staging_doubles.AttachmentsWithoutReader, str(tmp_path))
    )
    assert "attachments_round_trip" not in results
    assert "unverified" in results.skipped["attachments_round_trip"]
    assert "attachment_rule" in results


def test_a_refused_call_leaves_no_record_behind(tmp_path: Path) -> None:
    """A sink that keeps the record of a call it refused for an unstorable attachment."""

    class KeepsRefusedRecord(MemoryStagingStore):
        def stage(self, record: Any, *, attachments: Any = None) -> Any:
            stored = super().stage(record)  # the record first, in a write of its own
            if not stored.ok or not attachments:
                return stored
            return super().stage(record, attachments=attachments)

    error = _fails("attachment_rule", functools.partial(KeepsRefusedRecord, str(tmp_path)))
    assert "the key of a refused call" in error.detail


def test_close_errors_are_reported_and_every_client_closed(tmp_path: Path) -> None:
    error = _fails(
        "stage_idempotent", functools.partial(staging_doubles.CloseRaises, str(tmp_path))
    )
    assert "close() raised OSError: close failed" in error.detail
    assert isinstance(error.__cause__, OSError)
    # Three clients, three failing closes: each one was attempted.
    assert error.detail.count("close() raised") == 3


def test_a_close_error_does_not_replace_the_failure(tmp_path: Path) -> None:
    error = _fails(
        "stage_conflict_refused",
        functools.partial(staging_doubles.ConflictRaisesAndCloseRaises, str(tmp_path)),
    )
    assert "acknowledged" in error.detail
    assert any("close() raised OSError" in note for note in error.__notes__)


def test_an_async_close_is_awaited(tmp_path: Path) -> None:
    before = staging_doubles.AsyncClose.closed
    assert run_staging_check(
        "stage_idempotent", functools.partial(staging_doubles.AsyncClose, str(tmp_path))
    )
    assert staging_doubles.AsyncClose.closed - before == 3  # no "never awaited" warning either


async def test_an_async_close_is_awaited_inside_a_running_loop(tmp_path: Path) -> None:
    before = staging_doubles.AsyncClose.closed
    assert run_staging_check(
        "stage_idempotent", functools.partial(staging_doubles.AsyncClose, str(tmp_path))
    )
    assert staging_doubles.AsyncClose.closed - before == 3


def test_a_factory_error_is_chained(tmp_path: Path) -> None:
    error = _fails(
        "stage_idempotent", functools.partial(staging_doubles.FactoryRaises, str(tmp_path))
    )
    assert "sink factory raised ConnectionError" in error.detail
    assert isinstance(error.__cause__, ConnectionError)
    none = _fails("stage_idempotent", lambda: None)
    assert "returned None" in none.detail


def test_a_process_factory_that_cannot_be_pickled_is_named(tmp_path: Path) -> None:
    factory = functools.partial(FileStagingStore, tmp_path)
    error = _fails(
        "retire_fences_other_processes",
        factory,
        process_factory=lambda: FileStagingStore(tmp_path),
    )
    assert "process_factory must be picklable" in error.detail
    assert "lambda" in error.detail
    assert error.__cause__ is not None


def test_a_process_factory_failing_in_the_child_is_reported(tmp_path: Path) -> None:
    error = _fails(
        "acknowledged_survives_sigkill",
        functools.partial(FileStagingStore, tmp_path),
        process_factory=functools.partial(staging_doubles.FactoryRaises, str(tmp_path)),
    )
    assert "ConnectionError: cannot reach the staging server" in error.detail


def test_the_pytest_entry_point_skips_with_the_reason(tmp_path: Path) -> None:
    generated = pytest_staging_checks(MemoryStagingStore)
    with pytest.raises(pytest.skip.Exception, match="no process_factory"):
        generated("acknowledged_survives_sigkill", tmp_path)
