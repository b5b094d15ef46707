"""Token-in-token-out (`--tito`) against the fake upstream in tokenizer mode: a locally trained
byte-level BPE with Qwen3's chat tokens, the `renderers` Qwen3 format, and pseudo-random
sampled ids (as a random-weight model samples them), which chat re-rendering does not keep."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response
from tests.engine.tiny_model import ADDED, SPECIAL
from tests.fake_upstream import MODEL, FakeUpstream, ThreadServer

from tokencapture import ParentResolutionStatus, TokenCaptureStore
from tokencapture.gateway import DIVERGED_REASON, GatewayConfig, create_app, open_backend
from tokencapture.gateway.tito import FALLBACK_FIELD, Bridge, _about_context_length

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a number up",
            "parameters": {"type": "object", "properties": {"k": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "You may call one or more functions to assist with the user query.",
        '{"name": "lookup", "arguments": {"k": 12}}',
        "system user assistant tool the a number look up reply hello world",
    ] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens(ADDED)
    root = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return root


class Loop:
    """A gateway (tito on or off) over the tokenizer-mode fake, and an agent loop through it."""

    def __init__(
        self,
        root: Path,
        tokenizer_dir: Path,
        *,
        tito: bool,
        upstream: tuple[FakeUpstream, ThreadServer] | None = None,
        **fake: Any,
    ) -> None:
        bridge = Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3")
        if upstream is None:
            self.fake = FakeUpstream(bridge=bridge, **fake)
            self.upstream = ThreadServer(self.fake.app)
        else:  # another gateway over the same engine (and store): a restart
            self.fake, self.upstream = upstream
        self.app = create_app(
            open_backend(store_dir=root),
            GatewayConfig(self.upstream.url, tito=bridge if tito else None),
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway"
        )
        self.store = TokenCaptureStore(root)
        self.owns_upstream = upstream is None

    async def agent(self, rollout: str, turns: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a tool user."},
            {"role": "user", "content": "look up a number"},
        ]
        for turn in range(turns):
            answer = await self.client.post(
                f"/rollouts/{rollout}/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "tools": TOOLS},
                headers={"x-model-call-id": f"{rollout}-{turn}"},
            )
            assert answer.status_code == 200, answer.text
            message = answer.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or ():
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "7"})
            if not message.get("tool_calls"):
                messages.append({"role": "user", "content": f"and again ({turn})"})
        return messages

    async def call(
        self, rollout: str, messages: list[dict[str, Any]], call_id: str, **extra: Any
    ) -> tuple[dict[str, Any], Any]:
        """One chat call with `extra` parameters: its answer, and its entry."""
        answer = await self.client.post(
            f"/rollouts/{rollout}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, **extra},
            headers={"x-model-call-id": call_id},
        )
        assert answer.status_code == 200, answer.text
        [entry] = [e for e in self.store.read_entries(rollout) if e.model_call_id == call_id]
        return answer.json(), entry

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.gateway.close()
        if self.owns_upstream:
            self.upstream.stop()


@pytest.fixture
async def loops(tmp_path: Path, tokenizer_dir: Path) -> AsyncIterator[tuple[Loop, Loop]]:
    chat = Loop(tmp_path / "chat", tokenizer_dir, tito=False)
    tito = Loop(tmp_path / "tito", tokenizer_dir, tito=True)
    yield chat, tito
    await chat.close()
    await tito.close()


ROLLOUTS, TURNS = 8, 5


def test_tito_rests_on_renderers_public_api_at_the_pinned_version(tokenizer_dir: Path) -> None:
    """The bridge is made of renderers' public pieces (its `Tokenizer` and `Renderer`
    protocols), and the installed renderers is the one the gateway extra pins (a 0.x release
    may change that API: see pyproject.toml)."""
    import tomllib
    from importlib.metadata import version

    import renderers
    from packaging.requirements import Requirement

    bridge = Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3")
    assert isinstance(bridge.tokenizer, renderers.Tokenizer)
    assert isinstance(bridge.renderer, renderers.Renderer)
    assert isinstance(bridge.renderer, renderers.Qwen3Renderer)
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gateway"]
    [pin] = [Requirement(r) for r in extra if Requirement(r).name == "renderers"]
    assert pin.specifier.contains(version("renderers")), (pin, version("renderers"))
    assert not pin.specifier.contains("0.2.0")  # held below the next 0.x minor
    # The tokenizer's vocabulary as the fake upstream's sampler reads it: added tokens counted.
    assert (
        bridge.tokenizer.vocab_size
        == max(bridge.tokenizer.convert_tokens_to_ids(["</think>", "<|im_end|>"])) + 1
    )


async def test_agent_loop_drifts_through_chat_and_not_with_tito(loops: tuple[Loop, Loop]) -> None:
    chat, tito = loops
    for index in range(ROLLOUTS):
        await chat.agent(f"r{index}", TURNS)
        await tito.agent(f"r{index}", TURNS)
    drifted = resolved = 0
    for index in range(ROLLOUTS):
        for entry in chat.store.read_entries(f"r{index}")[1:]:
            drifted += entry.parent_resolution_reason == DIVERGED_REASON
        entries = tito.store.read_entries(f"r{index}")
        assert entries[0].parent_resolution is ParentResolutionStatus.ROOT
        for parent, entry in itertools.pairwise(entries):
            assert entry.parent_resolution is ParentResolutionStatus.RESOLVED, entry
            assert entry.parent_call_id == parent.model_call_id
            assert entry.prefix_requested and entry.prefix_supplied
            exact = parent.prompt_token_ids + parent.generation_token_ids
            assert entry.prompt_token_ids[: len(exact)] == exact
            assert FALLBACK_FIELD not in (entry.model_extra or {})
            resolved += 1
    continuations = ROLLOUTS * (TURNS - 1)
    print(f"without --tito {drifted} of {continuations} continuations drifted; with it 0")
    assert resolved == continuations
    assert drifted > 0  # the fake's sampled ids do not survive re-rendering
    # The tito calls went to the completions endpoint with the parent's tokens.
    assert sum(1 for r in tito.fake.requests if "prompt" in r) == continuations


async def test_tito_answers_in_chat_format_with_tool_calls(loops: tuple[Loop, Loop]) -> None:
    _, tito = loops
    messages = await tito.agent("one", 10)
    entries = tito.store.read_entries("one")
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert [e.output_items[0].get("tool_calls") or None for e in entries] == [
        m.get("tool_calls") or None for m in assistants
    ]
    assert [e.output_items[0]["content"] for e in entries] == [m["content"] for m in assistants]
    assert sum(1 for m in assistants[1:] if m.get("tool_calls")) >= 2


async def test_tito_falls_back_to_chat_and_records_why(loops: tuple[Loop, Loop]) -> None:
    _, tito = loops
    await tito.agent("fb", 1)
    # A continuation that the store never saw: unresolved, so no bridge.
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "invented"},
        {"role": "user", "content": "y"},
    ]
    answer = await tito.client.post(
        "/rollouts/fb/v1/chat/completions", json={"model": MODEL, "messages": messages}
    )
    assert answer.status_code == 200
    entry = tito.store.read_entries("fb")[-1]
    assert entry.parent_resolution is ParentResolutionStatus.UNRESOLVED
    assert entry.model_extra is not None
    assert entry.model_extra[FALLBACK_FIELD] == "parent_unresolved: no_match"
    assert entry.prefix_requested is False


async def test_tito_carries_the_completion_parameters_and_falls_back_for_chat_only_ones(
    loops: tuple[Loop, Loop],
) -> None:
    """A bridged continuation keeps the request's meaning: parameters the completions endpoint
    takes alike (logit bias, structured outputs, stop token ids) go with it; one it cannot
    honour (a forced tool choice is a grammar the chat endpoint builds from the tools) sends
    the call to chat, recorded. The answer's id is the id the entry keeps."""
    _, tito = loops
    messages = await tito.agent("p", 1)
    extra = {
        "logit_bias": {"5": 1.0},
        "structured_outputs": {"regex": "[a-z ]{1,8}"},
        "stop_token_ids": [7],
    }
    answer = await tito.client.post(
        "/rollouts/p/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": TOOLS, **extra},
        headers={"x-model-call-id": "bridged"},
    )
    assert answer.status_code == 200, answer.text
    sent = tito.fake.requests[-1]
    assert "prompt" in sent  # token in
    assert sent["logit_bias"] == extra["logit_bias"]
    assert sent["structured_outputs"] == extra["structured_outputs"]
    assert 7 in sent["stop_token_ids"]
    assert tito.fake.bridge is not None
    assert set(sent["stop_token_ids"]) >= set(tito.fake.bridge.stop_token_ids())
    entry = tito.store.read_entries("p")[-1]
    assert entry.prefix_requested
    assert entry.response_id == answer.json()["id"]

    forced = await tito.client.post(
        "/rollouts/p/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "required"},
        headers={"x-model-call-id": "forced"},
    )
    assert forced.status_code == 200, forced.text
    assert "messages" in tito.fake.requests[-1]  # went to chat
    entry = tito.store.read_entries("p")[-1]
    assert entry.model_extra is not None
    assert entry.model_extra[FALLBACK_FIELD] == "parameter_not_bridged: tool_choice"
    assert entry.prefix_requested is False


