"""``dualpath demo``: what DualPath does, measured on this machine in a few minutes.

It starts the embedded cluster once (the router in this process; 1 prefill + 2 decode engine
processes of the default model, one node each; Mooncake transfers; KV in files under a
temporary folder) and replays the shipped excerpt of real agent sessions
(``bench/demo_trace.py``) as concurrent agents: each agent submits its next turn as soon as its
previous one returned, the prompt being the context so far (or the part of it the trace keeps)
plus the turn's new tokens. Token ids are random: the content does not matter, the KV does; it
is really stored and read back, so most of every later prompt is a storage hit. The excerpt
keeps turns 21-25 of each session (``workloads/demo.py``), where an agent reloads 98% of its
prompt every turn, as in the paper (98.7%).

Each mode, ``basic`` then ``dualpath``, runs over an emptied store, after a short warm-up. Every
session's first turn (a cold prefill of the agent's system prompt, the same in every mode) runs
once, untimed, in the first mode; its stored blocks are put back for the next mode. The timed
part is the agent loop from turn 2 on, where every turn reloads its context: JCT, TTFT
(submit to the first token, streamed), turn latency, hit rate, and the bytes each node's
storage NIC read.

The storage NICs are capped so that ``basic`` is storage-bound, as agentic serving is in the
paper (docs/design.md §6): ``basic`` reads every hit through the prefill node's NIC, ``dualpath``
also through the two decode nodes' NICs, forwarding over the compute network, capped at 8x the
storage cap (the paper's per-GPU ratio). Settings that differ from the cluster's defaults are
explained where :class:`DemoOptions` sets them; the run reports deadline misses and requests
placed more than once, which would make the figures mean something else.
"""

from __future__ import annotations

import datetime
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from dualpath.bench.cluster import COMPUTE_PER_STORAGE, testbed_config
from dualpath.bench.demo_report import (
    minus_reads,
    node_reads,
    render_table,
    summarize,
    warn_if_misleading,
)
from dualpath.bench.replay import run_turns
from dualpath.bench.report import (
    bar_chart,
    cpu_model,
    kv_bytes_per_token,
    machine_profile,
    write_json,
)
from dualpath.commands.args import add_device_argument, names, optional
from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.regime import ladder_regime
from dualpath.server.launch import LocalCluster
from dualpath.vocab import Mode
from dualpath.workloads.demo import DemoSession, load_demo_trace
from dualpath.workloads.turns import AgentTurn

if TYPE_CHECKING:
    from argparse import ArgumentParser

# The default workload (turns 21-25 of 8 sessions, h 98%) reloads 57 tokens per computed one,
# so where loading a token costs under a tenth of recomputing it (kappa) basic is still
# storage-bound (rho > 1: its prefill node's NIC would need more than the cap): the paper's
# regime (docs/results.md, "The regime"). Kappa depends on the CPU, so on a CPU the default cap
# is set where a probe of this machine's recompute speed (``recompute_probe.py``) puts kappa at
# PROBE_KAPPA. The probe computes alone while the run's recompute shares the cores, yet the two
# agreed within 10% on a 2-core EPYC (0.69 against 0.65-0.70 ms per token): 0.08 leaves the
# run's own kappa that margin below the regime's 0.1 (docs/results.md).
PROBE_KAPPA = 0.08
# Elsewhere (a GPU) the fixed default: 360 MB/s of float32 KV (7,800 tokens/s), scaled by the
# KV dtype's size.
READ_CAP_FLOAT32_MB_S = 360.0


