"""The gateway when its process runs short of file descriptors (client sockets, the engine's
pool, the store's files): it raises its soft limit, sizes its upstream pool from it, never
answers 500, closes the connection of a 503 it gives for want of descriptors, retries an
upstream connect that ran out once the store's cached descriptors are closed, and keeps every
acknowledged call."""

from __future__ import annotations

import asyncio
import errno
import inspect
import resource
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from tests.fake_upstream import MODEL, FakeUpstream, Server, ThreadServer, start_gateway
from tests.gateway_kills import fake, store_dir

from tokencapture import TokenCaptureStore, jobs
from tokencapture.gateway import GatewayConfig, create_app, open_backend
from tokencapture.gateway.app import upstream_pool_size

__all__ = ["fake", "store_dir"]  # fixtures: the fake upstream process, a store directory

EMFILE = OSError(errno.EMFILE, "Too many open files")


def _connect_out_of_descriptors() -> aiohttp.ClientConnectorError:
    from aiohttp.client_reqrep import ConnectionKey

    key = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, EMFILE)


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize(
    ("soft", "size"),
    [(1024, 256), (4096, 512), (1 << 20, 512), (128, 32), (20, 8), (resource.RLIM_INFINITY, 512)],
)
def test_the_upstream_pool_is_a_quarter_of_the_limit_within_8_to_512(soft: int, size: int) -> None:
    assert upstream_pool_size(soft) == size


async def test_a_loop_whose_queue_cannot_be_made_starts_none_and_leaves_none_unawaited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_descriptor() -> None:
        raise EMFILE

    monkeypatch.setattr(jobs._core, "Completions", no_descriptor)
    jobs._bridges.pop(asyncio.get_running_loop(), None)

    async def step() -> None:
        await asyncio.sleep(0)

    first, second = step(), step()
    with pytest.raises(OSError) as raised:
        jobs.start_together(first, second)
    assert raised.value.errno == errno.EMFILE
    # Closed, not left for the garbage collector to warn about (pytest -W error would fail).
    assert inspect.getcoroutinestate(first) == inspect.CORO_CLOSED
    assert inspect.getcoroutinestate(second) == inspect.CORO_CLOSED


