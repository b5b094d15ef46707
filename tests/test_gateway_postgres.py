"""`tokencapture gateway --dsn` (its own process) over a real PostgreSQL server: what it
captures is read back with the PostgreSQL store API, an upstream error masks the rollout and
records why, and a store that refuses the entry answers 503, never 200.

Expected tokens are the fake upstream's own rendering (tests/fake_upstream.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fake_upstream import (
    MODEL,
    Server,
    converse_on_new_connections,
    render_chat,
    replying,
    start_gateway,
)
from tests.gateway_kills import fake
from tests.postgres_fixture import dsn, execute, fetch, pg_dsn, pg_server

from tokencapture import ParentResolutionStatus
from tokencapture.gateway.app import REQUEST_DIGEST_FIELD
from tokencapture.postgres import PostgresTokenCaptureStore

__all__ = ["dsn", "fake", "pg_dsn", "pg_server"]


@pytest.fixture
def gateway(fake: Server, dsn: str, tmp_path: Path) -> Iterator[tuple[Server, str]]:
    server = start_gateway(fake.url, dsn, tmp_path)
    yield server, dsn
    server.stop()


@pytest.fixture
def pg(dsn: str) -> Iterator[PostgresTokenCaptureStore]:
    store = PostgresTokenCaptureStore(dsn)
    yield store
    store.close_sync()


def _chat(
    server: Server, rollout: str, call: str, messages: list[dict[str, Any]], **body: Any
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/rollouts/{rollout}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, **body},
        headers={"x-model-call-id": call},
        timeout=30,
    )


def test_captures_into_postgres_and_resolves_the_continuation(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore
) -> None:
    server, _ = gateway
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = _chat(server, "pgr", "a", messages, return_token_ids=True)
    assert first.status_code == 200, first.text
    body = first.json()
    messages = [*messages, body["choices"][0]["message"], {"role": "user", "content": "more"}]
    second = _chat(server, "pgr", "b", messages)
    assert second.status_code == 200, second.text
    assert "prompt_token_ids" not in second.json()

    parent, child = pg.read_entries("pgr")
    assert parent.model_call_id == "a"
    assert parent.prompt_token_ids == render_chat(messages[:1])
    assert parent.prompt_token_ids == body["prompt_token_ids"]
    assert parent.generation_token_ids == body["choices"][0]["token_ids"]
    assert child.prompt_token_ids == render_chat(messages)
    assert child.parent_resolution is ParentResolutionStatus.RESOLVED
    assert child.parent_call_id == "a"
    assert child.prefix_supplied is True
    snapshot = pg.freeze_now("pgr")
    assert not snapshot.incomplete
    assert [e.model_call_id for e in snapshot.entries] == ["a", "b"]
    summary = httpx.get(f"{server.url}/rollouts/pgr").json()
    assert summary["entries"] == 2
    assert summary["parent_resolution"] == {"root": 1, "resolved": 1}


def test_upstream_error_masks_the_rollout_and_records_why(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore
) -> None:
    server, dsn = gateway
    answer = _chat(server, "pge", "bad", [{"role": "user", "content": "x"}], fake_status=500)
    assert answer.status_code == 500
    assert pg.read_entries("pge") == []
    assert pg.is_incomplete("pge")
    assert pg.freeze_now("pge").incomplete
    rows = fetch(
        dsn,
        "SELECT model_call_id, failure, convert_from(line, 'UTF8') AS line "
        "FROM tokencapture.ledger_rows WHERE rollout_id = $1",
        "pge",
    )
    assert [(r["model_call_id"], r["failure"]) for r in rows] == [("bad", True)]
    assert '"failure_reason":"upstream_status_500"' in rows[0]["line"]


def test_a_store_that_refuses_the_entry_answers_503_never_200(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore
) -> None:
    server, dsn = gateway
    # The intent is written; the entry's insert is refused by the server.
    execute(
        dsn,
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
    )
    execute(
        dsn,
        "CREATE TRIGGER refuse BEFORE INSERT ON tokencapture.entries "
        "FOR EACH ROW EXECUTE FUNCTION public.refuse()",
    )
    for stream in (False, True):
        call = f"s{int(stream)}"
        answer = _chat(server, "pgf", call, [{"role": "user", "content": "x"}], stream=stream)
        if stream:
            assert answer.status_code == 200  # the headers went before the put
            assert "[DONE]" not in answer.text
            assert '"code":503' in answer.text
        else:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "store_unavailable"
    execute(dsn, "DROP TRIGGER refuse ON tokencapture.entries")
    assert pg.read_entries("pgf") == []
    assert pg.is_incomplete("pgf")
    rows = fetch(
        dsn,
        "SELECT model_call_id, convert_from(line, 'UTF8') AS line FROM tokencapture.ledger_rows "
        "WHERE rollout_id = $1 ORDER BY seq",
        "pgf",
    )
    assert [r["model_call_id"] for r in rows] == ["s0", "s1"]
    assert all("store_write_failed" in r["line"] for r in rows)


def _wait_for_intent(dsn: str, rollout: str, call: str) -> None:
    for _ in range(500):
        if fetch(
            dsn,
            "SELECT 1 FROM tokencapture.intents WHERE rollout_id = $1 AND model_call_id = $2",
            rollout,
            call.encode(),
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"no intent of {call!r} in {rollout!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_failing_after_its_rollout_froze_keeps_the_snapshot_droppable(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore, stream: bool
) -> None:
    """A call at the engine when the trainer freezes its rollout, then failing (the engine's
    500; a stream the engine breaks): recorded in the ledger, not marked, so the snapshot's
    version does not move and the trainer's `drop` of it succeeds."""
    server, dsn = gateway
    rollout = f"pgz{int(stream)}"
    assert _chat(server, rollout, "first", [{"role": "user", "content": "a"}]).status_code == 200
    failing = {"fake_break_after": 1} if stream else {"fake_status": 500}
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(
            _chat,
            server,
            rollout,
            "late",
            [{"role": "user", "content": "late"}],
            stream=stream,
            fake_delay=1.0,
            **failing,
        )
        _wait_for_intent(dsn, rollout, "late")  # durable: the call is at the engine
        snapshot = pg.freeze_now(rollout)
        answer = late.result()
    assert snapshot.incomplete  # the in-flight call's intent has no entry
    if stream:
        assert answer.status_code == 200 and "[DONE]" not in answer.text
    else:
        assert answer.status_code == 500
    rows = fetch(
        dsn,
        "SELECT model_call_id, failure FROM tokencapture.ledger_rows WHERE rollout_id = $1",
        rollout,
    )
    assert ("late", True) in [(r["model_call_id"], r["failure"]) for r in rows]
    assert pg.freeze_now(rollout).version == snapshot.version
    assert pg._drop(rollout, snapshot.snapshot_id, snapshot.version)


