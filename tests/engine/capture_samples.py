"""Record real answers of the engine into tests/engine/samples/ (what a fake upstream mimics).

    python tests/engine/capture_samples.py        # from the repository root, the test venv

starts the engine with the harness (tests/vllm_engine.py), sends each request below and writes
one JSON file per request: `{"request": ..., "status": ..., "response": ...}`, or for a
stream `{"request": ..., "status": ..., "events": [...]}` (each server-sent event's data in
order, the final "[DONE]" included). Ids and timestamps differ from run to run; the shapes and,
the model being deterministic, the token ids and log-probs do not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.vllm_engine import TOOLS, VllmEngine, post_json, post_stream  # noqa: E402

SAMPLES = Path(__file__).resolve().parent / "samples"

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]


def requests(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    common = {"model": model, "temperature": 0.0, "return_token_ids": True}
    chat = {**common, "messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    completion = {**common, "prompt": "The weather in Paris is", "max_tokens": 6, "logprobs": 1}
    return {
        "chat": ("chat/completions", chat),
        "chat_stream": (
            "chat/completions",
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
        ),
        "completions": ("completions", completion),
        "completions_token_prompt": (
            "completions",
            {**completion, "prompt": [1, 561, 201, 488, 262, 283, 329, 312, 414, 2, 201]},
        ),
        "completions_stream": ("completions", {**completion, "stream": True}),
        "chat_tools": (
            "chat/completions",
            {**common, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "logprobs": True},
        ),
        "error_prompt_too_long": ("completions", {"model": model, "prompt": [5] * 2100}),
        "error_unknown_model": (
            "chat/completions",
            {"model": "no-such-model", "messages": MESSAGES, "max_tokens": 1},
        ),
    }


def main() -> None:
    SAMPLES.mkdir(exist_ok=True)
    with VllmEngine() as engine:
        for name, (route, body) in requests(engine.model).items():
            url = f"{engine.v1}/{route}"
            record: dict[str, Any] = {"route": f"/v1/{route}", "request": body}
            if body.get("stream"):
                record["status"], record["events"] = post_stream(url, body)
            else:
                answer = post_json(url, body)
                record["status"], record["response"] = answer.status, answer.json()
            path = SAMPLES / f"{name}.json"
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
            print(path, record["status"])


if __name__ == "__main__":
    main()
