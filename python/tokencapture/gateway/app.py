"""The capture gateway's ASGI application (Starlette, with aiohttp's client to the upstream).

The upstream client is aiohttp's rather than httpx's: profiled under 16 concurrent sessions,
httpx's `AsyncClient.send` was 56% of the gateway's CPU (a quarter of it in httpcore's pool
scanning every connection for expiry on each request), about 2.5 ms per call.

A captured call, in order: the ids are validated as the store validates them; `begin_call`
writes the durable intent (for a client's own call id, unless its entry is already stored: a
retry, answered below); the request goes upstream with `return_token_ids` and log-probs
injected (and, meanwhile, the parent is resolved from the request's messages); the answer's
exact tokens become a `TokenEntry`, stamped for lineage, which is `put` (durable) before one
byte of the answer is released; the token fields the client did not ask for are removed. An
upstream error, timeout or disconnect marks the call incomplete with the reason (a failure row
of the capture ledger) and passes the upstream's status through; a client that leaves while
the engine works cancels the upstream request (its connection closed: vLLM aborts the
generation) and marks the call `client_disconnected`; a store write that fails answers 503,
never 200. A stream is passed through chunk by chunk, except that its final chunk
and `[DONE]` are held until the entry is stored. A retry of a stored call (the client's own
call id, the same request) is answered from the stored entry, with nothing sent upstream;
two calls with one client id at once are answered one after the other, the second as a
retry of the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import inspect
import logging
import resource
import time
import urllib.parse
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from yarl import URL

from tokencapture import _core
from tokencapture.descriptors import close_cached
from tokencapture.fingerprint import conversation_digest
from tokencapture.gateway.backend import Backend
from tokencapture.gateway.capture import (
    CHAT,
    COMPLETIONS,
    DIVERGED_REASON,
    CaptureError,
    Generation,
    Requested,
    StreamAccumulator,
    echoed_text,
    generation_from_chat,
    generation_from_completion,
    generation_from_entry,
    prepare_upstream_body,
    replay_body,
    replay_chunks,
    strip_chat,
    strip_completion,
)
from tokencapture.gateway.errors import (
    OUT_OF_DESCRIPTORS_HEADERS,
    HttpError,
    error_response,
    out_of_descriptors,
)
from tokencapture.jobs import off_loop, prepare_loop, start_together
from tokencapture.lineage import stamp_continuation
from tokencapture.metrics import Metrics
from tokencapture.protocols import (
    LineageResolution,
    TokenCaptureConflictError,
    TokenCaptureFrozenError,
)
from tokencapture.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokencapture.store import check_call_id, validate_rollout_id

__all__ = [
    "ANSWER_FORM_FIELDS",
    "DEFAULT_MAX_BODY_BYTES",
    "REQUEST_DIGEST_FIELD",
    "Gateway",
    "GatewayApp",
    "GatewayConfig",
    "create_app",
    "request_digest",
]

logger = logging.getLogger("tokencapture.gateway")

DEFAULT_MAX_BODY_BYTES: Final[int] = 16 * 1024 * 1024
ROLLOUT_HEADER: Final[str] = "x-rollout-id"
CALL_HEADER: Final[str] = "x-model-call-id"
_JSON: Final[dict[str, str]] = {"content-type": "application/json"}
_SSE_HEADERS: Final[dict[str, str]] = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_UNRESOLVED_ERROR_REASON: Final[str] = "resolver_error"
_RECENT_SHAPES: Final[int] = 100_000

# The entry's extra field (TokenEntry keeps unknown fields) holding the digest of the request a
# call with the client's own id was made with, compared on a retry (`request_digest`).
REQUEST_DIGEST_FIELD: Final[str] = "gateway_request_digest"
# Request fields that only shape the answer's form, not the generation: a retry may differ in
# them and still be replayed (the replay is built for the retry's own form).
ANSWER_FORM_FIELDS: Final[frozenset[str]] = frozenset(
    {"stream", "stream_options", "return_token_ids"}
)


def request_digest(kind: str, body: dict[str, Any]) -> str:
    """The digest of a request as the client sent it (before the gateway's injections), less
    the fields that only shape the answer's form (`ANSWER_FORM_FIELDS`): every other field
    (the messages or prompt, model, sampling and its limits, stop, tools, log-probs asked for,
    response format, engine extensions) must be the same for a retry to be replayed. The
    canonical form is orjson's with sorted keys, so key order does not matter; values do
    (`1` and `1.0` differ)."""
    kept = {key: value for key, value in body.items() if key not in ANSWER_FORM_FIELDS}
    canonical = orjson.dumps([kind, kept], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()


@dataclass
class GatewayConfig:
    """What a gateway needs besides its backend.

    `upstream` is the engine's root URL (the gateway adds `/v1/...`); `token` protects every
    route but `/healthz` (a bearer token); `timeout` is how long an upstream call may wait for
    the engine's next bytes (seconds: a stream's chunks each restart it, a non-streamed
    answer must arrive within it; `connect_timeout` bounds the connect); `max_connections`
    sizes the pooled upstream client (None: from the process's descriptor limit, see
    `upstream_pool_size`); `tito` is a `tokencapture.gateway.tito.Bridge` that turns resolved
    continuations into token-in completions (None: chat goes to the engine's chat endpoint).
    """

    upstream: str
    token: str | None = None
    timeout: float = 600.0
    connect_timeout: float = 10.0
    max_connections: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tito: Any = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    # The engine's own API key (vLLM's `--api-key`), sent as `Authorization: Bearer ...` on
    # every upstream request; the clients' `Authorization` is then never forwarded.
    upstream_api_key: str | None = None


MAX_UPSTREAM_CONNECTIONS: Final[int] = 512
# Seconds an upstream connect that ran out of descriptors waits before each retry after the
# first (0.75 s in all; see `Gateway.request_upstream`).
UPSTREAM_DESCRIPTOR_WAITS: Final[tuple[float, ...]] = (0.05, 0.1, 0.2, 0.4)


def upstream_pool_size(soft_limit: int | None = None) -> int:
    """The upstream pool's default size: 512, or a quarter of the process's soft descriptor
    limit when that is smaller (at least 8).

    Each call in flight holds its client's socket and, while at the engine, one of the pool's;
    the store needs descriptors of its own for the intent and the entry. A pool as large as
    the limit would let clients and the engine take every descriptor, and then every call
    fails at the store (503) while its sockets wait: with a quarter, calls beyond the pool
    wait for a connection instead, and keep their descriptors' worth for the store.
    """
    if soft_limit is None:
        soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY:
        return MAX_UPSTREAM_CONNECTIONS
    return max(8, min(MAX_UPSTREAM_CONNECTIONS, soft_limit // 4))


def _store_unavailable(message: str, exc: BaseException) -> HttpError:
    """The 503 of a store that failed; one for want of descriptors also closes its
    connection (see `OUT_OF_DESCRIPTORS_HEADERS`)."""
    headers = OUT_OF_DESCRIPTORS_HEADERS if out_of_descriptors(exc) else None
    return HttpError(503, message, "store_unavailable", headers)


def _event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


_DONE: Final[bytes] = b"[DONE]"

# Headers about one connection, not the message (RFC 9110 7.6.1), and the ones the HTTP client
# and server set themselves: a passthrough forwards neither way.
_HOP_BY_HOP_HEADERS: Final[frozenset[str]] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        # Nor cookies: a gateway serves many clients, and an engine's cookies are none of
        # theirs (the upstream client keeps no jar either).
        "cookie",
        "set-cookie",
    }
)
# The engine's headers the gateway's server sets for itself.
_ANSWER_OWN_HEADERS: Final[frozenset[str]] = frozenset({"date", "server"})


def _connection_tokens(values: list[str]) -> frozenset[str]:
    """The header names a `Connection` header lists (hop-by-hop too)."""
    return frozenset(
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    )


class Gateway:
    """The request handlers, the pooled upstream client and the metrics of one gateway."""

    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        self.backend = backend
        self.config = config
        self.metrics = Metrics(backend.kind, store="gateway")
        self._client: aiohttp.ClientSession | None = None
        self._base = config.upstream.rstrip("/")
        self._background: set[asyncio.Task[None]] = set()
        # Whether a client's `Authorization` is the engine's to read: not when the gateway
        # checks it itself (`token`) or sends the engine a key of its own.
        self._upstream_auth: bool = config.token is None and config.upstream_api_key is None
        engine_auth = (
            {}
            if config.upstream_api_key is None
            else {"authorization": f"Bearer {config.upstream_api_key}"}
        )
        # `identity`: the session does not decompress (a captured answer is parsed as sent, a
        # passthrough relayed as sent), so a captured call asks for no encoding; a passthrough
        # forwards the client's own Accept-Encoding and the engine's Content-Encoding back.
        self._headers: dict[str, str] = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            **config.extra_headers,
            **engine_auth,
        }
        self._engine_auth = list(engine_auth.items())
        self._base_url = URL(self._base)
        self._urls: dict[str, URL] = {
            path: URL(self._base + path) for path in ("/v1/chat/completions", "/v1/completions")
        }
        self._recent: OrderedDict[tuple[str, str], tuple[int, int, str | None]] = OrderedDict()
        # The calls with a client's own id in flight, by (rollout, call id): a second call with
        # the same id waits for the first's outcome (`_one_at_a_time`). An entry lives as long
        # as its call: removed when the call's answer is sent, fails, or is cancelled.
        self._in_flight: dict[tuple[str, str], asyncio.Event] = {}

    # Lifecycle -----------------------------------------------------------------------------

    @property
    def client(self) -> aiohttp.ClientSession:
        """The pooled upstream session (made on first use, on the running loop)."""
        if self._client is None:
            limit = self.config.max_connections
            connector = aiohttp.TCPConnector(
                limit=upstream_pool_size() if limit is None else limit,
                keepalive_timeout=60,
                enable_cleanup_closed=True,
            )
            # `timeout` is how long the engine may stay silent, not how long a call may run:
            # a stream's every chunk restarts it (a long reasoning stream is not cut while it
            # still sends), and a non-streamed answer, which vLLM sends whole once generated,
            # must arrive within it.
            timeout = aiohttp.ClientTimeout(
                total=None, connect=self.config.connect_timeout, sock_read=self.config.timeout
            )
            # No cookie jar: a gateway serves many clients, and an engine's cookies are none of
            # theirs (and a jar costs a filter per request).
            self._client = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=False,
                # aiohttp would otherwise ask every upstream for `gzip, deflate`, which this
                # session does not decode.
                skip_auto_headers=("Accept-Encoding",),
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._client

    async def request_upstream(
        self, method: str, url: URL, **options: Any
    ) -> aiohttp.ClientResponse:
        """A request upstream (its body already read: bytes). A connect that ran out of
        descriptors (`EMFILE`, `ENFILE`: nothing was sent) is tried again after the store's
        cached descriptors are closed (the rule every open of the store follows), then a few
        times more within `UPSTREAM_DESCRIPTOR_WAITS`: a captured call's intent is already
        written, and giving up marks its rollout incomplete, while the sockets of calls being
        answered meanwhile close and give their descriptors back."""
        for wait in (None, 0.0, *UPSTREAM_DESCRIPTOR_WAITS):
            if wait is not None:
                await off_loop(close_cached)
                await asyncio.sleep(wait)
            try:
                # Never follows a redirect: a captured call's answer must come from the
                # endpoint it was sent to (a 302 would also turn its POST into a bodiless GET),
                # and a passthrough hands the redirect to its client.
                return await self.client.request(method, url, allow_redirects=False, **options)
            except aiohttp.ClientConnectorError as exc:
                if not out_of_descriptors(exc.os_error) or wait == UPSTREAM_DESCRIPTOR_WAITS[-1]:
                    raise
        raise AssertionError("unreachable")

    def url(self, path: str) -> URL:
        """The upstream's URL of `path` (the captured calls' two are parsed once)."""
        url = self._urls.get(path)
        return URL(self._base + path) if url is None else url

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None
        await self.backend.close()

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def remember(self, entry: TokenEntry) -> None:
        """Keep the shape of a stored entry (for `--tito`'s bridge to its continuation)."""
        if self.config.tito is None:
            return
        recent = self._recent
        recent[(entry.rollout_id, entry.model_call_id)] = self.config.tito.shape(entry)
        if len(recent) > _RECENT_SHAPES:
            recent.popitem(last=False)

    def recent_shape(
        self, rollout_id: str, model_call_id: str
    ) -> tuple[int, int, str | None] | None:
        """(prompt length, request context length, render digest) of an entry this gateway
        stored, if kept (`tokencapture.gateway.tito.Bridge.shape`)."""
        return self._recent.get((rollout_id, model_call_id))

    # Request plumbing ----------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        token = self.config.token
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            raise HttpError(401, "missing or wrong bearer token", "authentication_error")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body over the gateway's limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"request body over the gateway's limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            # The client left while sending its body: nothing was written or sent; the answer
            # reaches no one (a quiet end, not an error in the server's log).
            raise HttpError(
                499, "the client disconnected during its request", "client_gone"
            ) from None
        return b"".join(chunks)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        raw = await self._read_body(request)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise HttpError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return body

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        if self._upstream_auth:
            authorization = request.headers.get("authorization")
            if authorization is not None:
                return {**self._headers, "authorization": authorization}
        return self._headers  # shared: never changed (aiohttp copies what it is given)

    # Routes --------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        try:
            async with self.client.get(
                self.url("/health"), timeout=aiohttp.ClientTimeout(total=5.0), allow_redirects=False
            ) as answer:
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(
                503, f"upstream unreachable: {type(exc).__name__}: {exc}", "upstream_error"
            )
        if status != 200:
            return error_response(503, f"upstream /health answered {status}", "upstream_error")
        return JSONResponse({"status": "ok", "upstream": self.config.upstream})

    async def rollout_summary(self, request: Request) -> Response:
        try:
            self._authorize(request)
            rollout_id = self._rollout(request.path_params["rollout_id"])
            entries, incomplete = await self.backend.entries(rollout_id)
            state = await self.backend.state(rollout_id)
        except HttpError as exc:
            return exc.response()
        except LookupError as exc:  # a retired rollout
            return error_response(410, str(exc), "rollout_retired")
        counts: dict[str, int] = {}
        calls: list[dict[str, Any]] = []
        for entry in entries:
            status = entry.parent_resolution.value if entry.parent_resolution else "none"
            counts[status] = counts.get(status, 0) + 1
            calls.append(
                {
                    "model_call_id": entry.model_call_id,
                    "model": entry.model,
                    "prompt_tokens": len(entry.prompt_token_ids),
                    "generation_tokens": len(entry.generation_token_ids),
                    "parent_call_id": entry.parent_call_id,
                    "parent_resolution": status,
                    "parent_resolution_reason": entry.parent_resolution_reason,
                    "prefix_requested": entry.prefix_requested,
                    "prefix_supplied": entry.prefix_supplied,
                }
            )
        # The calls whose intent has no entry: in flight now, or lost (at freeze, any of them
        # masks the rollout).
        stored = {entry.model_call_id for entry in entries}
        return JSONResponse(
            {
                "rollout_id": rollout_id,
                "state": state["state"],
                "calls_without_entry": sorted(set(state["intents"]) - stored),
                "entries": len(entries),
                "tokens": sum(
                    len(e.prompt_token_ids) + len(e.generation_token_ids) for e in entries
                ),
                "incomplete": incomplete,
                "parent_resolution": counts,
                "continuations_prefix_supplied": sum(
                    1
                    for e in entries
                    if e.parent_resolution is not ParentResolutionStatus.ROOT and e.prefix_supplied
                ),
                "calls": calls,
            }
        )

    @staticmethod
    def _rollout(rollout_id: str) -> str:
        try:
            return validate_rollout_id(rollout_id)
        except (TypeError, ValueError) as exc:
            raise HttpError(400, f"invalid rollout id: {exc}") from None

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except HttpError as exc:
            return exc.response()
        return await self._passthrough(request, "/v1/models")

    async def passthrough(self, request: Request) -> Response:
        path = "/v1/" + request.path_params["path"]
        try:
            self._authorize(request)
        except HttpError as exc:
            return exc.response()
        if any(segment in (".", "..") for segment in path.split("/")):
            # A dot segment (also spelled `%2e` or with an encoded slash: the path is decoded)
            # would be resolved by the URL's normalisation, or by a proxy, to an engine route
            # outside /v1/ (`/health`, `/collective_rpc`, ...).
            return error_response(
                400, f"invalid path {path!r}: a '.' or '..' segment is not passed through"
            )
        return await self._passthrough(request, path, as_sent=True)

    def _passthrough_url(self, request: Request, path: str, *, as_sent: bool) -> URL:
        """The upstream URL of a passthrough of `path` (decoded). `as_sent`: the path and
        query exactly as the client spelled them (its `%2F` stays `%2F`, a bare `flag` stays
        bare), when the server gives them (`raw_path`, ASCII). Otherwise `path` with every
        character but the path's own delimiters percent-encoded (a `%` too) and the query as
        parsed. Dot segments are refused before either, so none is normalised away."""
        base = self._base_url
        raw = request.scope.get("raw_path") if as_sent else None
        query: bytes = request.scope.get("query_string", b"")
        if isinstance(raw, bytes) and raw.isascii() and query.isascii():
            # Mounted under a root path (a Starlette Mount, a proxy that keeps its prefix),
            # the raw path still begins with it: the engine's path is what follows.
            root = request.scope.get("root_path", "").encode("latin-1", "replace")
            if root and raw.startswith(root):
                raw = raw[len(root) :]
            if raw.startswith(b"/v1/"):
                spelled = raw.decode() + ("?" + query.decode() if query else "")
                return URL(self._base + spelled, encoded=True)
        quoted = urllib.parse.quote(path, safe="/!$&'()*+,;=:@~")
        url = base.with_path(base.raw_path.rstrip("/") + quoted, encoded=True)
        return url.with_query(list(request.query_params.multi_items()))

    def _passthrough_headers(self, request: Request) -> list[tuple[str, str]]:
        """The client's end-to-end headers for the engine (not the hop-by-hop ones, nor those
        the client's `Connection` names, nor its `Authorization` unless the gateway has no
        token of its own), then the configured extra headers; a body without a content type
        is sent as JSON, as the OpenAI API's are."""
        dropped = _HOP_BY_HOP_HEADERS | _connection_tokens(request.headers.getlist("connection"))
        own = {name.lower() for name in self.config.extra_headers}
        headers = [
            (name, value)
            for name, value in request.headers.items()
            if name not in dropped and name not in own and name != "authorization"
        ]
        if "content-type" not in request.headers and "content-type" not in own:
            headers.append(("content-type", "application/json"))
        extra = list(self.config.extra_headers.items())
        if self._engine_auth:  # the engine's key is the one Authorization sent
            extra = [(k, v) for k, v in extra if k.lower() != "authorization"]
        headers.extend(extra)
        headers.extend(self._engine_auth)
        if self._upstream_auth:
            authorization = request.headers.get("authorization")
            if authorization is not None:
                headers.append(("authorization", authorization))
        return headers

    def _answer_headers(self, answer: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
        """The engine's end-to-end headers for the client (not the hop-by-hop ones, nor its
        `Date` and `Server`, which the gateway's server sets); a `Location` under the
        upstream's URL is made relative, so that a client follows it through the gateway."""
        dropped = _HOP_BY_HOP_HEADERS | _ANSWER_OWN_HEADERS
        dropped = dropped | _connection_tokens(answer.headers.getall("connection", []))
        base = self._base.encode("latin-1", "replace")
        headers: list[tuple[bytes, bytes]] = []
        for raw_name, value in answer.raw_headers:
            name = raw_name.lower()
            if name.decode("latin-1") in dropped:
                continue
            if name == b"location" and value.startswith(base + b"/"):
                value = value[len(base) :]
            headers.append((name, value))
        return headers

    async def _passthrough(self, request: Request, path: str, *, as_sent: bool = False) -> Response:
        started = time.perf_counter()
        try:
            body = await self._read_body(request) if request.method == "POST" else None
        except HttpError as exc:
            return exc.response()
        try:
            answer = await _unless_client_leaves(
                request,
                self.request_upstream(
                    request.method,
                    self._passthrough_url(request, path, as_sent=as_sent),
                    data=body,
                    headers=self._passthrough_headers(request),
                ),
            )
        except _ClientLeft:
            # Gone while the engine worked: the request was cancelled (its connection
            # closed, so the engine stops); the answer reaches no one.
            self._observe_refused("passthrough", started, 499, "client_gone")
            return error_response(499, "the client disconnected before the answer", "client_gone")
        except TimeoutError:
            self._observe_refused("passthrough", started, 504, "upstream_error")
            return error_response(504, "upstream timed out", "upstream_error")
        except aiohttp.ClientError as exc:
            self._observe_refused("passthrough", started, 502, "upstream_error")
            return error_response(
                502, f"upstream unreachable: {type(exc).__name__}", "upstream_error"
            )
        relayed_whole = False

        async def relay() -> AsyncGenerator[bytes, None]:
            nonlocal relayed_whole
            try:
                async for chunk in answer.content.iter_any():
                    yield chunk
                relayed_whole = True
            finally:
                answer.release()

        relayed = _Relayed(
            relay(),
            answer,
            answer.status,
            succeeded=lambda: relayed_whole and answer.status < 400,
        )
        relayed.raw_headers.extend(self._answer_headers(answer))
        self._observe_when_sent("passthrough", started, relayed)
        return relayed

    def _observe_refused(self, operation: str, started: float, status: int, kind: str) -> None:
        """Count a call the gateway answered with its own error: `error.type` is the answer's
        error type (`client_gone`, `upstream_error`, ...), a bounded set, never a class name."""
        seconds = time.perf_counter() - started
        self.metrics.observe(operation, seconds, error_type=kind, status=status)

    def _observe_when_sent(self, operation: str, started: float, response: Response) -> None:
        """Count a call whose response is ready: now, by its status; a relayed one once its
        sending is over (its duration then covers the whole stream, and it failed unless the
        relay says it was answered whole: a stream the engine broke, one that ended in an
        error event, or one whose client left is a failure, as a non-streamed call's is)."""
        if isinstance(response, _Relayed) and response.succeeded is not None:
            succeeded = response.succeeded
            status = response.status_code

            def observe() -> None:
                # Failed: an error status relayed, or a stream that broke after its 200.
                self._observe_answered(operation, started, status, failed=not succeeded())

            response.finally_.append(observe)
            return
        status = response.status_code
        self._observe_answered(operation, started, status, failed=status >= 400)

    def _observe_answered(self, operation: str, started: float, status: int, failed: bool) -> None:
        """Count a call answered with `status`: a failure with an error status has that status
        as its `error.type` (OpenTelemetry's HTTP convention); one under a 200 (a stream that
        broke) has none."""
        error_type = str(status) if failed and status >= 400 else None
        seconds = time.perf_counter() - started
        self.metrics.observe(
            operation, seconds, failed=failed, error_type=error_type, status=status
        )

    def captured(self, kind: str) -> Callable[[Request, str | None], Awaitable[Response]]:
        """The handler of a captured route: `handle(request, rollout_id)`, the rollout id from
        the path (`/rollouts/{rollout_id}/...`) or None (then the `X-Rollout-Id` header's)."""
        path = "/v1/chat/completions" if kind == CHAT else "/v1/completions"
        operation = "chat_completions" if kind == CHAT else "completions"

        async def handle(request: Request, rollout: str | None) -> Response:
            started = time.perf_counter()
            try:
                self._authorize(request)
                if rollout is None:
                    rollout = request.headers.get(ROLLOUT_HEADER)
            except HttpError as exc:
                return exc.response()
            if rollout is None:
                # No rollout named at all: passed through uncaptured. A header that is present
                # but empty names an invalid rollout (400 below), not "no rollout": a client
                # whose rollout id came out empty must not get answers that nothing captured.
                return await self._passthrough(request, path)
            try:
                response = await self._capture(kind, path, request, rollout)
            except HttpError as exc:
                self._observe_refused(operation, started, exc.status, exc.kind)
                return exc.response()
            except BaseException:
                self.metrics.observe(operation, time.perf_counter() - started, failed=True)
                raise
            self._observe_when_sent(operation, started, response)
            return response

        return handle

    # Capture -------------------------------------------------------------------------------

    async def _capture(self, kind: str, path: str, request: Request, rollout: str) -> Response:
        rollout_id = self._rollout(rollout)
        given_call_id = request.headers.get(CALL_HEADER)
        if given_call_id == "":
            # Present but empty: an invalid id, not "no id" (a generated one would drop the
            # client's retry protection: its retry would be a second generation).
            raise HttpError(400, "invalid model call id: the X-Model-Call-Id header is empty")
        raw_call_id = given_call_id or uuid.uuid4().hex
        try:
            # Header values arrive as latin-1; a client sends UTF-8.
            call_id = raw_call_id.encode("latin-1").decode("utf-8")
        except UnicodeError:
            raise HttpError(400, "invalid model call id: not UTF-8") from None
        try:
            check_call_id(call_id)
        except (TypeError, ValueError) as exc:
            raise HttpError(400, f"invalid model call id: {exc}") from None
        body = await self._read_json(request)
        try:
            upstream_body, requested = prepare_upstream_body(kind, body)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        messages: list[dict[str, Any]] = []
        if kind == CHAT:
            raw = body.get("messages")
            if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
                raise HttpError(400, "messages must be a list of message objects")
            messages = _stampable(raw)
        headers = {CALL_HEADER: raw_call_id}
        call = _Call(self, kind, path, request, rollout_id, call_id, messages, requested, headers)
        if not given_call_id:
            # A generated id: no call was made with it before, and none is in flight.
            await self._begin(call, unless_stored=False)
            return await self._run(call, upstream_body)
        # Only a client's own id can name a call made before (a retry), or one in flight.
        return await self._one_at_a_time(
            (rollout_id, call_id),
            functools.partial(self._retry_or_dispatch, call, body, upstream_body),
        )

    async def _one_at_a_time(
        self, key: tuple[str, str], work: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Run `work()`, a call with the client's own id, once no other call with that id is
        in flight in this gateway: two calls with one id (a client's retry racing its first
        attempt) are answered one after the other, the second as a retry of the first
        (replayed if the first stored its entry for the same request, a 409 conflict if the
        request differs, dispatched as a fresh call if the first stored nothing). A call holds
        its place until its answer is sent (a stream: to its end, or its cancellation), so
        the next sees the first's outcome in the store. Across gateway processes the store
        decides alone (one 200, the others 409)."""
        in_flight = self._in_flight
        while (ahead := in_flight.get(key)) is not None:
            await ahead.wait()  # a waiter cancelled here holds nothing
        done = asyncio.Event()
        in_flight[key] = done

        def settle() -> None:
            if in_flight.get(key) is done:
                del in_flight[key]
            done.set()

        try:
            response = await work()
        except BaseException:
            settle()
            raise
        if isinstance(response, _Relayed):
            response.finally_.append(settle)
            return response
        settle()
        return response

    async def _retry_or_dispatch(
        self, call: _Call, body: dict[str, Any], upstream_body: dict[str, Any]
    ) -> Response:
        """A call with the client's own id: its intent, unless the store already holds its
        entry (checked in the same step); then a replay for the same request, a 409 for
        another. A dispatched call's entry carries the request's digest."""
        digest = request_digest(call.kind, body)
        if await self._begin(call, unless_stored=True):
            replayed = await self._replay(call, body, digest)
            if replayed is not None:
                return replayed
            await self._begin(call, unless_stored=False)  # the entry went since: a new call
        call.extra[REQUEST_DIGEST_FIELD] = digest
        call.body = body
        return await self._run(call, upstream_body)

    async def _run(self, call: _Call, upstream_body: dict[str, Any]) -> Response:
        """The call, its intent written: the engine, then its entry."""
        kind, rollout_id, call_id = call.kind, call.rollout_id, call.call_id
        try:
            if kind == CHAT and self.config.tito is not None:
                return await call.run_tito(upstream_body)
            return await call.run(upstream_body)
        except HttpError:
            raise
        except _StoredFirst:
            return await self._answer_stored_first(call)
        except _ClientLeft:
            # The client left while the engine worked (an agent's timeout): the upstream
            # request was cancelled, its connection closed (vLLM aborts the generation). As
            # for a stream its client leaves, the call is marked, and nothing is stored.
            await call.fail("client_disconnected")
            raise HttpError(
                499, "the client disconnected before the answer", "client_gone"
            ) from None
        except asyncio.CancelledError:
            # The gateway is stopping past its grace period (or its host cancelled the task):
            # no answer leaves, so the call is marked (from a task of its own: this one is
            # being torn down; `Gateway.close` waits for it).
            call.fail_later("cancelled")
            raise
        except Exception as exc:
            logger.exception("call %r of rollout %r failed in the gateway", call_id, rollout_id)
            await call.fail(f"gateway_error: {type(exc).__name__}")
            raise HttpError(
                500, f"the gateway failed: {type(exc).__name__}: {exc}", "gateway_error"
            ) from None
        finally:
            call.watch.stop()

    async def _answer_stored_first(self, call: _Call) -> Response:
        """The answer to a call whose other attempt (the same client id, through another
        gateway process) stored its entry while this one was at the engine: the stored entry,
        replayed, for the same request; a 409 for another (nothing was written or marked)."""
        assert call.body is not None  # only a call with the client's own id puts this way
        replayed = await self._replay(call, call.body, call.extra[REQUEST_DIGEST_FIELD])
        if replayed is None:  # dropped or deleted since: nothing to answer from
            raise HttpError(
                409,
                f"rollout {call.rollout_id!r} no longer holds call {call.call_id!r}, which "
                "another attempt stored while this one was in flight",
                "rollout_closed",
            )
        return replayed

    async def _begin(self, call: _Call, *, unless_stored: bool) -> bool:
        """Write the call's durable intent (with `unless_stored`, unless its entry is already
        stored: then True and nothing written). The parent is looked up once the intent is
        written (a read: nothing to undo), by the same job of the store's worker pool: one
        worker wake-up for both; the lookup is done long before the engine answers (the call
        goes upstream only after the intent)."""
        recorded = False
        try:
            stored = await call.start_intent(unless_stored=unless_stored)
            recorded = not stored
            return stored
        except TokenCaptureFrozenError as exc:
            raise HttpError(
                409, f"rollout {call.rollout_id!r} takes no more calls: {exc}", "rollout_closed"
            ) from None
        except (TypeError, ValueError) as exc:
            raise HttpError(400, str(exc)) from None
        except Exception as exc:
            raise _store_unavailable(
                f"the store could not record the call's intent: {exc}", exc
            ) from None
        finally:
            if not recorded:  # also when cancelled: no call, so no parent to look up
                call.cancel_resolution()

    async def _replay(self, call: _Call, body: dict[str, Any], digest: str) -> Response | None:
        """The answer to a retry of a call the store already holds (its answer was lost: a
        gateway killed after the put, a dropped connection), rebuilt from the stored entry
        with no dispatch and no second intent; None when the store no longer holds an entry
        under this call id (the call then proceeds as any other). Another request under a
        stored call id is a reused id: 409, before anything is dispatched or marked."""
        started = time.perf_counter()
        kind, requested, headers = call.kind, call.requested, call.headers
        try:
            entry = await self.backend.stored_entry(call.rollout_id, call.call_id)
        except Exception as exc:
            raise _store_unavailable(
                f"the store could not be read for an earlier answer to this call id: {exc}", exc
            ) from None
        if entry is None:
            return None
        if not _same_request(kind, entry, call.messages, body, digest):
            raise HttpError(
                409,
                "the store already holds another request's answer under call id "
                f"{call.call_id!r}: "
                "send every call with its own X-Model-Call-Id",
                "model_call_id_conflict",
            )
        generation = generation_from_entry(entry)
        strip = strip_chat if kind == CHAT else strip_completion
        created = int(time.time())
        response: Response
        if requested.stream:
            events = [
                _event(orjson.dumps(strip(chunk, requested)))
                for chunk in replay_chunks(kind, generation, body, created)
            ]
            content = b"".join(events) + _event(_DONE)
            response = Response(
                content, 200, headers={**headers, **_SSE_HEADERS}, media_type="text/event-stream"
            )
        else:
            answer = strip(replay_body(kind, generation, body, created), requested)
            response = Response(
                orjson.dumps(answer), 200, headers=headers, media_type="application/json"
            )
        self.metrics.observe("replay", time.perf_counter() - started, status=200)
        return response


# A content part without a type that vLLM reads by the field it carries (`chat_utils`: "Handle
# missing 'type' but provided direct URL fields"), in vLLM's order of looking.
_UNTYPED_PART_FIELDS: Final[tuple[str, ...]] = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)


def _stampable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation the call's lineage is stamped and resolved with, checked before the
    intent: a conversation the stamp (`stamp_continuation`, NeMo Gym's fingerprint) cannot
    read is a 400 here, not a 502 after the engine generated.

    A content part with no type (missing or null) and no string `text`, which the fingerprint
    refuses, is read as vLLM reads it: by the first of `_UNTYPED_PART_FIELDS` it carries, as
    the part with that type (`{"image_url": U}` as `{"type": "image_url", "image_url": U}`, so
    the two spellings of one image have one fingerprint). Only the stamped copy has the type;
    the engine gets the request as sent. Every conversation the fingerprint already reads is
    used as it is, so no fingerprint of it changes."""
    try:
        if _core.continuation_hashes(messages, len(messages)) is None:
            conversation_digest(messages)  # what the native hash defers; raises as the stamp
        return messages
    except (TypeError, ValueError) as exc:
        typed = _typed_parts(messages)
        if typed is not None:
            try:
                conversation_digest(typed)
                return typed
            except (TypeError, ValueError):
                pass
        raise HttpError(400, f"messages cannot be captured: {exc}") from None


def _typed_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` with each untyped part `_stampable` reads as vLLM does given its type (a
    copy of what changes), or None if there is none."""
    changed = False
    typed: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for part in content:
                if (
                    isinstance(part, dict)
                    and part.get("type") is None
                    and not isinstance(part.get("text"), str)
                ):
                    field_name = next((f for f in _UNTYPED_PART_FIELDS if f in part), None)
                    if field_name is not None:
                        part = {**part, "type": field_name}
                        changed = True
                parts.append(part)
            message = {**message, "content": parts}
        typed.append(message)
    return typed if changed else None


async def _disconnect_waiting(request: Request) -> bool:
    """Whether the client's disconnect already waits in the request's ASGI receive channel,
    without waiting for anything (the body is read, so a disconnect is all it can hold).
    Starlette's `Request.is_disconnected` asks the same by cancelling the receive in an anyio
    cancel scope; where the server's receive is a coroutine function (uvicorn's, hypercorn's)
    its coroutine runs here to its first suspension and is closed there instead: ~1 us
    against ~14 us a call, and no cancellation callbacks left on the loop."""
    if not inspect.iscoroutinefunction(request.receive):
        return await request.is_disconnected()
    step = request.receive()
    assert isinstance(step, Coroutine)
    try:
        step.send(None)
    except StopIteration as done:
        message = done.value
        return isinstance(message, dict) and message.get("type") == "http.disconnect"
    step.close()
    return False


_T = TypeVar("_T")


class _ClientLeft(Exception):
    """The client disconnected while its call waited for the engine (`_ClientWatch`)."""


async def _client_disconnected(receive: Receive) -> bool:
    """Wait for the ASGI server to say that the client disconnected (`http.disconnect`): True
    then. A client still there, its body read, is a `receive` that blocks (until the response
    is sent or the client leaves). A body not read yet (a passthrough `GET`'s empty one) is
    read past; False (stop watching) on any other message, or a second final body message,
    rather than spin on a server that answers at once."""
    bodies = 0
    while True:
        message = await receive()
        kind = message.get("type")
        if kind == "http.disconnect":
            return True
        if kind != "http.request":
            return False
        if not message.get("more_body", False):
            bodies += 1
            if bodies > 1:
                return False


class _ClientWatch:
    """A watch of a call's client while the call waits for the engine: `run(work)` awaits
    `work` (the request upstream, the answer's body), and when the ASGI server says the client
    disconnected, `work` is cancelled (aiohttp then closes the upstream connection, which is
    what makes vLLM abort the generation) and `_ClientLeft` raised. A departure seen between
    two `run`s makes the next raise at once.

    One watcher task for the whole call (its `receive`, pending while the client waits),
    made at the first `run` and ended by `stop` (before a stream is relayed: Starlette's own
    listener takes over; always once the call is over). The watcher cancels the task in
    `run`, as `asyncio.timeout` does, so a cancellation from elsewhere (a server stopping past
    its grace period) still propagates as one. Only what `run` awaits is watched: nothing
    else (the store's put, a mark) is ever cancelled by the client's departure. A client that
    finished sending its body and waits is a `receive` that blocks: never taken for gone."""

    __slots__ = ("cancelled", "left", "receive", "running", "watcher")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.watcher: asyncio.Task[None] | None = None
        self.running: asyncio.Task[Any] | None = None  # the task in `run`, while it is
        self.left = False
        self.cancelled = False  # the watcher cancelled `running`

    async def _watch(self) -> None:
        try:
            gone = await _client_disconnected(self.receive)
        except Exception:  # a server whose receive fails: not watched (as before this watch)
            return
        if gone:
            self.left = True
            if self.running is not None:
                self.cancelled = True
                self.running.cancel()

    async def run(self, work: Awaitable[_T]) -> _T:
        if self.left:
            if inspect.iscoroutine(work):
                work.close()
            raise _ClientLeft
        task = asyncio.current_task()
        assert task is not None
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())
        self.running = task
        try:
            result = await work
        except BaseException:
            if self._uncancelled(task):
                raise _ClientLeft from None
            raise
        finally:
            self.running = None
        if self._uncancelled(task):  # `work` swallowed the cancellation: gone all the same
            raise _ClientLeft
        return result

    def _uncancelled(self, task: asyncio.Task[Any]) -> bool:
        """Whether the watcher cancelled `task` and no one else did (the cancellation is
        then taken back: the call goes on, to be marked)."""
        if not self.cancelled:
            return False
        self.cancelled = False
        return task.uncancel() == 0

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()


async def _unless_client_leaves(request: Request, work: Awaitable[_T]) -> _T:
    """`await work` while watching the client (`_ClientWatch`; `_ClientLeft` if it left)."""
    watch = _ClientWatch(request.receive)
    try:
        return await watch.run(work)
    finally:
        watch.stop()


def _same_request(
    kind: str,
    entry: TokenEntry,
    messages: list[dict[str, Any]],
    body: dict[str, Any],
    digest: str,
) -> bool:
    """Whether a stored entry answers this request: the same request digest
    (`request_digest`, stored with the entry as `gateway_request_digest`). An entry stored
    without one (by a gateway before it) is compared as that gateway did: a chat entry
    stamped with the same conversation (the digest `stamp_continuation` stores); a
    completions entry (unstamped) with the same prompt when it is token ids (a text prompt
    cannot be compared with the stored tokens: taken as the same). Another request under a
    stored call id is a reused id (a 409 before anything is dispatched). An entry another
    writer made (not one output item at index 0, as the gateway writes) is not replayed
    either."""
    if len(entry.output_items) != 1 or entry.token_item_index != 0:
        return False
    extra = entry.__pydantic_extra__ or {}
    stored = extra.get(REQUEST_DIGEST_FIELD)
    if stored is not None:
        return bool(stored == digest)
    if kind == CHAT:
        if entry.continuation_context_len != len(messages):
            return False
        try:
            stamped = stamp_continuation(entry.model_copy(), messages)
        except (TypeError, ValueError):  # messages the stamp cannot read: not the stored ones
            return False
        return stamped.continuation_context_digest == entry.continuation_context_digest
    if entry.continuation_context_len or entry.continuation_context_digest:
        return False  # a chat call's entry
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        return prompt == list(entry.prompt_token_ids)
    return True


class _Call:
    """One captured call in flight."""

    def __init__(
        self,
        gateway: Gateway,
        kind: str,
        path: str,
        request: Request,
        rollout_id: str,
        call_id: str,
        messages: list[dict[str, Any]],
        requested: Requested,
        headers: dict[str, str],
    ) -> None:
        self.gateway = gateway
        self.kind = kind
        self.path = path
        self.request = request
        self.rollout_id = rollout_id
        self.call_id = call_id
        self.messages = messages
        self.requested = requested
        self.headers = headers
        self.resolution: asyncio.Future[LineageResolution] | None = None
        self.prefix_requested = False
        self.extra: dict[str, Any] = {}
        # The client's body, kept for a call with the client's own id: its entry is put
        # unless another attempt stored one first, whose answer is then given (a replay).
        self.body: dict[str, Any] | None = None
        # The client, watched while the call waits for the engine (`send`, `read`).
        self.watch = _ClientWatch(request.receive)
        # A stream's outcome: set once its last event ([DONE], after the stored entry's
        # final chunk) was taken by the sending, so not for a stream that ended in an error
        # event or lost its client.
        self.answered = False

    # Lineage -------------------------------------------------------------------------------

    def start_intent(self, *, unless_stored: bool) -> Awaitable[bool]:
        """The call's durable intent to await (with `unless_stored`, none if the call's entry is
        already stored: True then); for a chat call, with the lookup of its parent started too
        (`start_together`: the store's native jobs of both as one)."""
        backend = self.gateway.backend
        begin = backend.begin_call(self.rollout_id, self.call_id, unless_stored=unless_stored)
        if self.kind != CHAT:
            return begin
        intent, resolution = start_together(begin, backend.resolve(self.rollout_id, self.messages))
        self.resolution = resolution
        return intent

    def start_resolution(self) -> None:
        if self.kind == CHAT and self.resolution is None:
            self.resolution = asyncio.ensure_future(
                self.gateway.backend.resolve(self.rollout_id, self.messages)
            )

    async def resolved(self) -> LineageResolution | None:
        if self.resolution is None:
            return None
        try:
            return await self.resolution
        except Exception as exc:
            logger.warning("resolving call %r of %r failed: %s", self.call_id, self.rollout_id, exc)
            return LineageResolution(
                ParentResolutionStatus.UNRESOLVED,
                reason=f"{_UNRESOLVED_ERROR_REASON}: {type(exc).__name__}",
            )

    def cancel_resolution(self) -> None:
        if self.resolution is not None and not self.resolution.done():
            self.resolution.cancel()

    async def entry(self, generation: Generation) -> TokenEntry:
        entry = TokenEntry(
            rollout_id=self.rollout_id,
            model_call_id=self.call_id,
            model=generation.model,
            prompt_token_ids=generation.prompt_token_ids,
            generation_token_ids=generation.generation_token_ids,
            generation_log_probs=generation.generation_log_probs,
            output_items=generation.output_items,
            token_item_index=0,
            response_id=generation.response_id,
            created_at=time.time(),
            **self.extra,
        )
        resolution = await self.resolved()
        if resolution is None:
            # A completion: no conversation, so nothing to continue or be continued.
            stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
            return entry
        stamp_continuation(entry, self.messages)
        entry.prefix_requested = self.prefix_requested
        if resolution.status is ParentResolutionStatus.ROOT:
            stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.ROOT)
        elif resolution.status is ParentResolutionStatus.RESOLVED:
            assert resolution.match is not None
            parent = resolution.match.cumulative_token_ids
            prompt = generation.prompt_token_ids
            if len(prompt) >= len(parent) and tuple(prompt[: len(parent)]) == tuple(parent):
                stamp_lineage(
                    entry,
                    resolution.match.model_call_id,
                    parent_resolution=ParentResolutionStatus.RESOLVED,
                )
                entry.prefix_supplied = True
            else:
                stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.UNRESOLVED)
                entry.parent_resolution_reason = DIVERGED_REASON
        else:
            stamp_lineage(entry, None, parent_resolution=ParentResolutionStatus.UNRESOLVED)
            entry.parent_resolution_reason = resolution.reason or ""
        return entry

    # Failure -------------------------------------------------------------------------------

    async def fail(self, reason: str) -> None:
        self.cancel_resolution()
        await self.gateway.backend.fail(self.rollout_id, self.call_id, reason)

    def fail_later(self, reason: str) -> None:
        """`fail` in a task of its own (from a cancelled stream, which cannot await)."""
        self.cancel_resolution()
        self.gateway._spawn(self.gateway.backend.fail(self.rollout_id, self.call_id, reason))

    async def store(self, generation: Generation) -> None:
        """Build, stamp and put the entry; `HttpError(503)` when the store refuses it."""
        try:
            entry = await self.entry(generation)
        except (ValueError, TypeError) as exc:
            await self.fail(f"capture_failed: {exc}")
            raise HttpError(
                502, f"the upstream's answer cannot be captured: {exc}", "upstream_error"
            ) from None
        try:
            kept = await self.gateway.backend.put(entry, unless_stored=self.body is not None)
        except TokenCaptureFrozenError as exc:
            # Frozen (or retired) while the call was in flight. The freeze already judged this
            # call (its intent had no entry, so the snapshot is incomplete): the late entry is
            # dropped and the call is NOT marked incomplete, as the protocol says, since a mark
            # after the freeze would move the snapshot's version and the trainer's `drop` of
            # that snapshot would fail. Only the ledger's failure row records why.
            self.cancel_resolution()
            await self.gateway.backend.fail(
                self.rollout_id, self.call_id, f"rollout_closed: {type(exc).__name__}", mark=False
            )
            raise HttpError(
                409,
                f"rollout {self.rollout_id!r} was closed while the call was in flight ({exc}); "
                "the answer is withheld",
                "rollout_closed",
            ) from None
        except TokenCaptureConflictError as exc:
            # The call id is already stored with another generation (a reused X-Model-Call-Id):
            # the store refused this one and marked the rollout incomplete. A retry with the
            # same id can never succeed, so this is a 409, not a 503.
            await self.fail(f"model_call_id_conflict: {type(exc).__name__}")
            raise HttpError(
                409,
                f"the store already holds another generation under this call id ({exc}); the "
                "answer is withheld: send every call with its own X-Model-Call-Id",
                "model_call_id_conflict",
            ) from None
        except Exception as exc:
            await self.fail(f"store_write_failed: {type(exc).__name__}")
            raise _store_unavailable(
                f"the store did not accept the entry ({type(exc).__name__}: {exc}); "
                "the answer is withheld",
                exc,
            ) from None
        if kept:
            # Another attempt of this call (the client's retry, or its first try, through
            # another gateway process) was stored first: this answer is withheld and the
            # stored one is the call's. Nothing was written or marked: the rollout holds one
            # entry for the call, and its intent is not dangling.
            raise _StoredFirst
        self.gateway.remember(entry)

    async def store_if_client_waits(self, generation: Generation) -> None:
        """`store`, unless the client has gone (an agent's timeout, say) while the engine
        answered: then, as for a stream it leaves, the call is marked `client_disconnected`
        and not stored: its answer reaches no one, so it must not sit in the rollout as a
        call the agent saw (nor leave it unmasked)."""
        if self.watch.left or await _disconnect_waiting(self.request):
            await self.fail("client_disconnected")
            raise HttpError(499, "the client disconnected before the answer", "client_gone")
        await self.store(generation)

    # Dispatch ------------------------------------------------------------------------------

    async def send(self, body: dict[str, Any], path: str) -> aiohttp.ClientResponse:
        """POST upstream; the answer's headers are in, its body is still to be read. A client
        that disconnects meanwhile cancels the request (`_ClientLeft`)."""
        gateway = self.gateway
        try:
            return await self.watch.run(
                gateway.request_upstream(
                    "POST",
                    gateway.url(path),
                    data=orjson.dumps(body),
                    headers=gateway._upstream_headers(self.request),
                ),
            )
        except TimeoutError:
            await self.fail("upstream_timeout")
            raise HttpError(504, "upstream timed out", "upstream_error") from None
        except aiohttp.ClientError as exc:
            await self.fail(f"upstream_unreachable: {type(exc).__name__}")
            raise HttpError(
                502, f"upstream unreachable: {type(exc).__name__}: {exc}", "upstream_error"
            ) from None

    async def read(self, answer: aiohttp.ClientResponse) -> bytes:
        """The answer's body; a timeout or a disconnect while reading marks the call. A client
        that disconnects meanwhile drops the answer's connection (`_ClientLeft`). The last
        wait for the engine: the client's watch ends here (what follows, the store's put, is
        not watched)."""
        try:
            return await self.watch.run(answer.read())
        except _ClientLeft:
            answer.close()  # the connection, not back to the pool: the engine aborts
            raise
        except TimeoutError:
            await self.fail("upstream_timeout")
            raise HttpError(504, "upstream timed out", "upstream_error") from None
        except aiohttp.ClientError as exc:
            await self.fail(f"upstream_disconnected: {type(exc).__name__}")
            raise HttpError(
                502, f"upstream disconnected: {type(exc).__name__}", "upstream_error"
            ) from None
        finally:
            self.watch.stop()
            answer.release()

    async def refused(self, answer: aiohttp.ClientResponse) -> Response:
        """An upstream error status: mark the call and pass the status and body through."""
        try:
            content = await answer.read()
        except (aiohttp.ClientError, TimeoutError):
            content = b""
        finally:
            answer.release()
        await self.fail(f"upstream_status_{answer.status}")
        if 300 <= answer.status < 400:
            # Not followed (`Gateway.request_upstream`), and not passed on: the client asked
            # the gateway, and a redirect's target would not be captured.
            location = answer.headers.get("location", "")
            return error_response(
                502,
                f"the upstream answered {answer.status} (a redirect to {location!r}); the "
                "gateway does not follow redirects: point --upstream at the engine itself",
                "upstream_error",
                self.headers,
            )
        media = answer.headers.get("content-type", "application/json")
        return Response(content, answer.status, headers=self.headers, media_type=media)

    async def run(self, upstream_body: dict[str, Any]) -> Response:
        self.start_resolution()
        stream = self.requested.stream
        answer = await self.send(upstream_body, self.path)
        if answer.status != 200:
            return await self.refused(answer)
        if stream:
            self.watch.stop()  # the relay (and Starlette's listener) looks at the client now
            return _Relayed(
                self._relay(answer),
                answer,
                200,
                headers={**self.headers, **_SSE_HEADERS},
                media_type="text/event-stream",
                abandoned=lambda: self.fail_later("client_disconnected"),
                succeeded=lambda: self.answered,
            )
        content = await self.read(answer)
        try:
            data = orjson.loads(content)
            generation = (
                generation_from_chat(data, echoed_text(upstream_body))
                if self.kind == CHAT
                else generation_from_completion(data)
            )
        except Exception as exc:
            # An answer of another shape than the engine's (a field of another type raises
            # TypeError, say) is the engine's failure, not the gateway's.
            reason = _capture_failure(exc)
            await self.fail(f"capture_failed: {reason}")
            raise HttpError(
                502, f"the upstream's answer cannot be captured: {reason}", "upstream_error"
            ) from None
        await self.store_if_client_waits(generation)
        strip = strip_chat if self.kind == CHAT else strip_completion
        return Response(
            orjson.dumps(strip(data, self.requested)),
            200,
            headers=self.headers,
            media_type="application/json",
        )

    async def _uncapturable(self, exc: Exception) -> bytes:
        """Mark a stream the gateway cannot capture; the error event that ends it."""
        reason = _capture_failure(exc)
        await self.fail(f"capture_failed: {reason}")
        message = f"the upstream's stream cannot be captured: {reason}"
        return _event(_stream_error(502, message, "upstream_error"))

    async def client_gone(self) -> bool:
        """Whether the client has disconnected, as of the loop's latest look at its socket."""
        await asyncio.sleep(0)  # one turn of the loop: a pending disconnect is read
        return await _disconnect_waiting(self.request)

    async def _relay(self, answer: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
        """Pass the stream on chunk by chunk; hold the final chunk and `[DONE]` until stored."""
        accumulator = StreamAccumulator(self.kind)
        strip = strip_chat if self.kind == CHAT else strip_completion
        requested = self.requested
        untouched = requested.token_ids and requested.logprobs
        held: list[bytes] = []
        finished = False
        lines = _Lines(answer.content, _max_sse_line(self.gateway.config.max_body_bytes))
        try:
            try:
                while not finished and (read := await lines.read()) is not None:
                    for line in read:
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == _DONE:
                            finished = True
                            break
                        chunk = orjson.loads(payload)
                        if not isinstance(chunk, dict):
                            raise CaptureError("a stream chunk is not a JSON object")
                        if "error" in chunk and "choices" not in chunk:
                            raise CaptureError(f"the upstream's stream failed: {chunk['error']}")
                        accumulator.add(chunk)
                        event = _event(
                            payload if untouched else orjson.dumps(strip(chunk, requested))
                        )
                        if held or accumulator.finish_reason is not None:
                            held.append(event)
                        else:
                            yield event
                        # Let the loop run between chunks: when the engine is ahead and its
                        # chunks are all buffered, nothing here would wait, and the client's
                        # disconnect (which cancels this relay) would not be seen until the
                        # stream is over.
                        await asyncio.sleep(0)
            except TimeoutError:
                await self.fail("upstream_timeout")
                yield _event(_stream_error(504, "upstream timed out", "upstream_error"))
                return
            except aiohttp.ClientError as exc:
                await self.fail(f"upstream_disconnected: {type(exc).__name__}")
                yield _event(
                    _stream_error(
                        502, f"upstream disconnected: {type(exc).__name__}", "upstream_error"
                    )
                )
                return
            except Exception as exc:
                # A chunk the gateway cannot read (not JSON, an error event, another shape
                # than the engine's: a field of another type raises TypeError, say) fails the
                # call as the engine's failure, with an error event, never a cut connection.
                yield await self._uncapturable(exc)
                return
            if not finished:
                await self.fail("upstream_disconnected: stream ended without [DONE]")
                yield _event(
                    _stream_error(
                        502, "the upstream's stream ended without [DONE]", "upstream_error"
                    )
                )
                return
            try:
                generation = accumulator.generation()
            except Exception as exc:
                yield await self._uncapturable(exc)
                return
            if await self.client_gone():
                # Gone before the final chunk: the call did not reach the client, so it is
                # marked incomplete rather than stored (an entry is stored only for a stream
                # the client was still there for).
                await self.fail("client_disconnected")
                return
            try:
                await self.store(generation)
            except HttpError as exc:
                yield _event(_stream_error(exc.status, exc.message, exc.kind))
                return
            except _StoredFirst:
                # Its deltas are sent, so the stored answer cannot replace them: the stream
                # ends without its final chunk, as a failed call, and a retry gets the stored
                # answer.
                yield _event(_stream_error(409, _STORED_FIRST_MESSAGE))
                return
            for event in held:
                yield event
            yield _event(_DONE)
            self.answered = True  # the sending asked for more after [DONE]: it was sent
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away mid-stream (the response task is cancelled): the call did
            # not reach it. Mark it from a task of its own; this one is being torn down.
            if not finished:
                self.fail_later("client_disconnected")
            raise
        finally:
            if finished:
                answer.release()
            else:
                answer.close()  # drop the connection: the engine aborts the generation

    # Token in, token out --------------------------------------------------------------------

    async def run_tito(self, upstream_body: dict[str, Any]) -> Response:
        response: Response = await self.gateway.config.tito.run(self, upstream_body)
        return response


class _Relayed(Response):
    """An upstream answer streamed to the client as it comes (`relay` yields its chunks).

    However the sending ends (sent whole, failed, cancelled by the client's departure, or
    never begun because the client was gone before its first byte, when Starlette never
    iterates the relay at all), the relay is closed then, not at garbage collection: its own
    cleanup (a mark, the answer's release) runs at once. A relay that never started has
    cleaned nothing up: the upstream `answer` is closed (its connection dropped, so the engine
    stops generating, and not held until the collector runs) and `abandoned` runs (a captured
    call is marked `client_disconnected`). Then each of `finally_` (a call's place in flight,
    `Gateway._one_at_a_time`: the stream's outcome is known only now)."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        answer: aiohttp.ClientResponse,
        status: int,
        *,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        abandoned: Callable[[], None] | None = None,
        succeeded: Callable[[], bool] | None = None,
    ) -> None:
        # Not Response.__init__: the inner response is sent as it is; what a handler reads
        # of a response (its status) is copied.
        self.inner = StreamingResponse(self, status, headers=headers, media_type=media_type)
        self.relay = relay
        # Whether the call was answered, once the sending is over (the handler's metric).
        self.succeeded = succeeded
        self.started = False
        self.answer = answer
        self.abandoned = abandoned
        self.finally_: list[Callable[[], None]] = []
        self.status_code = self.inner.status_code
        self.background = None
        self.raw_headers = self.inner.raw_headers

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        # What the inner response iterates, once its headers are sent: the relay, noted as
        # started (at no cost per chunk).
        self.started = True
        return self.relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            try:
                # A relay suspended at a chunk when the sending was cancelled runs its
                # cleanup now; one finished or never started has nothing to run.
                await self.relay.aclose()
            finally:
                if not self.started:
                    self.answer.close()
                    if self.abandoned is not None:
                        self.abandoned()
                for settle in self.finally_:
                    settle()


class _StoredFirst(Exception):
    """Another attempt of the call (the same client id, through another gateway process)
    stored its entry first; this attempt's was not written (`Backend.put(unless_stored=True)`)."""


_STORED_FIRST_MESSAGE: Final[str] = (
    "another attempt of this call (the same X-Model-Call-Id, through another gateway process) "
    "was stored while this one was in flight: its answer is the call's; send the call again "
    "to receive it"
)


def _capture_failure(exc: Exception) -> str:
    """Why an upstream answer could not be captured: the gateway's own reasons (CaptureError,
    a JSON error) as they are, anything else (an answer of another shape) with its type."""
    if isinstance(exc, CaptureError | orjson.JSONDecodeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


# A stream's line (an SSE event's `data:` line) may be long: vLLM's first chunk carries every
# prompt token id (~7 bytes each), past aiohttp's own line limit (512 KiB: ~75k tokens). The
# relay splits lines itself, bounded by this many bytes or 8 times the request body limit,
# whichever is more (a line over it fails the call: its memory would be unbounded).
MIN_MAX_SSE_LINE_BYTES: Final[int] = 64 * 1024 * 1024


def _max_sse_line(max_body_bytes: int) -> int:
    return max(MIN_MAX_SSE_LINE_BYTES, 8 * max_body_bytes)


class _Lines:
    """The lines of an upstream stream (each with its `\\n`; the last may lack it), read as
    they come, as many as each read of the socket completes; none longer than `limit`."""

    def __init__(self, content: aiohttp.StreamReader, limit: int) -> None:
        self.content = content
        self.limit = limit
        self.partial = bytearray()
        self.ended = False

    async def read(self) -> list[bytes] | None:
        """The lines the next read completes (maybe none); None once the stream is over."""
        if self.ended:
            return None
        data = await self.content.readany()
        partial = self.partial
        if not data:
            self.ended = True
            if partial:
                last = bytes(partial)
                partial.clear()
                return [last]
            return None
        lines: list[bytes] = []
        start = 0
        while (end := data.find(b"\n", start)) != -1:
            if partial:
                partial += data[start : end + 1]
                lines.append(bytes(partial))
                partial.clear()
            else:
                lines.append(data[start : end + 1])
            if len(lines[-1]) > self.limit:  # one read may hold a whole line past it
                raise CaptureError(
                    f"a stream line is over the gateway's limit of {self.limit} bytes"
                )
            start = end + 1
        if start < len(data):
            partial += data[start:]
            if len(partial) > self.limit:
                raise CaptureError(
                    f"a stream line is over the gateway's limit of {self.limit} bytes"
                )
        return lines


def _stream_error(status: int, message: str, kind: str = "gateway_error") -> bytes:
    """A stream's error event, typed as the gateway's errors are (`upstream_error` when the
    engine's stream failed)."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


_CAPTURED_PATHS: Final[dict[str, str]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
}
_ROLLOUTS: Final[str] = "/rollouts/"


class GatewayApp:
    """The gateway's ASGI application: a captured call (`POST` to a captured route) goes
    straight to its handler; every other request, and the lifespan, to the Starlette app
    behind it (`starlette`), which routes the rest.

    Profiled under 16 concurrent sessions, Starlette's middleware and router around each
    captured call (ten coroutine frames in, three wrappers around every `send`, a regex per
    route tried) were ~6% of the event loop's samples. Errors are the same either way: an
    `HttpError` is answered by the handler, anything else propagates to the server (which
    answers 500), as through Starlette's error middleware.
    """

    def __init__(self, gateway: Gateway, starlette: Starlette) -> None:
        self.gateway = gateway
        self.starlette = starlette
        self.state = starlette.state
        self._handlers = {kind: gateway.captured(kind) for kind in (CHAT, COMPLETIONS)}

    def route(self, path: str) -> tuple[str, str | None] | None:
        """(kind, rollout id from the path or None) of a captured route, else None."""
        kind = _CAPTURED_PATHS.get(path)
        if kind is not None:
            return kind, None
        if path.startswith(_ROLLOUTS):
            slash = path.find("/", len(_ROLLOUTS))
            kind = _CAPTURED_PATHS.get(path[slash:]) if slash > len(_ROLLOUTS) else None
            if kind is not None:
                return kind, path[len(_ROLLOUTS) : slash]
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = self.route(scope["path"])
            if route is not None:
                kind, rollout = route
                request = Request(scope, receive, send)
                response = await self._handlers[kind](request, rollout)
                await response(scope, receive, send)
                return
        await self.starlette(scope, receive, send)


def create_app(
    backend: Backend,
    config: GatewayConfig,
) -> GatewayApp:
    """The gateway as an ASGI application (closes `backend` at shutdown).

    Routes: `POST /rollouts/{rollout_id}/v1/chat/completions` and `.../v1/completions`
    (captured, with or without a trailing slash), `GET /rollouts/{rollout_id}/v1/models`, the
    same under `/v1/...` with the rollout in an `X-Rollout-Id` header (without one a call
    passes through uncaptured; a `.` or `..` path segment is refused),
    `GET /rollouts/{rollout_id}` (an operator summary) and `GET /healthz`.
    """
    gateway = Gateway(backend, config)

    def routed(kind: str) -> Callable[[Request], Awaitable[Response]]:
        # The captured routes' methods other than POST (405), and a root path, come here.
        handle = gateway.captured(kind)

        async def endpoint(request: Request) -> Response:
            return await handle(request, request.path_params.get("rollout_id"))

        return endpoint

    chat = routed(CHAT)
    completions = routed(COMPLETIONS)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway.client  # noqa: B018 - build the pooled client (its TLS context) before calls
        prepare_loop()  # the store's completion queue: its descriptor taken before any client's
        try:
            yield
        finally:
            await gateway.close()

    routes = [
        Route("/healthz", gateway.healthz, methods=["GET"]),
        Route("/rollouts/{rollout_id}/v1/chat/completions", chat, methods=["POST"]),
        Route("/rollouts/{rollout_id}/v1/completions", completions, methods=["POST"]),
        Route("/rollouts/{rollout_id}/v1/models", gateway.models, methods=["GET"]),
        Route("/rollouts/{rollout_id}", gateway.rollout_summary, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        # With a trailing slash, the same endpoints at the engine (which redirects there): the
        # same captured calls, never passed through uncaptured.
        Route("/rollouts/{rollout_id}/v1/chat/completions/", chat, methods=["POST"]),
        Route("/rollouts/{rollout_id}/v1/completions/", completions, methods=["POST"]),
        Route("/v1/chat/completions/", chat, methods=["POST"]),
        Route("/v1/completions/", completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/{path:path}", gateway.passthrough, methods=["GET", "POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return GatewayApp(gateway, app)
