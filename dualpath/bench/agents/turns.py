"""What the offline ladder (``ladder.py``), the online search (``online.py``) and the report
(``report.py``) all do to an agent workload: load it with the bench's options, store its
primers beforehand, see its turns as the timed run does, and spread the agents' arrivals."""

from __future__ import annotations

import random
import shutil
from typing import TYPE_CHECKING, Any

from dualpath.vocab import Rung

if TYPE_CHECKING:
    from rich.progress import Progress

    from dualpath.bench.agents.ladder import AgentsOptions
    from dualpath.workloads.agents import Workload
    from dualpath.workloads.turns import AgentTurn


def load_bench_workload(options: AgentsOptions, vocab_size: int) -> Workload:
    """The workload ``options`` ask for (``agents``, ``turns``, ``scale`` left to the
    workload's default where None; the window from ``first_turn``), at the engines' block size.

    Raises ``ValueError`` as :func:`dualpath.workloads.agents.load_workload` does.
    """
    from dualpath.workloads.agents import load_workload

    kwargs = {k: v for k, v in (("agents", options.agents), ("turns", options.turns),
                                ("scale", options.scale)) if v is not None}
    return load_workload(options.workload, vocab_size=vocab_size,
                         block_size=options.block_size, max_context=options.max_context,
                         trace_dir=options.trace_dir, seed=options.seed,
                         first_turn=options.window_first_turn, **kwargs)


def prime(run: Any, options: AgentsOptions, primers: list[AgentTurn], bar: Progress,
          task: Any, mode: str) -> None:
    """Store the agents' primers, untimed (see ``prime_first_turns``): each agent's first
    prompt, or the request before its window (``Workload.primers``). They are computed once
    and their blocks kept aside (``<store>/../../primed``): later modes and trials get a
    copy, as their stores hold the same keys. The oracle stores nothing, so it computes them
    on every cluster (its router remembers them)."""
    if not options.prime_first_turns:
        return
    kept = run.store.parent.parent / "primed"
    if mode != Rung.ORACLE and kept.is_dir():
        shutil.copytree(kept, run.store, dirs_exist_ok=True)
        return
    bar.update(task, description=f"{mode}: storing the primers (untimed)")
    run.run([[p] for p in primers], None, lambda: None, options.timeout_s)
    run.wait_for_writes()
    if mode != Rung.ORACLE:
        shutil.copytree(run.store, kept)


def timed_sim_turns(workload: Workload, options: AgentsOptions) -> list[list[Any]]:
    """The workload's trajectories as the timed run sees them: with the primers stored
    beforehand, each first turn hits the full blocks it shares with its primer (all of its
    own, leaving one token to compute, when the primer is the turn itself)."""
    return workload.sim_turns(primed=options.prime_first_turns)


def expected_hit_rate(workload: Workload, options: AgentsOptions) -> float:
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
