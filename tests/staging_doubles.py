"""In-memory staging sinks for the staging conformance tests: one correct, and broken ones.

`MemoryStagingStore` is a dict behind a lock that keeps NeMo Gym's staging contract (verify,
idempotent restage, refuse conflicts, store or refuse attachments, fence on retire). Each
broken double breaks exactly one rule, as a plausible transport bug would; `BROKEN` maps it to
the check that must catch it. Stores over one ``name`` share their state (fresh clients of one
backend).
"""

from __future__ import annotations

import threading
import time
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

    def fetch_records(self, staging_keys: list[str]) -> list[Any]:
        with self._lock:
            rows = []
            for key in staging_keys:
                if key not in self._state["rows"]:
                    raise KeyError(key)
                rows.append(self._state["rows"][key])
        return [ours.StagedCallRecord.model_validate(row) for row in rows]

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


class CachesStagedRecords(MemoryStagingStore):
    """A client-side "already staged" cache answers a restage of a record this client staged
    before without asking the backend: after a retire, the dead key is acknowledged."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._seen: dict[str, Any] = {}

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        if self._seen.get(key) == record.model_dump():
            return _models_of(record).StageResult(ok=True, staging_key=key)
        result = super().stage(record, attachments=attachments)
        if result.ok:
            self._seen[key] = record.model_dump()
        return result


class KeepsAttachmentsOfRefusedCalls(MemoryStagingStore):
    """Writes each attachment on its own before the record: when a later one cannot be
    stored the call is refused, but the attachments before it stay under its key."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        for name, value in (attachments or {}).items():
            try:
                data = bytes(memoryview(value))
            except TypeError:
                break
            with self._lock:
                self._state["attachments"].setdefault(key, {})[name] = data
        return super().stage(record, attachments=attachments)


class DropsStoredAttachments(MemoryStagingStore):
    """Refuses attachments it cannot store, but never keeps the ones it acknowledges."""

    def _store(self, key: str, checked: Any, stored: dict[str, bytes]) -> None:
        super()._store(key, checked, {})


class AttachmentsWithoutReader(DropsStoredAttachments):
    """Drops acknowledged attachments and has no ``fetch_attachments``: the suite cannot see
    the loss, so the round trip must be reported unverified, not passed."""

    fetch_attachments = None  # type: ignore[assignment]


class DropsExtras(MemoryStagingStore):
    """Hands back records without their extras (routed experts and all)."""

    def fetch_records(self, staging_keys: list[str]) -> list[Any]:
        return [
            ours.StagedCallRecord.model_construct(**{**dict(record), "extras": None})
            for record in super().fetch_records(staging_keys)
        ]


class _Busy(MemoryStagingStore):
    """Shares one "connection": a stage while another is running is a bug (see subclasses)."""

    _in_use = threading.Lock()

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        if not _Busy._in_use.acquire(blocking=False):
            return self._busy()
        try:
            time.sleep(0.002)  # holds the connection long enough for threads to collide
            return super().stage(record, attachments=attachments)
        finally:
            _Busy._in_use.release()

    def _busy(self) -> Any:
        raise NotImplementedError


class RaisesWhenConcurrent(_Busy):
    """Not thread-safe: a concurrent stage raises."""

    def _busy(self) -> Any:
        raise RuntimeError("connection is busy with another command")


class ReturnsNoneWhenConcurrent(_Busy):
    """Not thread-safe: a concurrent stage returns None instead of a StageResult."""

    def _busy(self) -> Any:
        return None


class CloseRaises(MemoryStagingStore):
    """A correct store whose ``close`` fails."""

    def close(self) -> None:
        raise OSError("close failed: connection reset")


class AsyncClose(MemoryStagingStore):
    """A correct store with an ``async def close`` (it counts the closes it really ran)."""

    closed = 0

    async def close(self) -> None:
        AsyncClose.closed += 1


class ConflictRaisesAndCloseRaises(CloseRaises):
    """Fails `stage_conflict_refused` (a conflicting restage is acknowledged), then its close
    fails too: the report must stay the conflict, with the close error attached."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        result = super().stage(record, attachments=attachments)
        if not result.ok and "other content" in (result.error or ""):
            return _models_of(record).StageResult(ok=True, staging_key=_key_of(record))
        return result


def _key_of(record: Any) -> str:
    return f"{record.rollout_id}/{record.model_call_id}"


class FactoryRaises:
    """A factory that cannot reach its backend."""

    def __init__(self, name: str) -> None:
        raise ConnectionError("cannot reach the staging server")


BROKEN: dict[type[MemoryStagingStore], str] = {
    VisibleOnClose: "stage_visible_before_return",
    FetchesSorted: "fetch_in_order",
    RestageFails: "stage_idempotent",
    OverwritesConflicts: "stage_conflict_refused",
    SkipsVerification: "invalid_record_refused",
    DropsUnstorableAttachments: "attachment_rule",
    RetireHidesOnly: "retire_fences",
    CachesStagedRecords: "retire_fences",
    KeepsAttachmentsOfRefusedCalls: "attachment_rule",
    DropsStoredAttachments: "attachments_round_trip",
    DropsExtras: "extras_round_trip",
    RaisesWhenConcurrent: "concurrent_stages",
    ReturnsNoneWhenConcurrent: "concurrent_stages",
}
