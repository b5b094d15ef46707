"""The capture gateway against the fast fake upstream (served from a thread of the test process).

Expected tokens are computed by the fake's own rendering (tests/fake_upstream.py), never by
the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.fake_upstream import (
    IM_END,
    MODEL,
    FakeUpstream,
    Server,
    ThreadServer,
    encode,
    free_port,
    render_chat,
    start_fake,
)

from tokencapture import ParentResolutionStatus, TokenCaptureStore, TokenEntry
from tokencapture.gateway import DIVERGED_REASON, GatewayConfig, create_app, open_backend
from tokencapture.gateway.app import REQUEST_DIGEST_FIELD, request_digest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look up",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


class Harness:
    def __init__(self, root: Path, fake: FakeUpstream, **config: Any) -> None:
        self.root = root
        self.fake = fake
        self.upstream = ThreadServer(fake.app)
        self.backend = open_backend(store_dir=root)
        self.app = create_app(
            self.backend,
            GatewayConfig(self.upstream.url, **config),
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway"
        )
        self.store = TokenCaptureStore(root)

    async def chat(
        self, rollout: str, messages: list[dict[str, Any]], *, call: str | None = None, **body: Any
    ) -> httpx.Response:
        headers = {"x-model-call-id": call} if call else {}
        return await self.client.post(
            f"/rollouts/{rollout}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, **body},
            headers=headers,
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.gateway.close()
        self.upstream.stop()


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path / "store", FakeUpstream())
    yield harness
    await harness.close()


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def test_chat_captures_exact_tokens_and_strips_unrequested_fields(gw: Harness) -> None:
    messages = [{"role": "system", "content": "be brief"}, _user("hello")]
    answer = await gw.chat("r1", messages, call="c1")
    assert answer.status_code == 200
    body = answer.json()
    # Not asked for: removed, not nulled.
    assert "prompt_token_ids" not in body
    assert "token_ids" not in body["choices"][0]
    assert "logprobs" not in body["choices"][0]
    assert answer.headers["x-model-call-id"] == "c1"
    # The upstream was asked for them anyway.
    assert gw.fake.requests[-1]["return_token_ids"] is True
    assert gw.fake.requests[-1]["logprobs"] is True
    [entry] = gw.store.read_entries("r1")
    assert entry.model_call_id == "c1"
    assert entry.prompt_token_ids == render_chat(messages)
    text = body["choices"][0]["message"]["content"]
    assert entry.generation_token_ids == [*encode(text), IM_END]
    assert entry.generation_log_probs == [-0.25 - (i % 7) / 8 for i in range(len(text) + 1)]
    assert entry.model == MODEL
    assert entry.response_id == body["id"]
    assert entry.output_items == [{"role": "assistant", "content": text}]
    assert entry.parent_resolution is ParentResolutionStatus.ROOT
    assert entry.continuation_fingerprint != ""
    assert entry.cum_len == len(entry.prompt_token_ids) + len(entry.generation_token_ids)


async def test_requested_token_fields_are_kept(gw: Harness) -> None:
    answer = await gw.chat("r1", [_user("hi")], return_token_ids=True, logprobs=True)
    body = answer.json()
    [entry] = gw.store.read_entries("r1")
    assert body["prompt_token_ids"] == entry.prompt_token_ids
    assert body["choices"][0]["token_ids"] == entry.generation_token_ids
    lps = [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]
    assert lps == entry.generation_log_probs


@pytest.mark.parametrize(
    ("value", "asked"),
    [
        (1, True),
        (1.0, True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        (0, False),
        ("false", False),
        ("no", False),
    ],
)
async def test_token_fields_asked_as_the_engine_reads_a_boolean(
    gw: Harness, value: object, asked: bool
) -> None:
    # vLLM's request models are pydantic's: `"logprobs": 1` or `"true"` asks for log-probs,
    # and the engine answers them; the client gets what it asked for.
    answer = await gw.chat("r1", [_user("hi")], return_token_ids=value, logprobs=value)
    assert answer.status_code == 200
    body = answer.json()
    choice = body["choices"][0]
    assert ("prompt_token_ids" in body) is asked
    assert ("token_ids" in choice) is asked
    assert ("logprobs" in choice) is asked
    assert gw.store.read_entries("r1")[0].generation_log_probs  # captured either way


async def test_continuation_resolves_to_parent(gw: Harness) -> None:
    messages = [_user("hello")]
    first = (await gw.chat("r1", messages, call="a")).json()
    messages += [first["choices"][0]["message"], _user("more")]
    assert (await gw.chat("r1", messages, call="b")).status_code == 200
    parent, child = gw.store.read_entries("r1")
    assert child.parent_resolution is ParentResolutionStatus.RESOLVED
    assert child.parent_call_id == "a"
    assert child.prefix_supplied is True
    assert child.prefix_requested is False
    prefix = parent.prompt_token_ids + parent.generation_token_ids
    assert child.prompt_token_ids[: len(prefix)] == prefix


async def test_intent_and_parent_lookup_start_together(
    gw: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat call's durable intent and its parent's lookup start together, the intent first
    (one job of the store's worker pool: docs/gateway.md, Performance); a completion, with no
    parent to look up, writes its intent alone. The continuation still resolves (the lookup
    is done by then)."""
    import tokencapture.gateway.app as app_module

    started: list[list[str]] = []
    real = app_module.start_together

    def spy(*coroutines: Any) -> Any:
        started.append([coroutine.__qualname__ for coroutine in coroutines])
        return real(*coroutines)

    monkeypatch.setattr(app_module, "start_together", spy)
    messages = [_user("hello")]
    first = (await gw.chat("together", messages, call="a")).json()
    messages += [first["choices"][0]["message"], _user("more")]
    assert (await gw.chat("together", messages, call="b")).status_code == 200
    answer = await gw.client.post(
        "/rollouts/together-text/v1/completions", json={"model": MODEL, "prompt": "hi"}
    )
    assert answer.status_code == 200
    assert started == [
        ["Backend.begin_call", "Backend.resolve"],
        ["Backend.begin_call", "Backend.resolve"],
    ]
    assert [e.model_call_id for e in gw.store.read_entries("together-text")] == [
        answer.headers["x-model-call-id"]
    ]
    child = gw.store.read_entries("together")[1]
    assert child.parent_resolution is ParentResolutionStatus.RESOLVED
    assert child.parent_call_id == "a"


async def test_rerendered_continuation_is_unresolved_with_reason(tmp_path: Path) -> None:
    harness = Harness(tmp_path / "store", FakeUpstream(drift=True))
    try:
        messages = [_user("hello")]
        first = (await harness.chat("r1", messages, call="a")).json()
        messages += [first["choices"][0]["message"], _user("more")]
        await harness.chat("r1", messages, call="b")
        _, child = harness.store.read_entries("r1")
        assert child.parent_resolution is ParentResolutionStatus.UNRESOLVED
        assert child.parent_call_id is None
        assert child.parent_resolution_reason == DIVERGED_REASON
        assert child.prefix_supplied is False
    finally:
        await harness.close()


async def test_unknown_continuation_is_unresolved_no_match(gw: Harness) -> None:
    messages = [_user("x"), {"role": "assistant", "content": "never sampled"}, _user("y")]
    await gw.chat("r1", messages)
    [entry] = gw.store.read_entries("r1")
    assert entry.parent_resolution is ParentResolutionStatus.UNRESOLVED
    assert entry.parent_resolution_reason == "no_match"


async def test_tool_call_is_captured_as_output_item_and_continues(gw: Harness) -> None:
    messages = [_user("find it")]
    answer = (await gw.chat("r1", messages, tools=TOOLS, call="t1")).json()
    message = answer["choices"][0]["message"]
    [call] = message["tool_calls"]
    [entry] = gw.store.read_entries("r1")
    assert entry.output_items[0]["tool_calls"] == [
        {"id": call["id"], "type": "function", "function": call["function"]}
    ]
    assert entry.generation_token_ids[0] == 3  # <tool_call>
    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    await gw.chat("r1", messages, tools=TOOLS, call="t2")
    child = gw.store.read_entries("r1")[1]
    assert child.parent_call_id == "t1"
    assert child.parent_resolution is ParentResolutionStatus.RESOLVED