class _Harness:
    def __init__(self, root: Path) -> None:
        self.fake = FakeUpstream()
        self.upstream = ThreadServer(self.fake.app)
        self.backend = open_backend(store_dir=root)
        self.app = create_app(self.backend, GatewayConfig(self.upstream.url))
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway"
        )
        self.store = TokenCaptureStore(root)

    async def chat(self, rollout: str, call: str) -> httpx.Response:
        return await self.client.post(
            f"/rollouts/{rollout}/v1/chat/completions",
            json=_chat(call),
            headers={"x-model-call-id": call},
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.gateway.close()
        self.upstream.stop()


@pytest.fixture
async def harness(tmp_path: Path) -> Any:
    made = _Harness(tmp_path / "store")
    yield made
    await made.close()


async def test_an_intent_without_descriptors_is_a_503_that_closes_its_connection(
    harness: _Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Out of descriptors when the call's first native job would make the loop's queue: a 503
    # with the reason (it was a 500 from deep inside, its coroutines left unawaited).
    monkeypatch.setattr(jobs._core, "Completions", lambda: (_ for _ in ()).throw(EMFILE))
    jobs._bridges.pop(asyncio.get_running_loop(), None)
    answer = await harness.chat("r1", "c1")
    assert answer.status_code == 503
    assert "Too many open files" in answer.json()["error"]["message"]
    assert answer.headers["connection"] == "close"
    assert answer.headers["retry-after"] == "1"
    assert harness.fake.calls == 0
    monkeypatch.undo()
    jobs._bridges.pop(asyncio.get_running_loop(), None)
    # Nothing was written: the rollout takes the same call id afresh, whole.
    assert (await harness.chat("r1", "c1")).status_code == 200
    assert [e.model_call_id for e in harness.store.freeze_now("r1").entries] == ["c1"]


async def test_another_store_failure_keeps_its_connection(
    harness: _Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def full(*args: object, **kwargs: object) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(harness.backend, "begin_call", full)
    answer = await harness.chat("r1", "c1")
    assert answer.status_code == 503
    assert "connection" not in answer.headers
    assert "No space left on device" in answer.json()["error"]["message"]


async def test_an_upstream_connect_out_of_descriptors_is_retried_after_closing_the_caches(
    harness: _Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tokencapture.gateway.app as gateway_app

    gateway = harness.app.state.gateway
    request = gateway.client.request
    attempts: list[str] = []
    closed: list[int] = []

    async def once_out_of_descriptors(
        method: str, url: Any, **kwargs: Any
    ) -> aiohttp.ClientResponse:
        attempts.append(str(url))
        if len(attempts) == 1:
            raise _connect_out_of_descriptors()
        return await request(method, url, **kwargs)

    monkeypatch.setattr(gateway.client, "request", once_out_of_descriptors)
    monkeypatch.setattr(gateway_app, "close_cached", lambda: closed.append(1) or 0)
    answer = await harness.chat("r1", "c1")
    assert answer.status_code == 200
    assert len(attempts) == 2 and closed == [1]
    assert harness.fake.calls == 1
    assert [e.model_call_id for e in harness.store.freeze_now("r1").entries] == ["c1"]
    assert not harness.store.is_incomplete("r1")

    # Out of descriptors at every retry (0.75 s of waits, the caches closed before each): a
    # 502, the call marked (its intent is written).
    attempts.clear()

    async def never(method: str, url: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        attempts.append(str(url))
        raise _connect_out_of_descriptors()

    monkeypatch.setattr(gateway.client, "request", never)
    answer = await harness.chat("r2", "c1")
    assert answer.status_code == 502
    assert len(attempts) == 2 + len(gateway_app.UPSTREAM_DESCRIPTOR_WAITS)
    assert len(closed) == 1 + (len(attempts) - 1)  # the first call's, and one per retry
    assert harness.store.is_incomplete("r2")

    # An uncaptured call passed through follows the same rule.
    attempts.clear()
    monkeypatch.setattr(gateway.client, "request", once_out_of_descriptors)
    answer = await harness.client.get("/v1/models")
    assert answer.status_code == 200
    assert len(attempts) == 2 and attempts[0].endswith("/v1/models")


# The gateway as its own process, under a descriptor limit -----------------------------------


def _soft_limit(pid: int) -> int:
    [line] = [
        line
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
        if "open files" in line
    ]
    return int(line.split()[3])


def test_the_cli_raises_its_soft_limit_to_the_hard_one(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    server = start_gateway(fake.url, store_dir, tmp_path, nofile=(128, 4096))
    try:
        assert server.process is not None
        assert _soft_limit(server.process.pid) == 4096
    finally:
        server.stop()


async def _sessions(
    url: str,
    sessions: int,
    *,
    calls: int | None = None,
    successes: int | None = None,
    seconds: float,
) -> dict[str, Any]:
    """Closed-loop sessions (each its own rollout and connection) until each made `calls`
    calls, or `successes` answers were 200 in all, or `seconds` passed."""
    statuses: dict[str, int] = {}
    acknowledged: dict[str, list[str]] = {}
    deadline = time.monotonic() + seconds

    def done() -> bool:
        return time.monotonic() > deadline or (
            successes is not None and statuses.get("200", 0) >= successes
        )

    async def session(index: int) -> None:
        rollout = f"fd{index}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
            turn = 0
            while not done() and (calls is None or turn < calls):
                call = f"c{turn}"
                turn += 1
                try:
                    async with client.post(
                        f"{url}/rollouts/{rollout}/v1/chat/completions",
                        json=_chat(call),
                        headers={"x-model-call-id": call},
                    ) as answer:
                        body = await answer.read()
                        key = str(answer.status)
                        if answer.status == 200:
                            acknowledged.setdefault(rollout, []).append(call)
                        elif answer.status == 503:
                            assert b"Too many open files" in body, body
                            assert answer.headers.get("connection") == "close"
                except (TimeoutError, aiohttp.ClientConnectionError):
                    key = "connection error"
                    await asyncio.sleep(0.01)
                statuses[key] = statuses.get(key, 0) + 1

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return {"statuses": statuses, "acknowledged": acknowledged}


def _assert_all_stored(store_dir: Path, acknowledged: dict[str, list[str]]) -> None:
    store = TokenCaptureStore(store_dir)
    for rollout, calls in acknowledged.items():
        stored = {entry.model_call_id for entry in store.read_entries(rollout)}
        assert set(calls) <= stored, rollout


def test_at_a_hard_limit_of_256_120_sessions_all_succeed(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    """120 clients, each holding a socket, and as many calls at the engine: with a pool as
    large as the sessions (the earlier default of 512) clients and engine took the descriptors
    the store needed, and calls failed with 502 and 503."""
    server = start_gateway(fake.url, store_dir, tmp_path, nofile=(256, 256))
    try:
        seen = asyncio.run(_sessions(server.url, 120, seconds=5))
    finally:
        server.stop()
    assert set(seen["statuses"]) == {"200"}, seen["statuses"]
    _assert_all_stored(store_dir, seen["acknowledged"])
    assert "Traceback" not in server.log.read_text()


def test_more_clients_than_descriptors_still_make_progress_and_lose_nothing(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    """150 clients at a hard limit of 128: their sockets alone can take every descriptor. The
    calls that cannot be recorded are 503s that close their connection (never a 500), and so
    give the store the descriptors the next call needs: calls keep succeeding (before, the
    first ~40 did and then every call failed while the sockets waited)."""
    server = start_gateway(fake.url, store_dir, tmp_path, nofile=(128, 128))
    try:
        seen = asyncio.run(_sessions(server.url, 150, successes=300, seconds=60))
    finally:
        server.stop()
    statuses = seen["statuses"]
    assert statuses.get("200", 0) >= 300, statuses
    assert set(statuses) <= {"200", "502", "503", "connection error"}, statuses
    _assert_all_stored(store_dir, seen["acknowledged"])
    assert "Traceback" not in server.log.read_text()
