"""Fetched lines to entries with the file store's own native decoder.

The native core decodes a rollout's log only from a store directory (`_core.Store.read_lines`:
the validating walk that builds dicts straight from the bytes, copies repeated runs of token
ids from earlier lists and keeps its containers out of the garbage collector's way). Until it
takes a buffer directly, the fetched log is staged as a file in a private directory in memory
(/dev/shm when writable), decoded there, and removed. Measured on a 24-call, 2.5 MB agentic
rollout: ~11 ms staged and decoded natively against ~60 ms for orjson over the same lines plus
the entries' construction slowed by garbage collection passes over millions of ints.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
from typing import Any

from tokencapture import _core
from tokencapture.protocols import TokenCaptureCorruptionError

__all__ = ["decode_log"]

_lock = threading.Lock()
_staging: tuple[int, str, _core.Store] | None = None
_names = itertools.count()


def _remove(pid: int, directory: str) -> None:
    """At exit, remove this process's staging directory (a forked child leaves its parent's)."""
    if os.getpid() == pid:
        shutil.rmtree(directory, ignore_errors=True)


def _stage() -> tuple[str, _core.Store]:
    global _staging
    pid = os.getpid()
    if _staging is None or _staging[0] != pid:
        with _lock:
            if _staging is None or _staging[0] != pid:
                base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
                directory = tempfile.mkdtemp(prefix="tokencapture-decode-", dir=base)
                atexit.register(_remove, pid, directory)
                # One cached rollout: the staged files are removed after each decode.
                _staging = (pid, directory, _core.Store(directory, 1))
    return _staging[1], _staging[2]


def decode_log(log: bytes, where: str) -> list[dict[str, Any]]:
    """The records of a log (complete lines, unique call ids), decoded natively."""
    if not log:
        return []
    directory, store = _stage()
    name = f"d{next(_names)}"
    path = os.path.join(directory, f"{name}.tokens.jsonl")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(descriptor, "wb", closefd=True) as staged:
            staged.write(log)
        try:
            records, _ = store.read_lines(name)
        except ValueError as exc:
            raise TokenCaptureCorruptionError(
                f"{where}: a stored line is not valid: {exc}"
            ) from exc
    finally:
        for suffix in ("jsonl", "lock", "state.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, f"{name}.tokens.{suffix}"))
    return records
