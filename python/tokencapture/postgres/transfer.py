"""Moving rollouts whole between a store directory and a PostgreSQL database, either way.

A `RolloutImage` is everything a store holds for one rollout: its flags, snapshot id and
version, its entry lines byte for byte (in commit order, with their payload digests), its
intents and its incomplete marks. `export_*` reads one from a backend, `import_*` creates a
rollout from one (refusing an id that already exists there). `tokencapture copy` is built on
these; it is an operator tool for rollouts nobody is writing at the moment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from tokencapture import _core
from tokencapture.postgres._client import Client
from tokencapture.protocols import TokenCaptureCorruptionError
from tokencapture.rollout_files import complete_lines
from tokencapture.store import TokenCaptureStore, validate_rollout_id

__all__ = [
    "RolloutImage",
    "export_from_directory",
    "export_from_postgres",
    "import_into_directory",
    "import_into_postgres",
    "rollouts_in_directory",
    "rollouts_in_postgres",
]

_FILE = re.compile(
    r"^(?P<rollout>[A-Za-z0-9._-]+)\.tokens\.(jsonl|state\.json|intents|incomplete)$"
)


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


def _open_to_read(lock_path: Path) -> BinaryIO:
    """A rollout's lock file for a shared lock: read-only when it exists (`flock` works on
    any descriptor, so a read-only mount or a user who may only read can copy out), else
    made as a writer makes it."""
    try:
        return open(lock_path, "rb")
    except FileNotFoundError:
        return open(lock_path, "a+b")


def export_from_directory(store: TokenCaptureStore, rollout_id: str) -> RolloutImage | None:
    """The rollout as the file store holds it (digests verified, the tail folded in)."""
    validate_rollout_id(rollout_id)
    lock_path = store.lock_path_for(rollout_id)
    if not lock_path.exists() and not store.state_path_for(rollout_id).exists():
        return None
    with _open_to_read(lock_path) as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        state = store.inspect(rollout_id)  # verifies every indexed line's digest
        if state is None:
            return None
        image = RolloutImage(
            rollout_id,
            frozen=state["frozen"],
            retired=state["retired"],
            incomplete=state["incomplete"],
            snapshot_id=state["snapshot_id"],
            version=state["version"],
        )
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


def import_into_directory(store: TokenCaptureStore, image: RolloutImage) -> bool:
    """Create the rollout's files from an image; False if the rollout already has files.

    Whole or not at all: an import that fails (a full disk) removes what it wrote and raises
    an `OSError` naming the rollout, and one a crash cut short is redone by the next import:
    `<rollout>.tokens.importing` is made (and its name synced) before any file and removed
    (synced) after the last, so its presence says the files beside it are a partial copy.
    """
    rollout_id = validate_rollout_id(image.rollout_id)
    root = Path(store.root)
    marker = root / f"{rollout_id}.tokens.importing"
    log, state, intents, markers = (
        store.path_for(rollout_id),
        store.state_path_for(rollout_id),
        store.intents_path_for(rollout_id),
        store.incomplete_path_for(rollout_id),
    )
    temporary = state.with_name(state.name + ".copy-tmp")
    written = [log, intents, markers, temporary, state]
    with open(store.lock_path_for(rollout_id), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():  # an import a crash cut short: what it left is not the rollout's
            for path in written:
                path.unlink(missing_ok=True)
        elif any(path.exists() for path in (log, state, intents, markers)):
            return False
        try:
            marker.touch()
            _sync_directory(root)
            lines = b"".join(line + b"\n" for _, _, line in image.entries)
            if lines:
                _write_synced(log, lines)
            if image.intents:
                _write_synced(intents, b"".join(i + b"\n" for i in image.intents))
            if image.markers:
                _write_synced(markers, b"".join(m + b"\n" for m in image.markers))
            index = {
                "entry_digests": {call_id: digest for call_id, digest, _ in image.entries},
                "frozen": image.frozen,
                "incomplete": image.incomplete,
                "indexed_size": len(lines),
                "retired": image.retired,
                "snapshot_id": image.snapshot_id,
                "version": image.version,
            }
            temporary.unlink(missing_ok=True)
            _write_synced(temporary, orjson.dumps(index, option=orjson.OPT_SORT_KEYS))
            os.replace(temporary, state)
            _sync_directory(root)  # every name above durable before the marker goes
            marker.unlink()
            _sync_directory(root)
        except OSError as exc:
            for path in written:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                marker.unlink(missing_ok=True)
            raise OSError(
                exc.errno, f"copying rollout {rollout_id!r} into {root}: {exc.strerror or exc}"
            ) from exc
    return True


# PostgreSQL -------------------------------------------------------------------------------------


async def rollouts_in_postgres(client: Client) -> list[str]:
    pool = await client.pool()
    rows = await pool.fetch("SELECT rollout_id FROM tokencapture.rollouts ORDER BY rollout_id")
    return [row["rollout_id"] for row in rows]


async def export_from_postgres(client: Client, rollout_id: str) -> RolloutImage | None:
    validate_rollout_id(rollout_id)
    row = await client.fetch("row", "SELECT * FROM tokencapture.export_rollout($1)", rollout_id)
    if row["status"] != 0:
        return None
    return RolloutImage(
        rollout_id,
        frozen=row["frozen"],
        retired=row["retired"],
        incomplete=row["incomplete"],
        snapshot_id=row["snapshot_id"],
        version=row["version"],
        entries=[
            (call_id.decode(), digest, line)
            for call_id, digest, line in zip(
                row["call_ids"], row["digests"], row["lines"], strict=True
            )
        ],
        intents=list(row["intents"]),
        markers=list(row["markers"]),
    )


async def import_into_postgres(client: Client, image: RolloutImage) -> bool:
    validate_rollout_id(image.rollout_id)
    for call_id, digest, line in image.entries:
        if _core.payload_digest(line) != digest:
            raise TokenCaptureCorruptionError(
                f"rollout {image.rollout_id!r}: the line of {call_id!r} does not match its digest"
            )
    return bool(
        await client.fetch(
            "val",
            "SELECT tokencapture.import_rollout($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            image.rollout_id,
            image.frozen,
            image.retired,
            image.incomplete,
            image.snapshot_id,
            image.version,
            [call_id.encode() for call_id, _, _ in image.entries],
            [digest for _, digest, _ in image.entries],
            [line for _, _, line in image.entries],
            image.intents,
            image.markers,
            idempotent=False,  # a retry after a commit would report the rollout as existing
        )
    )
