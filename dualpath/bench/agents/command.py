"""The ``dualpath bench agents`` command line: options onto :class:`AgentsOptions`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dualpath.bench.agents.ladder import AgentsOptions


def _modes(raw: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options (defaults: :class:`dualpath.bench.agents.ladder.AgentsOptions`)."""
    p.add_argument("--workload", default="weka-sample",
                   help="weka-sample (shipped), weka (the full traces: --trace-dir), 32k, 48k, "
                   "64k (the paper's Table 2, scaled), mooncake (--trace-dir)")
    p.add_argument("--modes", default="basic,layerwise,round_robin,dualpath,oracle",
                   help="offline modes, in order, each on a fresh cluster")
    p.add_argument("--online-modes", default="basic,dualpath",
                   help="modes whose online capacity is searched ('' for none)")
    p.add_argument("--offline-off", action="store_true", help="skip the offline runs")
    p.add_argument("--split-read", action="store_true",
                   help="dualpath and round_robin read one hit partly on each side (DESIGN §9)")
    p.add_argument("--cold-start", action="store_true",
                   help="time each agent's first prompt as a cold prefill (default: it is "
                   "stored beforehand, untimed, as a deployment keeps the system prompt)")
    p.add_argument("--via", default="python", choices=("python", "http"),
                   help="the cluster API in this process, or a dualpath serve and its "
                   "streaming OpenAI API")
    p.add_argument("--agents", type=int, default=None, help="agents (sessions or copies)")
    p.add_argument("--turns", type=int, default=None, help="leading turns per agent")
    p.add_argument("--scale", type=float, default=None, help="divide token counts by this")
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
    p.add_argument("--dtype", default=None, help="engine dtype (default float32)")
    p.add_argument("--device", default=None,
                   help="the engines' device: cpu, cuda, cuda:N or auto (default auto: cuda "
                   "where this host has a GPU, each engine on its own GPU round robin)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (64)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default="results/agents.json",
                   help="where to write the results (a PNG beside it; '' for none)")
    p.add_argument("--dir", default=None, help="work folder, kept (default: a temporary one)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Run the benchmark with the options given."""
    from dualpath.bench.agents.ladder import run_bench

    run_bench(options_from(args))
    return 0


def options_from(args: argparse.Namespace) -> AgentsOptions:
    """The :class:`AgentsOptions` the parsed command line asks for (defaults where unset)."""
    from dualpath.bench.agents.ladder import AgentsOptions, with_overrides

    return with_overrides(
        AgentsOptions(), workload=args.workload, modes=_modes(args.modes),
        online_modes=_modes(args.online_modes), offline=not args.offline_off, via=args.via,
        agents=args.agents, turns=args.turns, scale=args.scale, trace_dir=args.trace_dir,
        read_cap_mb_s=args.read_cap_mb_s, compute_cap_mb_s=args.compute_cap_mb_s,
        online_trials=args.online_trials, prime_first_turns=not args.cold_start,
        ttft_slo_s=args.ttft_slo_s, profile=args.profile, model=args.model, dtype=args.dtype,
        device=args.device, block_size=args.block_size, split_read=args.split_read or None,
        seed=args.seed, json_path=args.json or "", work_dir=args.dir)
