"""Read-path choice (docs/paper.md §5.4): shorter node queue, ties, split reads, in-call queue
updates."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    NodeView,
    PendingRequest,
    SchedulerParams,
    choose_read_path,
    read_plan,
    split_read,
)


def test_shorter_queue_wins_and_a_tie_goes_to_the_pe():
    assert choose_read_path(10, 20) == "pe"
    assert choose_read_path(20, 10) == "de"
    assert choose_read_path(15, 15) == "pe"


@pytest.mark.parametrize(("hit", "pe_q", "de_q", "expected"), [
    (128, 0, 0, (64, 64)),  # equal queues: half each
    (192, 0, 0, (128, 64)),  # an odd number of blocks: the extra one to the PE
    (640, 0, 256, (448, 192)),  # both queues end at 448
    (640, 0, 64, (384, 256)),  # 5.5 blocks rounds to 6 on the PE side
    (640, 1000, 0, (0, 640)),  # the PE queue is longer than the whole hit: all on the DE
    (640, 0, 5000, (640, 0)),  # and the other way round
    (100, 0, 0, (64, 36)),  # a trailing partial block stays on the DE side
    (0, 10, 0, (0, 0)),
])
def test_split_levels_the_two_queues_in_whole_blocks(hit, pe_q, de_q, expected):
    pe, de = split_read(hit, pe_q, de_q, block_size=64)
    assert (pe, de) == expected
    assert pe + de == hit


def test_split_rejects_bad_input():
    with pytest.raises(ValueError):
        split_read(-1, 0, 0, 64)
    with pytest.raises(ValueError):
        split_read(64, 0, 0, 0)


def test_read_plan_auto_forced_and_split():
    auto = SchedulerParams(alpha_tokens=0, beta_tokens=0)
    assert read_plan(640, 100, 50, auto) == ("de", 0, 640)
    assert read_plan(640, 50, 50, auto) == ("pe", 640, 0)
    forced = SchedulerParams(alpha_tokens=0, beta_tokens=0, read_path="pe")
    assert read_plan(640, 10_000, 0, forced) == ("pe", 640, 0)
    split = SchedulerParams(alpha_tokens=0, beta_tokens=0, split_read=True)
    assert read_plan(640, 0, 256, split) == ("split", 448, 192)
    assert read_plan(640, 0, 5000, split) == ("pe", 640, 0)  # degenerate split: one side
    assert read_plan(640, 5000, 0, split) == ("de", 0, 640)
    assert read_plan(0, 5, 0, split) == ("de", 0, 0)  # nothing to read: plain choice


def _view(pe_q: int, de_q: int) -> ClusterView:
    engines = (EngineView("pe", "prefill", 0, "P"),
               EngineView("de", "decode", 1, "D", free_kv_tokens=1_000_000))
    return ClusterView(engines, (NodeView(0, pe_q), NodeView(1, de_q)))


def test_read_queues_grow_within_one_call():
    scheduler = GlobalScheduler(SchedulerParams(alpha_tokens=10**9, beta_tokens=10**9))
    for i in range(4):
        scheduler.submit(PendingRequest(i, 1000, 100))
    out = scheduler.schedule(_view(pe_q=0, de_q=150))
    # pe 0 ≤ 150 → pe (100); 100 ≤ 150 → pe (200); 200 > 150 → de (250); 200 ≤ 250 → pe
    assert [a.read_path for a in out] == ["pe", "pe", "de", "pe"]
    assert [(a.pe_read_tokens, a.de_read_tokens) for a in out] == [
        (100, 0), (100, 0), (0, 100), (100, 0)]


def test_scheduler_splits_reads_when_enabled():
    params = SchedulerParams(alpha_tokens=10**9, beta_tokens=10**9, split_read=True)
    scheduler = GlobalScheduler(params)
    scheduler.submit(PendingRequest(0, 1000, 640))
    scheduler.submit(PendingRequest(1, 1000, 640))
    first, second = scheduler.schedule(_view(pe_q=0, de_q=256))
    assert (first.read_path, first.pe_read_tokens, first.de_read_tokens) == ("split", 448, 192)
    # both queues now hold 448: the second request splits evenly
    assert (second.read_path, second.pe_read_tokens, second.de_read_tokens) == (
        "split", 320, 320)
    assert first.num_hit_tokens == 640


def test_a_requests_own_wishes_settle_its_read_plan():
    from dualpath.scheduler.rules import ReadWish

    auto = SchedulerParams(alpha_tokens=0, beta_tokens=0, block_size=64)
    split = SchedulerParams(alpha_tokens=0, beta_tokens=0, block_size=64, split_read=True)
    # a mode that reads on the PE does, whatever the queues say
    assert read_plan(640, 10_000, 0, auto, ReadWish(pe_only=True)) == ("pe", 640, 0)
    # a forced path wins over the queues; a forced split halves the hit (10 blocks: 5 + 5)
    assert read_plan(640, 0, 10_000, auto, ReadWish("de")) == ("de", 0, 640)
    assert read_plan(640, 0, 10_000, auto, ReadWish("split")) == ("split", 320, 320)
    assert read_plan(64, 0, 0, auto, ReadWish("split")) == ("pe", 64, 0)  # 1 block: no split
    assert read_plan(0, 0, 0, auto, ReadWish("split")) == ("pe", 0, 0)  # nothing to read
    # the PE's host pool: a hit it cannot take now goes to the DE, unless the path was forced
    assert read_plan(640, 0, 100, auto, ReadWish(free_host_blocks=9)) == ("de", 0, 640)
    assert read_plan(640, 0, 100, auto, ReadWish(free_host_blocks=10)) == ("pe", 640, 0)
    assert read_plan(640, 0, 100, auto, ReadWish("pe", free_host_blocks=0)) == ("pe", 640, 0)
    assert read_plan(640, 0, 256, split, ReadWish(free_host_blocks=7)) == ("split", 448, 192)
    assert read_plan(640, 0, 256, split, ReadWish(free_host_blocks=6)) == ("de", 0, 640)
    # round robin's turn is the scheduler's choice the wishes then settle
    assert read_plan(640, 0, 0, auto, ReadWish(), scheduled="de") == ("de", 0, 640)
    assert read_plan(640, 0, 0, auto, ReadWish(free_host_blocks=0), scheduled="pe") == (
        "de", 0, 640)


def test_the_pe_host_pool_fills_within_one_call():
    """Two 6-block hits on a PE whose pool has room for 10: the second goes to the DE."""
    scheduler = GlobalScheduler(SchedulerParams(alpha_tokens=10**9, beta_tokens=10**9,
                                                block_size=64))
    for req_id in (1, 2):
        scheduler.submit(PendingRequest(req_id, 400, 384))
    engines = (EngineView("pe", "prefill", 0, "P", free_host_blocks=10),
               EngineView("de", "decode", 1, "D", free_kv_tokens=1_000_000))
    out = scheduler.schedule(ClusterView(engines, (NodeView(0, 0), NodeView(1, 10_000))))
    assert [(a.req_id, a.read_path, a.pe_read_tokens) for a in out] == [
        (1, "pe", 384), (2, "de", 0)]