@dataclass(frozen=True)
class DemoOptions:
    """What ``dualpath demo`` runs; the defaults are the measured demo (README, docs/results.md)."""

    model: str | None = None  # HF folder; None: the default model
    # Storage-NIC read cap of every node (MB/s). None: on a CPU where kappa is PROBE_KAPPA by
    # this machine's measured recompute speed; on a GPU READ_CAP_FLOAT32_MB_S scaled by the KV
    # dtype's size (180 MB/s of bf16 KV, the same 7,800 tokens/s as 360 of float32).
    read_cap_mb_s: float | None = None
    compute_cap_mb_s: float | None = None  # None: COMPUTE_PER_STORAGE x read_cap_mb_s
    # Set by ``probed_cap`` when it chose the read cap: the recompute it timed (s per token).
    probed_recompute_s_per_token: float | None = None
    sessions: int | None = None  # first N sessions of the excerpt (None: all)
    turns: int | None = None  # first N turns of each session (None: all)
    # basic first (the cluster is started for the first mode: basic keeps every layer resident,
    # the layered modes run in its cluster too); oracle (hits free) and recompute (no reuse)
    # bound the ladder from both sides
    modes: tuple[str, ...] = ("basic", "dualpath", "oracle", "recompute")
    # 16-token blocks: a turn loses its partial last block from the hit; at the excerpt's scale
    # (token counts / 96) a turn adds ~10 new tokens, so 64-token blocks would miss 3x more
    block_size: int = 16
    # auto: the checkpoint's bf16 where the device computes it natively (a CPU with
    # AVX512_BF16 or AMX, or CUDA), else float32 (``local_devices.bench_dtype``: bf16 without
    # them is 2-3x slower). The KV takes the same dtype (46 KB per token of SmolLM2 in float32,
    # 23 KB in bf16), and the default storage cap follows it.
    dtype: str = "auto"
    # The engines' device: auto is cuda where this host has a GPU (each engine on its own,
    # round robin: LocalCluster), else cpu; run_demo resolves it before starting the cluster.
    device: str = "auto"
    # A DE persists a turn's new full blocks through this many staging slots while it decodes
    # (past them, a finished turn's blocks take any free slot). Agent turns add many blocks and
    # generate few tokens: with 8 slots 11 of 34 blocks of a 2,224-token first turn with 5
    # generated tokens were dropped before that fallback existed.
    save_staging_blocks: int = 64
    host_pool_blocks: int = 1024  # per engine (fp32 blocks of 737 KB): 8 agents' contexts
    heartbeat_s: float = 0.5  # the cluster default (a slower beat only delays fault handling)
    seed: int = 0  # of the random token ids
    # A capped NIC's queue legitimately holds more than the default 5 s of reads here, and a
    # read given up at its deadline is recomputed, which would quietly turn basic into recompute.
    read_deadline_s: float = 600.0
    timeout_s: float = 900.0  # per mode
    json_path: str | None = "results/demo.json"  # a PNG of the JCTs is written beside it
    work_dir: str | None = None  # store and logs; default: a temporary folder, removed after
    trace_path: str | None = None  # a demo trace file instead of the shipped excerpt


def add_arguments(parser: ArgumentParser) -> None:
    """The ``dualpath demo`` options: fields of :class:`DemoOptions`."""
    parser.add_argument("--read-cap-mb-s", type=float, default=None,
                        help="storage NIC read cap per node (default on a CPU: where loading "
                        "a token costs 0.08 of recomputing it on this machine, timed before "
                        "the run; on a GPU 360 for float32 KV, 180 for bf16)")
    parser.add_argument("--compute-cap-mb-s", type=float, default=None,
                        help="compute NIC cap per engine (default 8x the storage cap)")
    parser.add_argument("--sessions", type=int, default=None, help="first N sessions only")
    parser.add_argument("--turns", type=int, default=None, help="first N turns of each")
    parser.add_argument("--modes", type=names, default=DemoOptions.modes,
                        help=f"comma-separated (default {','.join(DemoOptions.modes)})")
    parser.add_argument("--json", dest="json_path", type=optional, default="results/demo.json",
                        help="results (+ PNG beside; '' for none)")
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="compute and KV dtype (default auto: "
                        "bfloat16 where the CPU has AVX512_BF16 or AMX, or on CUDA; else float32)")
    parser.add_argument("--block-size", type=int, default=DemoOptions.block_size)
    add_device_argument(parser, "auto")
    parser.add_argument("--dir", dest="work_dir", default=None,
                        help="work folder, kept (default: temporary)")


def run(options: DemoOptions) -> int:
    """``dualpath demo``."""
    run_demo(options)
    return 0


