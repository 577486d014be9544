"""``dualpath bench scheduler``: decisions per second of the global scheduler at paper scale.

A 48P96D-sized cluster (48 prefill and 96 decode nodes × 8 engines, one group per node) and an
offline batch of agentic requests (16K–64K tokens, 95–99% hit) go through the scheduler the way
the router drives it: every round the cluster reports a fresh view, ``schedule`` places what it
can, and a crude simulation advances time (PEs prefill FIFO at a fixed token rate, read queues
drain at the storage-NIC rate, a DE frees a request's KV a fixed time after its prefill). Only
the ``schedule`` calls are timed; building the views (the router's work) is timed apart.

Besides speed the run reports how evenly storage reads spread over nodes, per policy: max/avg
over nodes of the tokens each read in a 5 s window, averaged over windows (the paper's load-
balance metric, docs/paper.md §7.9: 1.53 with round robin, 1.18 with DualPath).
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.scheduler import (
    Assignment,
    ClusterView,
    EngineView,
    GlobalScheduler,
    NodeView,
    PendingRequest,
    SchedulerParams,
)
from dualpath.vocab import Role

if TYPE_CHECKING:
    from argparse import ArgumentParser

BLOCK = 64


@dataclass
class SimSetup:
    """Cluster size, workload and the rates the crude simulation runs at."""

    prefill_nodes: int = 48
    decode_nodes: int = 96
    engines_per_node: int = 8
    requests: int = 20_000
    min_tokens: int = 16_384
    max_tokens: int = 65_536
    prefill_tokens_per_s: float = 40_000.0  # prompt tokens (hits included) one PE gets through
    read_tokens_per_s: float = 150_000.0  # tokens one node's storage NIC reads
    de_kv_tokens: int = 1_000_000  # free KV of an idle DE
    decode_s: float = 30.0  # how long a request stays on its DE after its prefill
    round_s: float = 0.25  # simulated time between two schedule calls
    window_s: float = 5.0  # storage-read balance is measured over windows this long
    seed: int = 0


@dataclass
class SimEngine:
    """One engine's counters as the router tracks them."""

    role: str
    node_id: int
    group: str
    seq: int = 0
    tok: int = 0
    free: int = 0
    work: deque[list[int]] = field(default_factory=deque)  # PE: [req_id, tokens left]


class SimCluster:
    """The mutable cluster the benchmark simulates (what the router would track)."""

    def __init__(self, setup: SimSetup) -> None:
        self.setup = setup
        self.engines: dict[str, SimEngine] = {}
        for node in range(setup.prefill_nodes + setup.decode_nodes):
            role = Role.PREFILL if node < setup.prefill_nodes else Role.DECODE
            for rank in range(setup.engines_per_node):
                free = setup.de_kv_tokens if role == Role.DECODE else 0
                self.engines[f"{role[0]}{node:03d}.{rank}"] = SimEngine(role, node, f"g{node:03d}",
                                                                       free=free)
        self.read_q = dict.fromkeys(range(setup.prefill_nodes + setup.decode_nodes), 0)
        self.tokens: dict[int, int] = {}
        self.decode_of: dict[int, str] = {}
        self.releases: list[tuple[float, int]] = []
        self.now = 0.0

    def view(self) -> ClusterView:
        """The snapshot the engines would report now."""
        engines = tuple(EngineView(name, e.role, e.node_id, e.group, e.seq, e.tok, e.free)
                        for name, e in self.engines.items())
        return ClusterView(engines, tuple(NodeView(n, q) for n, q in self.read_q.items()))

    def apply(self, a: Assignment, num_tokens: int) -> None:
        """Account a decision the way the router does."""
        pe, de = self.engines[a.prefill], self.engines[a.decode]
        for e in (pe, de):
            e.seq += 1
            e.tok += num_tokens
        de.free -= num_tokens
        pe.work.append([a.req_id, num_tokens])
        self.read_q[pe.node_id] += a.pe_read_tokens
        self.read_q[de.node_id] += a.de_read_tokens
        self.tokens[a.req_id] = num_tokens
        self.decode_of[a.req_id] = a.decode

    def advance(self) -> list[int]:
        """One round of simulated progress; tokens each node read this round."""
        s = self.setup
        self.now += s.round_s
        budget = int(s.prefill_tokens_per_s * s.round_s)
        for e in self.engines.values():
            if e.role == Role.PREFILL:
                self._prefill(e, budget)
        while self.releases and self.releases[0][0] <= self.now:
            _, req_id = heapq.heappop(self.releases)
            de = self.engines[self.decode_of.pop(req_id)]
            n = self.tokens.pop(req_id)
            de.seq, de.tok, de.free = de.seq - 1, de.tok - n, de.free + n
        read = []
        for node, queue in self.read_q.items():
            done = min(queue, int(s.read_tokens_per_s * s.round_s))
            self.read_q[node] = queue - done
            read.append(done)
        return read

    def _prefill(self, pe: SimEngine, budget: int) -> None:
        while budget and pe.work:
            item = pe.work[0]
            step = min(budget, item[1])
            item[1] -= step
            pe.tok -= step
            budget -= step
            if not item[1]:
                pe.work.popleft()
                pe.seq -= 1
                heapq.heappush(self.releases, (self.now + self.setup.decode_s, item[0]))


