"""The same engine on a CUDA device gives the CPU's greedy tokens (skipped without CUDA).

Random-weight models only: the GPU check runs on machines without the default model's weights
(``tiny_chaotic_dir`` varies its greedy text, so a KV or kernel mistake shows; the SmolLM2
shape covers the real head sizes).
"""

from __future__ import annotations

import pytest

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.model.dummy import write_dummy_model
from dualpath.request import SamplingParams


@pytest.fixture(scope="module")
def smollm2_shape_dir(tmp_path_factory):
    return write_dummy_model(tmp_path_factory.mktemp("smol-shape"), "smollm2-135m", seed=3,
                             std=0.08, num_hidden_layers=4)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny_chaotic_dir", "smollm2_shape_dir"])
def test_cuda_greedy_matches_cpu(model, request):
    model_dir = request.getfixturevalue(model)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(7, 150, 2))]
    outs = {}
    for device in ("cpu", "cuda"):
        engine = LLMEngine(model_dir, EngineConfig(dtype="float32", device=device,
                                                   block_size=16))
        outs[device] = [o.output_ids for o in engine.generate(prompts, params)]
        sampled = engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=1.0,
                                                              seed=1))
        assert len(sampled[0].output_ids) >= 1
    assert outs["cpu"] == outs["cuda"]
