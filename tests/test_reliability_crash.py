"""Crash safety: writers SIGKILLed at random moments lose nothing they acknowledged.

The campaign and its invariants are documented in `tests/reliability/crash_harness.py`.
Quick mode (the normal run): 12 kills per store. Long mode (`TOKENCAPTURE_LONG=1`): 210 kills
per store. A failure message names the seed; `TOKENCAPTURE_CRASH_SEED=N` replays the same
operation choices (kill timing still varies).
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.reliability.common import long_mode
from tests.reliability.crash_harness import (
    CrashCampaign,
    CrashCheckError,
    Op,
    RolloutModel,
    parse_ack_log,
)
from tests.reliability.params import STORES

QUICK_KILLS = 12
LONG_KILLS = 210


def campaign_seed() -> int:
    fixed = os.environ.get("TOKENCAPTURE_CRASH_SEED")
    return int(fixed) if fixed else random.SystemRandom().getrandbits(32)


@pytest.mark.parametrize("kind", STORES)
def test_sigkill_campaign_loses_nothing_acknowledged(kind: str, tmp_path: Path) -> None:
    campaign = CrashCampaign(kind, tmp_path, seed=campaign_seed())
    report = campaign.run(QUICK_KILLS)
    print(report.summary())
    assert report.kills >= QUICK_KILLS
    assert report.acked_ops > 0 and report.entries_verified > 0


@pytest.mark.slow
@pytest.mark.skipif(not long_mode(), reason="long crash campaign: set TOKENCAPTURE_LONG=1")
@pytest.mark.parametrize("kind", STORES)
def test_sigkill_campaign_long(kind: str, tmp_path: Path) -> None:
    campaign = CrashCampaign(kind, tmp_path, seed=campaign_seed(), recheck_old=20)
    report = campaign.run(LONG_KILLS)
    print(report.summary())
    assert report.kills >= LONG_KILLS
    assert report.torn_writes > 0


# The checker itself: it must catch what it claims to catch. -------------------------------


@pytest.fixture(scope="module")
def checked_round(tmp_path_factory: pytest.TempPathFactory) -> CrashCampaign:
    """One verified round; each test breaks a copy of its model and expects the checker to
    object (the model is restored afterwards)."""
    campaign = CrashCampaign(
        "rust", tmp_path_factory.mktemp("checker"), seed=7, writers=2, torn_rate=0.0
    )
    campaign.run_round()
    return campaign


@pytest.fixture
def campaign(checked_round: CrashCampaign) -> Iterator[CrashCampaign]:
    saved = copy.deepcopy(checked_round.models)
    yield checked_round
    checked_round.models = saved


def rollout_with_entries(campaign: CrashCampaign) -> RolloutModel:
    for model in campaign.models.values():
        if model.live and model.last_ids:
            return model
    pytest.skip("the round acknowledged no entry (killed too early)")


def test_checker_flags_a_lost_acknowledged_put(campaign: CrashCampaign) -> None:
    rollout_with_entries(campaign).acked["never-written"] = "0" * 64
    with pytest.raises(CrashCheckError, match="acknowledged puts lost"):
        campaign.verify()


def test_checker_flags_an_unacknowledged_entry(campaign: CrashCampaign) -> None:
    model = rollout_with_entries(campaign)
    assert model.last_ids is not None
    call_id = model.last_ids[0]
    model.acked.pop(call_id)
    # A call whose later conflicting put was refused is named as such (both are flagged).
    why = "was a rejected put" if call_id in model.rejected else "never acknowledged"
    with pytest.raises(CrashCheckError, match=why):
        campaign.verify()


def test_checker_flags_bytes_that_differ(campaign: CrashCampaign) -> None:
    model = rollout_with_entries(campaign)
    assert model.last_ids is not None
    model.acked[model.last_ids[-1]] = "f" * 64
    with pytest.raises(CrashCheckError, match="byte-identical"):
        campaign.verify()


def test_checker_flags_a_version_that_goes_backwards(campaign: CrashCampaign) -> None:
    rollout_with_entries(campaign).max_version += 1
    with pytest.raises(CrashCheckError, match="version"):
        campaign.verify()


def test_checker_flags_a_lost_incomplete_mark(campaign: CrashCampaign) -> None:
    for model in campaign.models.values():
        if model.live and not model.flag_may and model.last_ids is not None:
            model.flag_must = model.flag_may = True
            break
    else:
        pytest.skip("every rollout of the round was marked incomplete")
    with pytest.raises(CrashCheckError, match="mark_incomplete"):
        campaign.verify()


def test_ack_log_parser_tolerates_a_torn_record_and_finds_the_call_in_flight(
    tmp_path: Path,
) -> None:
    log = tmp_path / "ack.log"
    log.write_bytes(
        b'{"t":"about","n":1,"op":"put","r":"a","c":"c1","sha":"x"}\n'
        b'{"t":"done","n":1,"res":"ok"}\n'
        b'{"t":"about","n":2,"op":"mark","r":"a","c":""}\n'
        b'{"t":"done","n":2,"re'
    )
    ops = parse_ack_log(log)
    assert [(op.op, op.res) for op in ops] == [("put", "ok"), ("mark", None)]
    assert isinstance(ops[0], Op) and ops[0].fields == {"r": "a", "c": "c1", "sha": "x"}
