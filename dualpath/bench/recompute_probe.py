"""How fast this machine recomputes a prompt: the demo sets its storage cap from it.

κ, loading a token over one storage NIC against recomputing it, is what puts a run in the
paper's regime (``dualpath/regime.py``). A fixed cap gives a different κ on every CPU: 180 MB/s
of bf16 KV was κ 0.09 on one 2-core EPYC and 0.18 on another that computes twice as fast. So
before it starts its cluster the demo times a prefill engine of its own (one torch thread, as
each engine process has) recomputing prompts of the workload's mean length, and caps the
storage NICs where κ lands on its target.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from dualpath.config import EngineConfig
from dualpath.request import SamplingParams


def probe_recompute_s_per_token(model_dir: Path, dtype: str, prompt_tokens: int,
                                block_size: int, repeats: int = 2, seed: int = 0) -> float:
    """Seconds per token this process takes to prefill a fresh prompt of ``prompt_tokens``
    random ids on one torch thread (the best of ``repeats``, after a short warm-up; no prefix
    is reused). Raises ``ValueError`` for fewer than one token or one repeat."""
    from dualpath.engine.llm_engine import LLMEngine

    if prompt_tokens < 1 or repeats < 1:
        raise ValueError(f"need a prompt of >= 1 token and >= 1 repeat, got {prompt_tokens} "
                         f"and {repeats}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blocks = 2 * (-(-prompt_tokens // block_size)) + 4
        engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, block_size=block_size,
                                                   num_kv_blocks=blocks,
                                                   enable_prefix_caching=False))
        vocab = engine.spec.vocab_size
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.generate([[rng.randrange(vocab) for _ in range(min(64, prompt_tokens))]], params)
        best_s = float("inf")
        for _ in range(repeats):
            ids = [rng.randrange(vocab) for _ in range(prompt_tokens)]
            began = time.perf_counter()
            engine.generate([ids], params)
            best_s = min(best_s, time.perf_counter() - began)
        return best_s / prompt_tokens
    finally:
        torch.set_num_threads(threads)
