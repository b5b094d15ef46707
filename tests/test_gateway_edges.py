"""The capture gateway at its edges: paths a captured call may be spelled with, redirects,
compressing upstreams, long or odd streams, requests the lineage stamp cannot read, and what
a passthrough forwards. In process, against the fake upstream (tests/fake_upstream.py) or a
small engine of another shape (`Odd`), each served from a thread of the test process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from tests.fake_upstream import MODEL, FakeUpstream, ThreadServer, render_chat
from tests.test_gateway import Harness, _chat_scope, _user, gw

from tokencapture import TokenCaptureStore
from tokencapture.gateway import GatewayConfig, create_app, open_backend

__all__ = ["gw"]  # the shared fixture, imported for pytest


def _ledger(root: Path, rollout: str) -> list[dict[str, Any]]:
    path = root / f"{rollout}.lineage.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _summary(harness: Harness, rollout: str) -> dict[str, Any]:
    answer = await harness.client.get(f"/rollouts/{rollout}")
    assert answer.status_code == 200, answer.text
    summary: dict[str, Any] = answer.json()
    return summary


def _events(answer: httpx.Response) -> list[Any]:
    """A stream's events, `[DONE]` included (as the string)."""
    data = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in data]


def _sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class Odd:
    """An engine that answers otherwise than vLLM: redirects, odd shapes, and a record of the
    paths and headers it was sent."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, str]] = []
        self.raw: list[tuple[bytes, bytes]] = []  # (raw_path, query_string) as they arrived
        self.headers: list[dict[str, str]] = []
        self.app = Starlette(
            routes=[
                Route("/health", self.other, methods=["GET", "POST"]),
                Route("/collective_rpc", self.other, methods=["GET", "POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/elsewhere", self.other, methods=["GET", "POST"]),
                Route("/v1/moved", self.moved, methods=["GET"]),
                Route("/v1/audio/transcriptions", self.echo, methods=["POST"]),
                Route("/v1/{path:path}", self.other, methods=["GET", "POST"]),
            ]
        )

    def _seen(self, request: Request) -> None:
        self.hits.append((request.method, request.scope["path"]))
        self.raw.append((request.scope.get("raw_path", b""), request.scope["query_string"]))
        self.headers.append(dict(request.headers))

    async def other(self, request: Request) -> Response:
        self._seen(request)
        return Response(b'{"reached": true}', media_type="application/json")

    async def moved(self, request: Request) -> Response:
        self._seen(request)
        return RedirectResponse(str(request.url.replace(path="/v1/elsewhere")), 307)

    async def echo(self, request: Request) -> Response:
        self._seen(request)
        body = await request.body()
        headers = {"x-processing-ms": "12", "x-request-id": request.headers.get("x-request-id", "")}
        return Response(body, 201, headers=headers, media_type="text/plain")

    async def chat(self, request: Request) -> Response:
        self._seen(request)
        body = orjson.loads(await request.body())
        mode = body.get("odd")
        prompt = render_chat(body["messages"])
        if mode == "redirect":
            return RedirectResponse("/v1/elsewhere", 302)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "tool_calls": 5},
            "token_ids": [20, 2],
            "logprobs": {
                "content": [{"token": "h", "logprob": -0.5}, {"token": "", "logprob": -0.1}]
            },
            "finish_reason": "stop",
        }
        if mode == "shape":
            answer = {"id": "x", "model": MODEL, "prompt_token_ids": prompt, "choices": [choice]}
            return Response(orjson.dumps(answer), media_type="application/json")
        first = {
            "id": "x",
            "model": MODEL,
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
        odd = {
            "id": "x",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"tool_calls": 5}, "token_ids": [20]}],
        }

        async def stream() -> AsyncIterator[bytes]:
            yield _sse(first, odd)

        return StreamingResponse(stream(), media_type="text/event-stream")


class OddHarness(Harness):
    def __init__(self, root: Path, odd: Odd) -> None:
        self.odd = odd
        super().__init__(root, FakeUpstream())
        self.upstream.stop()
        self.upstream = ThreadServer(odd.app)
        self.app = create_app(self.backend, GatewayConfig(self.upstream.url))
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway"
        )


@pytest.fixture
async def odd(tmp_path: Path) -> AsyncIterator[OddHarness]:
    harness = OddHarness(tmp_path / "store", Odd())
    yield harness
    await harness.close()


# 1. Paths and redirects -------------------------------------------------------------------


async def test_a_captured_endpoint_with_a_trailing_slash_is_captured(gw: Harness) -> None:
    """The engine serves `/v1/chat/completions/` as `/v1/chat/completions` (by a redirect):
    with a rollout id it is the captured call, never an uncaptured passthrough."""
    messages = [_user("slash")]
    answer = await gw.client.post(
        "/v1/chat/completions/",
        json={"model": MODEL, "messages": messages},
        headers={"x-rollout-id": "ts", "x-model-call-id": "c1"},
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-model-call-id"] == "c1"
    routed = await gw.client.post(
        "/rollouts/ts/v1/completions/",
        json={"model": MODEL, "prompt": "p"},
        headers={"x-model-call-id": "c2"},
    )
    assert routed.status_code == 200, routed.text
    entries = gw.store.read_entries("ts")
    assert [e.model_call_id for e in entries] == ["c1", "c2"]
    assert entries[0].prompt_token_ids == render_chat(messages)
    assert not gw.store.freeze_now("ts").incomplete


async def test_a_captured_call_never_follows_a_redirect(odd: OddHarness) -> None:
    """A 3xx from the engine is an upstream error for a captured call: 502, marked, and the
    redirect's target is never asked (a 302 would have turned the POST into a GET)."""
    answer = await odd.chat("rd", [_user("x")], call="c", odd="redirect")
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "upstream_error"
    assert odd.odd.hits == [("POST", "/v1/chat/completions")]
    assert _ledger(odd.root, "rd") == [
        {"failure_reason": "upstream_status_302", "model_call_id": "c"}
    ]
    assert odd.store.freeze_now("rd").incomplete