async def test_a_retry_of_a_tito_call_is_answered_from_the_store(
    loops: tuple[Loop, Loop],
) -> None:
    """A continuation sent as tokens to the completions endpoint, then retried with its call
    id after a lost answer: the stored entry answers in chat format (the parsed message, the
    `chatcmpl-` id, the tito prompt's tokens), and the engine sees no second request."""
    _, tito = loops
    messages = await tito.agent("rt", 2)
    url = "/rollouts/rt/v1/chat/completions"
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "return_token_ids": True}
    headers = {"x-model-call-id": "rt-2"}
    first = (await tito.client.post(url, json=body, headers=headers)).json()
    entry = tito.store.read_entries("rt")[-1]
    assert entry.prefix_requested  # went through the bridge
    seen = len(tito.fake.requests)
    again = (await tito.client.post(url, json=body, headers=headers)).json()
    assert len(tito.fake.requests) == seen
    assert (again["id"], again["prompt_token_ids"]) == (first["id"], first["prompt_token_ids"])
    choice, was = again["choices"][0], first["choices"][0]
    assert choice["token_ids"] == was["token_ids"] == entry.generation_token_ids
    for key in ("content", "tool_calls"):
        assert (choice["message"].get(key) or None) == (was["message"].get(key) or None), key
    assert len(tito.store.read_entries("rt")) == 3


