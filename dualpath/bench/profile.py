"""``dualpath profile``: measure the rates the scheduler's thresholds and cost model need.

On the actual engine (model, dtype, threads of the config) it times prefills of ``bsz`` new
tokens on top of ``cached`` ones already in the cache, fits the compute-quota cost model
(``scheduler/batch.py``) to them, and times full-block reads from the configured store. From
those: α = tokens a node reads in 3 s, β = prompt tokens one engine prefills in 5 s at an
agentic hit rate (docs/paper.md §5.2, A.4). ``ClusterConfig.profile_path`` points the router at the
JSON it writes.

On a CPU the whole prefill forward is timed (attention cannot be isolated there), so the cost
model predicts forward time; the quota is applied to that.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import track

from dualpath.bench.report import machine_profile, write_json
from dualpath.commands.args import EngineOptions, add_engine_arguments
from dualpath.config import EngineConfig, StorageConfig
from dualpath.engine.llm_engine import LLMEngine
from dualpath.kv.host_pool import HostPool
from dualpath.request import SamplingParams
from dualpath.scheduler.batch import AttentionCostModel
from dualpath.scheduler.rules import SchedulerParams
from dualpath.storage import open_store

if TYPE_CHECKING:
    from argparse import ArgumentParser

GRID_CACHED = (0, 256, 1024)
GRID_BSZ = (64, 256, 512)
DECODE_BATCHES = (1, 4, 8)
DECODE_CONTEXT = 512


def _time_prefill(engine: LLMEngine, cached: int, bsz: int, seed: int) -> float:
    """Milliseconds to prefill ``bsz`` new tokens after ``cached`` cached ones."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, engine.spec.vocab_size - 1, (cached + bsz,), generator=g).tolist()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    if cached:
        engine.generate([[*tokens[:cached], 1]], one)  # puts the prefix in the prefix cache
    start = time.perf_counter()
    out = engine.generate([tokens], one)[0]
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if out.num_cached_tokens != cached:
        raise RuntimeError(f"expected {cached} cached tokens, got {out.num_cached_tokens}")
    return elapsed_ms


def _read_rate(engine: LLMEngine, storage: StorageConfig, blocks: int) -> float:
    """Tokens per second read from the store as full blocks (uncapped)."""
    layout = engine.layout
    root = Path(storage.root) / "profile-probe"
    shutil.rmtree(root, ignore_errors=True)
    store = open_store(StorageConfig(**{**asdict(storage), "root": str(root)}), layout)
    pool = HostPool(layout.full_block_bytes, blocks, pin=False)
    pool.slab.random_(0, 256)
    buffers = [pool.buffer(s) for s in pool.alloc(blocks)]
    keys = engine.key_space.keys(list(range(blocks * layout.block_size)))
    try:
        store.put_from(keys, buffers)
        os.sync()
        start = time.perf_counter()
        if not all(store.get_into(keys, buffers)):
            raise RuntimeError("profile blocks did not read back")
        seconds = time.perf_counter() - start
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return blocks * layout.block_size / seconds


def _time_decode_step(engine: LLMEngine, batch: int, context: int, steps: int = 16) -> float:
    """Milliseconds of one decode step with ``batch`` running sequences of ``context`` tokens:
    (time of ``steps + 1`` tokens − time of 1 token) / ``steps``, prompts already cached."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, engine.spec.vocab_size - 1, (context,), generator=g).tolist()
               for _ in range(batch)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    many = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    engine.generate(prompts, one)  # caches the prompts
    start = time.perf_counter()
    engine.generate(prompts, one)
    t_one = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, many)
    t_many = time.perf_counter() - start
    return max(0.0, (t_many - t_one) / steps * 1e3)


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``y = base + slope · x`` (slope ≥ 0)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return my - slope * mx, slope


@dataclass(frozen=True, kw_only=True)
class ProfileOptions(EngineOptions):
    """The ``dualpath profile`` command line."""

    json: str
    storage_root: str = ".cache/kv-store"
    read_blocks: int = 64
    read_cap_mb_s: float | None = None
    compute_cap_mb_s: float | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`ProfileOptions`."""
    parser.add_argument("--json", required=True, help="where to write the profile")
    parser.add_argument("--storage-root", default=".cache/kv-store", help="the store to time")
    parser.add_argument("--read-blocks", type=int, default=64)
    parser.add_argument("--read-cap-mb-s", type=float, default=None,
                        help="the storage NIC cap the cluster will run with")
    parser.add_argument("--compute-cap-mb-s", type=float, default=None,
                        help="the compute NIC cap the cluster will run with (for the simulator)")
    add_engine_arguments(parser)


