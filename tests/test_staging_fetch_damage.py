"""What a `FileStagingStore` fetch verifies: bytes damaged after the store indexed them, and
bytes damaged before a fresh store's first fetch with the frame's hashes recomputed.

The store indexes the segment first (its first fetch or ``keys()``) and the segment is
damaged afterwards, so each case reaches the fetch path's own checks: the row's checksum
(the only guard of a log-prob's low f64 bits, which NeMo Gym's float32 digest does not
see), the staging digest (checked even when the checksum was recomputed over the damage),
the extras digest of `fetch_records`, and that the row read is the row of the key asked
for. ``large`` chains are big enough that the
fetch verifies on a helper thread while it builds the snapshots (rust/src/split.rs).

A fresh store's first fetch serves its rows from the bytes its fold just read, the row's
checksum matched in the fold's one hash pass over each frame body: with the frame's content
hash recomputed over the damage (so the fold takes the frame as valid), the same checks must
still refuse it.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import model_state

from tokencapture import FileStagingStore, TokenCaptureCorruptionError
from tokencapture.conformance_staging import build_chain
from tokencapture.staging import records as models

HEADER_LEN = 56
CHECK_LEN = 16
EXTRAS = {"note": "xyz-extra", "weight": 0.75}
SIZES = {"small": (4, 4, 3), "large": (24, 450, 250)}


def _chain(tmp_path: Path, size: str) -> tuple[Path, list[Any]]:
    calls, prompt, generated = SIZES[size]
    records = build_chain(
        models,
        "r",
        calls,
        prompt_tokens=prompt,
        generated_tokens=generated,
        extras=EXTRAS,
    )
    store = FileStagingStore(tmp_path)
    for record in records:
        assert store.stage(record).ok
    (segment,) = [p for p in tmp_path.iterdir() if p.name.startswith("seg-")]
    return segment, records


def _rows(segment: Path) -> dict[str, tuple[int, int]]:
    """Each frame's row as (offset, length), by model_call_id."""
    data = segment.read_bytes()
    rows: dict[str, tuple[int, int]] = {}
    at = 8  # the segment magic
    while at + HEADER_LEN <= len(data):
        assert data[at : at + 4] == b"TCF2"
        row_len = struct.unpack_from("<I", data, at + 4)[0]
        att_len = struct.unpack_from("<Q", data, at + 8)[0]
        row_at = at + HEADER_LEN
        rows[_layout(data[row_at : row_at + row_len])["call_id"]] = (row_at, row_len)
        at = row_at + row_len + att_len
    return rows


def _layout(row: bytes) -> dict[str, Any]:
    """Offsets (within the row) of the fields the cases damage (rust/src/staging/row.rs)."""
    at = 4 + 3
    out: dict[str, Any] = {}
    for name in ("rollout_id", "call"):
        length = struct.unpack_from("<I", row, at)[0]
        out[f"{name}_at"] = at + 4
        if name == "call":
            out["call_id"] = row[at + 4 : at + 4 + length].decode()
        at += 4 + length
    if row[at] == 1:
        at += 1 + 4 + struct.unpack_from("<I", row, at + 1)[0]
    else:
        at += 1
    at += 1 + 4 * 8  # mode, prev_len, delta_len, cum_len, weight_version
    out["digest"] = at
    at += 4 * 32 + 8
    n = struct.unpack_from("<Q", row, at - 8)[0]
    out["ids"], out["masks"], out["log_probs"] = at, at + 8 * n, at + 9 * n
    out["n"] = n
    out["extras"] = at + 17 * n
    return out


def _patch(segment: Path, offset: int, new: bytes) -> None:
    with segment.open("r+b") as f:
        f.seek(offset)
        f.write(new)


