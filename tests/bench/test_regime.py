"""The regime figures' arithmetic (``dualpath/regime.py``)."""

from __future__ import annotations

import json
import math

import pytest

from dualpath.regime import (
    Regime,
    RegimeError,
    load_s_per_token,
    recompute_s_per_token,
    regime,
)


def test_the_papers_hit_rate_is_76_hit_tokens_per_computed_one():
    r = regime(987, 1000)
    assert r.hit_rate == pytest.approx(0.987)
    assert r.hit_per_computed == pytest.approx(987 / 13)  # 75.9
    assert r.kappa is None and r.rho is None  # no rates given: not measured, not guessed


def test_rho_is_basics_storage_demand_over_supply():
    """46,080 B/token over 16 MB/s: 2.88 ms a token; recomputing: 1.5 ms. A prefill node at
    full speed needs 4 hit tokens per computed one (h = 0.8): 4 x 2.88 ms of its NIC per
    1.5 ms of compute, so the NIC is 7.7x oversubscribed."""
    load_s = load_s_per_token(46_080, 16e6)
    assert load_s == pytest.approx(2.88e-3)
    r = regime(800, 1000, load_s, 1.5e-3)
    assert r.hit_per_computed == pytest.approx(4.0)
    assert r.kappa == pytest.approx(1.92)
    assert r.rho == pytest.approx(4.0 * 1.92)
    # the same demand measured as bytes per second, against the same supply
    demand_bytes_s = r.hit_per_computed * 46_080 / 1.5e-3
    assert demand_bytes_s / 16e6 == pytest.approx(r.rho)


def test_the_paper_regime_is_storage_bound_with_a_small_kappa():
    """DeepSeek-V3.2-like: 40 KB a token over a 50 GB/s NIC, 40K tokens/s of prefill per
    node: κ = 1/30; at h = 0.987 Basic needs 2.5x the NIC it has."""
    r = regime(987, 1000, load_s_per_token(40_000, 50e9), 1 / 40_000)
    assert r.kappa == pytest.approx(1 / 31.25)
    assert r.rho == pytest.approx(987 / 13 / 31.25)
    assert r.rho > 1 > r.kappa


def test_a_compute_bound_run_has_rho_below_one():
    r = regime(500, 1000, 1e-4, 1e-3)  # h = 0.5, κ = 0.1
    assert r.rho == pytest.approx(0.1) and r.rho < 1


def test_everything_hit_has_no_ratio_and_nothing_hit_has_zero():
    all_hit = regime(1000, 1000, 1e-3, 1e-3)
    assert all_hit.hit_per_computed is None and all_hit.rho is None and all_hit.kappa == 1.0
    none_hit = regime(0, 1000, 1e-3, 1e-3)
    assert none_hit.hit_rate == 0 and none_hit.hit_per_computed == 0 and none_hit.rho == 0
    assert regime(0, 0).hit_rate == 0  # an empty run


def test_the_json_form_is_the_four_named_figures():
    r = regime(950, 1000, 2e-4, 2e-3)
    data = json.loads(json.dumps(r.as_dict()))
    assert set(data) == {"hit_rate", "hit_per_computed", "kappa", "rho"}
    assert Regime(**data) == r
    assert all(v is None or math.isfinite(v) for v in data.values())


def test_describe_names_each_figure():
    line = regime(950, 1000, 2e-4, 2e-3).describe()
    assert line == "h 95.0%, 19.0 hit/computed, κ 0.1, ρ 1.9"
    assert regime(950, 1000).describe() == "h 95.0%, 19.0 hit/computed, κ -, ρ -"


def test_recompute_seconds_per_token():
    assert recompute_s_per_token(3.0, 1500) == pytest.approx(2e-3)
    assert recompute_s_per_token(0.0, 0) is None  # nothing computed: unknown, not zero


@pytest.mark.parametrize("call", [
    lambda: regime(11, 10), lambda: regime(-1, 10), lambda: regime(5, 10, 0.0, 1e-3),
    lambda: regime(5, 10, 1e-3, float("inf")), lambda: regime(5, 10, 1e-3, -1.0),
    lambda: load_s_per_token(0, 1e6), lambda: load_s_per_token(100, 0),
    lambda: recompute_s_per_token(-1.0, 5),
])
def test_figures_that_describe_no_run_are_refused(call):
    with pytest.raises(RegimeError):
        call()


def test_the_nic_for_a_kappa_inverts_load_over_recompute():
    from dualpath.regime import snic_bytes_s_for

    bytes_s = snic_bytes_s_for(0.08, 23_040, 0.69e-3)
    assert bytes_s == pytest.approx(417.4e6, rel=1e-3)  # the demo's bf16 SmolLM2 on an EPYC
    assert load_s_per_token(23_040, bytes_s) / 0.69e-3 == pytest.approx(0.08)
    for bad in [(0, 1, 1), (0.1, 0, 1), (0.1, 1, 0), (-1, 1, 1)]:
        with pytest.raises(RegimeError):
            snic_bytes_s_for(*bad)
