"""Golden vectors from the reference implementation (NeMo Gym 0.7.0)."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import GOLDEN, SHARED_GOLDEN, VENDORED_GOLDEN

from tokencapture import _core
from tokencapture.records import TokenEntry, compute_digest
from tokencapture.store import TokenCaptureStore, canonical_line

# NeMo Gym's staging vectors, vendored here only (see its README): not in shared/golden.
STAGING_ONLY = "nemo-gym-0.7.0-staging/"
TOKEN_VECTORS = json.loads((GOLDEN / "token_digests.json").read_text())
ENTRY_VECTORS = json.loads((GOLDEN / "entries.json").read_text())["vectors"]
STORE_EXPECTED = json.loads((GOLDEN / "store-0.7.0.expected.json").read_text())


@pytest.mark.skipif(not SHARED_GOLDEN.is_dir(), reason="no shared/golden next to the checkout")
def test_the_vendored_vectors_are_the_shared_ones() -> None:
    def files(root: Path) -> dict[str, bytes]:
        return {
            path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(root.rglob("*"))
            if path.is_file() and not path.relative_to(root).as_posix().startswith(STAGING_ONLY)
        }

    assert files(VENDORED_GOLDEN) == files(SHARED_GOLDEN)


@pytest.mark.parametrize(
    "vector", TOKEN_VECTORS["vectors"], ids=lambda v: f"len{len(v['token_ids'])}"
)
def test_token_digest_matches_golden(vector: dict[str, Any]) -> None:
    assert compute_digest(vector["token_ids"]) == vector["digest"]


@pytest.mark.parametrize(
    "vector", TOKEN_VECTORS["vectors"], ids=lambda v: f"len{len(v['token_ids'])}"
)
def test_token_digest_accepts_buffers(vector: dict[str, Any]) -> None:
    ids = vector["token_ids"]
    assert compute_digest(array("Q", ids)) == vector["digest"]
    assert compute_digest(tuple(ids)) == vector["digest"]
    assert compute_digest(iter(ids)) == vector["digest"]
    if all(i < 2**32 for i in ids):
        assert compute_digest(array("I", ids)) == vector["digest"]
        assert compute_digest(array("q", ids)) == vector["digest"]


def test_token_digest_accepts_numpy_arrays() -> None:
    np = pytest.importorskip("numpy")
    vector = max(TOKEN_VECTORS["vectors"], key=lambda v: len(v["token_ids"]))
    ids = vector["token_ids"]
    assert compute_digest(np.array(ids, dtype=np.uint64)) == vector["digest"]
    assert compute_digest(np.array(ids, dtype=np.int64)) == vector["digest"]
    with pytest.raises(ValueError, match="negative"):
        compute_digest(np.array([1, -2], dtype=np.int64))


@pytest.mark.parametrize("vector", TOKEN_VECTORS["rejected"], ids=lambda v: str(v["token_ids"]))
def test_token_digest_rejections(vector: dict[str, Any]) -> None:
    assert vector["error"] == "ValueError"
    with pytest.raises(ValueError):
        compute_digest(vector["token_ids"])


@pytest.mark.parametrize("vector", ENTRY_VECTORS, ids=lambda v: v["entry"]["model_call_id"])
def test_canonical_line_and_payload_digest(vector: dict[str, Any]) -> None:
    entry = TokenEntry.model_validate(vector["entry"])
    line = canonical_line(entry)
    assert line == vector["canonical_line"].encode()
    assert _core.payload_digest(line) == vector["payload_sha256"]


@pytest.mark.parametrize("vector", ENTRY_VECTORS, ids=lambda v: v["entry"]["model_call_id"])
def test_stored_line_is_byte_identical(tmp_path: Path, vector: dict[str, Any]) -> None:
    store = TokenCaptureStore(tmp_path)
    entry = TokenEntry.model_validate(vector["entry"])
    store.append(entry)
    assert (
        store.path_for(entry.rollout_id).read_bytes() == vector["canonical_line"].encode() + b"\n"
    )
    # A first put writes no state index (the log alone reads the same); a freeze writes it.
    assert not store.state_path_for(entry.rollout_id).exists()
    store.freeze_now(entry.rollout_id)
    state = json.loads(store.state_path_for(entry.rollout_id).read_bytes())
    assert state["entry_digests"] == {entry.model_call_id: vector["payload_sha256"]}


def test_foreign_pydantic_model_stores_identically(tmp_path: Path) -> None:
    from pydantic import BaseModel, ConfigDict

    class ForeignEntry(BaseModel):  # stands in for NeMo Gym's own TokenEntry
        model_config = ConfigDict(extra="allow")

    vector = ENTRY_VECTORS[0]
    store = TokenCaptureStore(tmp_path)
    store.append(ForeignEntry(**vector["entry"]))  # type: ignore[arg-type]
    store.append(dict(vector["entry"]))  # type: ignore[arg-type]
    rollout = vector["entry"]["rollout_id"]
    assert store.path_for(rollout).read_bytes() == vector["canonical_line"].encode() + b"\n"
    (entry,) = store.freeze_now(rollout).entries
    assert type(entry) is TokenEntry
    assert canonical_line(entry) == vector["canonical_line"].encode()


@pytest.mark.parametrize("rollout_id", sorted(STORE_EXPECTED))
def test_reference_directory_reads_correctly(golden_store: Path, rollout_id: str) -> None:
    expected = STORE_EXPECTED[rollout_id]
    store = TokenCaptureStore(golden_store)
    if expected.get("retired"):
        from tokencapture.protocols import TokenCaptureRetiredError

        with pytest.raises(TokenCaptureRetiredError):
            store.freeze_now(rollout_id)
        return
    snapshot = store.freeze_now(rollout_id)
    assert len(snapshot.entries) == expected["entry_count"]
    assert [e.model_call_id for e in snapshot.entries] == expected["model_call_ids"]
    assert snapshot.incomplete is expected["incomplete"]
    # Freezing again changes nothing, and the torn line is gone from the file.
    again = store.freeze_now(rollout_id)
    assert (again.snapshot_id, again.version) == (snapshot.snapshot_id, snapshot.version)
    assert store.path_for(rollout_id).read_bytes().endswith(b"\n")


def test_reference_directory_versions(golden_store: Path) -> None:
    store = TokenCaptureStore(golden_store)
    # golden-torn: state v2 covers two entries; call-3 is an unindexed tail (+1); freeze (+1).
    assert store.freeze_now("golden-torn").version == 4
    # golden-frozen was frozen by the reference: same snapshot id and version come back.
    frozen = store.freeze_now("golden-frozen")
    assert (frozen.snapshot_id, frozen.version) == ("d1ed2c8d0f8545ff87970edc0eafecc8", 2)
    # golden-r1: fully indexed at v3, so the first freeze is v4.
    assert store.freeze_now("golden-r1").version == 4
    # The extra field of call-3 round-trips.
    (entry,) = [e for e in store.freeze_now("golden-r1").entries if e.model_call_id == "call-3"]
    assert entry.model_extra == {"custom_extra_field": {"kept": True}}
