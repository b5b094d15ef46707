"""A client that leaves a non-streamed call while the engine works: the gateway sees the
departure (`http.disconnect`) while it waits, cancels the upstream request (its connection
closed, which is what makes vLLM abort the generation), and marks a captured call
`client_disconnected`. A client that is still there, its body sent, is never taken for gone,
and an entry already being put is put whole. Against the fake upstream (tests/fake_upstream.py),
whose `fake_delay` stops when its client disconnects and keeps the request in `abandoned`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.fake_upstream import MODEL, FakeUpstream, ThreadServer
from tests.test_gateway import _chat_scope, _user

from tokencapture import TokenCaptureStore
from tokencapture.gateway import GatewayConfig, create_app, open_backend


class Served:
    """The fake engine and a gateway, each served by uvicorn from a thread of the test
    process: the gateway sees its clients' sockets as a deployment does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fake = FakeUpstream()
        self.upstream = ThreadServer(self.fake.app)
        self.app = create_app(open_backend(store_dir=root), GatewayConfig(self.upstream.url))
        self.gateway = ThreadServer(self.app, lifespan="on")
        self.store = TokenCaptureStore(root)

    def ledger(self, rollout: str) -> list[dict[str, Any]]:
        path = self.root / f"{rollout}.lineage.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    async def abandoned(self, count: int, within: float) -> None:
        """Wait until the engine has seen `count` requests' connections closed."""
        deadline = asyncio.get_running_loop().time() + within
        while len(self.fake.abandoned) < count:
            assert asyncio.get_running_loop().time() < deadline, (
                f"the engine's requests went on: {len(self.fake.abandoned)} of {count} abandoned"
            )
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        self.gateway.stop()
        self.upstream.stop()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    served = Served(tmp_path / "store")
    yield served
    served.stop()


async def _leave_after(url: str, path: str, body: dict[str, Any], seconds: float) -> None:
    """POST and give up after `seconds` (an agent's timeout): the connection is closed."""
    async with httpx.AsyncClient(base_url=url, timeout=seconds) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(path, json=body, headers={"x-model-call-id": "gone"})


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_a_captured_call_whose_client_left_is_cancelled_at_the_engine_and_marked(
    served: Served, route: str
) -> None:
    """The engine's request is cancelled well before its answer would have come (5 s), the
    call is marked `client_disconnected` with a failure row, and nothing is stored."""
    body: dict[str, Any] = {"model": MODEL, "fake_delay": 5}
    body.update({"messages": [_user("slow")]} if route == "chat/completions" else {"prompt": "x"})
    started = asyncio.get_running_loop().time()
    await _leave_after(served.gateway.url, f"/rollouts/left/v1/{route}", body, 0.5)
    await served.abandoned(1, within=3)
    assert asyncio.get_running_loop().time() - started < 4  # not the engine's 5 s
    assert served.fake.calls == 0  # the engine did not finish it
    deadline = asyncio.get_running_loop().time() + 5
    while not served.ledger("left"):  # the mark follows the cancel
        assert asyncio.get_running_loop().time() < deadline, "the call was not marked"
        await asyncio.sleep(0.02)
    assert served.ledger("left") == [
        {"failure_reason": "client_disconnected", "model_call_id": "gone"}
    ]
    assert served.store.read_entries("left") == []
    assert served.store.is_incomplete("left")
    stats = served.app.gateway.metrics.snapshot()["chat_completions" if "chat" in route else route]
    assert (stats["count"], stats["failures"]) == (1, 1)


async def test_a_passed_through_call_whose_client_left_is_cancelled_at_the_engine(
    served: Served,
) -> None:
    body = {"model": MODEL, "messages": [_user("slow")], "fake_delay": 5}
    await _leave_after(served.gateway.url, "/v1/chat/completions", body, 0.5)
    await served.abandoned(1, within=3)
    assert served.fake.calls == 0
    deadline = asyncio.get_running_loop().time() + 5
    while "passthrough" not in served.app.gateway.metrics.snapshot():
        assert asyncio.get_running_loop().time() < deadline, "the call was not counted"
        await asyncio.sleep(0.02)
    stats = served.app.gateway.metrics.snapshot()["passthrough"]
    assert (stats["count"], stats["failures"]) == (1, 1)


async def test_a_client_that_waits_is_not_taken_for_gone(served: Served) -> None:
    """A client that sent its whole body and waits (the server's `receive` then blocks until
    the response is sent) gets its answer, captured, from a slow engine; the engine's
    connection is not closed under it."""
    async with httpx.AsyncClient(base_url=served.gateway.url, timeout=30) as client:
        chat = client.post(
            "/rollouts/kept/v1/chat/completions",
            json={"model": MODEL, "messages": [_user("slow")], "fake_delay": 0.6},
            headers={"x-model-call-id": "waits"},
        )
        passed = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [_user("slow")], "fake_delay": 0.6},
        )
        models = client.get("/v1/models")  # a passthrough GET: its empty body is read past
        answers = await asyncio.gather(chat, passed, models)
    assert [answer.status_code for answer in answers] == [200, 200, 200], answers[0].text
    assert served.fake.abandoned == []
    [entry] = served.store.read_entries("kept")
    assert entry.model_call_id == "waits"
    assert not served.store.is_incomplete("kept")


async def test_an_entry_being_put_when_the_client_leaves_is_put_whole(tmp_path: Path) -> None:
    """The watch of the client covers the engine's work only: a client that leaves while the
    entry is being put does not cancel the put (the entry is stored whole, not marked), as
    the rule "the entry stored before the answer is released" and durability need. Driven
    through ASGI by hand: the client leaves once the put has begun."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    backend = open_backend(store_dir=root)
    app = create_app(backend, GatewayConfig(upstream.url))
    putting = asyncio.Event()
    put_whole: list[str] = []
    real_put = backend.put

    async def slow_put(entry: Any, **options: Any) -> bool:
        putting.set()
        await asyncio.sleep(0.3)  # the client leaves meanwhile
        kept = await real_put(entry, **options)
        put_whole.append(entry.model_call_id)
        return kept

    backend.put = slow_put  # type: ignore[method-assign]
    payload = orjson.dumps({"model": MODEL, "messages": [_user("hi")], "fake_delay": 0.2})
    requested = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await putting.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await asyncio.wait_for(app(_chat_scope("put", "whole", payload), receive, send), 30)
    finally:
        await app.state.gateway.close()
        upstream.stop()
    assert put_whole == ["whole"]
    assert sent[0]["status"] == 200
    store = TokenCaptureStore(root)
    [entry] = store.read_entries("put")
    assert entry.model_call_id == "whole"
    assert not store.is_incomplete("put")
    assert fake.abandoned == [] and fake.calls == 1