async def test_completions_logprobs_zero_is_a_request(gw: Harness) -> None:
    url = "/rollouts/r1/v1/completions"
    plain = (await gw.client.post(url, json={"model": MODEL, "prompt": "abc"})).json()
    assert "logprobs" not in plain["choices"][0]
    assert "token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in plain["choices"][0]
    assert gw.fake.requests[-1]["logprobs"] == 0
    zero = await gw.client.post(url, json={"model": MODEL, "prompt": "abc", "logprobs": 0})
    assert zero.json()["choices"][0]["logprobs"]["token_logprobs"]
    ids = (
        await gw.client.post(
            url, json={"model": MODEL, "prompt": [40, 41], "return_token_ids": True}
        )
    ).json()
    assert ids["choices"][0]["prompt_token_ids"] == [40, 41]
    entries = gw.store.read_entries("r1")
    assert [e.prompt_token_ids for e in entries] == [encode("abc"), encode("abc"), [40, 41]]
    assert entries[2].generation_token_ids == ids["choices"][0]["token_ids"]


def test_captured_routes_are_matched_as_starlette_would(tmp_path: Path) -> None:
    """The ASGI front's own match of the captured routes: what Starlette's `{rollout_id}` (one
    non-empty path segment) would match, nothing else (that goes to Starlette)."""
    app = create_app(open_backend(store_dir=tmp_path), GatewayConfig("http://127.0.0.1:9"))
    route = app.route
    assert route("/rollouts/r1/v1/chat/completions") == ("chat", "r1")
    assert route("/rollouts/r 1.x/v1/completions") == ("completions", "r 1.x")
    assert route("/v1/chat/completions") == ("chat", None)
    assert route("/v1/completions") == ("completions", None)
    for other in (
        "/rollouts//v1/chat/completions",
        "/rollouts/a/b/v1/chat/completions",
        "/rollouts/r1/v1/chat/completions/",
        "/rollouts/r1/v1/models",
        "/rollouts/r1",
        "/rollouts/r1/v1/chat/completionsx",
        "/v1/chat/completions/",
        "/v1/embeddings",
        "/healthz",
    ):
        assert route(other) is None, other


async def test_captured_routes_other_than_post_are_starlettes(gw: Harness) -> None:
    """A GET of a captured route is Starlette's 405, an extra path segment its 404; a call
    under a root path goes through Starlette's router and is captured alike."""
    assert (await gw.client.get("/rollouts/r1/v1/chat/completions")).status_code == 405
    answer = await gw.client.post(
        "/rollouts/a/b/v1/chat/completions", json={"model": MODEL, "messages": [_user("x")]}
    )
    assert answer.status_code == 404
    rooted = httpx.AsyncClient(
        transport=httpx.ASGITransport(gw.app, root_path="/gw"), base_url="http://gateway"
    )
    async with rooted:
        answer = await rooted.post(
            "/gw/rollouts/rooted/v1/chat/completions",
            json={"model": MODEL, "messages": [_user("x")]},
            headers={"x-model-call-id": "c"},
        )
    assert answer.status_code == 200, answer.text
    assert [e.model_call_id for e in gw.store.read_entries("rooted")] == ["c"]
    assert gw.store.read_entries("a") == []


async def test_the_upstream_client_keeps_no_cookies(tmp_path: Path) -> None:
    """An engine's `Set-Cookie` is not sent back on later calls (of any client): the
    gateway's upstream client has no cookie jar."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[str | None] = []

    async def models(request: Request) -> JSONResponse:
        seen.append(request.headers.get("cookie"))
        answer = JSONResponse({"object": "list", "data": []})
        answer.set_cookie("engine", "session-of-someone-else")
        return answer

    upstream = ThreadServer(Starlette(routes=[Route("/v1/models", models)]))
    # By name: aiohttp's default jar would keep no cookie of an IP address anyway.
    url = f"http://localhost:{upstream.port}"
    app = create_app(open_backend(store_dir=tmp_path), GatewayConfig(url))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway")
    try:
        for _ in range(2):
            assert (await client.get("/v1/models")).status_code == 200
    finally:
        await client.aclose()
        await app.state.gateway.close()
        upstream.stop()
    assert seen == [None, None]


async def test_rollout_header_and_passthrough(gw: Harness) -> None:
    answer = await gw.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("a")]},
        headers={"x-rollout-id": "hdr", "x-model-call-id": "h1"},
    )
    assert answer.status_code == 200
    assert [e.model_call_id for e in gw.store.read_entries("hdr")] == ["h1"]
    # No rollout: passed through uncaptured, the upstream's own answer (nulls included).
    before = sorted(p.name for p in gw.root.iterdir())
    plain = await gw.client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [_user("a")]}
    )
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["token_ids"] is None
    assert "return_token_ids" not in gw.fake.requests[-1]
    assert sorted(p.name for p in gw.root.iterdir()) == before
    models = await gw.client.get("/rollouts/r9/v1/models")
    assert models.json()["data"][0]["id"] == MODEL


async def test_generated_call_ids_are_unique(gw: Harness) -> None:
    for _ in range(3):
        await gw.chat("r1", [_user("same")])
    ids = [e.model_call_id for e in gw.store.read_entries("r1")]
    assert len(set(ids)) == 3


@pytest.mark.parametrize("status", [500, 400, 503])
async def test_upstream_error_marks_call_incomplete_and_passes_status(
    gw: Harness, status: int
) -> None:
    answer = await gw.chat("r1", [_user("x")], call="bad", fake_status=status)
    assert answer.status_code == status
    assert answer.json()["message"] == "fake failure"
    assert gw.store.read_entries("r1") == []
    assert gw.store.is_incomplete("r1")
    snapshot = gw.store.freeze_now("r1")
    assert snapshot.incomplete
    rows = [json.loads(line) for line in (gw.root / "r1.lineage.jsonl").read_text().splitlines()]
    assert rows == [{"failure_reason": f"upstream_status_{status}", "model_call_id": "bad"}]


async def test_upstream_down_is_502_and_marked(tmp_path: Path) -> None:
    backend = open_backend(store_dir=tmp_path)
    app = create_app(backend, GatewayConfig("http://127.0.0.1:9", connect_timeout=2.0))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://g") as c:
        answer = await c.post(
            "/rollouts/r1/v1/chat/completions",
            json={"messages": [_user("x")]},
            headers={"x-model-call-id": "d"},
        )
        assert answer.status_code == 502
        assert "upstream unreachable" in answer.json()["error"]["message"]
        health = await c.get("/healthz")
        assert health.status_code == 503
    await app.state.gateway.close()
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("r1")
    assert store.freeze_now("r1").incomplete


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_fake(tmp_path_factory.mktemp("fake"))
    yield server
    server.stop()


async def test_upstream_timeout_is_504_and_marked(tmp_path: Path, fake_server: Server) -> None:
    backend = open_backend(store_dir=tmp_path)
    app = create_app(backend, GatewayConfig(fake_server.url, timeout=0.3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://g") as c:
        answer = await c.post(
            "/rollouts/r1/v1/chat/completions",
            json={"messages": [_user("x")], "fake_delay": 2},
            headers={"x-model-call-id": "slow"},
        )
        assert answer.status_code == 504
        fine = await c.post("/rollouts/r2/v1/chat/completions", json={"messages": [_user("x")]})
        assert fine.status_code == 200
    await app.state.gateway.close()
    store = TokenCaptureStore(tmp_path)
    assert store.is_incomplete("r1")
    assert not store.is_incomplete("r2")
    assert (tmp_path / "r1.lineage.jsonl").read_text().strip() == json.dumps(
        {"failure_reason": "upstream_timeout", "model_call_id": "slow"},
        separators=(",", ":"),
        sort_keys=True,
    )


async def test_intent_is_durable_before_the_upstream_sees_the_call(tmp_path: Path) -> None:
    root = tmp_path / "store"
    seen: list[bool] = []
    intents = TokenCaptureStore(root).intents_path_for("r1")

    def check(body: dict[str, Any]) -> None:
        seen.append(intents.exists() and b"c1" in intents.read_bytes())

    harness = Harness(root, FakeUpstream(on_request=check))
    try:
        assert (await harness.chat("r1", [_user("x")], call="c1")).status_code == 200
    finally:
        await harness.close()
    assert seen == [True]


@contextlib.contextmanager
def _served(root: Path, fake: FakeUpstream) -> Iterator[ThreadServer]:
    """The gateway over `root` in front of `fake`, both served on loopback sockets from
    threads (an in-process client would buffer a whole stream)."""
    upstream = ThreadServer(fake.app)
    server = ThreadServer(
        create_app(open_backend(store_dir=root), GatewayConfig(upstream.url)), lifespan="on"
    )
    try:
        yield server
    finally:
        server.stop()
        upstream.stop()


def _slow_stream(client: httpx.AsyncClient, call: str, **knobs: Any) -> Any:
    return client.stream(
        "POST",
        "/rollouts/r1/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("a slow stream")], "stream": True, **knobs},
        headers={"x-model-call-id": call},
    )


async def test_stream_final_chunk_and_done_wait_for_the_put(tmp_path: Path) -> None:
    """Over a real socket (an in-process client buffers the whole stream): when the chunk that
    finishes the generation, and `[DONE]`, reach the client, the entry is stored; the chunks
    before it arrive while the call is still in flight (passed through, not buffered)."""
    root = tmp_path / "store"
    store = TokenCaptureStore(root)
    stored_at: list[tuple[str, int]] = []
    with _served(root, FakeUpstream()) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            # The engine pauses between its final chunk and [DONE]: a gateway that let the
            # final chunk through before the put is seen doing so.
            _slow_stream(client, "s1", fake_chunk_delay=0.02, fake_done_delay=0.3) as answer,
        ):
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    kind = "done"
                elif orjson.loads(data)["choices"][0].get("finish_reason") is not None:
                    kind = "final"
                else:
                    kind = "delta"
                stored_at.append((kind, len(store.read_entries("r1"))))
    kinds = [kind for kind, _ in stored_at]
    assert kinds[-2:] == ["final", "done"]
    assert kinds.count("delta") >= 3
    assert stored_at[-2:] == [("final", 1), ("done", 1)]
    assert ("delta", 0) in stored_at  # some deltas reached the client before the put


async def test_client_disconnect_mid_stream_drops_the_upstream_stream(tmp_path: Path) -> None:
    """A client that goes away mid-stream: the call is marked incomplete and the gateway drops
    its upstream connection (the engine stops generating) rather than reading the rest."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    store = TokenCaptureStore(root)
    with _served(root, fake) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            _slow_stream(client, "gone", fake_chunk_delay=0.1) as answer,
        ):
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    break
        deadline = asyncio.get_running_loop().time() + 15
        while not (fake.streams_cut and store.is_incomplete("r1")):
            assert asyncio.get_running_loop().time() < deadline, "not cut or not marked"
            await asyncio.sleep(0.05)
    assert (fake.streams_cut, fake.streams_done) == (1, 0)
    assert store.read_entries("r1") == []