async def test_a_passthrough_redirect_is_handed_to_the_client(odd: OddHarness) -> None:
    """Not followed: the client gets the engine's redirect, its target made relative (so that
    the client follows it through the gateway)."""
    answer = await odd.client.get("/v1/moved")
    assert answer.status_code == 307
    assert answer.headers["location"] == "/v1/elsewhere"
    assert odd.odd.hits == [("GET", "/v1/moved")]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/%2e%2e/health"),
        ("POST", "/v1/..%2fcollective_rpc"),
        ("POST", "/v1/x/%2E%2E/%2e%2e/collective_rpc"),
        ("GET", "/v1/%2e/models"),
    ],
)
async def test_a_passthrough_with_dot_segments_is_refused(
    odd: OddHarness, method: str, path: str
) -> None:
    """A decoded `.` or `..` segment would reach the engine outside /v1/: refused, with
    nothing sent."""
    answer = await odd.client.request(method, path, content=b"{}")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert odd.odd.hits == []


async def test_a_passthrough_path_reaches_the_engine_as_the_client_spelled_it(
    odd: OddHarness,
) -> None:
    """Every other path goes under /v1/ as it is (a `%` stays a `%`, a `?` stays in the path)."""
    assert (await odd.client.get("/v1/a%25b%3Fc/d")).status_code == 200
    assert odd.odd.hits == [("GET", "/v1/a%b?c/d")]
    # An encoded slash stays encoded and a bare query flag stays bare (they were decoded to
    # `/` and re-encoded as `flag=`).
    assert (await odd.client.get("/v1/files/a%2Fb?flag&x=1+2")).status_code == 200
    assert odd.odd.raw[-1] == (b"/v1/files/a%2Fb", b"flag&x=1+2")
    # Mounted under a root path, the raw path begins with it: the engine gets what follows.
    rooted = httpx.AsyncClient(
        transport=httpx.ASGITransport(odd.app, root_path="/gw"), base_url="http://gateway"
    )
    async with rooted:
        assert (await rooted.get("/gw/v1/files/a%2Fb?flag")).status_code == 200
    assert odd.odd.raw[-1] == (b"/v1/files/a%2Fb", b"flag")


# 2. Encodings -------------------------------------------------------------------------------


