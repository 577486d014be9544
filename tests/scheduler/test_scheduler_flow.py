"""GlobalScheduler end to end: queues, held PEs, fetching groups, rotation, round robin."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    PendingRequest,
    SchedulerParams,
)

BIG = 10**9
P = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG)


def pe(name: str, node: int, group: str, tok: int = 0) -> EngineView:
    return EngineView(name, "prefill", node, group, tok=tok)


def de(name: str, node: int, group: str, free: int = BIG, tok: int = 0) -> EngineView:
    return EngineView(name, "decode", node, group, tok=tok, free_kv_tokens=free)


def submit(scheduler: GlobalScheduler, *sizes: int, start: int = 0) -> None:
    for i, n in enumerate(sizes, start):
        scheduler.submit(PendingRequest(i, n, n // 2))


def pairs(out) -> list[tuple[int, str, str]]:
    return [(a.req_id, a.prefill, a.decode) for a in out]


def test_every_request_gets_a_complete_assignment_in_submission_order():
    view = ClusterView((pe("p0", 0, "P0"), pe("p1", 1, "P1"), de("d0", 2, "D0"),
                        de("d1", 3, "D1")))
    scheduler = GlobalScheduler(P)
    submit(scheduler, 100, 200, 300)
    out = scheduler.schedule(view)
    assert [a.req_id for a in out] == [0, 1, 2]
    # one PE group fetches first and takes all (β is huge); phase 1 alternates the DE groups
    assert pairs(out) == [(0, "p0", "d0"), (1, "p0", "d1"), (2, "p0", "d0")]
    assert all(a.num_hit_tokens == a.pe_read_tokens + a.de_read_tokens for a in out)
    assert len(scheduler) == 0 and scheduler.queued() == []


def test_a_request_without_a_de_holds_its_pe_and_stays_queued_in_order():
    scheduler = GlobalScheduler(P)
    full = ClusterView((pe("p0", 0, "P"), pe("p1", 0, "P"), de("d0", 1, "D", free=500)))
    submit(scheduler, 1000)
    assert scheduler.schedule(full) == []  # r0 holds p0, no DE has 1000 free
    submit(scheduler, 100, start=1)
    assert scheduler.schedule(full) == []  # r1: p0 counts r0's 1000 → p1; r0 blocks the DE
    assert scheduler.queued() == [0, 1]
    freed = ClusterView((pe("p0", 0, "P"), pe("p1", 0, "P"), de("d0", 1, "D", free=2000)))
    assert pairs(scheduler.schedule(freed)) == [(0, "p0", "d0"), (1, "p1", "d0")]
    submit(scheduler, 10, start=2)  # nothing is held any more: p0 wins the tie again
    assert pairs(scheduler.schedule(freed)) == [(2, "p0", "d0")]


def test_only_fetching_groups_take_work():
    view = ClusterView((pe("p0", 0, "P0"), pe("p1", 1, "P1"), de("d0", 2, "D")))
    scheduler = GlobalScheduler(P)
    submit(scheduler, 100, 100)
    assert pairs(scheduler.schedule(view, fetching={"P1", "D"}))[0] == (0, "p1", "d0")
    scheduler = GlobalScheduler(P)
    submit(scheduler, 100)
    assert scheduler.schedule(view, fetching={"P0"}) == []  # no DE group fetches
    assert scheduler.queued() == [0]
    assert pairs(scheduler.schedule(view, fetching={"D"})) == [(0, "p0", "d0")]


def test_pe_groups_take_turns_fetching_first():
    view = ClusterView((pe("p0", 0, "P0"), pe("p1", 1, "P1"), de("d0", 2, "D")))
    scheduler = GlobalScheduler(P)
    firsts = []
    for i in range(4):
        scheduler.submit(PendingRequest(i, 10))
        firsts.append(scheduler.schedule(view)[0].prefill)
    assert firsts == ["p0", "p1", "p0", "p1"]


def test_phase1_counts_a_group_private_queue():
    view = ClusterView((pe("p0", 0, "P"), de("d0", 1, "D0", free=0),
                        de("d1", 2, "D1", tok=500)))
    scheduler = GlobalScheduler(P)
    submit(scheduler, 1000)
    assert scheduler.schedule(view) == []  # D0 has the fewest tokens but no memory
    submit(scheduler, 100, start=1)
    assert pairs(scheduler.schedule(view)) == [(1, "p0", "d1")]  # D0 counts its 1000 queued


def test_duplicate_ids_are_rejected_while_queued():
    scheduler = GlobalScheduler(P)
    scheduler.submit(PendingRequest(7, 10))
    with pytest.raises(ValueError):
        scheduler.submit(PendingRequest(7, 20))
    scheduler.schedule(ClusterView((pe("p", 0, "P"), de("d", 1, "D"))))
    scheduler.submit(PendingRequest(7, 20))  # assigned ids may come back (a next turn)


def test_requests_return_to_queue_when_their_engine_disappears():
    scheduler = GlobalScheduler(P)
    submit(scheduler, 1000)
    before = ClusterView((pe("p0", 0, "P"), pe("p1", 0, "P"), de("d0", 1, "D0", free=0)))
    assert scheduler.schedule(before) == []  # r0 holds p0 and waits in D0's queue
    after = ClusterView((pe("p1", 0, "P"), de("d1", 2, "D1")))  # p0 and D0 are gone
    assert pairs(scheduler.schedule(after)) == [(0, "p1", "d1")]
    scheduler = GlobalScheduler(P)
    submit(scheduler, 1000)
    assert scheduler.schedule(before) == []
    moved = ClusterView((pe("p0", 0, "P"), de("d1", 2, "D1")))  # only the DE group changed
    assert pairs(scheduler.schedule(moved)) == [(0, "p0", "d1")]


# --- round robin -----------------------------------------------------------------------------

RR = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG, policy="round_robin")


def _rr_view(**free: int) -> ClusterView:
    return ClusterView((pe("p0", 0, "P"), pe("p1", 0, "P"), de("d0", 1, "D", free.get("d0", BIG)),
                        de("d1", 1, "D", free.get("d1", BIG)),
                        de("d2", 1, "D", free.get("d2", BIG))))


def test_round_robin_rotates_engines_and_alternates_read_paths():
    scheduler = GlobalScheduler(RR)
    submit(scheduler, *[10] * 5)
    out = scheduler.schedule(_rr_view())
    assert pairs(out) == [(0, "p0", "d0"), (1, "p1", "d1"), (2, "p0", "d2"), (3, "p1", "d0"),
                          (4, "p0", "d1")]
    assert [a.read_path for a in out] == ["pe", "de", "pe", "de", "pe"]
    submit(scheduler, 10, start=5)
    (nxt,) = scheduler.schedule(_rr_view())  # the rotation carries over calls
    assert (nxt.prefill, nxt.decode, nxt.read_path) == ("p1", "d2", "de")


def test_round_robin_skips_overloaded_pes_and_des_without_memory():
    params = SchedulerParams(alpha_tokens=BIG, beta_tokens=100, policy="round_robin")
    view = ClusterView((pe("p0", 0, "P", tok=101), pe("p1", 0, "P"),
                        de("d0", 1, "D", free=5), de("d1", 1, "D")))
    scheduler = GlobalScheduler(params)
    submit(scheduler, 60, 60, 60)
    # p1 takes two (0 → 60 → 120 > β), then no PE is left; d0 never has memory
    assert pairs(scheduler.schedule(view)) == [(0, "p1", "d1"), (1, "p1", "d1")]
    assert scheduler.queued() == [2]


def test_round_robin_with_a_forced_read_path():
    params = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG, policy="round_robin",
                             read_path="de")
    scheduler = GlobalScheduler(params)
    submit(scheduler, 10, 10)
    assert [a.read_path for a in scheduler.schedule(_rr_view())] == ["de", "de"]
