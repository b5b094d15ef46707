"""Rollouts as whole images, in and out of a store directory (`tokencapture copy`).

A `RolloutImage` is everything a store holds for one rollout: its flags, snapshot id and
version, its entry lines byte for byte (in commit order, with their payload digests), its
intents and its incomplete marks. `export_from_directory` reads one, `import_into_directory`
creates a rollout from one (refusing an id that already exists there); the PostgreSQL side is
`tokencapture.postgres.transfer`. `tokencapture copy` is built on these; it is an operator tool
for rollouts nobody is writing at the moment. Nothing here needs the PostgreSQL driver: a copy
between two directories works without the `postgres` extra.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from tokencapture import _core
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.rollout_files import complete_lines
from tokencapture.store import TokenCaptureStore, validate_rollout_id

__all__ = [
    "IMPORTING_SUFFIX",
    "PartialCopyError",
    "RolloutImage",
    "export_from_directory",
    "import_into_directory",
    "rollouts_in_directory",
]

# The marker an import keeps beside a rollout's files while it writes them (see
# `import_into_directory`).
IMPORTING_SUFFIX = ".tokens.importing"
_FILE = re.compile(
    r"^(?P<rollout>[A-Za-z0-9._-]+)\.tokens\.(jsonl|state\.json|intents|incomplete)$"
)


# The lifecycle fields of an image, as a state index and an exported row both name them.
_STATE_FIELDS = ("frozen", "retired", "incomplete", "snapshot_id", "version")


@dataclass
class RolloutImage:
    rollout_id: str
    frozen: bool = False
    retired: bool = False
    incomplete: bool = False
    snapshot_id: str = ""
    version: int = 0
    # (model_call_id, payload digest, canonical line without its newline), commit order.
    entries: list[tuple[str, str, bytes]] = field(default_factory=list)
    intents: list[bytes] = field(default_factory=list)  # call ids in UTF-8
    markers: list[bytes] = field(default_factory=list)

    @classmethod
    def with_state(cls, rollout_id: str, state: Mapping[str, Any], **lists: Any) -> RolloutImage:
        """An image whose lifecycle fields are `state`'s (a state index, or a database row:
        anything indexed by those names)."""
        return cls(rollout_id, **{name: state[name] for name in _STATE_FIELDS}, **lists)

    def summary(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "entries": len(self.entries),
            "version": self.version,
            "snapshot_id": self.snapshot_id,
            "frozen": self.frozen,
            "retired": self.retired,
            "incomplete": self.incomplete,
        }


# Directories ------------------------------------------------------------------------------------


def rollouts_in_directory(root: Path) -> list[str]:
    found = {m["rollout"] for p in root.iterdir() if (m := _FILE.match(p.name))}
    return sorted(found)


def _open_to_read(lock_path: Path) -> BinaryIO | None:
    """A rollout's lock file for a shared lock: read-only when it exists (`flock` works on
    any descriptor, so a read-only mount or a user who may only read can copy out), else
    made as a writer makes it; None on a read-only filesystem that has none (nothing writes
    there: read without it, as the store's own reads do)."""
    try:
        return open(lock_path, "rb")
    except FileNotFoundError:
        pass
    try:
        return open(lock_path, "a+b")
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return None
        raise


def export_from_directory(store: TokenCaptureStore, rollout_id: str) -> RolloutImage | None:
    """The rollout as the file store holds it (digests verified, the tail folded in)."""
    validate_rollout_id(rollout_id)
    lock_path = store.lock_path_for(rollout_id)
    files = (
        lock_path,
        store.path_for(rollout_id),
        store.state_path_for(rollout_id),
        store.intents_path_for(rollout_id),
        store.incomplete_path_for(rollout_id),
    )
    if not any(path.exists() for path in files):
        return None
    lock = _open_to_read(lock_path)
    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_SH)
        state = store.inspect(rollout_id)  # verifies every indexed line's digest
        if state is None:
            return None
        image = RolloutImage.with_state(rollout_id, state)
        digests: dict[str, str] = state["entry_digests"]
        seen: set[str] = set()
        for line in complete_lines(store.path_for(rollout_id)):
            call_id = orjson.loads(line)["model_call_id"]
            digest = _core.payload_digest(line)
            if call_id in seen or digests.get(call_id) != digest:
                continue  # a duplicate, or the refused half of a conflict
            seen.add(call_id)
            image.entries.append((call_id, digest, line))
        if len(seen) != len(digests):
            raise TokenCaptureCorruptionError(
                f"{store.path_for(rollout_id)}: the log holds {len(seen)} of the "
                f"{len(digests)} indexed entries"
            )
        for raw in complete_lines(store.intents_path_for(rollout_id)):
            intent = raw.strip(b" \t\n\x0b\x0c\r")
            if intent and intent not in image.intents:
                image.intents.append(intent)
        image.markers = complete_lines(store.incomplete_path_for(rollout_id))
    return image


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _sync_directory(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class PartialCopyError(ValueError):
    """A copy cut short left a rollout's files in the target, and they have changed since: a
    writer of the target used the rollout (or the source changed). Nothing is overwritten."""


def import_into_directory(store: TokenCaptureStore, image: RolloutImage) -> bool:
    """Create the rollout's files from an image; False if the rollout already has files.

    Whole or not at all: an import that fails (a full disk) removes what it wrote and raises
    an `OSError` naming the rollout. One a crash cut short is redone by the next import:
    `<rollout>.tokens.importing` is made (and its name synced) before any file and removed
    (synced) after the last, so its presence says the files beside it may be a partial copy.
    They are redone only while each is still a prefix of what this import writes (a torn
    copy); a rollout a writer of the target has used since is never overwritten
    (`PartialCopyError`).
    """
    rollout_id = validate_rollout_id(image.rollout_id)
    root = Path(store.root)
    marker = root / f"{rollout_id}{IMPORTING_SUFFIX}"
    log, state, intents, markers = (
        store.path_for(rollout_id),
        store.state_path_for(rollout_id),
        store.intents_path_for(rollout_id),
        store.incomplete_path_for(rollout_id),
    )
    temporary = state.with_name(state.name + ".copy-tmp")
    lines = b"".join(line + b"\n" for _, _, line in image.entries)
    contents = {
        log: lines,
        intents: b"".join(i + b"\n" for i in image.intents),
        markers: b"".join(m + b"\n" for m in image.markers),
    }
    index = orjson.dumps(
        {
            "entry_digests": {call_id: digest for call_id, digest, _ in image.entries},
            "frozen": image.frozen,
            "incomplete": image.incomplete,
            "indexed_size": len(lines),
            "retired": image.retired,
            "snapshot_id": image.snapshot_id,
            "version": image.version,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    written = [log, intents, markers, temporary, state]
    with open(store.lock_path_for(rollout_id), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            if not _torn_copy_of(contents, state, index):
                raise PartialCopyError(
                    f"rollout {rollout_id!r} in {root}: a copy cut short left {marker.name}, "
                    "and the rollout's files have changed since (a writer of the target used "
                    "it, or the source changed): not overwritten; delete the rollout there "
                    f"(and {marker.name}) to copy it again"
                )
            for path in written:
                path.unlink(missing_ok=True)
        elif any(path.exists() for path in (log, state, intents, markers)):
            return False
        try:
            marker.touch()
            _sync_directory(root)
            for path, data in contents.items():
                if data:
                    _write_synced(path, data)
            temporary.unlink(missing_ok=True)
            _write_synced(temporary, index)
            os.replace(temporary, state)
            _sync_directory(root)  # every name above durable before the marker goes
            marker.unlink()
            _sync_directory(root)
        except OSError as exc:
            removed = True
            for path in written:
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    removed = False
            if removed:  # else the marker stays: the files beside it are a partial copy
                with contextlib.suppress(OSError):
                    marker.unlink(missing_ok=True)
            raise OSError(
                exc.errno, f"copying rollout {rollout_id!r} into {root}: {exc.strerror or exc}"
            ) from exc
    return True


def _torn_copy_of(contents: dict[Path, bytes], state: Path, index: bytes) -> bool:
    """Whether a rollout's files are (a part of) what an import of `contents` and `index`
    writes: each file a prefix of its content (torn by a crash mid-write), the state index
    absent or exactly `index`."""
    for path, data in contents.items():
        try:
            held = path.read_bytes()
        except FileNotFoundError:
            continue
        if not data.startswith(held):
            return False
    try:
        return state.read_bytes() == index
    except FileNotFoundError:
        return True
