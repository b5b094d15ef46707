"""Deterministic workload data shared by the micro benchmarks and `compare.py`.

Everything here runs before any timer starts: entries are built once, identically for every
implementation, from a seeded generator, so two runs write byte-identical logs.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from tokencapture.records import ParentResolutionStatus, TokenEntry, stamp_lineage

__all__ = [
    "VOCAB",
    "AgenticShape",
    "Conversations",
    "SmallShape",
    "agentic_rollouts",
    "conversation_rollouts",
    "import_numeric_libraries",
    "small_rollouts",
]

VOCAB = 151_936  # a Qwen-sized vocabulary: ids need five or six digits, as in production
CREATED_AT = 1_760_000_000.0


@dataclass(frozen=True, slots=True)
class SmallShape:
    """W1: many short calls (a chat or math environment)."""

    rollouts: int = 64
    calls: int = 16
    prompt_tokens: int = 256
    generated_tokens: int = 64
    in_flight: int = 32


@dataclass(frozen=True, slots=True)
class AgenticShape:
    """W2: long agentic rollouts whose full prompt grows by every turn."""

    rollouts: int = 16
    calls: int = 24
    first_prompt_tokens: int = 2_000
    new_tokens_per_turn: int = 600
    generated_tokens: int = 512
    in_flight: int = 16

    def final_prompt_tokens(self) -> int:
        turns = self.calls - 1
        return self.first_prompt_tokens + turns * (self.generated_tokens + self.new_tokens_per_turn)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _log_probs(rng: random.Random, n: int) -> list[float]:
    # Full-precision doubles, as a float32 log-prob widened to a Python float prints.
    return [-rng.expovariate(2.0) for _ in range(n)]


def small_rollouts(
    shape: SmallShape, *, prefix: str = "w1", seed: int = 1
) -> list[list[TokenEntry]]:
    """`shape.rollouts` lists of `shape.calls` independent short entries."""
    rng = random.Random(seed)
    rollouts: list[list[TokenEntry]] = []
    for r in range(shape.rollouts):
        rollout_id = f"{prefix}-r{r:04d}"
        calls = []
        for c in range(shape.calls):
            calls.append(
                TokenEntry(
                    rollout_id=rollout_id,
                    model_call_id=f"{rollout_id}-c{c:03d}",
                    model="bench-model",
                    prompt_token_ids=_ids(rng, shape.prompt_tokens),
                    generation_token_ids=_ids(rng, shape.generated_tokens),
                    generation_log_probs=_log_probs(rng, shape.generated_tokens),
                    created_at=CREATED_AT + r + c / 100,
                )
            )
        rollouts.append(calls)
    return rollouts


def agentic_rollouts(
    shape: AgenticShape, *, prefix: str = "w2", seed: int = 2
) -> list[list[TokenEntry]]:
    """Rollouts whose call k's prompt is call k-1's prompt + generation + new tokens.

    Prompts are full (not deltas). Each call is stamped with its lineage (`cum_len`, digest,
    parent) as a capture server would, so freezes read back realistic records.
    """
    rng = random.Random(seed)
    rollouts: list[list[TokenEntry]] = []
    for r in range(shape.rollouts):
        rollout_id = f"{prefix}-r{r:04d}"
        calls: list[TokenEntry] = []
        prompt = _ids(rng, shape.first_prompt_tokens)
        parent: str | None = None
        for c in range(shape.calls):
            generation = _ids(rng, shape.generated_tokens)
            entry = TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"{rollout_id}-c{c:03d}",
                model="bench-model",
                prompt_token_ids=prompt,
                generation_token_ids=generation,
                generation_log_probs=_log_probs(rng, shape.generated_tokens),
                created_at=CREATED_AT + r + c / 100,
            )
            stamp_lineage(
                entry,
                parent,
                parent_resolution=(
                    ParentResolutionStatus.ROOT
                    if parent is None
                    else ParentResolutionStatus.RESOLVED
                ),
            )
            calls.append(entry)
            parent = entry.model_call_id
            prompt = [*prompt, *generation, *_ids(rng, shape.new_tokens_per_turn)]
        rollouts.append(calls)
    return rollouts


# Conversations for lineage resolution (W4) ---------------------------------------------------


def _assistant_turn(rollout: int, call: int) -> list[dict[str, Any]]:
    """What call `call` generated: a short reasoning message and one tool call."""
    call_id = f"tool-{rollout}-{call}"
    return [
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"Step {call}: inspecting file {call}."}],
        },
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "read_file",
            "arguments": f'{{"path": "src/module_{call}.py", "limit": {100 + call}}}',
        },
    ]


def _tool_result(rollout: int, call: int) -> dict[str, Any]:
    return {
        "type": "function_call_output",
        "call_id": f"tool-{rollout}-{call}",
        "output": f"# module {call} of rollout {rollout}\n" + "x = 1\n" * 40,
    }


Items = list[dict[str, Any]]


@dataclass(slots=True)
class Conversations:
    """Agentic rollouts with the harness items around every call.

    `requests[r][c]` is the request that call `c` of rollout `r` answered; `continuations[r][c]`
    is the next request (that request, the call's output items and the tool result), which a
    resolver must resolve to call `c`. Entries carry `output_items` but no continuation
    fingerprint: the caller stamps them with the lineage module under test
    (`stamp_continuation(entry, requests[r][c])`).
    """

    rollouts: list[list[TokenEntry]]
    requests: list[list[Items]]
    continuations: list[list[Items]]


def conversation_rollouts(
    shape: AgenticShape, *, prefix: str = "w4", seed: int = 4
) -> Conversations:
    """`agentic_rollouts` with an agent conversation (messages, tool calls, tool results)."""
    rollouts = agentic_rollouts(shape, prefix=prefix, seed=seed)
    requests: list[list[Items]] = []
    continuations: list[list[Items]] = []
    for r, calls in enumerate(rollouts):
        request: Items = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"Fix the failing test in repository {r}."},
        ]
        asked: list[Items] = []
        following: list[Items] = []
        for c, entry in enumerate(calls):
            entry.output_items = _assistant_turn(r, c)
            entry.token_item_index = 0
            asked.append(request)
            request = [*request, *entry.output_items, _tool_result(r, c)]
            following.append(request)
        requests.append(asked)
        continuations.append(following)
    return Conversations(rollouts, requests, continuations)


def _other_threads_cpu_ticks() -> int:
    """CPU clock ticks (user + system) of this process's threads other than the caller."""
    me = threading.get_native_id()
    ticks = 0
    for task in os.listdir("/proc/self/task"):
        if int(task) == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks


def import_numeric_libraries(settle_s: float = 2.0) -> None:
    """Import numpy and pyarrow as a trainer has them: long before it reads (untimed).

    numpy's OpenBLAS starts a worker thread per core at import, which polls for work (a
    `sched_yield` loop) for ~50-80 ms on this machine before it sleeps (measured through
    `/proc/self/task`). A read timed right after the import shares one of the two cores with
    it for that long (the whole of a 16-rollout read), which a trainer, whose imports ran
    seconds earlier, never does. So wait, up to `settle_s`, until the process's other threads
    have used no CPU for three clock ticks' worth of polls; every column gets the same wait.
    """
    import numpy  # noqa: F401
    import pyarrow  # type: ignore[import-untyped]  # noqa: F401

    if not os.path.isdir("/proc/self/task"):
        return
    tick = 1 / os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + settle_s
    last, quiet = _other_threads_cpu_ticks(), 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(tick)
        now = _other_threads_cpu_ticks()
        quiet = quiet + 1 if now == last else 0
        last = now
