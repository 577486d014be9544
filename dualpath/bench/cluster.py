"""``dualpath bench cluster``: multi-turn agents on a real local cluster, JCT per mode.

``agents`` agents each replay ``turns`` turns on a :class:`LocalCluster` (1 PE + 2 DE processes
by default, Mooncake transfers, KV in files): turn i's prompt is the previous prompt, the
tokens the previous turn generated and ``append`` new random tokens, and every turn generates
exactly ``gen`` tokens (the paper's replay rule, PAPER §7.4, zero tool latency). Agents run
independently: each submits its next turn as soon as its previous one returned. JCT is the
time until the last agent's last turn. The storage and compute NIC caps emulate the testbed's
NICs (storage reads must be the bottleneck for DualPath to matter, as in the paper).

Each mode runs on a fresh cluster with an empty store, in the order given. The summary holds
every mode's JCT and the ``dualpath`` / ``basic`` JCT ratio, which ``dualpath sim --preset
testbed`` predicts from a ``dualpath profile`` of the same engine and caps.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


class _Agent:
    """One agent's trajectory: submits turn after turn, records when it finished."""

    def __init__(self, cluster: LocalCluster, first: list[int], appends: list[list[int]],
                 params: SamplingParams, mode: str, done: threading.Event,
                 progress: Any) -> None:
        self.cluster, self.prompt, self.appends = cluster, first, appends
        self.params, self.mode, self.done, self.progress = params, mode, done, progress
        self.turn = 0
        self.hits: list[int] = []
        self.finished_at: float | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        """Submit the first turn."""
        self._submit()

    def _submit(self) -> None:
        future = self.cluster.submit(self.prompt, self.params, mode=self.mode)
        future.add_done_callback(self._returned)

    def _returned(self, future: Any) -> None:
        try:
            out = future.result()
        except Exception as exc:  # reported by run_agents
            self.error = exc
            self.done.set()
            return
        self.hits.append(out.num_hit_tokens)
        self.progress()
        if self.turn == len(self.appends):
            self.finished_at = time.perf_counter()
            self.done.set()
            return
        self.prompt = self.prompt + list(out.output_ids) + self.appends[self.turn]
        self.turn += 1
        self._submit()


def make_trajectories(agents: int, turns: int, first: int, append: int, vocab: int,
                      seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """Random first prompts and appended tokens per agent (no shared prefixes)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    return [(rand(first), [rand(append) for _ in range(turns - 1)]) for _ in range(agents)]


def run_agents(cluster: LocalCluster, trajectories: list[tuple[list[int], list[list[int]]]],
               gen: int, mode: str, progress: Any = lambda: None,
               timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run every agent to its last turn; JCT, turns and hit tokens."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    events = [threading.Event() for _ in trajectories]
    agents = [_Agent(cluster, first, appends, params, mode, ev, progress)
              for (first, appends), ev in zip(trajectories, events, strict=True)]
    start = time.perf_counter()
    for agent in agents:
        agent.start()
    for ev in events:
        if not ev.wait(max(0.0, timeout_s - (time.perf_counter() - start))):
            raise DualPathError(f"bench cluster: {mode} did not finish in {timeout_s:.0f} s")
    errors = [a.error for a in agents if a.error is not None]
    if errors:
        raise DualPathError(f"bench cluster: {mode}: a request failed: {errors[0]}")
    ends = [a.finished_at for a in agents if a.finished_at is not None]
    return {"mode": mode, "agents": len(agents), "jct_s": max(ends) - start,
            "turns": sum(len(a.hits) for a in agents),
            "hit_tokens": sum(sum(a.hits) for a in agents)}


def _config(args: argparse.Namespace, store: Path, engine: EngineConfig) -> ClusterConfig:
    return ClusterConfig(
        engine=engine,
        storage=StorageConfig(root=str(store), read_cap_mb_s=args.read_cap_mb_s),
        traffic=TrafficConfig(compute_send_cap_mb_s=args.compute_cap_mb_s,
                              compute_recv_cap_mb_s=args.compute_cap_mb_s),
        num_prefill=args.prefill, num_decode=args.decode, profile_path=args.profile)


def run_cluster_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode on a fresh cluster; JSON + PNG with the JCTs and the dualpath/basic ratio."""
    from dualpath.cli import engine_config
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    model_dir = resolve_model(args.model)
    vocab = load_spec(model_dir).vocab_size
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    trajs = make_trajectories(args.agents, args.turns, args.first, args.append, vocab, args.seed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="dualpath-bench-cluster-"))
    rows = []
    with Progress(transient=True) as bar:
        for mode in modes:
            task = bar.add_task(mode, total=args.agents * args.turns)
            store = work / mode / "kv"
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
            config = _config(args, store, engine_config(args))
            with LocalCluster(model_dir, config, log_dir=work / mode / "logs") as cluster:
                row = run_agents(cluster, trajs, args.gen, mode,
                                 lambda t=task: bar.advance(t))
                row["metrics"] = cluster.metrics()
            rows.append(row)
    jct = {r["mode"]: r["jct_s"] for r in rows}
    summary: dict[str, Any] = {"jct_s": jct}
    if "basic" in jct and "dualpath" in jct:
        summary["dualpath_vs_basic_jct_ratio"] = jct["dualpath"] / jct["basic"]
    result = {"benchmark": "cluster", "machine": machine_profile(),
              "workload": {"agents": args.agents, "turns": args.turns, "first": args.first,
                           "append": args.append, "gen": args.gen, "seed": args.seed},
              "caps_mb_s": {"read": args.read_cap_mb_s, "compute": args.compute_cap_mb_s},
              "rows": rows, "summary": summary}
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        path = write_json(args.json, result)
        bar_chart(path.with_suffix(".png"), "Local cluster: JCT per mode",
                  [f"{args.agents} agents x {args.turns} turns"],
                  {m: [t] for m, t in jct.items()}, "JCT (s)")
    Console().print_json(data=summary)
    return result
