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
from collections.abc import Callable
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


def stage_rollouts(store: FileStagingStore | PostgresStagingStore) -> None:
    """Stage two calls of each rollout into `store`, then close it."""
    for rollout_id in ROLLOUTS:
        for record in chain(rollout_id, 2):
            assert store.stage(record).ok
    store.close()


def staging_store(root: Path) -> Path:
    stage_rollouts(FileStagingStore(root))
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


def the_same_copy_takes_the_rest(capsys: pytest.CaptureFixture[str], *args: str) -> None:
    """The copy run again, the server back: a (copied before) exists, b and c are copied."""
    code, report, _ = copy(capsys, *args)
    assert code == 1 and report["exists_in_target"] == ["a"]
    assert [c["rollout_id"] for c in report["copied"]] == ["b", "c"]
    assert "not_attempted" not in report


class Outage:
    """The setup of the mid-copy tests: a PostgreSQL server of the test's own, its schema
    installed, that the test stops when the copy reaches a chosen call (`stop_at`), then
    brings back (`back`)."""

    def __init__(self, server: PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
        install_schema_sync(server.dsn)
        self.server = server
        self.dsn = server.dsn
        self._monkeypatch = monkeypatch

    def stop_at(
        self,
        owner: type,
        method: str,
        stops: Callable[[Any], bool],
        name: Callable[[Any], str] = str,
    ) -> list[str]:
        """Stop the server just before the first call of `owner.<method>` whose first argument
        `stops` accepts; the `name`s of that argument in every call from then on (each, once
        the server is gone, a connection that fails: a connect timeout when the host drops
        packets)."""
        real = getattr(owner, method)
        attempted: list[str] = []
        server = self.server

        def wrapped(self: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
            if server.running and stops(arg):
                server.stop()
            if not server.running:
                attempted.append(name(arg))
            return real(self, arg, *args, **kwargs)

        self._monkeypatch.setattr(owner, method, wrapped)
        return attempted

    def stop_before(self, method: str, rollout_id: str) -> list[str]:
        """`stop_at` the copy's `_Backend.<method>` of `rollout_id`; the rollouts it is then
        called for."""
        return self.stop_at(
            cli._Backend, method, lambda arg: _rollout_of(arg) == rollout_id, _rollout_of
        )

    def back(self) -> None:
        """Undo the interception and start the server again."""
        self._monkeypatch.undo()
        self.server.start()


def _rollout_of(arg: Any) -> str:
    return arg if isinstance(arg, str) else str(arg.rollout_id)


@pytest.fixture
def outage(own_server: PgServer, monkeypatch: pytest.MonkeyPatch) -> Outage:
    return Outage(own_server, monkeypatch)


def test_a_target_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(token_store(tmp_path / "source"))
    # Gone after it answered, before the first rollout: the copy stops there, nothing
    # copied, exit 2, the report and one line on stderr; b and c are not even tried.
    attempted = outage.stop_before("create", "a")
    code, report, err = copy(capsys, source, outage.dsn)
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
    outage.back()
    attempted = outage.stop_before("create", "b")
    code = main(["copy", source, outage.dsn])
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
    outage.back()
    the_same_copy_takes_the_rest(capsys, source, outage.dsn)


def test_a_target_that_goes_away_at_the_last_rollout_lists_nothing_not_attempted(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(token_store(tmp_path / "source"))
    attempted = outage.stop_before("create", "c")
    code, report, err = copy(capsys, source, outage.dsn, *ROLLOUTS)
    assert code == 1 and err == "" and attempted == ["c"]
    assert [c["rollout_id"] for c in report["copied"]] == ["a", "b"]
    assert [f["rollout_id"] for f in report["failed_in_target"]] == ["c"]
    assert report["not_attempted"] == []


def test_a_source_that_goes_away_mid_copy_is_reported_exit_1_or_2_if_nothing_was_copied(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["copy", str(token_store(tmp_path / "source")), outage.dsn]) == 0
    capsys.readouterr()
    attempted = outage.stop_before("export", "a")
    code, report, err = copy(capsys, outage.dsn, str(tmp_path / "first"))
    assert code == 2 and report["copied"] == [] and attempted == ["a"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "a" and " is unavailable: " in unreadable["problem"]
    assert report["not_attempted"] == ["b", "c"]
    assert err.rstrip().endswith("(nothing was copied)") and err.count("\n") == 1
    outage.back()
    attempted = outage.stop_before("export", "b")
    code, report, err = copy(capsys, outage.dsn, str(tmp_path / "second"))
    assert code == 1 and err == "" and attempted == ["b"]
    assert [c["rollout_id"] for c in report["copied"]] == ["a"]
    ((unreadable),) = report["unreadable_in_source"]
    assert unreadable["rollout_id"] == "b" and " is unavailable: " in unreadable["problem"]
    assert report["not_attempted"] == ["c"]
    # Back: the same copy takes the rest.
    outage.back()
    the_same_copy_takes_the_rest(capsys, outage.dsn, str(tmp_path / "second"))


def test_a_staging_target_that_goes_away_mid_copy_exits_1_or_2_if_nothing_was_copied(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(staging_store(tmp_path / "staged"))

    def stop_at(rollout_id: str) -> list[str]:
        """Stop the server at the first stage of `rollout_id`; the keys staged from then on."""
        return outage.stop_at(
            PostgresStagingStore,
            "stage",
            lambda record: record.rollout_id == rollout_id,
            lambda record: str(record.staging_key),
        )

    attempted = stop_at("a")
    code = main(["copy", source, outage.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 2 and report["copied"] == {} and attempted == ["a/c0"]
    ((refused),) = report["refused"]
    assert refused.startswith("a/c0: PostgresUnavailableError: PostgreSQL at ")
    assert report["not_attempted"] == ["a/c1", "b/c0", "b/c1", "c/c0", "c/c1"]
    assert captured.err.rstrip().endswith("(nothing was copied)")
    outage.back()
    attempted = stop_at("b")
    code = main(["copy", source, outage.dsn, "--staging"])
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
    outage.back()
    code = main(["copy", source, outage.dsn, "--staging", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["copied"] == {"a": 2, "b": 2, "c": 2}
    assert report["refused"] == [] and "not_attempted" not in report


def test_a_staging_source_that_goes_away_mid_copy_is_reported(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PostgreSQL staging source lost while the copy reads a call's attachments: the copy
    stops with its report (what it copied, the rest not attempted) instead of one line that
    drops it; the rollouts named but not read are not claimed missing."""
    stage_rollouts(PostgresStagingStore(outage.dsn))
    outage.stop_at(PostgresStagingStore, "fetch_attachments", lambda key: key == "b/c0")
    target = tmp_path / "target"
    code = main(["copy", outage.dsn, str(target), *ROLLOUTS, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1, captured
    assert report["copied"] == {"a": 2} and report["refused"] == []
    assert report["not_attempted"] == ["b/c0", "b/c1", "c/c0", "c/c1"]
    assert report["missing_in_source"] == []
    outage.back()
    code = main(["copy", outage.dsn, str(target), "--staging", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["copied"] == {"a": 2, "b": 2, "c": 2}


def test_a_staging_target_lost_before_a_call_is_read_back_reports_it_unverified(
    outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every copied call is read back from the target and compared; a target lost between a
    call's stage and that read leaves it staged but not verified: reported so (not copied),
    the rest not attempted, and the report kept."""
    source = str(staging_store(tmp_path / "staged"))
    outage.stop_at(PostgresStagingStore, "fetch_records", lambda keys: keys == ["b/c1"])
    code = main(["copy", source, outage.dsn, "--staging", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1, captured
    assert report["copied"] == {"a": 2, "b": 1}
    ((refused),) = report["refused"]
    assert refused.startswith("b/c1: staged, but not read back to compare: PostgreSQL at ")
    assert report["not_attempted"] == ["c/c0", "c/c1"]