@pytest.fixture
async def gzipping(tmp_path: Path) -> AsyncIterator[Harness]:
    """The fake engine behind a compressing proxy (what Starlette's GZipMiddleware does for
    every client that accepts gzip)."""
    harness = Harness(tmp_path / "store", FakeUpstream())
    harness.upstream.stop()
    harness.upstream = ThreadServer(GZipMiddleware(harness.fake.app, minimum_size=1))
    harness.app = create_app(harness.backend, GatewayConfig(harness.upstream.url))
    harness.client = httpx.AsyncClient(
        transport=httpx.ASGITransport(harness.app), base_url="http://gateway"
    )
    yield harness
    await harness.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_compressing_upstream_is_captured(gzipping: Harness, stream: bool) -> None:
    """The gateway asks for no encoding it does not decode: the answer is captured."""
    messages = [_user("squeeze me")]
    answer = await gzipping.chat("gz", messages, call="c", stream=stream)
    assert answer.status_code == 200, answer.text
    if stream:
        assert _events(answer)[-1] == "[DONE]"
    [entry] = gzipping.store.read_entries("gz")
    assert entry.prompt_token_ids == render_chat(messages)
    assert not gzipping.store.freeze_now("gz").incomplete


async def test_a_compressed_passthrough_says_its_encoding(gzipping: Harness) -> None:
    """A passthrough forwards the client's Accept-Encoding and the engine's Content-Encoding:
    a client that accepts gzip gets gzip it can read, one that does not gets plain bytes."""
    compressed = await gzipping.client.get("/v1/models", headers={"accept-encoding": "gzip"})
    assert compressed.headers["content-encoding"] == "gzip"
    assert compressed.json()["data"][0]["id"] == MODEL  # decoded by httpx
    plain = await gzipping.client.get("/v1/models", headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert plain.json()["data"][0]["id"] == MODEL


# 3. Streams and answers of other shapes ----------------------------------------------------


async def test_a_stream_whose_first_line_is_long_is_captured(gw: Harness) -> None:
    """vLLM's first chunk carries every prompt token id on one line: ~200k tokens here, a
    line of ~800 KB, past aiohttp's own line limit (512 KiB)."""
    messages = [_user("x" * 200_000)]
    answer = await gw.chat("long", messages, call="c", stream=True)
    assert answer.status_code == 200
    assert _events(answer)[-1] == "[DONE]", answer.text[-300:]
    [entry] = gw.store.read_entries("long")
    assert entry.prompt_token_ids == render_chat(messages)
    assert not gw.store.freeze_now("long").incomplete


async def test_a_stream_of_another_shape_ends_in_an_error_event_and_is_marked(
    odd: OddHarness,
) -> None:
    """A delta the accumulator cannot read (`tool_calls: 5`: a TypeError) fails the call as
    the engine's: an `upstream_error` event, the call marked, a ledger row; no cut
    connection."""
    answer = await odd.chat("shape", [_user("x")], call="c", stream=True)
    assert answer.status_code == 200
    last = _events(answer)[-1]
    assert last["error"]["type"] == "upstream_error", last
    assert "TypeError" in last["error"]["message"]
    [row] = _ledger(odd.root, "shape")
    assert row["model_call_id"] == "c"
    assert row["failure_reason"].startswith("capture_failed: TypeError")
    assert odd.store.freeze_now("shape").incomplete


async def test_an_answer_of_another_shape_is_a_502_and_marked(odd: OddHarness) -> None:
    answer = await odd.chat("shape", [_user("x")], call="c", odd="shape")
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["type"] == "upstream_error"
    [row] = _ledger(odd.root, "shape")
    assert row["failure_reason"].startswith("capture_failed: TypeError")
    assert odd.store.freeze_now("shape").incomplete


# 4. Messages the lineage stamp cannot read -------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        b'{"role": "user", "content": 5}',
        b'{"role": "user", "content": [{"text": 5}]}',
        b'{"role": "user", "content": [{"foo": "bar"}]}',
        b'{"role": "assistant", "content": "a", "tool_calls": [{"id": "t", "function": [1]}]}',
        b'{"role": "user", "content": [5]}',
    ],
)
async def test_messages_the_stamp_cannot_read_are_refused_before_the_intent(
    gw: Harness, message: bytes
) -> None:
    """What the lineage stamp (NeMo Gym's fingerprint) refuses is a 400 before the intent,
    not a 502 after the engine generated (with the rollout masked)."""
    answer = await gw.client.post(
        "/rollouts/bad/v1/chat/completions",
        content=b'{"model": "m", "messages": [' + message + b"]}",
        headers={"content-type": "application/json", "x-model-call-id": "c"},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert gw.fake.calls == 0
    summary = await _summary(gw, "bad")
    assert summary["state"] == "empty"
    assert summary["calls_without_entry"] == []


async def test_an_untyped_image_part_is_read_as_vllm_reads_it(gw: Harness) -> None:
    """vLLM takes `{"image_url": U}` (no type) as the image part `{"type": "image_url",
    "image_url": U}`: the call is captured, stamped as the typed spelling is, and a
    continuation written either way resolves to it."""
    url = {"url": "https://example.com/cat.png"}
    untyped = [{"role": "user", "content": [{"image_url": url}, {"type": "text", "text": "?"}]}]
    typed = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": url}, {"type": "text", "text": "?"}],
        }
    ]
    first = await gw.chat("img", untyped, call="u")
    assert first.status_code == 200, first.text
    assert (await gw.chat("img2", typed, call="t")).status_code == 200
    [entry] = gw.store.read_entries("img")
    [other] = gw.store.read_entries("img2")
    assert entry.continuation_context_digest == other.continuation_context_digest
    assert entry.continuation_fingerprint == other.continuation_fingerprint
    # The engine got the part as the client sent it.
    assert gw.fake.requests[0]["messages"] == untyped
    reply = first.json()["choices"][0]["message"]
    continued = await gw.chat("img", [*typed, reply, _user("and?")], call="u2")
    assert continued.status_code == 200
    assert gw.store.read_entries("img")[1].parent_call_id == "u"