@contextlib.asynccontextmanager
async def _served_on_this_loop(app: Any) -> AsyncIterator[str]:
    """`app` served by uvicorn on a loopback port from a task of the running event loop (the
    test's own): a client on the same loop then runs only when the server's code awaits, so
    what the server does between two of its awaits is one step the client cannot split."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 30
    while not server.started:
        assert not serving.done(), "the gateway did not start"
        assert asyncio.get_running_loop().time() < deadline, "the gateway did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


# Long enough (one chunk per byte) that a relay letting the loop run between chunks gives a
# client on the same loop many more turns than it needs to read a line and hang up.
_LONG_REPLY = "a stream the engine finished before the client read its first line " * 2


async def test_client_gone_while_the_engine_ran_ahead_is_marked_not_stored(
    tmp_path: Path,
) -> None:
    """The engine sends its whole stream in one write (every chunk and `[DONE]` are buffered
    in the gateway before the relay reads the first); the client reads the first chunk and
    hangs up. The call is marked incomplete as `client_disconnected` and not stored, and the
    rollout freezes incomplete (docs/gateway.md), as for a client that leaves while the engine
    is still generating.

    Deterministic: the gateway and the client share this test's event loop, so the client
    reads and hangs up only when the relay awaits. A relay that never awaits while the chunks
    are buffered (before bee5ca0) stores the call whole before the client ran at all; one
    that lets the loop run between chunks sees the disconnect before the last chunk."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    store = TokenCaptureStore(root)
    body = {
        "model": MODEL,
        "messages": [_user("everything at once")],
        "stream": True,
        "fake_one_write": True,
        "fake_reply": _LONG_REPLY,
    }
    payload = orjson.dumps(body)
    request = (
        b"POST /rollouts/ahead/v1/chat/completions HTTP/1.1\r\n"
        b"host: gateway\r\ncontent-type: application/json\r\n"
        b"x-model-call-id: left\r\n" + b"content-length: %d\r\n\r\n" % len(payload) + payload
    )
    try:
        async with _served_on_this_loop(app) as address:
            host, port = address.split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert status.startswith(b"HTTP/1.1 200 "), status
            first = b""
            while not first.startswith(b"data: "):  # skip the chunked encoding's size line
                first = await asyncio.wait_for(reader.readline(), 30)
            assert orjson.loads(first[6:])["choices"][0]["finish_reason"] is None
            writer.close()  # the client leaves after the first chunk
            await writer.wait_closed()
            deadline = asyncio.get_running_loop().time() + 10
            while not store.is_incomplete("ahead"):
                assert asyncio.get_running_loop().time() < deadline, (
                    f"not marked incomplete; {len(store.read_entries('ahead'))} entries stored"
                )
                await asyncio.sleep(0.02)
    finally:
        upstream.stop()
    assert (fake.streams_done, fake.streams_cut) == (1, 0)  # the engine had sent it all
    assert not app.gateway._in_flight  # the call's place in flight went with its client
    assert store.read_entries("ahead") == []
    assert json.loads((root / "ahead.lineage.jsonl").read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "left",
    }
    assert store.freeze_now("ahead").incomplete


def _chat_scope(rollout_id: str, call_id: str, payload: bytes) -> dict[str, Any]:
    """The ASGI scope of a captured chat POST, for tests that drive the app by hand."""
    path = f"/rollouts/{rollout_id}/v1/chat/completions"
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"gateway"),
            (b"content-type", b"application/json"),
            (b"x-model-call-id", call_id.encode()),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


