"""Run a script of store operations under the faultfs LD_PRELOAD shim and report each outcome.

The parent (`tests/test_reliability_faults.py`) starts this module with `LD_PRELOAD` pointing
at the compiled `faultfs.c` and `FAULTFS_CONTROL` / `FAULTFS_LOG` set, and sends a JSON
object on stdin:

    {"store": "rust" | "reference", "root": DIR, "steps": [[OP, ARGS...], ...]}

Steps:
    ["arm", {"pattern": P, "ops": "write,sync,truncate", "errno": N, "budget": B, "count": C}]
    ["disarm"]
    ["put", ROLLOUT, CALL_ID, TOKENS]   append make_entry(ROLLOUT, CALL_ID, tokens=TOKENS)
    ["begin", ROLLOUT, CALL_ID]         _begin_call
    ["mark", ROLLOUT, CALL_ID]          _mark_incomplete
    ["freeze", ROLLOUT]                 freeze_now -> {ids, incomplete, version}
    ["read", ROLLOUT]                   read_entries -> ids
    ["incomplete", ROLLOUT]             is_incomplete
    ["retire", [ROLLOUTS]] / ["delete", [ROLLOUTS]]
    ["reopen"]                          a fresh store object over the same directory
    ["raw", FILE_NAME]                  the raw bytes of ROOT/FILE_NAME, as
                                        {"exists", "size", "complete", "lines"}: `complete`
                                        when empty or newline-terminated, `lines` the
                                        newline-terminated lines (decoded as UTF-8)

It prints one JSON list: per step `{"ok": RESULT}` or `{"error": {"type", "errno", "msg"}}`,
followed by `{"fired": N}` (how many faults the shim injected).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.reliability.common import StoreLike, make_entry, open_store


class Faults:
    """Writes the shim's control file (atomically: the shim may read it at any time)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.gen = 0

    def arm(self, spec: dict[str, Any]) -> None:
        self.gen += 1
        lines = [f"gen={self.gen}"] + [f"{key}={value}" for key, value in spec.items()]
        tmp = self.path.with_name(self.path.name + ".next")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.path)

    def disarm(self) -> None:
        self.arm({})


def run_step(
    store: StoreLike, faults: Faults, kind: str, root: str, step: list[Any]
) -> tuple[Any, StoreLike]:
    """Run one step; returns its result and the store to use from now on."""
    op, args = step[0], step[1:]
    if op == "arm":
        faults.arm(args[0])
        return None, store
    if op == "disarm":
        faults.disarm()
        return None, store
    if op == "reopen":
        return None, open_store(kind, root)
    if op == "raw":
        path = Path(root) / args[0]
        if not path.exists():
            return {"exists": False, "size": 0, "complete": True, "lines": []}, store
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        lines = [line.decode("utf-8", "replace") for line in complete.splitlines()]
        info = {"exists": True, "size": len(data), "complete": complete == data, "lines": lines}
        return info, store
    if op == "put":
        store.append(make_entry(args[0], args[1], tokens=args[2]))
        return None, store
    if op == "begin":
        store._begin_call(args[0], args[1])
        return None, store
    if op == "mark":
        store._mark_incomplete(args[0], args[1])
        return None, store
    if op == "freeze":
        snap = store.freeze_now(args[0])
        result = {
            "ids": [e.model_call_id for e in snap.entries],
            "incomplete": snap.incomplete,
            "version": snap.version,
        }
        return result, store
    if op == "read":
        return [e.model_call_id for e in store.read_entries(args[0])], store
    if op == "incomplete":
        return store.is_incomplete(args[0]), store
    if op == "retire":
        return dict(store.retire_now(args[0])), store
    if op == "delete":
        return dict(store.delete_now(args[0])), store
    raise ValueError(f"unknown step {step!r}")


def main() -> int:
    request = json.loads(sys.stdin.read())
    faults = Faults(os.environ["FAULTFS_CONTROL"])
    faults.disarm()
    kind, root = request["store"], request["root"]
    store = open_store(kind, root)
    results: list[dict[str, Any]] = []
    for step in request["steps"]:
        try:
            value, store = run_step(store, faults, kind, root, step)
        except Exception as exc:
            results.append(
                {
                    "error": {
                        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                        "mro": [c.__name__ for c in type(exc).__mro__],
                        "errno": getattr(exc, "errno", None),
                        "msg": str(exc),
                    }
                }
            )
            continue
        results.append({"ok": value})
    faults.disarm()
    log = os.environ.get("FAULTFS_LOG", "")
    fired = len(Path(log).read_text().splitlines()) if log and Path(log).exists() else 0
    results.append({"fired": fired})
    sys.stdout.write(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
