"""The session's real inference engine (vLLM on CPU serving the tiny test model).

tests/conftest.py imports `vllm_engine` from here, so every test module can ask for it and the
whole session shares one server (it takes a minute or more to start and ~3 GB of memory).
It yields the started `tests.vllm_engine.VllmEngine`: `base_url` (the server's root URL),
`v1` (`base_url + "/v1"`), `model` (the served model name), `model_dir` / `tokenizer_dir` (the
Hugging Face directory with the tokenizer and its chat template) and `python` (the vLLM venv's
interpreter, which has `tokenizers` and `transformers`).

In CI (`CI=true`) or with `TOKENCAPTURE_REQUIRE_VLLM=1` (set by scripts/test.sh) an engine that
cannot start fails the tests that need it; elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from tests.vllm_engine import EngineUnavailable, VllmEngine

__all__ = ["require_vllm", "unavailable", "vllm_engine"]


def require_vllm() -> bool:
    """Whether a missing engine must fail the run (CI) rather than skip."""
    return (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("TOKENCAPTURE_REQUIRE_VLLM") == "1"
    )


def unavailable(reason: str) -> None:
    """Fail (CI) or skip (elsewhere) a test that needs an engine it cannot have."""
    if require_vllm():
        pytest.fail(f"vLLM is required here but unavailable: {reason}")
    pytest.skip(f"vLLM unavailable: {reason}")


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[VllmEngine]:
    """vLLM serving the tiny model for the whole session (stopped and removed at the end)."""
    try:
        engine = VllmEngine()
    except (EngineUnavailable, OSError) as exc:
        unavailable(str(exc))
        raise  # unreachable: unavailable raises
    try:
        engine.start()
    except (EngineUnavailable, OSError) as exc:
        engine.cleanup()
        unavailable(str(exc))
    try:
        yield engine
    finally:
        engine.cleanup()
