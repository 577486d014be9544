"""Synthetic agent trajectories from the paper's Table 2 presets (docs/paper.md §7.4).

A trajectory is a list of turns; turn ``i`` has a context (tokens from earlier turns), an
append and a generation length. The prompt is ``context + append``; the hit is the context
rounded down to whole blocks (the DE persists full blocks only, docs/design.md §9), so the prefill
computes ``prompt − hit`` tokens and the decode engine generates ``gen`` tokens.

Replay rule. With ``context_step=None`` the context grows by ``append + gen`` each turn (the
paper's A.3 rule for one trajectory). Table 2 reports means over 500 trajectories of varying
length, and a single trajectory with 157 turns of 429 + 176 tokens would average 47K of
context, not the table's 32,721 (long trajectories are truncated at MAL). The presets therefore
use ``context_step = 2·context / (turns − 1)`` by default, so the mean context over turns — and
the total hit volume, ≈ turns × context per agent as in docs/paper.md §7.2 — match Table 2, while
the per-turn append and generation (the compute) stay as the table gives them.

Lengths (``WorkloadConfig.lengths``). ``"same"`` (default): every agent replays that one
trajectory, so all finish together. ``"varied"``: trajectories of different lengths that
still match Table 2's means — turns, mean context *and* mean total length (87% of the MAL
in every row, so most trajectories run to the cap). Each agent's context starts at a first
prompt and grows by a fixed step per turn until ``prompt + gen`` would pass the MAL; its turn
count is exponential (Weka's real agentic sessions have a turn-count CV of 1.03), cut at
that cap, and drawn by stratified quantiles so the mix is the same for any agent count.
The first prompt, the step and the exponential's mean (:data:`VARIED`) are solved from the
three means; the paper does not publish the distribution, so this is one consistent
reading of its table, not its traces.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dualpath.workloads.sim_traces import trace_trajectories
from dualpath.workloads.trace_files import TRACES
from dualpath.workloads.turns import Turn


@dataclass(frozen=True)
class TrajectoryPreset:
    """One row of Table 2."""

    name: str
    turns: int
    append: int
    gen: int
    total_tokens: int
    mean_context: int

    def table_step(self) -> float:
        """Context growth per turn that gives the table's mean context over the turns."""
        return 2 * self.mean_context / max(1, self.turns - 1)


PRESETS: dict[str, TrajectoryPreset] = {
    "32k": TrajectoryPreset("32k", 60, 608, 148, 28_639, 17_183),
    "48k": TrajectoryPreset("48k", 106, 474, 172, 42_607, 25_120),
    "64k": TrajectoryPreset("64k", 157, 429, 176, 55_958, 32_721),
    # testbed scale (SmolLM2 on a CPU): 8 turns of 256 appended + 32 generated tokens
    "tiny": TrajectoryPreset("tiny", 8, 256, 32, 2_304, 1_008),
}


@dataclass(frozen=True)
class VariedLengths:
    """Varied trajectory lengths for one Table 2 row, solved from its means (module doc)."""

    first_prompt: int  # context of the first turn (all of it computed: no cache yet)
    step: float  # context growth per turn
    turns_mean: float  # mean of the exponential turn count before the cap
    max_len: int  # the MAL: a trajectory stops before ``prompt + gen`` would exceed it


# Solved so that mean turns, turn-weighted mean context and mean final length (last prompt +
# generation) match Table 2 under the MAL (32,768 / 49,152 / 65,536 tokens).
VARIED: dict[str, VariedLengths] = {
    "32k": VariedLengths(4006, 407.27, 240.90, 32_768),
    "48k": VariedLengths(4198, 359.65, 384.57, 49_152),
    "64k": VariedLengths(4153, 329.12, 547.72, 65_536),
}
LENGTHS = ("same", "varied")


@dataclass(frozen=True)
class WorkloadConfig:
    """``agents`` copies of a preset trajectory, all starting at t = 0 (offline)."""

    preset: str = "64k"
    agents: int = 1024
    block_size: int = 64
    context_step: float | None = -1.0  # -1: Table 2 mean (see module doc); None: append+gen
    turns: int | None = None  # truncate to this many turns (tests)
    append_scale: float = 1.0
    seed: int = 0  # trace sampling and online arrivals
    max_context: int | None = None  # traces: cut a trajectory where it exceeds this
    aps: float | None = None  # online: agents arrive as a Poisson process (agents/s)
    lengths: str = "same"  # "same": one trajectory for all; "varied": see the module doc
    subagents: bool = False  # weka: sub-agents as agents of their own (workloads/weka.py)

    def __post_init__(self) -> None:
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")
        if self.agents <= 0:
            raise ValueError(f"agents must be > 0, got {self.agents}")
        if self.aps is not None and self.aps <= 0:
            raise ValueError(f"aps must be > 0, got {self.aps}")


