"""Staging and capture-ledger wire models (SPEC section 6): every rule, accepted and rejected.

The expected messages are NeMo Gym 0.7.0's wording for each rule (read from its source); the
differential against NeMo Gym's own classes is in `test_nemo_gym_ledger.py`. Digests are
computed here independently from the documented byte layouts.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

import tokencapture.records as token_records
import tokencapture.staging as staging
from tokencapture.staging.records import (
    EMPTY_EXTRAS_DIGEST,
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    CommitCoords,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
    StagedCallRecord,
    StageResult,
    compute_extras_digest,
    compute_staging_digest,
    staging_key,
)

D1 = "0123456789abcdef" * 4
D2 = "f" * 64
D3 = "a" * 64
D4 = "5" * 64


def root_fields(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model_call_id": "call-1",
        "prev_len": 0,
        "delta_len": 12,
        "cum_len": 12,
        "weight_version": 0,
        "digest": D1,
        "extras_digest": D2,
        "staging_key": "rollout-1/call-1",
        "mode": "text",
        "chain_hash": D3,
        "cumulative_hash": D4,
        "response_id": "resp-1",
    }
    fields.update(overrides)
    return fields


def child_fields(**overrides: Any) -> dict[str, Any]:
    child = {
        "model_call_id": "call-2",
        "parent_call_id": "call-1",
        "prev_len": 12,
        "delta_len": 5,
        "cum_len": 17,
        "mode": "token_in",
        "staging_key": "rollout-1/call-2",
        "response_id": "resp-2",
    }
    return root_fields(**{**child, **overrides})


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


def refused(model: type[Any], fields: dict[str, Any], message: str = "") -> None:
    with pytest.raises(ValidationError) as info:
        model(**fields)
    assert message in str(info.value)


# --- CallRecord ---------------------------------------------------------------------------------


def test_root_record_dump_has_versions_first_and_defaults() -> None:
    record = CallRecord(**root_fields())
    assert list(record.model_dump()) == [
        "schema_version",
        "digest_version",
        "extras_digest_version",
        "model_call_id",
        "parent_call_id",
        "prev_len",
        "delta_len",
        "cum_len",
        "weight_version",
        "digest",
        "extras_digest",
        "staging_key",
        "mode",
        "chain_hash",
        "cumulative_hash",
        "response_id",
        "admitted_at",
        "output_fingerprint",
        "continuation_fingerprint",
        "fingerprint_version",
    ]
    dump = record.model_dump()
    assert (dump["schema_version"], dump["digest_version"], dump["extras_digest_version"]) == (
        2,
        2,
        1,
    )
    assert (dump["admitted_at"], dump["output_fingerprint"], dump["fingerprint_version"]) == (
        None,
        None,
        0,
    )
    assert CallRecord(**child_fields()).parent_call_id == "call-1"


def test_mode_defaults_to_token_in_so_a_root_must_name_it() -> None:
    fields = root_fields()
    del fields["mode"]
    refused(CallRecord, fields, "a parentless manifest row must use text mode")
    fields = child_fields()
    del fields["mode"]
    assert CallRecord(**fields).mode == "token_in"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"delta_len": 0, "cum_len": 0}, "manifest lengths must describe a non-empty"),
        ({"cum_len": 13}, "manifest lengths must describe a non-empty contiguous delta"),
        ({"prev_len": 3, "cum_len": 15}, "a parentless manifest row must have prev_len == 0"),
        ({"mode": "token_in"}, "a parentless manifest row must use text mode"),
        ({"mode": "TEXT"}, "Input should be 'token_in' or 'text'"),
        ({"schema_version": 1}, "Input should be 2"),
        ({"digest_version": 1}, "Input should be 2"),
        ({"extras_digest_version": 2}, "Input should be 1"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"admitted_at": "5.0"}, "Input should be a valid number"),
        ({"admitted_at": math.inf}, "finite number"),
        ({"output_fingerprint": ""}, "String should match pattern"),
        ({"digest": D1.upper()}, "String should match pattern"),
        ({"response_id": ""}, "at least 1 character"),
        ({"staging_key": 5}, "Input should be a valid string"),
        ({"weight_version": -1}, "greater than or equal to 0"),
        ({"prev_len": "0"}, "Input should be a valid integer"),
        ({"fingerprint_version": True}, "Input should be a valid integer"),
    ],
    ids=repr,
)
def test_root_record_rules(overrides: dict[str, Any], message: str) -> None:
    refused(CallRecord, root_fields(**overrides), message)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prev_len": 0, "cum_len": 5}, "a child manifest row must have prev_len > 0"),
        ({"mode": "text"}, "a child manifest row must use token_in mode"),
        ({"parent_call_id": ""}, "at least 1 character"),
    ],
    ids=repr,
)
def test_child_record_rules(overrides: dict[str, Any], message: str) -> None:
    refused(CallRecord, child_fields(**overrides), message)


def test_a_self_parent_is_accepted_as_nemo_gym_accepts_it() -> None:
    assert CallRecord(**child_fields(parent_call_id="call-2")).parent_call_id == "call-2"


def test_models_are_mutable_like_nemo_gyms() -> None:
    # A strict float takes an int, as NeMo Gym's StrictFloat does (pydantic's rule).
    assert CallRecord(**root_fields(admitted_at=5)).admitted_at == 5
    record = CallRecord(**root_fields())
    record.weight_version = 9  # no validate_assignment, not frozen
    assert record.weight_version == 9


# --- CaptureLedgerCommit ------------------------------------------------------------------------


def test_commit_round_trips_and_keeps_its_chain_a_tuple() -> None:
    commit = CaptureLedgerCommit(**commit_fields())
    assert commit.staging_chain == ("seg-0",)
    assert commit.record == CallRecord(**root_fields())
    back = CaptureLedgerCommit.model_validate_json(commit.model_dump_json())
    assert back == commit
    assert CaptureLedgerCommit(**commit_fields(staging_chain=())).staging_chain == ()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout_id": ""}, "at least 1 character"),
        ({"staging_chain": [""]}, "at least 1 character"),
        ({"staging_chain": [1]}, "Input should be a valid string"),
        ({"request_items": [["not", "a", "dict"]]}, "Input should be a valid dictionary"),
        ({"record": root_fields(cum_len=1)}, "manifest lengths"),
        ({"cumulative_token_ids": [1]}, "Extra inputs are not permitted"),
    ],
    ids=repr,
)
def test_commit_rules(overrides: dict[str, Any], message: str) -> None:
    refused(CaptureLedgerCommit, commit_fields(**overrides), message)


def test_commit_items_are_any_dicts() -> None:
    # NeMo Gym types them as bare `list[dict]`: no JSON check, so NaN passes the model.
    commit = CaptureLedgerCommit(**commit_fields(request_items=[{"x": math.nan, 1: "int key"}]))
    assert math.isnan(commit.request_items[0]["x"])


# --- ManifestFailure, RolloutManifest, RolloutReceipt -------------------------------------------


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


def test_manifest_lists_compare_to_lists_and_round_trip() -> None:
    assert RolloutManifest(rollout_id="r").records == []
    assert RolloutManifest(rollout_id="r").failures == []
    manifest = RolloutManifest(
        rollout_id="rollout-1",
        records=[root_fields(), child_fields(), root_fields()],  # duplicates: not checked
        failures=[{"model_call_id": "call-3", "reason": LEDGER_ROW_MISSING_RESPONSE_ID_REASON}],
    )
    wire = manifest.model_dump(mode="json")
    assert list(wire) == ["schema_version", "rollout_id", "records", "failures"]
    assert wire["failures"] == [
        {"schema_version": 2, "model_call_id": "call-3", "reason": "ledger_row_missing_response_id"}
    ]
    assert RolloutManifest.model_validate(orjson.loads(orjson.dumps(wire))) == manifest


def test_receipt_states() -> None:
    record = root_fields()
    ok = RolloutReceipt(
        rollout_id="r",
        terminal_model_call_id="call-1",
        manifest=[record],
        terminal_selection="declared",
    )
    assert ok.capture_poisoned is False
    cases: list[tuple[dict[str, Any], str]] = [
        ({"manifest": [record, record]}, "duplicate model_call_id"),
        ({"terminal_model_call_id": "other"}, "absent from the receipt manifest"),
        ({"failure_reason": "x"}, "an unpoisoned receipt cannot carry a failure_reason"),
        ({"terminal_selection": None}, "must name terminal_model_call_id"),
        (
            {"capture_poisoned": True, "terminal_selection": None},
            "terminal_model_call_id requires a terminal_selection method",
        ),
    ]
    for fields, message in cases:
        base: dict[str, Any] = {
            "rollout_id": "r",
            "terminal_model_call_id": "call-1",
            "manifest": [record],
            "terminal_selection": "declared",
        }
        refused(RolloutReceipt, {**base, **fields}, message)
    refused(
        RolloutReceipt,
        {"rollout_id": "r", "capture_poisoned": True},
        "must be poisoned with a failure_reason",
    )


# --- staging models and their digests -----------------------------------------------------------


def test_extras_digest_layout() -> None:
    # The layout: domain, version byte, then typed values ("N" for None, "D" + count + sorted
    # length-prefixed keys, "I" + signed 64-bit, "S" + length-prefixed UTF-8).
    empty = hashlib.sha256(b"nemo-gym-staging-extras-v1\x01N").hexdigest()
    assert empty == EMPTY_EXTRAS_DIGEST
    body = (
        b"D"
        + struct.pack(">Q", 2)
        + struct.pack(">Q", 1)
        + b"a"
        + b"I"
        + struct.pack(">q", -3)
        + struct.pack(">Q", 1)
        + b"b"
        + b"S"
        + struct.pack(">Q", 2)
        + b"hi"
    )
    expected = hashlib.sha256(b"nemo-gym-staging-extras-v1\x01" + body).hexdigest()
    assert compute_extras_digest({"b": "hi", "a": -3}) == expected
    for bad in ({"x": (1,)}, {"x": math.nan}, {"x": 2**63}, {1: 1}):
        with pytest.raises((TypeError, ValueError)):
            compute_extras_digest(bad)  # type: ignore[arg-type]


def staged(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "r",
        "model_call_id": "c",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 2,
        "cum_len": 2,
        "weight_version": 1,
        "token_ids_delta": [5, 6],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.5],
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": D3,
        "cumulative_hash": D4,
    }
    fields.update(overrides)
    return fields


def test_staged_call_digest_is_checked() -> None:
    fields = staged()
    digest = compute_staging_digest(**fields)
    record = StagedCallRecord(digest=digest, **fields)
    assert record.staging_key == "r/c" == staging_key("r", "c")
    refused(StagedCallRecord, {**fields, "digest": D1}, "digest does not match staged call")
    refused(
        StagedCallRecord,
        {**fields, "digest": digest, "extras": {"k": 1}},
        "extras_digest does not match extras",
    )
    with pytest.raises(ValueError, match=r"prompt-carry log probabilities must be 0\.0"):
        compute_staging_digest(**{**fields, "generation_log_probs_delta": [-1.0, 0.0]})
    with pytest.raises(ValueError, match="must be non-empty"):
        staging_key("", "c")


def test_admission_coords_and_stage_result_rules() -> None:
    assert CaptureAdmission(rollout_id="r", model_call_id="c", mode="text").prev_len == 0
    refused(
        CaptureAdmission,
        {"rollout_id": "r", "model_call_id": "c", "mode": "token_in"},
        "token_in admission requires a parent_call_id and prev_len > 0",
    )
    coords: dict[str, Any] = {
        "rollout_id": "r",
        "model_call_id": "c",
        "prev_len": 0,
        "delta_len": 0,
        "cum_len": 0,
        "weight_version": 0,
        "disposition": "capture_failed",
    }
    assert CommitCoords(**coords).digest is None
    refused(CommitCoords, {**coords, "digest": D1}, "cannot carry staged payload metadata")
    refused(CommitCoords, {**coords, "disposition": "staged"}, "staged coordinates require")
    refused(StageResult, {"ok": True}, "a successful stage result requires staging_key")
    refused(StageResult, {"ok": False}, "a failed stage result requires an error")


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
    assert LEDGER_ROW_MISSING_RESPONSE_ID_REASON == "ledger_row_missing_response_id"
    assert LEDGER_ROW_MISSING_CHAIN_HASH_REASON == "ledger_row_missing_chain_hash"
    assert UNRESOLVED_PARENT_REASON == "unresolved_parent"
    assert UNCOMMITTED_CALL_REASON == "request_finished_without_staged_coordinates"
    assert UNRESOLVED_PARENT_REASON is token_records.UNRESOLVED_PARENT_REASON
    assert UNCOMMITTED_CALL_REASON is token_records.UNCOMMITTED_CALL_REASON
    assert staging.MISSING_RESPONSE_ID_REASON == LEDGER_ROW_MISSING_RESPONSE_ID_REASON
    assert staging.MISSING_CHAIN_DIGEST_REASON == LEDGER_ROW_MISSING_CHAIN_HASH_REASON


def test_staging_package_reexports() -> None:
    assert staging.CallRecord is CallRecord
    assert staging.CaptureLedgerCommit is CaptureLedgerCommit
    assert staging.ManifestFailure is ManifestFailure
    assert staging.RolloutManifest is RolloutManifest
    assert staging.RolloutRemoval is RolloutRemoval
    assert set(staging.__all__) <= set(dir(staging))