async def test_client_gone_before_the_store_is_marked_not_stored(tmp_path: Path) -> None:
    """The relay's last look at the client, once the whole stream is in and before the entry
    is stored: a client that left by then is not stored but marked `client_disconnected`.

    Driven through the ASGI interface by hand, so that only that look can see the client
    leave: the client goes as soon as the first chunk reaches it, and this server answers
    `http.disconnect` to every `receive` called after that, but never wakes a `receive` that
    was already pending (Starlette's disconnect listener, which would cancel the relay, is such
    a one: a server's wake-up of it lags behind the relay when the engine's chunks are all
    buffered). The pauses between chunks do not look at the client, so without the final check
    the call is stored whole and `[DONE]` sent to a client that is gone."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    store = TokenCaptureStore(root)
    payload = orjson.dumps(
        {
            "model": MODEL,
            "messages": [_user("everything at once")],
            "stream": True,
            "fake_one_write": True,
            "fake_reply": "a stream the client leaves after its first chunk",
        }
    )
    gone = False
    requested = False
    never = asyncio.get_running_loop().create_future()  # a pending receive is never woken
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if gone:
            return {"type": "http.disconnect"}
        # Shielded: a receive cancelled by its caller (the gateway's disconnect watch while
        # the engine works, as Starlette's listener does) leaves the others pending, as a
        # server's receive does.
        result: dict[str, Any] = await asyncio.shield(never)
        return result

    async def send(message: dict[str, Any]) -> None:
        nonlocal gone
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            gone = True  # the client leaves once the first chunk reached it

    scope = _chat_scope("before-store", "left", payload)
    try:
        await asyncio.wait_for(app(scope, receive, send), 30)
    finally:
        never.cancel()
        await app.state.gateway.close()
        upstream.stop()
    assert sent and orjson.loads(sent[0][6:])["choices"][0]["finish_reason"] is None
    assert not any(b"[DONE]" in body for body in sent)
    assert not app.gateway._in_flight
    assert fake.streams_done == 1  # the engine had sent it all
    assert store.read_entries("before-store") == []
    assert json.loads((root / "before-store.lineage.jsonl").read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "left",
    }
    assert store.freeze_now("before-store").incomplete
    stats = app.state.gateway.metrics.snapshot()["chat_completions"]
    assert (stats["count"], stats["failures"]) == (1, 1)  # the client left: a failure


class _GoneBeforeTheAnswer(OSError):
    """What an ASGI server (spec 2.4, as uvicorn's `ClientDisconnected`) raises from `send`
    when the client has gone."""


def _client_gone_after_its_request(
    payload: bytes, *, send_raises: bool, seen_by_receive: bool = True
) -> tuple[Any, Any]:
    """(receive, send) of an ASGI server whose client sent `payload` and left: every later
    `receive` answers `http.disconnect`; `send` raises (as uvicorn's does under ASGI spec 2.4)
    or, with `send_raises` false, drops what it is given (spec 2.3).

    With `seen_by_receive` false, a later `receive` blocks instead (the server has not read
    the departure off the socket yet, or the client leaves only once the engine answered): the
    gateway's watch of the client while the engine works sees nothing, and the departure shows
    when the answer is sent (`send` raises)."""
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if not seen_by_receive:
            await asyncio.Event().wait()  # never set; cancellable, as a server's receive is
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if send_raises:
            raise _GoneBeforeTheAnswer("the client is gone")

    return receive, send


async def test_stream_whose_client_left_before_its_first_byte_is_marked_and_let_go(
    tmp_path: Path,
) -> None:
    """A captured stream whose client is gone before the answer's headers go out: Starlette
    never iterates the relay, so nothing of the relay ever runs. The call is still marked
    `client_disconnected` (not stored, its rollout freezes incomplete), its place in flight
    freed, and its upstream stream dropped at once (the engine stops generating), not held
    until the garbage collector finds the relay."""
    from starlette.requests import ClientDisconnect

    root = tmp_path / "store"
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    store = TokenCaptureStore(root)
    payload = orjson.dumps(
        {
            "model": MODEL,
            "messages": [_user("a stream no one reads")],
            "stream": True,
            "fake_chunk_delay": 0.2,
        }
    )
    scope = _chat_scope("unread", "left-early", payload)
    scope["asgi"] = {"version": "3.0", "spec_version": "2.4"}
    receive, send = _client_gone_after_its_request(payload, send_raises=True, seen_by_receive=False)
    try:
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(app(scope, receive, send), 30)
        deadline = asyncio.get_running_loop().time() + 10
        while not (fake.streams_cut and store.is_incomplete("unread")):
            assert asyncio.get_running_loop().time() < deadline, (
                f"streams cut {fake.streams_cut}, marked {store.is_incomplete('unread')}"
            )
            await asyncio.sleep(0.02)
    finally:
        await app.state.gateway.close()
        upstream.stop()
    assert (fake.streams_cut, fake.streams_done) == (1, 0)
    assert not app.gateway._in_flight
    assert store.read_entries("unread") == []
    assert json.loads((root / "unread.lineage.jsonl").read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "left-early",
    }
    assert store.freeze_now("unread").incomplete


async def test_passthrough_whose_client_left_before_its_first_byte_frees_its_connection(
    tmp_path: Path,
) -> None:
    """An uncaptured call whose client is gone before the answer's first byte gives its
    upstream connection back at once: with a pool of one connection, the next call goes
    through instead of waiting for the unread stream's end (or the garbage collector)."""
    from starlette.requests import ClientDisconnect

    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    app = create_app(
        open_backend(store_dir=tmp_path / "store"),
        GatewayConfig(upstream.url, max_connections=1, timeout=20),
    )
    # A stream slower than the wait below: its connection is not given back by its end.
    payload = orjson.dumps(
        {
            "model": MODEL,
            "messages": [_user("passed through")],
            "stream": True,
            "fake_chunk_delay": 3,
        }
    )
    scope = _chat_scope("unused", "unused", payload)
    scope["asgi"] = {"version": "3.0", "spec_version": "2.4"}
    scope["path"] = "/v1/chat/completions"  # and no X-Rollout-Id: passed through
    scope["raw_path"] = b"/v1/chat/completions"
    receive, send = _client_gone_after_its_request(payload, send_raises=True, seen_by_receive=False)
    try:
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(app(scope, receive, send), 30)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://gateway"
        ) as client:
            answer = await asyncio.wait_for(
                client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [_user("next")]},
                ),
                5,
            )
        assert answer.status_code == 200
    finally:
        await app.state.gateway.close()
        upstream.stop()


async def test_call_cancelled_in_the_gateway_is_marked(tmp_path: Path) -> None:
    """A call whose task is cancelled while the engine works (a server stopping past its grace
    period cancels its requests' tasks): no answer leaves, the call is marked `cancelled` and
    its rollout freezes incomplete, as for any call that failed in flight."""
    root = tmp_path / "store"
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    store = TokenCaptureStore(root)
    payload = orjson.dumps({"model": MODEL, "messages": [_user("slow")], "fake_delay": 3})
    receive, send = _client_gone_after_its_request(payload, send_raises=True, seen_by_receive=False)
    call = asyncio.ensure_future(app(_chat_scope("stopped", "in-flight", payload), receive, send))
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while not (root / "stopped.tokens.intents").exists():  # dispatched: its intent is in
            assert asyncio.get_running_loop().time() < deadline, "no intent written"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        await app.state.gateway.close()  # waits for the mark
        upstream.stop()
    assert json.loads((root / "stopped.lineage.jsonl").read_text()) == {
        "failure_reason": "cancelled",
        "model_call_id": "in-flight",
    }
    assert store.read_entries("stopped") == []
    assert store.is_incomplete("stopped")


async def test_answer_without_token_ids_is_502_not_captured(gw: Harness) -> None:
    answer = await gw.chat("r1", [_user("x")], fake_no_token_ids=True)
    assert answer.status_code == 502
    assert "prompt_token_ids" in answer.json()["error"]["message"]
    assert gw.store.is_incomplete("r1")


async def test_store_failure_is_503_never_200(gw: Harness) -> None:
    await gw.chat("r1", [_user("x")], call="ok")
    snapshot = gw.store.freeze_now("r1")  # a frozen rollout refuses more intents
    answer = await gw.chat("r1", [_user("y")], call="late")
    assert answer.status_code == 409
    assert gw.store.freeze_now("r1").version == snapshot.version

    class Failing:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def put(self, entry: Any) -> Any:
            async def fail() -> None:
                raise OSError(28, "No space left on device")

            return fail()

        put_unless_stored = put  # how a call with the client's own id is put

    gw.backend.store = Failing(gw.backend.store)
    answer = await gw.chat("r2", [_user("z")], call="lost")
    assert answer.status_code == 503
    assert "No space left on device" in answer.json()["error"]["message"]
    assert gw.fake.calls == 2  # the engine answered; the answer was withheld
    assert gw.store.read_entries("r2") == []
    assert gw.store.freeze_now("r2").incomplete


async def test_n_above_one_is_refused(gw: Harness) -> None:
    answer = await gw.chat("r1", [_user("x")], n=2)
    assert answer.status_code == 400
    assert "n=2" in answer.json()["error"]["message"]
    assert gw.fake.calls == 0
    assert not (gw.root / "r1.tokens.intents").exists()


@pytest.mark.parametrize("rollout", ["bad%20id", "a..b%2Fc", "x" * 300])
async def test_rollout_ids_are_validated(gw: Harness, rollout: str) -> None:
    answer = await gw.client.post(
        f"/rollouts/{rollout}/v1/chat/completions", json={"messages": [_user("x")]}
    )
    assert answer.status_code in (400, 404)
    assert gw.fake.calls == 0


@pytest.mark.parametrize("call_id", [b" lead", b"trail ", b"\xff\xfe"])
async def test_bad_call_ids_are_refused(gw: Harness, call_id: bytes) -> None:
    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={"messages": [_user("x")]},
        headers=[(b"x-model-call-id", call_id)],
    )
    assert answer.status_code == 400
    assert "model call id" in answer.json()["error"]["message"]
    assert gw.fake.calls == 0


async def test_utf8_call_id_is_kept(gw: Harness) -> None:
    answer = await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={"messages": [_user("x")]},
        headers=[(b"x-model-call-id", "\u00e9t\u00e9".encode())],
    )
    assert answer.status_code == 200
    assert [e.model_call_id for e in gw.store.read_entries("r1")] == ["\u00e9t\u00e9"]


async def test_bad_json_and_body_limit(tmp_path: Path) -> None:
    harness = Harness(tmp_path, FakeUpstream(), max_body_bytes=1000)
    try:
        big = await harness.chat("r1", [_user("x" * 2000)])
        assert big.status_code == 413
        body = orjson.dumps({"model": MODEL, "messages": [_user("y" * 2000)]})

        async def chunked() -> AsyncIterator[bytes]:  # no content-length: counted as read
            for start in range(0, len(body), 256):
                yield body[start : start + 256]

        streamed = await harness.client.post("/rollouts/r1/v1/chat/completions", content=chunked())
        assert "content-length" not in streamed.request.headers
        assert streamed.status_code == 413
        bad = await harness.client.post("/rollouts/r1/v1/chat/completions", content=b"{nope")
        assert bad.status_code == 400
        assert harness.fake.calls == 0
    finally:
        await harness.close()


