"""The native staging digests against NeMo Gym 0.7.0's: its golden vectors and a differential.

`tokencapture.staging_digest` (the Rust core's digests) must equal
``nemo_gym.token_id_capture.staging.digest`` on every input: the same digest where NeMo Gym
answers one, the same exception type and words where it refuses. The expected values come from
NeMo Gym's published vectors and from NeMo Gym's own module, never from ours.
"""

from __future__ import annotations

import collections
import json
import math
import struct
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tests.nemo_oracle import ORACLE_DIR, import_nemo

nemo = import_nemo("staging.digest")

from tokencapture import staging_digest as ours  # noqa: E402
from tokencapture import staging_records  # noqa: E402

VECTORS_FILE = Path(__file__).resolve().parent / "golden" / "nemo-gym-0.7.0-staging"
VECTORS = json.loads((VECTORS_FILE / "golden_vectors.json").read_text())
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U64 = 2**64 - 1
EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,  # the smallest float64 subnormal: float32 0.0 after rounding
    -1e-45,  # float32 subnormal range
    1.401298464324817e-45,  # the smallest float32 subnormal
    1.1754942106924411e-38,  # the largest float32 subnormal
    3.4028234663852886e38,  # float32 max
    3.4028235677973366e38,  # rounds to float32 max... or overflows: NeMo Gym decides
    3.5e38,
    1e39,
    -1e300,
    math.inf,
    -math.inf,
    math.nan,
    -0.6931471805599453,
]


def outcome(function: Callable[..., str], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """What a digest function did: its digest, or its exception's type and words."""
    try:
        return ("digest", function(*args, **kwargs))
    except Exception as error:
        return ("raised", type(error).__name__, str(error))


# ---- the golden vectors -------------------------------------------------------------------


def test_the_vendored_vectors_are_nemo_gyms_file() -> None:
    sdist_copy = (
        ORACLE_DIR / "nemo_gym" / "token_id_capture" / "staging" / "conformance"
    ) / "golden_vectors.json"
    if not sdist_copy.is_file():
        pytest.skip("NeMo Gym's sdist is not unpacked")
    assert (VECTORS_FILE / "golden_vectors.json").read_bytes() == sdist_copy.read_bytes()


@pytest.mark.parametrize(
    "compute",
    [ours.compute_extras_digest, staging_records.compute_extras_digest],
    ids=["native", "records"],
)
def test_extras_digest_vector(compute: Callable[[Any], str]) -> None:
    assert compute(VECTORS["extras"]) == VECTORS["extras_digest"]
    assert VECTORS["staged_call"]["extras_digest"] == VECTORS["extras_digest"]


@pytest.mark.parametrize(
    "compute",
    [ours.compute_staging_digest, staging_records.compute_staging_digest],
    ids=["native", "records"],
)
def test_staged_call_digest_vector(compute: Callable[..., str]) -> None:
    assert compute(**VECTORS["staged_call"]) == VECTORS["staged_call_digest"]
    # Every field is covered: change any one and the digest moves.
    for name, value in VECTORS["staged_call"].items():
        if name in ("schema_version", "digest_version", "extras_digest_version", "mode"):
            continue
        changed = dict(VECTORS["staged_call"])
        if isinstance(value, str):
            changed[name] = value[:-1] + ("0" if value[-1] != "0" else "1")
        elif isinstance(value, int):
            changed[name] = value + 1
            if name in ("prev_len", "delta_len"):
                continue  # would break cum_len's rule instead
        else:
            continue
        assert outcome(compute, **changed)[1] != VECTORS["staged_call_digest"], name


def test_the_vector_fields_through_the_other_digests() -> None:
    """The vector's token delta through the token-id hash and the chain hash, and its float
    columns through the float32 framing: equal to NeMo Gym's on the same inputs."""
    call = VECTORS["staged_call"]
    ids = call["token_ids_delta"]
    assert ours.encode_token_ids(ids) == nemo.encode_token_ids(ids)
    assert ours.hash_token_ids(ids) == nemo.hash_token_ids(ids)
    for parent in (None, call["chain_hash"], call["cumulative_hash"]):
        assert ours.compute_chain_hash(parent, ids) == nemo.compute_chain_hash(parent, ids)
    assert ours.EMPTY_EXTRAS_DIGEST == nemo.EMPTY_EXTRAS_DIGEST
    assert staging_records.EMPTY_EXTRAS_DIGEST == nemo.EMPTY_EXTRAS_DIGEST


# ---- the differential ---------------------------------------------------------------------

token_ids = st.lists(
    st.one_of(
        st.integers(0, U64),
        st.sampled_from([0, 1, U64, 2**63, 2**32]),
        st.sampled_from([-1, 2**64, True, 1.0, "7", None]),  # refused: NeMo Gym's words
    ),
    max_size=12,
)
hex_digest = st.one_of(
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.sampled_from(["A" * 64, "0" * 63, "g" * 64, "", "0" * 65]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.floats(width=32, allow_subnormal=True),
    st.sampled_from(EDGE_FLOATS),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([2**63, -(2**63) - 1, 2**100]),
    floats,
    st.text(),
    st.sampled_from(["\ud800", "é", "", "a\x00b"]),
)
extras_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
        st.tuples(inner),  # refused: tuples are not lists
    ),
    max_leaves=12,
)
extras = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=6), extras_values, max_size=5),
    # Any mapping at the top (NeMo Gym copies it with dict()), a dict subclass included.
    st.dictionaries(st.text(max_size=6), extras_values, max_size=3).map(
        lambda d: collections.OrderedDict(reversed(list(d.items())))
    ),
    st.dictionaries(st.text(max_size=6), extras_values, max_size=3).map(types.MappingProxyType),
    st.dictionaries(st.sampled_from([1, b"k", ("t",)]), st.none(), min_size=1, max_size=1),
    st.sampled_from([[], "x", 3]),  # not a mapping
)


