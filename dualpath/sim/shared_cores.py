"""The testbed's own configuration in simulation: its engines share a few CPU cores.

On the testbed (``make demo``: 1 prefill + 2 decode engine processes and the router on one
2-core host) every mode is CPU-bound. Measured on a 2-core AMD EPYC (SmolLM2-135M float32, KV
46,080 B/token, block 16, 300 MB/s storage NICs, 8 Weka sessions, turns 21-25 / 96: 459
computed tokens, 26,272 hit tokens, 1.21 GB of hit KV, 115 decoded tokens), the engine
processes used, over the timed part: oracle 5.8 CPU-s (prefill engine 2.1-2.4, decode engines
3.5-3.7), basic 10.8, dualpath 10.7, with both cores 87-94% busy. Moving KV (storage reads,
Mooncake TCP loopback sends and receives, copies into the caches) costs about 4.4 CPU-s per GB
of hit KV, in basic and dualpath alike. A model of the NICs and each engine's compute alone
predicts basic/dualpath 1.4-2 there (``T_sim`` below: 1.38); measured, it is 1.0-1.1.

The model, per mode ``m`` (basic, dualpath, oracle):

- ``T_sim(m)``: the cluster simulator (:func:`dualpath.sim.cluster.simulate`) on the testbed's
  configuration, each engine on a core of its own: the run's prefill and decode engines, one
  node each; every node's storage NIC at the read cap (FIFO, one read at a time), compute NICs
  at the compute cap; the run's own agents and turns (prompt, hit and generated tokens of each
  timed turn, all agents starting at once); a prefill forward costs
  :func:`pe_s_per_token` per computed token (the oracle's prefill compute, forward time less
  layer waits, per computed token: the least contended measurement; without an oracle, the
  reusing mode's with the least per token), a decode step ``DECODE_CPU_S_PER_TOKEN`` per
  running request; Basic reads a request's KV when it is placed and loads it whole before its
  forward, as the testbed preset does.
- ``T_cpu(m) = (W_base + cpu_s_per_gb × GB(m)) / cores``: the CPU-seconds of the mode's work
  over the cores that share it. ``W_base`` is the work every mode does (prefill the computed
  tokens, decode the generated ones): the oracle's engine CPU-seconds when the run has them,
  else :func:`pe_s_per_token` × computed tokens plus ``DECODE_CPU_S_PER_TOKEN`` × decoded
  tokens. ``GB(m)`` is the
  mode's hit tokens × KV bytes per token (0 in the oracle); ``cpu_s_per_gb`` is
  ``(CPU(basic) − CPU(oracle)) / GB(basic)`` when the run has both CPU figures, else
  ``CPU_S_PER_GB``.
- ``JCT(m) = max(T_sim(m), T_cpu(m))``, and the prediction is ``JCT(basic) / JCT(dualpath)``,
  compared with the measured ratio: a miss of more than ``TOLERANCE`` (15%) is flagged.

Assumptions, each a simplification:

- The cores are the only shared resource, and a mode can keep them busy: ``T_cpu`` is a floor
  (the router's process and the OS take some of the cores too: the runs above measured JCTs
  4-17% over it).
- One CPU cost per GB of hit KV, whichever path it takes: the DE path's extra hop (DE node →
  PE over the compute network) is not charged more, as measured (basic and dualpath used the
  same CPU). The oracle moves no KV at all (no reads, and no prompt KV sent to the decode
  engine: ``engine/layerwise.py``), so the per-GB cost also covers the prompt KV's hand-off,
  which is the hits / h: it scales with the hits as long as h does not change much.
- Prefill and decode work do not depend on the mode (the same tokens in every mode): the
  oracle's is every mode's base. The prefill engine's compute as the demo measures it is wall
  time (it includes waiting for a core), so it overstates its CPU-seconds (2.5-3.1 s against
  2.1-2.4 CPU-s measured in the oracle): without CPU figures the floor is a little high.
- The overlap of the bounds is ignored: the JCT is the larger one, not more.
- ``DECODE_CPU_S_PER_TOKEN`` and ``CPU_S_PER_GB`` were measured on the 2-core AMD EPYC above
  (decode: 3.6 CPU-s for 115 tokens); the JSON's CPU figures, when present, replace them.
- Recompute is not predicted (the cluster simulator has no recompute mode).

Pure: no torch, sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from dualpath.sim.cluster import simulate
from dualpath.sim.config import SimConfig
from dualpath.sim.demo_run import DemoRun, ModeRun
from dualpath.sim.profiles import GB, TestbedProfile
from dualpath.vocab import Mode, Rung
from dualpath.workloads.presets import WorkloadConfig
from dualpath.workloads.turns import Turn

DECODE_CPU_S_PER_TOKEN = 3.6 / 115  # decode engines' CPU-s per decoded token (module doc)
CPU_S_PER_GB = 4.4  # CPU-s per GB of hit KV moved (module doc)
TOLERANCE = 0.15  # the largest miss of the measured basic/dualpath ratio not flagged
KV_CAPACITY_TOKENS = 1 << 30  # engines' KV capacity in the simulator: never binding here
PREDICTED = (Rung.BASIC, Rung.DUALPATH, Rung.ORACLE)

Simulate = Callable[[SimConfig, list[list[Turn]]], float]  # (config, agents' turns) -> JCT


class PredictionError(ValueError):
    """A run the model cannot be calibrated on (nothing computed, no mode to take it from)."""


@dataclass(frozen=True)
class CoreBudget:
    """What the testbed's cores must do: ``base_cpu_s`` in every mode, ``cpu_s_per_gb`` for
    each GB of hit KV moved, shared by ``cores``."""

    cores: int
    base_cpu_s: float
    cpu_s_per_gb: float
    calibration: str  # where the two figures came from

    def cpu_s(self, moved_bytes: float) -> float:
        """CPU-seconds of a mode that moves ``moved_bytes`` of hit KV."""
        return self.base_cpu_s + self.cpu_s_per_gb * moved_bytes / GB

    def floor_s(self, moved_bytes: float) -> float:
        """``T_cpu``: those CPU-seconds spread over every core."""
        return self.cpu_s(moved_bytes) / self.cores


def _compute_mode(run: DemoRun) -> ModeRun:
    """The mode whose prefill compute stands for the workload's: the oracle (the least
    contended), else the reusing mode with the least compute per token, else recompute (whose
    long prompts batch into few forwards: its compute per token is the lowest, and not this
    workload's)."""
    computed = [m for m in run.modes.values()
                if m.pe_computed_tokens > 0 and m.pe_compute_s > 0]
    if not computed:
        raise PredictionError(f"{run.path}: no mode measured its prefill engine's compute")
    return min(computed, key=lambda m: (m.mode != Mode.ORACLE, m.mode == Mode.RECOMPUTE,
                                        m.pe_compute_s / m.pe_computed_tokens))


def pe_s_per_token(run: DemoRun) -> float:
    """Seconds of prefill compute per computed token (:func:`_compute_mode`'s)."""
    mode = _compute_mode(run)
    return mode.pe_compute_s / mode.pe_computed_tokens


def moved_bytes(run: DemoRun, mode: str) -> float:
    """Hit KV bytes a mode moves: its hits (the first reusing mode's where it did not run),
    none in the oracle."""
    if mode == Mode.ORACLE:
        return 0.0
    ran = run.modes.get(mode)
    hits = ran.hit_tokens if ran else sum(t.hit for turns in run.agents for t in turns)
    return float(hits * run.kv_bytes_per_token)


def core_budget(run: DemoRun) -> CoreBudget:
    """Calibrate :class:`CoreBudget` on the run (module docstring: ``W_base``,
    ``cpu_s_per_gb``)."""
    (base, base_of), (per_gb, per_gb_of) = _base_cpu_s(run), _cpu_s_per_gb(run)
    return CoreBudget(run.cores, base, per_gb, f"base: {base_of}; per GB: {per_gb_of}")


def _base_cpu_s(run: DemoRun) -> tuple[float, str]:
    """``W_base`` and where it came from."""
    oracle = run.modes.get(Mode.ORACLE)
    if oracle is not None and oracle.cpu_s is not None:
        return oracle.cpu_s, "the oracle's engine CPU-s"
    pe = pe_s_per_token(run) * run.computed_tokens
    return pe + DECODE_CPU_S_PER_TOKEN * run.decode_tokens, (
        f"{_compute_mode(run).mode}'s prefill compute per token x {run.computed_tokens} "
        f"computed tokens + {DECODE_CPU_S_PER_TOKEN * 1e3:.1f} ms x {run.decode_tokens} "
        "decoded tokens")


def _cpu_s_per_gb(run: DemoRun) -> tuple[float, str]:
    """``cpu_s_per_gb`` and where it came from."""
    oracle, basic = run.modes.get(Mode.ORACLE), run.modes.get(Mode.BASIC)
    gb = moved_bytes(run, Mode.BASIC) / GB
    if oracle is None or basic is None or oracle.cpu_s is None or basic.cpu_s is None or not gb:
        return CPU_S_PER_GB, "the 2-core EPYC's measured CPU-s per GB"
    return (basic.cpu_s - oracle.cpu_s) / gb, "(basic - oracle) CPU-s / GB of basic's hits"


def demo_sim_config(run: DemoRun) -> SimConfig:
    """The cluster simulator's configuration of the testbed, each engine on its own core
    (module docstring, ``T_sim``)."""
    per_token_s = pe_s_per_token(run)
    profile = TestbedProfile(
        prefill_tokens_per_s=1 / per_token_s,
        read_tokens_per_s=run.read_cap_mb_s * 1e6 / run.kv_bytes_per_token,
        cost_model=(0.0, per_token_s * 1e3, 0.0), model=run.model,
        kv_bytes_per_token=run.kv_bytes_per_token, kv_capacity_tokens=KV_CAPACITY_TOKENS,
        decode_step_ms=(0.0, DECODE_CPU_S_PER_TOKEN * 1e3),
        compute_cap_bps=run.compute_cap_mb_s * 1e6, cpus=0)
    return SimConfig(testbed=profile, prefill_nodes=run.prefill_engines,
                     decode_nodes=run.decode_engines, ep_lockstep=False, basic_prefetch=True,
                     read_streams=1, workload=WorkloadConfig(agents=len(run.agents),
                                                             block_size=run.block_size))


def simulate_jct_s(cfg: SimConfig, agents: list[list[Turn]]) -> float:
    """JCT of the cluster simulator on ``agents``' turns."""
    return float(simulate(cfg, trajectories=agents)["jct_s"])


@dataclass(frozen=True)
class ModePrediction:
    """One mode: both bounds, the predicted JCT (the larger) and the measured one."""

    mode: str
    sim_s: float  # T_sim: NICs and each engine's compute, no core shared
    cpu_floor_s: float  # T_cpu
    cpu_s: float
    moved_gb: float
    measured_jct_s: float | None

    @property
    def jct_s(self) -> float:
        """The predicted JCT."""
        return max(self.sim_s, self.cpu_floor_s)

    @property
    def bound(self) -> str:
        """What sets the predicted JCT."""
        return "cores" if self.cpu_floor_s >= self.sim_s else "NICs and compute"


def ratio_miss(predicted: float, measured: float) -> float:
    """Relative miss of a predicted ratio: predicted / measured − 1."""
    if predicted <= 0 or measured <= 0:
        raise PredictionError(f"ratios must be > 0, got {predicted} and {measured}")
    return predicted / measured - 1


@dataclass(frozen=True)
class TestbedPrediction:
    """The prediction of every mode and the basic/dualpath ratio against the measured one."""

    __test__ = False  # not a pytest class

    modes: Mapping[str, ModePrediction]
    budget: CoreBudget
    tolerance: float = TOLERANCE

    def _ratio(self, jct: Callable[[ModePrediction], float | None]) -> float | None:
        basic, dual = self.modes.get(Rung.BASIC), self.modes.get(Rung.DUALPATH)
        if basic is None or dual is None:
            return None
        b, d = jct(basic), jct(dual)
        return None if b is None or d is None or d <= 0 else b / d

    @property
    def predicted_ratio(self) -> float | None:
        """Predicted basic JCT / dualpath JCT."""
        return self._ratio(lambda m: m.jct_s)

    @property
    def measured_ratio(self) -> float | None:
        """Measured basic JCT / dualpath JCT (None when either did not run)."""
        return self._ratio(lambda m: m.measured_jct_s)

    @property
    def miss(self) -> float | None:
        """Predicted ratio / measured ratio − 1 (None without a measured ratio)."""
        p, m = self.predicted_ratio, self.measured_ratio
        return None if p is None or m is None else ratio_miss(p, m)

    @property
    def flagged(self) -> bool:
        """True when the prediction misses the measured ratio by more than the tolerance."""
        return self.miss is not None and abs(self.miss) > self.tolerance

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``result.regime.testbed.prediction``)."""
        return {"modes": {m: {**asdict(p), "jct_s": p.jct_s, "bound": p.bound}
                          for m, p in self.modes.items()},
                "budget": asdict(self.budget), "tolerance": self.tolerance,
                "predicted_ratio": self.predicted_ratio,
                "measured_ratio": self.measured_ratio, "miss": self.miss,
                "flagged": self.flagged}


def predict(run: DemoRun, simulate_s: Simulate = simulate_jct_s,
            tolerance: float = TOLERANCE) -> TestbedPrediction:
    """Predict basic, dualpath and the oracle on the run's own configuration (module
    docstring); ``simulate_s`` gives ``T_sim`` (the cluster simulator by default)."""
    cfg, budget = demo_sim_config(run), core_budget(run)
    agents = [list(turns) for turns in run.agents]
    modes = {}
    for mode in PREDICTED:
        moved = moved_bytes(run, mode)
        measured = run.modes.get(mode)
        modes[str(mode)] = ModePrediction(
            str(mode), simulate_s(replace(cfg, mode=mode), agents), budget.floor_s(moved),
            budget.cpu_s(moved), moved / GB, measured.jct_s if measured else None)
    return TestbedPrediction(modes, budget, tolerance)


def describe(prediction: TestbedPrediction) -> list[str]:
    """Lines for the terminal: each mode's prediction beside its measurement, then the ratio
    (``[red]`` marked when it misses by more than the tolerance)."""
    b = prediction.budget
    lines = [f"testbed predicted ({b.cores} shared cores: {b.base_cpu_s:.1f} CPU-s of compute "
             f"and decode + {b.cpu_s_per_gb:.2f} CPU-s per GB of hit KV moved) vs measured:"]
    for p in prediction.modes.values():
        measured = "-" if p.measured_jct_s is None else f"{p.measured_jct_s:.2f} s"
        lines.append(f"  {p.mode:<9} {p.jct_s:6.2f} s (bound: {p.bound}; cores "
                     f"{p.cpu_s:.1f} CPU-s / {b.cores} = {p.cpu_floor_s:.2f} s, NICs and "
                     f"compute alone {p.sim_s:.2f} s)   measured {measured}")
    pr, mr, miss = prediction.predicted_ratio, prediction.measured_ratio, prediction.miss
    if pr is None:
        return lines
    if mr is None or miss is None:
        lines.append(f"  basic/dualpath: predicted {pr:.2f} (not measured)")
    elif prediction.flagged:
        lines.append(f"  [red]basic/dualpath: predicted {pr:.2f}, measured {mr:.2f}: "
                     f"{miss:+.0%}, MISSED by more than {prediction.tolerance:.0%}[/]")
    else:
        lines.append(f"  basic/dualpath: predicted {pr:.2f}, measured {mr:.2f}: {miss:+.0%}, "
                     f"within {prediction.tolerance:.0%}")
    return lines
