"""Build the tests' tiny model: a 2-layer Llama with random weights and a locally trained
byte-level BPE tokenizer with Qwen3's chat-format tokens and a Qwen3-style chat template.

Test-only, no downloads, deterministic (fixed seeds: the same files byte for byte on every run).
It runs in the vLLM venv (it needs `tokenizers`, `numpy` and `safetensors`, which that venv
has); the harness (`tests/vllm_engine.py`) calls it as a script:

    python tests/engine/tiny_model.py OUT_DIR

and OUT_DIR receives a Hugging Face model directory: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json and
generation_config.json.

The tokenizer carries the special tokens of Qwen3's chat format (`<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` as special tokens; `<tool_call>`, `</tool_call>`,
`<tool_response>`, `</tool_response>`, `<think>`, `</think>` as added non-special tokens, as
Qwen3's own tokenizer has them), so that the `renderers` package's Qwen3 renderer works with it
(pass `Qwen3RendererConfig()` explicitly: its automatic choice matches the tokenizer's
`name_or_path` against hub names, and a local directory is none of them). The chat template
renders what that renderer renders for system, user, assistant (content, tool calls), tool
results and tools (checked by tests/test_vllm_engine.py against the engine's own rendering).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 20260101
VOCAB_SIZE = 1024  # the model's vocabulary = the tokenizer's, added tokens included
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 4
INTERMEDIATE = 512
MAX_POSITIONS = 2048

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that are text to the model (Qwen3 has them so: not stripped from output text).
ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# The chat template: Qwen3's chat format (ChatML with Hermes-style JSON tool calls), written to
# render exactly what renderers' Qwen3Renderer renders (with its default enable_thinking=True):
# - tools: one system block with the tool list (one JSON object per line) and the call format;
# - the last assistant message after the last real user query is wrapped in an (empty) think
#   block, as are earlier ones that carry reasoning_content;
# - consecutive tool results share one user block, each in <tool_response> tags;
# - the generation prompt is `<|im_start|>assistant\n` (`enable_thinking=false` adds the empty
#   think block, as Qwen3's template does).
CHAT_TEMPLATE = r"""
{%- set tools_header = TOOLS_HEADER -%}
{%- set tools_footer = TOOLS_FOOTER -%}
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part is mapping and part.text is string -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- tools_header -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- tools_footer + '<|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=messages | length - 1, found=false) -%}
{%- for message in messages | reverse -%}
    {%- set index = messages | length - 1 - loop.index0 -%}
    {%- set body = text(message.content) | trim -%}
    {%- if not ns.found and message.role == 'user'
          and not (body.startswith('<tool_response>') and body.endswith('</tool_response>')) -%}
        {%- set ns.found = true -%}
        {%- set ns.last_query = index -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = text(message.content) -%}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set before = content.split('</think>')[0] -%}
            {%- set reasoning = before.split('<think>')[-1].lstrip('\n').rstrip('\n') -%}
            {%- set content = content.split('</think>', 1)[1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- if not loop.first or content -%}{{- '\n' -}}{%- endif -%}
            {%- set function = call.function if call.function is defined else call -%}
            {{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' -}}
            {%- if function.arguments is string -%}{{- function.arguments -}}
            {%- else -%}{{- function.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = CHAT_TEMPLATE.replace("TOOLS_HEADER", json.dumps(_TOOLS_HEADER)).replace(
    "TOOLS_FOOTER", json.dumps(_TOOLS_FOOTER)
)

# The tokenizer's training text: English prose, chat-formatted turns and JSON tool calls, so
# that common words and the template's scaffolding become single tokens.
_PROSE = """
The quick brown fox jumps over the lazy dog. A training run collects rollouts from an agent
that talks to a model through an inference engine. Every call sends a prompt and receives a
completion; the trainer needs the exact token ids that were sampled, and the log probability
of each one. When the engine renders a conversation again, the tokens may change: a space,
a number, or a boolean written differently shifts every later token. Store the tokens once,
durably, before the answer goes back to the caller, and read them back for training.
What is the weather in Paris today? It is sunny and warm, twenty degrees. Please look up the
population of Berlin. The answer is 3.7 million people. Can you add 17 and 25? The sum is 42.
Hello! How can I help you today? Thank you, that is all. Goodbye and have a nice day.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 100 256 1024 2048 65536.
The system prompt says: you are a helpful assistant. Answer briefly and call tools when needed.
Reinforcement learning improves a policy from rewards: sample several attempts, score each
one, and move the weights toward the better answers. An environment returns observations,
tools return results, and a verifier decides whether the final answer is correct. Crashes
happen; a durable log survives them, and a reader never sees half of a record. Checkpoints,
shards, manifests and digests keep large runs honest. Engineers measure throughput, latency
and memory; they write tests that fail when behaviour changes, and they read the logs.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. January, February, March,
April, May, June, July, August, September, October, November and December. Red, green, blue,
yellow, orange, purple, black, white. North, south, east, west. Spring, summer, autumn, winter.
Questions start with who, what, where, when, why or how; answers should be short and clear.
Error: the request was too long. Warning: the connection was closed before the response.
"""
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def _corpus() -> list[str]:
    """The training text, in a fixed order."""
    calls = [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>',
    ]
    chat = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n" + calls[0] + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 20 degrees\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is sunny in Paris.<|im_end|>\n"
    )
    tools = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in _TOOLS)
    cities = ["Paris", "Berlin", "London", "Madrid", "Rome", "Tokyo", "Lisbon", "Vienna"]
    weather = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy"]
    facts = [
        f"The weather in {city} is {weather[i % len(weather)]}, {10 + 3 * i} degrees."
        for i, city in enumerate(cities)
    ]
    facts += [
        f"{a} plus {b} is {a + b}; {a} times {b} is {a * b}."
        for a in range(3, 40, 7)
        for b in range(2, 30, 9)
    ]
    facts += [json.dumps({"name": "get_weather", "arguments": {"city": city}}) for city in cities]
    return [_PROSE, chat, tools, *calls, *facts] * 4


def build_tokenizer() -> object:
    """The trained tokenizer (a `tokenizers.Tokenizer`)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED),
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {size} tokens, not {VOCAB_SIZE}: grow the corpus")
    return tokenizer


def _weights() -> dict[str, object]:
    import numpy as np

    rng = np.random.default_rng(SEED)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int) -> object:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    def ones(n: int) -> object:
        return np.ones(n, dtype=np.float32)

    tensors: dict[str, object] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = ones(HIDDEN)
        tensors[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    tensors["model.norm.weight"] = ones(HIDDEN)
    # Larger output weights than the rest: a peakier next-token distribution, so that greedy
    # choices are not near-ties that float rounding could flip.
    tensors["lm_head.weight"] = (normal(VOCAB_SIZE, HIDDEN) * 50).astype(np.float32)  # type: ignore[operator]
    return tensors


def build(out: Path) -> Path:
    """Write the model directory into `out` (created; must be empty or absent)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL + ADDED}  # type: ignore[attr-defined]
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]

    added_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL,
        }
        for t in SPECIAL + ADDED
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added_decoder,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
        },
    )
    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HIDDEN // HEADS,
            "hidden_act": "silu",
            "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": pad,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": "float32",
        },
    )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad},
    )
    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    return out


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/engine/tiny_model.py OUT_DIR")
    print(build(Path(sys.argv[1])))
