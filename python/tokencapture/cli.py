"""The `tokencapture` command line (also `python -m tokencapture`).

Human-readable output by default, `--json` for scripts. Errors are one line on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tokencapture.lineage import FileLineageStore, stamp_continuation
from tokencapture.records import TokenEntry, compute_digest, stamp_lineage
from tokencapture.store import TokenCaptureStore, validate_rollout_id

# Every file name the store writes: `<rollout>.tokens.<suffix>`.
_FILE_PATTERN = re.compile(
    r"^(?P<rollout>[A-Za-z0-9._-]+)\.tokens\.(?P<suffix>jsonl|state\.json|intents|incomplete|lock)$"
)
_DURATION = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>s|m|h|d)?$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class CliError(Exception):
    """A problem to report as one line, with exit code 2."""


def _existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise CliError(f"{text}: not a directory")
    return path


def _rollouts_in(root: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in root.iterdir():
        match = _FILE_PATTERN.match(path.name)
        if match:
            found.setdefault(match["rollout"], []).append(path)
    return dict(sorted(found.items()))


def _status(state: dict[str, Any]) -> str:
    if state.get("retired"):
        return "retired"
    if state.get("incomplete"):
        return "incomplete"
    if state.get("frozen"):
        return "frozen"
    return "open"


def _age(paths: Iterable[Path], now: float) -> float:
    mtimes = [p.stat().st_mtime for p in paths if p.exists()]
    return now - max(mtimes) if mtimes else 0.0


def _human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _emit(args: argparse.Namespace, payload: Any, render: Callable[[Any], str]) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True) if args.json else render(payload))


# Commands ---------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    root = _existing_dir(args.dir)
    store = TokenCaptureStore(root)
    now = time.time()
    rows = []
    for rollout_id, paths in _rollouts_in(root).items():
        problem = None
        try:
            state = store.inspect(rollout_id) or {}
        except (ValueError, OSError) as exc:  # one damaged rollout must not hide the others
            state, problem = {}, str(exc)
        log = store.path_for(rollout_id)
        rows.append(
            {
                "rollout_id": rollout_id,
                "status": "corrupt" if problem else _status(state),
                "problem": problem,
                "entries": state.get("entry_count", 0),
                "bytes": log.stat().st_size if log.exists() else 0,
                "version": state.get("version", 0),
                "age_seconds": round(_age(paths, now), 3),
            }
        )

    def render(rows: list[dict[str, Any]]) -> str:
        lines = [f"{'ROLLOUT':<32} {'STATUS':<10} {'ENTRIES':>7} {'BYTES':>12} {'VERSION':>7} AGE"]
        for row in rows:
            lines.append(
                f"{row['rollout_id']:<32} {row['status']:<10} {row['entries']:>7} "
                f"{row['bytes']:>12} {row['version']:>7} {_human_age(row['age_seconds'])}"
            )
        lines.append(f"{len(rows)} rollout(s)")
        return "\n".join(lines)

    _emit(args, rows, render)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    root = _existing_dir(args.dir)
    store = TokenCaptureStore(root)
    rollout_id = validate_rollout_id(args.rollout)
    state = store.inspect(rollout_id)
    if state is None:
        raise CliError(f"rollout {rollout_id!r} has no files in {root}")
    intents_path = store.intents_path_for(rollout_id)
    intents = (
        intents_path.read_text("utf-8", "replace").splitlines() if intents_path.exists() else []
    )
    entries = store.read_entries(rollout_id)
    stored = {e.model_call_id for e in entries}
    payload = {
        "rollout_id": rollout_id,
        "status": _status(state),
        "version": state["version"],
        "snapshot_id": state["snapshot_id"],
        "frozen": state["frozen"],
        "retired": state["retired"],
        "incomplete": state["incomplete"],
        "intents": intents,
        "dangling_intents": [i for i in intents if i not in stored],
        "entries": [
            {
                "model_call_id": e.model_call_id,
                "prompt_tokens": len(e.prompt_token_ids),
                "generated_tokens": len(e.generation_token_ids),
                "parent_call_id": e.parent_call_id,
                "parent_resolution": e.parent_resolution.value if e.parent_resolution else None,
                "prompt_is_delta": e.prompt_is_delta,
                "created_at": e.created_at,
            }
            for e in entries
        ],
    }

    def render(p: dict[str, Any]) -> str:
        lines = [
            f"rollout {p['rollout_id']}: {p['status']}, version {p['version']}, "
            f"snapshot {p['snapshot_id'] or '-'}",
            f"intents: {len(p['intents'])} ({len(p['dangling_intents'])} without an entry)",
            f"{'CALL':<32} {'PROMPT':>7} {'GEN':>6} {'PARENT':<24} RESOLUTION",
        ]
        for e in p["entries"]:
            delta = " (delta)" if e["prompt_is_delta"] else ""
            lines.append(
                f"{e['model_call_id']:<32} {e['prompt_tokens']:>7} {e['generated_tokens']:>6} "
                f"{e['parent_call_id'] or '-':<24} {e['parent_resolution'] or '-'}{delta}"
            )
        return "\n".join(lines)

    _emit(args, payload, render)
    return 0


def _verify_rollout(store: TokenCaptureStore, rollout_id: str) -> list[str]:
    """Every problem of one rollout: lines and payload digests, token digests, delta chains."""
    try:
        state = store.inspect(rollout_id)  # checks every line and every indexed payload digest
        entries = store.read_entries(rollout_id)  # full validation of every record
    except (ValueError, OSError) as exc:
        return [str(exc)]
    if state is None:
        return []
    problems = []
    by_id = {e.model_call_id: e for e in entries}
    for entry in entries:
        if entry.digest is None:
            continue
        try:
            tokens = _cumulative(entry, by_id)
        except ValueError as exc:
            problems.append(f"{rollout_id}/{entry.model_call_id}: {exc}")
            continue
        if entry.cum_len is not None and entry.cum_len != len(tokens):
            problems.append(
                f"{rollout_id}/{entry.model_call_id}: cum_len {entry.cum_len} but the chain "
                f"holds {len(tokens)} tokens"
            )
        elif compute_digest(tokens) != entry.digest:
            problems.append(f"{rollout_id}/{entry.model_call_id}: token digest mismatch")
    return problems


def _cumulative(entry: TokenEntry, by_id: dict[str, TokenEntry]) -> list[int]:
    """Rebuild an entry's cumulative tokens through its delta chain."""
    chain = [entry]
    seen = {entry.model_call_id}
    while chain[-1].prompt_is_delta:
        parent_id = chain[-1].parent_call_id
        if parent_id is None or parent_id not in by_id:
            raise ValueError(f"delta chain breaks at missing parent {parent_id!r}")
        if parent_id in seen:
            raise ValueError(f"delta chain has a cycle at {parent_id!r}")
        seen.add(parent_id)
        chain.append(by_id[parent_id])
    tokens: list[int] = []
    for link in reversed(chain):
        tokens.extend(link.prompt_token_ids)
        tokens.extend(link.generation_token_ids)
    return tokens


