"""`benches/bench_staging.py`'s cleanup stops every PostgreSQL server it started, even when a
close before it fails (before, the first close that raised left the later columns' servers
running), and raises the first error (the others noted on it)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tests.pg_server import PgServer, PgServerUnavailable
from tests.postgres_fixture import unavailable

BENCHES = Path(__file__).resolve().parents[1] / "benches"


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    path = list(sys.path)
    sys.path.insert(0, str(BENCHES))
    try:
        yield importlib.import_module("bench_staging")
    finally:
        sys.path[:] = path  # the module puts python/ first on import


class Failing:
    """A store (or column) whose close raises."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed

    def close(self) -> None:
        self.closed.append(self.name)
        raise RuntimeError(f"{self.name} would not close")


class Server:
    """A stand-in `PgServer`: records its cleanup."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed

    def cleanup(self) -> None:
        self.closed.append(self.name)


def test_a_failing_store_close_still_stops_the_columns_server(bench: ModuleType) -> None:
    closed: list[str] = []
    column = bench.PostgresColumn()
    variant = bench.PostgresColumn(shared=column)
    column.server = Server("server", closed)
    variant.opened = [Failing("variant store", closed), Failing("variant store 2", closed)]
    column.opened = [Failing("store", closed)]
    with pytest.raises(RuntimeError, match="variant store would not close") as raised:
        column.close()
    assert closed == ["variant store", "variant store 2", "store", "server"]
    notes = raised.value.__notes__
    assert len(notes) == 2 and "store would not close" in notes[1]
    assert column.server is None and column.opened == [] and variant.opened == []


def test_the_final_cleanup_closes_every_column_after_one_fails(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    second = bench.PostgresColumn()
    second.server = Server("second server", closed)
    monkeypatch.setitem(bench.BACKENDS, "first", Failing("first column", closed))
    monkeypatch.setitem(bench.BACKENDS, "second", second)
    with pytest.raises(RuntimeError, match="first column would not close"):
        bench.main(["--backends", "first,second", "--runs", "0", "--no-fetch"])
    assert closed == ["first column", "second server"]


def test_real_servers_are_stopped_when_a_close_fails(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two columns each with a throwaway server of their own (tests/pg_server.py), the first
    one's store failing to close: after the cleanup neither server's postmaster runs."""
    monkeypatch.delenv("TOKENCAPTURE_BENCH_PG_DSN", raising=False)
    columns: list[Any] = [bench.PostgresColumn(), bench.PostgresColumn()]
    try:
        for column in columns:
            column.start()
    except (PgServerUnavailable, OSError) as exc:
        for column in columns:
            if column.server is not None:
                column.server.cleanup()
        unavailable(str(exc))
    servers: list[PgServer] = [column.server for column in columns]
    assert all(server.running for server in servers)
    closed: list[str] = []
    columns[0].opened.append(Failing("store", closed))
    monkeypatch.setitem(bench.BACKENDS, "pg-a", columns[0])
    monkeypatch.setitem(bench.BACKENDS, "pg-b", columns[1])
    try:
        with pytest.raises(RuntimeError, match="store would not close"):
            bench.main(["--backends", "pg-a,pg-b", "--runs", "0", "--no-fetch"])
        for server in servers:
            assert not server.running
            assert not server.base.exists()  # removed with its data directory
            postmasters = [
                pid
                for pid in os.listdir("/proc")
                if pid.isdigit() and str(server.data).encode() in _cmdline(pid)
            ]
            assert postmasters == [], server.data
    finally:
        for server in servers:  # this test's own servers, whatever the bench left
            server.cleanup()


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
