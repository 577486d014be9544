"""Online statistics and the APS capacity rule."""

import pytest

from dualpath.sim.online import aps_capacity, latency_stats, meets_slo


def test_latency_stats_use_the_steady_window():
    # (submit, prefilled, decode_start, done, generated)
    records = [(0.0, 9.0, 9.5, 19.5, 10),  # in the warm-up: excluded
               (50.0, 51.0, 51.2, 52.2, 10), (100.0, 102.0, 102.1, 103.1, 10)]
    out = latency_stats(records, 0.05, warmup=0.2)
    assert out["requests"] == 2
    assert out["ttft_s"] == pytest.approx(1.5)
    assert out["tpot_s"] == pytest.approx(0.1)
    assert out["ttst_s"] == pytest.approx((1.2 + 0.1 + 2.1 + 0.1) / 2)
    assert latency_stats([], 0.05) == {"requests": 0}


def test_capacity_interpolates_where_ttft_crosses_the_slo():
    rows = [{"mode": "m", "aps": a, "ttft_s": t, "tpot_s": 0.04}
            for a, t in ((0.1, 1.0), (0.2, 2.0), (0.3, 6.0), (0.4, 3.0))]
    assert aps_capacity(rows, "m") == pytest.approx(0.25)  # 0.4 passing again does not count
    assert aps_capacity(rows, "m", tpot_slo_s=0.03) is None
    assert aps_capacity([{"mode": "m", "aps": 0.1, "ttft_s": 1.0, "tpot_s": 0.1}], "m") == 0.1
    assert not meets_slo({"ttft_s": 1.0, "tpot_s": 0.1}, tpot_slo_s=0.05)
    assert meets_slo({"ttft_s": 1.0, "tpot_s": 0.1})
