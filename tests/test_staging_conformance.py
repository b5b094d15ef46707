"""The staging conformance checks: real stores pass, each broken double fails its own check."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from tests.nemo_oracle import import_nemo

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


@pytest.mark.parametrize(
    ("double", "check"), list(BROKEN.items()), ids=lambda v: getattr(v, "__name__", v)
)
def test_each_broken_double_fails_its_check(tmp_path: Path, double: type, check: str) -> None:
    factory = functools.partial(double, str(tmp_path))
    with pytest.raises(StagingConformanceError) as caught:
        run_staging_conformance(factory)
    assert caught.value.check == check
    # ...and the correct double passes that very check.
    assert run_staging_check(check, functools.partial(MemoryStagingStore, str(tmp_path) + "ok"))


def test_unknown_check_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown staging checks"):
        run_staging_check("nope", lambda: None)
