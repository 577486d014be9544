"""A moved stream (its decode engine failed or lost it) is placed on another decode engine
while one has room: placed back, a dying engine would move it a second time."""

from __future__ import annotations

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    PendingRequest,
    SchedulerParams,
)
from dualpath.vocab import Policy

BIG = 10**9
P = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG)


def view(free_d1: int = BIG, d1_group: str = "D1", d0_tok: int = 0,
         d1_tok: int = 0) -> ClusterView:
    return ClusterView((EngineView("p0", "prefill", 0, "P0"),
                        EngineView("d0", "decode", 1, "D0", free_kv_tokens=BIG, tok=d0_tok),
                        EngineView("d1", "decode", 2, d1_group, free_kv_tokens=free_d1,
                                   tok=d1_tok)))


def decode_of(request: PendingRequest, cluster: ClusterView | None = None,
              params: SchedulerParams = P) -> str:
    scheduler = GlobalScheduler(params)
    scheduler.submit(request)
    (assignment,) = scheduler.schedule(cluster or view())
    return assignment.decode


def test_a_moved_stream_skips_the_engine_it_left_in_its_own_group_or_another():
    assert decode_of(PendingRequest(1, 1000, 960)) == "d0"  # the tie's winner
    assert decode_of(PendingRequest(1, 1000, 960, left_engine="d0")) == "d1"
    assert decode_of(PendingRequest(1, 1000, 960, left_engine="d0"), view(d1_group="D0")) == "d1"
    # even when the engine it left is the less loaded one
    for group in ("D0", "D1"):
        assert decode_of(PendingRequest(1, 1000, left_engine="d0"),
                         view(d1_tok=5000, d1_group=group)) == "d1"
        assert decode_of(PendingRequest(1, 1000, left_engine="d1"),
                         view(d0_tok=5000, d1_group=group)) == "d0"


def test_the_engine_it_left_takes_it_when_no_other_has_room_and_warmth_does_not_pull_it_back():
    for group in ("D0", "D1"):
        assert decode_of(PendingRequest(1, 1000, left_engine="d0"),
                         view(free_d1=999, d1_group=group)) == "d0"
    assert decode_of(PendingRequest(1, 1000, 960, warm_engine="d0", left_engine="d0"),
                     view(d1_group="D0")) == "d1"
    assert decode_of(PendingRequest(1, 1000, left_engine="d7")) == "d0"  # gone: no matter


def test_round_robin_passes_the_engine_it_left():
    params = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG, policy=Policy.ROUND_ROBIN)
    assert decode_of(PendingRequest(1, 1000), params=params) == "d0"
    assert decode_of(PendingRequest(1, 1000, left_engine="d0"), params=params) == "d1"
    assert decode_of(PendingRequest(1, 1000, left_engine="d0"), view(free_d1=10),
                     params=params) == "d0"


def test_the_field_survives_a_recorded_log():
    request = PendingRequest(3, 100, left_engine="d1")
    assert PendingRequest.from_dict(request.to_dict()) == request
