"""The command line on PostgreSQL: `db init`, the directory commands given a DSN, `copy`
between any two backends (byte for byte, versions, snapshot ids, fences), `demo --dsn`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.postgres_fixture import execute, pg_dsn, pg_server
from tests.test_postgres_store import SCHEMA_FILES

from tokencapture.cli import main
from tokencapture.postgres import SCHEMA_VERSION, PostgresTokenCaptureStore, install_schema_sync
from tokencapture.postgres.transfer import export_from_directory
from tokencapture.protocols import TokenCaptureRetiredError
from tokencapture.store import TokenCaptureStore, canonical_line

__all__ = ["pg_dsn", "pg_server"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main([*args, "--json"] if args[0] != "demo" else list(args))
    out = capsys.readouterr().out
    return code, (json.loads(out) if args[0] != "demo" else out)


def test_db_init_installs_then_reports_current(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, first = run(capsys, "db", "init", pg_dsn)
    assert code == 0 and first["applied"] == SCHEMA_FILES
    code, second = run(capsys, "db", "init", pg_dsn)
    assert code == 0 and second == {"applied": [], "schema_version": SCHEMA_VERSION}


def _varied(store: TokenCaptureStore) -> None:
    """Rollouts in every state a store can hold."""
    store.append(make_entry("open", call=1))
    store.append(make_entry("open", call=2))
    store._begin_call("open", "call-3")  # dangling intent
    store.append(make_entry("frozen", call=1))
    store.freeze_now("frozen")
    store.append(make_entry("marked", call="é\x00x"))
    store._mark_incomplete("marked", "lost\ncall")
    store._mark_incomplete("marked")
    store.append(make_entry("conflicted", call=1))
    with pytest.raises(ValueError):
        store.append(make_entry("conflicted", call=1, generation_log_probs=[-1.0, -2.0]))
    store.append(make_entry("retired", call=1))
    store.retire_now(["retired", "never-written"])
    store.append(make_entry("dropped", call=1))
    snapshot = store.freeze_now("dropped")
    assert store._drop("dropped", snapshot.snapshot_id, snapshot.version)
    store.append(make_entry("frozen-marked", call=1))
    store.freeze_now("frozen-marked")
    store._mark_incomplete("frozen-marked", "late")


def _images(store: TokenCaptureStore) -> dict[str, Any]:
    from tokencapture.postgres.transfer import rollouts_in_directory

    return {
        rollout_id: export_from_directory(store, rollout_id)
        for rollout_id in rollouts_in_directory(store.root)
    }


def test_copy_round_trips_every_state_byte_for_byte(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install_schema_sync(pg_dsn)
    source = TokenCaptureStore(tmp_path / "source")
    _varied(source)
    code, copied = run(capsys, "copy", str(source.root), pg_dsn)
    assert code == 0 and copied["exists_in_target"] == [] and copied["missing_in_source"] == []
    assert len(copied["copied"]) == 8
    back = tmp_path / "back"
    code, _ = run(capsys, "copy", pg_dsn, str(back))
    assert code == 0
    restored = TokenCaptureStore(back)
    assert _images(restored) == _images(source)
    for rollout_id in ("open", "marked", "conflicted"):  # the exact log bytes
        assert (
            restored.path_for(rollout_id).read_bytes() == source.path_for(rollout_id).read_bytes()
        )
    # Every backend now answers alike: freezes (same ids where frozen), fences, flags.
    pg = PostgresTokenCaptureStore(pg_dsn)
    try:
        for rollout_id in sorted(_images(source)):
            answers = []
            for store in (source, pg, restored):
                try:
                    snapshot = store.freeze_now(rollout_id)
                except TokenCaptureRetiredError:
                    answers.append("retired")
                    continue
                answers.append(
                    (
                        [canonical_line(e) for e in snapshot.entries],
                        snapshot.incomplete,
                        snapshot.version,
                        snapshot.snapshot_id if rollout_id.startswith("frozen") else "",
                    )
                )
            assert answers[0] == answers[1] == answers[2], rollout_id
            assert store.is_incomplete(rollout_id) == source.is_incomplete(rollout_id)
    finally:
        pg.close_sync()
    # A second copy refuses to overwrite.
    code, again = run(capsys, "copy", str(source.root), pg_dsn, "open", "nope")
    assert code == 1 and again["exists_in_target"] == ["open"]
    assert again["missing_in_source"] == ["nope"]


def test_copy_of_the_reference_stores_directory_freezes_as_expected(
    pg_dsn: str, golden_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The golden directory (an unindexed tail and a torn line included) copied to PostgreSQL
    freezes to what the file store freezes it to."""
    install_schema_sync(pg_dsn)
    files_copy = tmp_path / "golden-files"
    shutil.copytree(golden_store, files_copy)
    code, copied = run(capsys, "copy", str(golden_store), pg_dsn)
    assert code == 0 and copied["copied"]
    files = TokenCaptureStore(files_copy)
    pg = PostgresTokenCaptureStore(pg_dsn)
    try:
        for summary in copied["copied"]:
            rollout_id = summary["rollout_id"]
            try:
                expected = files.freeze_now(rollout_id)
            except TokenCaptureRetiredError:
                with pytest.raises(TokenCaptureRetiredError):
                    pg.freeze_now(rollout_id)
                continue
            got = pg.freeze_now(rollout_id)
            assert got.entries == expected.entries
            assert (got.incomplete, got.version) == (expected.incomplete, expected.version)
    finally:
        pg.close_sync()


