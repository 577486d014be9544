"""What the offline ladder (``ladder.py``), the online search (``online.py``) and the report
(``report.py``) all do to an agent workload: store its first prompts beforehand, see its turns
as the timed run does, and spread the agents' arrivals."""

from __future__ import annotations

import random
import shutil
from typing import TYPE_CHECKING, Any

from dualpath.vocab import Rung

if TYPE_CHECKING:
    from rich.progress import Progress

    from dualpath.bench.agents.ladder import AgentsOptions
    from dualpath.workloads.turns import AgentTurn


def prime(run: Any, options: AgentsOptions, agents: list[list[AgentTurn]], bar: Progress,
          task: Any, mode: str) -> None:
    """Store the agents' first prompts, untimed (see ``prime_first_turns``). They are
    computed once and their blocks kept aside (``<store>/../../primed``): later modes and
    trials get a copy, as their stores hold the same keys. The oracle stores nothing, so it
    computes them on every cluster (its router remembers them)."""
    if not options.prime_first_turns:
        return
    kept = run.store.parent.parent / "primed"
    if mode != Rung.ORACLE and kept.is_dir():
        shutil.copytree(kept, run.store, dirs_exist_ok=True)
        return
    bar.update(task, description=f"{mode}: storing the first prompts (untimed)")
    run.run([a[:1] for a in agents], None, lambda: None, options.timeout_s)
    run.wait_for_writes()
    if mode != Rung.ORACLE:
        shutil.copytree(run.store, kept)


def timed_sim_turns(workload: Any, options: AgentsOptions) -> list[list[Any]]:
    """The workload's trajectories as the timed run sees them: with the first prompts stored
    beforehand, each first turn hits its full blocks (leaving one token to compute)."""
    from dataclasses import replace as changed

    turns = workload.sim_turns()
    if not options.prime_first_turns:
        return turns
    b = options.block_size
    return [[changed(t[0], hit=(t[0].prompt - 1) // b * b), *t[1:]] if t else t for t in turns]


def expected_hit_rate(workload: Any, options: AgentsOptions) -> float:
    """The hit rate an engine should measure on the timed run."""
    turns = timed_sim_turns(workload, options)
    hits = sum(t.hit for traj in turns for t in traj)
    return hits / max(1, sum(t.prompt for traj in turns for t in traj))


def poisson_offsets(count: int, aps: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of ``count`` agents at ``aps`` agents per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(aps)
    return out
