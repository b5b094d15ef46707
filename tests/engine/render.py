"""Render conversations to token ids with the tiny model's chat template, outside the engine.

Runs in the vLLM venv (it needs `tokenizers` and `jinja2`), as a script:

    python tests/engine/render.py MODEL_DIR < requests.json > token_ids.json

where requests.json is a list of `{"messages": [...], "tools": [...] | null,
"add_generation_prompt": bool, "kwargs": {...}}` and the answer is the list of their token id
lists. The template is rendered with jinja2 in the sandbox and with the settings Hugging Face
chat templates use (trim_blocks, lstrip_blocks, a `tojson` that keeps non-ASCII), then encoded
with the `tokenizers` library (added tokens split out, no BOS/EOS added): an implementation
independent of the engine's own rendering (transformers' `apply_chat_template` in vLLM), so
that a test comparing the two checks the engine, not itself.

With `--decode` the input is a list of token id lists and the answer their texts (special
tokens kept). With `--renderers` the answer also holds what the `renderers` package's Qwen3
renderer gives for each request: `{"template": [...], "renderers": [...]}`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def render_template(model_dir: Path, requests: list[dict[str, Any]]) -> list[list[int]]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    template = env.from_string(config["chat_template"])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = []
    for request in requests:
        text = template.render(
            messages=request["messages"],
            tools=request.get("tools"),
            add_generation_prompt=request.get("add_generation_prompt", False),
            **request.get("kwargs", {}),
        )
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def render_renderers(model_dir: Path, requests: list[dict[str, Any]]) -> list[list[int]]:
    from renderers import Qwen3RendererConfig, create_renderer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = create_renderer(tokenizer, Qwen3RendererConfig())
    return [
        list(
            renderer.render_ids(
                request["messages"],
                tools=request.get("tools"),
                add_generation_prompt=request.get("add_generation_prompt", False),
            )
        )
        for request in requests
    ]


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 1:
        sys.exit("usage: python tests/engine/render.py [--renderers | --decode] MODEL_DIR < IN")
    model_dir = Path(args[0])
    requests = json.load(sys.stdin)
    if "--decode" in argv:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        json.dump(
            [tokenizer.decode(ids, skip_special_tokens=False) for ids in requests], sys.stdout
        )
        return
    template = render_template(model_dir, requests)
    if "--renderers" in argv:
        json.dump(
            {"template": template, "renderers": render_renderers(model_dir, requests)}, sys.stdout
        )
    else:
        json.dump(template, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