def _damage(segment: Path, call_id: str, target: str, reseal: bool) -> None:
    """Flip one bit of `target` in the row of `call_id`; with `reseal`, recompute the row's
    checksum over the damage (so only the digests can catch it)."""
    row_at, row_len = _rows(segment)[call_id]
    row = bytearray(segment.read_bytes()[row_at : row_at + row_len])
    lay = _layout(bytes(row))
    n = lay["n"]
    if target == "token_id":
        row[lay["ids"] + 8 * (n - 1)] ^= 0x01
    elif target == "mask":  # a generated token's 1.0 becomes 0.0
        row[lay["masks"] + n - 1] ^= 0x01
    elif target == "log_prob":  # the lowest mantissa bit: the same float32
        at = lay["log_probs"] + 8 * (n - 1)
        before = struct.unpack_from("<d", row, at)[0]
        row[at] ^= 0x01
        after = struct.unpack_from("<d", row, at)[0]
        assert before != after and struct.pack("<f", before) == struct.pack("<f", after)
    elif target == "digest":
        row[lay["digest"] + 5] ^= 0x01
    elif target == "model_call_id":  # "call-1" -> "call-0": another key's id
        row[lay["call_at"] + 5] ^= 0x01
    elif target == "extras":
        at = bytes(row).index(b"xyz-extra")
        row[at] ^= 0x02
    else:
        raise AssertionError(target)
    if reseal:
        body = bytes(row[:-CHECK_LEN])
        row[-CHECK_LEN:] = hashlib.sha256(body).digest()[:CHECK_LEN]
    _patch(segment, row_at, bytes(row))


