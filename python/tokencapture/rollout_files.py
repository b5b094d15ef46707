"""The names of a rollout's files in a file store's directory (NeMo Gym's layout), shared by the
native-backed store and the pure-Python reference so the two cannot drift apart."""

from __future__ import annotations

from pathlib import Path

from tokencapture.validation import validate_rollout_id


class RolloutFiles:
    """Path helpers for a store rooted at ``self._root``; every id is validated first."""

    _root: Path

    def _file(self, rollout_id: str, suffix: str) -> Path:
        return self._root / f"{validate_rollout_id(rollout_id)}.tokens.{suffix}"

    def path_for(self, rollout_id: str) -> Path:
        """The rollout's entry log."""
        return self._file(rollout_id, "jsonl")

    def state_path_for(self, rollout_id: str) -> Path:
        return self._file(rollout_id, "state.json")

    def intents_path_for(self, rollout_id: str) -> Path:
        """The durable per-call intent file."""
        return self._file(rollout_id, "intents")

    def incomplete_path_for(self, rollout_id: str) -> Path:
        """Sentinel marking that at least one call of this rollout failed to capture."""
        return self._file(rollout_id, "incomplete")

    def lock_path_for(self, rollout_id: str) -> Path:
        return self._file(rollout_id, "lock")
