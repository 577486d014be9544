"""Online serving in ``dualpath bench agents``: Poisson arrivals, latency over the steady
window, and a short search for the largest APS whose mean TTFT meets the SLO.

The paper's SLO is TTFT ≤ 4 s and TPOT ≤ 50 ms (docs/paper.md §7.7), about 2.3× its TTFT at capacity
(1.74 s). The testbed is slower, so the SLO is scaled alike: :data:`TTFT_SLO_S`, about 2.3× a
default turn's TTFT with the cluster to itself (~2.2 s: a 28 MB hit read at 16 MB/s, then
its prefill), stated in every result (``--ttft-slo-s`` changes it); TPOT is reported, not
required (the testbed's decode step is CPU-bound).

Search (:func:`search_capacity`): the first trial runs at :data:`FIRST_LOAD` of the mode's
offline throughput (agents / offline JCT) when the offline run is there, else at
:data:`FIRST_APS`; each next trial
multiplies the APS by :data:`STEP` while every trial met the SLO, divides by it while none did,
and then bisects (geometrically) between the highest APS that met it and the lowest that did
not. The capacity is :func:`dualpath.sim.online.aps_capacity` over the trials (the
simulator's own rule: interpolated where the mean TTFT crosses the SLO).

A trial ends once every turn submitted by the last arrival has returned (``cut_after_s``):
later turns are outside the window, and the agents' remaining turns, a few turn latencies
of draining, would only add time; the agents keep submitting until then, so the measured
turns see the same load, and what is in flight at the cut is aborted. ``span_s`` runs to
the cut.
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from dualpath.bench.replay import NO_PACING, Pacing
from dualpath.sim.online import aps_capacity
from dualpath.workloads.turns import AgentTurn

TTFT_SLO_S = 5.0
FIRST_APS = 0.05
FIRST_LOAD = 0.8  # the first trial's APS / the mode's offline throughput (agents / JCT)
STEP = 1.6
WARMUP_FRACTION = 0.2  # of the arrival span: turns submitted before are not counted


def _pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def steady_stats(records: list[dict[str, Any]], offsets_s: list[float]) -> dict[str, Any]:
    """Mean and p90 TTFT, time to second token and TPOT over the turns submitted between
    :data:`WARMUP_FRACTION` of the arrival span and the last arrival (all turns if none)."""
    last = max(offsets_s)
    window = [r for r in records if WARMUP_FRACTION * last <= r["submitted_s"] <= last]
    window = window or records
    out: dict[str, Any] = {"window_turns": len(window), "window_s": [WARMUP_FRACTION * last,
                                                                     last]}
    for key in ("ttft_s", "ttst_s", "tpot_s"):
        values = [r[key] for r in window if r.get(key) is not None]
        out[key] = mean(values) if values else None
        out[key.replace("_s", "_p90_s")] = _pct(values, 0.9)
    return out


def _first_aps(agents: int, offline: dict[str, Any] | None) -> float:
    return FIRST_LOAD * agents / offline["jct_s"] if offline else FIRST_APS


def _next_aps(trials: list[dict[str, Any]]) -> float:
    """Up by :data:`STEP` until a trial fails, down until one meets the SLO, then halfway
    (geometrically) between the highest that met it and the lowest that did not."""
    met = [t["aps"] for t in trials if t["meets_slo"]]
    failed = [t["aps"] for t in trials if not t["meets_slo"]]
    if not failed:
        return max(met) * STEP
    if not met:
        return min(failed) / STEP
    return (max(met) * min(failed)) ** 0.5


def search_capacity(run: Any, mode: str, agents: list[list[AgentTurn]], options: Any,
                    offline: dict[str, Any] | None, bar: Any,
                    primers: list[AgentTurn] | None = None, pacing: Pacing = NO_PACING,
                    first_aps: float | None = None) -> dict[str, Any]:
    """Trials at rising or falling APS on ``run`` (a warm cluster, the store emptied and the
    ``primers`` stored before each: by default each agent's first turn); the trials and the
    capacity under the SLO. ``pacing``: each agent's tool times and session (its arrival is
    still the trial's Poisson offset); ``first_aps``: the first trial's (default: from the
    offline run)."""
    from dualpath.bench.agents.turns import poisson_offsets, prime

    slo = options.ttft_slo_s or TTFT_SLO_S
    aps = first_aps or _first_aps(len(agents), offline)
    task = bar.add_task(f"{mode}: online", total=options.online_trials * sum(map(len, agents)))
    trials = []
    for i in range(options.online_trials):
        run.empty()
        prime(run, options, [a[0] for a in agents] if primers is None else primers, bar, task,
              mode)
        offsets = poisson_offsets(len(agents), aps, options.seed + i)
        bar.update(task, description=f"{mode}: online at {aps:.3f} APS")
        paced = {"pacing": pacing} if pacing != NO_PACING else {}  # the HTTP run: none
        records, span = run.run(agents, offsets, lambda: bar.advance(task), options.timeout_s,
                                cut_after_s=max(offsets), **paced)
        bar.update(task, completed=(i + 1) * sum(map(len, agents)))  # unmeasured turns cut
        stats = steady_stats(records, offsets)
        trials.append({"mode": mode, "aps": aps, "span_s": span, **stats,
                       "meets_slo": stats["ttft_s"] is not None and stats["ttft_s"] <= slo,
                       "records": records})
        aps = _next_aps(trials)
    rows = [{**t, "ttft_s": t["ttft_s"] if t["ttft_s"] is not None else float("inf")}
            for t in trials]
    return {"mode": mode, "ttft_slo_s": slo, "agents": len(agents), "trials": trials,
            "capacity_aps": aps_capacity(rows, mode, slo)}