def cmd_verify(args: argparse.Namespace) -> int:
    root = _existing_dir(args.dir)
    store = TokenCaptureStore(root)
    rollouts = list(_rollouts_in(root))
    show_progress = args.progress or (not args.json and sys.stderr.isatty() and len(rollouts) > 20)
    problems: dict[str, list[str]] = {}
    for index, rollout_id in enumerate(rollouts, 1):
        found = _verify_rollout(store, rollout_id)
        if found:
            problems[rollout_id] = found
        if show_progress:
            width = 30
            filled = width * index // max(len(rollouts), 1)
            sys.stderr.write(
                f"\rverify [{'#' * filled}{'.' * (width - filled)}] {index}/{len(rollouts)}"
            )
            sys.stderr.flush()
    if show_progress:
        sys.stderr.write("\n")
    payload = {"rollouts": len(rollouts), "problems": problems, "ok": not problems}

    def render(p: dict[str, Any]) -> str:
        if p["ok"]:
            return f"ok: {p['rollouts']} rollout(s) verified"
        lines = [f"{sum(len(v) for v in p['problems'].values())} problem(s):"]
        for rollout_id, found in p["problems"].items():
            lines.extend(f"  {rollout_id}: {problem}" for problem in found)
        return "\n".join(lines)

    _emit(args, payload, render)
    return 0 if not problems else 1


