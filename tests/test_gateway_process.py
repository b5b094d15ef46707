"""The gateway as its own process (`tokencapture gateway` under uvicorn) over real sockets:
the CLI, a client that disconnects mid-stream, and SIGKILLs under 16 concurrent sessions."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fake_upstream import MODEL, Server, render_chat, start_fake, start_gateway

from tokencapture import TokenCaptureStore


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_fake(tmp_path_factory.mktemp("fake"))
    yield server
    server.stop()


@pytest.fixture
def gateway(fake: Server, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    store = tmp_path / "store"
    server = start_gateway(fake.url, store, tmp_path)
    yield server, store
    server.stop()


def _wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_cli_gateway_serves_and_captures(gateway: tuple[Server, Path]) -> None:
    server, store_dir = gateway
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    answer = httpx.post(
        f"{server.url}/rollouts/cli/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-model-call-id": "one"},
    )
    assert answer.status_code == 200
    [entry] = TokenCaptureStore(store_dir).read_entries("cli")
    assert entry.prompt_token_ids == render_chat([{"role": "user", "content": "hi"}])


def test_cli_refuses_a_public_bind_without_token(fake: Server, tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokencapture",
            "gateway",
            "--upstream",
            fake.url,
            "--store",
            str(tmp_path),
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "bearer token" in result.stderr


def test_client_disconnect_mid_stream_marks_call_incomplete(
    gateway: tuple[Server, Path],
) -> None:
    server, store_dir = gateway
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": True,
        "fake_chunk_delay": 0.05,
    }
    with (
        httpx.Client() as client,
        client.stream(
            "POST",
            f"{server.url}/rollouts/gone/v1/chat/completions",
            json=body,
            headers={"x-model-call-id": "left"},
        ) as answer,
    ):
        lines = answer.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    # The connection is closed: the gateway marks the call and records why.
    store = TokenCaptureStore(store_dir)
    _wait_for(lambda: store.is_incomplete("gone"))
    assert store.read_entries("gone") == []
    ledger = store_dir / "gone.lineage.jsonl"
    _wait_for(ledger.exists)
    assert json.loads(ledger.read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "left",
    }
    assert store.freeze_now("gone").incomplete


SESSIONS = 16
KILLS = 20


def test_sigkill_under_concurrent_sessions_loses_no_acknowledged_call(
    fake: Server, tmp_path: Path
) -> None:
    """Every call whose answer reached the client is stored with exactly the answer's tokens;
    every other call is whole (its tokens are the engine's for its request) or absent."""
    store_dir = tmp_path / "store"
    rng = random.Random(26)
    acknowledged: dict[tuple[str, str], dict[str, Any]] = {}
    sent: dict[tuple[str, str], list[dict[str, Any]]] = {}

    async def session(
        client: httpx.AsyncClient, index: int, stop: asyncio.Event, round_: int
    ) -> None:
        rollout = f"k{index}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {index}"}]
        turn = 0
        while not stop.is_set():
            call_id = f"r{round_}-t{turn}"
            sent[(rollout, call_id)] = list(messages)
            try:
                answer = await client.post(
                    f"/rollouts/{rollout}/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "return_token_ids": True},
                    headers={"x-model-call-id": call_id},
                )
            except httpx.HTTPError:
                return
            if answer.status_code != 200:
                return
            body = answer.json()
            acknowledged[(rollout, call_id)] = body
            messages = [
                *messages,
                body["choices"][0]["message"],
                {"role": "user", "content": f"turn {turn}"},
            ]
            turn += 1
            if len(messages) > 9:
                messages = messages[:1]

    for round_ in range(KILLS):
        server = start_gateway(fake.url, store_dir, tmp_path)
        stop = asyncio.Event()

        async def run(
            server: Server = server, stop: asyncio.Event = stop, round_: int = round_
        ) -> None:
            # One client (building one costs a TLS context: ~0.1 s of CPU under load).
            async with httpx.AsyncClient(
                base_url=server.url, timeout=10.0, limits=httpx.Limits(max_connections=SESSIONS)
            ) as client:
                assert (await client.get("/healthz")).status_code == 200
                tasks = [
                    asyncio.create_task(session(client, i, stop, round_)) for i in range(SESSIONS)
                ]
                await asyncio.sleep(rng.uniform(0.3, 1.5))
                server.kill()  # SIGKILL, mid-flight
                stop.set()
                await asyncio.gather(*tasks)

        asyncio.run(run())

    store = TokenCaptureStore(store_dir)
    stored: dict[tuple[str, str], Any] = {}
    for index in range(SESSIONS):
        for entry in store.read_entries(f"k{index}"):
            stored[(entry.rollout_id, entry.model_call_id)] = entry
    assert len(acknowledged) > KILLS * SESSIONS  # the load was real
    for key, body in acknowledged.items():
        entry = stored.get(key)
        assert entry is not None, f"acknowledged call {key} lost"
        assert entry.prompt_token_ids == body["prompt_token_ids"]
        assert entry.generation_token_ids == body["choices"][0]["token_ids"]
    for key, entry in stored.items():
        # Whole: exactly the engine's tokens for the request that was sent.
        assert entry.prompt_token_ids == render_chat(sent[key])
    unacknowledged = len(stored) - len(acknowledged)
    print(
        f"{len(acknowledged)} acknowledged calls, all stored; {unacknowledged} stored but "
        f"unacknowledged (killed before the answer left)"
    )
