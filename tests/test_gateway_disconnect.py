"""A client that leaves a non-streamed call while the engine works: the gateway sees the
departure (`http.disconnect`) while it waits, cancels the upstream request (its connection
closed, which is what makes vLLM abort the generation), and marks a captured call
`client_disconnected`. A client that is still there, its body sent, is never taken for gone,
and an entry already being put is put whole. Against the fake upstream (tests/fake_upstream.py),
whose `fake_delay` stops when its client disconnects and keeps the request in `abandoned`, and
`BodyStall` around it, an engine whose answer's body stalls after its headers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send
from tests.fake_upstream import MODEL, FakeUpstream, ThreadServer
from tests.test_gateway import _chat_scope, _user

from tokencapture import TokenCaptureStore
from tokencapture.gateway import GatewayConfig, create_app, open_backend


class BodyStall:
    """The fake engine's app with one more knob in a request's body, `fake_stall_body`: the
    answer's status line, its headers (a `Content-Length` for the whole body) and the first
    half of its body are sent, then the engine stalls, its body unfinished, until `release` is
    set (the rest is sent then) or its client (the gateway) closes the connection (counted in
    `abandoned`). vLLM sends a non-streamed body at once; this is an engine, or a proxy before
    it, whose body is slow to come. Other requests go to the fake engine as they are."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.fake = fake
        self.stalled = threading.Event()  # a stalling answer sent its first half
        self.release = threading.Event()
        self.abandoned = 0
        self.finished = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.fake.app(scope, receive, send)
            return
        received: list[Message] = []
        body = b""
        while True:
            message = await receive()
            received.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        stall = bool(body) and orjson.loads(body).get("fake_stall_body") is True

        async def replayed() -> Message:
            return received.pop(0) if received else await receive()

        async def stalling(message: Message) -> None:
            if message["type"] != "http.response.body" or not stall:
                await send(message)
                return
            data = message.get("body", b"")
            half = len(data) // 2
            await send({"type": "http.response.body", "body": data[:half], "more_body": True})
            self.stalled.set()
            if await self._gone(receive):
                self.abandoned += 1
                return
            await send({**message, "body": data[half:]})
            self.finished += 1

        await self.fake.app(scope, replayed, stalling)

    async def _gone(self, receive: Receive) -> bool:
        """Wait until released (False) or the client disconnects (True): its request read,
        the server's `receive` says nothing else until then."""
        waiting = asyncio.ensure_future(receive())
        try:
            while not self.release.is_set():
                done, _ = await asyncio.wait({waiting}, timeout=0.01)
                if done:
                    return bool(waiting.result()["type"] == "http.disconnect")
            return False
        finally:
            waiting.cancel()


