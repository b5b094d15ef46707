"""`FileStagingStore.stage` is typed: a `StagedCallRecord` in, a `StageResult` out (it was
`Any` both ways, so a caller's mypy checked nothing about a stage)."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.staging_backends import make_record

from tokencapture.staging import FileStagingStore, StagedCallRecord, StageResult

ROOT = Path(__file__).resolve().parents[1]


def test_stage_annotations_name_the_staging_records() -> None:
    hints = typing.get_type_hints(FileStagingStore.stage)
    assert hints == {
        "record": StagedCallRecord,
        "attachments": Mapping[str, Any] | None,
        "return": StageResult,
    }


def test_stage_answers_what_its_annotation_says(tmp_path: Path) -> None:
    store = FileStagingStore(tmp_path, models="tokencapture")
    try:
        result = store.stage(make_record("r"), attachments={"raw": b"\x01"})
        assert isinstance(result, StageResult) and result.ok
        refused = store.stage(make_record("r", tokens=[9, 9]))  # another content, same key
        assert isinstance(refused, StageResult) and not refused.ok
    finally:
        store.close()


CALLER = """\
from typing import assert_type

from tokencapture.staging import FileStagingStore, StagedCallRecord, StageResult


def use(store: FileStagingStore, record: StagedCallRecord) -> None:
    assert_type(store.stage(record), StageResult)
    assert_type(store.stage(record, attachments={"raw": b"x"}), StageResult)
    store.stage({"rollout_id": "r"})  # refused: not a record
"""


def test_mypy_strict_checks_a_caller_of_stage(tmp_path: Path) -> None:
    """The project's own mypy configuration (strict, the pydantic plugin) on a caller."""
    from mypy import api

    caller = tmp_path / "caller.py"
    caller.write_text(CALLER)
    out, err, _ = api.run(
        [
            *("--config-file", str(ROOT / "pyproject.toml")),
            *("--cache-dir", str(tmp_path / "mypy-cache")),  # never another run's answers
            "--no-error-summary",
            str(caller),
        ]
    )
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 1, out + err
    assert errors[0].startswith(f"{caller}:9: error: ") and "[arg-type]" in errors[0], errors
