"""`tokencapture copy` with a PostgreSQL side that does not answer.

Before, a copy from a directory into a server that was not there exited 1 ("ran and found
problems"), with every rollout listed under `failed_in_target` (a copy from such a server
given rollout names listed each under `unreadable_in_source`; `copy --staging` each under
`refused`). Now a server that does not answer before anything is copied is the one-line
"unavailable" error every command gives, exit 2. A server that goes away in the middle of a
copy stops it: the rollout (with `--staging`, the call) that met it is reported as before, and
the rest are listed under `not_attempted` without being tried (before, each was tried, at the
cost of a connect timeout each when the host drops packets); exit 1 if some were copied, 2 if
none were. The same copy run again once the server is back copies the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.pg_server import PgServer, _free_port
from tests.postgres_fixture import own_server
from tests.staging_backends import chain

import tokencapture.cli as cli
from tokencapture.cli import main
from tokencapture.postgres import PostgresStagingStore, install_schema_sync
from tokencapture.staging import FileStagingStore
from tokencapture.store import TokenCaptureStore

__all__ = ["own_server"]

ROLLOUTS = ("a", "b", "c")


def token_store(root: Path) -> Path:
    store = TokenCaptureStore(root)
    for rollout_id in ROLLOUTS:
        store.append(make_entry(rollout_id, call=0))
    return root


def staging_store(root: Path) -> Path:
    store = FileStagingStore(root)
    for rollout_id in ROLLOUTS:
        for record in chain(rollout_id, 2):
            assert store.stage(record).ok
    store.close()
    return root


def nowhere(tmp_path: Path) -> list[str]:
    """DSNs no server answers at: a closed loopback port, a socket directory with no socket."""
    empty = tmp_path / "no-socket-here"
    empty.mkdir()
    return [
        f"postgresql://postgres@127.0.0.1:{_free_port()}/nowhere",
        f"postgresql://postgres@/nowhere?host={empty}&port={_free_port()}",
    ]


def said_unavailable_in_one_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    captured = capsys.readouterr()
    assert captured.out == "", (args, captured.out)
    assert captured.err.startswith("tokencapture: error: PostgreSQL at "), (args, captured.err)
    assert " is unavailable: " in captured.err, (args, captured.err)
    assert captured.err.count("\n") == 1, (args, captured.err)


@pytest.mark.parametrize("json_output", [False, True])
def test_a_copy_to_or_from_a_server_that_is_not_there_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], json_output: bool
) -> None:
    source = token_store(tmp_path / "source")
    staged = staging_store(tmp_path / "staged")
    for dsn in nowhere(tmp_path):
        for args in (
            ["copy", str(source), dsn],  # into it: was exit 1, each rollout "failed_in_target"
            ["copy", str(source), dsn, "a", "b"],
            ["copy", dsn, str(tmp_path / "target")],  # from it
            ["copy", dsn, str(tmp_path / "target"), "a", "b"],  # was exit 1, "unreadable"
            ["copy", str(staged), dsn, "--staging"],  # was exit 1, every call "refused"
            ["copy", dsn, str(tmp_path / "staged-target"), "--staging"],
            ["copy", dsn, str(tmp_path / "staged-target"), "a", "--staging"],
        ):
            args = [*args, "--json"] if json_output else args
            assert main(args) == 2, args
            said_unavailable_in_one_line(capsys, args)
    # Nothing was written into the directories named as targets.
    assert not (tmp_path / "target").exists() or not any((tmp_path / "target").iterdir())


def copy(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    code = main(["copy", *args, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def stop_before(
    monkeypatch: pytest.MonkeyPatch, server: PgServer, method: str, rollout_id: str
) -> list[str]:
    """Stop `server` just before the copy's `_Backend.<method>` of `rollout_id`; the rollouts
    that method is then called for (each attempt, once the server is gone, a connection that
    fails: a connect timeout each when the host drops packets)."""
    real = getattr(cli._Backend, method)
    attempted: list[str] = []

    def wrapped(self: Any, arg: Any) -> Any:
        name = arg if isinstance(arg, str) else arg.rollout_id
        if name == rollout_id:
            server.stop()
        if not server.running:
            attempted.append(name)
        return real(self, arg)

    monkeypatch.setattr(cli._Backend, method, wrapped)
    return attempted


def test_a_target_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    source = str(token_store(tmp_path / "source"))
    # Gone after it answered, before the first rollout: the copy stops there, nothing
    # copied, exit 2, the report and one line on stderr; b and c are not even tried.
    attempted = stop_before(monkeypatch, own_server, "create", "a")
    code, report, err = copy(capsys, source, own_server.dsn)
    assert code == 2
    assert attempted == ["a"]
    assert report["copied"] == []
    ((failed),) = report["failed_in_target"]
    assert failed["rollout_id"] == "a" and " is unavailable: " in failed["problem"]
    assert report["not_attempted"] == ["b", "c"]
    assert err.startswith("tokencapture: error: PostgreSQL at ") and err.count("\n") == 1
    assert err.rstrip().endswith("(nothing was copied)")
    # Back, then gone again after the first rollout: a copied, b met the lost server, c not
    # tried, exit 1. The text report says so too.
    monkeypatch.undo()
    own_server.start()
    attempted = stop_before(monkeypatch, own_server, "create", "b")
    code = main(["copy", source, own_server.dsn])
    text = capsys.readouterr()
    assert code == 1 and text.err == "" and attempted == ["b"]
    lines = text.out.splitlines()
    assert lines[0] == "copied 1 rollout(s) (1 entries)"
    assert lines[1].startswith("not copied, the target refused it: b: PostgreSQL at ")
    assert lines[2] == (
        "not attempted, the copy stopped when a PostgreSQL server went away (1 rollout(s); "
        "run the same copy again once it is back): c"
    )
    assert len(lines) == 3
    # Back: the same copy takes the rest; with nothing lost, the report has no not_attempted.
    monkeypatch.undo()
    own_server.start()
    code, report, _ = copy(capsys, source, own_server.dsn)
    assert code == 1 and report["exists_in_target"] == ["a"]
    assert [c["rollout_id"] for c in report["copied"]] == ["b", "c"]
    assert "not_attempted" not in report


def test_a_target_that_goes_away_at_the_last_rollout_lists_nothing_not_attempted(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    source = str(token_store(tmp_path / "source"))
    attempted = stop_before(monkeypatch, own_server, "create", "c")
    code, report, err = copy(capsys, source, own_server.dsn, *ROLLOUTS)
    assert code == 1 and err == "" and attempted == ["c"]
    assert [c["rollout_id"] for c in report["copied"]] == ["a", "b"]
    assert [f["rollout_id"] for f in report["failed_in_target"]] == ["c"]
    assert report["not_attempted"] == []


def test_a_source_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    assert main(["copy", str(token_store(tmp_path / "source")), own_server.dsn]) == 0
    capsys.readouterr()
    attempted = stop_before(monkeypatch, own_server, "export", "a")
    code, report, err = copy(capsys, own_server.dsn, str(tmp_path / "first"))
    assert code == 2 and report["copied"] == [] and attempted == ["a"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "a" and " is unavailable: " in unreadable["problem"]
    assert report["not_attempted"] == ["b", "c"]
    assert err.rstrip().endswith("(nothing was copied)") and err.count("\n") == 1
    monkeypatch.undo()
    own_server.start()
    attempted = stop_before(monkeypatch, own_server, "export", "b")
    code, report, err = copy(capsys, own_server.dsn, str(tmp_path / "second"))
    assert code == 1 and err == "" and attempted == ["b"]
    assert [c["rollout_id"] for c in report["copied"]] == ["a"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "b" and " is unavailable: " in unreadable["problem"]
    assert report["not_attempted"] == ["c"]
    # Back: the same copy takes the rest.
    monkeypatch.undo()
    own_server.start()
    code, report, _ = copy(capsys, own_server.dsn, str(tmp_path / "second"))
    assert code == 1 and report["exists_in_target"] == ["a"]
    assert [c["rollout_id"] for c in report["copied"]] == ["b", "c"]
    assert "not_attempted" not in report


def test_a_staging_target_that_goes_away_mid_copy_exits_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    source = str(staging_store(tmp_path / "staged"))
    real = PostgresStagingStore.stage

    def stop_at(rollout_id: str) -> list[str]:
        """Stop the server at the first stage of `rollout_id`; the keys staged from then on
        (each attempt a failed connection: a connect timeout when the host drops packets)."""
        attempted: list[str] = []

        def stage(self: PostgresStagingStore, record: Any, **kwargs: Any) -> Any:
            if record.rollout_id == rollout_id and own_server.running:
                own_server.stop()
            if not own_server.running:
                attempted.append(record.staging_key)
            return real(self, record, **kwargs)

        monkeypatch.setattr(PostgresStagingStore, "stage", stage)
        return attempted

    attempted = stop_at("a")
    code = main(["copy", source, own_server.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 2 and report["copied"] == {} and attempted == ["a/c0"]
    ((refused),) = report["refused"]
    assert refused.startswith("a/c0: PostgresUnavailableError: PostgreSQL at ")
    assert report["not_attempted"] == ["a/c1", "b/c0", "b/c1", "c/c0", "c/c1"]
    assert captured.err.rstrip().endswith("(nothing was copied)")
    monkeypatch.undo()
    own_server.start()
    attempted = stop_at("b")
    code = main(["copy", source, own_server.dsn, "--staging"])
    captured = capsys.readouterr()
    assert code == 1 and captured.err == "" and attempted == ["b/c0"]
    lines = captured.out.splitlines()
    assert lines[0].startswith("copied 2 staged call(s) of 1 rollout(s)")
    assert lines[1].startswith(
        "refused by the target: b/c0: PostgresUnavailableError: PostgreSQL at "
    )
    assert lines[2] == (
        "not attempted, the copy stopped when a PostgreSQL server went away (3 staged "
        "call(s); run the same copy again once it is back): b/c1, c/c0, c/c1"
    )
    assert len(lines) == 3
    # Back: the same copy stages the rest (and a's calls again, idempotently).
    monkeypatch.undo()
    own_server.start()
    code = main(["copy", source, own_server.dsn, "--staging", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["copied"] == {"a": 2, "b": 2, "c": 2}
    assert report["refused"] == [] and "not_attempted" not in report


def test_a_staging_source_that_goes_away_mid_copy_is_reported(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A PostgreSQL staging source lost while the copy reads a call's attachments: the copy
    stops with its report (what it copied, the rest not attempted) instead of one line that
    drops it; the rollouts named but not read are not claimed missing."""
    install_schema_sync(own_server.dsn)
    source = PostgresStagingStore(own_server.dsn)
    for rollout_id in ROLLOUTS:
        for record in chain(rollout_id, 2):
            assert source.stage(record).ok
    source.close()
    real = PostgresStagingStore.fetch_attachments

    def fetch_attachments(self: PostgresStagingStore, key: str) -> Any:
        if key == "b/c0" and own_server.running:
            own_server.stop()
        return real(self, key)

    monkeypatch.setattr(PostgresStagingStore, "fetch_attachments", fetch_attachments)
    target = tmp_path / "target"
    code = main(["copy", own_server.dsn, str(target), *ROLLOUTS, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1, captured
    assert report["copied"] == {"a": 2} and report["refused"] == []
    assert report["not_attempted"] == ["b/c0", "b/c1", "c/c0", "c/c1"]
    assert report["missing_in_source"] == []
    monkeypatch.undo()
    own_server.start()
    code = main(["copy", own_server.dsn, str(target), "--staging", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["copied"] == {"a": 2, "b": 2, "c": 2}


def test_a_staging_target_lost_before_a_call_is_read_back_reports_it_unverified(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every copied call is read back from the target and compared; a target lost between a
    call's stage and that read leaves it staged but not verified: reported so (not copied),
    the rest not attempted, and the report kept."""
    install_schema_sync(own_server.dsn)
    source = str(staging_store(tmp_path / "staged"))
    real = PostgresStagingStore.fetch_records

    def fetch_records(self: PostgresStagingStore, keys: list[str]) -> Any:
        if keys == ["b/c1"] and own_server.running:
            own_server.stop()
        return real(self, keys)

    monkeypatch.setattr(PostgresStagingStore, "fetch_records", fetch_records)
    code = main(["copy", source, own_server.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1, captured
    assert report["copied"] == {"a": 2, "b": 1}
    ((refused),) = report["refused"]
    assert refused.startswith("b/c1: staged, but not read back to compare: PostgreSQL at ")
    assert report["not_attempted"] == ["c/c0", "c/c1"]