def run(options: ProfileOptions) -> int:
    """``dualpath profile``."""
    run_profile(options)
    return 0


def run_profile(options: ProfileOptions) -> dict:
    """Profile, fit, derive α and β, write the JSON profile."""
    from dualpath.model.default_model import resolve_model

    config: EngineConfig = options.engine_config()
    cluster_config = config
    config = EngineConfig(**{**asdict(config), "max_num_batched_tokens": max(GRID_BSZ) + 64,
                             "num_kv_blocks": config.num_kv_blocks or 256})
    model_dir = resolve_model(options.model)
    engine = LLMEngine(model_dir, config)
    grid = [(c, b) for c in GRID_CACHED for b in GRID_BSZ]
    _time_prefill(engine, 0, 64, seed=0)  # warm-up
    samples = [((c, b), _time_prefill(engine, c, b, seed=i + 1))
               for i, (c, b) in enumerate(track(grid, description="prefill timings"))]
    model = AttentionCostModel.fit([([pair], ms) for pair, ms in samples])
    prefill_tok_s = max(b / (ms / 1e3) for (c, b), ms in samples if c == 0)
    # tok (the scheduler's load) counts prompt tokens, hits included: β is in prompt tokens a
    # PE gets through at an agentic hit rate (the most-cached sample: 1024 + 64 tokens here)
    prompt_tok_s = max((c + b) / (ms / 1e3) for (c, b), ms in samples if c >= 8 * b)
    storage = StorageConfig(root=options.storage_root, o_direct=True)
    read_tok_s = _read_rate(engine, storage, options.read_blocks)
    if options.read_cap_mb_s:
        read_tok_s = min(read_tok_s, options.read_cap_mb_s * 1e6 / engine.layout.full_block_bytes
                         * engine.layout.block_size)
    params = SchedulerParams.from_rates(read_tok_s, prompt_tok_s)
    decode = [(b, _time_decode_step(engine, b, DECODE_CONTEXT))
              for b in track(DECODE_BATCHES, description="decode steps")]
    base_ms, per_seq_ms = _fit_line(decode)
    layout = engine.layout
    cluster_blocks = cluster_config.num_kv_blocks or int(
        cluster_config.kv_cache_mb * 2**20 // layout.full_block_bytes)
    result = {
        "benchmark": "profile", "model": model_dir.name, "dtype": engine.dtype,
        "machine": machine_profile(), "engine_config": asdict(config),
        "samples": [{"cached": c, "bsz": b, "ms": ms} for (c, b), ms in samples],
        "cost_model": model.to_dict(),
        "summary": {"prefill_tokens_per_s": prefill_tok_s,
                    "prompt_tokens_per_s_at_hit": prompt_tok_s, "read_tokens_per_s": read_tok_s,
                    "alpha_tokens": params.alpha_tokens, "beta_tokens": params.beta_tokens,
                    "decode_step_ms": [base_ms, per_seq_ms],
                    "decode_samples_ms": {str(b): ms for b, ms in decode},
                    "kv_bytes_per_token": layout.full_block_bytes / layout.block_size,
                    "kv_capacity_tokens": cluster_blocks * layout.block_size,
                    "compute_cap_bps": (options.compute_cap_mb_s or 1500.0) * 1e6},
    }
    write_json(options.json, result)
    Console().print_json(json.dumps(result["summary"]))
    return result


def load_profile(path: str | Path) -> dict:
    """A profile written by ``dualpath profile``."""
    return json.loads(Path(path).read_text())
