"""Part (a) of ``dualpath bench layerwise``: the largest prefill a fixed device-KV budget holds.

One prefill engine with a small device-KV budget (``prefill_kv_cache_mb``) and one decode engine
(its own, roomy budget). A warm-up turn stores a long base prompt's full blocks; then prompts
of a growing number of hit blocks (prefixes of the base) plus a short miss tail are prefilled,
one at a time, first in ``basic`` (every layer resident) and then in ``layerwise`` (a window of
layers), each on its own cluster over the same store. The largest hit that completes is the
mode's answer; ``basic`` refuses larger prompts at once with a clear error. Outputs are greedy,
and every prompt both modes complete must give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.vocab import Mode, Role


@dataclass(frozen=True)
class BatchOptions:
    """Sizes of part (a)."""

    hit_blocks: tuple[int, ...] = (2, 4, 7, 15, 31, 63, 118)  # the ladder (118: 8k context)
    miss_tokens: int = 32  # at most half a block
    gen_tokens: int = 4  # fewer than half a block
    seed: int = 3


def largest_prefill(model_dir: Path, base_config: ClusterConfig, vocab: int,
                    options: BatchOptions, log_dir: Path,
                    progress: Any = lambda: None) -> dict[str, Any]:
    """Store the base prompt once, then climb the ladder in ``basic`` and ``layerwise``."""
    block = base_config.engine.block_size
    g = torch.Generator().manual_seed(options.seed)
    base = torch.randint(3, vocab - 1, (max(options.hit_blocks) * block,), generator=g).tolist()
    # under half a block, so no rung stores a block a later run of the same prompt could hit
    miss = min(options.miss_tokens, block // 2)
    tails = {k: torch.randint(3, vocab - 1, (miss,), generator=g).tolist()
             for k in options.hit_blocks}
    params = SamplingParams(max_tokens=options.gen_tokens, ignore_eos=True)
    warm = replace(base_config, mode="layerwise")
    with LocalCluster(model_dir, warm, log_dir=log_dir / "warm") as cluster:
        cluster.submit(base, params).result(timeout=1800)  # its full blocks go to the store
    rows: dict[str, Any] = {}
    for mode in (Mode.BASIC, Mode.LAYERWISE):
        config = replace(base_config, mode=mode)
        with LocalCluster(model_dir, config, log_dir=log_dir / mode) as cluster:
            rows[mode] = _climb(cluster, base, tails, params, block, progress)
            pe = next(m for m in cluster.metrics().values() if m["role"] == Role.PREFILL)
            rows[mode]["pe_max_forward_hit_tokens"] = pe.get("max_forward_hit_tokens", 0)
    _check_same_tokens(rows)
    return rows


def _climb(cluster: LocalCluster, base: list[int], tails: dict[int, list[int]],
           params: SamplingParams, block: int, progress: Any) -> dict[str, Any]:
    """Prefill each rung until one fails; the largest hit that completed."""
    steps: list[dict[str, Any]] = []
    for k, tail in tails.items():
        prompt = base[: k * block] + tail
        try:
            out = cluster.submit(prompt, params).result(timeout=1800)
        except DualPathError as exc:
            steps.append({"hit_blocks": k, "ok": False, "error": str(exc)})
            progress()
            break
        steps.append({"hit_blocks": k, "ok": True, "hit_tokens": out.num_hit_tokens,
                      "prompt_tokens": len(prompt), "output_ids": list(out.output_ids)})
        progress()
    done = [s for s in steps if s["ok"]]
    if done and done[-1]["hit_tokens"] != done[-1]["hit_blocks"] * block:
        raise DualPathError(f"the largest prompt hit {done[-1]['hit_tokens']} tokens, not its "
                            f"{done[-1]['hit_blocks']} stored blocks: the store was not warm")
    return {"steps": steps, "max_hit_tokens": max((s["hit_tokens"] for s in done), default=0)}


def _check_same_tokens(rows: dict[str, Any]) -> None:
    """Greedy: every prompt both modes completed gave the same tokens."""
    basic = {s["hit_blocks"]: s["output_ids"] for s in rows["basic"]["steps"] if s["ok"]}
    for step in rows["layerwise"]["steps"]:
        k = step["hit_blocks"]
        if step["ok"] and k in basic and basic[k] != step["output_ids"]:
            raise DualPathError(f"basic and layerwise disagree on the prompt of {k} hit blocks")
    rows["same_tokens_checked"] = sorted(basic)
