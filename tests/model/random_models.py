"""Random-weight Llama checkpoints of a chosen attention shape (the kernel tests' models)."""

from __future__ import annotations

from pathlib import Path

import torch

# Llama-2-13B's attention (40 query heads of 128, 8 KV heads as in the acceptance) and
# Llama-3-70B's (64 of 128, 8 KV heads). The hidden size is kept small through an explicit
# head_dim (the q/k/v and output projections map 320 or 256 <-> heads x 128; transformers
# wants it a multiple of the heads): the kernels see exactly the real models' heads, while a
# checkpoint takes 10 MB, not a gigabyte a layer.
LLAMA2_13B_ATTENTION = dict(num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                            hidden_size=320)
LLAMA3_70B_ATTENTION = dict(num_attention_heads=64, num_key_value_heads=8, head_dim=128)


def save_random_llama(folder: Path, seed: int, **overrides: object) -> Path:
    """A random Llama (2 layers, hidden 256, vocabulary 300 unless overridden) saved as an
    HF checkpoint in ``folder``; norms drawn around 1 as in ``tests/conftest.py``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    values = dict(vocab_size=300, hidden_size=256, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, eos_token_id=299, rope_theta=10000.0,
                  tie_word_embeddings=False, initializer_range=0.05)
    values.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**values), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def paged_cache(g: torch.Generator, ctx_lens: list[int], block: int, kv_heads: int, dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, list[list[int]]]:
    """A random paged cache with each sequence's blocks scattered over it (and 3 blocks no
    sequence uses), and their block tables."""
    need = [-(-n // block) for n in ctx_lens]
    cache = torch.randn(sum(need) + 3, block, 2, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(cache.shape[0], generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    return cache, tables