def trajectory(cfg: WorkloadConfig) -> list[Turn]:
    """The turns of one agent under ``cfg`` (every agent replays the same lengths)."""
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown workload {cfg.preset!r}; known: {sorted(PRESETS)} and the "
                         "traces weka, mooncake")
    p = PRESETS[cfg.preset]
    append = max(1, round(p.append * cfg.append_scale))
    step = (p.table_step() if cfg.context_step == -1.0
            else float(append + p.gen) if cfg.context_step is None else cfg.context_step)
    turns = p.turns if cfg.turns is None else min(cfg.turns, p.turns)
    out = []
    for i in range(turns):
        context = round(i * step)
        hit = context // cfg.block_size * cfg.block_size
        out.append(Turn(prompt=context + append, hit=hit, gen=p.gen))
    return out


def agent_trajectories(cfg: WorkloadConfig) -> list[list[Turn]]:
    """One trajectory per agent: a Table 2 preset (every agent the same list) or a real trace
    (``weka``, ``mooncake``: :func:`dualpath.workloads.sim_traces.trace_trajectories`)."""
    if cfg.lengths == "varied":
        return varied_trajectories(cfg)
    if cfg.preset in TRACES:
        return trace_trajectories(cfg.preset, cfg.agents, seed=cfg.seed,
                                  block_size=cfg.block_size, max_context=cfg.max_context,
                                  subagents=cfg.subagents)
    one = trajectory(cfg)
    return [one] * cfg.agents


def varied_trajectories(cfg: WorkloadConfig) -> list[list[Turn]]:
    """``lengths="varied"``: each agent replays the first turns of the longest trajectory
    (module doc); the turn counts, stratified exponential quantiles, are shuffled by
    ``random.Random(cfg.seed)`` so that online arrivals do not come sorted by length."""
    if cfg.preset not in VARIED:
        raise ValueError(f"lengths='varied' needs a Table 2 preset {sorted(VARIED)}, "
                         f"not {cfg.preset!r}")
    p, v = PRESETS[cfg.preset], VARIED[cfg.preset]
    append = max(1, round(p.append * cfg.append_scale))
    longest: list[Turn] = []
    while True:
        context = v.first_prompt + round(len(longest) * v.step)
        if longest and context + append + p.gen > v.max_len:
            break
        hit = context // cfg.block_size * cfg.block_size if longest else 0
        longest.append(Turn(prompt=context + append, hit=hit, gen=p.gen))
    cap = len(longest) if cfg.turns is None else min(cfg.turns, len(longest))
    counts = [min(cap, max(1, round(-v.turns_mean * math.log(1 - (a + 0.5) / cfg.agents))))
              for a in range(cfg.agents)]
    random.Random(cfg.seed).shuffle(counts)
    return [longest[:n] for n in counts]


def arrival_times(cfg: WorkloadConfig) -> list[float]:
    """Start time of each agent: all at 0 (offline) or a Poisson process at ``cfg.aps``."""
    if cfg.aps is None:
        return [0.0] * cfg.agents
    if cfg.aps <= 0:
        raise ValueError(f"aps must be > 0, got {cfg.aps}")
    rng, t, out = random.Random(cfg.seed), 0.0, []
    for _ in range(cfg.agents):
        out.append(t)
        t += rng.expovariate(cfg.aps)
    return out


def summary(turns: list[Turn], agents: int) -> dict[str, float]:
    """Totals of a workload: hit, miss and generated tokens, mean context, hit rate."""
    hit = sum(t.hit for t in turns)
    miss = sum(t.miss for t in turns)
    return {"turns": len(turns), "agents": agents, "hit_tokens": hit * agents,
            "miss_tokens": miss * agents, "gen_tokens": sum(t.gen for t in turns) * agents,
            "mean_context": hit / max(1, len(turns)), "hit_rate": hit / max(1, hit + miss)}
