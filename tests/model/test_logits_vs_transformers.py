"""Our forward over the paged KV cache equals transformers' (fp32) logits.

Both paths are checked: plain torch ops (``cpu_kernels=False``: the same MKL GEMMs as
transformers, so within 1e-3; 3.6e-5 measured on SmolLM2) and the fast path (oneDNN's
prepacked GEMMs and the C kernels sum in other orders: 1.2e-3 measured on SmolLM2's 30 layers,
on logits of magnitude ~20, so within 5e-3).
"""

from __future__ import annotations

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.llm_engine import LLMEngine

TOLERANCE = {False: 1e-3, True: 5e-3}  # by cpu_kernels
FAST = [pytest.param(False, id="torch-ops"), pytest.param(True, id="fast-path")]


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (length,), generator=g).tolist()


def _max_diff(model_dir, lengths, block_size, vocab, **cfg) -> float:
    """The largest logit difference over prompts of ``lengths``."""
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=block_size,
                                               num_kv_blocks=256, **cfg))
    worst = 0.0
    for i, length in enumerate(lengths):
        ids = _prompt(length, vocab, seed=length + i)
        ours, cached = engine.prompt_logits(ids)
        assert cached == 0
        theirs = _hf_logits(model_dir, ids)
        assert ours.shape == theirs.shape
        worst = max(worst, float((ours - theirs).abs().max()))
    return worst


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen2_dir",
                                     "tiny_mistral_dir"])
def test_tiny_models_match_transformers(fixture, fast, request):
    model_dir = request.getfixturevalue(fixture)
    # block size 16: several prompts span many blocks; mistral's window (24) is exceeded
    diff = _max_diff(model_dir, [1, 7, 16, 45, 130], block_size=16, vocab=300, cpu_kernels=fast)
    assert diff <= TOLERANCE[fast]


@pytest.mark.parametrize("fast", FAST)
def test_chunked_prefill_matches_transformers(tiny_qwen2_dir, fast):
    diff = _max_diff(tiny_qwen2_dir, [100, 61], block_size=16, vocab=300,
                     max_num_batched_tokens=24, cpu_kernels=fast)
    assert diff <= TOLERANCE[fast]


@pytest.mark.parametrize("fast", FAST)
def test_smollm2_matches_transformers(smollm2_dir, fast):
    diff = _max_diff(smollm2_dir, [5, 64, 100, 300], block_size=64, vocab=49152,
                     cpu_kernels=fast)
    assert diff <= TOLERANCE[fast]