def warmup_turns(vocab: int, block_size: int, seed: int) -> list[list[AgentTurn]]:
    """Two short agents of two turns (a miss, then a storage hit) that share nothing with the
    workload: an engine's first forwards, transfers and reads are slow once, in every mode."""
    g = torch.Generator().manual_seed(seed + 1_000_003)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    return [[AgentTurn(rand(2 * block_size + 5), 2), AgentTurn(rand(5), 2)] for _ in range(2)]


def agent_turns(sessions: list[DemoSession], vocab: int, seed: int) -> list[list[AgentTurn]]:
    """The agents' turns: random new tokens per turn (seeded), kept prefixes as recorded."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    return [[AgentTurn(rand(t.prompt - t.keep), t.gen, t.keep) for t in s.turns]
            for s in sessions]


def _config(options: DemoOptions, mode: str, store: Path) -> ClusterConfig:
    options = resolved(options, options.device)  # as run_demo has (idempotent)
    return testbed_config(
        store, mode, dtype=options.dtype, device=options.device, block_size=options.block_size,
        read_cap_mb_s=options.read_cap_mb_s, compute_cap_mb_s=options.compute_cap_mb_s,
        read_deadline_s=options.read_deadline_s,
        num_prefill=1, num_decode=2, host_pool_blocks=options.host_pool_blocks,
        save_staging_blocks=options.save_staging_blocks, heartbeat_s=options.heartbeat_s,
        engine_timeout_s=12 * options.heartbeat_s, router_timeout_s=12 * options.heartbeat_s)


def _run_mode(cluster: LocalCluster, mode: str, agents: list[list[AgentTurn]],
              warmup: list[list[AgentTurn]], options: DemoOptions, work: Path, bar: Progress,
              primed: list[list[int]] | None) -> tuple[dict[str, Any], list[list[int]]]:
    """One mode over an empty store: a warm-up and every session's first turn untimed, then
    the timed turns (the agent loop, where every turn reloads its context).

    The first turns run once, in the first mode; their stored blocks are copied aside and put
    back for later modes, with the contexts (``primed``) they left (greedy decoding makes them
    the same in every mode). Returns the row and those contexts.
    """
    store, first_turns = work / "kv", work / "first-turns"
    began = time.perf_counter()
    task = bar.add_task(f"{mode}: emptying the store", total=sum(len(a) - 1 for a in agents))
    _empty(cluster, store)
    bar.update(task, description=f"{mode}: warming up")
    run_turns(cluster, warmup, mode, timeout_s=120.0, label="demo warm-up")
    # An oracle's hits are the router's record of earlier oracle requests, not the store, and
    # it stores nothing: it runs the first turns itself, as does the first mode that stores
    # (greedy decoding: the same contexts in every mode)
    if mode == Mode.ORACLE or not first_turns.exists():
        bar.update(task, description=f"{mode}: first turns (untimed)")
        contexts = run_turns(cluster, [a[:1] for a in agents], mode,
                             timeout_s=options.timeout_s, label="demo first turns")["contexts"]
        if mode != Mode.ORACLE:
            _wait_for_writes(cluster)
            shutil.copytree(store, first_turns)
        primed = primed or contexts
    else:
        shutil.copytree(first_turns, store, dirs_exist_ok=True)
    before, cpu_before = node_reads(cluster.metrics()), cluster.engine_cpu_s()
    bar.update(task, description=f"{mode}: replaying turns 2+")
    row = run_turns(cluster, [a[1:] for a in agents], mode, lambda: bar.advance(task),
                    options.timeout_s, label="demo", contexts=primed)
    row["nodes"] = minus_reads(node_reads(cluster.metrics()), before)
    # the engines' CPU-seconds over the timed turns, by role: on a small host every mode
    # shares its cores, and moving KV costs CPU there (docs/results.md, "The regime")
    row["cpu_s"] = {role: s - cpu_before.get(role, 0.0)
                    for role, s in cluster.engine_cpu_s().items()}
    assert cluster.router is not None
    row["router"] = cluster.router.counters()
    row["untimed_s"] = time.perf_counter() - began - row["jct_s"]  # store, warm-up, first turns
    bar.update(task, description=f"{mode}: done")
    return row, primed


def _wait_for_writes(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    """Wait until no engine has a block write pending."""
    deadline = time.monotonic() + timeout_s
    while any(m.get("storage_write_queue_tokens", 0) for m in cluster.metrics().values()):
        if time.monotonic() > deadline:
            raise DualPathError(f"demo: block writes still pending after {timeout_s:.0f} s")
        time.sleep(0.2)


def _empty(cluster: LocalCluster, store: Path) -> None:
    """Delete every stored block, once no write is pending."""
    _wait_for_writes(cluster)
    for child in store.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def resolved(options: DemoOptions, device: str) -> DemoOptions:
    """``options`` on ``device`` (resolved), with the dtype of ``auto`` filled in, and on a
    GPU the default storage cap (``READ_CAP_FLOAT32_MB_S`` per 4 bytes of the KV dtype); on a
    CPU ``probed_cap`` fills it in once the model and workload are known."""
    from dualpath.local_devices import bench_dtype

    dtype = bench_dtype(options.dtype, device)
    cap = options.read_cap_mb_s
    if cap is None and device != "cpu":
        cap = READ_CAP_FLOAT32_MB_S * torch.empty(0, dtype=getattr(torch, dtype)).element_size() / 4
    return replace(options, device=device, dtype=dtype, read_cap_mb_s=cap)


def probed_cap(options: DemoOptions, model_dir: Path, sessions: list[DemoSession],
               console: Console) -> DemoOptions:
    """``options`` with the storage cap at which kappa is ``PROBE_KAPPA`` by this machine's
    recompute speed at the timed turns' mean prompt length (unchanged when a cap is given)."""
    if options.read_cap_mb_s is not None:
        return options
    from dualpath.bench.recompute_probe import probe_recompute_s_per_token
    from dualpath.regime import snic_bytes_s_for

    timed = [t.prompt for s in sessions for t in s.turns[1:]]
    mean_tokens = round(sum(timed) / len(timed))
    with console.status(f"timing a recompute of {mean_tokens} tokens on this CPU"):
        s_per_token = probe_recompute_s_per_token(model_dir, options.dtype, mean_tokens,
                                                  options.block_size)
    bytes_s = snic_bytes_s_for(PROBE_KAPPA, kv_bytes_per_token(model_dir, options.dtype),
                               s_per_token)
    console.print(f"recompute on this CPU: {s_per_token * 1e3:.2f} ms per token at "
                  f"{mean_tokens} tokens, so storage NICs at {bytes_s / 1e6:.0f} MB/s put "
                  f"kappa at {PROBE_KAPPA:g} (the run measures its own below)")
    return replace(options, read_cap_mb_s=round(bytes_s / 1e6, 1),
                   probed_recompute_s_per_token=s_per_token)


