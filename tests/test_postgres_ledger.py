"""`PostgresCaptureLedger` gives `FileCaptureLedger`'s answers on the same commits and passes
the ledger conformance checks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from tests.postgres_fixture import dsn, execute, pg_dsn, pg_server
from tests.test_conformance import LEDGER_CHECKS, STORE_CHECKS

from tokencapture.conformance import _commit, _continuation_of, run_conformance
from tokencapture.fingerprint import assistant_fingerprint, conversation_digest
from tokencapture.ledger import CaptureLedgerConflictError, FileCaptureLedger
from tokencapture.ledger_rows import commit_row
from tokencapture.postgres import (
    PostgresCaptureLedger,
    PostgresTokenCaptureStore,
)
from tokencapture.protocols import RolloutRetiredError, TokenCaptureCorruptionError

__all__ = ["dsn", "pg_dsn", "pg_server"]


def test_ledger_conformance(dsn: str) -> None:
    async def run() -> list[str]:
        return await run_conformance(
            lambda: PostgresTokenCaptureStore(dsn),
            lambda: PostgresTokenCaptureStore(dsn),
            ledger_factory=lambda: PostgresCaptureLedger(dsn),
        )

    assert asyncio.run(run()) == STORE_CHECKS + LEDGER_CHECKS


def _outcome(loop: asyncio.AbstractEventLoop, call: Any) -> object:
    """A call of the async API: its exception (type and message) or its awaited result."""
    try:
        result = call()
        if asyncio.iscoroutine(result):
            result = loop.run_until_complete(result)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    if isinstance(result, dict):
        return json.dumps(result, sort_keys=True)
    return result


def test_same_answers_as_the_file_ledger(dsn: str, tmp_path: Path) -> None:
    files = FileCaptureLedger(tmp_path)
    pg = PostgresCaptureLedger(dsn)
    loop = asyncio.new_event_loop()
    stamp = "L"
    commits = [_commit(f"{stamp}-a", f"call-{i}", variant=i) for i in range(3)]
    other = _commit(f"{stamp}-b", "call-0", variant=7)
    twin = _commit(f"{stamp}-b", "call-1", variant=7)  # same fingerprint as `other`: ambiguous
    twin.record.model_call_id = "call-1"
    steps: list[Any] = [
        *(lambda s, c=c: s.record(c) for c in commits),
        lambda s: s.record(commits[0]),  # identical: a no-op
        lambda s: s.record(_commit(f"{stamp}-a", "call-0", variant=9)),  # conflict
        lambda s: s.record_failure(f"{stamp}-a", "call-9", "lost ✗"),
        lambda s: s.record_failure(f"{stamp}-a", "call-9", "lost ✗"),  # no-op
        lambda s: s.record_failure(f"{stamp}-a", "call-1", "late failure"),
        lambda s: s.record(_commit(f"{stamp}-a", "call-9", variant=3)),  # after a failure
        lambda s: s.record(other),
        lambda s: s.record(twin),
        lambda s: s.has_rows(f"{stamp}-a"),
        lambda s: s.has_rows(f"{stamp}-none"),
        lambda s: s.manifest(f"{stamp}-a"),
        lambda s: s.manifest(f"{stamp}-b"),
        lambda s: s.manifest(f"{stamp}-none"),
        *(lambda s, c=c: s.resolve(c.rollout_id, _continuation_of(c)) for c in commits),
        lambda s: s.resolve(other.rollout_id, _continuation_of(other)),  # ambiguous
        lambda s: s.resolve(f"{stamp}-a", []),
        lambda s: s.resolve(f"{stamp}-a", [{"role": "user", "content": "new"}]),
        lambda s: s.retire([f"{stamp}-a", f"{stamp}-none"]),
        lambda s: s.retire([f"{stamp}-a"]),
        lambda s: s.record(commits[1]),  # discarded by the fence
        lambda s: s.has_rows(f"{stamp}-a"),
        lambda s: s.manifest(f"{stamp}-a"),
        lambda s: s.resolve(f"{stamp}-a", _continuation_of(commits[0])),
        lambda s: s.delete([f"{stamp}-a", f"{stamp}-b", f"{stamp}-c"]),
        lambda s: s.has_rows(f"{stamp}-a"),
        lambda s: s.record(commits[2]),  # reuse starts empty
        lambda s: s.manifest(f"{stamp}-a"),
        lambda s: s.retire("bad"),
        lambda s: s.record_failure(f"{stamp}-a", "", "x"),
    ]
    try:
        for index, step in enumerate(steps):
            ours = _outcome(loop, lambda step=step: step(pg))
            assert ours == _outcome(loop, lambda step=step: step(files)), index
    finally:
        loop.run_until_complete(pg.close())
        loop.run_until_complete(files.close())
        loop.close()


def test_conflicts_and_fences_raise_the_file_ledgers_exceptions(dsn: str) -> None:
    pg = PostgresCaptureLedger(dsn)
    try:
        assert pg.record_now(_commit("x", "call-0")) is True
        with pytest.raises(CaptureLedgerConflictError, match="written once"):
            pg.record_now(_commit("x", "call-0", variant=1))
        pg.retire_now(["x"])
        assert pg.record_now(_commit("x", "call-1")) is False  # discarded by the fence
        with pytest.raises(RolloutRetiredError, match="retired"):
            pg.manifest_now("x")
        with pytest.raises(RolloutRetiredError, match="retired"):
            pg.has_rows_now("x")
        with pytest.raises(TypeError):
            pg.record(42)  # type: ignore[arg-type]
    finally:
        pg.close_sync()


# Request content only the conversation digest reads (a user turn's): the fingerprint accepts it,
# so the candidate row's context digest is computed, and refuses it.
_BAD_USER_TURNS = [
    {"role": "user", "content": 5},  # ValueError
    {"role": "user", "content": "lone \ud800"},  # UnicodeEncodeError (a ValueError)
    {"role": "user", "content": "q", "tool_calls": [5]},  # TypeError
]


def _request_with(commit: Any, turn: dict[str, Any]) -> list[dict[str, Any]]:
    """The commit's continuation with its request's user turn (the last) replaced by `turn`."""
    items = _continuation_of(commit)
    items[len(commit.request_items) - 1] = turn
    return items


def test_request_content_the_context_digest_refuses_is_the_requests_error(dsn: str) -> None:
    pg = PostgresCaptureLedger(dsn)
    try:
        commit = _commit("digest", "call-0")
        assert pg.record_now(commit) is True
        for turn in _BAD_USER_TURNS:
            items = _request_with(commit, turn)
            # The stored row is the request's candidate: the fingerprint reads no user turn.
            assert assistant_fingerprint(items) == assistant_fingerprint(_continuation_of(commit))
            with pytest.raises((ValueError, TypeError)) as digest:
                conversation_digest(items[: len(commit.request_items)])
            expected = digest.value
            assert not isinstance(expected, TokenCaptureCorruptionError)
            with pytest.raises((ValueError, TypeError)) as raised:
                pg.resolve_now("digest", items)  # runs `resolve` to its end
            assert (type(raised.value), str(raised.value)) == (type(expected), str(expected))
        found = pg.resolve_now("digest", _continuation_of(commit))
        assert found.match is not None and found.match.model_call_id == "call-0"
    finally:
        pg.close_sync()


def test_a_damaged_candidate_row_is_still_corruption(dsn: str) -> None:
    pg = PostgresCaptureLedger(dsn)
    try:
        commit = _commit("damaged", "call-0")
        assert pg.record_now(commit) is True
        row = commit_row(commit)  # the stored row, as the ledger wrote it
        request = _continuation_of(commit)
        for column, value in [
            ("context_len", "two"),  # int() raises ValueError: the row's fault
            ("context_digest", ...),  # KeyError, read after the request's context digest
            ("digest", ...),  # the context matches; the match cannot be built
        ]:
            damaged = dict(row)
            if value is ...:
                del damaged[column]
            else:
                damaged[column] = value
            execute(
                dsn,
                "UPDATE tokencapture.ledger_rows SET line = $2 WHERE rollout_id = $1",
                "damaged",
                json.dumps(damaged, sort_keys=True, separators=(",", ":")).encode(),
            )
            with pytest.raises(TokenCaptureCorruptionError, match=r"damaged.*cannot be read"):
                pg.resolve_now("damaged", request)
            if column == "context_len":
                # Damaged whatever the request holds: the row's context_len is read first.
                with pytest.raises(TokenCaptureCorruptionError, match="ValueError"):
                    pg.resolve_now("damaged", _request_with(commit, _BAD_USER_TURNS[0]))
    finally:
        pg.close_sync()
