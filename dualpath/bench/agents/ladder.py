"""``dualpath bench agents``: agentic workloads through the real cluster, the whole mode ladder.

Workloads (``bench/workloads.py``): the paper's Table 2 presets scaled to the model's context,
the Weka agentic traces (a shipped sample, or any folder in the Weka format), Mooncake's trace
format. Every mode (``recompute``: no KV reuse at all, ``basic``, ``layerwise``,
``round_robin``, ``dualpath``, ``oracle``) runs on a fresh cluster (1 prefill + 2 decode engine
processes by default) over an empty store, after a short untimed warm-up that shares nothing
with the workload, through the Python cluster API (``--via python``) or a ``dualpath serve``
process and its streaming OpenAI API (``--via http``). Each agent's primer is stored untimed
before a timed run (``prime_first_turns``; ``--cold-start`` times the first turns cold): the
request before its window of turns (``--first-turn``: by default the Weka traces' turns 21-24,
where an agent reloads 98% of its context each turn), or its first prompt (the system and tool
prompt, which deployments keep cached); computed once, its blocks are copied into later modes'
and trials' stores.

* **Offline** (the paper's rule): every agent starts at once, zero tool latency; JCT is the
  time to the last agent's last turn.
* **Online**: agents arrive as a Poisson process at a given APS (agents per second); TTFT, time
  to second token and TPOT over the steady window (turns submitted between 20% of the arrival
  span and the last arrival). The largest APS whose mean TTFT meets the SLO is found by a short
  search per mode (``bench/agents_online.py``) on the mode's cluster after its offline run,
  the store emptied and primed before each trial. The SLO is scaled for the testbed and
  stated in the result.

Storage NICs are capped so that ``basic`` is storage-bound (docs/design.md §6): unless a cap is
given, the oracle runs first and its JCT calibrates the cap (one node's NIC reads the timed run's
hits in :data:`STORAGE_BOUND` × that JCT), so the regime is the same on a faster or slower CPU.
Compute NICs run at 8× the storage cap (the paper's per-GPU ratio); each node's NIC rates are
sampled every second. The
result (JSON with a top-level ``summary``, the resolved cluster config of every mode, every
turn's record) and its plots are written by ``bench/agents_report.py``; the same workload is
also run through the simulator (the testbed preset's settings, the very same trajectories)
when a ``dualpath profile`` is given (``--profile``).

With ``--engine vllm`` the rungs run on vLLM instances that carry our KV connector, with vLLM's
prefix cache on and our store as the tier below it, beside plain vLLM on the same hardware
(``bench/agents/plain_vllm.py``): as many plain instances as the cluster has engines, sessions
pinned to them. Every instance, ours or plain, gets the same device-KV budget, bounded so that
the workload's working set is at least 5x what they hold together (``bench/agents/kv_budget.py``;
a workload too small for that is refused). The ladder's ``oracle`` on vLLM is plain vLLM with an
unbounded prefix cache (every hit free); it calibrates the storage cap when it runs, else the
plain vLLM row does.
"""

from __future__ import annotations

import datetime
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from dualpath.bench.agents.kv_budget import MIN_WORKING_SET_OVER_BUDGET, PLAIN_ROW, KvBudget
from dualpath.bench.agents.nics import utilization
from dualpath.bench.agents.run import HttpRun, PythonRun
from dualpath.bench.agents.turns import load_bench_workload, prime, timed_sim_turns
from dualpath.bench.cluster import testbed_config
from dualpath.bench.demo import warmup_turns
from dualpath.bench.report import (
    host_cpu_shares,
    host_cpu_ticks,
    kv_bytes_per_token,
    machine_profile,
)
from dualpath.config import ClusterConfig, VllmConfig
from dualpath.vocab import EngineKind, Mode, Rung
from dualpath.workloads.sample import FIRST_TURN as SAMPLE_FIRST_TURN
from dualpath.workloads.turns import AgentTurn

