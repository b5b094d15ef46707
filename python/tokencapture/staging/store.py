"""`FileStagingStore`: a durable NeMo Gym ``StagingSink`` and ``StagingSource`` in a directory.

Inference workers call `stage` from their completion threads; it returns only once the record
(and its attachments) is durable. The trainer (or a worker resolving a ``staging_chain``)
calls `fetch`. The format, its recovery rule and what a returned call promises are in
docs/staging.md; the write path (group commit: many threads' records in one ``fdatasync``) is
the Rust core's (``rust/src/staging/file.rs``).

NeMo Gym constructs it as ``tokencapture:FileStagingStore`` with ``{"root": ...}``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tokencapture import _core
from tokencapture.descriptors import check_max_open_files, descriptor_stats
from tokencapture.model_building import construct_all
from tokencapture.protocols import RolloutRemovalPayload
from tokencapture.staging_attachments import (
    StagedAttachment,
    decode_attachments,
    encode_attachments,
)
from tokencapture.staging_records import StagedCallRecord, StageResult
from tokencapture.staging_rows import (
    ModelsChoice,
    StagingModels,
    checked_keys,
    checked_rollout_ids,
    failure_reason,
)

__all__ = ["FileStagingStore"]


class FileStagingStore:
    """Worker-owned staging in a local directory (one host; see docs/staging.md).

    * ``stage(record, *, attachments=None) -> StageResult``: thread-safe, synchronous, durable
      before it returns ``ok=True``. The record is verified first (every digest recomputed);
      a record that does not verify, a retired rollout, a key already staged with other
      content, an attachment that cannot be stored or a storage failure return
      ``ok=False`` with the reason. Staging the same record (and attachments) again is
      idempotent.
    * ``fetch(keys)``: one verified base snapshot per key, in order; an unknown key raises
      `StagingKeyError` (a ``KeyError``), a retired one `StagingKeyRetiredError`, damaged
      bytes `TokenCaptureCorruptionError`.
    * ``fetch_records(keys)`` (with extras) and ``fetch_attachments(key)``.
    * ``retire(rollout_ids)`` fences rollouts in every process; ``delete(rollout_ids)`` removes
      their data and lifts the fence. Both are batched and return ``{"removed", "absent"}``;
      ``retire_now``/``delete_now`` are the same calls under the token store's names, and
      ``aretire``/``adelete`` run them off the event loop.

    Descriptors: between calls an instance keeps the segment it writes and the store lock,
    a cache of the process descriptor budget (`tokencapture.descriptors`) that closes them as
    it closes any cache's (a closed segment is sealed; the next stage starts another);
    ``max_open_files`` caps what it keeps (below 2 the store lock is reopened per batch).
    Every open retries once after the process's cached descriptors were closed, when it ran
    out of them (``EMFILE``/``ENFILE``); only then does a call raise ``OSError`` (a stage
    answers ``ok=False``). `stats` reports them.

    ``models`` picks the wire models fetches build (see `StagingModels.resolve`): by default
    NeMo Gym's when NeMo Gym's staging records are imported in the process, ours otherwise. A
    stage answers with the ``StageResult`` of its record's models.

    ``close()`` (idempotent; ``aclose()`` from a coroutine, as `PostgresStagingStore` has both)
    closes the store lock the instance keeps and releases its native store, and with it the
    segment it writes. Every later call raises ``RuntimeError("the store is closed")``, the
    words of a closed PostgreSQL store (a ``stage`` answers ``ok=False`` with them). What was
    staged stays on disk for any other instance.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        models: ModelsChoice = "auto",
        max_open_files: int | None = None,
    ) -> None:
        self._models_choice = models
        StagingModels.resolve(models)  # refuse a bad choice now
        native = _core.StagingFileStore(Path(root), check_max_open_files(max_open_files))
        self._open: _core.StagingFileStore | None = native
        self._root = native.root

    def __repr__(self) -> str:
        return f"FileStagingStore({str(self.root)!r})"

    @property
    def root(self) -> Path:
        return self._root

    @property
    def _native(self) -> _core.StagingFileStore:
        native = self._open
        if native is None:
            raise RuntimeError("the store is closed")
        return native

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._open is None

    def close(self) -> None:
        """Close the store lock this instance keeps and release its native store, whose
        segment descriptor closes once no call in flight still uses it (idempotent). Every
        later call raises ``RuntimeError``; a ``stage`` answers ``ok=False``."""
        native, self._open = self._open, None
        if native is not None:
            native.release_cached_fds()

    close_sync = close

    async def aclose(self) -> None:
        """`close` from a coroutine (it does not block: nothing waits on a server)."""
        self.close()

    def _models(self) -> StagingModels:
        return StagingModels.resolve(self._models_choice)

    # ---- StagingSink --------------------------------------------------------------------

    def stage(
        self, record: StagedCallRecord, *, attachments: Mapping[str, Any] | None = None
    ) -> StageResult:
        """Durably stage one call's token delta (and its attachments) before returning.

        A NeMo Gym ``StagedCallRecord`` is taken too, and answered with NeMo Gym's
        ``StageResult`` (the same fields): a store answers in the models of the record."""
        models = self._models()
        try:
            models = StagingModels.of_record(record, models)
            encoded = encode_attachments(attachments)
            key = self._native.stage(record, encoded)
        except Exception as error:  # any failure is an answer (never a BaseException)
            return cast(StageResult, models.failed(failure_reason(error)))
        return cast(StageResult, models.ok(key))

    # ---- StagingSource ------------------------------------------------------------------

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One digest-verified base snapshot per key, in the order asked."""
        keys = checked_keys(staging_keys)
        return construct_all(
            self._models().base_snapshot, self._native.fetch(keys, False), given=True
        )

    def fetch_records(self, staging_keys: list[str]) -> list[Any]:
        """One digest-verified record (with its extras) per key, in the order asked."""
        keys = checked_keys(staging_keys)
        return construct_all(self._models().record, self._native.fetch(keys, True), given=True)

    def fetch_attachments(self, staging_key: str) -> dict[str, StagedAttachment]:
        """The attachments staged with one key (empty if it had none)."""
        if type(staging_key) is not str:
            raise TypeError(f"staging_key must be a str, not {type(staging_key).__name__}")
        return decode_attachments(self._native.fetch_attachments(staging_key))

    def keys(self, rollout_id: str | None = None) -> list[str]:
        """Every staged key (of one rollout, or all), sorted."""
        return self._native.keys(rollout_id)

    def retired(self) -> list[str]:
        """Every retired (fenced) rollout id, sorted: rollouts with no fetchable keys that no
        stage succeeds for until they are deleted."""
        return self._native.retired()

    # ---- lifecycle ----------------------------------------------------------------------

    def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Fence rollouts: their keys stop being fetchable and no later stage of them
        succeeds, from any process. Durable before it returns."""
        removed, absent = self._native.retire(checked_rollout_ids(rollout_ids))
        return {"removed": removed, "absent": absent}

    def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove rollouts' staged calls and any fence, so an id can be staged again."""
        removed, absent = self._native.delete(checked_rollout_ids(rollout_ids))
        return {"removed": removed, "absent": absent}

    retire_now = retire
    delete_now = delete

    def aretire(self, rollout_ids: Sequence[str]) -> asyncio.Future[RolloutRemovalPayload]:
        """`retire` off the event loop (arguments checked now)."""
        ids = checked_rollout_ids(rollout_ids)
        return asyncio.get_running_loop().run_in_executor(None, self.retire, ids)

    def adelete(self, rollout_ids: Sequence[str]) -> asyncio.Future[RolloutRemovalPayload]:
        """`delete` off the event loop (arguments checked now)."""
        ids = checked_rollout_ids(rollout_ids)
        return asyncio.get_running_loop().run_in_executor(None, self.delete, ids)

    def damage(self) -> list[tuple[str, int, int]]:
        """Damaged ranges of acknowledged frames, ``(segment file, start, end)``: bytes that
        no longer read back, found mid-segment (see docs/staging.md, the recovery rule). Empty
        on a healthy store. While any is known, a fetch of a key the store does not hold raises
        `TokenCaptureCorruptionError` (it may have been there) instead of `StagingKeyError`."""
        return self._native.damage()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Under ``"descriptors"``, what this store keeps open between calls (the segment it
        writes, its store lock) beside the process budget
        (`tokencapture.descriptors.descriptor_stats`); under ``"commits"``, its group-commit
        counters."""
        batches, frames, syncs = self._native.stats()
        return {
            "descriptors": descriptor_stats(self._native),
            "commits": {"batches": batches, "frames": frames, "syncs": syncs},
        }

    def commit_stats(self) -> tuple[int, int, int]:
        """``(batches, frames, syncs)`` this instance committed: how far group commit shared
        its syncs."""
        return self._native.stats()
