"""The ``dualpath bench agents`` command line: options onto :class:`AgentsOptions`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath.commands.args import names
from dualpath.vocab import EngineKind, Rung

if TYPE_CHECKING:
    from argparse import ArgumentParser

    from dualpath.bench.agents.ladder import AgentsOptions


@dataclass(frozen=True)
class AgentsCommandOptions:
    """The command line; None leaves :class:`AgentsOptions`' default."""

    workload: str = "weka-sample"
    modes: tuple[str, ...] | None = None  # None: the ladder (vLLM engines: theirs)
    online_modes: tuple[str, ...] | None = None  # None: basic, dualpath (vLLM: none)
    offline_off: bool = False
    split_read: bool = False
    cold_start: bool = False
    via: str = "python"
    agents: int | None = None
    turns: int | None = None
    first_turn: int | None = None
    scale: float | None = None
    trace_dir: str | None = None
    read_cap_mb_s: float | None = None
    compute_cap_mb_s: float | None = None
    online_trials: int | None = None
    ttft_slo_s: float | None = None
    profile: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int | None = None
    seed: int | None = None
    json: str = "results/agents.json"
    dir: str | None = None
    engine: str = "dualpath"
    min_working_set_over_budget: float | None = None


def add_arguments(p: ArgumentParser) -> None:
    """The options of :class:`AgentsCommandOptions`."""
    p.add_argument("--workload", default="weka-sample",
                   help="weka-sample (shipped), weka (the full traces: --trace-dir), 32k, 48k, "
                   "64k (the paper's Table 2, scaled), mooncake (--trace-dir)")
    p.add_argument("--modes", type=names, default=None,
                   help=f"offline modes, in order, each on a fresh cluster (default "
                   f"{','.join(Rung)}; with --engine vllm recompute,basic,layerwise,dualpath,"
                   "oracle)")
    p.add_argument("--online-modes", type=names, default=None,
                   help="modes whose online capacity is searched ('' for none; default "
                   "basic,dualpath, none with --engine vllm)")
    p.add_argument("--engine", default="dualpath", choices=tuple(EngineKind),
                   help="the engines: dualpath's, or vLLM instances with dualpath's KV "
                   "connector (`make peers`), plain vLLM reported beside them")
    p.add_argument("--min-working-set-over-budget", type=float, default=None,
                   help="with --engine vllm: the workload's working set over the device KV "
                   "of every vLLM instance together, at least (default 5; a workload too "
                   "small for it is refused)")
    p.add_argument("--offline-off", action="store_true", help="skip the offline runs")
    p.add_argument("--split-read", action="store_true",
                   help="dualpath and round_robin read one hit partly on each side "
                        "(docs/design.md §9)")
    p.add_argument("--cold-start", action="store_true",
                   help="time each agent's first prompt as a cold prefill (default: it is "
                   "stored beforehand, untimed, as a deployment keeps the system prompt)")
    p.add_argument("--via", default="python", choices=("python", "http"),
                   help="the cluster API in this process, or a dualpath serve and its "
                   "streaming OpenAI API")
    p.add_argument("--agents", type=int, default=None,
                   help="agents (sessions or copies; default 8, 28 with --engine vllm)")
    p.add_argument("--turns", type=int, default=None,
                   help="turns per agent, from --first-turn (default 4, 2 with --engine vllm)")
    p.add_argument("--first-turn", type=int, default=None,
                   help="traces: the top-level request each agent's timed turns start at; the "
                   "one before it is stored untimed first (default 21 for weka and "
                   "weka-sample, else 1)")
    p.add_argument("--scale", type=float, default=None,
                   help="divide token counts by this (default 64, 32 with --engine vllm)")
    p.add_argument("--trace-dir", default=None,
                   help="traces folder (default: $DUALPATH_TRACES_DIR)")
    p.add_argument("--read-cap-mb-s", type=float, default=None,
                   help="storage NIC cap per node, MB/s (default: calibrated on the oracle run)")
    p.add_argument("--compute-cap-mb-s", type=float, default=None,
                   help="compute NIC cap per engine (default 8x the storage cap)")
    p.add_argument("--online-trials", type=int, default=None, help="APS tried per mode")
    p.add_argument("--ttft-slo-s", type=float, default=None, help="online TTFT SLO (seconds)")
    p.add_argument("--profile", default=None,
                   help="a dualpath profile JSON: also predict the JCTs with the simulator")
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    p.add_argument("--dtype", default=None, help="engine dtype (default auto: bfloat16 where "
                   "the CPU has AVX512_BF16 or AMX, or on CUDA, else float32; float32 with "
                   "--engine vllm)")
    p.add_argument("--device", default=None,
                   help="the engines' device: cpu, cuda, cuda:N or auto (default auto: cuda "
                   "where this host has a GPU, each engine on its own GPU round robin)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 16; 32 with --engine vllm)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default="results/agents.json",
                   help="where to write the results (a PNG beside it; '' for none)")
    p.add_argument("--dir", default=None, help="work folder, kept (default: a temporary one)")


def run(options: AgentsCommandOptions) -> int:
    """Run the benchmark with the options given."""
    from dualpath.bench.agents.ladder import run_bench

    run_bench(options_from(options))
    return 0


def options_from(options: AgentsCommandOptions) -> AgentsOptions:
    """The :class:`AgentsOptions` the parsed command line asks for (defaults where unset)."""
    from dualpath.bench.agents.ladder import VLLM_RUNGS, AgentsOptions, with_overrides

    o = options
    vllm = o.engine == EngineKind.VLLM
    modes = o.modes if o.modes is not None else (VLLM_RUNGS if vllm else None)
    online = o.online_modes if o.online_modes is not None else (() if vllm else None)
    # the base resolves the engine-kind defaults (block size, host buffers) for this engine
    base = AgentsOptions(engine=o.engine, modes=VLLM_RUNGS, online_modes=()) if vllm \
        else AgentsOptions()
    return with_overrides(
        base, workload=o.workload, modes=modes, online_modes=online, engine=o.engine,
        offline=not o.offline_off, via=o.via, agents=o.agents, turns=o.turns,
        first_turn=o.first_turn, scale=o.scale,
        trace_dir=o.trace_dir, read_cap_mb_s=o.read_cap_mb_s, compute_cap_mb_s=o.compute_cap_mb_s,
        online_trials=o.online_trials, prime_first_turns=not o.cold_start,
        ttft_slo_s=o.ttft_slo_s, profile=o.profile, model=o.model, dtype=o.dtype,
        device=o.device, block_size=o.block_size, split_read=o.split_read or None, seed=o.seed,
        json_path=o.json or "", work_dir=o.dir,
        min_working_set_over_budget=o.min_working_set_over_budget)
