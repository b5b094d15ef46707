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
from typing import TYPE_CHECKING, Any

from tokencapture.lineage import FileLineageStore, stamp_continuation
from tokencapture.records import TokenEntry, compute_digest, stamp_lineage
from tokencapture.rollout_files import complete_lines
from tokencapture.store import TokenCaptureStore, validate_rollout_id
from tokencapture.transfer import (
    IMPORTING_SUFFIX,
    export_from_directory,
    import_into_directory,
    rollouts_in_directory,
)

if TYPE_CHECKING:
    from tokencapture.postgres import PostgresTokenCaptureStore

# Every file name the store writes: `<rollout>.tokens.<suffix>`.
_FILE_PATTERN = re.compile(
    r"^(?P<rollout>[A-Za-z0-9._-]+)\.tokens\.(?P<suffix>jsonl|state\.json|intents|incomplete|lock|importing)$"
)
_DURATION = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>s|m|h|d)?$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# Exit codes: 0 done; 1 the command ran and found problems (verify, copy); 2 it could not run
# (bad arguments, as argparse says them too; no such store; an I/O or database error).
EXIT_PROBLEMS = 1
EXIT_ERROR = 2


class CliError(Exception):
    """A problem to report as one line, with exit code 2."""


def _is_dsn(text: str) -> bool:
    """Whether a store argument names a PostgreSQL database rather than a directory."""
    return text.startswith(("postgresql://", "postgres://"))


def _pg_store(dsn: str) -> PostgresTokenCaptureStore:
    from tokencapture.postgres import PostgresTokenCaptureStore

    return PostgresTokenCaptureStore(dsn)


def _pg_query(store: PostgresTokenCaptureStore, sql: str, *args: Any) -> list[Any]:
    """Rows of an operator query (not a store operation) on the store's connections, with the
    store's errors (an unavailable server is `PostgresUnavailableError`, said as every
    command says it)."""
    client = store._client
    return list(client.run_sync(client.fetch("rows", sql, *args)))


def _one_line(text: str) -> str:
    """An error message on one line: a server's message may span several (a Citus worker
    down: "connection to the remote node ... failed", then "Is the server running on that
    host ..." on a line of its own), and the CLI says every error in one."""
    return re.sub(r"[ \t]*[\r\n]+\s*", " ", text).strip()


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


_PG_LS = """
SELECT r.rollout_id, r.frozen, r.retired, r.incomplete, r.version,
       extract(epoch FROM now() - r.retired_at) AS retired_seconds,
       count(e.rollout_id) AS entries, coalesce(sum(octet_length(e.line) + 1), 0) AS bytes
FROM tokencapture.rollouts r LEFT JOIN tokencapture.entries e USING (rollout_id)
GROUP BY r.rollout_id ORDER BY r.rollout_id
"""


def _ls_postgres(dsn: str) -> list[dict[str, Any]]:
    store = _pg_store(dsn)
    try:
        return [
            {
                "rollout_id": row["rollout_id"],
                "status": _status(dict(row)),
                "problem": None,
                "entries": row["entries"],
                "bytes": int(row["bytes"]),
                "version": row["version"],
                # The store keeps no modification times; a fence knows when it was set.
                "age_seconds": (
                    None
                    if row["retired_seconds"] is None
                    else round(float(row["retired_seconds"]), 3)
                ),
            }
            for row in _pg_query(store, _PG_LS)
        ]
    finally:
        store.close_sync()


def cmd_ls(args: argparse.Namespace) -> int:
    if args.staging:
        return _staging_ls(args)
    if _is_dsn(args.dir):
        _emit(args, _ls_postgres(args.dir), _render_ls)
        return 0
    root = _existing_dir(args.dir)
    store = TokenCaptureStore(root)
    now = time.time()
    rows = []
    for rollout_id, paths in _rollouts_in(root).items():
        problem = status = None
        try:
            state = store.inspect(rollout_id) or {}
        except (ValueError, OSError) as exc:  # one bad rollout must not hide the others
            # Damage is "corrupt"; a file the store cannot open (permissions, I/O) is not
            # evidence of damage, and says so.
            state, problem = {}, str(exc)
            status = "unreadable" if isinstance(exc, OSError) else "corrupt"
        if _copy_cut_short(root, rollout_id):
            status, problem = "partial-copy", _COPY_CUT_SHORT
        log = store.path_for(rollout_id)
        rows.append(
            {
                "rollout_id": rollout_id,
                "status": status or _status(state),
                "problem": problem,
                "entries": state.get("entry_count", 0),
                "bytes": log.stat().st_size if log.exists() else 0,
                "version": state.get("version", 0),
                "age_seconds": round(_age(paths, now), 3),
            }
        )

    _emit(args, rows, _render_ls)
    return 0


_COPY_CUT_SHORT = (
    "a copy into this directory was cut short here: run the copy again (it refuses a rollout "
    "a writer has used since: delete that one here first)"
)


def _copy_cut_short(root: Path, rollout_id: str) -> bool:
    """Whether an import of `copy` left its marker beside the rollout's files (a crash cut it
    short: the files may be a partial copy, which the next copy redoes)."""
    return (root / f"{rollout_id}{IMPORTING_SUFFIX}").exists()