def run_demo(options: DemoOptions, console: Console | None = None) -> dict[str, Any]:
    """Replay the excerpt in every mode; print the table; write JSON (+ PNG); return it."""
    from dualpath.local_devices import resolve_local_device
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    console = console or Console()
    began = time.perf_counter()
    options = resolved(options, resolve_local_device(options.device))
    sessions, header = load_demo_trace(Path(options.trace_path) if options.trace_path else None)
    sessions = [DemoSession(s.trace, s.turns[:options.turns]) for s in sessions[:options.sessions]]
    if not sessions or min(len(s.turns) for s in sessions) < 2:
        raise ValueError("the demo needs at least one session of at least 2 turns (turn 1 is "
                         "untimed)")
    model_dir = resolve_model(options.model)
    options = probed_cap(options, model_dir, sessions, console)
    vocab = load_spec(model_dir).vocab_size
    agents = agent_turns(sessions, vocab, options.seed)
    warmup = warmup_turns(vocab, options.block_size, options.seed)
    turns = max(len(s.turns) for s in sessions)
    console.print(f"[bold]dualpath demo[/]: {len(sessions)} real agent sessions (Weka trace, "
                  f"token counts / {header.get('scale', 1)}), {turns} turns each, turns 2-"
                  f"{turns} timed, on {model_dir.name} ({options.dtype}, {options.device}); "
                  f"1 prefill + 2 decode engine processes; storage NICs capped at "
                  f"{options.read_cap_mb_s:g} MB/s per node; modes: {', '.join(options.modes)}. "
                  f"CPU: {cpu_model()}.")
    work = Path(options.work_dir or tempfile.mkdtemp(prefix="dualpath-demo-"))
    for stale in ("kv", "first-turns"):
        shutil.rmtree(work / stale, ignore_errors=True)
    (work / "kv").mkdir(parents=True)
    rows, primed = [], None
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
            start = bar.add_task("starting the cluster: router + 1 PE + 2 DE processes", total=1)
            with LocalCluster(model_dir, _config(options, options.modes[0], work / "kv"),
                              log_dir=work / "logs") as cluster:
                bar.update(start, completed=1)
                startup_s = time.perf_counter() - began
                for mode in options.modes:
                    row, primed = _run_mode(cluster, mode, agents, warmup, options, work, bar,
                                            primed)
                    rows.append(row)
    finally:
        for path in ([work] if options.work_dir is None else [work / "kv", work / "first-turns"]):
            shutil.rmtree(path, ignore_errors=True)
    result = _result(options, header, sessions, model_dir.name, rows,
                     kv_bytes_per_token(model_dir, options.dtype))
    result["wall_s"] = time.perf_counter() - began
    result["startup_s"] = startup_s
    console.print(render_table(result))
    warn_if_misleading(result, console)
    if options.json_path:
        path = write_json(options.json_path, result)
        bar_chart(path.with_suffix(".png"), "DualPath demo: job completion time",
                  [f"{len(sessions)} sessions x {turns} turns"],
                  {m: [s["jct_s"]] for m, s in result["modes"].items()}, "JCT (s)")
        console.print(f"wrote {path} and {path.with_suffix('.png')}")
    console.print(f"demo took {result['wall_s']:.0f} s")
    return result