def test_directory_commands_take_a_dsn(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install_schema_sync(pg_dsn)
    pg = PostgresTokenCaptureStore(pg_dsn)
    try:
        pg.append(make_entry("a", call=1))
        pg.append(make_entry("a", call=2))
        pg._begin_call("a", "call-9")
        pg.append(make_entry("b", call=1))
        pg.freeze_now("b")
    finally:
        pg.close_sync()
    code, rows = run(capsys, "ls", pg_dsn)
    assert code == 0
    assert [(r["rollout_id"], r["status"], r["entries"], r["version"]) for r in rows] == [
        ("a", "open", 2, 2),
        ("b", "frozen", 1, 2),
    ]
    assert (
        rows[0]["bytes"]
        == len(canonical_line(make_entry("a", call=1)))
        + len(canonical_line(make_entry("a", call=2)))
        + 2
    )
    code, shown = run(capsys, "show", pg_dsn, "a")
    assert code == 0 and shown["dangling_intents"] == ["call-9"]
    assert [e["model_call_id"] for e in shown["entries"]] == ["call-1", "call-2"]
    code, verified = run(capsys, "verify", pg_dsn)
    assert code == 0 and verified == {"rollouts": 2, "problems": {}, "ok": True}
    code, retired = run(capsys, "retire", pg_dsn, "a", "c")
    assert code == 0 and retired == {"removed": ["a"], "absent": ["c"]}
    code, swept = run(capsys, "sweep", pg_dsn, "--older-than", "1h")
    assert code == 0 and swept["swept"] == []  # fences are younger than an hour
    code, swept = run(capsys, "sweep", pg_dsn, "--older-than", "0s", "--dry-run")
    assert code == 0 and swept == {"swept": ["a", "c"], "dry_run": True}
    code, swept = run(capsys, "sweep", pg_dsn, "--older-than", "0s")
    assert code == 0 and swept["swept"] == ["a", "c"]
    code, deleted = run(capsys, "delete", pg_dsn, "b", "a")
    assert code == 0 and deleted == {"removed": ["b"], "absent": ["a"]}
    code, rows = run(capsys, "ls", pg_dsn)
    assert rows == []


def test_verify_reports_a_damaged_line(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    install_schema_sync(pg_dsn)
    pg = PostgresTokenCaptureStore(pg_dsn)
    pg.append(make_entry("a", call=1))
    pg.close_sync()
    execute(
        pg_dsn,
        "UPDATE tokencapture.entries"
        " SET line = convert_to(replace(convert_from(line, 'UTF8'), '506', '507'), 'UTF8')",
    )
    code, verified = run(capsys, "verify", pg_dsn)
    assert code == 1 and "does not match its payload digest" in verified["problems"]["a"][0]


def test_demo_runs_against_a_dsn(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "demo", "--dsn", pg_dsn, "--rollouts", "2", "--calls", "3")
    assert code == 0
    assert "4 requests resolved to their parent call's exact tokens" in out
    assert "deleted the demo's fences" in out
    code, rows = run(capsys, "ls", pg_dsn)
    assert rows == []


def test_db_init_refuses_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "init", str(tmp_path)]) == 2
    assert "not a postgresql:// connection string" in capsys.readouterr().err


