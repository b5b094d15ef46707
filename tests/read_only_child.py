"""The reading side of `tests/test_read_only_stores.py`, run by that test in this process and
as the test servers' unprivileged account (`tests.fake_upstream.server_runner`), which imports
this module with no pytest: `python -m tests.read_only_child FUNCTION ARGS...` prints the
function's JSON result.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

from tests.staging_backends import make_record

from tokencapture import TokenCaptureStore, TokenEntry
from tokencapture.cli import main
from tokencapture.staging import FileStagingStore


def entry(rollout_id: str, call: int) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=f"call-{call}",
        prompt_token_ids=[call, call + 1],
        generation_token_ids=[call + 2],
        generation_log_probs=[-0.5],
    )


def cli(*args: str) -> tuple[int, Any]:
    """`tokencapture ARGS --json` in this process: its exit code and its parsed output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--json"])
    return code, json.loads(out.getvalue()) if out.getvalue() else err.getvalue()


def read_everything(tokens: Path, staging: Path, copy_to: Path) -> dict[str, Any]:
    """Everything a reader can learn from both stores, through the API and the CLI."""
    seen: dict[str, Any] = {}
    store = TokenCaptureStore(tokens)
    rollouts = sorted({p.name.split(".tokens.")[0] for p in tokens.glob("*.tokens.*")})
    for rollout_id in rollouts:
        seen[f"entries {rollout_id}"] = [e.model_call_id for e in store.read_entries(rollout_id)]
        seen[f"inspect {rollout_id}"] = store.inspect(rollout_id)
        seen[f"incomplete {rollout_id}"] = store.is_incomplete(rollout_id)
    code, rows = cli("ls", str(tokens))
    for row in rows if code == 0 else []:
        row.pop("age_seconds")
    seen["ls"] = (code, rows)
    seen["show open"] = cli("show", str(tokens), "open")
    seen["verify"] = cli("verify", str(tokens))
    stage = FileStagingStore(staging)
    keys = stage.keys()
    seen["keys"] = keys
    seen["keys a/b"] = stage.keys("a/b")
    seen["fetch"] = [s.model_call_id for s in stage.fetch(keys)]
    seen["fetch_records"] = [r.digest for r in stage.fetch_records(keys)]
    solo = next(key for key in keys if key.startswith("solo"))
    seen["attachments"] = {
        name: bytes(a).hex() for name, a in stage.fetch_attachments(solo).items()
    }
    seen["damage"] = stage.damage()
    seen["retired"] = stage.retired()
    seen["ls --staging"] = cli("ls", str(staging), "--staging")
    seen["show --staging"] = cli("show", str(staging), "a/b", "--staging")
    seen["verify --staging"] = cli("verify", str(staging), "--staging")
    code, copied = cli("copy", str(staging), str(copy_to / "staging"), "--staging")
    seen["copy --staging"] = (code, copied)
    if code == 0:
        back = FileStagingStore(copy_to / "staging")
        seen["copied staging keys"] = back.keys()
    return seen


def copy_tokens(tokens: Path, copy_to: Path) -> dict[str, Any]:
    """`tokencapture copy` out of the token store, and what the copy holds."""
    code, copied = cli("copy", str(tokens), str(copy_to / "tokens"))
    seen: dict[str, Any] = {"copy": code}
    if code == 0:
        target = TokenCaptureStore(copy_to / "tokens")
        seen["copied"] = {
            r: [e.model_call_id for e in target.read_entries(r)] for r in ("open", "frozen")
        }
    else:
        seen["problem"] = copied
    return seen


def try_writes(tokens: Path, staging: Path) -> dict[str, Any]:
    """Every kind of write, each expected to fail: its error (type, errno, message)."""
    before = sorted(str(p) for p in (*tokens.iterdir(), *staging.iterdir()))
    store = TokenCaptureStore(tokens)
    failed: dict[str, Any] = {}
    writes = {
        "put open": lambda: store.append(entry("open", 99)),
        "put new": lambda: store.append(entry("new", 1)),
        "freeze": lambda: store.freeze_now("open"),
        "retire": lambda: store.retire_now(["frozen"]),
        "mark": lambda: store._mark_incomplete("open", "call-77"),
    }
    for name, write in writes.items():
        try:
            write()
        except OSError as exc:
            failed[name] = [type(exc).__name__, exc.errno, str(exc)]
        else:
            failed[name] = "succeeded"
    stage = FileStagingStore(staging)
    result = stage.stage(make_record("a/b", "c9"))
    failed["stage"] = [result.ok, result.error]
    failed["files unchanged"] = before == sorted(
        str(p) for p in (*tokens.iterdir(), *staging.iterdir())
    )
    return failed


def read_nolock(tokens: Path) -> Any:
    try:
        TokenCaptureStore(tokens).read_entries("nolock")
    except OSError as exc:
        return [type(exc).__name__, str(exc)]
    return "read"


if __name__ == "__main__":
    function, *paths = sys.argv[1:]
    print(json.dumps(globals()[function](*map(Path, paths))))