def cmd_retire(args: argparse.Namespace) -> int:
    store = TokenCaptureStore(_existing_dir(args.dir))
    result = store.retire_now(args.ids)
    _emit(args, result, lambda r: f"retired: removed {r['removed']}, absent {r['absent']}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    store = TokenCaptureStore(_existing_dir(args.dir))
    result = store.delete_now(args.ids)
    _emit(args, result, lambda r: f"deleted: removed {r['removed']}, absent {r['absent']}")
    return 0


def _duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 12h or 7d")
    return float(match["value"]) * _UNIT_SECONDS[match["unit"] or "s"]


def cmd_sweep(args: argparse.Namespace) -> int:
    root = _existing_dir(args.dir)
    store = TokenCaptureStore(root)
    now = time.time()
    swept = []
    for rollout_id, paths in _rollouts_in(root).items():
        state_path = store.state_path_for(rollout_id)
        if not state_path.exists():
            continue
        state = json.loads(state_path.read_bytes() or b"{}")
        has_records = any(p.suffix in (".jsonl", ".intents", ".incomplete") for p in paths)
        if (
            state.get("retired")
            and not has_records
            and now - state_path.stat().st_mtime >= args.older_than
        ):
            swept.append(rollout_id)
    if swept and not args.dry_run:
        store.delete_now(swept)
    payload = {"swept": swept, "dry_run": args.dry_run}
    verb = "would remove" if args.dry_run else "removed"
    _emit(args, payload, lambda p: f"{verb} {len(p['swept'])} retired fence(s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benches" / "compare.py"
    if not script.exists():
        raise CliError("bench needs a source checkout (benches/compare.py was not found)")
    os.execv(sys.executable, [sys.executable, str(script), *args.bench_args])
    return 0  # pragma: no cover - execv does not return


async def _demo(rollouts: int, calls: int) -> None:
    """Put, resolve, freeze, drop and retire a few small agent rollouts in a temp directory."""
    with tempfile.TemporaryDirectory(prefix="tokencapture-demo-") as root:
        store = TokenCaptureStore(root)
        resolver = FileLineageStore(root)
        print(f"demo store: {root}")
        resolved = 0

        async def run_rollout(index: int) -> None:
            nonlocal resolved
            rollout_id = f"demo-{index}"
            request: list[dict[str, Any]] = [{"role": "user", "content": f"Task {index}."}]
            prompt = list(range(100 + index, 132 + index))
            for call in range(calls):
                call_id = f"call-{call}"
                # Request-time lineage: which earlier call does this request continue?
                decision = await resolver.resolve(rollout_id, request)
                if decision.match is not None:
                    # The parent's exact prompt + generation: this prompt minus its new token.
                    if list(decision.match.cumulative_token_ids) != prompt[:-1]:
                        raise RuntimeError(f"{rollout_id}/{call_id}: lineage returned other tokens")
                    resolved += 1
                await store.begin_call(rollout_id, call_id)
                generated = [1000 + call, 1001 + call]
                answer = [{"role": "assistant", "content": f"Answer {call} to task {index}."}]
                entry = TokenEntry(
                    rollout_id=rollout_id,
                    model_call_id=call_id,
                    model="demo-model",
                    prompt_token_ids=prompt,
                    generation_token_ids=generated,
                    generation_log_probs=[-0.25, -0.5],
                    output_items=answer,
                    created_at=time.time(),
                )
                parent = decision.match.model_call_id if decision.match else None
                stamp_lineage(entry, parent, parent_resolution=decision.status)
                await store.put(stamp_continuation(entry, request))
                request = [*request, *answer, {"role": "user", "content": "Go on."}]
                prompt = [*prompt, *generated, 7]

        started = time.perf_counter()
        await asyncio.gather(*(run_rollout(i) for i in range(rollouts)))
        elapsed = time.perf_counter() - started
        print(
            f"put {rollouts * calls} entries durably (fsync each) in {elapsed * 1000:.1f} ms; "
            f"{resolved} requests resolved to their parent call's exact tokens"
        )
        for index in range(rollouts):
            rollout_id = f"demo-{index}"
            snapshot = await store.freeze(rollout_id)
            tokens = sum(
                len(e.prompt_token_ids) + len(e.generation_token_ids) for e in snapshot.entries
            )
            dropped = await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)
            print(
                f"{rollout_id}: froze {len(snapshot.entries)} entries ({tokens} tokens), "
                f"version {snapshot.version}, incomplete={snapshot.incomplete}, "
                f"snapshot {snapshot.snapshot_id[:8]}; dropped={dropped}"
            )
        removal = await store.retire([f"demo-{i}" for i in range(rollouts)])
        print(f"retired {len(removal['absent'])} dropped rollouts again: a no-op, fences kept")
        await resolver.close()
        await store.close()


def cmd_demo(args: argparse.Namespace) -> int:
    asyncio.run(_demo(args.rollouts, args.calls))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokencapture", description="Inspect and manage a token capture directory."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        if name not in ("demo", "bench"):
            sub.add_argument("--json", action="store_true", help="machine-readable output")
        return sub

    demo = command(
        "demo",
        cmd_demo,
        "put, resolve, freeze, drop and retire a few rollouts in a temporary directory",
    )
    demo.add_argument("--rollouts", type=int, default=4)
    demo.add_argument("--calls", type=int, default=3)
    command(
        "ls", cmd_ls, "list rollouts with status, entries, bytes, version and age"
    ).add_argument("dir")
    show = command(
        "show", cmd_show, "summarize one rollout: entries, intents, version, snapshot id"
    )
    show.add_argument("dir")
    show.add_argument("rollout")
    verify = command(
        "verify", cmd_verify, "re-check every line, payload digest, token digest and delta chain"
    )
    verify.add_argument("dir")
    verify.add_argument("--progress", action="store_true", help="always show the progress bar")
    for name, handler, help in (
        ("retire", cmd_retire, "remove records and keep fences"),
        ("delete", cmd_delete, "remove records, fences and locks"),
    ):
        sub = command(name, handler, help)
        sub.add_argument("dir")
        sub.add_argument("ids", nargs="+", metavar="ROLLOUT")
    sweep = command("sweep", cmd_sweep, "delete retired fences older than a duration")
    sweep.add_argument("dir")
    sweep.add_argument(
        "--older-than",
        type=_duration,
        required=True,
        metavar="DURATION",
        help="e.g. 90s, 30m, 12h, 7d",
    )
    sweep.add_argument("--dry-run", action="store_true")
    bench = command("bench", cmd_bench, "run the benchmark comparison (benches/compare.py)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except BrokenPipeError:
        # The reader (say `| head`) stopped early: not an error; silence the final flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as exc:
        print(f"tokencapture: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"tokencapture: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tokencapture: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