def test_copy_between_two_databases(
    pg_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio
    import uuid

    from tokencapture.postgres._client import Client
    from tokencapture.postgres.transfer import export_from_postgres

    names = [f"c_{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for name in names:
        execute(pg_server.dsn, f"CREATE DATABASE {name}")
    source, target = (pg_server.dsn_for(name) for name in names)
    install_schema_sync(source)
    install_schema_sync(target)
    files = TokenCaptureStore(tmp_path / "files")
    _varied(files)
    assert run(capsys, "copy", str(files.root), source)[0] == 0
    code, copied = run(capsys, "copy", source, target)
    assert code == 0 and len(copied["copied"]) == 8

    async def images(dsn: str) -> list[Any]:
        client = Client(dsn)
        try:
            return [
                await export_from_postgres(client, summary["rollout_id"])
                for summary in copied["copied"]
            ]
        finally:
            await client.close()

    assert asyncio.run(images(source)) == asyncio.run(images(target))


def test_a_role_or_database_that_does_not_exist_is_one_line_not_a_traceback(
    pg_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver's refusals are its own exception types; the CLI said them with a traceback."""
    for dsn in (
        pg_server.dsn.replace("postgres@", "nobody@"),
        pg_server.dsn_for("no_such_database"),
    ):
        for args in (["ls", dsn], ["verify", dsn, "--json"], ["ls", dsn, "--staging"]):
            assert main(args) == 2
            err = capsys.readouterr().err
            assert "Traceback" not in err
            assert err.startswith("tokencapture: error: PostgreSQL: ") and err.count("\n") == 1


def test_copy_goes_on_past_a_rollout_it_cannot_read_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One unreadable rollout in the source (a line that is not a record, newline-terminated:
    damage, not a torn tail) is reported and the others are copied; before, the copy stopped
    there with one error line and no report, some rollouts already written."""
    source = TokenCaptureStore(tmp_path / "source")
    for rollout_id in ("a", "b", "b2", "c"):
        source.append(make_entry(rollout_id, call=0))
    log = source.path_for("b2")
    log.write_bytes(b"not a record\n" + log.read_bytes())
    code, report = run(capsys, "copy", str(tmp_path / "source"), str(tmp_path / "target"))
    assert code == 1
    assert [c["rollout_id"] for c in report["copied"]] == ["a", "b", "c"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "b2" and "byte offset 0" in unreadable["problem"]
    target = TokenCaptureStore(tmp_path / "target")
    assert [len(target.read_entries(r)) for r in ("a", "b", "c")] == [1, 1, 1]


def test_an_unavailable_server_is_said_alike_by_every_command_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens at the DSN's port: every command says `PostgreSQL at HOST:PORT/DB is
    unavailable: ...` in one line, exit 2 (`ls`, `verify` and `copy` printed the driver's
    own exception, the others this)."""
    from tests.pg_server import _free_port

    port = _free_port()
    dsn = f"postgresql://postgres@127.0.0.1:{port}/nowhere"
    for args in (
        ["ls", dsn],
        ["verify", dsn],
        ["show", dsn, "r1"],
        ["copy", dsn, str(tmp_path / "copy")],
        ["sweep", dsn, "--older-than", "1d"],
        ["retire", dsn, "r1"],
        ["ls", dsn, "--staging"],
        ["verify", dsn, "--staging"],
        ["db", "init", dsn],
    ):
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "", args
        assert captured.err.startswith(
            f"tokencapture: error: PostgreSQL at 127.0.0.1:{port}/nowhere is unavailable: "
        ), (args, captured.err)
        assert captured.err.count("\n") == 1, (args, captured.err)


def test_a_server_message_of_several_lines_is_one_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Citus coordinator relays a dead worker as "... failed with the following error:
    Connection refused\\n\\tIs the server running on that host ..."; said in one line
    (tests/test_citus_faults.py has the real one)."""
    import asyncpg

    import tokencapture.cli as cli
    from tokencapture.postgres import PostgresUnavailableError

    message = (
        "connection to the remote node postgres@127.0.0.1:5433 failed with the following "
        "error: Connection refused\n\tIs the server running on that host and accepting "
        "TCP/IP connections?"
    )
    dsn = "postgresql://postgres@127.0.0.1:5432/capture"
    for error in (
        PostgresUnavailableError(f"PostgreSQL at 127.0.0.1:5432/capture is unavailable: {message}"),
        asyncpg.PostgresError.new({"S": "ERROR", "C": "XX000", "M": message}),
    ):

        def fail(_: str, error: BaseException = error) -> Any:
            raise error

        monkeypatch.setattr(cli, "_ls_postgres", fail)
        assert main(["ls", dsn]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "Connection refused Is the server running on that host" in err, err
