"""NeMo Gym's `token_id_capture` configuration block, validated by NeMo Gym 0.7.0's rules.

A configuration means the same thing to both: capture is off unless `enabled` is true (a
pydantic bool: `"false"`, `"0"` and `"off"` are false), a key the block does not know is
refused (a typo must not turn capture off silently), an enabled block with neither a directory
nor a sink is refused, and a directory must be absolute (`~` is not expanded). Errors are
pydantic `ValidationError`s, which are `ValueError`s. `tokencapture.config` builds the store
from it.
"""

from __future__ import annotations

import logging
import os
from importlib import import_module
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokencapture.protocols import (
    LineageResolver,
    TokenSink,
    installed_lineage_store,
    installed_token_sink,
)

__all__ = ["TokenIdCaptureConfig", "TokenIdCaptureSettings"]

logger = logging.getLogger(__name__)


class TokenIdCaptureSettings(BaseModel):
    """The `token_id_capture` block: NeMo Gym 0.7.0's keys, types and defaults."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    all_agents: bool = False
    dir: Path | None = None
    sink: str | None = None
    sink_kwargs: dict[str, Any] = Field(default_factory=dict)
    lineage_store: str | None = None
    lineage_store_kwargs: dict[str, Any] = Field(default_factory=dict)
    rebuild_response: bool = True
    allow_unresolved_continuations: bool = False
    delta_records: bool = False
    max_mask_fraction: float | None = None
    mask_fraction_min_samples: int = 50
    external_staging: bool = False
    external_staging_backend: Literal["vllm_worker", "megatron_worker"] = "vllm_worker"
    control_auth_token_env: str = Field(
        default="NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN", min_length=1
    )

    def resolve_control_auth_token(self) -> str:
        """The manifest routes' bearer token, read from the environment variable
        `control_auth_token_env` names (kept out of any serialized config)."""
        token = os.environ.get(self.control_auth_token_env)
        if not token:
            raise ValueError(
                "token_id_capture.external_staging needs a control bearer token in the "
                f"environment variable {self.control_auth_token_env}"
            )
        return token


class TokenIdCaptureConfig(BaseModel):
    """A global config as capture reads it: the block, and the top-level directory key it
    falls back to (other top-level keys are the rest of the run's and are ignored)."""

    model_config = ConfigDict(extra="ignore")

    token_id_capture: TokenIdCaptureSettings = Field(default_factory=TokenIdCaptureSettings)
    model_call_capture_dir: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.token_id_capture.enabled

    def resolved_dir(self) -> Path | None:
        """The file store's directory: the block's `dir`, else `model_call_capture_dir`."""
        return self.token_id_capture.dir or self.model_call_capture_dir

    def build_sink(self) -> TokenSink | None:
        """The configured sink (`sink`: ``"module.path:ClassName"`` built with `sink_kwargs`),
        checked against `TokenSink`; None when capture is off or the file store is in use.
        Call it once in each server process."""
        block = self.token_id_capture
        if not block.enabled or block.sink is None:
            return None
        endpoint: TokenSink = _build_endpoint(block.sink, block.sink_kwargs, TokenSink, "sink")
        return endpoint

    def build_lineage_store(self) -> LineageResolver | None:
        """The configured request-time lineage store (`lineage_store`, `lineage_store_kwargs`),
        checked against `LineageResolver`; None when capture is off or none is configured."""
        block = self.token_id_capture
        if not block.enabled or block.lineage_store is None:
            return None
        endpoint: LineageResolver = _build_endpoint(
            block.lineage_store, block.lineage_store_kwargs, LineageResolver, "lineage_store"
        )
        return endpoint

    @model_validator(mode="after")
    def _check(self) -> TokenIdCaptureConfig:
        block = self.token_id_capture
        if block.external_staging and not block.enabled:
            raise ValueError("token_id_capture.external_staging requires token_id_capture.enabled")
        if block.external_staging and block.rebuild_response:
            raise ValueError(
                "token_id_capture.external_staging requires rebuild_response=false (the "
                "framework that stages the tokens builds the training rows)"
            )
        if block.external_staging_backend == "megatron_worker" and not block.external_staging:
            raise ValueError("token_id_capture.external_staging_backend requires external_staging")
        if not block.enabled:
            return self  # a disabled block may keep inactive settings (templated configs)
        if block.sink is not None:
            if block.dir is not None:
                logger.warning(
                    "token_id_capture.dir is set beside token_id_capture.sink: the sink "
                    "replaces the file store, so nothing is written to %s",
                    block.dir,
                )
            _require_resolver(block)
            return self
        directory = self.resolved_dir()
        if directory is None:
            if installed_token_sink() is not None:  # a sink installed in code, no directory
                _require_resolver(block)
                return self
            if not block.rebuild_response:
                return self
            raise ValueError("token_id_capture is enabled but has neither a directory nor a sink")
        if not directory.is_absolute():
            raise ValueError(f"token capture directory must be absolute, got {str(directory)!r}")
        return self


def _require_resolver(block: TokenIdCaptureSettings) -> None:
    """A custom sink needs a lineage store over its records: without one no continuation
    resolves its parent and every multi-call rollout is masked (allowed only when asked)."""
    if block.lineage_store is not None or installed_lineage_store() is not None:
        return
    if block.allow_unresolved_continuations:
        logger.warning(
            "token_id_capture has a custom sink and no lineage_store: every continuation "
            "resolves UNRESOLVED and multi-call rollouts are masked"
        )
        return
    raise ValueError(
        "token_id_capture has a custom sink but no lineage_store: no continuation can resolve "
        "its parent, so every multi-call rollout would be masked. Configure "
        "token_id_capture.lineage_store on the sink's backend, or set "
        "token_id_capture.allow_unresolved_continuations: true to accept that"
    )


def _build_endpoint(target: str, kwargs: dict[str, Any], protocol: type, kind: str) -> Any:
    """`target` (``"module.path:ClassName"``) built with `kwargs`, refused with `ValueError`
    unless it has every method of `protocol` (a missing one would make incomplete capture
    look complete)."""
    if ":" not in target:
        raise ValueError(
            f"token_id_capture.{kind} must be 'module.path:ClassName' (got {target!r})"
        )
    module_path, _, class_name = target.partition(":")
    try:
        factory = getattr(import_module(module_path), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"could not load token_id_capture.{kind} {target!r}: {error}") from error
    try:
        endpoint = factory(**kwargs)
    except TypeError as error:
        raise ValueError(
            f"could not construct token_id_capture.{kind} {target!r} with {kind}_kwargs="
            f"{sorted(kwargs)}: {error}"
        ) from error
    methods = sorted(
        name for name, member in vars(protocol).items() if callable(member) and name[0] != "_"
    )
    missing = [name for name in methods if not callable(getattr(endpoint, name, None))]
    if missing or not isinstance(endpoint, protocol):
        raise ValueError(
            f"token_id_capture.{kind} {target!r} does not satisfy {protocol.__name__}: "
            f"{', '.join(missing) or 'attribute check failed'}"
        )
    return endpoint