def _result(options: DemoOptions, header: dict[str, Any], sessions: list[DemoSession],
            model: str, rows: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    cores = machine_profile()["cpus"] or 1
    modes = {r["mode"]: summarize(r, options.read_cap_mb_s, cores) for r in rows}
    jct = {m: s["jct_s"] for m, s in modes.items()}
    summary: dict[str, Any] = {"jct_s": jct,
                               "mean_ttft_s": {m: s["mean_ttft_s"] for m, s in modes.items()},
                               "hit_rate": {m: s["hit_rate"] for m, s in modes.items()},
                               "regime": ladder_regime(modes, kv_bytes_per_token,
                                                       options.read_cap_mb_s)}
    if Mode.BASIC in jct and Mode.DUALPATH in jct:
        summary["dualpath_speedup"] = jct[Mode.BASIC] / jct[Mode.DUALPATH]
    if Mode.BASIC in jct and Mode.RECOMPUTE in jct:
        summary["recompute_vs_basic"] = jct[Mode.RECOMPUTE] / jct[Mode.BASIC]
    for r in rows:
        r["records"] = [[asdict(t) for t in recs] for recs in r["records"]]
        del r["contexts"]
    return {"benchmark": "demo", "date": datetime.date.today().isoformat(),
            "machine": machine_profile(), "model": model,
            "cluster": {"prefill": 1, "decode": 2, "engine_threads": 1, "dtype": options.dtype,
                        "device": options.device,
                        "block_size": options.block_size,
                        "read_deadline_s": options.read_deadline_s,
                        "host_pool_blocks": options.host_pool_blocks,
                        "save_staging_blocks": options.save_staging_blocks,
                        "heartbeat_s": options.heartbeat_s},
            "caps_mb_s": {"read": options.read_cap_mb_s,
                          "compute": options.compute_cap_mb_s
                          or COMPUTE_PER_STORAGE * options.read_cap_mb_s,
                          # the read cap's source: None where given or a GPU's fixed default
                          "read_probe": None if options.probed_recompute_s_per_token is None
                          else {"recompute_s_per_token": options.probed_recompute_s_per_token,
                                "kappa": PROBE_KAPPA}},
            "workload": {**header, "sessions": len(sessions),
                         "turns": max(len(s.turns) for s in sessions),
                         "traces": [s.trace for s in sessions], "seed": options.seed},
            "modes": modes, "rows": rows, "summary": summary}