def _render_ls(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'ROLLOUT':<32} {'STATUS':<12} {'ENTRIES':>7} {'BYTES':>12} {'VERSION':>7} AGE"]
    for row in rows:
        age = "-" if row["age_seconds"] is None else _human_age(row["age_seconds"])
        lines.append(
            f"{row['rollout_id']:<32} {row['status']:<12} {row['entries']:>7} "
            f"{row['bytes']:>12} {row['version']:>7} {age}"
        )
    lines.append(f"{len(rows)} rollout(s)")
    return "\n".join(lines)


def _show_postgres(dsn: str, rollout_id: str) -> tuple[dict[str, Any], list[str], list[TokenEntry]]:
    from tokencapture.postgres.transfer import export_from_postgres

    store = _pg_store(dsn)
    try:
        image = store._client.run_sync(export_from_postgres(store._client, rollout_id))
        if image is None:
            raise CliError(f"rollout {rollout_id!r} is not in the database")
        state = {
            "version": image.version,
            "snapshot_id": image.snapshot_id,
            "frozen": image.frozen,
            "retired": image.retired,
            "incomplete": image.incomplete,
        }
        intents = [intent.decode("utf-8", "replace") for intent in image.intents]
        return state, intents, store.read_entries(rollout_id)
    finally:
        store.close_sync()


def cmd_show(args: argparse.Namespace) -> int:
    if args.staging:
        return _staging_show(args)
    rollout_id = validate_rollout_id(args.rollout)
    if _is_dsn(args.dir):
        state, intents, entries = _show_postgres(args.dir, rollout_id)
    else:
        root = _existing_dir(args.dir)
        store = TokenCaptureStore(root)
        found = store.inspect(rollout_id)
        if found is None:
            raise CliError(f"rollout {rollout_id!r} has no files in {root}")
        state = found
        # The shared reader: a torn last line (a crash mid-append) was never acknowledged, so
        # it is no intent (as the gateway's summary and NeMo Gym's freeze read the file).
        lines = complete_lines(store.intents_path_for(rollout_id))
        intents = [line.decode("utf-8", "replace") for line in lines if line]
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


def _verify_rollout(
    store: TokenCaptureStore | PostgresTokenCaptureStore, rollout_id: str
) -> list[str]:
    """Every problem of one rollout: lines and payload digests, token digests, delta chains."""
    try:
        # A directory: every line and every indexed payload digest checked first.
        if isinstance(store, TokenCaptureStore) and store.inspect(rollout_id) is None:
            return []
        # Full validation of every record (PostgreSQL: each line against its digest first).
        entries = store.read_entries(rollout_id)
    except (ValueError, OSError) as exc:
        return [str(exc)]
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
    if args.staging:
        return _staging_verify(args)
    store: TokenCaptureStore | PostgresTokenCaptureStore
    if _is_dsn(args.dir):
        store = _pg_store(args.dir)
        rollouts = [
            row["rollout_id"]
            for row in _pg_query(
                store, "SELECT rollout_id FROM tokencapture.rollouts ORDER BY rollout_id"
            )
        ]
    else:
        root = _existing_dir(args.dir)
        store = TokenCaptureStore(root)
        rollouts = list(_rollouts_in(root))
    show_progress = args.progress or (not args.json and sys.stderr.isatty() and len(rollouts) > 20)
    problems: dict[str, list[str]] = {}
    for index, rollout_id in enumerate(rollouts, 1):
        found = _verify_rollout(store, rollout_id)
        if isinstance(store, TokenCaptureStore) and _copy_cut_short(store.root, rollout_id):
            found = [_COPY_CUT_SHORT, *found]
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
    if not isinstance(store, TokenCaptureStore):
        store.close_sync()
    payload = {"rollouts": len(rollouts), "problems": problems, "ok": not problems}

    return _verified(args, payload, f"ok: {len(rollouts)} rollout(s) verified")


def _verified(args: argparse.Namespace, payload: dict[str, Any], ok_line: str) -> int:
    """Report a verification (`payload["problems"]`: rollout -> problems); exit 1 on any."""

    def render(p: dict[str, Any]) -> str:
        if p["ok"]:
            return ok_line
        lines = [f"{sum(len(v) for v in p['problems'].values())} problem(s):"]
        for rollout_id, found in p["problems"].items():
            lines.extend(f"  {rollout_id}: {problem}" for problem in found)
        return "\n".join(lines)

    _emit(args, payload, render)
    return 0 if payload["ok"] else EXIT_PROBLEMS


def _removal(args: argparse.Namespace, operation: str) -> Any:
    if args.staging:
        return _staging_removal(args, operation)
    if _is_dsn(args.dir):
        store = _pg_store(args.dir)
        try:
            return getattr(store, operation)(args.ids)
        finally:
            store.close_sync()
    return getattr(TokenCaptureStore(_existing_dir(args.dir)), operation)(args.ids)


