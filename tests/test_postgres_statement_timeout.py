"""`statement_timeout` bounds every call: a statement the server cancels for it (SQLSTATE
57014) is not retried, so a call blocked on a rollout's lock fails within about one timeout
(it was retried as an unavailable server and took two); a connection lost under a call is
still retried once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from tests.conftest import make_entry
from tests.postgres_fixture import dsn, pg_dsn, pg_server

from tokencapture.postgres import PostgresTokenCaptureStore, PostgresUnavailableError

__all__ = ["dsn", "pg_dsn", "pg_server"]  # the fixtures, imported for pytest


def test_a_call_blocked_past_the_statement_timeout_fails_within_one_timeout(dsn: str) -> None:
    timeout = 1.5
    store = PostgresTokenCaptureStore(dsn, statement_timeout=timeout)
    store.append(make_entry("locked", call=1))
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("append", lambda: store.append(make_entry("locked", call=2))),
        ("freeze", lambda: store.freeze_now("locked")),
    ]

    async def run() -> list[tuple[str, float, str]]:
        holder = await asyncpg.connect(dsn)
        took: list[tuple[str, float, str]] = []
        try:
            async with holder.transaction():
                await holder.execute(
                    "SELECT 1 FROM tokencapture.rollouts WHERE rollout_id = 'locked' FOR UPDATE"
                )
                # Which timeout answers first (the server's 57014 or the client's own, both
                # `statement_timeout`) varies: a few rounds see the server's.
                for _ in range(3):
                    for name, call in calls:
                        started = time.monotonic()
                        with pytest.raises(PostgresUnavailableError) as failed:
                            await asyncio.to_thread(call)
                        took.append((name, time.monotonic() - started, str(failed.value)))
        finally:
            await holder.close()
        return took

    try:
        took = asyncio.run(run())
        for name, seconds, error in took:
            assert "QueryCanceledError" in error or "TimeoutError" in error, error
            # One timeout, not two: a retry takes two whole timeouts (3 s), so anything under
            # 1.9x is one, with room for a loaded machine.
            assert timeout * 0.9 < seconds < timeout * 1.9, (name, seconds, error)
        # The lock released, the rollout takes the call.
        store.append(make_entry("locked", call=2))
        assert [e.model_call_id for e in store.freeze_now("locked").entries] == [
            "call-1",
            "call-2",
        ]
    finally:
        store.close_sync()


def test_the_server_cancelling_a_statement_is_not_retried_a_lost_connection_is(
    dsn: str,
) -> None:
    """The retry decision itself, deterministically: 57014 from the server is raised after one
    attempt; a connection terminated under the call is retried (idempotent calls only)."""
    store = PostgresTokenCaptureStore(dsn, statement_timeout=10)
    client = store._client

    async def run() -> None:
        attempts: list[int] = []

        async def cancelled(connection: Any) -> int:
            attempts.append(1)
            async with connection.transaction():
                await connection.execute("SET LOCAL statement_timeout = 50")
                return int(await connection.fetchval("SELECT 1 FROM pg_sleep(1)"))

        with pytest.raises(PostgresUnavailableError, match="QueryCanceledError"):
            await client.on_connection(cancelled)
        assert len(attempts) == 1

        attempts.clear()

        async def cut_once(connection: Any) -> int:
            attempts.append(1)
            if len(attempts) == 1:
                await connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            return int(await connection.fetchval("SELECT 7"))

        assert await client.on_connection(cut_once) == 7
        assert len(attempts) == 2

        attempts.clear()
        with pytest.raises(PostgresUnavailableError, match="unavailable"):
            await client.on_connection(cut_once, idempotent=False)
        assert len(attempts) == 1
        await store.close()

    asyncio.run(run())
