"""NeMo Gym's records helpers and names, beside ours: every public name of its
`token_id_capture` package that we implement is importable from `tokencapture` (it was not:
`CallRecord`, `CaptureLedgerCommit`, `extract_token_fields`, `TokenIdCaptureConfig`), and the
response helpers and the token-id framing give NeMo Gym's answers (a hypothesis differential
over served-response shapes)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.nemo_oracle import import_nemo

import tokencapture
from tokencapture import records

theirs = import_nemo("records")
nemo_package = importlib.import_module("nemo_gym.token_id_capture")

# Names of NeMo Gym's package that belong to its serving and training code (the capture
# context, the builder, the consumer), which a store does not implement.
SERVING_SIDE = {
    "Chain",
    "CaptureContext",
    "NG_CAPTURE_FIELD",
    "NG_COMMIT_COORDS_FIELD",
    "set_token_sink",
    "capture_health_snapshot",
    "register_call_intent",
    "reset_token_sink",
    "resolve_parent",
    "capture_tokens",
    "commit_entry",
    "current_capture_context",
    "mark_external_staging_committed",
    "IncrementalLineageStore",
    "LineageIndex",
    "RolloutLineage",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "run_builder",
    "assert_prefix_contiguity",
    "trajectories_for_rollout",
    "clear_token_captures_for_rollouts",
    "trajectories_from_source",
    "token_id_capture_dirs_from_config",
}


def test_every_store_side_name_of_the_package_is_ours_too() -> None:
    wanted = sorted(set(nemo_package.__all__) - SERVING_SIDE)
    missing = [name for name in wanted if not hasattr(tokencapture, name)]
    assert missing == []
    assert set(wanted) <= set(tokencapture.__all__)
    for name in (
        "DIGEST_VERSION",
        "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
        "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    ):
        assert getattr(records, name) == getattr(theirs, name), name


def outcome(function: Any, *args: Any) -> Any:
    try:
        return ("ok", function(*args))
    except (ValueError, TypeError, AttributeError) as exc:
        return ("raised", type(exc).__name__, str(exc))


@pytest.mark.parametrize(
    "ids", [[], [0], [1, 2, 3], [2**64 - 1], [-1], [1, -5, 3], list(range(1000))]
)
def test_encode_token_ids_is_nemo_gyms_framing(ids: list[int]) -> None:
    assert outcome(records.encode_token_ids, ids) == outcome(theirs.encode_token_ids, ids)


@pytest.mark.parametrize("ids", [None, [], (), [7], [0, 2**64 - 1]])
def test_compute_digest_is_nemo_gyms_none_included(ids: Any) -> None:
    """NeMo Gym digests `None` as the empty sequence (a call with no generation); ours raised
    `TypeError` there."""
    assert records.compute_digest(ids) == theirs.compute_digest(ids)


def test_an_id_past_u64_is_a_value_error() -> None:
    """NeMo Gym's own raises StopIteration here (it looks for a negative id that is not
    there); ours says what is wrong, as `compute_digest` does."""
    with pytest.raises(ValueError, match="below 2\\*\\*64"):
        records.encode_token_ids([1, 2**64])


token_fields = st.fixed_dictionaries(
    {},
    optional={
        "prompt_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=3)),
        "generation_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=3)),
        "generation_log_probs": st.one_of(st.none(), st.lists(st.floats(-5, 0), max_size=3)),
        "routed_experts": st.none(),
        "content": st.text(max_size=3),
        "type": st.sampled_from(["message", "reasoning", "function_call"]),
        "role": st.sampled_from(["assistant", "user"]),
    },
)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.text(max_size=3)}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": st.text(max_size=3)}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.integers()}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking")}),
    st.text(max_size=2),
)
responses = st.one_of(
    st.fixed_dictionaries({"output": st.lists(st.one_of(token_fields, st.integers()), max_size=3)}),
    st.fixed_dictionaries(
        {
            "choices": st.lists(
                st.one_of(
                    st.none(),
                    st.fixed_dictionaries(
                        {}, optional={"message": st.one_of(token_fields, st.none())}
                    ),
                ),
                max_size=3,
            )
        },
        optional={"output": st.just([])},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.just("assistant"),
            "content": st.lists(blocks, max_size=4),
        }
    ),
    st.just({}),
)


@settings(max_examples=400, deadline=None)
@given(responses)
def test_the_response_helpers_give_nemo_gyms_answers(payload: dict[str, Any]) -> None:
    for name in ("response_to_output_items", "extract_token_fields"):
        assert outcome(getattr(records, name), payload) == outcome(
            getattr(theirs, name), payload
        ), name
    items = theirs.response_to_output_items(payload)
    assert outcome(records.strip_token_fields, items) == outcome(theirs.strip_token_fields, items)