async def test_bearer_token(tmp_path: Path) -> None:
    harness = Harness(tmp_path, FakeUpstream(), token="s3cret")
    try:
        assert (await harness.chat("r1", [_user("x")])).status_code == 401
        harness.client.headers["authorization"] = "Bearer wrong"
        assert (await harness.chat("r1", [_user("x")])).status_code == 401
        assert (await harness.client.get("/rollouts/r1")).status_code == 401
        assert (await harness.client.get("/v1/models")).status_code == 401
        harness.client.headers["authorization"] = "Bearer s3cret"
        assert (await harness.chat("r1", [_user("x")])).status_code == 200
        # The gateway's token is not forwarded to the engine.
        assert (await harness.client.get("/healthz")).status_code == 200
        assert harness.fake.calls == 1
    finally:
        await harness.close()


async def test_stream_is_captured_and_final_chunk_follows_the_put(gw: Harness) -> None:
    messages = [_user("stream me")]
    answer = await gw.chat(
        "r1", messages, call="s1", stream=True, stream_options={"include_usage": True}
    )
    assert answer.status_code == 200
    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])
    assert all("prompt_token_ids" not in c for c in chunks)
    [entry] = gw.store.read_entries("r1")
    assert entry.prompt_token_ids == render_chat(messages)
    assert entry.generation_token_ids == [*encode(text), IM_END]
    assert len(entry.generation_log_probs) == len(entry.generation_token_ids)
    assert entry.output_items == [{"role": "assistant", "content": text}]


async def test_stream_with_token_fields_and_tools(gw: Harness) -> None:
    answer = await gw.chat(
        "r1", [_user("go")], tools=TOOLS, stream=True, return_token_ids=True, logprobs=True
    )
    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"]
    ids = [t for c in chunks for t in (c["choices"][0].get("token_ids") or [])]
    [entry] = gw.store.read_entries("r1")
    assert ids == entry.generation_token_ids
    assert chunks[0]["prompt_token_ids"] == entry.prompt_token_ids
    [call] = entry.output_items[0]["tool_calls"]
    assert call["function"]["name"] == "lookup"


async def test_stream_broken_by_upstream_is_marked_and_never_done(gw: Harness) -> None:
    answer = await gw.chat(
        "r1", [_user("long text here")], stream=True, fake_break_after=3, call="broken"
    )
    assert "[DONE]" not in answer.text
    [error] = [
        json.loads(line[len("data: ") :])["error"]
        for line in answer.text.splitlines()
        if line.startswith("data: {") and '"error"' in line
    ]
    assert error["type"] == "upstream_error"  # the engine's stream failed, not the gateway
    assert error["code"] == 502
    assert gw.store.read_entries("r1") == []
    assert gw.store.is_incomplete("r1")


async def test_rollout_summary(gw: Harness) -> None:
    messages = [_user("hello")]
    first = (await gw.chat("r1", messages, call="a")).json()
    messages += [first["choices"][0]["message"], _user("more")]
    await gw.chat("r1", messages, call="b")
    summary = (await gw.client.get("/rollouts/r1")).json()
    assert summary["entries"] == 2
    assert summary["parent_resolution"] == {"root": 1, "resolved": 1}
    assert summary["continuations_prefix_supplied"] == 1
    assert [c["model_call_id"] for c in summary["calls"]] == ["a", "b"]
    assert summary["incomplete"] is False
    empty = (await gw.client.get("/rollouts/nothing")).json()
    assert empty["entries"] == 0


async def test_healthz(gw: Harness) -> None:
    answer = await gw.client.get("/healthz")
    assert answer.status_code == 200
    assert answer.json()["status"] == "ok"


async def test_metrics_count_gateway_calls(gw: Harness) -> None:
    await gw.chat("r1", [_user("x")])
    await gw.chat("r1", [_user("x")], fake_status=500)
    stats = gw.app.state.gateway.metrics.snapshot()
    assert stats["chat_completions"]["count"] == 2
    assert stats["chat_completions"]["failures"] == 1


async def test_metrics_count_a_stream_by_how_it_ended(gw: Harness) -> None:
    """A stream counts once its sending is over: a whole one as a success, one the engine
    broke (its client gets an error event, its rollout is marked) as a failure. Both were
    counted as successes when their headers went out."""
    metrics = gw.app.state.gateway.metrics
    whole = await gw.chat("r1", [_user("x")], stream=True, call="whole")
    assert "[DONE]" in whole.text
    stats = metrics.snapshot()["chat_completions"]
    assert (stats["count"], stats["failures"]) == (1, 0)
    broken = await gw.chat(
        "r2", [_user("long text here")], stream=True, fake_break_after=3, call="broken"
    )
    assert "[DONE]" not in broken.text
    stats = metrics.snapshot()["chat_completions"]
    assert (stats["count"], stats["failures"]) == (2, 1)


async def test_concurrent_sessions(gw: Harness) -> None:
    async def session(index: int) -> None:
        messages = [_user(f"s{index}")]
        for turn in range(3):
            answer = (await gw.chat(f"s{index}", messages, call=f"s{index}-{turn}")).json()
            messages += [answer["choices"][0]["message"], _user(f"t{turn}")]

    await asyncio.gather(*(session(i) for i in range(16)))
    for index in range(16):
        entries = gw.store.read_entries(f"s{index}")
        assert [e.parent_call_id for e in entries] == [None, f"s{index}-0", f"s{index}-1"]


# Found by driving a real vLLM through the gateway (the review's held-out-style harness) ------


async def test_rollout_frozen_while_the_call_is_in_flight_keeps_its_snapshot_droppable(
    gw: Harness,
) -> None:
    """A trainer freezes a rollout while one of its calls is still at the engine: the late
    entry is refused (409, not a 503 that invites retries) and the call is NOT marked
    incomplete after the freeze, which would move the snapshot's version and make the
    trainer's `drop` of that snapshot fail. The freeze already masked the rollout (the call's
    intent had no entry)."""
    await gw.chat("r1", [_user("first")], call="first")
    late = asyncio.create_task(gw.chat("r1", [_user("late")], call="late", fake_delay=0.5))
    intents = gw.store.intents_path_for("r1")
    for _ in range(200):  # the late call's intent is durable: it is at the engine
        if b"late" in intents.read_bytes():
            break
        await asyncio.sleep(0.01)
    snapshot = gw.store.freeze_now("r1")
    assert snapshot.incomplete  # the in-flight call's intent has no entry
    answer = await late
    assert answer.status_code == 409
    assert answer.json()["error"]["type"] == "rollout_closed"
    assert [e.model_call_id for e in gw.store.read_entries("r1")] == ["first"]
    assert gw.store.freeze_now("r1").version == snapshot.version
    assert await gw.store.drop("r1", snapshot.snapshot_id, snapshot.version)


async def test_a_reused_call_id_is_a_409_conflict(gw: Harness) -> None:
    """The same X-Model-Call-Id for a second, different request once the first is stored: the
    intent step finds the stored entry, the requests differ, so the gateway answers 409
    `model_call_id_conflict` before anything is dispatched, written or marked (a retry with
    the same id can never succeed, so not a 503 that a client's retry policy would repeat;
    and no generation reached the agent uncaptured, so the rollout stays whole)."""
    first = await gw.chat("r1", [_user("one")], call="same")
    assert first.status_code == 200
    second = await gw.chat("r1", [_user("two")], call="same")
    assert second.status_code == 409
    assert second.json()["error"]["type"] == "model_call_id_conflict"
    assert gw.fake.calls == 1
    [entry] = gw.store.read_entries("r1")
    assert entry.output_items[0]["content"] == first.json()["choices"][0]["message"]["content"]
    # Nothing was marked or stored as a conflict: a first put writes no state index, and the
    # 409 wrote none either.
    assert not gw.store.state_path_for("r1").exists()
    assert not gw.store.incomplete_path_for("r1").exists()
    assert gw.store.intents_path_for("r1").read_bytes() == b"same\n"
    assert not gw.store.freeze_now("r1").incomplete


async def test_an_empty_rollout_header_is_refused_not_passed_through(gw: Harness) -> None:
    """`X-Rollout-Id:` present but empty names an invalid rollout (400): passing the call
    through uncaptured would answer 200 with nothing stored for a client that meant to
    capture."""
    answer = await gw.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("a")]},
        headers={"x-rollout-id": ""},
    )
    assert answer.status_code == 400
    assert "rollout id" in answer.json()["error"]["message"]
    assert gw.fake.calls == 0


@pytest.mark.parametrize("prompt", [["a", "b"], [[40, 41], [42]]])
async def test_a_batched_completions_prompt_is_refused_before_the_engine(
    gw: Harness, prompt: list[Any]
) -> None:
    """Several prompts in one completions call would make the engine answer one choice each
    (and the call uncapturable after the engine did the work): refused like `n > 1`."""
    answer = await gw.client.post(
        "/rollouts/r1/v1/completions", json={"model": MODEL, "prompt": prompt}
    )
    assert answer.status_code == 400
    assert "one prompt" in answer.json()["error"]["message"]
    assert gw.fake.calls == 0
    assert not gw.store.intents_path_for("r1").exists()
    ids = await gw.client.post(
        "/rollouts/r1/v1/completions", json={"model": MODEL, "prompt": [40, 41]}
    )
    assert ids.status_code == 200  # one prompt of token ids is no batch