class _ReadWindow:
    """Max/avg over nodes of the tokens each read per window, averaged over busy windows."""

    def __init__(self, setup: SimSetup) -> None:
        self.rounds = max(1, round(setup.window_s / setup.round_s))
        self.totals: list[int] = []
        self.count = 0
        self.ratios: list[float] = []

    def add(self, read: list[int]) -> None:
        """Tokens each node read in one round."""
        self.totals = ([a + b for a, b in zip(self.totals, read, strict=True)] if self.totals
                       else list(read))
        self.count += 1
        if self.count == self.rounds:
            if sum(self.totals):
                self.ratios.append(max(self.totals) * len(self.totals) / sum(self.totals))
            self.totals, self.count = [], 0

    def mean_max_over_avg(self) -> float:
        """The mean ratio over the windows in which anything was read."""
        return sum(self.ratios) / len(self.ratios) if self.ratios else 0.0


def make_requests(setup: SimSetup) -> list[PendingRequest]:
    """The offline batch: uniform lengths (whole blocks), 95–99% of each prompt a hit."""
    rng = random.Random(setup.seed)
    out = []
    for req_id in range(setup.requests):
        n = rng.randrange(setup.min_tokens // BLOCK, setup.max_tokens // BLOCK + 1) * BLOCK
        hit = min(int(n * rng.uniform(0.95, 0.99)) // BLOCK * BLOCK, n - 1)
        out.append(PendingRequest(req_id, n, hit))
    return out


def run_policy(setup: SimSetup, params: SchedulerParams, progress: Progress) -> dict[str, Any]:
    """Drive one scheduler through the whole batch; timings and balance figures."""
    cluster = SimCluster(setup)
    scheduler = GlobalScheduler(params)
    requests = make_requests(setup)
    for req in requests:
        scheduler.submit(req)
    task = progress.add_task(params.policy, total=len(requests))
    decide_s = view_s = 0.0
    decisions = calls = 0
    slowest = 0.0
    window = _ReadWindow(setup)
    while len(scheduler):
        t0 = time.perf_counter()
        view = cluster.view()
        t1 = time.perf_counter()
        out = scheduler.schedule(view)
        t2 = time.perf_counter()
        view_s, decide_s = view_s + t1 - t0, decide_s + t2 - t1
        slowest = max(slowest, t2 - t1)
        calls += 1
        decisions += len(out)
        for a in out:
            cluster.apply(a, requests[a.req_id].num_tokens)
        window.add(cluster.advance())
        progress.update(task, advance=len(out))
    return {"policy": params.policy, "decisions": decisions, "calls": calls,
            "decide_s": decide_s, "view_build_s": view_s,
            "decisions_per_s": decisions / decide_s if decide_s else 0.0,
            "mean_call_ms": 1e3 * decide_s / calls, "max_call_ms": 1e3 * slowest,
            "simulated_s": cluster.now,
            "read_max_over_avg": window.mean_max_over_avg()}


@dataclass(frozen=True)
class SchedulerBenchOptions:
    """The ``dualpath bench scheduler`` command line."""

    json: str
    prefill_nodes: int = 48
    decode_nodes: int = 96
    engines_per_node: int = 8
    requests: int = 20_000
    policies: str = "dualpath,round_robin"
    split_read: bool = False
    seed: int = 0
    png: bool = True


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`SchedulerBenchOptions`."""
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--prefill-nodes", type=int, default=48)
    parser.add_argument("--decode-nodes", type=int, default=96)
    parser.add_argument("--engines-per-node", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--policies", default="dualpath,round_robin",
                        help="comma-separated; the first one's rate is summary.decisions_per_s")
    parser.add_argument("--split-read", action="store_true",
                        help="split reads across both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-png", dest="png", action="store_false", help="skip the bar chart")


def run(options: SchedulerBenchOptions) -> int:
    """``dualpath bench scheduler``."""
    run_scheduler_bench(options)
    return 0


def run_scheduler_bench(options: SchedulerBenchOptions) -> dict[str, Any]:
    """Run every requested policy; print a table, write JSON (and a PNG beside it)."""
    setup = SimSetup(prefill_nodes=options.prefill_nodes, decode_nodes=options.decode_nodes,
                     engines_per_node=options.engines_per_node, requests=options.requests,
                     seed=options.seed)
    policies = [p.strip() for p in options.policies.split(",") if p.strip()]
    runs = []
    with Progress() as progress:
        for policy in policies:
            params = SchedulerParams.from_rates(setup.read_tokens_per_s,
                                                setup.prefill_tokens_per_s, policy=policy,
                                                split_read=options.split_read)
            runs.append({**run_policy(setup, params, progress), "params": params.to_dict()})
    result = _result(setup, runs)
    _report(result, Path(options.json), options.png)
    return result


def _result(setup: SimSetup, runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    summary: dict[str, Any] = {"decisions_per_s": first["decisions_per_s"],
                               "policy": first["policy"],
                               "engines": (setup.prefill_nodes + setup.decode_nodes)
                               * setup.engines_per_node}
    for run in runs:
        summary[f"{run['policy']}_decisions_per_s"] = run["decisions_per_s"]
        summary[f"{run['policy']}_read_max_over_avg"] = run["read_max_over_avg"]
    return {"benchmark": "scheduler", "setup": vars(setup), "machine": machine_profile(),
            "runs": runs, "summary": summary}


def _report(result: dict[str, Any], out: Path, png: bool) -> None:
    s = result["setup"]
    table = Table(title=f"global scheduler, {s['prefill_nodes']}P{s['decode_nodes']}D × "
                        f"{s['engines_per_node']} engines, {s['requests']} requests")
    for col in ("policy", "dec/s", "calls", "ms/call", "max ms", "read max/avg", "views s"):
        table.add_column(col, no_wrap=True)
    for r in result["runs"]:
        table.add_row(r["policy"], f"{r['decisions_per_s']:,.0f}", str(r["calls"]),
                      f"{r['mean_call_ms']:.2f}", f"{r['max_call_ms']:.2f}",
                      f"{r['read_max_over_avg']:.2f}", f"{r['view_build_s']:.2f}")
    Console().print(table)
    write_json(out, result)
    if png:
        runs = result["runs"]
        bar_chart(out.with_suffix(".png"), "global scheduler decisions per second",
                  [r["policy"] for r in runs],
                  {"decisions/s": [r["decisions_per_s"] for r in runs]}, "decisions/s")
