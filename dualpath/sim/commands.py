"""``dualpath sim`` and ``dualpath plan``: run presets / plan P/D ratios, print tables and,
with ``--json``, write the full result (and a PNG figure beside it)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.sim.config import SimConfig
from dualpath.sim.planner import plan
from dualpath.sim.presets import DS660B, DS660B_QUOTA_ALL, run_preset
from dualpath.sim.profiles import GB, HardwareProfile, get_hardware, get_model

if TYPE_CHECKING:
    from rich.console import Console


def _write(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON at ``path`` and its figure beside it (same name, ``.png``)."""
    if not path:
        return
    from dualpath.sim.plots import plot_result, png_path_for

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot_result(result, png_path_for(path))


def _console() -> Console:
    """A rich console; 132 columns when stdout is not a terminal, so that tables piped to a
    file or a log are not squeezed into 80."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=132)


def _print(console: Console, tables: list[Any], json_path: str | None,
           lines: tuple[str, ...] = ()) -> None:
    """Print ``tables`` (each caption as a line under its table, so that it is not wrapped to
    the table's width) and ``lines``, then where the JSON went (or how to get it)."""
    for table in tables:
        caption, table.caption = table.caption, None
        console.print(table)
        if caption:
            console.print(caption, style="dim")
    for line in lines:
        console.print(line)
    if json_path:
        from dualpath.sim.plots import png_path_for

        console.print(f"wrote {json_path} and {png_path_for(json_path)}")
    else:
        console.print("[dim](--json PATH writes the full result and a PNG figure)[/]")


# ``dualpath sim`` options that change the DS 660B configuration of the paper presets
PAPER_OPTIONS = ("baseline_batcher", "read_queue", "token_budget", "storage_eff",
                 "basic_prefetch", "lengths")


def _paper_base(args: argparse.Namespace) -> SimConfig | None:
    """The DS 660B configuration with the :data:`PAPER_OPTIONS` given applied (``None`` when
    none is given: the presets' own base)."""
    given = [o for o in PAPER_OPTIONS if getattr(args, o) is not None
             and getattr(args, o) is not False]  # `is`: a --token-budget of 0 is given
    if not given:
        return None
    if args.preset == "testbed":
        flags = ", ".join("--" + o.replace("_", "-") for o in given)
        raise ValueError(f"{flags}: these options apply to the paper presets")
    base = DS660B_QUOTA_ALL if args.baseline_batcher == "quota" else DS660B
    if args.read_queue == "shared":
        base = replace(base, read_streams=None)
    if args.token_budget is not None:
        if args.token_budget <= 0:
            raise ValueError(f"--token-budget must be positive, got {args.token_budget}")
        base = replace(base, token_budget=args.token_budget)
    if args.storage_eff is not None:
        if not 0 < args.storage_eff <= 1:
            raise ValueError(f"--storage-eff must be in (0, 1], got {args.storage_eff}")
        base = replace(base, storage_eff=args.storage_eff)
    if args.basic_prefetch:
        base = replace(base, basic_prefetch=True)
    if args.lengths:
        base = replace(base, workload=replace(base.workload, lengths=args.lengths))
    return base


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.preset`` with a rich progress bar; print its tables and, with ``--json``,
    write the result."""
    from rich.progress import Progress

    from dualpath.sim.report import sim_tables

    kwargs: dict[str, Any] = {}
    if args.workload:
        kwargs["workload"] = args.workload
    if (args.preset == "testbed") != bool(args.testbed):
        raise ValueError("--testbed PROFILE.json goes with --preset testbed (and only with it)")
    if args.testbed:
        kwargs["profile"] = args.testbed
    if args.real:
        if args.preset != "testbed":
            raise ValueError("--real goes with --preset testbed")
        kwargs["real"] = args.real
    base = _paper_base(args)
    if base is not None:
        kwargs["base"] = base
    if args.agents and args.preset not in ("paper-fig7", "paper-ablation", "testbed"):
        raise ValueError(f"--agents applies to paper-fig7 and paper-ablation, not {args.preset}")
    if args.aps and args.preset != "paper-online":
        raise ValueError(f"--aps applies to paper-online, not {args.preset}")
    try:
        if args.agents:
            kwargs["agents"] = tuple(int(a) for a in args.agents.split(","))
        if args.aps:
            kwargs["aps"] = tuple(float(a) for a in args.aps.split(","))
    except ValueError as exc:
        raise ValueError(f"--agents/--aps must be comma-separated numbers: {exc}") from None
    with Progress(transient=True) as bar:
        tasks: dict[str, Any] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        result = run_preset(args.preset, progress=progress, **kwargs)
    _write(args.json, result)
    _print(_console(), sim_tables(result), args.json)
    return result


# ``dualpath plan`` what-if options (GB/s) and the hardware fields they replace (bytes/s)
WHAT_IF_BANDWIDTHS = {"dram_gbps": "dram_bps", "snic_gbps": "snic_bps", "cnic_gbps": "cnic_bps"}


def _hardware(args: argparse.Namespace) -> HardwareProfile:
    """``--hardware`` with the :data:`WHAT_IF_BANDWIDTHS` given put in (named ``name*``)."""
    hw = get_hardware(args.hardware)
    changes = {}
    for option, field in WHAT_IF_BANDWIDTHS.items():
        gbps = getattr(args, option)
        if gbps is None:
            continue
        if not gbps > 0:
            raise ValueError(f"--{option.replace('_', '-')} must be positive, got {gbps}")
        changes[field] = gbps * GB
    return replace(hw, name=f"{hw.name}*", **changes) if changes else hw


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Eq. (9) range for ``--hardware`` and a table of candidates; with ``--workload``,
    simulated JCT per candidate."""
    from dualpath.sim.cluster import simulate
    from dualpath.sim.report import plan_range_line, plan_table
    from dualpath.workloads.presets import WorkloadConfig

    hw = _hardware(args)
    get_model(args.model)
    sim = None

    def fits(p: int, d: int) -> bool:
        cfg = replace(DS660B, model=args.model, hardware=hw, prefill_nodes=p,
                      decode_nodes=d, kv_bytes_per_token=None, hbm_kv_bytes_per_token=None)
        try:
            cfg.kv_capacity_tokens(min(p, d))
        except ValueError:
            return False
        return True
    if args.workload:
        base = replace(DS660B, model=args.model, hardware=hw,
                       kv_bytes_per_token=DS660B.kv_bytes_per_token
                       if args.model == "ds660b" else None,
                       hbm_kv_bytes_per_token=DS660B.hbm_kv_bytes_per_token
                       if args.model == "ds660b" else None)

        def sim(p: int, d: int) -> float:
            cfg = replace(base, prefill_nodes=p, decode_nodes=d, mode="dualpath",
                          workload=WorkloadConfig(args.workload, agents=args.agents))
            return float(simulate(cfg)["jct_s"])  # plan() only asks for pairs that fit
    result = plan(hw, args.max_nodes, sim, fits, beyond=args.beyond)
    result["model"] = args.model
    _write(args.json, result)
    _print(_console(), [plan_table(result)], args.json, (plan_range_line(result),))
    return result
