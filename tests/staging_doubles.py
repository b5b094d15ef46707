"""In-memory staging sinks for the staging conformance tests: one correct, and broken ones.

`MemoryStagingStore` is a dict behind a lock that keeps NeMo Gym's staging contract (verify,
idempotent restage, refuse conflicts, store or refuse attachments, fence on retire). Each
broken double breaks exactly one rule, as a plausible transport bug would; `BROKEN` maps it to
the check that must catch it. Stores over one ``name`` share their state (fresh clients of one
backend).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from tokencapture.staging import records as ours

_BACKENDS: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


def _backend(name: str) -> dict[str, Any]:
    with _LOCK:
        return _BACKENDS.setdefault(name, {"rows": {}, "attachments": {}, "retired": set()})


class MemoryStagingStore:
    """A correct in-memory StagingSink + StagingSource (no durability across processes)."""

    def __init__(self, name: str) -> None:
        self._state = _backend(name)
        self._lock = _LOCK

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        models = _models_of(record)
        try:
            checked = self._verify(models, record)
            stored = self._attachments(attachments)
        except (ValueError, TypeError) as error:
            return models.StageResult(ok=False, error=f"{type(error).__name__}: {error}")
        key = f"{checked.rollout_id}/{checked.model_call_id}"
        with self._lock:
            if checked.rollout_id in self._state["retired"]:
                return models.StageResult(ok=False, error=f"rollout {checked.rollout_id} retired")
            held = self._state["rows"].get(key)
            if held is not None and held != checked.model_dump():
                return models.StageResult(ok=False, error=f"{key} staged with other content")
            self._store(key, checked, stored)
        return models.StageResult(ok=True, staging_key=key)

    def _verify(self, models: Any, record: Any) -> Any:
        return models.StagedCallRecord.model_validate(record.model_dump())

    def _store(self, key: str, checked: Any, stored: dict[str, bytes]) -> None:
        self._state["rows"][key] = checked.model_dump()
        self._state["attachments"][key] = stored

    def _attachments(self, attachments: Mapping[str, Any] | None) -> dict[str, bytes]:
        stored: dict[str, bytes] = {}
        for name, value in (attachments or {}).items():
            try:
                stored[name] = bytes(memoryview(value))
            except TypeError:
                raise TypeError(f"attachment {name!r} is a {type(value).__name__}") from None
        return stored

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        with self._lock:
            rows = []
            for key in staging_keys:
                if key not in self._state["rows"]:
                    raise KeyError(key)
                rows.append(self._state["rows"][key])
        return [ours.StagedCallBaseSnapshot.model_validate(_base(row)) for row in rows]

    def fetch_attachments(self, staging_key: str) -> dict[str, bytes]:
        with self._lock:
            return dict(self._state["attachments"][staging_key])

    def retire(self, rollout_ids: list[str]) -> dict[str, list[str]]:
        with self._lock:
            for rollout_id in rollout_ids:
                self._state["retired"].add(rollout_id)
                for key in [k for k in self._state["rows"] if k.startswith(f"{rollout_id}/")]:
                    del self._state["rows"][key]
        return {"removed": list(rollout_ids), "absent": []}


def _base(row: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in row.items() if name != "extras"}


def _models_of(record: Any) -> Any:
    import sys

    return sys.modules[type(record).__module__]


class FetchesSorted(MemoryStagingStore):
    """Answers a fetch in key order, not in the order asked."""

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        return super().fetch(sorted(staging_keys))


class SkipsVerification(MemoryStagingStore):
    """Stores whatever it is given without recomputing the digest."""

    def _verify(self, models: Any, record: Any) -> Any:
        return models.StagedCallRecord.model_construct(**dict(record))


class OverwritesConflicts(MemoryStagingStore):
    """Lets a restage with other content replace the first."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        with self._lock:
            self._state["rows"].pop(f"{record.rollout_id}/{record.model_call_id}", None)
        return super().stage(record, attachments=attachments)


class DropsUnstorableAttachments(MemoryStagingStore):
    """Silently drops an attachment it cannot store."""

    def _attachments(self, attachments: Mapping[str, Any] | None) -> dict[str, bytes]:
        stored: dict[str, bytes] = {}
        for name, value in (attachments or {}).items():
            try:
                stored[name] = bytes(memoryview(value))
            except TypeError:
                continue
        return stored


class RetireHidesOnly(MemoryStagingStore):
    """Retire hides the rows but does not fence later stages."""

    def retire(self, rollout_ids: list[str]) -> dict[str, list[str]]:
        answer = super().retire(rollout_ids)
        with self._lock:
            self._state["retired"].difference_update(rollout_ids)
        return answer


class VisibleOnClose(MemoryStagingStore):
    """Buffers stages in the client; other clients see them only after ``close``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._pending: list[tuple[str, Any, dict[str, bytes]]] = []

    def _store(self, key: str, checked: Any, stored: dict[str, bytes]) -> None:
        self._pending.append((key, checked, stored))

    def close(self) -> None:
        with self._lock:
            for key, checked, stored in self._pending:
                super()._store(key, checked, stored)
        self._pending.clear()


class RestageFails(MemoryStagingStore):
    """Refuses a restage of the very same record."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        with self._lock:
            held = key in self._state["rows"]
        if held:
            return _models_of(record).StageResult(ok=False, error="already staged")
        return super().stage(record, attachments=attachments)


BROKEN: dict[type[MemoryStagingStore], str] = {
    VisibleOnClose: "stage_visible_before_return",
    FetchesSorted: "fetch_in_order",
    RestageFails: "stage_idempotent",
    OverwritesConflicts: "stage_conflict_refused",
    SkipsVerification: "invalid_record_refused",
    DropsUnstorableAttachments: "attachment_rule",
    RetireHidesOnly: "retire_fences",
}