def test_rollout_summary_tells_the_state_and_the_calls_without_entry(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore
) -> None:
    """Over PostgreSQL too, the summary says which calls have an intent and no entry (a lost
    call, masking the rollout at freeze) and whether the rollout is open, frozen, retired or
    unknown."""
    server, _ = gateway
    assert _chat(server, "pgs", "kept", [{"role": "user", "content": "a"}]).status_code == 200
    pg._begin_call("pgs", "lost")
    summary = httpx.get(f"{server.url}/rollouts/pgs").json()
    assert (summary["state"], summary["calls_without_entry"]) == ("open", ["lost"])
    assert (summary["entries"], summary["incomplete"]) == (1, False)  # judged at freeze
    assert pg.freeze_now("pgs").incomplete
    assert httpx.get(f"{server.url}/rollouts/pgs").json()["state"] == "frozen"
    pg.retire_now(["pgs"])
    retired = httpx.get(f"{server.url}/rollouts/pgs").json()
    assert (retired["state"], retired["entries"], retired["calls_without_entry"]) == (
        "retired",
        0,
        [],
    )
    assert httpx.get(f"{server.url}/rollouts/never").json()["state"] == "empty"


def test_a_retry_of_a_stored_call_is_answered_from_the_store(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore, fake: Server
) -> None:
    """Over PostgreSQL (one primary-key lookup of the entry): a retry with the call id of a
    stored call gets the stored answer, whole or streamed, where the engine would now answer
    otherwise (and the store would refuse that as a conflict and mask the rollout)."""
    server, _ = gateway
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    asked = {"return_token_ids": True, "logprobs": True}
    first = _chat(server, "pgy", "c1", messages, **asked).json()
    with replying(fake.url, "another"):  # the engine would now answer otherwise
        retry = _chat(server, "pgy", "c1", messages, **asked)
        stream = _chat(server, "pgy", "c1", messages, stream=True, **asked)
    assert retry.status_code == 200, retry.text
    again = retry.json()
    assert (again["id"], again["prompt_token_ids"]) == (first["id"], first["prompt_token_ids"])
    choice, was = again["choices"][0], first["choices"][0]
    assert choice["message"]["content"] == was["message"]["content"]
    assert choice["token_ids"] == was["token_ids"]
    events = [line[6:] for line in stream.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        == (was["message"]["content"])
    )
    [entry] = pg.read_entries("pgy")
    assert entry.generation_token_ids == was["token_ids"]
    assert (entry.model_extra or {})[REQUEST_DIGEST_FIELD]  # kept by the database too
    assert not pg.is_incomplete("pgy")
    assert not pg.freeze_now("pgy").incomplete