async def test_rollout_summary_tells_the_state_and_the_calls_without_entry(gw: Harness) -> None:
    """The summary of a rollout with a lost call (an intent and no entry: a SIGKILL, say) says
    so, where the stored `incomplete` flag cannot yet; frozen, retired and unknown ids say
    which they are rather than looking like an empty open rollout."""
    await gw.chat("r1", [_user("kept")], call="kept")
    await gw.store.begin_call("r1", "lost")
    summary = (await gw.client.get("/rollouts/r1")).json()
    assert summary["state"] == "open"
    assert summary["calls_without_entry"] == ["lost"]
    assert summary["incomplete"] is False  # judged at freeze
    assert gw.store.freeze_now("r1").incomplete
    assert (await gw.client.get("/rollouts/r1")).json()["state"] == "frozen"
    await gw.store.retire(["r1"])
    retired = (await gw.client.get("/rollouts/r1")).json()
    assert (retired["state"], retired["entries"]) == ("retired", 0)
    assert (await gw.client.get("/rollouts/never")).json()["state"] == "empty"


async def test_a_call_failing_after_its_rollout_froze_keeps_the_snapshot_droppable(
    gw: Harness,
) -> None:
    """The same for a call that fails (here the engine's 500) after the trainer froze its
    rollout: recorded in the ledger, not marked, so the snapshot's version does not move."""
    await gw.chat("r1", [_user("first")], call="first")
    late = asyncio.create_task(
        gw.chat("r1", [_user("late")], call="late", fake_delay=0.5, fake_status=500)
    )
    intents = gw.store.intents_path_for("r1")
    for _ in range(200):
        if b"late" in intents.read_bytes():
            break
        await asyncio.sleep(0.01)
    snapshot = gw.store.freeze_now("r1")
    assert snapshot.incomplete
    assert (await late).status_code == 500
    rows = [json.loads(line) for line in (gw.root / "r1.lineage.jsonl").read_text().splitlines()]
    assert {"failure_reason": "upstream_status_500", "model_call_id": "late"} in rows
    assert gw.store.freeze_now("r1").version == snapshot.version
    assert await gw.store.drop("r1", snapshot.snapshot_id, snapshot.version)


async def test_a_client_gone_before_the_answer_is_marked_not_stored(tmp_path: Path) -> None:
    """A non-streaming client that leaves while the engine works (an agent's timeout): as for
    a stream it leaves, the call is marked `client_disconnected` and not stored, rather than
    kept as a call no one saw in a rollout that stays unmasked; and the engine's request is
    cancelled (its connection closed: the engine stops) rather than waited for. Driven through
    ASGI by hand: the client leaves once the engine has its request, and the server then
    answers `http.disconnect` to `receive` (also to the one already waiting)."""
    root = tmp_path / "store"
    loop = asyncio.get_running_loop()
    at_the_engine = asyncio.Event()
    fake = FakeUpstream(on_request=lambda body: loop.call_soon_threadsafe(at_the_engine.set))
    upstream = ThreadServer(fake.app)
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    payload = orjson.dumps({"model": MODEL, "messages": [_user("slow")], "fake_delay": 5})
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await at_the_engine.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass  # ASGI spec 2.3: what is sent to a client that is gone is dropped

    scope = _chat_scope("left", "gone", payload)
    try:
        started = loop.time()
        await asyncio.wait_for(app(scope, receive, send), 30)
        assert loop.time() - started < 4  # not held until the engine's answer
        deadline = loop.time() + 4
        while not fake.abandoned:  # the engine saw its connection closed, and stopped
            assert loop.time() < deadline, "the engine's request went on"
            await asyncio.sleep(0.02)
    finally:
        await app.state.gateway.close()
        upstream.stop()
    store = TokenCaptureStore(root)
    assert fake.calls == 0  # the engine did not finish it
    assert store.read_entries("left") == []
    assert json.loads((root / "left.lineage.jsonl").read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "gone",
    }
    assert store.freeze_now("left").incomplete


# A retry with the same X-Model-Call-Id after a lost answer ------------------------------------


def _events(answer: httpx.Response) -> list[Any]:
    """A stream's chunks (its `[DONE]` checked and dropped)."""
    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("tools", [None, TOOLS])
async def test_a_retry_of_a_stored_call_is_answered_from_the_store(
    gw: Harness, tools: list[Any] | None
) -> None:
    """The answer was lost (a SIGKILL after the put, a dropped connection) and the client sends
    the call again with its id: the stored answer comes back, with no second request to the
    engine (which would now answer otherwise), no second intent, no mark, and a replay in the
    metrics; the token fields follow what the retry asks for."""
    messages = [_user("hello")]
    asked = {"return_token_ids": True, "logprobs": True, "tools": tools}
    first = (await gw.chat("r1", messages, call="c1", **asked)).json()
    seen = len(gw.fake.requests)
    gw.fake.reply = "another answer"  # the engine would now answer otherwise
    retry = await gw.chat("r1", messages, call="c1", **asked)
    assert retry.status_code == 200, retry.text
    assert retry.headers["x-model-call-id"] == "c1"
    again = retry.json()
    assert len(gw.fake.requests) == seen  # the engine saw no second request
    for key in ("id", "model", "prompt_token_ids"):
        assert again[key] == first[key], key
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [again["usage"][k] for k in counts] == [first["usage"][k] for k in counts]
    choice, was = again["choices"][0], first["choices"][0]
    for key in ("content", "tool_calls"):
        assert choice["message"][key] == was["message"][key], key
    assert choice["token_ids"] == was["token_ids"]
    assert choice["finish_reason"] == was["finish_reason"]
    logprobs = [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]
    assert logprobs == [(t["token"], t["logprob"]) for t in was["logprobs"]["content"]]
    # `return_token_ids` shapes the answer only: a retry may differ in it.
    plain = (await gw.chat("r1", messages, call="c1", logprobs=True, tools=tools)).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] == choice["logprobs"]
    assert plain["choices"][0]["message"] == choice["message"]
    assert len(gw.fake.requests) == seen
    assert gw.store.intents_path_for("r1").read_bytes() == b"c1\n"  # no second intent
    assert gw.app.state.gateway.metrics.snapshot()["replay"]["count"] == 2
    snapshot = gw.store.freeze_now("r1")
    assert not snapshot.incomplete
    assert [e.model_call_id for e in snapshot.entries] == ["c1"]
    frozen = await gw.chat("r1", messages, call="c1", **asked)  # a read: still answered
    assert frozen.json()["choices"][0]["message"] == choice["message"]
    assert gw.store.freeze_now("r1").version == snapshot.version
    assert await gw.store.drop("r1", snapshot.snapshot_id, snapshot.version)