# A calibrated storage cap lets the prefill node's NIC alone read the timed run's hits in this
# many times the oracle's JCT: basic is storage-bound (its reads alone take 1.6x the
# compute-bound time; with compute it measures about 1.9x, as the paper's Basic is up to 1.87x
# slower than DualPath), and the three NICs of 1 PE + 2 DE can read them in about half the
# oracle's time, as the paper's DualPath reads within its compute. κ is about this bound × the
# oracle's JCT / hit tokens / recompute seconds per token: 2.0 put it at 0.102 on the default
# workload, 1.8 at 0.089-0.103 over three bf16 runs (2026-12-06/07), over the regime's 0.1.
STORAGE_BOUND = 1.6
# The oracle moves no KV, so its caps do not matter; it runs under this one while calibrating.
NOMINAL_CAP_MB_S = 1000.0
VIAS = ("python", "http")
BLOCK_SIZE = 16  # tokens per KV block, our engines
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention kernels take multiples of 32
HOST_POOL_TOKENS = 24_576  # each engine's DRAM buffer (384 blocks of 64 tokens)
SAVE_STAGING_TOKENS = 4096  # of those, what a DE keeps for persisting blocks
# The rungs vLLM engines run (round robin needs our engines; docs/vllm-connector.md); their
# recompute keeps vLLM's prefix cache off too, their oracle is plain vLLM with an unbounded
# prefix cache (bench/agents/plain_vllm.py)
VLLM_RUNGS = (Rung.RECOMPUTE, Rung.BASIC, Rung.LAYERWISE, Rung.DUALPATH, Rung.ORACLE)
# The default workload, (agents, turns, scale), by engine kind. Ours: 8 Weka sessions, turns
# 21-24, token counts / 64 (h 98.2% at 16-token blocks against the trace's own 98.6%, 46K
# prompt tokens; recompute reads none of them). vLLM's: the device KV of its 3 instances must
# hold the longest request each (vLLM's floor) and still be <= 1/5 of the working set, so 28
# sessions (the sample's 32 less those whose request 20 exceeds max_context), turns 21-22,
# / 32 (h 97.6% at 32-token blocks, working set 5.15x the floor's total, 161K prompt tokens).
DEFAULT_WORKLOAD = {EngineKind.DUALPATH: (8, 4, 64.0), EngineKind.VLLM: (28, 2, 32.0)}