def test_a_retry_with_another_request_is_a_conflict_not_a_replay(
    gateway: tuple[Server, str], pg: PostgresTokenCaptureStore
) -> None:
    """Over PostgreSQL too, the request's digest read back with the entry decides: another
    text prompt (or other generation parameters) under a stored id is a 409 conflict; the
    identical request is replayed."""
    server, _ = gateway
    url = f"{server.url}/rollouts/pgt/v1/completions"
    headers = {"x-model-call-id": "t1"}
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}
    first = httpx.post(url, json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    same = httpx.post(url, json=body, headers=headers, timeout=30)
    assert same.status_code == 200
    assert same.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    for other in ({"prompt": "xyz"}, {"max_tokens": 4}):
        answer = httpx.post(url, json={**body, **other}, headers=headers, timeout=30)
        assert answer.status_code == 409, (other, answer.text)
        assert answer.json()["error"]["type"] == "model_call_id_conflict"
    assert len(pg.read_entries("pgt")) == 1


def test_workers_over_one_database(
    fake: Server, dsn: str, tmp_path: Path, pg: PostgresTokenCaptureStore
) -> None:
    """`--workers 2 --dsn`: the supervisor opens (and closes) the backend before the workers
    start theirs; calls on new connections, whichever worker takes them, are all captured and
    every continuation resolves its parent."""
    server = start_gateway(fake.url, dsn, tmp_path, "--workers", "2")
    try:
        converse_on_new_connections(server.url, "pg-workers", 8)
    finally:
        server.stop()
    entries = pg.freeze_now("pg-workers").entries
    assert [e.model_call_id for e in entries] == [f"c{t}" for t in range(8)]
    for turn, entry in enumerate(entries[1:], start=1):
        assert entry.parent_resolution is ParentResolutionStatus.RESOLVED, turn
        assert entry.parent_call_id == f"c{turn - 1}"


def test_one_call_through_two_gateways_at_once_is_stored_once(
    fake: Server, dsn: str, tmp_path: Path, pg: PostgresTokenCaptureStore
) -> None:
    """A client's retry reaching a second gateway process over the same database while its
    first attempt is at the engine: the first stored is the call's, the other attempt is
    answered with it (no 409, the rollout not marked), as over a directory."""
    servers = [start_gateway(fake.url, dsn, tmp_path) for _ in range(2)]
    try:
        messages = [{"role": "user", "content": "hello"}]
        with ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(
                    lambda server: _chat(server, "pg-race", "c1", messages, fake_delay=0.3),
                    servers,
                )
            )
    finally:
        for server in servers:
            server.stop()
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    [entry] = pg.read_entries("pg-race")
    assert entry.response_id == answers[0].json()["id"]
    assert not pg.is_incomplete("pg-race")
