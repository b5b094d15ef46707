"""Configuration entry points: build the store from a NeMo Gym global config.

`make_token_store` reads the `token_id_capture` block as NeMo Gym 0.7.0 does
(`TokenIdCaptureConfig`, validated by its rules: see `tokencapture.capture_settings`).
"""

from tokencapture.capture_settings import TokenIdCaptureConfig, TokenIdCaptureSettings
from tokencapture.store import make_token_store

__all__ = ["TokenIdCaptureConfig", "TokenIdCaptureSettings", "make_token_store"]