@SETTINGS
@given(ids=token_ids)
@example(ids=[])
@example(ids=[U64, 0])
def test_token_id_hashing_equals_nemo_gyms(ids: list[Any]) -> None:
    assert outcome(ours.hash_token_ids, ids) == outcome(nemo.hash_token_ids, ids)
    assert outcome(ours.encode_token_ids, ids) == outcome(nemo.encode_token_ids, ids)


@SETTINGS
@given(parent=st.one_of(st.none(), hex_digest), ids=token_ids)
def test_chain_hash_equals_nemo_gyms(parent: str | None, ids: list[Any]) -> None:
    assert outcome(ours.compute_chain_hash, parent, ids) == outcome(
        nemo.compute_chain_hash, parent, ids
    )


@SETTINGS
@given(extras=extras)
@example(extras={"a": -0.0, "b": 0.0})
@example(extras={"z": 1, "é": 2, "a": {"\U0001f600": [True, None, 1.5]}})
@example(extras={"x": math.nan})
def test_extras_digest_equals_nemo_gyms(extras: Any) -> None:
    assert outcome(ours.compute_extras_digest, extras) == outcome(
        nemo.compute_extras_digest, extras
    )
    assert outcome(staging_records.compute_extras_digest, extras) == outcome(
        nemo.compute_extras_digest, extras
    )


