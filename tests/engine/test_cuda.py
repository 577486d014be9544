"""The same engine on a CUDA device gives the CPU's greedy tokens (skipped without CUDA)."""

from __future__ import annotations

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.request import SamplingParams


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu(smollm2_dir):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        engine = LLMEngine(smollm2_dir, EngineConfig(dtype="float32", device=device))
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers."}])
        outs[device] = engine.generate([ids], params)[0].output_ids
        sampled = engine.generate([ids], SamplingParams(max_tokens=8, temperature=1.0, seed=1))
        assert len(sampled[0].output_ids) >= 1
    assert outs["cpu"] == outs["cuda"]