# 6. Small things ----------------------------------------------------------------------------


async def test_an_empty_call_id_header_is_refused(gw: Harness) -> None:
    answer = await gw.client.post(
        "/rollouts/e/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("x")]},
        headers={"x-model-call-id": ""},
    )
    assert answer.status_code == 400, answer.text
    assert gw.fake.calls == 0
    assert (await _summary(gw, "e"))["state"] == "empty"


async def test_a_client_gone_during_its_upload_ends_quietly(tmp_path: Path) -> None:
    """Starlette's ClientDisconnect (the body never came whole) does not escape to the
    server: nothing is written or sent upstream."""
    fake = FakeUpstream()
    upstream = ThreadServer(fake.app)
    root = tmp_path / "store"
    app = create_app(open_backend(store_dir=root), GatewayConfig(upstream.url))
    messages: Iterator[dict[str, Any]] = iter(
        [
            {"type": "http.request", "body": b'{"model": "m", "mess', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict[str, Any]:
        return next(messages)

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    try:
        await asyncio.wait_for(app(_chat_scope("up", "c", b"x" * 100), receive, send), 30)
    finally:
        await app.state.gateway.close()
        upstream.stop()
    assert sent[0]["status"] == 499
    assert fake.calls == 0
    assert not (root / "up.lineage.jsonl").exists()


# 5. Passthrough headers ---------------------------------------------------------------------


async def test_a_passthrough_forwards_end_to_end_headers_both_ways(odd: OddHarness) -> None:
    """The client's Content-Type (a multipart upload) and its own headers reach the engine,
    the hop-by-hop ones do not; the engine's headers come back."""
    files = {"file": ("a.wav", b"RIFF....", "audio/wav")}
    answer = await odd.client.post(
        "/v1/audio/transcriptions",
        files=files,
        data={"model": MODEL},
        headers={
            "x-request-id": "req-1",
            "keep-alive": "timeout=5",
            "connection": "x-drop",
            "x-drop": "1",
        },
    )
    assert answer.status_code == 201, answer.text
    [seen] = odd.odd.headers
    assert seen["content-type"].startswith("multipart/form-data; boundary=")
    assert seen["x-request-id"] == "req-1"
    assert "keep-alive" not in seen
    assert "x-drop" not in seen
    assert seen.get("accept-encoding") == answer.request.headers["accept-encoding"]
    assert answer.headers["x-processing-ms"] == "12"
    assert answer.headers["x-request-id"] == "req-1"
    assert answer.headers["content-type"].startswith("text/plain")
    assert b"RIFF...." in answer.content


async def test_the_engines_own_key_goes_upstream_and_a_clients_never(tmp_path: Path) -> None:
    """An engine started with `--api-key` behind a gateway (`--upstream-api-key`): every
    upstream request, captured or passed through, carries the engine's key, never the key a
    client sent (before, a gateway with `--token` could not reach such an engine at all)."""
    harness = OddHarness(tmp_path / "store", Odd())
    harness.app = create_app(
        harness.backend, GatewayConfig(harness.upstream.url, upstream_api_key="engine-key")
    )
    harness.client = httpx.AsyncClient(
        transport=httpx.ASGITransport(harness.app),
        base_url="http://gateway",
        headers={"authorization": "Bearer client-secret"},
    )
    try:
        await harness.chat("keyed", [_user("x")], call="c", odd="shape")
        await harness.client.get("/v1/elsewhere")
        seen = [headers.get("authorization") for headers in harness.odd.headers]
        assert seen == ["Bearer engine-key", "Bearer engine-key"]
    finally:
        await harness.close()


def test_the_cli_passes_the_engines_key_to_every_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tokencapture.cli import main
    from tokencapture.gateway import server

    given: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda **options: given.update(options))
    argv = ["gateway", "--upstream", "http://127.0.0.1:9", "--store", str(tmp_path)]
    assert main([*argv, "--upstream-api-key", "engine-key"]) == 0
    assert given["upstream_api_key"] == "engine-key"
    # Workers build their gateway from the environment: the key reaches them there.
    monkeypatch.setenv(server.SETTINGS_ENV, json.dumps(server_settings(tmp_path)))
    monkeypatch.setenv(server.UPSTREAM_KEY_ENV, "engine-key")
    app = server.app_from_environment()
    assert app.gateway.config.upstream_api_key == "engine-key"
    asyncio.run(app.gateway.backend.close())


def server_settings(store: Path) -> dict[str, Any]:
    return {
        "upstream": "http://127.0.0.1:9",
        "store_dir": str(store),
        "dsn": None,
        "tito": False,
        "tokenizer": None,
        "renderer": "qwen3",
        "timeout": 600.0,
        "max_body_bytes": 1 << 20,
    }


async def test_the_timeout_is_the_engines_silence_not_the_calls_length(tmp_path: Path) -> None:
    """A stream that keeps sending runs past `timeout` (before, every call was cut at
    `timeout` seconds in all: a long reasoning stream was lost, its rollout masked); a
    silent engine still times out."""
    upstream = ThreadServer(FakeUpstream().app)
    backend = open_backend(store_dir=tmp_path)
    app = create_app(backend, GatewayConfig(upstream.url, timeout=0.6))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://g", timeout=30
        ) as client:
            long = await client.post(
                "/rollouts/long/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [_user("tell me")],
                    "stream": True,
                    "max_tokens": 6,
                    "fake_chunk_delay": 0.25,
                },
                headers={"x-model-call-id": "c"},
            )
            assert _events(long)[-1] == "[DONE]"
            silent = await client.post(
                "/rollouts/silent/v1/chat/completions",
                json={"model": MODEL, "messages": [_user("x")], "fake_delay": 2},
            )
            assert silent.status_code == 504
    finally:
        await app.state.gateway.close()
        upstream.stop()
    store = TokenCaptureStore(tmp_path)
    assert not store.freeze_now("long").incomplete and store.read_entries("long")
    assert store.freeze_now("silent").incomplete


async def test_a_stream_line_over_the_limit_fails_whole_or_in_parts() -> None:
    """The line limit holds for a line that one read brings whole, not only for the part of
    one still waiting for its end."""
    from tokencapture.gateway.app import _Lines
    from tokencapture.gateway.capture import CaptureError

    class Reads:
        def __init__(self, *reads: bytes) -> None:
            self.reads = list(reads)

        async def readany(self) -> bytes:
            return self.reads.pop(0) if self.reads else b""

    fits = _Lines(Reads(b"data: 1\ndata: 2", b"\n"), limit=16)  # type: ignore[arg-type]
    assert await fits.read() == [b"data: 1\n"]
    assert await fits.read() == [b"data: 2\n"]
    assert await fits.read() is None
    for reads in ((b"x" * 20 + b"\n",), (b"x" * 10, b"x" * 10 + b"\n"), (b"x" * 20,)):
        lines = _Lines(Reads(*reads), limit=16)  # type: ignore[arg-type]
        with pytest.raises(CaptureError, match="limit of 16 bytes"):
            while await lines.read() is not None:
                pass
