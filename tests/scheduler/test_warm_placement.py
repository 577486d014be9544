"""Warm sessions in the scheduler: a request whose session's blocks are in a DE's DRAM goes
to that DE and reads there (the DE path), unless the DE is full or overloaded, its mode reads
on the PE, or it forces its own path."""

from __future__ import annotations

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    PendingRequest,
    SchedulerParams,
)
from dualpath.scheduler.rules import ReadWish, read_plan
from dualpath.vocab import ReadPath

BIG = 10**9
P = SchedulerParams(alpha_tokens=BIG, beta_tokens=BIG)


def view(free_d1: int = BIG, tok_d1: int = 0, d1_group: str = "D1") -> ClusterView:
    return ClusterView((EngineView("p0", "prefill", 0, "P0"),
                        EngineView("d0", "decode", 1, "D0", free_kv_tokens=BIG),
                        EngineView("d1", "decode", 2, d1_group, free_kv_tokens=free_d1,
                                   tok=tok_d1)))


def place(request: PendingRequest, cluster: ClusterView | None = None):
    scheduler = GlobalScheduler(P)
    scheduler.submit(request)
    (assignment,) = scheduler.schedule(cluster or view())
    return assignment


def test_a_warm_request_goes_to_its_de_and_reads_there():
    cold = place(PendingRequest(1, 1000, 960))
    assert (cold.decode, cold.read_path) == ("d0", ReadPath.PE)  # the shorter queue's tie
    warm = place(PendingRequest(1, 1000, 960, warm_engine="d1"))
    assert (warm.decode, warm.read_path) == ("d1", ReadPath.DE)
    assert (warm.pe_read_tokens, warm.de_read_tokens) == (0, 960)
    same_group = place(PendingRequest(1, 1000, 960, warm_engine="d1"), view(d1_group="D0"))
    assert (same_group.decode, same_group.read_path) == ("d1", ReadPath.DE)


def test_a_full_or_overloaded_warm_de_is_passed_over():
    full = place(PendingRequest(1, 1000, 960, warm_engine="d1"), view(free_d1=999))
    assert full.decode == "d0" and full.read_path == ReadPath.PE
    busy = place(PendingRequest(1, 1000, 960, warm_engine="d1"),
                 view(tok_d1=10**8, d1_group="D0"))  # another DE of its group is idle
    assert busy.decode == "d0"
    one_more = place(PendingRequest(1, 1000, 960, warm_engine="d1"),
                     view(tok_d1=1000, d1_group="D0"))  # one request like it beyond the idle one
    assert one_more.decode == "d1"
    two_more = place(PendingRequest(1, 1000, 960, warm_engine="d1"),
                     view(tok_d1=1001, d1_group="D0"))
    assert two_more.decode == "d0"


def test_a_warm_engine_that_is_not_there_changes_nothing():
    gone = place(PendingRequest(1, 1000, 960, warm_engine="d9"))
    assert (gone.decode, gone.read_path) == ("d0", ReadPath.PE)


def test_modes_and_forced_paths_keep_their_read_side():
    pe_only = place(PendingRequest(1, 1000, 960, pe_only=True, warm_engine="d1"))
    assert pe_only.decode == "d1" and pe_only.read_path == ReadPath.PE
    forced = place(PendingRequest(1, 1000, 960, read_path=ReadPath.PE, warm_engine="d1"))
    assert forced.read_path == ReadPath.PE
    assert read_plan(960, 10**6, 0, P, ReadWish(warm_de=True)) == (ReadPath.DE, 0, 960)
    assert read_plan(960, 0, 10**6, P, ReadWish(warm_de=True)) == (ReadPath.DE, 0, 960)
    assert read_plan(960, 0, 0, P, ReadWish(warm_de=True), scheduled=ReadPath.PE)[0] == \
        ReadPath.PE  # round robin's turn


def test_a_turn_is_prefilled_on_its_decode_engine_only_with_little_to_compute_and_room():
    from dualpath.scheduler.rules import prefill_on_de

    assert prefill_on_de(1000, 960, free_kv_tokens=1000, max_local_tokens=64)
    assert prefill_on_de(1000, 936, free_kv_tokens=1000, max_local_tokens=64)  # 64: the most
    assert not prefill_on_de(1000, 935, free_kv_tokens=1000, max_local_tokens=64)
    assert not prefill_on_de(1000, 960, free_kv_tokens=999, max_local_tokens=64)  # no room
    assert not prefill_on_de(1000, 1000, free_kv_tokens=4000, max_local_tokens=64)  # nothing
    assert not prefill_on_de(40, 0, free_kv_tokens=4000, max_local_tokens=0)  # off
    # the warm DE holds at most this turn's tokens beyond the least loaded DE with room
    assert prefill_on_de(1000, 960, 1000, 64, de_tok=3000, least_tok=2000)
    assert not prefill_on_de(1000, 960, 1000, 64, de_tok=3001, least_tok=2000)