@st.composite
def staged_calls(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly well-formed calls (so the digest itself is compared), some with one field off."""
    root = draw(st.booleans())
    n = draw(st.integers(1, 10))
    generated = draw(st.integers(0, n))
    masks: list[Any] = [0.0] * (n - generated) + [1.0] * generated
    log_probs: list[Any] = [0.0] * (n - generated) + draw(
        st.lists(floats, min_size=generated, max_size=generated)
    )
    if draw(st.integers(0, 9)) == 0:  # carry log-probabilities of -0.0 pass NeMo Gym's check
        log_probs = [-0.0 if m == 0.0 else lp for m, lp in zip(masks, log_probs, strict=True)]
    prev_len = 0 if root else draw(st.integers(1, 2**40))
    fields: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": draw(st.text(min_size=1, max_size=8)),
        "model_call_id": draw(st.text(min_size=1, max_size=8)),
        "parent_call_id": None if root else draw(st.text(min_size=1, max_size=8)),
        "mode": "text" if root else "token_in",
        "prev_len": prev_len,
        "delta_len": n,
        "cum_len": prev_len + n,
        "weight_version": draw(st.integers(0, U64)),
        "token_ids_delta": draw(st.lists(st.integers(0, U64), min_size=n, max_size=n)),
        "token_mask_delta": masks,
        "generation_log_probs_delta": log_probs,
        "extras_digest": draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
        "chain_hash": draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
        "cumulative_hash": draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
    }
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(sorted(fields)))
        fields[name] = draw(
            st.one_of(
                st.sampled_from([None, "", 0, -1, 3, U64 + 1, True, 1.5, "text", "token_in"]),
                hex_digest,
                token_ids,
                st.lists(floats, max_size=n + 1),
                st.lists(st.sampled_from([0.0, 1.0, -0.0, 0.5, 1, 2.0]), min_size=n, max_size=n),
                st.text(max_size=3),
            )
        )
    return fields


@SETTINGS
@given(fields=staged_calls())
@example(fields={**VECTORS["staged_call"], "generation_log_probs_delta": [-0.0, -0.25]})
@example(fields={**VECTORS["staged_call"], "generation_log_probs_delta": [0.0, 5e-324]})
@example(fields={**VECTORS["staged_call"], "generation_log_probs_delta": [0.0, 3.5e38]})
@example(fields={**VECTORS["staged_call"], "generation_log_probs_delta": [0.0, math.nan]})
@example(fields={**VECTORS["staged_call"], "rollout_id": "\ud800"})
def test_staging_digest_equals_nemo_gyms(fields: dict[str, Any]) -> None:
    expected = outcome(nemo.compute_staging_digest, **fields)
    assert outcome(ours.compute_staging_digest, **fields) == expected
    assert outcome(staging_records.compute_staging_digest, **fields) == expected


def test_the_float_edges_reach_the_digest_as_float32_bits() -> None:
    """-0.0 and 0.0 (and two float64 values of one float32) digest as their float32 bits do,
    as NeMo Gym's do: the differential above would pass a digest that ignored the floats."""
    base = dict(VECTORS["staged_call"])

    def digest(lp: float) -> tuple[Any, ...]:
        return outcome(
            ours.compute_staging_digest, **{**base, "generation_log_probs_delta": [0.0, lp]}
        )

    assert digest(-0.0) != digest(0.0)
    assert digest(-0.0) == outcome(
        nemo.compute_staging_digest, **{**base, "generation_log_probs_delta": [0.0, -0.0]}
    )
    same32 = struct.unpack(">f", struct.pack(">f", -0.1))[0]
    assert same32 != -0.1 and digest(same32) == digest(-0.1)
    assert digest(math.nan)[0] == "raised" and digest(math.inf)[0] == "raised"


@pytest.mark.parametrize("with_attachments", [False, True])
def test_encoded_stage_content_digest_is_sha256_of_row_and_attachments(
    with_attachments: bool,
) -> None:
    """`staging_encode` computes the content digest with the row, in one release of the GIL;
    it is the SHA-256 of the row bytes and the attachments blob (what PostgreSQL stores and
    compares for idempotency), and a record whose digest does not verify is still refused."""
    import hashlib

    from tokencapture.conformance_staging import build_chain
    from tokencapture.staging import records as models
    from tokencapture.staging_rows import encode_stage

    (record,) = build_chain(models, "enc", 1, prompt_tokens=3, generated_tokens=2)
    attachments = {"blob": b"\x01\x02" * 40} if with_attachments else None
    encoded = encode_stage(record, attachments)
    assert encoded.has_attachments is with_attachments
    assert bool(encoded.attachments) is with_attachments
    expected = hashlib.sha256(encoded.row + encoded.attachments).hexdigest()
    assert encoded.content_digest == expected
    other = encode_stage(record, {"blob": b"\x03"})
    assert other.content_digest != encoded.content_digest
    assert other.row == encoded.row
    tampered = record.model_copy(update={"token_ids_delta": [*record.token_ids_delta[:-1], 7]})
    with pytest.raises(ValueError):
        encode_stage(tampered, attachments)


def nested(depth: int, kind: str) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return {"top": value}


@pytest.mark.parametrize(
    "extras",
    [
        collections.OrderedDict([("b", 1), ("a", collections.OrderedDict())]),  # nested: refused
        collections.OrderedDict([("b", 1), ("a", [2.5, None])]),
        collections.defaultdict(list, {"z": [1], "a": {"k": "v"}}),
        types.MappingProxyType({"x": -0.0}),
    ],
)
def test_a_mapping_at_the_top_of_extras_is_digested_as_nemo_gym_copies_it(extras: Any) -> None:
    assert outcome(ours.compute_extras_digest, extras) == outcome(
        nemo.compute_extras_digest, extras
    )


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_extras_as_deep_as_nemo_gym_digests_are_digested_and_staged(
    kind: str, tmp_path: Path
) -> None:
    """NeMo Gym's recursive encoder digests ~330 levels under the default recursion limit and
    more under a raised one; such trees digest the same here and stage (the limit was 256
    levels, so a record NeMo Gym's capture built was refused)."""
    import sys

    from tokencapture import FileStagingStore
    from tokencapture.staging_digest import compute_chain_hash, hash_token_ids

    records = import_nemo("staging.records")
    extras = nested(600, kind)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(4000)
    try:
        digest = nemo.compute_extras_digest(extras)
    finally:
        sys.setrecursionlimit(limit)
    assert ours.compute_extras_digest(extras) == digest
    ids = [1, 2, 3]
    fields: dict[str, Any] = {
        **{k: VECTORS["staged_call"][k] for k in ("schema_version", "digest_version")},
        "extras_digest_version": 1,
        "rollout_id": "deep",
        "model_call_id": kind,
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 0,
        "token_ids_delta": ids,
        "token_mask_delta": [0.0, 1.0, 1.0],
        "generation_log_probs_delta": [0.0, -1.0, -2.0],
        "extras_digest": digest,
        "chain_hash": compute_chain_hash(None, ids),
        "cumulative_hash": hash_token_ids(ids),
    }
    fields["digest"] = nemo.compute_staging_digest(**fields)
    record = records.StagedCallRecord.model_construct(**fields, extras=extras)
    store = FileStagingStore(tmp_path)
    assert store.stage(record).ok
    (back,) = FileStagingStore(tmp_path).fetch_records([f"deep/{kind}"])
    assert ours.compute_extras_digest(back.extras) == digest
    # Far past any tree NeMo Gym digests: refused, not a crash.
    with pytest.raises(RecursionError):
        ours.compute_extras_digest(nested(5000, kind))
