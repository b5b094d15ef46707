"""The capture gateway in front of a real vLLM (CPU) serving the tiny random-weight model.

Every captured entry is compared with what the engine itself answered for the same request
(asked directly, greedy decoding being deterministic) and with what the gateway relayed.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.fake_upstream import free_port, server_dir, start_gateway
from tests.gateway_kills import run_kills
from tests.vllm_engine import TOOLS, VllmEngine, post_json, post_stream

from tokencapture import ParentResolutionStatus, TokenCaptureStore
from tokencapture.gateway import GatewayConfig, create_app, open_backend
from tokencapture.gateway.tito import Bridge

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


class Through:
    """An in-process gateway (tito optional) whose upstream is the real engine."""

    def __init__(
        self, engine: VllmEngine, root: Path, *, tito: bool = False, upstream: str | None = None
    ) -> None:
        self.engine = engine
        bridge = Bridge.from_tokenizer_dir(engine.tokenizer_dir) if tito else None
        self.app = create_app(
            open_backend(store_dir=root), GatewayConfig(upstream or engine.base_url, tito=bridge)
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway", timeout=300
        )
        self.store = TokenCaptureStore(root)

    async def post(self, route: str, rollout: str, body: dict[str, Any], call: str) -> Any:
        answer = await self.client.post(
            f"/rollouts/{rollout}/v1/{route}",
            json={"model": self.engine.model, **body},
            headers={"x-model-call-id": call},
        )
        assert answer.status_code == 200, answer.text
        return answer

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.gateway.close()


@pytest.fixture
async def through(vllm_engine: VllmEngine, tmp_path: Path) -> AsyncIterator[Through]:
    gateway = Through(vllm_engine, tmp_path / "store")
    yield gateway
    await gateway.close()


def _direct(engine: VllmEngine, route: str, body: dict[str, Any]) -> Any:
    answer = post_json(f"{engine.v1}/{route}", {"model": engine.model, **body})
    assert answer.status == 200, answer.text
    return answer.json()


def _chat_logprobs(choice: dict[str, Any]) -> list[float]:
    return [item["logprob"] for item in choice["logprobs"]["content"]]


async def test_chat_entry_is_the_engines_answer(through: Through) -> None:
    body = {
        "messages": [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    relayed = (await through.post("chat/completions", "c", body, "c1")).json()
    assert "prompt_token_ids" not in relayed
    assert "token_ids" not in relayed["choices"][0]
    assert "logprobs" not in relayed["choices"][0]
    direct = _direct(
        through.engine, "chat/completions", {**body, "return_token_ids": True, "logprobs": True}
    )
    [entry] = through.store.read_entries("c")
    assert entry.prompt_token_ids == direct["prompt_token_ids"]
    assert entry.generation_token_ids == direct["choices"][0]["token_ids"]
    assert entry.generation_log_probs == pytest.approx(
        _chat_logprobs(direct["choices"][0]), abs=1e-4
    )
    assert entry.output_items[0]["content"] == relayed["choices"][0]["message"]["content"]
    assert entry.response_id == relayed["id"]
    assert entry.model == through.engine.model


async def test_chat_with_token_fields_relays_exactly_what_was_stored(through: Through) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0.0,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    relayed = (await through.post("chat/completions", "t", body, "t1")).json()
    [entry] = through.store.read_entries("t")
    assert entry.prompt_token_ids == relayed["prompt_token_ids"]
    assert entry.generation_token_ids == relayed["choices"][0]["token_ids"]
    assert entry.generation_log_probs == _chat_logprobs(relayed["choices"][0])


async def test_completions_text_and_token_prompts(through: Through) -> None:
    text = {"prompt": "The weather in Paris", "max_tokens": 5, "temperature": 0.0}
    relayed = (await through.post("completions", "p", text, "p1")).json()
    assert "token_ids" not in relayed["choices"][0]
    direct = _direct(through.engine, "completions", {**text, "return_token_ids": True})
    tokens = {
        "prompt": direct["choices"][0]["prompt_token_ids"],
        "max_tokens": 5,
        "temperature": 0.0,
        "logprobs": 0,
    }
    relayed_tokens = (await through.post("completions", "p", tokens, "p2")).json()
    assert relayed_tokens["choices"][0]["logprobs"]["token_logprobs"]  # logprobs: 0 asks
    first, second = through.store.read_entries("p")
    assert first.prompt_token_ids == direct["choices"][0]["prompt_token_ids"]
    assert first.generation_token_ids == direct["choices"][0]["token_ids"]
    assert second.prompt_token_ids == direct["choices"][0]["prompt_token_ids"]
    assert second.generation_token_ids == direct["choices"][0]["token_ids"]
    assert second.generation_log_probs == relayed_tokens["choices"][0]["logprobs"]["token_logprobs"]


async def test_chat_stream_entry_is_the_streamed_tokens(through: Through) -> None:
    body = {
        "messages": [SYSTEM, {"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    answer = await through.post("chat/completions", "s", body, "s1")
    events = [e[6:] for e in answer.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    status, direct = post_stream(
        f"{through.engine.v1}/chat/completions", {"model": through.engine.model, **body}
    )
    assert status == 200
    direct_ids = [
        t for c in direct[:-1] for choice in c["choices"] for t in choice.get("token_ids") or []
    ]
    [entry] = through.store.read_entries("s")
    assert entry.prompt_token_ids == chunks[0]["prompt_token_ids"] == direct[0]["prompt_token_ids"]
    assert entry.generation_token_ids == streamed == direct_ids
    assert all("logprobs" not in choice for c in chunks for choice in c["choices"])
    assert len(entry.generation_log_probs) == len(streamed)


async def test_tools_request_entry_is_the_engines_answer(through: Through) -> None:
    """A request with tools (rendered into the prompt by the engine's template). The random
    model emits no parsable tool call (forcing one with a named tool_choice makes vLLM 0.32
    emit `<tool_call>` text whose arguments never close), so tool-call continuations are
    tested against the fake upstream with the same Qwen3 format (tests/test_gateway_tito.py)."""
    messages = [SYSTEM, {"role": "user", "content": "What is the weather in Paris today?"}]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0.0}
    relayed = (await through.post("chat/completions", "tools", body, "plain")).json()
    direct = _direct(through.engine, "chat/completions", {**body, "return_token_ids": True})
    [entry] = through.store.read_entries("tools")
    assert entry.prompt_token_ids == direct["prompt_token_ids"]
    assert entry.generation_token_ids == direct["choices"][0]["token_ids"]
    assert entry.output_items[0]["content"] == relayed["choices"][0]["message"]["content"]
    plain = _direct(
        through.engine, "chat/completions", {**body, "tools": None, "return_token_ids": True}
    )
    assert len(entry.prompt_token_ids) > len(plain["prompt_token_ids"])  # the tools block


# A regex grammar makes the random model write a Hermes tool call, which the engine's tool
# parser turns into `tool_calls` (a named tool_choice does not: see the test above).
TOOL_CALL_REGEX = (
    '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{1,6}"\\}\\}\\n'
    "</tool_call>"
)


async def test_engine_tool_calls_stream_and_not_are_captured_and_continued(
    through: Through,
) -> None:
    """Real tool calls from the engine, streamed and not: the entry holds the tool call the
    client received and the tokens it was sent; the continuation (with the tool's result) is
    RESOLVED exactly when its prompt extends the parent's tokens."""
    messages: list[dict[str, Any]] = [
        SYSTEM,
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    body = {
        "tools": TOOLS,
        "max_tokens": 60,
        "structured_outputs": {"regex": TOOL_CALL_REGEX},
        "return_token_ids": True,
        "logprobs": True,
    }
    relayed = (
        await through.post("chat/completions", "tc", {"messages": messages, **body}, "t1")
    ).json()
    message = relayed["choices"][0]["message"]
    [call] = message["tool_calls"]
    streamed = await through.post(
        "chat/completions", "tc2", {"messages": messages, "stream": True, **body}, "s1"
    )
    events = [e[6:] for e in streamed.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    streamed_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    first, streamed_entry = (
        through.store.read_entries("tc")[0],
        through.store.read_entries("tc2")[0],
    )
    assert first.generation_token_ids == relayed["choices"][0]["token_ids"]
    assert first.generation_log_probs == _chat_logprobs(relayed["choices"][0])
    assert first.output_items[0]["tool_calls"] == [
        {"id": call["id"], "type": "function", "function": call["function"]}
    ]
    assert streamed_entry.generation_token_ids == streamed_ids
    deltas = [
        tool for c in chunks for ch in c["choices"] for tool in ch["delta"].get("tool_calls") or []
    ]
    arguments = "".join(tool["function"].get("arguments") or "" for tool in deltas)
    assert json.loads(arguments)["city"]  # the client's streamed call, whole
    [streamed_call] = streamed_entry.output_items[0]["tool_calls"]
    assert streamed_call["function"] == {"name": "get_weather", "arguments": arguments}
    assert streamed_call["id"] == deltas[0]["id"]
    messages += [
        {"role": "assistant", "content": message["content"], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    await through.post(
        "chat/completions", "tc", {"messages": messages, "max_tokens": 4, "temperature": 0.0}, "t2"
    )
    child = through.store.read_entries("tc")[1]
    exact = first.prompt_token_ids + first.generation_token_ids
    extends = child.prompt_token_ids[: len(exact)] == exact
    if extends:
        assert child.parent_resolution is ParentResolutionStatus.RESOLVED
        assert child.parent_call_id == "t1"
    else:
        assert child.parent_resolution is ParentResolutionStatus.UNRESOLVED
        assert child.parent_resolution_reason == "prompt_diverged_from_parent_tokens"


async def test_completions_echo_entry_holds_the_generated_tokens_log_probs(
    through: Through,
) -> None:
    """With `echo`, vLLM's `token_logprobs` begin with the prompt's positions (the first null):
    captured, not refused (502) as an answer with a log-prob that is not a number, and the
    entry keeps the generated tokens' log-probs only, streamed or not."""
    body = {"prompt": "The weather in Paris", "max_tokens": 3, "echo": True, "logprobs": 0}
    relayed = (await through.post("completions", "echo", body, "e1")).json()
    await through.post("completions", "echo", {**body, "stream": True}, "e2")
    direct = _direct(through.engine, "completions", {**body, "return_token_ids": True})
    choice = direct["choices"][0]
    generated, prompt = choice["token_ids"], choice["prompt_token_ids"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + len(generated)
    assert relayed["choices"][0]["logprobs"]["token_logprobs"][0] is None  # relayed as is
    for entry in through.store.read_entries("echo"):
        assert entry.prompt_token_ids == prompt
        assert len(entry.generation_log_probs) == len(entry.generation_token_ids) == 3
    first = through.store.read_entries("echo")[0]
    assert first.generation_log_probs == relayed["choices"][0]["logprobs"]["token_logprobs"][-3:]
    assert not through.store.is_incomplete("echo")


async def test_engine_error_is_passed_through_and_marked(through: Through) -> None:
    body = {"messages": [{"role": "user", "content": "x " * 3000}], "max_tokens": 4}
    answer = await through.client.post(
        "/rollouts/err/v1/chat/completions",
        json={"model": through.engine.model, **body},
        headers={"x-model-call-id": "long"},
    )
    assert answer.status_code == 400
    assert through.store.read_entries("err") == []
    assert through.store.freeze_now("err").incomplete
    row = json.loads((through.store.root / "err.lineage.jsonl").read_text())
    assert row == {"failure_reason": "upstream_status_400", "model_call_id": "long"}


def test_client_disconnect_mid_stream_against_the_engine(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    base = server_dir()
    store_dir = base / "store"
    server = start_gateway(vllm_engine.base_url, store_dir, tmp_path)
    try:
        body = {
            "model": vllm_engine.model,
            "messages": [{"role": "user", "content": "A long story, please."}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.Client(timeout=120) as client,
            client.stream(
                "POST",
                f"{server.url}/rollouts/gone/v1/chat/completions",
                json=body,
                headers={"x-model-call-id": "left"},
            ) as answer,
        ):
            lines = answer.iter_lines()
            assert next(lines).startswith("data: ")
        store = TokenCaptureStore(store_dir)
        ledger = store_dir / "gone.lineage.jsonl"
        deadline = time.monotonic() + 30
        # The gateway marks the call incomplete, then records why: wait for both.
        while not (store.is_incomplete("gone") and ledger.exists()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert store.is_incomplete("gone")
        assert store.read_entries("gone") == []
        row = json.loads(ledger.read_text())
        assert row == {"failure_reason": "client_disconnected", "model_call_id": "left"}
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


ROLLOUTS, TURNS = 8, 5


async def _agent(gateway: Through, rollout: str) -> None:
    messages: list[dict[str, Any]] = [
        SYSTEM,
        {"role": "user", "content": f"Plan a trip, step {rollout}."},
    ]
    for turn in range(TURNS):
        body = {
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 1000 * int(rollout[1:]) + turn,
        }
        answer = (await gateway.post("chat/completions", rollout, body, f"{rollout}-{turn}")).json()
        message = answer["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"And then? ({turn})"})


async def test_agent_loop_drift_without_tito_and_none_with_it(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    chat = Through(vllm_engine, tmp_path / "chat")
    tito = Through(vllm_engine, tmp_path / "tito", tito=True)
    try:
        for index in range(ROLLOUTS):
            await _agent(chat, f"r{index}")
            await _agent(tito, f"r{index}")
        drifted = 0
        for index in range(ROLLOUTS):
            for entry in chat.store.read_entries(f"r{index}")[1:]:
                drifted += not entry.prefix_supplied
            entries = tito.store.read_entries(f"r{index}")
            for parent, entry in itertools.pairwise(entries):
                assert entry.parent_resolution is ParentResolutionStatus.RESOLVED, entry
                assert entry.parent_call_id == parent.model_call_id
                assert entry.prefix_requested and entry.prefix_supplied
                exact = parent.prompt_token_ids + parent.generation_token_ids
                assert entry.prompt_token_ids[: len(exact)] == exact
        continuations = ROLLOUTS * (TURNS - 1)
        print(
            f"\nreal vLLM, tiny model, {ROLLOUTS} rollouts x {TURNS} turns: without --tito "
            f"{drifted} of {continuations} continuations drifted; with --tito 0"
        )
    finally:
        await chat.close()
        await tito.close()


async def _tito_continuation(
    gateway: Through, rollout: str, user: str, **root: Any
) -> list[dict[str, Any]]:
    """A root call through `gateway` and a new user turn: the conversation to continue."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": user}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0.0, **root}
    answer = (await gateway.post("chat/completions", rollout, body, f"{rollout}-0")).json()
    message = answer["choices"][0]["message"]
    reply = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
    return [*messages, reply, {"role": "user", "content": "Go on."}]


TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def _entry(gateway: Through, rollout: str, call: str) -> Any:
    [entry] = [e for e in gateway.store.read_entries(rollout) if e.model_call_id == call]
    return entry


async def test_tito_continuation_without_max_tokens_runs_to_the_chat_endpoints_limit(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    """vLLM's completions endpoint stops a request without `max_tokens` at 16 tokens; its
    chat endpoint runs to the end of the context (`max_model_len` less the prompt). A bridged
    continuation without a limit runs as the chat endpoint would: the random model, greedy,
    to the end of the context (a long prompt keeps that short); the limit is the one the
    plain chat endpoint applies to a prompt of that length."""
    tito = Through(vllm_engine, tmp_path / "tito", tito=True)
    tokenizer = tito.app.state.gateway.config.tito.tokenizer
    # A user turn of ~1,750 tokens: the rest of the 2,048-token context is a few hundred.
    words = 1750 * 100 // len(tokenizer.encode("word " * 100))
    try:
        messages = await _tito_continuation(tito, "nomax", "word " * words)
        body = {"messages": messages, "temperature": 0.0}
        answer = (await tito.post("chat/completions", "nomax", body, "nomax-1")).json()
        entry = _entry(tito, "nomax", "nomax-1")
        assert entry.prefix_requested and entry.prefix_supplied
        usage, finish = answer["usage"], answer["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == len(entry.generation_token_ids) > 16
        # The chat endpoint, asked without a limit, ends at the end of the context alike.
        direct = _direct(
            vllm_engine,
            "chat/completions",
            {"messages": messages[:2], "temperature": 0.0},
        )
        for ended, counts in (
            (finish, usage),
            (direct["choices"][0]["finish_reason"], direct["usage"]),
        ):
            if ended == "length":
                assert counts["prompt_tokens"] + counts["completion_tokens"] == 2048
        assert finish == "length"  # the random model does not stop on its own here
    finally:
        await tito.close()


async def test_tito_sends_to_chat_what_a_completion_cannot_answer_alike(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    """Against the engine: stop strings, `top_logprobs`, a parameter the bridge does not know
    and a changed tool list go to the chat endpoint (recorded in `tito_fallback_reason`) and
    are answered as it answers them; a bridged answer's log-prob items carry the engine's
    token strings and their bytes, and its id is `chatcmpl-` + the completion's."""
    tito = Through(vllm_engine, tmp_path / "tito", tito=True)
    bridge = tito.app.state.gateway.config.tito
    try:
        messages = await _tito_continuation(tito, "fb", "Tell me a story", tools=TOOLS)
        base = {"messages": messages, "max_tokens": 12, "temperature": 0.0, "tools": TOOLS}
        cases: list[tuple[dict[str, Any], str | None]] = [
            ({"stop": ["e"]}, "parameter_not_bridged: stop"),
            ({"logprobs": True, "top_logprobs": 2}, "parameter_not_bridged: top_logprobs"),
            ({"prompt_logprobs": 1}, "parameter_not_bridged: prompt_logprobs"),
            ({"tools": [*TOOLS, TIME_TOOL]}, "tools_changed"),
            ({"logprobs": True}, None),
        ]
        for index, (extra, reason) in enumerate(cases):
            call = f"fb-{index + 1}"
            answer = (await tito.post("chat/completions", "fb", {**base, **extra}, call)).json()
            entry = _entry(tito, "fb", call)
            assert (entry.model_extra or {}).get("tito_fallback_reason") == reason, extra
            assert entry.prefix_requested is (reason is None)
            choice = answer["choices"][0]
            if "stop" in extra:
                assert "e" not in (choice["message"]["content"] or "")
            if extra.get("top_logprobs"):
                assert all(len(item["top_logprobs"]) == 2 for item in choice["logprobs"]["content"])
            if "tools" in extra:
                assert "get_time" in bridge.tokenizer.decode(entry.prompt_token_ids)
            if reason is None:
                assert answer["id"] == entry.response_id
                assert not answer["id"].startswith("chatcmpl-cmpl-")
                direct = _direct(
                    vllm_engine,
                    "completions",
                    {
                        "prompt": entry.prompt_token_ids,
                        "max_tokens": 12,
                        "temperature": 0.0,
                        "logprobs": 0,
                        "skip_special_tokens": False,
                        "stop_token_ids": bridge.stop_token_ids(),
                    },
                )
                tokens = direct["choices"][0]["logprobs"]["tokens"]
                items = choice["logprobs"]["content"]
                assert [item["token"] for item in items] == tokens
                assert [item["bytes"] for item in items] == [list(t.encode()) for t in tokens]
    finally:
        await tito.close()


VLLM_SESSIONS, VLLM_KILLS = 16, 6


def test_sigkill_under_concurrent_sessions_against_the_engine(
    vllm_engine: VllmEngine, tmp_path: Path
) -> None:
    """The fake upstream's SIGKILL test (tests/test_gateway_process.py, 20 kills) against the
    real engine, with fewer kills (6 rounds of 3-8 s: the CPU engine answers 16 sessions at a
    few dozen calls a second; ~400 calls acknowledged in all, ~4.5 min with the engine already
    started): every acknowledged call is stored with its answer's
    exact tokens; every stored call that was not acknowledged is whole: its prompt is exactly
    what the engine renders for its request (asked directly afterwards) and its generation is
    complete (one log-prob a token, at most max_tokens). The generated ids themselves are not
    compared with a later answer: under 16 concurrent sessions the engine batches differently,
    and the random-weight model's near-tied logits may then pick another token."""
    store_dir = server_dir()
    try:
        run = run_kills(
            vllm_engine.base_url,
            store_dir,
            tmp_path,
            model=vllm_engine.model,
            sessions=VLLM_SESSIONS,
            kills=VLLM_KILLS,
            seed=2607,
            window=(3.0, 8.0),
            body=lambda messages: {"max_tokens": 6, "temperature": 0.0},
            timeout=120.0,
        )
        # The load was real (the CPU engine answers ~10 calls a round).
        assert len(run.acknowledged) >= 5 * VLLM_KILLS
        run.check_acknowledged()
        for key, entry in run.unacknowledged.items():
            engine = _direct(vllm_engine, "chat/completions", run.sent[key])
            assert entry.prompt_token_ids == engine["prompt_token_ids"], key
            assert 1 <= len(entry.generation_token_ids) <= 6, key
            assert len(entry.generation_log_probs) == len(entry.generation_token_ids), key
        print(
            f"\nreal vLLM, {VLLM_KILLS} SIGKILLs under {VLLM_SESSIONS} sessions: "
            f"{len(run.acknowledged)} acknowledged calls, all stored; "
            f"{len(run.unacknowledged)} stored but unacknowledged, all whole"
        )
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


async def test_a_retry_after_a_lost_answer_is_replayed_not_resampled(
    through: Through, tmp_path: Path
) -> None:
    """A retry with the call id of a stored call, through a new gateway on the same store
    whose engine is unreachable (a dispatch would be a 502): the stored answer comes back,
    whole and streamed, with the engine's own id, tokens, log-probs, finish reason and token
    counts; nothing is marked. The same id with the first answer's first token banned is
    another request, which the engine would answer otherwise: a 409 conflict, refused before
    dispatch (so nothing is marked), not the stored answer."""
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
        "logprobs": True,
    }
    first = (await through.post("chat/completions", "rp", body, "rp1")).json()
    # The first answer was lost; the retry goes through a new gateway, whose engine is gone.
    lost = Through(through.engine, tmp_path / "store", upstream=f"http://127.0.0.1:{free_port()}")
    try:
        again = (await lost.post("chat/completions", "rp", body, "rp1")).json()
        assert (again["id"], again["model"]) == (first["id"], first["model"])
        assert again["prompt_token_ids"] == first["prompt_token_ids"]
        choice, was = again["choices"][0], first["choices"][0]
        assert choice["token_ids"] == was["token_ids"]
        assert choice["message"]["content"] == was["message"]["content"]
        assert choice["finish_reason"] == was["finish_reason"]
        assert _chat_logprobs(choice) == _chat_logprobs(was)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert again["usage"][key] == first["usage"][key], key
        answer = await lost.post("chat/completions", "rp", {**body, "stream": True}, "rp1")
        events = [e[6:] for e in answer.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert (
            "".join(c["delta"].get("content") or "" for c in choices) == was["message"]["content"]
        )
        assert [t for c in choices for t in c.get("token_ids") or []] == was["token_ids"]
        assert lost.app.state.gateway.metrics.snapshot()["replay"]["count"] == 2
    finally:
        await lost.close()
    [entry] = through.store.read_entries("rp")
    assert entry.generation_token_ids == was["token_ids"]
    assert not through.store.is_incomplete("rp")  # nothing marked by the replays
    # The tiny model is peaked: banning the first answer's first token changes the answer.
    banned = {**body, "logit_bias": {str(was["token_ids"][0]): -100}}
    other = _direct(through.engine, "chat/completions", banned)
    assert other["choices"][0]["token_ids"] != was["token_ids"]
    conflict = await through.client.post(
        "/rollouts/rp/v1/chat/completions",
        json={"model": through.engine.model, **banned},
        headers={"x-model-call-id": "rp1"},
    )
    assert conflict.status_code == 409, conflict.text
    assert conflict.json()["error"]["type"] == "model_call_id_conflict"
    assert through.store.read_entries("rp")[0].generation_token_ids == was["token_ids"]
    assert not through.store.freeze_now("rp").incomplete  # refused before any dispatch