@pytest.mark.parametrize("tools", [None, TOOLS])
async def test_a_streamed_retry_of_a_stored_call_replays_a_valid_stream(
    gw: Harness, tools: list[Any] | None
) -> None:
    """The same for a streaming retry: a valid SSE stream (the generation, the finish reason,
    the usage asked for, `[DONE]`) whose chunks add up to the stored answer."""
    messages = [_user("stream me")]
    first = await gw.chat(
        "r1", messages, call="s1", stream=True, return_token_ids=True, logprobs=True, tools=tools
    )
    chunks = _events(first)
    seen = len(gw.fake.requests)
    gw.fake.reply = "another answer"  # the engine would now answer otherwise
    retry = await gw.chat(
        "r1",
        messages,
        call="s1",
        stream=True,
        return_token_ids=True,
        logprobs=True,
        tools=tools,
        stream_options={"include_usage": True},
    )
    assert retry.status_code == 200
    assert retry.headers["content-type"].startswith("text/event-stream")
    replayed = _events(retry)
    assert len(gw.fake.requests) == seen

    def folded(chunks: list[Any]) -> tuple[Any, ...]:
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        deltas = [c["delta"] for c in choices]
        calls = [
            (call.get("id"), call["function"].get("name"), call["function"].get("arguments"))
            for d in deltas
            for call in d.get("tool_calls") or ()
        ]
        return (
            {c["id"] for c in chunks},
            [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")],
            "".join(d.get("content") or "" for d in deltas),
            calls,
            [t for c in choices for t in c.get("token_ids") or ()],
            [t["logprob"] for c in choices for t in (c.get("logprobs") or {}).get("content", ())],
            [c["finish_reason"] for c in choices if c["finish_reason"]],
        )

    assert folded(replayed) == folded(chunks)
    assert replayed[-1]["usage"]["completion_tokens"] == len(folded(chunks)[4])
    plain = _events(
        await gw.chat("r1", messages, call="s1", stream=True, logprobs=True, tools=tools)
    )
    assert all("token_ids" not in c["choices"][0] for c in plain if c["choices"])
    assert all("prompt_token_ids" not in c for c in plain)
    assert len(gw.fake.requests) == seen
    assert not gw.store.freeze_now("r1").incomplete


async def test_a_completions_retry_is_answered_from_the_store(gw: Harness) -> None:
    """Completions too, non-streaming and streaming; the finish reason `length` is computed
    from the stored tokens and the request's `max_tokens`."""
    url = "/rollouts/r1/v1/completions"
    body = {"model": MODEL, "prompt": "abc", "return_token_ids": True, "logprobs": 1}
    headers = {"x-model-call-id": "k1"}
    first = (await gw.client.post(url, json={**body, "max_tokens": 3}, headers=headers)).json()
    seen = len(gw.fake.requests)
    retry = await gw.client.post(url, json={**body, "max_tokens": 3}, headers=headers)
    again = retry.json()
    assert len(gw.fake.requests) == seen
    assert (again["id"], again["model"]) == (first["id"], first["model"])
    choice, was = again["choices"][0], first["choices"][0]
    for key in ("text", "prompt_token_ids", "token_ids", "finish_reason"):
        assert choice[key] == was[key], key
    assert was["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == was["logprobs"]["token_logprobs"]
    stream = _events(
        await gw.client.post(url, json={**body, "max_tokens": 3, "stream": True}, headers=headers)
    )
    assert "".join(c["choices"][0]["text"] for c in stream) == was["text"]
    assert [t for c in stream for t in c["choices"][0].get("token_ids") or ()] == was["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in stream] == [None, "length"]
    other = await gw.client.post(
        url, json={**body, "max_tokens": 3, "prompt": [40, 41]}, headers=headers
    )
    assert other.status_code == 409  # another prompt under the id: a reused id
    assert other.json()["error"]["type"] == "model_call_id_conflict"
    assert len(gw.fake.requests) == seen  # refused before it went to the engine


async def test_a_retry_whose_call_has_only_an_intent_goes_to_the_engine(gw: Harness) -> None:
    """A call id with an intent and no entry (the first attempt failed, or was lost before the
    put): nothing to answer from, so the retry is dispatched and stored as any call."""
    await gw.store.begin_call("r1", "c1")
    seen = len(gw.fake.requests)
    answer = await gw.chat("r1", [_user("hello")], call="c1", fake_reply="fresh")
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "fresh"
    assert len(gw.fake.requests) == seen + 1
    [entry] = gw.store.read_entries("r1")
    assert entry.output_items[0]["content"] == "fresh"
    assert "replay" not in gw.app.state.gateway.metrics.snapshot()


async def test_an_entry_the_gateway_did_not_write_is_not_replayed(gw: Harness) -> None:
    """An entry stored under the call id by another writer (no output item, say) is not an
    answer the gateway can rebuild: the call is refused as a reused id (409), before it goes
    to the engine."""
    await gw.store.begin_call("r1", "x")
    gw.store.append(
        TokenEntry(
            rollout_id="r1",
            model_call_id="x",
            model=MODEL,
            prompt_token_ids=encode("abc"),
            generation_token_ids=[40, IM_END],
            generation_log_probs=[-0.5, -0.25],
            created_at=1.0,
        )
    )
    answer = await gw.client.post(
        "/rollouts/r1/v1/completions",
        json={"model": MODEL, "prompt": "abc"},
        headers={"x-model-call-id": "x"},
    )
    assert answer.status_code == 409
    assert answer.json()["error"]["type"] == "model_call_id_conflict"
    assert gw.fake.calls == 0


# "The same request": every field but those that shape the answer's form -----------------------


async def test_a_retry_with_another_text_prompt_is_a_conflict_not_a_replay(gw: Harness) -> None:
    """A completions call with a text prompt, retried with its id: the identical request is
    replayed; another text prompt under the id is a reused id (409 `model_call_id_conflict`,
    before it is dispatched), never the stored answer of the first
    prompt with a 200 (a text prompt cannot be compared with the stored tokens: the entry
    keeps the request's digest instead)."""
    url = "/rollouts/r1/v1/completions"
    headers = {"x-model-call-id": "t1"}
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}
    first = await gw.client.post(url, json=body, headers=headers)
    assert first.status_code == 200, first.text
    [entry] = gw.store.read_entries("r1")
    assert entry.model_extra is not None
    assert entry.model_extra[REQUEST_DIGEST_FIELD] == request_digest("completions", body)
    seen = len(gw.fake.requests)
    same = await gw.client.post(url, json=body, headers=headers)
    assert same.status_code == 200
    assert same.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert len(gw.fake.requests) == seen  # replayed
    other = await gw.client.post(url, json={**body, "prompt": "xyz"}, headers=headers)
    assert other.status_code == 409, other.text
    assert other.json()["error"]["type"] == "model_call_id_conflict"
    assert len(gw.fake.requests) == seen  # refused before it went to the engine
    assert [e.generation_token_ids for e in gw.store.read_entries("r1")] == [
        entry.generation_token_ids
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 3},
        {"temperature": 0.5},
        {"stop": ["x"]},
        {"tools": TOOLS},
        {"logprobs": True},
        {"top_logprobs": 2, "logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"model": "another-model"},
        {"seed": 7},
    ],
    ids=lambda change: "+".join(change),
)
async def test_a_chat_retry_with_other_generation_parameters_is_a_conflict(
    gw: Harness, change: dict[str, Any]
) -> None:
    """The same conversation with other generation parameters (or log-probs asked
    otherwise) is another request: not replayed, a 409 conflict."""
    messages = [_user("hello")]
    body = {"max_tokens": 16}
    assert (await gw.chat("r1", messages, call="c1", **body)).status_code == 200
    retry = await gw.chat("r1", messages, call="c1", **{**body, **change})
    assert retry.status_code == 409, retry.text
    assert retry.json()["error"]["type"] == "model_call_id_conflict"
    assert "replay" not in gw.app.state.gateway.metrics.snapshot()


async def test_a_retry_may_differ_in_the_answers_form_only(gw: Harness) -> None:
    """`stream`, `stream_options` and `return_token_ids` only shape the answer (the replay is
    built in the retry's form); key order is no difference either."""
    messages = [_user("hello")]
    first = await gw.chat("r1", messages, call="c1", max_tokens=16, temperature=0.0)
    seen = len(gw.fake.requests)
    gw.fake.reply = "another answer"
    reordered = await gw.client.post(
        "/rollouts/r1/v1/chat/completions",
        json={
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "max_tokens": 16,
            "messages": messages,
            "model": MODEL,
        },
        headers={"x-model-call-id": "c1"},
    )
    assert reordered.status_code == 200
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in _events(reordered) if c["choices"]
    )
    assert text == first.json()["choices"][0]["message"]["content"]
    assert len(gw.fake.requests) == seen


