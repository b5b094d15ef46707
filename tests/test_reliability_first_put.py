"""A rollout's first puts write no state index (the log's `fdatasync` and the directory's
`fsync` are their only syncs). After a power cut the directory holds what those made durable:
the log (its acknowledged lines, maybe a torn line of a put in flight) and the lock, and no
state index. SPEC: a missing state index is a fresh rollout, so every reader folds the log and
nothing acknowledged is lost; a writer truncates the torn line and goes on."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import make_entry
from tests.nemo_oracle import import_nemo

from tokencapture.reference import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore, canonical_line

nemo_store = import_nemo("store")


def power_cut_image(store: TokenCaptureStore, rollout_id: str, target: Path) -> Path:
    """The directory as a power cut right after the last acknowledged put leaves it: only
    files whose data and names were synced (no state index among them)."""
    names = {path.name for path in store.root.iterdir()}
    assert names == {f"{rollout_id}.tokens.jsonl", f"{rollout_id}.tokens.lock"}, names
    shutil.copytree(store.root, target)
    return target


def tear(image: Path, rollout_id: str) -> None:
    """Add the torn line of a put that was in flight at the cut."""
    torn = canonical_line(make_entry(rollout_id, "in-flight"))[:40]
    with open(image / f"{rollout_id}.tokens.jsonl", "ab") as log:
        log.write(torn)


def test_acknowledged_first_puts_survive_a_power_cut_without_a_state_index(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path / "live")
    acknowledged = [make_entry("r", n) for n in range(1, 4)]
    for count, entry in enumerate(acknowledged, 1):
        store.append(entry)
        image = power_cut_image(store, "r", tmp_path / f"cut-{count}")
        kept = acknowledged[:count]
        # Every reader, ours, the reference and NeMo Gym's, folds the log from the start
        # (NeMo Gym's reader trips over a torn line, so it reads the image before the tear).
        nemo = nemo_store.TokenCaptureStore(image)
        assert [e.model_call_id for e in nemo.read_entries("r")] == [e.model_call_id for e in kept]
        tear(image, "r")
        assert TokenCaptureStore(image).read_entries("r") == kept
        assert ReferenceStore(image).read_entries("r") == kept
        # A writer after the restart truncates the torn line, goes on, and freezes it whole.
        after = TokenCaptureStore(image)
        after.append(make_entry("r", "after"))
        snapshot = after.freeze_now("r")
        assert [e.model_call_id for e in snapshot.entries] == [
            *(e.model_call_id for e in kept),
            "after",
        ]
        assert snapshot.version == count + 2 and not snapshot.incomplete
