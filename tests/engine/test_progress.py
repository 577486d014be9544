"""The work's progress as the heartbeat reports it: every layer of a forward stamps it, and the
layer under way carries a budget (how long it should take), so a forward of many seconds — or
a single layer longer than the engine timeout — still shows progress while a stuck loop does
not."""

from __future__ import annotations

import time

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.progress import PRIOR_FLOPS_PER_S, LayerWork, StepClock
from dualpath.model.hooks import LayerHooks
from dualpath.request import SamplingParams


def test_a_forward_stamps_progress_after_every_layer_and_budgets_the_next(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=16))
    clock = engine.runner.clock
    stamps, budgets = [], []

    class Watch(LayerHooks):
        def before_layer(self, layer_idx: int) -> None:
            stamps.append(clock.progress_s)
            budgets.append(clock.budget_s())

    seq = engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=1))
    step = engine.batcher.schedule()
    before = time.monotonic()
    engine.runner.run(engine.runner.prepare(step.items), Watch())
    assert stamps[0] < before <= stamps[1] <= stamps[-1] <= clock.progress_s
    assert len(stamps) == engine.spec.num_layers and seq.block_table
    assert all(b > 0 for b in budgets) and clock.budget_s() == 0.0  # none between forwards


def test_the_first_layer_is_budgeted_from_its_work_and_later_ones_from_the_one_before():
    clock = StepClock(params_per_layer=1_000_000, attention_width=256, now_s=0.0)
    work = LayerWork(num_tokens=8192, num_pairs=8192 * 4096.5)
    flops = work.flops(1_000_000, 256)
    clock.begin(work, now_s=10.0)
    assert clock.budget_s() == pytest.approx(flops / PRIOR_FLOPS_PER_S)  # nothing timed yet
    clock.layer_done(now_s=16.0)  # the first layer took 6 s
    assert clock.progress_s == 16.0 and clock.budget_s() == pytest.approx(6.0)
    clock.layer_done(now_s=23.0)
    assert clock.budget_s() == pytest.approx(7.0)
    clock.end(now_s=23.5)
    assert clock.budget_s() == 0.0 and clock.progress_s == 23.5
    half = LayerWork(num_tokens=4096, num_pairs=work.num_pairs / 4)
    clock.begin(half, now_s=30.0)  # at the pace the last layer ran
    assert clock.budget_s() == pytest.approx(7.0 * half.flops(1_000_000, 256) / flops)


def test_a_step_hook_bounded_by_its_own_deadline_is_budgeted_at_it():
    """A decode step's EP exchange waits for its peers at most their grant timeout: while it
    waits, the budget is that timeout (a dead peer's exchange is not a hang), and after it none."""
    clock = StepClock(params_per_layer=1, attention_width=1, now_s=0.0)
    seen = []
    exchange = clock.bounded(lambda n: seen.append((n, clock.budget_s())), budget_s=5.0)
    exchange(7)
    assert seen == [(7, 5.0)] and clock.budget_s() == 0.0
    with pytest.raises(RuntimeError):
        clock.bounded(lambda n: (_ for _ in ()).throw(RuntimeError("peer")), 5.0)(1)
    assert clock.budget_s() == 0.0