async def test_an_entry_without_a_request_digest_keeps_the_older_comparison(
    gw: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry a gateway before the request digest stored (no `gateway_request_digest`) is
    compared as that gateway did: a chat retry by its conversation alone."""
    from tokencapture.gateway import app as gateway_app

    monkeypatch.setattr(gateway_app, "REQUEST_DIGEST_FIELD", "an_older_build_wrote_none")
    messages = [_user("hello")]
    first = await gw.chat("r1", messages, call="c1", max_tokens=16)
    monkeypatch.undo()
    [entry] = gw.store.read_entries("r1")
    assert REQUEST_DIGEST_FIELD not in (entry.model_extra or {})
    seen = len(gw.fake.requests)
    again = await gw.chat("r1", messages, call="c1", max_tokens=3)  # the conversation only
    assert again.status_code == 200
    content = first.json()["choices"][0]["message"]["content"]
    assert again.json()["choices"][0]["message"]["content"] == content
    assert len(gw.fake.requests) == seen
    other = await gw.chat("r1", [_user("bye")], call="c1", max_tokens=16)
    assert other.status_code == 409


# Two calls with one id at once -----------------------------------------------------------------


async def test_two_retries_at_once_are_answered_one_after_the_other(gw: Harness) -> None:
    """Two calls with one id arrive together (a client's retry racing its first attempt,
    whose answer was slow): the second waits for the first's outcome and is its retry,
    replayed from the stored entry: both 200, one request to the engine, one entry, nothing
    masked, nothing left in flight."""
    messages = [_user("hello")]
    one, two = await asyncio.gather(
        gw.chat("r1", messages, call="c1", fake_delay=0.3),
        gw.chat("r1", messages, call="c1", fake_delay=0.3),
    )
    assert (one.status_code, two.status_code) == (200, 200), (one.text, two.text)
    was, again = one.json(), two.json()
    assert was["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    assert was["id"] == again["id"]
    assert gw.fake.calls == 1
    assert gw.app.state.gateway.metrics.snapshot()["replay"]["count"] == 1
    assert len(gw.store.read_entries("r1")) == 1
    assert not gw.store.freeze_now("r1").incomplete
    assert not gw.app.state.gateway._in_flight


async def test_two_streamed_calls_at_once_wait_for_the_streams_end(gw: Harness) -> None:
    """The same for streams: the first's place is held until its stream is stored and sent."""
    messages = [_user("hello")]
    asked = {"stream": True, "return_token_ids": True, "fake_chunk_delay": 0.02}
    one, two = await asyncio.gather(
        gw.chat("r1", messages, call="s1", **asked), gw.chat("r1", messages, call="s1", **asked)
    )
    assert (one.status_code, two.status_code) == (200, 200)

    def tokens(answer: httpx.Response) -> list[int]:
        return [
            t
            for c in _events(answer)
            if c["choices"]
            for t in c["choices"][0].get("token_ids") or ()
        ]

    assert tokens(one) == tokens(two) != []
    assert gw.fake.calls == 1
    assert not gw.store.freeze_now("r1").incomplete
    assert not gw.app.state.gateway._in_flight


async def test_two_different_calls_at_once_with_one_id_are_200_and_409(gw: Harness) -> None:
    """Two different requests under one id at once: the one that went first is answered,
    the other is a reused id (409), as one after the other."""
    one, two = await asyncio.gather(
        gw.chat("r1", [_user("one")], call="c1", fake_delay=0.2),
        gw.chat("r1", [_user("two")], call="c1", fake_delay=0.2),
    )
    assert sorted((one.status_code, two.status_code)) == [200, 409]
    assert len(gw.store.read_entries("r1")) == 1
    assert not gw.app.state.gateway._in_flight


@pytest.fixture
async def two_gateways(tmp_path: Path) -> AsyncIterator[tuple[Harness, Harness]]:
    """Two gateways over one store directory (as two processes: each its own store, map of
    calls in flight and engine), for calls with one id that reach both at once."""
    one = Harness(tmp_path / "store", FakeUpstream())
    two = Harness(tmp_path / "store", FakeUpstream())
    yield one, two
    await one.close()
    await two.close()


def _replays(*harnesses: Harness) -> int:
    snapshots = (h.app.state.gateway.metrics.snapshot() for h in harnesses)
    return sum(s["replay"]["count"] for s in snapshots if "replay" in s)


async def test_one_call_through_two_gateways_at_once_is_stored_once_and_answered_alike(
    two_gateways: tuple[Harness, Harness],
) -> None:
    """A client's retry reaching another gateway process while its first attempt is at the
    engine: both are dispatched (nothing shared but the store), the first stored is the
    call's, and the other attempt is answered with it (a replay), not a 409 that marks the
    rollout: both 200 with one answer, one entry, nothing masked."""
    one, two = two_gateways
    messages = [_user("hello")]
    first, retry = await asyncio.gather(
        one.chat("r1", messages, call="c1", fake_delay=0.2),
        two.chat("r1", messages, call="c1", fake_delay=0.2),
    )
    assert (first.status_code, retry.status_code) == (200, 200), (first.text, retry.text)
    assert one.fake.calls == two.fake.calls == 1
    assert first.json()["id"] == retry.json()["id"]
    message = first.json()["choices"][0]["message"]
    assert message["content"] == retry.json()["choices"][0]["message"]["content"] != ""
    [entry] = one.store.read_entries("r1")
    assert entry.response_id == first.json()["id"]
    assert _replays(one, two) == 1
    assert not one.store.freeze_now("r1").incomplete


async def test_two_requests_under_one_id_through_two_gateways_are_200_and_409_unmarked(
    two_gateways: tuple[Harness, Harness],
) -> None:
    """Two different requests under one id at once through two gateways: the one stored
    first is answered, the other is a reused id (409), and the rollout stays whole."""
    one, two = two_gateways
    a, b = await asyncio.gather(
        one.chat("r1", [_user("one")], call="c1", fake_delay=0.2),
        two.chat("r1", [_user("two")], call="c1", fake_delay=0.2),
    )
    assert sorted((a.status_code, b.status_code)) == [200, 409], (a.text, b.text)
    conflict = a if a.status_code == 409 else b
    assert conflict.json()["error"]["type"] == "model_call_id_conflict"
    assert len(one.store.read_entries("r1")) == 1
    assert not one.store.freeze_now("r1").incomplete


async def test_a_stream_whose_other_attempt_was_stored_first_ends_in_an_error_unmarked(
    two_gateways: tuple[Harness, Harness],
) -> None:
    """A stream has sent its deltas before its entry is put, so when another attempt of the
    call was stored first it cannot be answered with that one: it ends with an error event
    (409) and no `[DONE]`; the other stream completes; one entry, nothing masked."""
    one, two = two_gateways
    messages = [_user("hello")]
    asked = {"stream": True, "return_token_ids": True, "fake_chunk_delay": 0.02}
    a, b = await asyncio.gather(
        one.chat("r1", messages, call="s1", **asked), two.chat("r1", messages, call="s1", **asked)
    )
    assert (a.status_code, b.status_code) == (200, 200)
    done = [answer for answer in (a, b) if answer.text.rstrip().endswith("data: [DONE]")]
    assert len(done) == 1, (a.text, b.text)
    [cut] = [answer for answer in (a, b) if answer is not done[0]]
    chunks = [orjson.loads(e[6:]) for e in cut.text.split("\n\n") if e.startswith("data: ")]
    [error] = [chunk["error"] for chunk in chunks if "error" in chunk]
    assert error["code"] == 409 and "stored while this one was in flight" in error["message"]
    [entry] = one.store.read_entries("r1")
    assert entry.response_id == next(c["id"] for c in _events(done[0]) if "id" in c)
    assert not one.store.freeze_now("r1").incomplete


async def test_a_call_waiting_for_a_failed_one_is_dispatched_afresh(gw: Harness) -> None:
    """The first of two calls with one id fails at the engine (its intent has no entry): the
    second, which waited, is dispatched as a fresh call would be and stored."""
    failed: list[bool] = []

    def fail_the_first(body: dict[str, Any]) -> None:
        if not failed:
            failed.append(True)
            body["fake_status"] = 500  # the engine fails this one, whatever it asked

    gw.fake.on_request = fail_the_first
    messages = [_user("hello")]
    one, two = await asyncio.gather(
        gw.chat("r1", messages, call="c1", fake_delay=0.2),
        gw.chat("r1", messages, call="c1", fake_delay=0.2),
    )
    assert sorted((one.status_code, two.status_code)) == [200, 500]
    assert len(gw.fake.requests) == 2 and gw.fake.calls == 1
    assert [e.model_call_id for e in gw.store.read_entries("r1")] == ["c1"]
    assert "replay" not in gw.app.state.gateway.metrics.snapshot()
    assert not gw.app.state.gateway._in_flight


async def test_a_cancelled_call_leaves_nothing_in_flight(gw: Harness) -> None:
    """A call cancelled while at the engine (its client gone) gives up its place: the next
    call with its id is not held, and nothing is left in the gateway's map."""
    gateway = gw.app.state.gateway
    messages = [_user("hello")]
    slow = asyncio.ensure_future(gw.chat("r1", messages, call="c1", fake_delay=5))
    deadline = asyncio.get_running_loop().time() + 10
    while not gw.fake.requests:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(gw.chat("r1", messages, call="c1", max_tokens=4))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # held behind the first
    assert list(gateway._in_flight) == [("r1", "c1")]
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow
    answer = await asyncio.wait_for(waiting, 10)
    assert answer.status_code == 200, answer.text
    assert not gateway._in_flight


@pytest.mark.parametrize("workers", [0, -1, True, 1.5])
def test_serve_refuses_a_worker_count_that_is_not_a_positive_int(
    tmp_path: Path, workers: Any
) -> None:
    from tokencapture.gateway.server import serve

    store = tmp_path / "store"
    with pytest.raises(ValueError, match="--workers"):
        serve(upstream="http://127.0.0.1:9", store_dir=str(store), workers=workers)
    assert not store.exists()  # refused before the store was opened
