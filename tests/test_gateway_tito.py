"""Token-in-token-out (`--tito`) against the fake upstream in tokenizer mode: a locally trained
byte-level BPE with Qwen3's chat tokens, the `renderers` Qwen3 format, and pseudo-random
sampled ids (as a random-weight model samples them), which chat re-rendering does not keep."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.engine.tiny_model import ADDED, SPECIAL
from tests.fake_upstream import FakeUpstream, ThreadServer

from tokencapture import ParentResolutionStatus, TokenCaptureStore
from tokencapture.gateway import DIVERGED_REASON, GatewayConfig, create_app, open_backend
from tokencapture.gateway.tito import FALLBACK_FIELD, Bridge

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

    def __init__(self, root: Path, tokenizer_dir: Path, *, tito: bool) -> None:
        bridge = Bridge.from_tokenizer_dir(tokenizer_dir, "qwen3")
        self.fake = FakeUpstream(bridge=bridge)
        self.upstream = ThreadServer(self.fake.app)
        self.app = create_app(
            open_backend(store_dir=root),
            GatewayConfig(self.upstream.url, tito=bridge if tito else None),
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(self.app), base_url="http://gateway"
        )
        self.store = TokenCaptureStore(root)

    async def agent(self, rollout: str, turns: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a tool user."},
            {"role": "user", "content": "look up a number"},
        ]
        for turn in range(turns):
            answer = await self.client.post(
                f"/rollouts/{rollout}/v1/chat/completions",
                json={"model": "fake", "messages": messages, "tools": TOOLS},
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

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.state.gateway.close()
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
        "/rollouts/fb/v1/chat/completions", json={"model": "fake", "messages": messages}
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
        json={"model": "fake", "messages": messages, "tools": TOOLS, **extra},
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
        json={"model": "fake", "messages": messages, "tools": TOOLS, "tool_choice": "required"},
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
    body = {"model": "fake", "messages": messages, "tools": TOOLS, "return_token_ids": True}
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
