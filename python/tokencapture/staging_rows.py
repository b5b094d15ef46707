"""What every staging backend shares above the Rust core: which wire models a store builds,
how a record and its attachments become a verified stored row, how stored rows become models
again, and how an outcome becomes a `StageResult`.

A backend (the file store here, a database store elsewhere) calls `encode_stage` to verify a
record natively (its ``digest``, ``extras_digest``, ``chain_hash`` and ``cumulative_hash``
fields recomputed with NeMo Gym's algorithms) and get its row and attachments blob
(`tokencapture._core.StagedRow`: ``key``, ``rollout_id``, ``row``, ``attachments``,
``content_digest``), stores those bytes, and reads them back through `snapshots_from_rows`,
`records_from_rows` and `attachments_from_blob`, which verify them again.

Models: NeMo Gym's capture code checks ``isinstance(result, StageResult)`` and its rebuild
``isinstance(snapshot, StagedCallBaseSnapshot)`` against *its* classes, so a store answers in
the caller's models. `StagingModels.resolve` picks them: ``"tokencapture"`` (ours),
``"nemo_gym"`` (NeMo Gym's, imported), or ``"auto"`` (the default: NeMo Gym's when
``nemo_gym.token_id_capture.staging.records`` is already imported in the process, ours
otherwise). A stage answers in the models of the record it was given.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from tokencapture import _core
from tokencapture import staging_records as _ours
from tokencapture.model_building import construct_all
from tokencapture.staging_attachments import (
    StagedAttachment,
    decode_attachments,
    encode_attachments,
)

__all__ = [
    "NEMO_STAGING_RECORDS",
    "ModelsChoice",
    "StagingModels",
    "attachments_from_blob",
    "checked_keys",
    "checked_rollout_ids",
    "encode_stage",
    "failure_reason",
    "records_from_rows",
    "snapshots_from_rows",
]

NEMO_STAGING_RECORDS = "nemo_gym.token_id_capture.staging.records"
ModelsChoice = Literal["auto", "tokencapture", "nemo_gym"] | ModuleType


@dataclass(frozen=True, slots=True)
class StagingModels:
    """The three wire models a staging store builds."""

    base_snapshot: type[Any]
    record: type[Any]
    stage_result: type[Any]

    @classmethod
    def of_module(cls, module: ModuleType) -> StagingModels:
        return cls(
            base_snapshot=module.StagedCallBaseSnapshot,
            record=module.StagedCallRecord,
            stage_result=module.StageResult,
        )

    @classmethod
    def resolve(cls, choice: ModelsChoice) -> StagingModels:
        if isinstance(choice, ModuleType):
            return cls.of_module(choice)
        if choice == "tokencapture":
            return OURS
        if choice == "nemo_gym":
            return cls.of_module(importlib.import_module(NEMO_STAGING_RECORDS))
        if choice == "auto":
            nemo = sys.modules.get(NEMO_STAGING_RECORDS)
            return cls.of_module(nemo) if nemo is not None else OURS
        raise ValueError(
            f"models must be 'auto', 'tokencapture', 'nemo_gym' or a records module, not {choice!r}"
        )

    @classmethod
    def of_record(cls, record: object, fallback: StagingModels) -> StagingModels:
        """The models of the module `record`'s class (or a base of it) comes from: NeMo
        Gym's or ours; `fallback` for anything else."""
        for klass in type(record).__mro__:
            if klass.__module__ == NEMO_STAGING_RECORDS:
                return cls.of_module(sys.modules[NEMO_STAGING_RECORDS])
            if klass.__module__ == _ours.__name__:
                return OURS
        return fallback

    def ok(self, staging_key: str) -> Any:
        return self.stage_result(ok=True, staging_key=staging_key)

    def failed(self, error: str) -> Any:
        return self.stage_result(ok=False, error=error)


OURS = StagingModels.of_module(_ours)


def checked_keys(staging_keys: Sequence[str]) -> list[str]:
    """The staging keys a fetch asked for, as a list: a list of str, not one str."""
    if isinstance(staging_keys, str):
        raise TypeError("staging_keys must be a list of keys, not one str")
    keys = list(staging_keys)
    for key in keys:
        if type(key) is not str:
            raise TypeError(f"staging keys must be str, not {type(key).__name__}")
    return keys


def checked_rollout_ids(rollout_ids: Sequence[str]) -> list[str]:
    """A retire or delete batch as a list: non-empty str ids, not one str."""
    if isinstance(rollout_ids, str):
        raise TypeError("rollout_ids must be a sequence of ids, not one str")
    ids = list(rollout_ids)
    for rollout_id in ids:
        if type(rollout_id) is not str or not rollout_id:
            raise ValueError(f"rollout ids must be non-empty str, got {rollout_id!r}")
    return ids


def failure_reason(error: BaseException) -> str:
    """The ``StageResult.error`` of a refused or failed stage: the exception's type and words."""
    text = str(error) or repr(error)
    return f"{type(error).__name__}: {text}"


def encode_stage(record: object, attachments: Mapping[str, Any] | None = None) -> _core.StagedRow:
    """Verify `record` natively and encode it with its attachments (or raise: ``ValueError``
    and ``TypeError`` for a record or attachment that cannot be staged)."""
    return _core.staging_encode(record, encode_attachments(attachments))


def snapshots_from_rows(
    rows: Sequence[bytes], keys: Sequence[str], models: StagingModels
) -> list[Any]:
    """Verified base snapshots of stored rows (raises `TokenCaptureCorruptionError`)."""
    fields = _core.staging_decode(list(rows), list(keys), False)
    return construct_all(models.base_snapshot, fields, given=True)


def records_from_rows(
    rows: Sequence[bytes], keys: Sequence[str], models: StagingModels
) -> list[Any]:
    """Verified whole records (with extras) of stored rows."""
    fields = _core.staging_decode(list(rows), list(keys), True)
    return construct_all(models.record, fields, given=True)


def attachments_from_blob(blob: bytes, key: str) -> dict[str, StagedAttachment]:
    """The attachments of a stored blob (empty for none)."""
    return decode_attachments(_core.staging_decode_attachments(blob, key))
