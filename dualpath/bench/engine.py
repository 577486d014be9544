"""``dualpath bench engine``: our single-engine runner against HF ``transformers`` generate.

Same model, dtype, thread count and prompts, measured side by side in one run:
- prefill tokens/s of one long prompt (time to the first generated token);
- decode tokens/s at several batch sizes, measured as the difference between generating N
  tokens and generating 1 token per row (so prefill cost cancels out), best of ``repeats``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dualpath.bench.report import bar_chart, machine_profile, write_json


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count, length), generator=g).tolist()


class _Ours:
    name = "dualpath"

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from dualpath.cli import engine_config
        from dualpath.engine.llm_engine import LLMEngine

        cfg = engine_config(args)
        cfg = replace(cfg, enable_prefix_caching=False,
                      max_num_batched_tokens=max(cfg.max_num_batched_tokens, args.prompt_tokens))
        self.engine = LLMEngine(model_dir, cfg)
        self.config = cfg

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from dualpath.request import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(max_tokens=new_tokens,
                                                            ignore_eos=True))
        assert all(len(o.output_ids) == new_tokens for o in outs)


class _Transformers:
    name = "transformers"

    def __init__(self, model_dir: Path, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.generation_config.eos_token_id = None  # generate exactly N tokens

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new_tokens


def _measure(system, args, vocab: int, progress: Progress, task) -> dict[str, float]:
    long_prompt = _random_prompts(1, args.prompt_tokens, vocab, seed=1)
    system.generate(long_prompt, 1)  # warm-up
    prefill_s = _best_seconds(lambda: system.generate(long_prompt, 1), args.repeats)
    result = {"prefill_tok_s": args.prompt_tokens / prefill_s}
    progress.advance(task)
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        prompts = _random_prompts(batch, args.decode_prompt_tokens, vocab, seed=batch)
        one = _best_seconds(lambda p=prompts: system.generate(p, 1), args.repeats)
        many = _best_seconds(lambda p=prompts: system.generate(p, args.decode_tokens),
                             args.repeats)
        result[f"decode_b{batch}_tok_s"] = batch * (args.decode_tokens - 1) / max(many - one,
                                                                                  1e-9)
        progress.advance(task)
    return result


def run_engine_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark, print a table, write JSON and PNG; return the result."""
    from dualpath.model.default_model import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    ours = _Ours(model_dir, args)
    theirs = _Transformers(model_dir, ours.engine.dtype)
    vocab = ours.engine.spec.vocab_size
    batches = [int(b) for b in args.decode_batches.split(",")]
    measured = {}
    with Progress() as progress:
        for system in (ours, theirs):
            task = progress.add_task(f"bench {system.name}", total=1 + len(batches))
            measured[system.name] = _measure(system, args, vocab, progress, task)
    result = _result(args, model_dir, ours, measured, batches)
    _print_table(result, batches)
    out = write_json(args.json, result)
    bar_chart(out.with_suffix(".png"), f"engine throughput, {model_dir.name}, "
              f"{ours.engine.dtype}, {args.threads} thread(s)",
              ["prefill"] + [f"decode b{b}" for b in batches],
              {name: [m["prefill_tok_s"]] + [m[f"decode_b{b}_tok_s"] for b in batches]
               for name, m in measured.items()}, "tokens/s")
    return result


def _result(args, model_dir, ours, measured, batches) -> dict:
    a, b = measured["dualpath"], measured["transformers"]
    ratios = {"prefill_ratio_vs_transformers": a["prefill_tok_s"] / b["prefill_tok_s"]}
    for batch in batches:
        key = f"decode_b{batch}_tok_s"
        ratios[f"decode_ratio_vs_transformers_b{batch}"] = a[key] / b[key]
    return {
        "benchmark": "engine",
        "model": str(model_dir.name),
        "dtype": ours.engine.dtype,
        "setup": {"prompt_tokens": args.prompt_tokens, "decode_batches": batches,
                  "decode_prompt_tokens": args.decode_prompt_tokens,
                  "decode_tokens": args.decode_tokens, "repeats": args.repeats},
        "machine": machine_profile(),
        "config": asdict(ours.config),
        "measured": measured,
        "summary": ratios,
    }


def _print_table(result: dict, batches: list[int]) -> None:
    table = Table(title=f"engine benchmark ({result['model']}, {result['dtype']})")
    for col in ("metric", "dualpath tok/s", "transformers tok/s", "ratio"):
        table.add_column(col)
    a, b = result["measured"]["dualpath"], result["measured"]["transformers"]
    rows = [("prefill", "prefill_tok_s")] + [(f"decode b{n}", f"decode_b{n}_tok_s")
                                             for n in batches]
    for label, key in rows:
        table.add_row(label, f"{a[key]:.0f}", f"{b[key]:.0f}", f"{a[key] / b[key]:.2f}")
    Console().print(table)