def cmd_retire(args: argparse.Namespace) -> int:
    result = _removal(args, "retire_now")
    _emit(args, result, lambda r: f"retired: removed {r['removed']}, absent {r['absent']}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    result = _removal(args, "delete_now")
    _emit(args, result, lambda r: f"deleted: removed {r['removed']}, absent {r['absent']}")
    return 0


def _duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 30m, 12h or 7d")
    return float(match["value"]) * _UNIT_SECONDS[match["unit"] or "s"]


def cmd_sweep(args: argparse.Namespace) -> int:
    """`sweep_retired` of the store (file or PostgreSQL), listing what it removes."""
    if _is_dsn(args.dir):
        pg = _pg_store(args.dir)
        try:
            swept = pg.sweep_retired_ids(args.older_than, dry_run=args.dry_run)
        finally:
            pg.close_sync()
    else:
        store = TokenCaptureStore(_existing_dir(args.dir))
        swept = store.sweep_retired_ids(args.older_than, dry_run=args.dry_run)
    payload = {"swept": swept, "dry_run": args.dry_run}
    verb = "would remove" if args.dry_run else "removed"
    _emit(args, payload, lambda p: f"{verb} {len(p['swept'])} retired fence(s)")
    return 0


def cmd_db_init(args: argparse.Namespace) -> int:
    if not _is_dsn(args.dsn):
        raise CliError(f"{args.dsn}: not a postgresql:// connection string")
    from tokencapture.postgres import (
        SCHEMA_VERSION,
        PostgresCitusError,
        describe_distribution_sync,
        install_schema_sync,
    )

    try:
        applied = install_schema_sync(args.dsn, citus=True if args.citus else None)
        distribution = describe_distribution_sync(args.dsn)
    except PostgresCitusError as exc:
        raise CliError(str(exc)) from exc
    payload: dict[str, Any] = {"applied": applied, "schema_version": SCHEMA_VERSION}
    if distribution["citus"]:  # a Citus coordinator: how the schema is distributed
        payload["citus"] = distribution
    _emit(
        args,
        payload,
        lambda p: (
            f"schema version {p['schema_version']}: "
            + (f"applied {', '.join(p['applied'])}" if p["applied"] else "already current")
            + (
                f"; distributed with Citus ({len(p['citus']['tables'])} tables, "
                f"{len(p['citus']['delegated'])} functions delegated by rollout id)"
                if "citus" in p
                else ""
            )
        ),
    )
    return 0


class _Backend:
    """One side of `copy`: a store directory or a PostgreSQL database."""

    def __init__(self, location: str, *, create: bool) -> None:
        self.location = location
        self.pg: PostgresTokenCaptureStore | None = None
        self.files: TokenCaptureStore | None = None
        if _is_dsn(location):
            self.pg = _pg_store(location)
        else:
            path = Path(location)
            if not create:
                _existing_dir(location)
            self.files = TokenCaptureStore(path)

    def rollouts(self) -> list[str]:
        if self.pg is not None:
            from tokencapture.postgres import transfer

            return self.pg._client.run_sync(transfer.rollouts_in_postgres(self.pg._client))
        assert self.files is not None
        return rollouts_in_directory(self.files.root)

    def export(self, rollout_id: str) -> Any:
        if self.pg is not None:
            from tokencapture.postgres import transfer

            client = self.pg._client
            return client.run_sync(transfer.export_from_postgres(client, rollout_id))
        assert self.files is not None
        return export_from_directory(self.files, rollout_id)

    def create(self, image: Any) -> bool:
        if self.pg is not None:
            from tokencapture.postgres import transfer

            client = self.pg._client
            return client.run_sync(transfer.import_into_postgres(client, image))
        assert self.files is not None
        return import_into_directory(self.files, image)

    def reach(self) -> None:
        """Contact the database, if this side is one (a directory: nothing): an unreachable
        server raises `PostgresUnavailableError` here, before anything is copied."""
        if self.pg is not None:
            client = self.pg._client
            client.run_sync(client.fetch("val", "SELECT 1"))

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close_sync()


def _unavailable(exc: BaseException) -> bool:
    """Whether `exc` is a PostgreSQL server that did not answer (`PostgresUnavailableError`;
    only raised once `tokencapture.postgres` is imported, which a copy between two
    directories never does)."""
    client = sys.modules.get("tokencapture.postgres._client")
    return client is not None and isinstance(exc, client.PostgresUnavailableError)


def _stopped(payload: dict[str, Any], not_attempted: list[str] | None) -> None:
    """Add `not_attempted` to a copy's report when a server went away mid-copy, which stops it:
    what was not tried (rollouts; with `--staging`, staged calls' keys), empty if it went away
    at the last one. Absent when no server went away, so such a report keeps its keys."""
    if not_attempted is not None:
        payload["not_attempted"] = not_attempted


def _not_attempted_line(what: str, not_attempted: list[str]) -> str:
    return (
        f"not attempted, the copy stopped when a PostgreSQL server went away "
        f"({len(not_attempted)} {what}; run the same copy again once it is back): "
        f"{', '.join(not_attempted)}"
    )


def _lost_server(lost: list[str], copied: int) -> int | None:
    """The exit code of a copy a server went away in the middle of (`lost`: what the first
    such failure said): 2, said on stderr too, if nothing was copied; None (the usual code)
    if some was."""
    if not lost or copied:
        return None
    print(f"tokencapture: error: {_one_line(lost[0])} (nothing was copied)", file=sys.stderr)
    return EXIT_ERROR


def cmd_copy(args: argparse.Namespace) -> int:
    if args.staging:
        return _staging_copy(args)
    source = _Backend(args.source, create=False)
    target = _Backend(args.target, create=True)
    copied: list[dict[str, Any]] = []
    skipped: list[str] = []
    missing: list[str] = []
    unreadable: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    lost: list[str] = []  # a server that went away mid-copy: what it said
    not_attempted: list[str] | None = None  # set when that stopped the copy
    try:
        # Each database side is reached before anything is copied: a server that does not
        # answer is the one-line error every command gives it (exit 2), not a failure listed
        # under every rollout.
        source.reach()
        target.reach()
        names = list(args.rollouts or source.rollouts())
        for index, rollout_id in enumerate(names):
            # A server that went away stops the copy: trying the rest would cost each rollout
            # the connect timeout; they are listed as not attempted (run the copy again).
            if lost:
                not_attempted = names[index:]
                break
            try:
                image = source.export(validate_rollout_id(rollout_id))
            except (OSError, ValueError) as exc:  # one damaged rollout must not stop the rest
                unreadable.append({"rollout_id": rollout_id, "problem": str(exc)})
                if _unavailable(exc):
                    lost.append(str(exc))
                continue
            if image is None:
                missing.append(rollout_id)
                continue
            try:
                created = target.create(image)
            except (OSError, ValueError) as exc:  # a full disk; a used partial copy: say which
                failed.append({"rollout_id": rollout_id, "problem": str(exc)})
                if _unavailable(exc):
                    lost.append(str(exc))
                continue
            if created:
                copied.append(image.summary())
            else:
                skipped.append(rollout_id)
        if lost and not_attempted is None:
            not_attempted = []  # it went away at the last rollout
    finally:
        source.close()
        target.close()
    payload = {
        "copied": copied,
        "exists_in_target": skipped,
        "missing_in_source": missing,
        "unreadable_in_source": unreadable,
        "failed_in_target": failed,
    }
    _stopped(payload, not_attempted)

    def render(p: dict[str, Any]) -> str:
        lines = [
            f"copied {len(p['copied'])} rollout(s) "
            f"({sum(c['entries'] for c in p['copied'])} entries)"
        ]
        if p["exists_in_target"]:
            lines.append(f"not copied, already in the target: {', '.join(p['exists_in_target'])}")
        if p["missing_in_source"]:
            lines.append(f"not in the source: {', '.join(p['missing_in_source'])}")
        lines.extend(
            f"not copied, unreadable in the source: {u['rollout_id']}: {u['problem']}"
            for u in p["unreadable_in_source"]
        )
        lines.extend(
            f"not copied, the target refused it: {f['rollout_id']}: {f['problem']}"
            for f in p["failed_in_target"]
        )
        if "not_attempted" in p:
            lines.append(_not_attempted_line("rollout(s)", p["not_attempted"]))
        return "\n".join(lines)

    _emit(args, payload, render)
    clean = not skipped and not missing and not unreadable and not failed and not not_attempted
    code = _lost_server(lost, len(copied))
    return code if code is not None else 0 if clean else EXIT_PROBLEMS


# Staging stores (`--staging`): a FileStagingStore directory or a PostgresStagingStore DSN ----


def _staging_store(location: str, *, create: bool = False, reading: bool = False) -> Any:
    """The staging store at `location` (a directory, or a postgresql:// DSN). `reading`: a
    command that only reads, refused on a directory that holds no staging store (it would
    otherwise leave a `store.lock` there, in a token store say)."""
    if _is_dsn(location):
        from tokencapture.postgres import PostgresStagingStore

        return PostgresStagingStore(location, models="tokencapture")
    from tokencapture.staging import FileStagingStore

    if not create:
        path = _existing_dir(location)
        if reading and not (path / "control.log").exists() and not any(path.glob("seg-*.tcs")):
            tokens = any(path.glob("*.tokens.jsonl"))
            raise CliError(
                f"{location}: holds no staging store (no control.log, no segment)"
                + ("; it holds a token store: leave out --staging" if tokens else "")
            )
    return FileStagingStore(location, models="tokencapture")


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()


def _staged_by_rollout(
    store: Any, rollout_ids: Sequence[str] | None = None
) -> dict[str, list[Any]]:
    """The verified records of every staged key (of `rollout_ids`, or all), by rollout, each
    rollout's calls in chain order (by cumulative length, then key)."""
    if rollout_ids:
        keys = [key for rollout_id in rollout_ids for key in store.keys(rollout_id)]
    else:
        keys = store.keys()
    grouped: dict[str, list[Any]] = {}
    for record in store.fetch_records(keys) if keys else []:
        grouped.setdefault(record.rollout_id, []).append(record)
    for records in grouped.values():
        records.sort(key=lambda r: (r.cum_len, r.staging_key))
    return dict(sorted(grouped.items()))


def _staging_ls(args: argparse.Namespace) -> int:
    store = _staging_store(args.dir, reading=True)
    try:
        grouped = _staged_by_rollout(store)
        retired = store.retired()
    finally:
        _close(store)
    rows = [
        {
            "rollout_id": rollout_id,
            "calls": len(records),
            "tokens": sum(r.delta_len for r in records),
            "max_cum_len": max(r.cum_len for r in records),
            "weight_versions": sorted({r.weight_version for r in records}),
            "retired": False,
        }
        for rollout_id, records in grouped.items()
    ]
    # A retired rollout's calls are no longer fetchable, but its fence is there: listed, marked.
    rows.extend(
        {
            "rollout_id": rollout_id,
            "calls": 0,
            "tokens": 0,
            "max_cum_len": 0,
            "weight_versions": [],
            "retired": True,
        }
        for rollout_id in retired
        if rollout_id not in grouped
    )
    rows.sort(key=lambda row: row["rollout_id"])

    def render(found: list[dict[str, Any]]) -> str:
        lines = [f"{'ROLLOUT':<32} {'CALLS':>6} {'TOKENS':>9} {'MAX_CUM':>9} WEIGHTS"]
        for row in found:
            weights = ",".join(str(w) for w in row["weight_versions"])
            if row["retired"]:
                weights = "(retired)"
            lines.append(
                f"{row['rollout_id']:<32} {row['calls']:>6} {row['tokens']:>9} "
                f"{row['max_cum_len']:>9} {weights}"
            )
        fenced = sum(1 for row in found if row["retired"])
        lines.append(f"{len(found) - fenced} staged rollout(s), {fenced} retired")
        return "\n".join(lines)

    _emit(args, rows, render)
    return 0


def _staging_show(args: argparse.Namespace) -> int:
    store = _staging_store(args.dir, reading=True)
    try:
        records = _staged_by_rollout(store, [args.rollout]).get(args.rollout, [])
        if not records:
            raise CliError(f"rollout {args.rollout!r} has no staged calls in {args.dir}")
        calls = [
            {
                "staging_key": r.staging_key,
                "model_call_id": r.model_call_id,
                "parent_call_id": r.parent_call_id,
                "mode": r.mode,
                "prev_len": r.prev_len,
                "delta_len": r.delta_len,
                "cum_len": r.cum_len,
                "weight_version": r.weight_version,
                "generated_tokens": sum(1 for m in r.token_mask_delta if m),
                "extras": sorted(r.extras) if r.extras else [],
                "attachments": sorted(store.fetch_attachments(r.staging_key)),
            }
            for r in records
        ]
    finally:
        _close(store)
    payload = {"rollout_id": args.rollout, "calls": calls}

    def render(p: dict[str, Any]) -> str:
        lines = [
            f"rollout {p['rollout_id']}: {len(p['calls'])} staged call(s)",
            f"{'CALL':<24} {'PARENT':<24} {'MODE':<8} {'PREV':>6} {'DELTA':>6} {'CUM':>6} "
            f"{'EXTRAS':<16} ATTACHMENTS",
        ]
        for c in p["calls"]:
            lines.append(
                f"{c['model_call_id']:<24} {c['parent_call_id'] or '-':<24} {c['mode']:<8} "
                f"{c['prev_len']:>6} {c['delta_len']:>6} {c['cum_len']:>6} "
                f"{','.join(c['extras']) or '-':<16} {','.join(c['attachments']) or '-'}"
            )
        return "\n".join(lines)

    _emit(args, payload, render)
    return 0


def _chain_problems(records: list[Any]) -> list[str]:
    """What is wrong with one rollout's staged chain: a parent that is not staged, lengths that
    do not add up, chain or cumulative hashes that are not the tokens' (NeMo's algorithms)."""
    from tokencapture.staging_digest import compute_chain_hash, hash_token_ids

    by_call = {r.model_call_id: r for r in records}
    problems = []
    for record in records:
        where = record.staging_key
        tokens: list[int] = []
        link: Any = record
        seen: set[str] = set()
        chain = []
        while link is not None and link.model_call_id not in seen:
            seen.add(link.model_call_id)
            chain.append(link)
            link = by_call.get(link.parent_call_id) if link.parent_call_id else None
        root = chain[-1]
        if root.parent_call_id is not None:
            problems.append(f"{where}: parent {root.parent_call_id!r} is not staged")
            continue
        parent_hash = None
        for step in reversed(chain):
            if step.prev_len != len(tokens):
                problems.append(
                    f"{where}: {step.model_call_id} has prev_len {step.prev_len} but its chain "
                    f"holds {len(tokens)} tokens before it"
                )
                break
            tokens.extend(step.token_ids_delta)
            parent_hash = compute_chain_hash(parent_hash, step.token_ids_delta)
        else:
            if record.chain_hash != parent_hash:
                problems.append(f"{where}: chain_hash is not the hash of its chain")
            if record.cumulative_hash != hash_token_ids(tokens):
                problems.append(f"{where}: cumulative_hash is not the hash of its chain's tokens")
    return problems


def _rollout_of_key(store: Any, key: str, known: dict[str, set[str]]) -> str:
    """The rollout a staged key belongs to, when its record cannot be read. NeMo Gym's key is
    ``"<rollout_id>/<model_call_id>"`` and either id may hold ``/``, so the key alone does not
    say where the rollout id ends: each split is tried against the keys the store lists for
    that rollout (which it files by the rollout id stored with the row). `known` caches those
    listings."""
    at = key.find("/")
    while at != -1:
        candidate = key[:at]
        if candidate not in known:
            try:
                known[candidate] = set(store.keys(candidate))
            except (ValueError, LookupError, OSError):
                known[candidate] = set()
        if key in known[candidate]:
            return candidate
        at = key.find("/", at + 1)
    return key.rpartition("/")[0] or key  # not listed under any split: the longest one


def _staging_verify(args: argparse.Namespace) -> int:
    store = _staging_store(args.dir, reading=True)
    problems: dict[str, list[str]] = {}
    grouped: dict[str, list[Any]] = {}
    keys: list[str] = []
    damaged: list[tuple[str, int, int]] = []
    listed: dict[str, set[str]] = {}
    try:
        # A file store's damaged ranges: acknowledged frames that no longer read back. Their
        # keys are not listed, so no fetch below would name them.
        damage = getattr(store, "damage", None)
        damaged = list(damage()) if callable(damage) else []
        keys = store.keys()
        for key in keys:  # one at a time: a damaged key must not hide the others
            try:
                (record,) = store.fetch_records([key])
                store.fetch_attachments(key)
            except (ValueError, LookupError, OSError) as exc:
                rollout_id = _rollout_of_key(store, key, listed)
                problems.setdefault(rollout_id, []).append(f"{key}: {exc}")
                continue
            grouped.setdefault(record.rollout_id, []).append(record)
    finally:
        _close(store)
    for rollout_id, records in grouped.items():
        found = _chain_problems(records)
        if found:
            problems.setdefault(rollout_id, []).extend(found)
    for segment, start, end in damaged:
        problems.setdefault("(damaged)", []).append(
            f"{segment}: bytes {start}..{end} of acknowledged frames no longer read back "
            "(the calls they held cannot be fetched)"
        )
    payload = {
        "keys": len(keys),
        "rollouts": len(grouped),
        "damaged": [list(entry) for entry in damaged],
        "problems": problems,
        "ok": not problems,
    }

    ok_line = f"ok: {len(keys)} staged call(s) of {len(grouped)} rollout(s) verified"
    return _verified(args, payload, ok_line)


def _staging_removal(args: argparse.Namespace, operation: str) -> Any:
    store = _staging_store(args.dir)
    try:
        return getattr(store, operation)(args.ids)
    finally:
        _close(store)


def _restageable(attachment: Any) -> Any:
    """A fetched attachment as a value that stages to the same stored attachment."""
    if attachment.kind == "bytes":
        return attachment.data
    if attachment.kind == "arrow":
        return attachment.to_arrow()
    if attachment.dtype:
        return attachment.to_numpy()
    view = memoryview(attachment.data)
    return view.cast(attachment.format or "B", attachment.shape) if attachment.shape else view


def _staging_copy(args: argparse.Namespace) -> int:
    source = _staging_store(args.source, reading=True)
    target = _staging_store(args.target, create=True)
    copied: dict[str, int] = {}
    refused: list[str] = []
    mismatched: list[str] = []
    not_copied: set[tuple[str, str]] = set()  # (rollout, call): its children are not either
    lost: list[str] = []  # a server that went away mid-copy: what it said
    not_attempted: list[str] | None = None  # set when that stopped the copy
    try:
        # A database target is reached before anything is copied (a source is, listing its
        # keys): one that does not answer is the one-line error of every command, exit 2.
        if _is_dsn(args.target):
            target.retired()
        # Frames the source acknowledged that no longer read back: not copied, and said so.
        damage = getattr(source, "damage", None)
        damaged = [list(entry) for entry in damage()] if callable(damage) else []
        calls = [
            (rollout_id, record)
            for rollout_id, records in _staged_by_rollout(source, args.rollouts).items()
            for record in records
        ]
        for index, (rollout_id, record) in enumerate(calls):
            # A server that went away stops the copy: trying the rest would cost each call the
            # connect timeout; they are listed as not attempted (run the copy again).
            if lost:
                not_attempted = [call.staging_key for _, call in calls[index:]]
                break
            key = record.staging_key
            parent = record.parent_call_id
            if parent is not None and (rollout_id, parent) in not_copied:
                refused.append(f"{key}: its parent call {parent!r} was not copied")
                not_copied.add((rollout_id, record.model_call_id))
                continue
            try:
                attachments = source.fetch_attachments(key)
            except OSError as exc:
                if not _unavailable(exc):
                    raise
                lost.append(str(exc))  # the source went away: this call is not tried either
                not_attempted = [call.staging_key for _, call in calls[index:]]
                break
            restaged = {name: _restageable(a) for name, a in attachments.items()}
            result = target.stage(record, attachments=restaged or None)
            if not result.ok:
                refused.append(f"{key}: {result.error}")
                if result.error.startswith("PostgresUnavailableError: "):  # failure_reason
                    lost.append(result.error.split(": ", 1)[1])
                not_copied.add((rollout_id, record.model_call_id))
                continue
            # Verified: the target gives back the same record and attachments.
            try:
                (back,) = target.fetch_records([key])
                same = back.model_dump() == record.model_dump() and (
                    target.fetch_attachments(key) == attachments
                )
            except OSError as exc:
                if not _unavailable(exc):
                    raise
                # Staged, but the target went away before it was read back: not verified
                # (the same copy run again stages it again, idempotently, and compares).
                lost.append(str(exc))
                refused.append(
                    f"{key}: staged, but not read back to compare: {_one_line(str(exc))}"
                )
                not_copied.add((rollout_id, record.model_call_id))
                continue
            if not same:
                mismatched.append(key)
                not_copied.add((rollout_id, record.model_call_id))
                continue
            copied[rollout_id] = copied.get(rollout_id, 0) + 1
        if lost and not_attempted is None:
            not_attempted = []  # it went away at the last call
        try:
            missing = [r for r in args.rollouts or [] if r not in copied and not source.keys(r)]
        except OSError as exc:
            if not (lost and _unavailable(exc)):
                raise
            missing = []  # the source went away: which named rollouts it lacks is unknown
    finally:
        _close(source)
        _close(target)
    payload = {
        "copied": copied,
        "refused": refused,
        "mismatched": mismatched,
        "missing_in_source": missing,
        "damaged_in_source": damaged,
    }
    _stopped(payload, not_attempted)

    def render(p: dict[str, Any]) -> str:
        lines = [
            f"copied {sum(p['copied'].values())} staged call(s) of {len(p['copied'])} "
            "rollout(s), each fetched back from the target and compared"
        ]
        lines.extend(f"refused by the target: {line}" for line in p["refused"])
        if p["mismatched"]:
            lines.append(f"fetched back different: {', '.join(p['mismatched'])}")
        if p["missing_in_source"]:
            lines.append(f"not in the source: {', '.join(p['missing_in_source'])}")
        lines.extend(
            f"damaged in the source, not copied: segment {segment} bytes {start}..{end}"
            for segment, start, end in p["damaged_in_source"]
        )
        if "not_attempted" in p:
            lines.append(_not_attempted_line("staged call(s)", p["not_attempted"]))
        return "\n".join(lines)

    _emit(args, payload, render)
    code = _lost_server(lost, sum(copied.values()))
    if code is not None:
        return code
    clean = not refused and not mismatched and not missing and not damaged and not not_attempted
    return 0 if clean else EXIT_PROBLEMS


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benches" / "compare.py"
    if not script.exists():
        raise CliError("bench needs a source checkout (benches/compare.py was not found)")
    os.execv(sys.executable, [sys.executable, str(script), *args.bench_args])
    return 0  # pragma: no cover - execv does not return


async def _demo(rollouts: int, calls: int, dsn: str | None = None) -> None:
    """Put, resolve, freeze, drop and retire a few small agent rollouts in a temp directory
    (or, with `dsn`, in a PostgreSQL database, under rollout ids of their own)."""
    with tempfile.TemporaryDirectory(prefix="tokencapture-demo-") as root:
        store: Any
        resolver: Any
        prefix = "demo"
        if dsn is not None:
            from tokencapture.postgres import PostgresLineageStore, PostgresTokenCaptureStore

            store = PostgresTokenCaptureStore(dsn, install_schema=True)
            resolver = PostgresLineageStore(dsn, install_schema=True)
            prefix = f"demo-{os.urandom(4).hex()}"
            print(f"demo store: PostgreSQL at {store._client.where}, rollouts {prefix}-*")
        else:
            store = TokenCaptureStore(root)
            resolver = FileLineageStore(root)
            print(f"demo store: {root}")
        resolved = 0

        async def run_rollout(index: int) -> None:
            nonlocal resolved
            rollout_id = f"{prefix}-{index}"
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
            rollout_id = f"{prefix}-{index}"
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
        removal = await store.retire([f"{prefix}-{i}" for i in range(rollouts)])
        print(f"retired {len(removal['absent'])} dropped rollouts again: a no-op, fences kept")
        if dsn is not None:
            await store.delete([f"{prefix}-{i}" for i in range(rollouts)])
            print("deleted the demo's fences from the database")
        await resolver.close()
        await store.close()


def cmd_demo(args: argparse.Namespace) -> int:
    if args.dsn is not None and not _is_dsn(args.dsn):
        raise CliError(f"{args.dsn}: not a postgresql:// connection string")
    asyncio.run(_demo(args.rollouts, args.calls, args.dsn))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    if args.dsn is not None and not _is_dsn(args.dsn):
        raise CliError(f"{args.dsn}: not a postgresql:// connection string")
    try:
        from tokencapture.gateway.server import serve
    except ImportError as exc:
        raise CliError(str(exc)) from exc
    serve(
        upstream=args.upstream,
        store_dir=args.store,
        dsn=args.dsn,
        host=args.host,
        port=args.port,
        token=args.token,
        tito=args.tito,
        tokenizer=args.tokenizer,
        renderer=args.renderer,
        timeout=args.timeout,
        max_body_bytes=args.max_body_bytes,
        workers=args.workers,
        upstream_api_key=args.upstream_api_key,
    )
    return 0


# The commands that understand staging stores (`--staging`).
_STAGING_COMMANDS = ("ls", "show", "verify", "retire", "delete", "copy")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokencapture",
        description=(
            "Inspect and manage a token capture store: a directory, or a postgresql:// DSN "
            "wherever a DIR is asked for."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        if name not in ("demo", "bench"):
            sub.add_argument("--json", action="store_true", help="machine-readable output")
        if name in _STAGING_COMMANDS:
            sub.add_argument(
                "--staging",
                action="store_true",
                help="the store is a staging store (FileStagingStore directory or "
                "PostgresStagingStore DSN), not a token capture store",
            )
        return sub

    demo = command(
        "demo",
        cmd_demo,
        "put, resolve, freeze, drop and retire a few rollouts in a temporary directory",
    )
    demo.add_argument("--dsn", default=None, help="run against this postgresql:// database instead")
    demo.add_argument(
        "--rollouts", type=int, default=4, metavar="N", help="rollouts to run (default 4)"
    )
    demo.add_argument(
        "--calls", type=int, default=3, metavar="N", help="model calls per rollout (default 3)"
    )
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
    verify.add_argument(
        "--progress",
        action="store_true",
        help="always show the progress bar on stderr (by default only on a terminal, without "
        "--json, for more than 20 rollouts)",
    )
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
    db = commands.add_parser("db", help="manage a PostgreSQL database's tokencapture schema")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    init = db_commands.add_parser(
        "init",
        help="install or upgrade the schema (idempotent)",
        description="install or "
        "upgrade the tokencapture schema in a PostgreSQL database (idempotent)",
    )
    init.set_defaults(handler=cmd_db_init)
    init.add_argument("dsn", metavar="DSN")
    init.add_argument(
        "--citus",
        action="store_true",
        help="require Citus and distribute the schema by rollout id (the default does so "
        "whenever the database has the citus extension)",
    )
    init.add_argument("--json", action="store_true", help="machine-readable output")
    copy = command(
        "copy",
        cmd_copy,
        "copy rollouts byte for byte (versions, snapshot ids, fences) between two stores: "
        "directories or postgresql:// DSNs, either way",
    )
    copy.add_argument("source", metavar="SRC")
    copy.add_argument("target", metavar="DST")
    copy.add_argument("rollouts", nargs="*", metavar="ROLLOUT", help="default: every rollout")
    gateway = commands.add_parser(
        "gateway",
        help="serve the OpenAI-compatible capture gateway (needs tokencapture[gateway])",
        description="serve the OpenAI-compatible capture gateway in front of a vLLM-compatible "
        "engine; every call under /rollouts/ROLLOUT/v1/ is stored durably before it is answered "
        "(docs/gateway.md)",
    )
    gateway.set_defaults(handler=cmd_gateway)
    gateway.add_argument("--upstream", required=True, metavar="URL", help="the engine's root URL")
    where = gateway.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="DIR", help="a token capture store directory")
    where.add_argument("--dsn", metavar="DSN", help="a postgresql:// database")
    gateway.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    gateway.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    gateway.add_argument(
        "--token",
        default=None,
        help="bearer token clients must send (or $TOKENCAPTURE_GATEWAY_TOKEN)",
    )
    gateway.add_argument(
        "--upstream-api-key",
        default=None,
        metavar="KEY",
        help="the engine's API key (vLLM --api-key), sent upstream as a bearer token "
        "(or $TOKENCAPTURE_UPSTREAM_API_KEY)",
    )
    gateway.add_argument(
        "--tito", action="store_true", help="token-in-token-out continuations (renderers)"
    )
    gateway.add_argument("--tokenizer", metavar="DIR", help="--tito: the engine's tokenizer dir")
    gateway.add_argument(
        "--renderer", default="qwen3", help="--tito: the renderers chat format (default qwen3)"
    )
    gateway.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the engine may stay silent: a non-streamed answer must come within it, a "
        "stream's chunks each restart it (default 600)",
    )
    gateway.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="N",
        help="largest request body accepted, in bytes; a larger one is answered 413 "
        "(default 16777216, 16 MiB)",
    )
    gateway.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes over the one store (default 1; see docs/gateway.md)",
    )
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
    except (CliError, OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        # Exit 2: the command could not do its job. Exit 1 is kept for a command that ran and
        # found problems (verify, copy), so a script can tell "damaged" from "not checked".
        print(f"tokencapture: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        # The PostgreSQL driver's refusals (a role or database that does not exist, a bad
        # password) are its own exception types: one line too, named, never a traceback.
        if type(exc).__module__.split(".")[0] != "asyncpg":
            raise
        said = _one_line(f"{type(exc).__name__}: {exc}")
        print(f"tokencapture: error: PostgreSQL: {said}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("tokencapture: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
