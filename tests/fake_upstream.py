"""A fast, deterministic stand-in for a vLLM OpenAI server, answering in vLLM's JSON shapes.

Shapes (from vLLM's answers with `return_token_ids: true`): chat completions carry
`prompt_token_ids` at the top level and `token_ids` per choice, log-probs in
`choices[0].logprobs.content[j].logprob`; completions carry both id lists per choice and
`logprobs.token_logprobs`; a stream's first chunk carries the prompt ids (chat: top level;
completions: on the choice) and no generated ids, every later chunk its delta's `token_ids`.
Fields the request did not ask for are `null`, as vLLM sends them.

The "tokenizer" is bytes + 16, with ChatML specials: <|im_start|> 1, <|im_end|> 2,
<tool_call> 3, </tool_call> 4. The model answers `reply <k>` (k from the prompt), or a tool
call to the first tool when the request has tools and the last message is the user's.
`FakeUpstream(drift=True)` answers with surrounding spaces that its chat template strips when
it renders the assistant turn back: the next prompt no longer begins with what was sampled,
which is what a real engine's re-rendering does to continuations.

Per-request knobs in the body (a real vLLM ignores unknown fields too): `fake_status` (answer
with that status), `fake_delay` (seconds before answering; a client that disconnects
meanwhile makes it stop, as vLLM aborts such a request, and the request is kept in
`abandoned`), `fake_break_after` (a stream drops
the connection after that many chunks), `fake_no_token_ids` (answer as a non-vLLM server),
`fake_chunk_delay` (seconds between stream chunks), `fake_one_write` (a stream's chunks and
`[DONE]` all in one write: the engine ran ahead of the reader), `fake_reply` (the text the
model answers, one chunk per byte when streamed). The engine as a whole can be made to answer
otherwise without changing a request (a retry must be the same request to be replayed):
`FakeUpstream.reply`, set in the process or by `POST /fake/reply {"reply": TEXT or null}`, is
the text every chat call then answers (a body's `fake_reply` still wins).
A completion whose prompt and `max_tokens` pass `max_model_len` is refused with vLLM's 400.
Run it as a process with `python tests/fake_upstream.py PORT [--drift]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from tests import accounts
from tests.accounts import Account
from tests.engine.tiny_model import ADDED, SPECIAL

IM_START, IM_END, TOOL_START, TOOL_END = 1, 2, 3, 4
OFFSET = 16
MODEL = "fake-tiny"
# The chat tokens a sampling "model" never emits as text (tokenizer mode): Qwen3's, as the
# tests' tiny model has them.
QWEN3_SPECIALS = (*SPECIAL, *ADDED)


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", "replace")


def _args_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_message(message: dict[str, Any]) -> list[int]:
    """ChatML; an assistant turn's content is stripped, as Qwen-style templates do."""
    role = message.get("role", "user")
    content = _content_text(message.get("content"))
    ids = [IM_START, *encode(f"{role}\n")]
    if role == "assistant":
        ids += encode(content.strip())
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            body = f'{{"name":"{function.get("name")}","arguments":'
            ids += [
                TOOL_START,
                *encode(body + _args_text(function.get("arguments")) + "}"),
                TOOL_END,
            ]
    else:
        ids += encode(content)
    return [*ids, IM_END, *encode("\n")]


