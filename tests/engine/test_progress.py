"""The work loop's progress as the heartbeat reports it: every layer of a forward stamps it, so a
forward of many seconds still shows progress while a stuck loop does not."""

from __future__ import annotations

import time

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.model.hooks import LayerHooks
from dualpath.request import SamplingParams


def test_a_forward_stamps_progress_after_every_layer(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=16))
    stamps = []

    class Watch(LayerHooks):
        def before_layer(self, layer_idx: int) -> None:
            stamps.append(engine.runner.layer_done_s)

    seq = engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=1))
    step = engine.batcher.schedule()
    before = time.monotonic()
    engine.runner.run(engine.runner.prepare(step.items), Watch())
    assert stamps[0] < before <= stamps[1] <= stamps[-1] <= engine.runner.layer_done_s
    assert len(stamps) == engine.spec.num_layers and seq.block_table