CASES = [
    # (target, recompute the checksum, fetch_records)
    ("token_id", False, False),
    ("token_id", True, False),
    ("mask", False, False),
    ("mask", True, False),
    ("log_prob", False, False),
    ("digest", False, False),
    ("digest", True, False),
    ("model_call_id", False, False),
    ("model_call_id", True, False),
    ("extras", False, True),
    ("extras", True, True),
]


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize(("target", "reseal", "records"), CASES)
def test_damage_after_indexing_raises_corruption(
    tmp_path: Path, size: str, target: str, reseal: bool, records: bool
) -> None:
    segment, chain = _chain(tmp_path, size)
    # The last call carries the extras; the others are damaged in the middle of the chain.
    victim = chain[-1] if target == "extras" else chain[len(chain) // 2]
    keys = [f"r/{record.model_call_id}" for record in chain]
    reader = FileStagingStore(tmp_path)  # indexed before the damage
    fetch = reader.fetch_records if records else reader.fetch
    assert len(fetch(keys)) == len(chain)
    _damage(segment, victim.model_call_id, target, reseal)
    with pytest.raises(TokenCaptureCorruptionError, match=f"r/{victim.model_call_id}"):
        fetch(keys)
    with pytest.raises(TokenCaptureCorruptionError):
        fetch([f"r/{victim.model_call_id}"])
    # The other rows still fetch.
    others = [key for key in keys if key != f"r/{victim.model_call_id}"]
    assert [s.model_call_id for s in fetch(others)] == [k.split("/")[1] for k in others]


def _reframe(segment: Path, call_id: str) -> None:
    """Recompute the content hash (and the header's check) of `call_id`'s frame over its bytes
    as they are now, as if the damage had been written with the frame."""
    row_at, row_len = _rows(segment)[call_id]
    data = segment.read_bytes()
    header = bytearray(data[row_at - HEADER_LEN : row_at])
    att_len = struct.unpack_from("<Q", header, 8)[0]
    body = data[row_at : row_at + row_len + att_len]
    header[32:48] = hashlib.sha256(body).digest()[:16]
    header[48:56] = hashlib.sha256(bytes(header[:48])).digest()[:8]
    _patch(segment, row_at - HEADER_LEN, bytes(header))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize(
    ("target", "reseal", "records"),
    # A damaged call id files the row under another key at the fold (whose own frame it then
    # contradicts): not a row the fetch is served.
    [case for case in CASES if case[0] != "model_call_id"],
)
def test_damage_before_a_fresh_stores_first_fetch_raises_corruption(
    tmp_path: Path, size: str, target: str, reseal: bool, records: bool
) -> None:
    """The fold takes the damaged frame as valid (its hashes were recomputed) and the first
    fetch serves the row from the fold's bytes: the row checksum (matched in the fold's pass,
    the only guard of a log-prob's low bits), the digests and the key check still refuse it."""
    segment, chain = _chain(tmp_path, size)
    victim = chain[-1] if target == "extras" else chain[len(chain) // 2]
    keys = [f"r/{record.model_call_id}" for record in chain]
    _damage(segment, victim.model_call_id, target, reseal)
    _reframe(segment, victim.model_call_id)
    reader = FileStagingStore(tmp_path)
    assert reader.damage() == []  # the fold found nothing wrong with the frame
    fresh = FileStagingStore(tmp_path)
    fetch = fresh.fetch_records if records else fresh.fetch
    with pytest.raises(TokenCaptureCorruptionError, match=f"r/{victim.model_call_id}"):
        fetch(keys)
    with pytest.raises(TokenCaptureCorruptionError):
        fetch([f"r/{victim.model_call_id}"])
    others = [key for key in keys if key != f"r/{victim.model_call_id}"]
    assert [s.model_call_id for s in FileStagingStore(tmp_path).fetch(others)] == [
        k.split("/")[1] for k in others
    ]


@pytest.mark.parametrize("size", list(SIZES))
def test_a_valid_row_of_another_key_is_refused(tmp_path: Path, size: str) -> None:
    """The index points at a whole, valid row, but another key's (its checksum and digest
    hold): the fetch checks the row's ids against the key asked for."""
    segment, _ = _chain(tmp_path, size)
    rows = _rows(segment)
    (a_at, a_len), (b_at, b_len) = rows["call-1"], rows["call-2"]
    assert a_len == b_len
    reader = FileStagingStore(tmp_path)
    assert len(reader.keys()) == len(rows)  # indexed before the damage
    data = segment.read_bytes()
    _patch(segment, a_at, data[b_at : b_at + b_len])
    for fetch in (reader.fetch, reader.fetch_records):
        with pytest.raises(TokenCaptureCorruptionError, match=r"r/call-1.*r/call-2"):
            fetch(["r/call-0", "r/call-1"])
        assert fetch(["r/call-2"])[0].model_call_id == "call-2"


@pytest.mark.parametrize("size", list(SIZES))
def test_an_undamaged_fetch_returns_what_was_staged(tmp_path: Path, size: str) -> None:
    _, chain = _chain(tmp_path, size)
    keys = [f"r/{record.model_call_id}" for record in chain]
    fetched = FileStagingStore(tmp_path).fetch_records(keys)
    assert [r.model_dump() for r in fetched] == [r.model_dump() for r in chain]
    snapshots = FileStagingStore(tmp_path).fetch(keys)
    for snapshot, record in zip(snapshots, chain, strict=True):
        assert snapshot.token_ids_delta == record.token_ids_delta
        assert snapshot.generation_log_probs_delta == record.generation_log_probs_delta
        assert snapshot.digest == record.digest


@pytest.mark.parametrize("with_extras", [False, True])
def test_fetched_models_are_what_model_construct_builds(tmp_path: Path, with_extras: bool) -> None:
    """A fetch builds its models without ``model_construct``'s per-field lookups
    (`tokencapture.model_building`): the same instances, field for field and in field order."""
    from tokencapture import _core, model_building

    _, chain = _chain(tmp_path, "small")
    keys = [f"r/{record.model_call_id}" for record in chain]
    native = _core.StagingFileStore(tmp_path, None)
    dicts = native.fetch(keys, with_extras)
    cls = models.StagedCallRecord if with_extras else models.StagedCallBaseSnapshot
    built = model_building.construct_all(cls, dicts)
    assert model_building.fast_way(cls)  # the fast way applies to our models
    assert [model_state(m) for m in built] == [model_state(cls.model_construct(**d)) for d in dicts]
    store = FileStagingStore(tmp_path, models="tokencapture")
    fetch = store.fetch_records if with_extras else store.fetch
    assert [model_state(m) for m in fetch(keys)] == [model_state(m) for m in built]