def render_chat(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for message in messages:
        ids += render_message(message)
    return [*ids, IM_START, *encode("assistant\n")]


def _tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _chat_logprobs(ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """A chat choice's (or delta's) `logprobs`, as vLLM sends them."""
    return {
        "content": [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": [t % 256], "top_logprobs": []}
            for t, lp in zip(ids, logprobs, strict=True)
        ]
    }


def _usage(prompt: list[int], ids: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + len(ids),
        "completion_tokens": len(ids),
    }


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _in_one_write(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The whole of `stream` as one body chunk (one write to the socket)."""
    yield b"".join([chunk async for chunk in stream])


class FakeUpstream:
    """The fake engine; `app` is its ASGI application. Counts the calls it answered."""

    def __init__(
        self,
        *,
        drift: bool = False,
        max_tokens: int = 64,
        bridge: Any = None,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        max_model_len: int | None = 2048,
    ) -> None:
        self.drift = drift
        # The context length its model card says (vLLM's `max_model_len`; None: a card
        # without it, as another engine's), and how often `GET /v1/models` was asked.
        self.max_model_len = max_model_len
        self.models_calls = 0
        # Called with each request's body as it arrives (a test looks at the store then).
        self.on_request = on_request
        self.bridge = bridge
        self.max_tokens = max_tokens
        self.calls = 0
        # The text every chat call answers, when set (see the module's docstring).
        self.reply: str | None = None
        self.requests: list[dict[str, Any]] = []
        # The requests whose client (the gateway) closed its connection while the engine
        # worked on them (`fake_delay`): the engine stopped, as vLLM aborts such a request.
        self.abandoned: list[dict[str, Any]] = []
        # Streams sent to the end, and streams that stopped early (the reader went away).
        self.streams_done = 0
        self.streams_cut = 0
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/fake/reply", self.set_reply, methods=["POST"]),
            ]
        )

    async def set_reply(self, request: Request) -> Response:
        reply = orjson.loads(await request.body()).get("reply")
        self.reply = None if reply is None else str(reply)
        return Response(b"", 204)

    async def health(self, request: Request) -> Response:
        return Response(b"", 200)

    async def models(self, request: Request) -> Response:
        self.models_calls += 1
        card: dict[str, Any] = {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        body = {"object": "list", "data": [card]}
        return Response(orjson.dumps(body), media_type="application/json")

    # The "model" ------------------------------------------------------------------------

    def _generate(
        self, prompt: list[int], tools: list[Any] | None, last_role: str | None
    ) -> tuple[list[int], str, dict[str, Any] | None]:
        k = zlib.crc32(bytes(t % 256 for t in prompt)) % 1000
        if tools and last_role == "user":
            name = (tools[0].get("function") or {}).get("name", "tool")
            arguments = orjson.dumps({"k": k}).decode()
            body = f'{{"name":"{name}","arguments":{arguments}}}'
            ids = [TOOL_START, *encode(body), TOOL_END, IM_END]
            return ids, "", _tool_call(name, arguments)
        text = f"  reply {k} " if self.drift else f"reply {k}"
        return [*encode(text), IM_END], text, None

    @staticmethod
    def _logprobs(ids: list[int]) -> list[float]:
        return [-0.25 - (index % 7) / 8 for index, _ in enumerate(ids)]

    async def _knobs(self, request: Request, body: dict[str, Any]) -> Response | None:
        delay = body.get("fake_delay")
        if delay and await self._left_during(request, float(delay)):
            self.abandoned.append(body)
            return Response(b"", 499)  # read by no one
        status = body.get("fake_status")
        if status:
            error = {
                "object": "error",
                "message": "fake failure",
                "type": "InternalServerError",
                "param": None,
                "code": status,
            }
            return Response(orjson.dumps(error), int(status), media_type="application/json")
        return None

    @staticmethod
    async def _left_during(request: Request, seconds: float) -> bool:
        """Wait `seconds` (the engine at work), unless the client disconnects first, as
        vLLM's server notices (its `with_cancellation`) and aborts the generation: True
        then."""

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        try:
            await asyncio.wait_for(gone(), seconds)
        except TimeoutError:
            return False
        return True

    def _over_the_context(self, prompt: list[int], max_tokens: object) -> Response | None:
        """vLLM's 400 for a request whose prompt and `max_tokens` pass the context length
        (`max_model_len`, as its model card says), else None."""
        if self.max_model_len is None or type(max_tokens) is not int:
            return None
        if len(prompt) + max_tokens <= self.max_model_len:
            return None
        error = {
            "object": "error",
            "message": (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            ),
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        return Response(orjson.dumps(error), 400, media_type="application/json")

    def _sample(self, prompt: list[int]) -> tuple[list[int], str, dict[str, Any] | None]:
        """Tokenizer mode: pseudo-random token ids (as a random-weight model samples them),
        and every other turn a Hermes-style tool call to `lookup`."""
        tokenizer = self.bridge.tokenizer
        # Qwen3's special tokens, by name (the renderer's own ids are its internals).
        special = dict(
            zip(
                QWEN3_SPECIALS,
                tokenizer.convert_tokens_to_ids(list(QWEN3_SPECIALS)),
                strict=True,
            )
        )
        rng = random.Random(zlib.crc32(orjson.dumps(prompt)))
        vocab = [t for t in range(tokenizer.vocab_size) if t not in special.values()]
        ids = [rng.choice(vocab) for _ in range(6)]
        text = tokenizer.decode(ids)
        call = None
        if rng.random() < 0.5:
            arguments = orjson.dumps({"k": rng.randrange(100)}).decode()
            block = f'\n{{"name": "lookup", "arguments": {arguments}}}\n'
            ids += [special["<tool_call>"], *tokenizer.encode(block), special["</tool_call>"]]
            call = _tool_call("lookup", arguments)
        return [*ids, special["<|im_end|>"]], text, call

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        if self.on_request is not None:
            self.on_request(body)
        refused = await self._knobs(request, body)
        if refused is not None:
            return refused
        self.calls += 1
        messages = body["messages"]
        tools = body.get("tools")
        if self.bridge is not None:
            specs = [t["function"] for t in tools] if tools else None
            prompt = self.bridge.renderer.render_ids(
                messages, tools=specs, add_generation_prompt=True
            )
            ids, text, call = self._sample(prompt)
        else:
            prompt = render_chat(messages)
            ids, text, call = self._generate(prompt, tools, messages[-1].get("role"))
        reply = body.get("fake_reply", self.reply)
        if reply is not None:
            text, call = str(reply), None
            ids = [*encode(text), IM_END]
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or self.max_tokens
        finish = "tool_calls" if call else "stop"
        if len(ids) > limit:
            ids, finish, call = ids[:limit], "length", None
            text = self.bridge.tokenizer.decode(ids) if self.bridge is not None else decode(ids)
        logprobs = self._logprobs(ids)
        want_ids = body.get("return_token_ids") is True
        want_lp = body.get("logprobs") is True
        no_ids = bool(body.get("fake_no_token_ids"))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            stream = self._chat_stream(
                rid,
                prompt,
                ids,
                logprobs,
                text,
                call,
                finish,
                want_ids,
                want_lp,
                body.get("fake_break_after"),
                body,
            )
            if body.get("fake_one_write"):
                stream = _in_one_write(stream)
            return StreamingResponse(self._tracked(stream), media_type="text/event-stream")
        message = {
            "role": "assistant",
            "content": None if call else text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [call] if call else [],
            "reasoning_content": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": _chat_logprobs(ids, logprobs) if want_lp else None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids if want_ids and not no_ids else None,
        }
        answer = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {**_usage(prompt, ids), "prompt_tokens_details": None},
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if want_ids and not no_ids else None,
            "kv_transfer_params": None,
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def _tracked(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except BaseException:
            self.streams_cut += 1
            raise
        self.streams_done += 1

    async def _chat_stream(
        self,
        rid: str,
        prompt: list[int],
        ids: list[int],
        logprobs: list[float],
        text: str,
        call: dict[str, Any] | None,
        finish: str,
        want_ids: bool,
        want_lp: bool,
        break_after: Any,
        body: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(choice: dict[str, Any], **top: Any) -> bytes:
            data = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": MODEL,
                "choices": [choice],
                **top,
            }
            return _event(data)

        sent = 0
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield chunk(first, prompt_token_ids=prompt if want_ids else None)
        sent += 1
        pieces: list[tuple[list[int], dict[str, Any]]]
        if call is not None:
            pieces = [
                (
                    ids[:-1],
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": call["id"],
                                "type": "function",
                                "function": call["function"],
                            }
                        ]
                    },
                )
            ]
            last = [ids[-1]]
        else:
            body_ids = ids[:-1] if ids and ids[-1] == IM_END else ids
            pieces = [([t], {"content": decode([t])}) for t in body_ids]
            last = ids[len(body_ids) :]
        position = 0
        for piece_ids, delta in pieces:
            if break_after is not None and sent >= int(break_after):
                raise ConnectionResetError("fake upstream broke the stream")
            lps = logprobs[position : position + len(piece_ids)]
            position += len(piece_ids)
            yield chunk(
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": _chat_logprobs(piece_ids, lps) if want_lp else None,
                    "finish_reason": None,
                    "token_ids": piece_ids if want_ids else None,
                }
            )
            sent += 1
            await asyncio.sleep(float(body.get("fake_chunk_delay") or 0))
        lps = logprobs[position:]
        yield chunk(
            {
                "index": 0,
                "delta": {"content": ""},
                "logprobs": _chat_logprobs(last, lps) if want_lp else None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": last if want_ids else None,
            }
        )
        if (body.get("stream_options") or {}).get("include_usage"):
            yield _event(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": MODEL,
                    "choices": [],
                    "usage": _usage(prompt, ids),
                }
            )
        await asyncio.sleep(float(body.get("fake_done_delay") or 0))
        yield b"data: [DONE]\n\n"

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        if self.on_request is not None:
            self.on_request(body)
        refused = await self._knobs(request, body)
        if refused is not None:
            return refused
        self.calls += 1
        prompt_in = body.get("prompt")
        prompt = list(prompt_in) if isinstance(prompt_in, list) else encode(str(prompt_in))
        too_long = self._over_the_context(prompt, body.get("max_tokens"))
        if too_long is not None:
            return too_long
        if self.bridge is not None:
            ids, _, _ = self._sample(prompt)
        else:
            ids, _, _ = self._generate(prompt, None, None)
        limit = body.get("max_tokens") or self.max_tokens
        finish = "stop"
        if len(ids) > limit:
            ids, finish = ids[:limit], "length"
        text = self.bridge.tokenizer.decode(ids) if self.bridge is not None else decode(ids)
        logprobs = self._logprobs(ids)
        want_ids = body.get("return_token_ids") is True
        want_lp = body.get("logprobs") is not None
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            return StreamingResponse(
                self._tracked(
                    self._completion_stream(rid, prompt, ids, logprobs, want_ids, want_lp)
                ),
                media_type="text/event-stream",
            )
        choice = {
            "index": 0,
            "text": text,
            "logprobs": {
                "text_offset": list(range(len(ids))),
                "token_logprobs": logprobs,
                "tokens": [f"token_id:{t}" for t in ids],
                "top_logprobs": [{} for _ in ids],
            }
            if want_lp
            else None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if want_ids else None,
            "token_ids": ids if want_ids else None,
        }
        answer = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
            "usage": _usage(prompt, ids),
            "kv_transfer_params": None,
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def _completion_stream(
        self,
        rid: str,
        prompt: list[int],
        ids: list[int],
        logprobs: list[float],
        want_ids: bool,
        want_lp: bool,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(choice: dict[str, Any]) -> bytes:
            data = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": MODEL,
                "choices": [choice],
            }
            return _event(data)

        yield chunk(
            {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
                "prompt_token_ids": prompt if want_ids else None,
            }
        )
        for index, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
            final = index == len(ids) - 1
            yield chunk(
                {
                    "index": 0,
                    "text": decode([token]),
                    "logprobs": {
                        "text_offset": [index],
                        "token_logprobs": [lp],
                        "tokens": [f"token_id:{token}"],
                        "top_logprobs": [{}],
                    }
                    if want_lp
                    else None,
                    "finish_reason": "stop" if final else None,
                    "stop_reason": None,
                    "token_ids": [token] if want_ids else None,
                }
            )
        yield b"data: [DONE]\n\n"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process on a loopback port: the fake upstream or a gateway, started, waited
    for (its TCP port accepts), stopped or SIGKILLed. Its output goes to `log`. It runs as
    `runner` (tests/accounts.py) when given one: `start_fake` and `start_gateway` drop root.
    """

    def __init__(
        self,
        argv: list[str],
        port: int,
        log: Path,
        env: dict[str, str] | None = None,
        runner: Account | None = None,
    ) -> None:
        self.argv = argv
        self.port = port
        self.log = log
        self.env = {**os.environ, **(env or {})}
        if runner is not None and runner.drops_root:
            # Nothing of root's: its home (asyncpg looks for ~/.postgresql/ there) and a TMPDIR
            # under it are not readable to the account.
            self.env.update(HOME="/nonexistent", TMPDIR="/tmp")
        self.runner = runner
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Server:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                **(self.runner.popen() if self.runner is not None else {}),
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.argv[:3]} exited: {self.log.read_text()[-2000:]}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"{self.argv[:3]} not listening in {timeout}s: {self.log.read_text()[-2000:]}"
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class ThreadServer:
    """An ASGI app served by uvicorn on a loopback port from a thread of this process (its
    state, such as a `FakeUpstream`'s request log, stays inspectable)."""

    def __init__(self, app: Any, *, lifespan: str = "off") -> None:
        import threading

        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan=lifespan,  # type: ignore[arg-type]
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the threaded server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# Servers the tests start run as this account when the tests are root (CI is): the gateway
# writes its store as it, as a deployment would.
SERVER_ACCOUNT = "tokencapture-test"
_ROOT = Path(__file__).resolve().parent.parent
# Runs the module or script named by the first argument as `python -m` / `python script`
# would. Another interpreter gets a prelude that loads this venv's packages (its .pth files
# included: the editable tokencapture is one) and the repository root.
_RUN = (
    "import runpy, sys; target = sys.argv.pop(1); sys.argv[0] = target; "
    "runpy.run_path(target, run_name='__main__') if target.endswith('.py') "
    "else runpy.run_module(target, run_name='__main__', alter_sys=True)"
)
_runner: tuple[Account, list[str]] | None = None
RUNNER_REASON = ""  # why the servers run as the tests' own user, when they are root
# Where the servers' account finds this checkout's `python/` and `tests/`: the checkout, or a
# readable copy of them (`_readable_copy`) when the checkout is not (CI's clone under a 0700
# temporary directory, say).
_SOURCES = _ROOT


def _servers_venv(python: str) -> Path:
    """A venv of the gateway's runtime dependencies (pyproject's, with the gateway and
    postgres extras) for the servers' account, from the system interpreter `python`: made once
    in the machine-level cache beside the engine's (/var/cache/tokencapture), keyed by the
    requirement list, for a test environment (CI's) whose packages live under /root."""
    import fcntl
    import hashlib
    import tomllib

    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [*project["dependencies"], *extras["gateway"], *extras["postgres"]]
    key = hashlib.sha256("\n".join([python, *requirements]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TOKENCAPTURE_CACHE_DIR") or "/var/cache/tokencapture")
    venv = cache / f"test-servers-{Path(python).name}-{key}"
    stamp = venv / ".installed"
    if stamp.exists():
        return venv
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".test-servers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *requirements],
                check=True,
            )
            subprocess.run(["chmod", "-R", "a+rX", str(venv)], check=True)
            stamp.write_text(key)
    return venv


def _readable_copy() -> Path:
    """A copy, readable by every account, of what the servers import from this checkout: the
    installed `tokencapture` package (its compiled extension included) as `python/`, and the
    tests' Python modules as `tests/`. Removed when the tests exit."""
    import atexit
    import shutil

    import tokencapture

    copy = accounts.shared_tmpdir("tokencapture-servers-")
    atexit.register(shutil.rmtree, copy, True)
    skip = shutil.ignore_patterns("__pycache__")
    package = Path(tokencapture.__file__).parent
    shutil.copytree(package, copy / "python" / "tokencapture", ignore=skip)
    for module in [*_ROOT.glob("tests/*.py"), *_ROOT.glob("tests/engine/*.py")]:
        target = copy / module.relative_to(_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(module, target)
    subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
    return copy


def _probe(runner: Account, python: str, prelude: str) -> str:
    """'' when `python -c prelude...` imports the gateway and this module as `runner`, else
    its error."""
    probe = subprocess.run(
        [python, "-c", prelude + "import tokencapture.gateway.server, tests.fake_upstream"],
        capture_output=True,
        check=False,
        cwd="/",
        **runner.popen(),
    )
    return "" if probe.returncode == 0 else probe.stderr.decode(errors="replace")[-500:]


def server_runner() -> tuple[Account, list[str]]:
    """The account the test servers run as and the argv that runs a module or a script as it
    (`[*prefix, "tokencapture", ...]` or `[*prefix, "path/to/script.py", ...]`).

    As root: `tokencapture-test`, with the system's python3 of our minor version (our own
    interpreter may live under /root, which the account cannot read) loading this
    environment's site-packages, or, when the account cannot read those either, a venv of the
    runtime dependencies made for it (`_servers_venv`) and this checkout's `python/`; each
    after a probe that it imports the gateway as the account. Otherwise (and when not root)
    the tests' own user and interpreter, and `RUNNER_REASON` says why.
    """
    global _runner, RUNNER_REASON
    if _runner is not None:
        return _runner
    root_path = f"import sys; sys.path.insert(0, {str(_ROOT)!r}); "
    ours = (accounts.current(), [sys.executable, "-c", root_path + _RUN])
    _runner = ours
    if os.geteuid() != 0:
        return _runner
    import sysconfig

    try:
        runner = accounts.account(SERVER_ACCOUNT, create=True)
    except accounts.AccountUnavailable as exc:
        RUNNER_REASON = str(exc)
        return _runner
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = [
        python
        for python in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}")
        if Path(python).exists()
    ]
    if not pythons:
        RUNNER_REASON = f"no system python{version} to run the servers as {SERVER_ACCOUNT}"
        return _runner
    python = pythons[0]
    ours_site = (
        f"import site, sys; site.addsitedir({sysconfig.get_paths()['purelib']!r}); " + root_path
    )
    error = _probe(runner, python, ours_site)
    if not error:
        _runner = (runner, [python, "-c", ours_site + _RUN])
        return _runner
    try:
        venv = _servers_venv(python)
    except (OSError, subprocess.CalledProcessError) as exc:
        RUNNER_REASON = f"{error}; and no venv for the servers: {exc}"
        return _runner
    global _SOURCES
    venv_python = str(venv / "bin" / "python")
    for attempt in ("checkout", "copy"):
        sources = _ROOT if attempt == "checkout" else _readable_copy()
        checkout = f"import sys; sys.path[:0] = [{str(sources / 'python')!r}, {str(sources)!r}]; "
        venv_error = _probe(runner, venv_python, checkout)
        if not venv_error:
            _SOURCES = sources
            _runner = (runner, [venv_python, "-c", checkout + _RUN])
            return _runner
    RUNNER_REASON = f"{error}; with {venv} and a readable copy of the sources: {venv_error}"
    return _runner


def server_dir(prefix: str = "tokencapture-srv-") -> Path:
    """A new directory the test servers' account owns (for a gateway's store); remove it with
    `shutil.rmtree` when done."""
    runner, _ = server_runner()
    path = accounts.shared_tmpdir(prefix)
    runner.own(path)
    return path


@contextlib.contextmanager
def replying(url: str, text: str) -> Iterator[None]:
    """A fake engine process at `url` answers every chat call with `text` meanwhile (the
    engine would now answer otherwise, the request unchanged)."""
    import httpx

    httpx.post(f"{url}/fake/reply", json={"reply": text}, timeout=10).raise_for_status()
    try:
        yield
    finally:
        httpx.post(f"{url}/fake/reply", json={"reply": None}, timeout=10).raise_for_status()


def start_fake(log_dir: Path, *, drift: bool = False) -> Server:
    port = free_port()
    runner, python = server_runner()
    script = _SOURCES / Path(__file__).relative_to(_ROOT)  # after server_runner() chose it
    argv = [*python, str(script), str(port), *(["--drift"] if drift else [])]
    return Server(argv, port, log_dir / f"fake-{port}.log", runner=runner).start()


def converse_on_new_connections(
    gateway_url: str,
    rollout_id: str,
    turns: int,
    *,
    until: Callable[[], bool] | None = None,
    max_turns: int = 120,
) -> int:
    """Chat calls of one conversation through a gateway (call `c<turn>`, each continuing the
    conversation with the answer before it), every call on a connection of its own so that
    any of a gateway's worker processes may take it: `turns` calls, then more until `until()`
    holds (at most `max_turns` in all). The number of calls made."""
    import httpx

    messages: list[dict[str, Any]] = [{"role": "user", "content": "turn 0"}]
    turn = 0
    while turn < turns or (until is not None and not until()):
        assert turn < max_turns, f"{max_turns} calls and the condition still does not hold"
        answer = httpx.post(
            f"{gateway_url}/rollouts/{rollout_id}/v1/chat/completions",
            json={"model": MODEL, "messages": messages},
            headers={"x-model-call-id": f"c{turn}", "connection": "close"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        messages += [
            answer.json()["choices"][0]["message"],
            {"role": "user", "content": f"turn {turn + 1}"},
        ]
        turn += 1
    return turn


def start_gateway(
    upstream: str,
    store: Path | str,
    log_dir: Path,
    *extra: str,
    nofile: tuple[int, int] | None = None,
) -> Server:
    """`tokencapture gateway` on a free port over `store`: a directory (which the servers'
    account must be able to write: see `server_dir`), or a PostgreSQL DSN (a `postgresql://`
    string). `nofile`: its (soft, hard) descriptor limit, set by util-linux's `prlimit`."""
    port = free_port()
    runner, python = server_runner()
    if nofile is not None:
        python = ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--", *python]
    where = (
        ["--dsn", store]
        if isinstance(store, str) and store.startswith(("postgresql://", "postgres://"))
        else ["--store", str(store)]
    )
    argv = [
        *python,
        "tokencapture",
        "gateway",
        "--upstream",
        upstream,
        *where,
        "--port",
        str(port),
        *extra,
    ]
    return Server(argv, port, log_dir / f"gateway-{port}.log", runner=runner).start()


def main(argv: list[str]) -> None:
    import uvicorn

    port = int(argv[0])
    fake = FakeUpstream(drift="--drift" in argv)
    uvicorn.run(fake.app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
