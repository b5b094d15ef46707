"""Configuration entry points: read NeMo Gym's `token_id_capture` block and build the store.

The block is validated by NeMo Gym 0.7.0's rules, so a configuration means the same thing to
both: capture is off unless `enabled` is true (a pydantic bool: `"false"`, `"0"` and `"off"`
are false), a key the block does not know is refused (a typo must not turn capture off
silently), an enabled block with neither a directory nor a sink is refused, and a directory
must be absolute (`~` is not expanded). Errors are pydantic `ValidationError`s, which are
`ValueError`s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokencapture.protocols import installed_lineage_store, installed_token_sink
from tokencapture.store import TokenCaptureStore

__all__ = ["TokenIdCaptureConfig", "TokenIdCaptureSettings", "make_token_store"]

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


def make_token_store(global_config_dict: Any) -> TokenCaptureStore | None:
    """Build the training-token file store from a NeMo Gym global config (None: an empty one).

    The block is validated as NeMo Gym validates it (see the module's doc). Returns None when
    capture is disabled, when a custom sink owns the records, or when no directory resolves.
    """
    config = TokenIdCaptureConfig.model_validate(
        {} if global_config_dict is None else global_config_dict
    )
    if not config.enabled or config.token_id_capture.sink is not None:
        return None
    directory = config.resolved_dir()
    return TokenCaptureStore(directory) if directory is not None else None