def _fallback(entry: Any) -> str | None:
    reason: str | None = (entry.model_extra or {}).get(FALLBACK_FIELD)
    return reason


def _bridged(entry: Any) -> bool:
    return bool(entry.prefix_requested and _fallback(entry) is None)


async def _continued(loop: Loop, rollout: str, **root: Any) -> list[dict[str, Any]]:
    """A root call (with `root`'s parameters) and a new user turn: a conversation to continue."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a tool user."},
        {"role": "user", "content": "look up a number"},
    ]
    answer, _ = await loop.call(rollout, messages, f"{rollout}-root", **root)
    message = answer["choices"][0]["message"]
    return [*messages, message, {"role": "user", "content": "and again"}]


@pytest.fixture
async def tito(tmp_path: Path, tokenizer_dir: Path) -> AsyncIterator[Loop]:
    loop = Loop(tmp_path / "tito", tokenizer_dir, tito=True)
    yield loop
    await loop.close()


async def test_a_continuation_without_a_limit_may_use_the_rest_of_the_context(
    tito: Loop,
) -> None:
    """vLLM's completions endpoint limits a request without `max_tokens` to 16 tokens, its
    chat endpoint to the rest of the context: a bridged continuation without a limit is sent
    with `max_tokens` = the engine's `max_model_len` (its `GET /v1/models`, asked once) less
    the prompt; a limit the client gave is sent as given (`max_completion_tokens` first)."""
    messages = await _continued(tito, "m")
    _, entry = await tito.call("m", messages, "m-1")
    assert _bridged(entry)
    sent = tito.fake.requests[-1]
    assert "prompt" in sent
    assert sent["max_tokens"] == 2048 - len(sent["prompt"]) == 2048 - len(entry.prompt_token_ids)
    for index, (limits, expected) in enumerate(
        [
            ({"max_tokens": 7}, 7),
            ({"max_completion_tokens": 9, "max_tokens": 7}, 9),
            ({"max_completion_tokens": None, "max_tokens": 5}, 5),
        ]
    ):
        _, entry = await tito.call("m", messages, f"m-limit-{index}", **limits)
        assert _bridged(entry), entry
        assert tito.fake.requests[-1]["max_tokens"] == expected
    _, entry = await tito.call("m", messages, "m-again")
    assert _bridged(entry)
    assert tito.fake.models_calls == 1  # the context length is kept


async def test_a_refused_completion_makes_the_context_length_asked_again(tito: Loop) -> None:
    """The context length is kept from the engine's `GET /v1/models`; an engine restarted
    behind the same address with a smaller `--max-model-len` refuses the `max_tokens` made
    from the kept one (400, in vLLM's words: "This model's maximum context length is ...").
    That 400 is passed through (the call is not retried; it is marked, as any engine's
    error), and the kept length is dropped: the next call asks `/v1/models` again and is sent
    a `max_tokens` within the new context."""
    messages = await _continued(tito, "s")
    _, entry = await tito.call("s", messages, "s-1")
    assert _bridged(entry)
    prompt_len = len(entry.prompt_token_ids)
    assert tito.fake.requests[-1]["max_tokens"] == 2048 - prompt_len
    assert tito.fake.models_calls == 1

    tito.fake.max_model_len = prompt_len + 100  # restarted with a smaller context
    refused = await tito.client.post(
        "/rollouts/s/v1/chat/completions",
        json={"model": MODEL, "messages": messages},
        headers={"x-model-call-id": "s-2"},
    )
    assert refused.status_code == 400, refused.text
    assert "maximum context length" in refused.json()["message"]
    assert tito.fake.requests[-1]["max_tokens"] == 2048 - prompt_len  # the kept length's
    assert len(tito.fake.requests) == 3  # not retried
    assert tito.store.is_incomplete("s")
    assert [e.model_call_id for e in tito.store.read_entries("s")] == ["s-root", "s-1"]

    _, entry = await tito.call("s", messages, "s-3")
    assert _bridged(entry)
    assert tito.fake.models_calls == 2  # asked again
    assert tito.fake.requests[-1]["max_tokens"] == 100  # within the new context
    _, entry = await tito.call("s", messages, "s-4")
    assert tito.fake.models_calls == 2  # and kept again


class _StrictEngine(FakeUpstream):
    """The fake engine, refusing a completion with a negative temperature as vLLM does (its
    `SamplingParams` check, a 400): a client's own bad request, not about the context."""

    async def completions(self, request: Request) -> Response:
        temperature = orjson.loads(await request.body()).get("temperature")
        if isinstance(temperature, int | float) and temperature < 0:
            self.requests.append({"temperature": temperature})
            message = f"temperature must be non-negative, got {float(temperature)}."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return Response(orjson.dumps({"error": error}), 400, media_type="application/json")
        return await super().completions(request)


async def test_a_refusal_about_something_else_keeps_the_context_length(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A 400 that is not about the context length (the client's own bad parameter) is passed
    through and marked as any refusal, and the kept context length stays: the next call does
    not ask `GET /v1/models` again (one request to the engine per client error, not two)."""
    fake = _StrictEngine(bridge=Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3"))
    upstream = ThreadServer(fake.app)
    loop = Loop(tmp_path / "strict", tokenizer_dir, tito=True, upstream=(fake, upstream))
    try:
        messages = await _continued(loop, "k")
        _, entry = await loop.call("k", messages, "k-1")
        assert _bridged(entry)
        assert fake.models_calls == 1
        for attempt in range(3):
            refused = await loop.client.post(
                "/rollouts/k/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "temperature": -1},
                headers={"x-model-call-id": f"k-bad-{attempt}"},
            )
            assert refused.status_code == 400, refused.text
            assert "temperature" in refused.json()["error"]["message"]
            assert fake.requests[-1] == {"temperature": -1}  # refused by the completions route
        assert loop.store.is_incomplete("k")
        _, entry = await loop.call("k", messages, "k-2")
        assert _bridged(entry)
        assert fake.requests[-1]["max_tokens"] == 2048 - len(entry.prompt_token_ids)
        assert fake.models_calls == 1  # kept through the client's errors
    finally:
        await loop.close()
        upstream.stop()


@pytest.mark.parametrize(
    ("body", "forgotten"),
    [
        # vLLM's OpenAI server (`_validate_input`), old and new words, and its engine's.
        (
            b'{"object":"error","message":"This model\'s maximum context length is 2048 '
            b"tokens. However, you requested 2100 tokens (100 in the messages, 2000 in the "
            b'completion). Please reduce the length of the messages or completion."}',
            True,
        ),
        (
            b'{"error":{"message":"\'max_tokens\' or \'max_completion_tokens\' is too '
            b"large: 2000. This model's maximum context length is 2048 tokens and your request "
            b'has 100 input tokens (2000 > 2048 - 100).","code":400}}',
            True,
        ),
        (
            b'{"error":{"message":"The decoder prompt (length 3000) is longer than the maximum '
            b"model length of 2048. Make sure that `max_model_len` is no smaller than the "
            b'number of text tokens.","code":400}}',
            True,
        ),
        (b"MAX_MODEL_LEN exceeded", True),  # in any case
        (b"", True),  # nothing read (a broken body) or said: nothing tells it is not
        (b" \n", True),
        (b'{"error":{"message":"temperature must be non-negative, got -1.0."}}', False),
        (b'{"error":{"message":"Token id 999999 is out of vocabulary"}}', False),
        (b"x" * 70_000 + b"context length", False),  # only the body's head is looked at
    ],
)
def test_a_400_is_taken_for_one_about_the_context_length_by_its_words(
    body: bytes, forgotten: bool
) -> None:
    assert _about_context_length(body) is forgotten
    assert _about_context_length(memoryview(body)) is forgotten


async def test_a_continuation_without_a_limit_goes_to_chat_when_the_default_is_unknown(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """An engine whose model card has no `max_model_len` (another engine), or a model whose
    `generation_config.json` sets the chat endpoint's default (`max_new_tokens`): a call
    without a limit goes to chat, recorded; with one it is bridged."""
    other = Loop(tmp_path / "other", tokenizer_dir, tito=True, max_model_len=None)
    try:
        messages = await _continued(other, "u")
        _, entry = await other.call("u", messages, "u-1")
        assert _fallback(entry) == "max_tokens_unknown"
        assert not entry.prefix_requested
        assert "messages" in other.fake.requests[-1]
        _, entry = await other.call("u", messages, "u-2", max_tokens=8)
        assert _bridged(entry)
    finally:
        await other.close()
    configured = tmp_path / "configured"
    shutil.copytree(tokenizer_dir, configured)
    (configured / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100}))
    capped = Loop(tmp_path / "capped", configured, tito=True)
    try:
        messages = await _continued(capped, "g")
        _, entry = await capped.call("g", messages, "g-1")
        assert _fallback(entry) == (
            "max_tokens_unknown: the model's generation_config sets max_new_tokens"
        )
        _, entry = await capped.call("g", messages, "g-2", max_completion_tokens=8)
        assert _bridged(entry)
    finally:
        await capped.close()


async def test_stop_strings_and_top_logprobs_go_to_chat(tito: Loop) -> None:
    """Stop strings are matched on the chat endpoint's text (what it answers is cut there),
    and the completion names a token's alternatives by their text only: a call with either
    goes to chat, recorded. Empty ones, and `stop_token_ids` (exact on tokens), are bridged."""
    messages = await _continued(tito, "s")
    for index, (extra, reason) in enumerate(
        [
            ({"stop": ["e"]}, "parameter_not_bridged: stop"),
            ({"stop": "e"}, "parameter_not_bridged: stop"),
            ({"logprobs": True, "top_logprobs": 2}, "parameter_not_bridged: top_logprobs"),
            ({"stop": []}, None),
            ({"stop": None, "stop_token_ids": [9]}, None),
            ({"logprobs": True, "top_logprobs": 0}, None),
        ]
    ):
        _, entry = await tito.call("s", messages, f"s-{index}", max_tokens=8, **extra)
        assert _fallback(entry) == reason, extra
        assert entry.prefix_requested is (reason is None)


async def test_a_bridged_answers_logprobs_are_in_the_chat_endpoints_shape(tito: Loop) -> None:
    """Each log-prob item has the engine's token string, its UTF-8 `bytes` (null for a token
    the engine names `token_id:N`, as this fake does: vLLM's chat gives the decoded token's)
    and no alternatives; the answer's id is `chatcmpl-` + the completion's own, and the
    entry's."""
    messages = await _continued(tito, "lp")
    answer, entry = await tito.call("lp", messages, "lp-1", logprobs=True)
    assert _bridged(entry)
    items = answer["choices"][0]["logprobs"]["content"]
    assert [item["logprob"] for item in items] == entry.generation_log_probs
    assert [item["token"] for item in items] == [
        f"token_id:{t}" for t in entry.generation_token_ids
    ]
    assert all(item["bytes"] is None and item["top_logprobs"] == [] for item in items)
    assert list(items[0]) == ["token", "logprob", "bytes", "top_logprobs"]
    assert answer["id"] == entry.response_id
    assert answer["id"].startswith("chatcmpl-")
    assert not answer["id"].startswith("chatcmpl-cmpl-")


def test_logprob_items_carry_the_engines_token_text_and_its_bytes(tokenizer_dir: Path) -> None:
    from tokencapture.gateway.tito import _logprobs_content

    bridge = Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3")
    data = {"choices": [{"logprobs": {"tokens": ["é", " a", "token_id:7"]}}]}
    items = _logprobs_content(data, [5, 6, 7], [-0.5, -1.0, -2.0], bridge)
    assert items == [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": []},
        {"token": " a", "logprob": -1.0, "bytes": [32, 97], "top_logprobs": []},
        {"token": "token_id:7", "logprob": -2.0, "bytes": None, "top_logprobs": []},
    ]


# Parameters a bridged continuation honours as vLLM's chat endpoint does.
BRIDGED: list[dict[str, Any]] = [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[a-z]{3}"}},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "parallel_tool_calls": False},
    {"max_completion_tokens": 3},
    {"n": 1},
    {"logprobs": True, "top_logprobs": 0},
    {"seed": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1},
    {"presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1},
    {"logit_bias": {"5": 1.0}, "bad_words": ["x"], "allowed_token_ids": [5, 6, 7]},
    {"min_tokens": 1, "ignore_eos": False, "include_stop_str_in_output": False},
    {"user": "u", "priority": 0, "return_token_ids": True, "stream": False},
    {"echo": False, "add_generation_prompt": True, "continue_final_message": False},
    {"skip_special_tokens": True, "spaces_between_special_tokens": True},
    {"use_beam_search": False, "include_reasoning": True, "add_special_tokens": False},
    {"chat_template_kwargs": {}, "prompt_logprobs": None, "truncate_prompt_tokens": None},
]
# Parameters it cannot honour: the call goes to chat with `parameter_not_bridged: NAME`.
NOT_BRIDGED: list[dict[str, Any]] = [
    {"prompt_logprobs": 1},
    {"use_beam_search": True},
    {"truncate_prompt_tokens": 5},
    {"reasoning_effort": "low"},
    {"tools": TOOLS, "tool_choice": "none"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template": "{{ messages }}"},
    {"echo": True},
    {"add_generation_prompt": False},
    {"continue_final_message": True},
    {"skip_special_tokens": False},
    {"include_reasoning": False},
    {"echo": None},
    {"return_tokens_as_token_ids": True},
    {"logprob_token_ids": [5]},
    {"documents": [{"title": "t", "text": "x"}]},
    {"vllm_xargs": {"k": 1}},
    {"stream_options": {"include_usage": True}},
    {"some_future_parameter": 1},
]


async def test_only_the_parameters_the_bridge_honours_are_bridged(tito: Loop) -> None:
    """An allowlist: a parameter the bridge does not know sends the call to chat, recorded
    (`parameter_not_bridged: NAME`), rather than being dropped."""
    messages = await _continued(tito, "a", tools=TOOLS)
    for index, extra in enumerate(BRIDGED):
        body = {"tools": TOOLS, "max_tokens": 8, **extra}
        _, entry = await tito.call("a", messages, f"a-ok-{index}", **body)
        assert _bridged(entry), (extra, _fallback(entry))
        sent = tito.fake.requests[-1]
        assert "prompt" in sent
        for key in ("response_format", "structured_outputs", "seed", "logit_bias", "bad_words"):
            if key in extra:
                assert sent[key] == extra[key]
    for index, extra in enumerate(NOT_BRIDGED):
        body = {"tools": TOOLS, "max_tokens": 8, **extra}
        answer = await tito.client.post(
            "/rollouts/a/v1/chat/completions",
            json={"model": MODEL, "messages": messages, **body},
            headers={"x-model-call-id": f"a-no-{index}"},
        )
        assert answer.status_code == 200, answer.text
        [entry] = [e for e in tito.store.read_entries("a") if e.model_call_id == f"a-no-{index}"]
        [name] = [key for key in extra if key != "tools" or "tool_choice" not in extra]
        assert _fallback(entry) == f"parameter_not_bridged: {name}", extra
        assert not entry.prefix_requested
        assert "messages" in tito.fake.requests[-1]


def test_a_false_parallel_tool_calls_keeps_the_first_parsed_call(tokenizer_dir: Path) -> None:
    """As vLLM's chat endpoint answers `parallel_tool_calls: false` (`maybe_filter_parallel_
    tool_calls`): the first tool call only."""
    bridge = Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3")
    specs = [t["function"] for t in TOOLS]
    prompt = bridge.renderer.render_ids(
        [{"role": "user", "content": "x"}], tools=specs, add_generation_prompt=True
    )
    text = "".join(
        f'<tool_call>\n{{"name": "lookup", "arguments": {{"k": {k}}}}}\n</tool_call>'
        for k in (1, 2)
    )
    ids = bridge.tokenizer.encode(text + "<|im_end|>")
    both = bridge.message(ids, prompt, specs)
    first = bridge.message(ids, prompt, specs, parallel_tool_calls=False)
    assert [json.loads(c["function"]["arguments"]) for c in both["tool_calls"]] == [
        {"k": 1},
        {"k": 2},
    ]
    assert [json.loads(c["function"]["arguments"]) for c in first["tool_calls"]] == [{"k": 1}]


async def test_a_changed_tool_list_or_template_argument_goes_to_chat(
    tito: Loop, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The bridge renders the new messages only: the tools (and the template's arguments)
    stay those of the parent's prompt. A continuation whose tools differ from its parent's
    goes to chat (`tools_changed`), which renders the new list; one whose parent was rendered
    with template arguments it lacks, too (`render_parameters_changed`). The parent's digest
    is in its entry, so a restarted gateway decides alike; an entry without one (stored
    without --tito) is never extended (`parent_render_unknown`)."""
    more = [
        *TOOLS,
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    ]
    messages = await _continued(tito, "t", tools=TOOLS, max_tokens=8)
    _, parent = await tito.call("t", messages, "t-more", tools=more, max_tokens=8)
    assert _fallback(parent) == "tools_changed"
    assert "search" in tito.fake.bridge.tokenizer.decode(parent.prompt_token_ids)
    _, entry = await tito.call("t", messages, "t-none", max_tokens=8)
    assert _fallback(entry) == "tools_changed"
    _, entry = await tito.call("t", messages, "t-same", tools=TOOLS, max_tokens=8)
    assert _bridged(entry)
    # The continuation of the call that went to chat with the new list extends its prompt.
    grown = [*messages, parent.output_items[0], {"role": "user", "content": "more"}]
    _, entry = await tito.call("t", grown, "t-more-2", tools=more, max_tokens=8)
    assert _bridged(entry) and entry.parent_call_id == "t-more"

    kwargs = {"enable_thinking": False}
    messages = await _continued(tito, "k", chat_template_kwargs=kwargs, max_tokens=8)
    _, entry = await tito.call("k", messages, "k-1", max_tokens=8)
    assert _fallback(entry) == "render_parameters_changed"

    # A restarted gateway over the same store and engine.
    restarted = Loop(
        tmp_path / "tito", tokenizer_dir, tito=True, upstream=(tito.fake, tito.upstream)
    )
    try:
        messages = await _continued(tito, "r", tools=TOOLS, max_tokens=8)
        _, entry = await restarted.call("r", messages, "r-1", tools=TOOLS, max_tokens=8)
        assert _bridged(entry) and entry.parent_call_id == "r-root"
        _, entry = await restarted.call("r", messages, "r-2", tools=more, max_tokens=8)
        assert _fallback(entry) == "tools_changed"
    finally:
        await restarted.close()

    plain = Loop(tmp_path / "tito", tokenizer_dir, tito=False, upstream=(tito.fake, tito.upstream))
    try:
        messages = await _continued(plain, "p", tools=TOOLS, max_tokens=8)
    finally:
        await plain.close()
    _, entry = await tito.call("p", messages, "p-1", tools=TOOLS, max_tokens=8)
    assert _fallback(entry) == "parent_render_unknown"  # its parent resolved, no digest
    assert not entry.prefix_requested


class _ModelsAnswer:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        pass


class _ModelsEngine:
    """The part of a gateway `Bridge.context_length` uses, over an engine answering its
    `GET /v1/models` with `answers` in turn (then the last again); counts the requests."""

    def __init__(self, *answers: tuple[int, bytes]) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.config = type("Config", (), {"upstream": "http://engine:8000"})()

    async def request_upstream(self, method: str, url: str, **_: Any) -> _ModelsAnswer:
        assert (method, url) == ("GET", "/v1/models")
        self.asked += 1
        status, body = self.answers[min(self.asked, len(self.answers)) - 1]
        return _ModelsAnswer(status, body)

    def url(self, path: str) -> str:
        return path

    def _upstream_headers(self, request: object) -> dict[str, str]:
        return {}


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        ((404, b"Not Found"), True),  # an engine without the route: never says
        ((200, b"<html>"), True),  # a models route that is not vLLM's
        ((503, b"busy"), False),  # may say later: asked again, but not on every call
    ],
)
async def test_a_models_answer_that_says_nothing_is_not_asked_on_every_call(
    answer: tuple[int, bytes], kept: bool
) -> None:
    """A call without a limit asks the engine's `GET /v1/models` for its context length; an
    answer that says nothing was asked again on every such call (one more request to the
    engine, waited for, before each fallback to chat)."""
    engine = _ModelsEngine(answer)
    call = type("Call", (), {"gateway": engine, "request": None})()
    bridge = Bridge(renderer=None, tokenizer=None)
    for _ in range(5):
        assert await bridge.context_length(call, MODEL) is None
    assert engine.asked == 1
    if not kept:
        bridge._unknown_until.clear()  # the time to ask again has come
        assert await bridge.context_length(call, MODEL) is None
        assert engine.asked == 2