class Served:
    """The fake engine and a gateway, each served by uvicorn from a thread of the test
    process: the gateway sees its clients' sockets as a deployment does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fake = FakeUpstream()
        self.engine = BodyStall(self.fake)
        self.upstream = ThreadServer(self.engine)
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
        await _engine_abandoned(self.fake, self.engine, count, within)

    async def counted(self, operation: str, within: float = 5) -> dict[str, Any]:
        """The gateway's stats of `operation` once a call of it is counted (when it is over:
        after its mark, so not at once when the ledger shows the mark)."""
        deadline = asyncio.get_running_loop().time() + within
        while (stats := self.app.gateway.metrics.snapshot().get(operation)) is None:
            assert asyncio.get_running_loop().time() < deadline, "the call was not counted"
            await asyncio.sleep(0.02)
        return stats

    def stop(self) -> None:
        self.gateway.stop()
        self.upstream.stop()


async def _engine_abandoned(
    fake: FakeUpstream, engine: BodyStall, count: int, within: float
) -> None:
    """Wait until the engine has seen `count` requests' connections closed (while it worked,
    or while its body stalled)."""
    deadline = asyncio.get_running_loop().time() + within
    while (seen := len(fake.abandoned) + engine.abandoned) < count:
        assert asyncio.get_running_loop().time() < deadline, (
            f"the engine's requests went on: {seen} of {count} abandoned"
        )
        await asyncio.sleep(0.02)


async def _no_engine_connection(upstream: ThreadServer, within: float) -> None:
    """Wait until the engine holds no connection: the gateway closed the one it used rather
    than keep it in its pool."""
    deadline = asyncio.get_running_loop().time() + within
    while upstream.server.server_state.connections:
        assert asyncio.get_running_loop().time() < deadline, "the engine's connection was kept"
        await asyncio.sleep(0.02)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    served = Served(tmp_path / "store")
    yield served
    served.stop()


def _leaving_client(
    payload: bytes, leave: Callable[[], Awaitable[object]]
) -> tuple[
    Callable[[], Awaitable[dict[str, Any]]],
    Callable[[dict[str, Any]], Awaitable[None]],
    list[dict[str, Any]],
]:
    """An ASGI client driven by hand: `receive` gives the request body, then waits for
    `leave()` and disconnects; `send` keeps what the gateway sent, in the list returned."""
    requested = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await leave()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return receive, send, sent


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
    stats = await served.counted("chat_completions" if "chat" in route else route)
    assert (stats["count"], stats["failures"]) == (1, 1)


async def test_a_passed_through_call_whose_client_left_is_cancelled_at_the_engine(
    served: Served,
) -> None:
    body = {"model": MODEL, "messages": [_user("slow")], "fake_delay": 5}
    await _leave_after(served.gateway.url, "/v1/chat/completions", body, 0.5)
    await served.abandoned(1, within=3)
    assert served.fake.calls == 0
    stats = await served.counted("passthrough")
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
    receive, send, sent = _leaving_client(payload, putting.wait)
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


@pytest.mark.parametrize("route", ["chat/completions", "completions", "passthrough"])
async def test_a_client_that_leaves_while_the_engines_body_stalls_abandons_it(
    served: Served, route: str
) -> None:
    """The engine sent its status line, headers and half its body, then stalls (`BodyStall`):
    a client that leaves then makes the gateway drop the engine's connection (not read to the
    end, not kept in the pool). A captured call is marked `client_disconnected`, stores
    nothing and counts as a failure, as a departure while the engine generates does; a
    passthrough, whose headers were relayed, counts as a failure too."""
    body: dict[str, Any] = {"model": MODEL, "fake_stall_body": True}
    body.update({"prompt": "x"} if route == "completions" else {"messages": [_user("slow")]})
    path = "/v1/chat/completions" if route == "passthrough" else f"/rollouts/left/v1/{route}"
    await _leave_after(served.gateway.url, path, body, 0.5)
    await served.abandoned(1, within=3)
    assert served.engine.stalled.is_set() and served.engine.finished == 0
    assert served.fake.calls == 1  # the engine answered: its body was what the gateway read
    await _no_engine_connection(served.upstream, within=3)
    operation = {"passthrough": "passthrough", "completions": "completions"}.get(
        route, "chat_completions"
    )
    stats = await served.counted(operation)
    assert (stats["count"], stats["failures"]) == (1, 1)
    if route != "passthrough":
        assert served.ledger("left") == [
            {"failure_reason": "client_disconnected", "model_call_id": "gone"}
        ]
        assert served.store.read_entries("left") == []
        assert served.store.is_incomplete("left")
    gateway = served.app.gateway
    assert gateway._in_flight == {} and not gateway._background


async def test_a_departure_during_the_body_read_is_answered_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    """Driven through ASGI by hand, on this loop: the client leaves once the engine's body
    has stalled (its headers read, the gateway reading the body). The gateway answers 499,
    the engine sees its connection closed, the call is marked and not stored, and no task of
    the call is left on the loop (the client's watch, the upstream read)."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    engine = BodyStall(fake)
    upstream = ThreadServer(engine)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    payload = orjson.dumps({"model": MODEL, "messages": [_user("hi")], "fake_stall_body": True})
    left_at: list[float] = []

    async def leave_once_stalled() -> None:
        while not engine.stalled.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the headers are in: the gateway waits for the body
        left_at.append(time.monotonic())

    receive, send, sent = _leaving_client(payload, leave_once_stalled)
    try:
        await asyncio.wait_for(app(_chat_scope("body", "stalled", payload), receive, send), 10)
        assert time.monotonic() - left_at[0] < 2  # at once, not at the engine's pace
        assert sent[0]["status"] == 499
        await _engine_abandoned(fake, engine, 1, within=3)
        await _no_engine_connection(upstream, within=3)
        for _ in range(3):  # a cancelled task ends at the loop's next turn
            await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        stats = app.state.gateway.metrics.snapshot()["chat_completions"]
        assert (stats["count"], stats["failures"]) == (1, 1)
    finally:
        engine.release.set()
        await app.state.gateway.close()
        upstream.stop()
    assert engine.finished == 0
    store = TokenCaptureStore(root)
    assert store.read_entries("body") == []
    assert store.is_incomplete("body")
