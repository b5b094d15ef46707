"""Capture-ledger wire models (SPEC section 6): every validation rule, accepted and rejected."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

import tokencapture.records as token_records
import tokencapture.staging as staging
from tokencapture.staging.records import (
    MISSING_CHAIN_DIGEST_REASON,
    MISSING_RESPONSE_ID_REASON,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
    RolloutRemoval,
)

D1 = "0123456789abcdef" * 4
D2 = "f" * 64
D3 = "a" * 64
D4 = "5" * 64


def root_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model_call_id": "call-1",
        "response_id": "resp-1",
        "mode": "text",
        "prev_len": 0,
        "delta_len": 12,
        "cum_len": 12,
        "digest": D1,
        "chain_hash": D2,
        "continuation_fingerprint": D3,
        "continuation_context_len": 1,
        "continuation_context_digest": D4,
    }
    fields.update(overrides)
    return fields


def child_fields(**overrides: Any) -> dict[str, Any]:
    fields = root_fields(
        model_call_id="call-2",
        response_id="resp-2",
        parent_call_id="call-1",
        mode="token_in",
        prev_len=12,
        delta_len=5,
        cum_len=17,
        continuation_context_len=3,
    )
    fields.update(overrides)
    return fields


def commit_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "record": root_fields(),
        "staging_chain": ["seg-0"],
        "request_items": [{"role": "user", "content": "hi", "meta": {"t": 1.5, "ok": None}}],
        "response_items": [{"role": "assistant", "content": [{"type": "text", "text": "yo"}]}],
    }
    fields.update(overrides)
    return fields


# --- CallRecord ---------------------------------------------------------------------------------


def test_root_record_accepted_with_version_defaults() -> None:
    record = CallRecord(**root_fields())
    assert record.parent_call_id is None
    assert record.extras_digest is None
    dumped = record.model_dump(mode="json")
    assert dumped["schema_version"] == 2
    assert dumped["digest_version"] == 2
    assert dumped["extras_digest_version"] == 1
    assert dumped["cum_len"] == 12


def test_child_record_accepted() -> None:
    record = CallRecord(**child_fields(extras_digest=D2))
    assert (record.parent_call_id, record.mode, record.prev_len) == ("call-1", "token_in", 12)
    assert record.extras_digest == D2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("schema_version", 1),
        ("schema_version", 3),
        ("digest_version", 1),
        ("digest_version", "2"),
        ("extras_digest_version", 2),
        ("extras_digest_version", 0),
    ],
)
def test_record_versions_are_pinned(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**root_fields(**{field: value}))


def test_record_versions_accept_their_own_value() -> None:
    CallRecord(**root_fields(schema_version=2, digest_version=2, extras_digest_version=1))


def test_delta_len_must_be_positive() -> None:
    with pytest.raises(ValidationError, match="delta_len must be positive"):
        CallRecord(**root_fields(delta_len=0, cum_len=0))
    assert CallRecord(**root_fields(delta_len=1, cum_len=1)).delta_len == 1


@pytest.mark.parametrize("cum_len", [11, 13, 0])
def test_cum_len_must_be_prev_plus_delta(cum_len: int) -> None:
    with pytest.raises(ValidationError, match="cum_len"):
        CallRecord(**root_fields(cum_len=cum_len))
    with pytest.raises(ValidationError, match="cum_len"):
        CallRecord(**child_fields(cum_len=cum_len + 5))


@pytest.mark.parametrize(
    "overrides",
    [
        {"prev_len": 3, "cum_len": 15},  # tokens inherited from nobody
        {"mode": "token_in"},  # token-in continuation of nothing
    ],
)
def test_record_without_parent_is_a_text_root(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="without a parent"):
        CallRecord(**root_fields(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {"prev_len": 0, "cum_len": 5},  # a parent but nothing inherited
        {"mode": "text"},  # a parent but a full text prompt
    ],
)
def test_record_with_parent_is_a_token_in_continuation(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="with a parent"):
        CallRecord(**child_fields(**overrides))


def test_record_cannot_be_its_own_parent() -> None:
    with pytest.raises(ValidationError, match="own parent"):
        CallRecord(**child_fields(parent_call_id="call-2"))


@pytest.mark.parametrize("mode", ["TEXT", "token", "", None])
def test_mode_is_one_of_two_literals(mode: object) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**root_fields(mode=mode))


@pytest.mark.parametrize("field", ["model_call_id", "response_id", "parent_call_id"])
@pytest.mark.parametrize("value", ["", 7, b"call", ["call"]], ids=repr)
def test_identifiers_are_non_empty_strict_strings(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**child_fields(**{field: value}))


def test_required_identifiers_cannot_be_none() -> None:
    for field in ("model_call_id", "response_id"):
        with pytest.raises(ValidationError):
            CallRecord(**root_fields(**{field: None}))


@pytest.mark.parametrize(
    "field", ["digest", "chain_hash", "continuation_context_digest", "extras_digest"]
)
@pytest.mark.parametrize(
    "value",
    ["", "A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 64 + "\n", " " + "a" * 63, 5],
    ids=repr,
)
def test_digests_are_lowercase_hex_sha256(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**root_fields(**{field: value}))


def test_continuation_fingerprint_is_a_digest_or_empty() -> None:
    assert CallRecord(**root_fields(continuation_fingerprint="")).continuation_fingerprint == ""
    for bad in ["x", "A" * 64, "a" * 63, None]:
        with pytest.raises(ValidationError):
            CallRecord(**root_fields(continuation_fingerprint=bad))


@pytest.mark.parametrize("field", ["prev_len", "delta_len", "cum_len", "continuation_context_len"])
@pytest.mark.parametrize("value", [-1, "12", 12.0, True, None], ids=repr)
def test_counts_are_strict_non_negative_ints(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        CallRecord(**child_fields(**{field: value}))


def test_context_len_may_be_zero() -> None:
    assert CallRecord(**root_fields(continuation_context_len=0)).continuation_context_len == 0


def test_record_forbids_extra_fields() -> None:
    with pytest.raises(ValidationError, match="extra"):
        CallRecord(**root_fields(prompt_token_ids=[1, 2]))


def test_record_is_immutable() -> None:
    record = CallRecord(**root_fields())
    with pytest.raises(ValidationError):
        record.cum_len = 99  # type: ignore[misc]


# --- CaptureLedgerCommit ------------------------------------------------------------------------


def test_commit_accepted_and_round_trips() -> None:
    commit = CaptureLedgerCommit(**commit_fields(record=child_fields()))
    assert commit.staging_chain == ("seg-0",)
    assert commit.record.parent_call_id == "call-1"
    wire = commit.model_dump(mode="json")
    assert wire["staging_chain"] == ["seg-0"]
    assert wire["schema_version"] == 2
    back = CaptureLedgerCommit.model_validate(orjson.loads(orjson.dumps(wire)))
    assert back == commit
    assert back.model_dump(mode="json") == wire


def test_commit_staging_chain_defaults_to_empty() -> None:
    fields = commit_fields()
    del fields["staging_chain"]
    assert CaptureLedgerCommit(**fields).staging_chain == ()


@pytest.mark.parametrize("field", ["rollout_id", "record", "request_items", "response_items"])
def test_commit_required_fields(field: str) -> None:
    fields = commit_fields()
    del fields[field]
    with pytest.raises(ValidationError):
        CaptureLedgerCommit(**fields)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout_id": ""},
        {"rollout_id": 1},
        {"staging_chain": [""]},
        {"staging_chain": [3]},
        {"schema_version": 1},
        {"record": root_fields(cum_len=1)},  # the nested record is validated too
        {"request_items": ["not a dict"]},
        {"response_items": [{"blob": {1, 2}}]},  # not JSON
        {"response_items": [{"when": object()}]},
    ],
    ids=repr,
)
def test_commit_rejects_invalid_fields(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CaptureLedgerCommit(**commit_fields(**overrides))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_commit_rejects_non_finite_floats_anywhere_in_items(bad: float) -> None:
    with pytest.raises(ValidationError, match="finite"):
        CaptureLedgerCommit(**commit_fields(request_items=[{"logprob": bad}]))
    with pytest.raises(ValidationError, match="finite"):
        CaptureLedgerCommit(**commit_fields(response_items=[{"a": [1, {"b": bad}]}]))


def test_commit_forbids_extra_fields() -> None:
    with pytest.raises(ValidationError, match="extra"):
        CaptureLedgerCommit(**commit_fields(cumulative_token_ids=[1, 2, 3]))


# --- ManifestFailure, RolloutManifest -----------------------------------------------------------


def test_failure_row_accepted_and_validated() -> None:
    failure = ManifestFailure(model_call_id="call-9", reason=UNCOMMITTED_CALL_REASON)
    assert failure.model_dump(mode="json") == {
        "schema_version": 2,
        "model_call_id": "call-9",
        "reason": "request_finished_without_staged_coordinates",
    }
    for overrides in ({"model_call_id": ""}, {"reason": ""}, {"reason": 3}, {"extra": "x"}):
        with pytest.raises(ValidationError):
            ManifestFailure(**{"model_call_id": "c", "reason": "r", **overrides})


def test_manifest_round_trips() -> None:
    manifest = RolloutManifest(
        rollout_id="rollout-1",
        records=[root_fields(), child_fields()],
        failures=[{"model_call_id": "call-3", "reason": MISSING_RESPONSE_ID_REASON}],
    )
    assert [r.model_call_id for r in manifest.records] == ["call-1", "call-2"]
    wire = manifest.model_dump(mode="json")
    assert wire["records"][1]["parent_call_id"] == "call-1"
    assert wire["failures"] == [
        {"schema_version": 2, "model_call_id": "call-3", "reason": "missing_response_id"}
    ]
    back = RolloutManifest.model_validate(orjson.loads(orjson.dumps(wire)))
    assert back == manifest


def test_empty_manifest_is_valid() -> None:
    manifest = RolloutManifest(rollout_id="r")
    assert (manifest.records, manifest.failures) == ((), ())


def test_manifest_rejects_a_record_twice() -> None:
    with pytest.raises(ValidationError, match="recorded twice"):
        RolloutManifest(rollout_id="r", records=[root_fields(), root_fields()])


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout_id": ""},
        {"records": [root_fields(delta_len=0, cum_len=0)]},
        {"failures": [{"model_call_id": "c"}]},
        {"schema_version": 3},
        {"tokens": []},
    ],
    ids=repr,
)
def test_manifest_rejects_invalid_fields(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RolloutManifest(**{"rollout_id": "r", **overrides})


# --- RolloutRemoval -----------------------------------------------------------------------------


def test_removal_dump_is_exactly_the_payload() -> None:
    payload = {"removed": ["a", "b"], "absent": ["c"]}
    assert RolloutRemoval.model_validate(payload).model_dump(mode="json") == payload


@pytest.mark.parametrize(
    "payload",
    [
        {"removed": ["a"], "absent": ["a"]},  # an id cannot be both
        {"removed": [""], "absent": []},
        {"removed": ["a"]},
        {"removed": "ab", "absent": []},
        {"removed": [], "absent": [], "schema_version": 2},
    ],
    ids=repr,
)
def test_removal_rejects_invalid_payloads(payload: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RolloutRemoval.model_validate(payload)


# --- reasons and re-exports ---------------------------------------------------------------------


def test_reason_constants() -> None:
    assert MISSING_RESPONSE_ID_REASON == "missing_response_id"
    assert MISSING_CHAIN_DIGEST_REASON == "missing_chain_digest"
    # Shared with the file store: SPEC section 2 fixes these two values.
    assert UNRESOLVED_PARENT_REASON == "unresolved_parent"
    assert UNCOMMITTED_CALL_REASON == "request_finished_without_staged_coordinates"
    assert UNRESOLVED_PARENT_REASON is token_records.UNRESOLVED_PARENT_REASON
    assert UNCOMMITTED_CALL_REASON is token_records.UNCOMMITTED_CALL_REASON
    reasons = {
        MISSING_RESPONSE_ID_REASON,
        MISSING_CHAIN_DIGEST_REASON,
        UNRESOLVED_PARENT_REASON,
        UNCOMMITTED_CALL_REASON,
    }
    assert len(reasons) == 4


def test_staging_package_reexports() -> None:
    assert staging.CallRecord is CallRecord
    assert staging.CaptureLedgerCommit is CaptureLedgerCommit
    assert staging.ManifestFailure is ManifestFailure
    assert staging.RolloutManifest is RolloutManifest
    assert staging.RolloutRemoval is RolloutRemoval
    assert set(staging.__all__) <= set(dir(staging))