@dataclass(frozen=True)
class AgentsOptions:
    """What ``dualpath bench agents`` runs; the defaults are the run in docs/results.md."""

    workload: str = "weka-sample"
    modes: tuple[Rung, ...] = tuple(Rung)  # the ladder (vocab.LADDER), in its order
    via: str = "python"
    # Agents, turns each and the token-count divisor; None: DEFAULT_WORKLOAD's for the engine
    # kind
    agents: int | None = None
    turns: int | None = None
    scale: float | None = None
    # The top-level request each agent's timed window starts at (traces; the request before
    # it is stored untimed first). None: the sample's FIRST_TURN for Weka, else 1.
    first_turn: int | None = None
    trace_dir: str | None = None  # the traces folder (else $DUALPATH_TRACES_DIR)
    max_context: int = 8192
    model: str | None = None
    # Storage-NIC read cap per node (MB/s). None: calibrated on this machine after the oracle's
    # run, so that basic is storage-bound by the same margin on any CPU (docs/design.md §6, see
    # STORAGE_BOUND); a fixed value is the same bandwidth for a faster or slower compute.
    read_cap_mb_s: float | None = None
    compute_cap_mb_s: float | None = None  # None: COMPUTE_PER_STORAGE x read_cap_mb_s
    # auto: with our engines as the demo's (bf16 where the device computes it natively, else
    # float32: local_devices.bench_dtype); with vLLM engines float32, as the ladder was measured
    dtype: str = "auto"
    # The engines' device: auto is cuda where this host has a GPU (each engine on its own,
    # round robin: LocalCluster), else cpu; run_bench resolves it before the first cluster.
    device: str = "auto"
    # None: 16 tokens (a turn loses its partial last block from the hit: 16-token blocks keep
    # the workload's hit rate within 0.5 points of the trace's), 32 with vLLM engines (its CPU
    # attention takes multiples of 32)
    block_size: int | None = None
    # None: HOST_POOL_TOKENS and SAVE_STAGING_TOKENS in blocks (agent turns add many blocks
    # and generate few: demo.py)
    host_pool_blocks: int | None = None
    save_staging_blocks: int | None = None
    read_deadline_s: float = 600.0  # a read given up is recomputed: basic must not recompute
    prefill: int = 1
    decode: int = 2
    split_read: bool = False  # dualpath and round_robin read a hit partly on each side
    offline: bool = True
    # Store every agent's first prompt (untimed, after the warm-up) before the timed run: the
    # agent's system and tool prompt, which real deployments keep cached. The timed run then
    # starts with a hit on it, as the long trajectories of the paper's traces do, rather than
    # with one cold prefill per agent that is the same work in every mode.
    prime_first_turns: bool = True
    online_modes: tuple[Rung, ...] = (Rung.BASIC, Rung.DUALPATH)
    online_trials: int = 2  # APS tried per mode (more: a finer capacity, a longer run)
    ttft_slo_s: float | None = None  # None: scaled from the paper's 4 s (agents_online.py)
    seed: int = 0
    timeout_s: float = 900.0  # per run
    json_path: str | None = "results/agents.json"
    work_dir: str | None = None
    profile: str | None = None  # a `dualpath profile` JSON: also predict with the simulator
    # What computes behind the engine processes; with vLLM, plain vLLM (its own prefix cache,
    # no storage tier) runs first as the ``vllm`` row (and calibrates the storage cap when the
    # oracle does not run)
    engine: EngineKind = EngineKind.DUALPATH
    # vLLM engines: the working set over every instance's device KV together (kv_budget.py)
    min_working_set_over_budget: float = MIN_WORKING_SET_OVER_BUDGET
    # vLLM engines, resolved by run_bench from the workload: each instance's device KV (bytes)
    # and max_model_len (None: VllmConfig's default budget, max_context)
    vllm_kv_cache_bytes: int | None = None
    vllm_max_model_len: int | None = None

    @property
    def applied_read_cap_mb_s(self) -> float:
        """The cap a cluster runs under: the given or calibrated one, else (the oracle's
        calibration run, which moves no KV) :data:`NOMINAL_CAP_MB_S`."""
        return self.read_cap_mb_s or NOMINAL_CAP_MB_S

    @property
    def window_first_turn(self) -> int:
        """The first turn of each agent's timed window (``first_turn`` or its default)."""
        if self.first_turn is not None:
            return self.first_turn
        return SAMPLE_FIRST_TURN if self.workload in ("weka", "weka-sample") else 1

    def _resolve_defaults(self) -> None:
        """The workload, block size and host-pool slots where left None, and vLLM's dtype of
        ``auto`` (see their comments)."""
        for name, value in zip(("agents", "turns", "scale"), DEFAULT_WORKLOAD[self.engine],
                               strict=True):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.dtype == "auto" and self.engine == EngineKind.VLLM:
            object.__setattr__(self, "dtype", "float32")
        if self.block_size is None:
            object.__setattr__(self, "block_size", VLLM_BLOCK_SIZE
                               if self.engine == EngineKind.VLLM else BLOCK_SIZE)
        if self.host_pool_blocks is None:
            object.__setattr__(self, "host_pool_blocks", HOST_POOL_TOKENS // self.block_size)
        if self.save_staging_blocks is None:
            object.__setattr__(self, "save_staging_blocks",
                               SAVE_STAGING_TOKENS // self.block_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", EngineKind(self.engine))
        self._resolve_defaults()
        unknown = [m for m in self.modes + self.online_modes if m not in tuple(Rung)]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; known: {', '.join(Rung)}")
        object.__setattr__(self, "modes", tuple(map(Rung, self.modes)))
        object.__setattr__(self, "online_modes", tuple(map(Rung, self.online_modes)))
        if self.via not in VIAS:
            raise ValueError(f"--via must be one of {VIAS}, got {self.via!r}")
        if self.read_cap_mb_s is not None and not self.read_cap_mb_s > 0:
            raise ValueError(f"--read-cap-mb-s must be > 0, got {self.read_cap_mb_s}")
        if not self.min_working_set_over_budget > 0:
            raise ValueError(f"--min-working-set-over-budget must be > 0, got "
                             f"{self.min_working_set_over_budget}")
        if self.engine == EngineKind.VLLM:
            unsupported = [m for m in self.modes + self.online_modes if m not in VLLM_RUNGS]
            if unsupported or self.online_modes or not self.offline:
                raise ValueError(f"with vLLM engines: offline {', '.join(VLLM_RUNGS)} only "
                                 f"(got modes {list(self.modes)}, online "
                                 f"{list(self.online_modes)})")
            return
        if self.read_cap_mb_s is None and not (self.offline and Rung.ORACLE in self.modes):
            raise ValueError("the storage cap is calibrated on the oracle's offline run: add "
                             "oracle to --modes or give --read-cap-mb-s")


def cluster_config(options: AgentsOptions, mode: str, store: Path) -> ClusterConfig:
    """The cluster of one rung of the ladder: its serving mode and scheduler policy."""
    rung = Rung(mode)
    config = testbed_config(
        store, rung.mode, dtype=options.dtype,
        device=options.device, block_size=options.block_size,
        read_cap_mb_s=options.applied_read_cap_mb_s,
        compute_cap_mb_s=options.compute_cap_mb_s, read_deadline_s=options.read_deadline_s,
        policy=rung.policy,
        num_prefill=options.prefill, num_decode=options.decode,
        split_read=options.split_read and rung.mode == Mode.DUALPATH,
        host_pool_blocks=options.host_pool_blocks,
        save_staging_blocks=options.save_staging_blocks)
    if options.engine != EngineKind.VLLM:
        return config
    return replace(config, engine_kind=EngineKind.VLLM, vllm=VllmConfig(
        max_model_len=options.vllm_max_model_len or options.max_context,
        kv_cache_bytes=options.vllm_kv_cache_bytes, prefix_caching=rung.mode != Mode.RECOMPUTE,
        extra_args=("--enforce-eager",)))


def _open(options: AgentsOptions, model_dir: Path, mode: str, work: Path) -> Any:
    """A fresh cluster for ``mode`` over an empty store under ``work``."""
    store = work / mode / "kv"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    config = cluster_config(options, mode, store)
    if options.via == "http":
        return HttpRun(model_dir, config, work / mode / "logs")
    return PythonRun(model_dir, config, config.mode, work / mode / "logs")


def run_mode(options: AgentsOptions, model_dir: Path, mode: str,
             agents: list[list[AgentTurn]], warmup: list[list[AgentTurn]], work: Path,
             bar: Progress, primers: list[AgentTurn] | None = None,
             ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One mode on a fresh cluster: offline (if asked), then the online search (if asked) on
    the same cluster, the store emptied in between, ``primers`` stored before each (by
    default each agent's first turn); the offline row and the online result."""
    from dualpath.bench.agents.online import search_capacity

    if options.engine == EngineKind.VLLM and mode == Rung.ORACLE:
        return _plain_vllm(options, model_dir, agents, warmup, work, bar, Rung.ORACLE,
                           primers), None
    with _open(options, model_dir, mode, work) as run:
        row = offline_run(run, options, mode, agents, warmup, work, bar, primers) if (
            options.offline and mode in options.modes) else None
        if mode not in options.online_modes:
            return row, None
        if row is None:
            run.run(warmup, None, lambda: None, 300.0)
        return row, search_capacity(run, mode, agents, options, row, bar, primers)


def offline_run(run: Any, options: AgentsOptions, mode: str, agents: list[list[AgentTurn]],
                warmup: list[list[AgentTurn]], work: Path, bar: Progress,
                primers: list[AgentTurn] | None = None) -> dict[str, Any]:
    """Offline: all agents at once, after a warm-up and the priming (``primers``, by default
    each agent's first turn); JCT, records, NICs."""
    task = bar.add_task(f"{mode}: warming up", total=sum(map(len, agents)))
    run.run(warmup, None, lambda: None, 300.0)
    run.empty()
    prime(run, options, [a[0] for a in agents] if primers is None else primers, bar, task,
          mode)
    bar.update(task, description=f"{mode}: offline")
    sampler = run.sampler().start()
    busy_before, ticks_before = run.busy_s(), host_cpu_ticks()
    records, jct = run.run(agents, None, lambda: bar.advance(task), options.timeout_s)
    samples = sampler.stop()
    spent = seconds_spent(busy_before, run.busy_s())
    host_cpu = host_cpu_shares(ticks_before, host_cpu_ticks())
    bar.update(task, description=f"{mode}: done")
    return {"mode": mode, "jct_s": jct, "records": records, "router": run.counters(),
            "engine_busy_s": {name: s["busy_s"] for name, s in spent.items()},
            "engine_loop_s": {name: {k: v for k, v in s.items() if k != "busy_s"}
                              for name, s in spent.items()},
            "host_cpu": host_cpu,
            "nics": utilization(samples, options.applied_read_cap_mb_s, None, sampler.interval_s),
            "config": asdict(cluster_config(options, mode, work / mode / "kv"))}


def seconds_spent(before: dict[str, dict[str, float]],
                  after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per engine, each time counter's growth from ``before`` to ``after``."""
    return {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in counters.items()}
            for name, counters in after.items()}


def timed_hit_bytes(workload: Any, options: AgentsOptions, model_dir: Path) -> int:
    """Bytes of KV the timed run's hits read from storage (the same in every mode but oracle)."""
    hits = sum(t.hit for traj in timed_sim_turns(workload, options) for t in traj)
    return hits * kv_bytes_per_token(model_dir, options.dtype)


def calibrated_cap_mb_s(hit_bytes: int, oracle_jct_s: float) -> float:
    """The storage cap per node at which one node's NIC reads ``hit_bytes`` in
    :data:`STORAGE_BOUND` × the oracle's JCT."""
    if not oracle_jct_s > 0:
        raise ValueError(f"the oracle's JCT must be > 0 to calibrate, got {oracle_jct_s}")
    return max(hit_bytes, 1) / (STORAGE_BOUND * oracle_jct_s) / 1e6


def run_bench(options: AgentsOptions, console: Console | None = None) -> dict[str, Any]:
    """Every mode offline, the online APS search, the simulator's prediction; the report."""
    from dualpath.bench.agents.report import build_result, print_report, write_report
    from dualpath.local_devices import bench_dtype, resolve_local_device
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    console = console or Console()
    began = time.perf_counter()
    device = resolve_local_device(options.device)
    options = replace(options, device=device, dtype=bench_dtype(options.dtype, device))
    model_dir = resolve_model(options.model)
    vocab = load_spec(model_dir).vocab_size
    workload = load_bench_workload(options, vocab)
    warmup = warmup_turns(vocab, options.block_size, options.seed)
    budget: KvBudget | None = None
    if options.engine == EngineKind.VLLM:
        options, budget = _vllm_budget(options, workload.agents, warmup, model_dir,
                                       workload.primer_turns())
    console.print(_headline(options, workload, model_dir))
    if budget is not None:
        console.print(f"plain vLLM and the ladder's vLLM instances: {budget.line()}")
    work = Path(options.work_dir or tempfile.mkdtemp(prefix="dualpath-bench-agents-"))
    offline, online = [], []
    calibration: dict[str, float] | None = None
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            calibrate = options.read_cap_mb_s is None
            if options.engine == EngineKind.VLLM:
                row = _plain_vllm(options, model_dir, workload.agents, warmup, work, bar,
                                  primers=workload.primer_turns())
                offline.append(row)
                if calibrate and Rung.ORACLE not in options.modes:
                    options, calibration = _calibrate(options, workload, model_dir,
                                                      row["jct_s"], console, "plain vLLM")
                    calibrate = False
            modes = list(options.modes if options.offline else ())
            modes += [m for m in options.online_modes if m not in modes]
            if calibrate:  # the oracle first: its JCT sets the storage cap of the others
                modes = [Rung.ORACLE, *(m for m in modes if m != Rung.ORACLE)]
            for mode in modes:
                row, searched = run_mode(options, model_dir, mode, workload.agents, warmup,
                                         work, bar, workload.primer_turns())
                offline += [row] if row else []
                online += [searched] if searched else []
                if calibrate and mode == Rung.ORACLE and row:
                    options, calibration = _calibrate(options, workload, model_dir,
                                                      row["jct_s"], console)
    finally:
        if options.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    result = build_result(options, workload, model_dir.name, offline, online,
                          kv_bytes_per_token(model_dir, options.dtype))
    result["summary"]["read_cap_mb_s"] = options.read_cap_mb_s
    result["summary"]["read_cap_calibration"] = calibration
    if budget is not None:
        result["summary"]["plain_vllm"] = budget.summary()
    result["wall_s"] = time.perf_counter() - began
    result["date"] = datetime.date.today().isoformat()
    result["machine"] = machine_profile()
    print_report(result, console)
    if options.json_path:
        write_report(result, options.json_path, console)
    console.print(f"bench agents took {result['wall_s']:.0f} s")
    return result


def _plain_vllm(options: AgentsOptions, model_dir: Path, agents: list[list[AgentTurn]],
                warmup: list[list[AgentTurn]], work: Path, bar: Progress,
                row: str = PLAIN_ROW, primers: list[AgentTurn] | None = None) -> dict[str, Any]:
    """The plain vLLM row, or (``row`` oracle) the vLLM ladder's oracle: plain vLLM with an
    unbounded prefix cache (``bench/agents/plain_vllm.py``); ``primers`` (default each
    agent's first turn) go into the prefix caches first, untimed."""
    from dualpath.bench.agents.kv_budget import unbounded_kv_bytes
    from dualpath.bench.agents.plain_vllm import plain_row

    config = cluster_config(options, Rung.BASIC, work / row / "kv")
    instances = options.prefill + options.decode
    kv_bytes = config.vllm.kv_cache_memory_bytes
    primers = [a[0] for a in agents] if primers is None else primers
    if row == Rung.ORACLE:
        block_bytes = kv_bytes_per_token(model_dir, options.dtype) * options.block_size
        kv_bytes = unbounded_kv_bytes(agents, warmup, instances, options.block_size,
                                      block_bytes, config.vllm.max_model_len, primers)
    return plain_row(config, model_dir, agents, warmup,
                     primers if options.prime_first_turns else None, options.timeout_s,
                     work / row, bar, instances, kv_bytes, row)


def _vllm_budget(options: AgentsOptions, agents: list[list[AgentTurn]],
                 warmup: list[list[AgentTurn]], model_dir: Path,
                 primers: list[AgentTurn] | None = None) -> tuple[AgentsOptions, KvBudget]:
    """``options`` with every vLLM instance's device KV and ``max_model_len`` bounded for the
    workload, its ``primers`` and ``warmup`` (``bench/agents/kv_budget.py``; ``KvBudgetError``
    when it is too small)."""
    from dualpath.bench.agents.kv_budget import (
        bounded_kv_budget,
        longest_request_tokens,
        max_model_len_for,
        working_set_tokens,
    )

    bs, per_token = options.block_size, kv_bytes_per_token(model_dir, options.dtype)
    longest = max(longest_request_tokens(agents, bs), longest_request_tokens(warmup, bs),
                  longest_request_tokens([[p] for p in primers or []], bs))
    budget = bounded_kv_budget(working_set_tokens(agents, bs) * per_token,
                               options.prefill + options.decode, per_token * bs,
                               max_model_len_for(longest, bs), bs,
                               options.min_working_set_over_budget)
    return replace(options, vllm_kv_cache_bytes=budget.kv_budget_bytes_each,
                   vllm_max_model_len=budget.max_model_len), budget


def _calibrate(options: AgentsOptions, workload: Any, model_dir: Path, oracle_jct_s: float,
               console: Console, reference: str = "oracle") -> tuple[AgentsOptions,
                                                                     dict[str, float]]:
    """``options`` with the storage cap the oracle's JCT calibrates, and what it came from."""
    hit_bytes = timed_hit_bytes(workload, options, model_dir)
    cap = calibrated_cap_mb_s(hit_bytes, oracle_jct_s)
    console.print(f"storage NICs calibrated: {cap:.1f} MB/s per node ({hit_bytes / 1e6:,.0f} MB "
                  f"of hits read by one node in {STORAGE_BOUND:g} x the {reference}'s "
                  f"{oracle_jct_s:.1f} s)")
    return replace(options, read_cap_mb_s=cap), {
        "storage_bound": STORAGE_BOUND, "oracle_jct_s": oracle_jct_s, "hit_mb": hit_bytes / 1e6}


def _headline(options: AgentsOptions, workload: Any, model_dir: Path) -> str:
    n = len(workload.agents)
    turns = sum(map(len, workload.agents))
    reference = ("plain vLLM" if options.engine == EngineKind.VLLM
                 and Rung.ORACLE not in options.modes else "the oracle")
    caps = (f"{options.read_cap_mb_s:g} MB/s per node" if options.read_cap_mb_s else
            f"calibrated on {reference} ({STORAGE_BOUND:g} x its JCT to read the hits on one)")
    return (f"[bold]dualpath bench agents[/]: {workload.name}, {n} agents, {turns} turns, via "
            f"{options.via}; {model_dir.name} ({options.dtype}, {options.device}); "
            f"{options.engine} engines, {options.prefill} PE + "
            f"{options.decode} DE; storage NICs {caps}; "
            f"modes {', '.join(options.modes) if options.offline else '-'}; online "
            f"{', '.join(options.online_modes) or '-'}")


def with_overrides(options: AgentsOptions, **changes: Any) -> AgentsOptions:
    """``options`` with ``changes`` (``None`` values ignored)."""
    return replace(options, **{k: v for k, v in changes.items() if v is not None})
