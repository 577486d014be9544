"""PE selection by Algorithm 1 (docs/paper.md §5.2): classes C1/C2/C3, least tokens, FIFO, ties."""

from __future__ import annotations

import pytest

from dualpath.scheduler import EngineLoad, PendingRequest, SchedulerParams, pe_fetch

P = SchedulerParams(alpha_tokens=100, beta_tokens=1000)


def pe(name: str, node: int, tok: int = 0) -> EngineLoad:
    return EngineLoad(name, node, seq=0, tok=tok, free_kv_tokens=0)


def reqs(*sizes: int) -> list[PendingRequest]:
    return [PendingRequest(i, n) for i, n in enumerate(sizes)]


def picks(pairs) -> list[tuple[int, str]]:
    return [(r.req_id, name) for r, name in pairs]


def test_short_read_queue_class_wins_over_fewer_tokens():
    engines = [pe("a", node=0, tok=500), pe("b", node=1, tok=0)]
    out = pe_fetch(reqs(10), engines, {0: 50, 1: 500}, P)  # node 0 short (C2), node 1 long (C3)
    assert picks(out) == [(0, "a")]


def test_alpha_boundary_read_queue_equal_to_alpha_is_short():
    engines = [pe("a", node=0, tok=900), pe("b", node=1, tok=0)]
    assert picks(pe_fetch(reqs(1), engines, {0: 100, 1: 0}, P)) == [(0, "b")]  # both C2
    engines = [pe("a", node=0, tok=900), pe("b", node=1, tok=0)]
    assert picks(pe_fetch(reqs(1), engines, {0: 100, 1: 101}, P)) == [(0, "a")]  # b is C3


def test_least_tokens_first_within_a_class():
    engines = [pe("a", 0, 300), pe("b", 0, 100), pe("c", 0, 200)]
    assert picks(pe_fetch(reqs(1), engines, {}, P)) == [(0, "b")]


def test_chosen_engine_tokens_grow_within_the_fetch():
    engines = [pe("a", 0, 0), pe("b", 0, 50)]
    out = pe_fetch(reqs(100, 100, 100), engines, {}, P)
    assert picks(out) == [(0, "a"), (1, "b"), (2, "a")]  # a:0→100, b:50→150, a:100→200
    assert (engines[0].tok, engines[1].tok) == (200, 150)
    assert (engines[0].seq, engines[1].seq) == (2, 1)


def test_overloaded_engine_never_receives_work():
    engines = [pe("a", 0, 1001), pe("b", 1, 0)]  # a is C1 although its node is short
    out = pe_fetch(reqs(1, 1), engines, {0: 0, 1: 10_000}, P)
    assert picks(out) == [(0, "b"), (1, "b")]
    assert engines[0].tok == 1001


def test_tokens_equal_to_beta_still_take_one_more_request():
    engines = [pe("a", 0, 1000)]
    assert picks(pe_fetch(reqs(5, 5), engines, {}, P)) == [(0, "a")]  # 1000 → 1005 > β
    assert engines[0].tok == 1005


def test_fetch_ends_when_every_engine_becomes_overloaded():
    params = SchedulerParams(alpha_tokens=100, beta_tokens=250)
    engines = [pe("a", 0, 0)]
    out = pe_fetch(reqs(100, 100, 100, 100), engines, {}, params)
    assert picks(out) == [(0, "a"), (1, "a"), (2, "a")]  # 0 → 100 → 200 → 300 > β
    assert engines[0].tok == 300


def test_all_engines_overloaded_ends_the_fetch_at_once():
    engines = [pe("a", 0, 1001), pe("b", 1, 5000)]
    waiting = reqs(1, 2)
    assert pe_fetch(waiting, engines, {}, P) == []
    assert [r.req_id for r in waiting] == [0, 1]  # the waiting queue is not consumed


def test_falls_back_to_long_queue_class_when_short_class_is_overloaded():
    params = SchedulerParams(alpha_tokens=100, beta_tokens=150)
    engines = [pe("short", 0, 0), pe("long", 1, 0)]
    out = pe_fetch(reqs(100, 100, 100), engines, {0: 0, 1: 1000}, params)
    assert picks(out) == [(0, "short"), (1, "short"), (2, "long")]  # short: 0→100→200 > β


def test_requests_leave_in_fifo_order():
    engines = [pe(f"e{i}", 0, 0) for i in range(3)]
    out = pe_fetch(reqs(300, 10, 200, 50), engines, {}, P)
    assert [r.req_id for r, _ in out] == [0, 1, 2, 3]


def test_ties_are_broken_by_engine_name():
    engines = [pe("b", 0, 7), pe("a", 1, 7), pe("c", 0, 7)]
    out = pe_fetch(reqs(1, 1, 1), engines, {}, P)
    assert picks(out) == [(0, "a"), (1, "b"), (2, "c")]


def test_unknown_node_has_an_empty_read_queue():
    engines = [pe("a", 7, 500), pe("b", 1, 0)]
    assert picks(pe_fetch(reqs(1), engines, {1: 10_000}, P)) == [(0, "a")]


def test_params_from_profiled_rates():
    params = SchedulerParams.from_rates(read_tokens_per_s=1_000_000, prefill_tokens_per_s=20_000)
    assert (params.alpha_tokens, params.beta_tokens) == (3_000_000, 100_000)
    assert params.z_factor == 1.05 and params.policy == "dualpath" and not params.split_read
    params = SchedulerParams.from_rates(1000, 10, alpha_s=1.0, beta_s=2.0, split_read=True)
    assert (params.alpha_tokens, params.beta_tokens, params.split_read) == (1000, 20, True)
    assert SchedulerParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("kwargs", [
    {"alpha_tokens": -1, "beta_tokens": 1}, {"alpha_tokens": 1, "beta_tokens": 1, "z_factor": 0},
    {"alpha_tokens": 1, "beta_tokens": 1, "policy": "random"},
    {"alpha_tokens": 1, "beta_tokens": 1, "read_path": "both"},
    {"alpha_tokens": 1, "beta_tokens": 1, "block_size": 0},
])
def test_bad_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SchedulerParams(**kwargs)


def test_from_rates_rejects_non_positive_rates():
    with pytest.raises(ValueError):
        SchedulerParams.from_rates(0, 10)
