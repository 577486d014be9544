"""``dualpath plan``: the bottleneck-free P/D range (eq. 9) of a model on a hardware, a table of
candidates and, with ``--workload``, each one's simulated JCT; ``--json`` writes it all."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dualpath.sim.commands import _console, _print, _write
from dualpath.sim.planner import plan
from dualpath.sim.presets import DS660B
from dualpath.sim.profiles import GB, HardwareProfile, get_hardware, get_model

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True)
class PlanOptions:
    """The ``dualpath plan`` command line (see :func:`add_arguments`)."""

    model: str = "ds660b"
    hardware: str = "hopper"
    workload: str | None = None
    agents: int = 64
    max_nodes: int = 6
    beyond: bool = False
    dram_gbps: float | None = None
    snic_gbps: float | None = None
    cnic_gbps: float | None = None
    json: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`PlanOptions`."""
    parser.add_argument("--model", default="ds660b", help="ds660b, ds27b, qwen32b")
    parser.add_argument("--hardware", default="hopper", help="hopper, h200, b200")
    parser.add_argument("--workload", default=None, help="32k, 48k, 64k: also simulate")
    parser.add_argument("--agents", type=int, default=64, help="agents when simulating")
    parser.add_argument("--max-nodes", type=int, default=6, help="largest P + D to consider")
    parser.add_argument("--beyond", action="store_true",
                        help="also simulate P/D ratios outside the eq. 9 range")
    for nic, what in (("dram", "DRAM per node"), ("snic", "storage NIC per node"),
                      ("cnic", "compute NIC per GPU")):
        parser.add_argument(f"--{nic}-gbps", type=float, default=None,
                            help=f"what-if: {what} in GB/s instead of the hardware's")
    parser.add_argument("--json", default=None,
                        help="write the full plan as JSON here, a PNG figure beside it "
                        "(the terminal gets a table of the candidates)")


def run(options: PlanOptions) -> int:
    """``dualpath plan``."""
    run_plan(options)
    return 0


# ``dualpath plan`` what-if options (GB/s) and the hardware fields they replace (bytes/s)
WHAT_IF_BANDWIDTHS = {"dram_gbps": "dram_bps", "snic_gbps": "snic_bps", "cnic_gbps": "cnic_bps"}


def _hardware(options: PlanOptions) -> HardwareProfile:
    """``--hardware`` with the :data:`WHAT_IF_BANDWIDTHS` given put in (named ``name*``)."""
    hw = get_hardware(options.hardware)
    changes = {}
    for option, field in WHAT_IF_BANDWIDTHS.items():
        gbps = getattr(options, option)
        if gbps is None:
            continue
        if not gbps > 0:
            raise ValueError(f"--{option.replace('_', '-')} must be positive, got {gbps}")
        changes[field] = gbps * GB
    return replace(hw, name=f"{hw.name}*", **changes) if changes else hw


def run_plan(options: PlanOptions) -> dict[str, Any]:
    """Eq. (9) range for ``--hardware`` and a table of candidates; with ``--workload``,
    simulated JCT per candidate."""
    from dualpath.sim.cluster import simulate
    from dualpath.sim.report import plan_range_line, plan_table
    from dualpath.workloads.presets import WorkloadConfig

    hw = _hardware(options)
    get_model(options.model)
    sim = None

    def fits(p: int, d: int) -> bool:
        cfg = replace(DS660B, model=options.model, hardware=hw, prefill_nodes=p,
                      decode_nodes=d, kv_bytes_per_token=None, hbm_kv_bytes_per_token=None)
        try:
            cfg.kv_capacity_tokens(min(p, d))
        except ValueError:
            return False
        return True
    if options.workload:
        base = replace(DS660B, model=options.model, hardware=hw,
                       kv_bytes_per_token=DS660B.kv_bytes_per_token
                       if options.model == "ds660b" else None,
                       hbm_kv_bytes_per_token=DS660B.hbm_kv_bytes_per_token
                       if options.model == "ds660b" else None)

        def sim(p: int, d: int) -> float:
            cfg = replace(base, prefill_nodes=p, decode_nodes=d, mode="dualpath",
                          workload=WorkloadConfig(options.workload, agents=options.agents))
            return float(simulate(cfg)["jct_s"])  # plan() only asks for pairs that fit
    result = plan(hw, options.max_nodes, sim, fits, beyond=options.beyond)
    result["model"] = options.model
    _write(options.json, result)
    _print(_console(), [plan_table(result)], options.json, (plan_range_line(result),))
    return result
