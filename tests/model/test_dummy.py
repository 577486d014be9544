"""Random-weight folders of real architectures (``model/dummy.py``): what the GPU check runs."""

from __future__ import annotations

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.model.dummy import ARCHITECTURES, write_dummy_model
from dualpath.model.loader import load_model
from dualpath.model.spec import load_spec, model_id
from dualpath.request import SamplingParams


def test_architectures_parse_to_their_published_sizes(tmp_path):
    smol = load_spec(write_dummy_model(tmp_path / "smol", "smollm2-135m"))
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)
    assert smol.tie_word_embeddings
    llama = load_spec(write_dummy_model(tmp_path / "llama", "llama-3-8b"))
    assert llama.kv_bytes_per_token("bfloat16") == 32 * 2 * 8 * 128 * 2  # 128 KiB a token
    assert llama.rope.theta == 500000.0 and not llama.tie_word_embeddings
    with pytest.raises(KeyError, match="smollm2-135m"):
        write_dummy_model(tmp_path / "x", "gpt-2")


def test_weights_are_drawn_in_the_requested_dtype_and_depend_on_the_seed(tmp_path):
    folder = write_dummy_model(tmp_path / "a", "smollm2-135m", seed=1, num_hidden_layers=2)
    model = load_model(folder, torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    norm = params["model.layers.0.input_layernorm.weight"].float()
    assert norm.min() > 0.79 and norm.max() < 1.21
    weight = params["model.layers.0.mlp.down_proj.weight"].float()
    assert 0.015 < weight.std() < 0.025 and torch.isfinite(weight).all()
    again = dict(load_model(folder, torch.bfloat16).named_parameters())
    assert torch.equal(again["model.layers.0.mlp.down_proj.weight"], params[
        "model.layers.0.mlp.down_proj.weight"])
    other = write_dummy_model(tmp_path / "b", "smollm2-135m", seed=2, num_hidden_layers=2)
    assert not torch.equal(dict(load_model(other, torch.bfloat16).named_parameters())[
        "model.layers.0.mlp.down_proj.weight"], params["model.layers.0.mlp.down_proj.weight"])
    assert model_id(folder) != model_id(other)  # stored KV of one is never the other's


def test_an_engine_runs_a_random_model_greedily_and_repeatably(tmp_path):
    folder = write_dummy_model(tmp_path / "smol", "smollm2-135m", num_hidden_layers=2)
    prompt = list(range(5, 69))
    outs = []
    for _ in range(2):
        engine = LLMEngine(folder, EngineConfig(dtype="float32", num_kv_blocks=16,
                                                block_size=16))
        assert engine.tokenizer is None
        outs.append(engine.generate([prompt], SamplingParams(max_tokens=6,
                                                             ignore_eos=True))[0].output_ids)
    assert len(outs[0]) == 6 and outs[0] == outs[1]
    assert set(ARCHITECTURES) >= {"smollm2-135m", "llama-3-8b"}
