"""The measurement method of ``dualpath bench engine``, run inside every system's process.

It imports nothing of dualpath, so the vLLM peer runs it from its own virtual environment
(``bench/peer_vllm.py``). A system is a function ``generate(prompts, new_tokens)`` that runs
token-id prompts to completion, exactly ``new_tokens`` tokens each, greedy. For every system:

- prefill tokens/s of one long prompt: its length / the time to generate 1 token;
- decode tokens/s at each batch size: ``batch * (N - 1) / (t(N tokens) - t(1 token))``, so the
  prefill cost cancels out; the two runs alternate within each repeat;
- every repeat's figure is kept, and the median, min and max reported;
- the CPU seconds of the system's whole process tree over the measured span, divided by that
  span's wall time: how many cores the system kept busy;
- the resident memory (RSS) of the system's whole process tree after the warm-up and after
  every measured run (median, min, max: the weights, the KV cache, the runtime), and the peak
  (the process's high-water mark, loading included). ``--set cpu_kernels=false`` beside a
  default run gives dualpath's RSS with the fast path off.

The spec (prompts, N, repeats) comes from a JSON file the orchestrator writes; the result goes
to another. Progress lines ``PROGRESS done total`` go to stdout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], None]
MakeSystem = Callable[[dict[str, Any]], tuple[Generate, dict[str, Any]]]


def spread(samples: list[float]) -> dict[str, Any]:
    """Median, min, max and the samples themselves."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


def _seconds(generate: Generate, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    generate(prompts, new_tokens)
    return time.perf_counter() - start


def _cpu_seconds() -> float:
    """CPU time of this process and all its descendants (vLLM's engine core is a child)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _rss_mb() -> float:
    """Resident memory of this process and all its descendants, in MiB."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def _peak_rss_mb() -> float:
    """This process's resident high-water mark, in MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(generate: Generate, spec: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the method for one system (see the module doc)."""
    batches = spec["decode_prompts"]
    steps = 1 + len(batches)
    repeats, new_tokens = spec["repeats"], spec["decode_tokens"]
    long_prompt = [spec["prefill_prompt"]]
    generate(long_prompt, 1)  # warm-up: every shape once
    for prompts in batches.values():
        generate(prompts, 2)
    rss = [_rss_mb()]  # sampled between timed runs, never inside one
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    prefill = []
    for _ in range(repeats):
        prefill.append(len(long_prompt[0]) / _seconds(generate, long_prompt, 1))
        rss.append(_rss_mb())
    print(f"PROGRESS 1 {steps}", flush=True)
    decode = {}
    for done, (batch, prompts) in enumerate(batches.items(), start=2):
        rates = []
        for _ in range(repeats):
            one = _seconds(generate, prompts, 1)
            many = _seconds(generate, prompts, new_tokens)
            rates.append(len(prompts) * (new_tokens - 1) / max(many - one, 1e-9))
            rss.append(_rss_mb())
        decode[batch] = spread(rates)
        print(f"PROGRESS {done} {steps}", flush=True)
    wall = time.perf_counter() - wall0
    cores_busy = (_cpu_seconds() - cpu0) / wall
    return {"prefill_tok_s": spread(prefill), "decode_tok_s": decode,
            "cores_busy": cores_busy, "measured_s": wall, "rss_mb": spread(rss),
            "peak_rss_mb": max(_peak_rss_mb(), *rss)}


def _spec_and_out(argv: list[str]) -> tuple[str, str]:
    """``--spec S --out O`` (either order): the command line ``compare.system_command`` gives
    a system's process. No argparse: this file imports nothing of dualpath and runs in the
    peers' environment too, and the line is the bench's own, not a user's."""
    values = dict(zip(argv[::2], argv[1::2], strict=False))
    if len(argv) != 4 or set(values) != {"--spec", "--out"}:
        sys.exit(f"usage: --spec SPEC.json --out OUT.json (got {argv})")
    return values["--spec"], values["--out"]


def run_system(name: str, make_system: MakeSystem, argv: list[str] | None = None) -> int:
    """A system process's main: read ``--spec``, build the system, measure, write ``--out``."""
    spec_path, out_path = _spec_and_out(list(sys.argv[1:] if argv is None else argv))
    with open(spec_path) as f:
        spec = json.load(f)
    started = time.perf_counter()
    generate, info = make_system(spec)
    load_s = time.perf_counter() - started
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    result = {"system": name, "load_s": load_s, "cpu_affinity": affinity, **info,
              **measure(generate, spec)}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover - the module is imported, not run
    sys.exit("run a system: python -m dualpath.bench.engine.worker, or bench/peer_vllm.py")
