"""Shared test helpers: the golden vectors, entry factories and small comparison helpers."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest

# The session's vLLM engine, defined once here so that every module shares one server.
from tests.vllm_fixture import vllm_engine  # noqa: F401

from tokencapture.records import TokenEntry

# The reference implementation's test vectors: the shared copy next to the checkout when there
# is one (the source of truth), else the copy kept in the repository so that a lone clone runs
# the whole suite (`test_golden.py` checks the two are identical whenever both exist).
SHARED_GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"
VENDORED_GOLDEN = Path(__file__).resolve().parent / "golden"
GOLDEN = SHARED_GOLDEN if SHARED_GOLDEN.is_dir() else VENDORED_GOLDEN


def is_storable_call_id(text: str) -> bool:
    """Whether `put` accepts `text` (valid Unicode: no lone surrogates) as a call id: one line
    of the intents file as readers read it back (non-empty, no line break, no ASCII whitespace
    at either end)."""
    return (
        text != "" and "\n" not in text and "\r" not in text and text == text.strip(" \t\x0b\x0c")
    )


def make_entry(rollout_id: str = "r1", call: int | str = 1, **fields: Any) -> TokenEntry:
    """A small valid entry; `call` names it, other fields override the defaults."""
    call_id = call if isinstance(call, str) else f"call-{call}"
    seed = sum(call_id.encode())
    values: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "test-model",
        "prompt_token_ids": [seed, seed + 1, seed + 2],
        "generation_token_ids": [seed + 10, seed + 11],
        "generation_log_probs": [-0.5, -0.25],
        "created_at": 1700000000.0 + seed,
    }
    values.update(fields)
    return TokenEntry(**values)


def model_state(model: Any) -> tuple[Any, ...]:
    """Everything that makes a pydantic instance what it is: two instances with equal states
    are indistinguishable (what ``model_construct`` would build, compared field by field)."""
    return (
        type(model),
        list(model.__dict__.items()),
        model.__pydantic_fields_set__,
        model.__pydantic_extra__,
        model.__pydantic_private__,
    )


def sha(text: str) -> str:
    """The SHA-256 hex digest of `text` (a well-formed digest value for test records)."""
    return hashlib.sha256(text.encode()).hexdigest()


def resolution_answer(resolution: Any) -> Any:
    """A resolution (ours or NeMo Gym's) as plain comparable values: `(status, reason, match
    fields)`; a str (an error name some tests record instead) is returned as is."""
    if isinstance(resolution, str):
        return resolution
    match = resolution.match
    fields = None
    if match is not None:
        fields = (
            match.model_call_id,
            tuple(match.cumulative_token_ids),
            match.digest,
            tuple(match.staging_chain),
            match.prev_len,
            match.chain_hash,
        )
    return (str(resolution.status.value), resolution.reason, fields)


@pytest.fixture
def golden_store(tmp_path: Path) -> Path:
    """A writable copy of the directory the reference store wrote (shared/ is read-only)."""
    target = tmp_path / "golden-store"
    shutil.copytree(GOLDEN / "store-0.7.0", target)
    for path in target.iterdir():
        path.chmod(0o644)
    target.chmod(0o755)
    return target
