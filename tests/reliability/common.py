"""Shared pieces of the reliability tests: store selection, deterministic entries, file listings.

Nothing here imports pytest, so the child-process scripts (crash writer, fault driver, soak)
start fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from tokencapture.protocols import RolloutRemovalPayload, TokenCaptureSnapshot
from tokencapture.records import TokenEntry
from tokencapture.store import canonical_line

__all__ = [
    "REFERENCE_MISSING_REASON",
    "REPO_ROOT",
    "STORE_KINDS",
    "StoreLike",
    "child_env",
    "entry_sha",
    "kill_once_started",
    "listing",
    "long_mode",
    "make_entry",
    "open_store",
    "python",
    "reference_available",
    "rollout_files",
    "sha256",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
STORE_KINDS = ("rust", "reference")
REFERENCE_MISSING_REASON = (
    "tokencapture.reference (the pure-Python reference store) does not exist yet"
)


class StoreLike(Protocol):
    """The synchronous surface both stores share (the reference's names)."""

    @property
    def root(self) -> Path: ...

    def append(self, entry: TokenEntry) -> None: ...

    async def put(self, entry: TokenEntry) -> None: ...

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    def _mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...

    def freeze_now(self, rollout_id: str) -> TokenCaptureSnapshot: ...

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool: ...

    def retire_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    def delete_now(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload: ...

    def read_entries(self, rollout_id: str) -> list[TokenEntry]: ...

    def is_incomplete(self, rollout_id: str) -> bool: ...

    def path_for(self, rollout_id: str) -> Path: ...

    def state_path_for(self, rollout_id: str) -> Path: ...


def reference_available() -> bool:
    """True once `tokencapture.reference` exports a `TokenCaptureStore`."""
    try:
        if importlib.util.find_spec("tokencapture.reference") is None:
            return False
    except ImportError:
        return False
    module = importlib.import_module("tokencapture.reference")
    return hasattr(module, "TokenCaptureStore")


def open_store(kind: str, root: str | os.PathLike[str]) -> StoreLike:
    """A fresh store object of the given kind over `root` ("rust" or "reference")."""
    if kind == "rust":
        from tokencapture.store import TokenCaptureStore

        return cast(StoreLike, TokenCaptureStore(root))
    if kind == "reference":
        module: Any = importlib.import_module("tokencapture.reference")
        return cast(StoreLike, module.TokenCaptureStore(root))
    raise ValueError(f"unknown store kind {kind!r}")


def long_mode() -> bool:
    """`TOKENCAPTURE_LONG=1` turns on the long campaigns (hundreds of kills, big soaks)."""
    return os.environ.get("TOKENCAPTURE_LONG", "") not in ("", "0")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a `python -m tests.reliability.X` child started from the repo root."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)
    env.update(extra)
    return env


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=32)
def _prompt(tokens: int, offset: int) -> tuple[int, ...]:
    return tuple((offset + i * 7919) % 151_000 for i in range(tokens))


def make_entry(rollout_id: str, call_id: str, *, tokens: int = 8, variant: int = 0) -> TokenEntry:
    """A valid entry whose whole content is a function of its arguments.

    `tokens` sets the prompt length (large values make multi-megabyte lines, which a SIGKILL
    can tear); `variant` changes the payload without changing the call id (a conflict).
    """
    seed = _seed_of(f"{rollout_id}/{call_id}/{variant}")
    # Long prompts come from a small cache so that building them does not dominate a writer.
    prompt = list(_prompt(tokens, seed % 8 if tokens > 1000 else seed % 151_000))
    generated = [(seed >> 8) % 151_000 + i for i in range(3 + seed % 5)]
    extra: dict[str, Any] = {
        "reliability_extra": {"variant": variant, "nested": [[1, 2], {"k": "v"}]}
    }
    return TokenEntry(
        **extra,
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="reliability-model",
        prompt_token_ids=prompt,
        generation_token_ids=generated,
        generation_log_probs=[-((seed >> i) % 1000) / 997.0 for i in range(len(generated))],
        output_items=[
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"héllo ✓ {call_id} v{variant}"}],
            }
        ],
        token_item_index=0,
        created_at=1_700_000_000.0 + (seed % 1_000_000) / 8.0,
    )


def entry_sha(entry: TokenEntry) -> str:
    """The payload digest of an entry's canonical line."""
    return sha256(canonical_line(entry))


def listing(root: Path) -> dict[str, bytes]:
    """Every file under `root` (recursively) and its bytes: the store's whole footprint."""
    out: dict[str, bytes] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = path.read_bytes()
        else:
            out[str(path.relative_to(root)) + "/"] = b""
    return out


def rollout_files(root: Path, rollout_id: str) -> list[str]:
    """Names of the files in `root` that belong to `rollout_id`."""
    prefix = f"{rollout_id}.tokens."
    return sorted(p.name for p in root.iterdir() if p.name.startswith(prefix))


def python() -> str:
    return sys.executable


def kill_once_started(argv: Sequence[str], max_delay: float, rng: Any, started: bytes) -> bytes:
    """Run a child, wait for its first line (which must begin with `started`: it is at work),
    SIGKILL it a random 0..`max_delay` seconds later, and return everything it printed (its
    last line possibly cut short by the kill)."""
    import signal
    import subprocess
    import time

    with subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=child_env()) as child:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.startswith(started), first
        time.sleep(rng.uniform(0.0, max_delay))
        child.send_signal(signal.SIGKILL)
        out = first + child.stdout.read()
        child.wait()
    assert child.returncode == -signal.SIGKILL, child.returncode
    return out
