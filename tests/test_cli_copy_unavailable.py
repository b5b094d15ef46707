"""`tokencapture copy` with a PostgreSQL side that does not answer.

Before, a copy from a directory into a server that was not there exited 1 ("ran and found
problems"), with every rollout listed under `failed_in_target` (a copy from such a server
given rollout names listed each under `unreadable_in_source`; `copy --staging` each under
`refused`). Now a server that does not answer before anything is copied is the one-line
"unavailable" error every command gives, exit 2. A server that goes away in the middle of a
copy is reported rollout by rollout as before: exit 1 if some were copied, 2 if none were.
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
) -> None:
    """Stop `server` just before the copy's `_Backend.<method>` of `rollout_id`."""
    real = getattr(cli._Backend, method)

    def wrapped(self: Any, arg: Any) -> Any:
        if (arg if isinstance(arg, str) else arg.rollout_id) == rollout_id:
            server.stop()
        return real(self, arg)

    monkeypatch.setattr(cli._Backend, method, wrapped)


def test_a_target_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    source = str(token_store(tmp_path / "source"))
    # Gone after it answered, before the first rollout: nothing copied, exit 2, the report
    # and one line on stderr.
    stop_before(monkeypatch, own_server, "create", "a")
    code, report, err = copy(capsys, source, own_server.dsn)
    assert code == 2
    assert report["copied"] == []
    assert [f["rollout_id"] for f in report["failed_in_target"]] == list(ROLLOUTS)
    assert all(" is unavailable: " in f["problem"] for f in report["failed_in_target"])
    assert err.startswith("tokencapture: error: PostgreSQL at ") and err.count("\n") == 1
    assert err.rstrip().endswith("(nothing was copied)")
    # Back, then gone again after the first rollout: a copied, b and c not, exit 1.
    monkeypatch.undo()
    own_server.start()
    stop_before(monkeypatch, own_server, "create", "b")
    code, report, err = copy(capsys, source, own_server.dsn)
    assert code == 1 and err == ""
    assert [c["rollout_id"] for c in report["copied"]] == ["a"]
    assert [f["rollout_id"] for f in report["failed_in_target"]] == ["b", "c"]
    assert all(" is unavailable: " in f["problem"] for f in report["failed_in_target"])
    # Back: the same copy takes the rest.
    monkeypatch.undo()
    own_server.start()
    code, report, _ = copy(capsys, source, own_server.dsn)
    assert code == 1 and report["exists_in_target"] == ["a"]
    assert [c["rollout_id"] for c in report["copied"]] == ["b", "c"]


def test_a_source_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    assert main(["copy", str(token_store(tmp_path / "source")), own_server.dsn]) == 0
    capsys.readouterr()
    stop_before(monkeypatch, own_server, "export", "a")
    code, report, err = copy(capsys, own_server.dsn, str(tmp_path / "first"))
    assert code == 2 and report["copied"] == []
    assert [u["rollout_id"] for u in report["unreadable_in_source"]] == list(ROLLOUTS)
    assert err.rstrip().endswith("(nothing was copied)") and err.count("\n") == 1
    monkeypatch.undo()
    own_server.start()
    stop_before(monkeypatch, own_server, "export", "c")
    code, report, err = copy(capsys, own_server.dsn, str(tmp_path / "second"))
    assert code == 1 and err == ""
    assert [c["rollout_id"] for c in report["copied"]] == ["a", "b"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "c" and " is unavailable: " in unreadable["problem"]


def test_a_staging_target_that_goes_away_mid_copy_exits_1_or_2_if_nothing_was_copied(
    own_server: PgServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_schema_sync(own_server.dsn)
    source = str(staging_store(tmp_path / "staged"))
    real = PostgresStagingStore.stage

    def stop_at(rollout_id: str) -> None:
        def stage(self: PostgresStagingStore, record: Any, **kwargs: Any) -> Any:
            if record.rollout_id == rollout_id and own_server.running:
                own_server.stop()
            return real(self, record, **kwargs)

        monkeypatch.setattr(PostgresStagingStore, "stage", stage)

    stop_at("a")
    code = main(["copy", source, own_server.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 2 and report["copied"] == {}
    assert report["refused"][0].startswith("a/c0: PostgresUnavailableError: PostgreSQL at ")
    assert captured.err.rstrip().endswith("(nothing was copied)")
    monkeypatch.undo()
    own_server.start()
    stop_at("b")
    code = main(["copy", source, own_server.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1 and captured.err == ""
    assert report["copied"] == {"a": 2}
    assert report["refused"][0].startswith("b/c0: PostgresUnavailableError: PostgreSQL at ")
