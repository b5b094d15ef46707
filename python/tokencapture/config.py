"""Configuration entry points: build the store from a NeMo Gym global config."""

from tokencapture.store import make_token_store

__all__ = ["make_token_store"]
