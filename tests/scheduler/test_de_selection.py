"""DE selection (docs/paper.md §5.3): phase 1 across groups, phase 2 with R, Z and the memory
check."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    EngineLoad,
    PendingRequest,
    SchedulerParams,
    de_phase1,
    de_phase2,
    high_token_threshold,
)

P = SchedulerParams(alpha_tokens=0, beta_tokens=0)


def de(name: str, tok: int = 0, seq: int = 0, free: int = 10_000) -> EngineLoad:
    return EngineLoad(name, node_id=0, seq=seq, tok=tok, free_kv_tokens=free)


def reqs(*sizes: int) -> list[PendingRequest]:
    return [PendingRequest(i, n) for i, n in enumerate(sizes)]


def picks(pairs) -> list[tuple[int, str]]:
    return [(r.req_id, name) for r, name in pairs]


# --- phase 1 ---------------------------------------------------------------------------------


def test_phase1_sends_each_request_to_the_group_with_fewest_tokens():
    group_tok = {"A": 300, "B": 100, "C": 100}
    out = de_phase1(reqs(50, 100, 30, 500), group_tok)
    # B (tie with C, by name) 100→150; C 100→200; B 150→180; B 180→680
    assert picks(out) == [(0, "B"), (1, "C"), (2, "B"), (3, "B")]
    assert group_tok == {"A": 300, "B": 680, "C": 200}


def test_phase1_without_groups_places_nothing():
    assert de_phase1(reqs(1), {}) == []


# --- phase 2 ---------------------------------------------------------------------------------


def test_worked_example_of_r_z_and_the_memory_check():
    """Two DEs: d0 (tok 1000, seq 2), d1 (tok 3000, seq 1), 5000 free each.

    Queue 2000, 2000, 4000, 3000: 2000+2000+4000 = 8000 fits the 10000 free, +3000 does not,
    so R holds the first three and Z = 1.05 × (8000 + 1000 + 3000) / 2 = 6300.
    r0 (2000): neither DE goes above Z → least seq: d1 (tok 5000, seq 2, free 3000).
    r1 (2000): d1 would reach 7000 > Z → d0, the only one below (tok 3000, free 3000).
    r2 (4000): 6000 KV is free in the group but no single DE has 4000 → the fetch ends.
    """
    engines = [de("d0", tok=1000, seq=2, free=5000), de("d1", tok=3000, seq=1, free=5000)]
    queue = reqs(2000, 2000, 4000, 3000)
    assert high_token_threshold(queue, engines, 1.05) == pytest.approx(6300.0)
    assert picks(de_phase2(queue, engines, P)) == [(0, "d1"), (1, "d0")]
    assert [(e.tok, e.seq, e.free_kv_tokens) for e in engines] == [(3000, 3, 3000),
                                                                   (5000, 2, 3000)]


def test_r_is_the_head_of_the_queue_that_fits_in_summed_memory():
    engines = [de("d0", tok=100, free=2500), de("d1", tok=300, free=2500)]
    # 6000 does not fit 5000 → R is empty even though 1000 behind it would fit
    assert high_token_threshold(reqs(6000, 1000), engines, 1.0) == pytest.approx(200.0)
    assert high_token_threshold(reqs(1000, 4000, 1), engines, 2.0) == pytest.approx(
        2.0 * (5000 + 400) / 2)


def test_prefers_least_requests_among_des_below_z():
    # R = both requests: Z = 1.05 × (2100 + 600) / 3 = 945, so b (500 + 100) is still below Z
    engines = [de("a", tok=0, seq=3), de("b", tok=500, seq=1), de("c", tok=100, seq=2)]
    assert picks(de_phase2(reqs(100, 2000), engines, P))[0] == (0, "b")


def test_least_tokens_among_high_token_des_when_none_stays_below_z():
    # R = {5000}: Z = 1.05 × (5000 + 9000) / 3 = 4900; every DE + 5000 exceeds it
    engines = [de("a", tok=4000, seq=0), de("b", tok=2000, seq=5), de("c", tok=3000, seq=0)]
    assert picks(de_phase2(reqs(5000), engines, P)) == [(0, "b")]


def test_a_low_token_de_without_memory_is_skipped():
    engines = [de("low", tok=0, free=10), de("high", tok=5000, free=10_000)]
    assert picks(de_phase2(reqs(100), engines, P)) == [(0, "high")]


def test_no_de_with_enough_memory_ends_the_fetch_even_if_later_requests_fit():
    engines = [de("a", free=1000), de("b", free=1000)]
    assert de_phase2(reqs(1500, 10), engines, P) == []
    assert [e.free_kv_tokens for e in engines] == [1000, 1000]


def test_fetch_stops_when_memory_runs_out():
    engines = [de("a", free=250)]
    assert picks(de_phase2(reqs(100, 100, 100), engines, P)) == [(0, "a"), (1, "a")]
    assert engines[0].free_kv_tokens == 50


def test_ties_among_low_des_go_to_fewer_tokens_then_name():
    engines = [de("b", tok=0), de("a", tok=0), de("c", tok=0, seq=0)]
    out = de_phase2(reqs(10, 10, 10), engines, P)
    assert picks(out) == [(0, "a"), (1, "b"), (2, "c")]
    engines = [de("a", tok=50, seq=1), de("b", tok=20, seq=1)]
    assert picks(de_phase2(reqs(10), engines, P)) == [(0, "b")]


def test_z_is_fixed_for_the_whole_fetch():
    # R = both (200): Z = 1.05 × 200 / 2 = 105; first request: both low → a (name)
    # second: a would reach 200 > 105 → b is the only low one
    engines = [de("a"), de("b")]
    assert picks(de_phase2(reqs(100, 100), engines, P)) == [(0, "a"), (1, "b")]


def test_empty_group_places_nothing():
    assert de_phase2(reqs(1), [], P) == []
