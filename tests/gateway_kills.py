"""Gateway processes under test: SIGKILLs of a `tokencapture gateway` under concurrent agent
sessions (the load and the bookkeeping that tests/test_gateway_process.py, fake upstream, and
tests/test_gateway_vllm.py, the real engine, share) and the fake upstream as a process.

Each round starts a gateway on the same store, runs `sessions` closed-loop multi-turn chats
through it, SIGKILLs it at a random moment, and keeps every answer that reached a client
(`acknowledged`) and every request that was sent (`sent`), by (rollout, call id).
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fake_upstream import Server, server_dir, start_fake, start_gateway

from tokencapture import TokenCaptureStore, TokenEntry

__all__ = ["KillRun", "fake", "run_kills", "store_dir"]

Key = tuple[str, str]


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The fake upstream as a process of its own, for a module's gateway processes."""
    server = start_fake(tmp_path_factory.mktemp("fake"))
    yield server
    server.stop()


@pytest.fixture
def store_dir() -> Iterator[Path]:
    """A store directory the servers' account can write (tests/accounts.py)."""
    path = server_dir()
    yield path / "store"
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class KillRun:
    """What the rounds sent, what reached the clients, and what the store holds."""

    sent: dict[Key, dict[str, Any]] = field(default_factory=dict)
    acknowledged: dict[Key, dict[str, Any]] = field(default_factory=dict)
    stored: dict[Key, TokenEntry] = field(default_factory=dict)

    def check_acknowledged(self) -> None:
        """Every acknowledged call is stored with exactly the tokens its answer carried."""
        for key, body in self.acknowledged.items():
            entry = self.stored.get(key)
            assert entry is not None, f"acknowledged call {key} lost"
            assert entry.prompt_token_ids == body["prompt_token_ids"], key
            assert entry.generation_token_ids == body["choices"][0]["token_ids"], key

    @property
    def unacknowledged(self) -> dict[Key, TokenEntry]:
        """Stored calls whose answer did not reach the client (killed after the put)."""
        return {k: e for k, e in self.stored.items() if k not in self.acknowledged}


def run_kills(
    upstream: str,
    store_dir: Path,
    log_dir: Path,
    *,
    model: str,
    sessions: int,
    kills: int,
    seed: int,
    window: tuple[float, float],
    body: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    timeout: float = 10.0,
) -> KillRun:
    """`kills` rounds; each SIGKILLs the gateway after a uniform draw from `window` seconds.
    `body(messages)` gives the request's extra fields (sampling, max_tokens)."""
    rng = random.Random(seed)
    run = KillRun()

    async def session(
        client: httpx.AsyncClient, index: int, stop: asyncio.Event, round_: int
    ) -> None:
        rollout = f"k{index}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {index}"}]
        turn = 0
        while not stop.is_set():
            call_id = f"r{round_}-t{turn}"
            request = {
                "model": model,
                "messages": messages,
                "return_token_ids": True,
                **(body(messages) if body is not None else {}),
            }
            run.sent[(rollout, call_id)] = request
            try:
                answer = await client.post(
                    f"/rollouts/{rollout}/v1/chat/completions",
                    json=request,
                    headers={"x-model-call-id": call_id},
                )
            except httpx.HTTPError:
                return
            if answer.status_code != 200:
                return
            reply = answer.json()
            run.acknowledged[(rollout, call_id)] = reply
            message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
            messages = [*messages, message, {"role": "user", "content": f"turn {turn}"}]
            turn += 1
            if len(messages) > 9:
                messages = messages[:1]

    for round_ in range(kills):
        server = start_gateway(upstream, store_dir, log_dir)

        async def one_round(server: Server = server, round_: int = round_) -> None:
            stop = asyncio.Event()
            async with httpx.AsyncClient(
                base_url=server.url,
                timeout=timeout,
                limits=httpx.Limits(max_connections=sessions),
            ) as client:
                assert (await client.get("/healthz")).status_code == 200
                tasks = [
                    asyncio.create_task(session(client, i, stop, round_)) for i in range(sessions)
                ]
                await asyncio.sleep(rng.uniform(*window))
                server.kill()  # SIGKILL, mid-flight
                stop.set()
                await asyncio.gather(*tasks)

        asyncio.run(one_round())

    store = TokenCaptureStore(store_dir)
    for index in range(sessions):
        for entry in store.read_entries(f"k{index}"):
            run.stored[(entry.rollout_id, entry.model_call_id)] = entry
    return run
