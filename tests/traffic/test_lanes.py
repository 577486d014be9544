"""The lane arbiter: weighted shares, no starvation, determinism, weight validation."""

from __future__ import annotations

from collections import Counter

import pytest

from dualpath.traffic.lanes import (
    DEFAULT_LANE_WEIGHTS,
    Lane,
    LaneArbiter,
    validate_weights,
    weights_from_pairs,
)

LOW = (Lane.KV_LOAD, Lane.KV_FORWARD, Lane.KV_SAVE)


def _shares(arbiter: LaneArbiter, backlogged: set[Lane], picks: int) -> Counter[Lane]:
    return Counter(arbiter.pick(backlogged) for _ in range(picks))


def test_high_lane_gets_99_percent_against_one_kv_lane():
    counts = _shares(LaneArbiter(), {Lane.HIGH, Lane.KV_FORWARD}, 10_000)
    assert abs(counts[Lane.HIGH] / 10_000 - 0.99) <= 0.005
    assert abs(counts[Lane.KV_FORWARD] / 10_000 - 0.01) <= 0.005
    assert set(counts) == {Lane.HIGH, Lane.KV_FORWARD}


def test_all_lanes_busy_share_by_weight():
    counts = _shares(LaneArbiter(), set(Lane), 10_200)
    assert counts[Lane.HIGH] == 9_900
    assert all(counts[lane] == 100 for lane in LOW)


def test_weight_one_lane_is_never_starved():
    arbiter = LaneArbiter()
    gaps, last = [], -1
    for i in range(5_000):
        if arbiter.pick({Lane.HIGH, Lane.KV_SAVE}) is Lane.KV_SAVE:
            gaps.append(i - last)
            last = i
    assert len(gaps) == 50
    assert max(gaps) <= 100  # at least one chunk in every 100


def test_kv_lane_backlogged_only_sometimes_still_gets_its_share():
    arbiter = LaneArbiter()
    picks = [arbiter.pick({Lane.HIGH, Lane.KV_LOAD} if i % 2 else {Lane.HIGH})
             for i in range(20_000)]
    assert picks.count(Lane.KV_LOAD) == pytest.approx(100, abs=2)  # 1% of its 10,000 turns


def test_only_low_lanes_share_equally():
    counts = _shares(LaneArbiter(), set(LOW), 9_000)
    assert all(counts[lane] == 3_000 for lane in LOW)
    pairs = _shares(LaneArbiter(), {Lane.KV_LOAD, Lane.KV_SAVE}, 1_000)
    assert pairs == {Lane.KV_LOAD: 500, Lane.KV_SAVE: 500}


def test_custom_weights_and_single_lane():
    weights = {Lane.HIGH: 3, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 2, Lane.KV_SAVE: 1}
    counts = _shares(LaneArbiter(weights), {Lane.KV_LOAD, Lane.KV_FORWARD}, 3_000)
    assert counts == {Lane.KV_FORWARD: 2_000, Lane.KV_LOAD: 1_000}
    assert _shares(LaneArbiter(), {Lane.KV_SAVE}, 10) == {Lane.KV_SAVE: 10}


def test_nothing_backlogged_picks_none():
    arbiter = LaneArbiter()
    assert arbiter.pick(()) is None
    assert arbiter.pick([Lane.HIGH]) is Lane.HIGH


def test_deterministic():
    def run() -> list[Lane | None]:
        arbiter = LaneArbiter()
        pattern = [set(Lane), {Lane.HIGH, Lane.KV_LOAD}, set(LOW), set()]
        return [arbiter.pick(pattern[i % 4]) for i in range(4_000)]

    assert run() == run()


def test_smooth_interleaving_spreads_the_low_lane():
    weights = {Lane.HIGH: 2, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 1, Lane.KV_SAVE: 1}
    arbiter = LaneArbiter(weights)
    picks = [arbiter.pick({Lane.HIGH, Lane.KV_LOAD}) for _ in range(6)]
    assert picks == [Lane.HIGH, Lane.KV_LOAD, Lane.HIGH] * 2  # not H, H, L


@pytest.mark.parametrize("weights", [
    {Lane.HIGH: 99, Lane.KV_LOAD: 1, Lane.KV_FORWARD: 1},  # a lane missing
    {**DEFAULT_LANE_WEIGHTS, Lane.KV_SAVE: 0},
    {**DEFAULT_LANE_WEIGHTS, Lane.KV_SAVE: -1},
    {**DEFAULT_LANE_WEIGHTS, Lane.KV_SAVE: 1.5},
    {**DEFAULT_LANE_WEIGHTS, Lane.KV_SAVE: True},
    {**DEFAULT_LANE_WEIGHTS, "bulk": 1},
])
def test_bad_weights_are_rejected(weights):
    with pytest.raises(ValueError):
        LaneArbiter(weights)


def test_weights_from_config_pairs():
    pairs = (("high", 99), ("kv_load", 1), ("kv_forward", 1), ("kv_save", 1))
    assert weights_from_pairs(pairs) == validate_weights(DEFAULT_LANE_WEIGHTS)
    with pytest.raises(ValueError, match="unknown lane"):
        weights_from_pairs((*pairs[:3], ("bulk", 1)))
    with pytest.raises(ValueError, match="twice"):
        weights_from_pairs((*pairs, ("high", 5)))
    with pytest.raises(ValueError):
        weights_from_pairs(pairs[:3])


def test_lane_is_a_string():
    assert Lane("kv_forward") is Lane.KV_FORWARD
    assert Lane.HIGH == "high" and str(Lane.KV_SAVE) == "kv_save"
