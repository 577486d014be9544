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
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from dualpath.bench.cluster_report import cluster_table
from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


@dataclass(frozen=True)
class AgentTurn:
    """One turn of an agent: the first ``keep`` tokens of its context so far (the previous
    turn's prompt and generated tokens; None keeps all of it), then ``new`` tokens; generates
    exactly ``gen`` tokens. A ``keep`` shorter than the context replays a compaction."""

    new: list[int]
    gen: int
    keep: int | None = None


@dataclass(frozen=True)
class TurnRecord:
    """How one turn was served: sizes, the hit, the time from submit to its first token
    (TTFT: the prefill engine's token, streamed) and to its last."""

    prompt_tokens: int
    hit_tokens: int
    computed_tokens: int
    ttft_s: float
    latency_s: float
    read_path: str
    attempts: int = 1  # placements it took (> 1: an engine failed it or lost track of it)
    submitted_s: float = 0.0  # since the run started
    ttst_s: float | None = None  # submit to the second token (None: one token generated)
    tpot_s: float | None = None  # first to last token / (tokens - 1)
    timings: dict[str, float] = field(default_factory=dict)  # the router's TTFT breakdown


class _Agent:
    """One agent's trajectory: submits turn after turn, records when it finished.

    With ``cut_after_s``, ``done`` is set once the agent submits a turn more than that many
    seconds after ``began`` (every earlier turn has returned: turns go one at a time); it goes on
    submitting until :meth:`stop` aborts the turn in flight.
    """

    def __init__(self, cluster: LocalCluster, turns: list[AgentTurn], mode: str,
                 done: threading.Event, progress: Any, context: list[int] | None = None,
                 began: float = 0.0, cut_after_s: float | None = None) -> None:
        self.cluster, self.turns, self.mode = cluster, turns, mode
        self.done, self.progress, self.began = done, progress, began
        self.cut_after_s = cut_after_s
        self.context: list[int] = list(context or [])  # prompt + output of the last turn
        self.turn = 0
        self.records: list[TurnRecord] = []
        self.token_times: dict[int, list[float]] = {}  # turn -> arrival time of each token
        self.finished_at: float | None = None
        self.done_at: float | None = None  # when ``done`` was set
        self.error: BaseException | None = None
        self._lock = threading.RLock()  # a future done at submit calls back in this thread
        self._future: Any = None  # the turn in flight
        self._stopped = False

    def stop(self) -> None:
        """Submit nothing more and abort the turn in flight (its result is ignored)."""
        with self._lock:
            self._stopped, future = True, self._future
        if future is not None and not future.done():
            self.cluster.abort(future)

    def _set_done(self) -> None:
        self.done_at = time.perf_counter()
        self.done.set()

    def start(self) -> None:
        """Submit the first turn (a turn that cannot be built ends the agent with its error)."""
        try:
            with self._lock:
                self._submit()
        except Exception as exc:  # reported by run_turns
            self.error = exc
            self._set_done()

    def _submit(self) -> None:
        """Submit the next turn (``_lock`` held)."""
        if self._stopped:
            return
        turn = self.turns[self.turn]
        if turn.keep is not None and turn.keep > len(self.context):
            raise DualPathError(f"turn {self.turn} keeps {turn.keep} tokens of a "
                                f"{len(self.context)}-token context")
        kept = self.context if turn.keep is None else self.context[:turn.keep]
        self.prompt = kept + turn.new
        self.submitted = time.perf_counter()
        params = SamplingParams(max_tokens=turn.gen, ignore_eos=True)
        past_cut = (self.cut_after_s is not None
                    and self.submitted - self.began > self.cut_after_s)
        self._future = self.cluster.submit(
            self.prompt, params, mode=self.mode,
            on_tokens=lambda t, n=self.turn: self._streamed(n, t))
        if past_cut and not self.done.is_set():
            self._set_done()
        self._future.add_done_callback(self._returned)

    def _streamed(self, turn: int, tokens: tuple[int, ...]) -> None:
        """Note when turn ``turn``'s tokens arrived (tokens come in order, per turn)."""
        now = time.perf_counter()
        self.token_times.setdefault(turn, []).extend([now] * len(tokens))

    def _returned(self, future: Any) -> None:
        with self._lock:
            if not self._stopped:
                self._record(future)

    def _record(self, future: Any) -> None:
        """Record a returned turn and submit the next (``_lock`` held)."""
        try:
            out = future.result()
            now = time.perf_counter()
            times = self.token_times.pop(self.turn, None) or [now]
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            self.records.append(TurnRecord(
                len(self.prompt), out.num_hit_tokens, out.num_computed_tokens,
                times[0] - self.submitted, now - self.submitted, out.read_path,
                out.num_attempts, self.submitted - self.began,
                times[1] - self.submitted if len(times) > 1 else None, tpot, out.timings))
            self.progress()
            self.context = self.prompt + list(out.output_ids)
            self.turn += 1
            if self.turn == len(self.turns):
                self.finished_at = time.perf_counter()
                self._set_done()
                return
            self._submit()
        except Exception as exc:  # reported by run_turns
            self.error = exc
            self._set_done()


def make_trajectories(agents: int, turns: int, first: int, append: int, vocab: int,
                      seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """Random first prompts and appended tokens per agent (no shared prefixes)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    return [(rand(first), [rand(append) for _ in range(turns - 1)]) for _ in range(agents)]


def run_turns(cluster: LocalCluster, agents: list[list[AgentTurn]], mode: str,
              progress: Any = lambda: None, timeout_s: float = 3600.0,
              label: str = "bench cluster",
              contexts: list[list[int]] | None = None,
              start_offsets_s: list[float] | None = None,
              cut_after_s: float | None = None) -> dict[str, Any]:
    """Run every agent to its last turn, each turn as soon as its previous one returned;
    ``contexts`` are the agents' contexts before their first turn here (default: empty);
    agent i starts ``start_offsets_s[i]`` seconds after the run (default: all at once).
    With ``cut_after_s``, the run ends once every turn submitted up to that many seconds
    after its start has returned: agents keep submitting until then (the load does not
    change), and the turns then in flight are aborted, unrecorded.

    Returns the mode, the JCT (until the last agent's last turn, or the cut), the turn count,
    the prompt, hit and computed token totals, every agent's :class:`TurnRecord` list
    (``records``) and its context after its last recorded turn (``contexts``: prompt and
    generated tokens).
    """
    events = [threading.Event() for _ in agents]
    starts = contexts if contexts is not None else [[] for _ in agents]
    start = time.perf_counter()
    runs = [_Agent(cluster, turns, mode, ev, progress, context, start, cut_after_s)
            for turns, ev, context in zip(agents, events, starts, strict=True)]
    timers = [threading.Timer(offset, run.start)
              for run, offset in zip(runs, start_offsets_s or [0.0] * len(runs), strict=True)]
    for timer in timers:
        timer.daemon = True
        timer.start()
    for ev in events:
        if not ev.wait(max(0.0, timeout_s - (time.perf_counter() - start))):
            for timer in timers:
                timer.cancel()
            raise DualPathError(f"{label}: {mode} did not finish in {timeout_s:.0f} s")
    for run in runs:
        run.stop()
    errors = [a.error for a in runs if a.error is not None]
    if errors:
        raise DualPathError(f"{label}: {mode}: a request failed: {errors[0]}")
    ends = [a.done_at for a in runs if a.done_at is not None]
    records = [a.records for a in runs]
    flat = [r for recs in records for r in recs]
    return {"mode": mode, "agents": len(runs), "jct_s": max(ends) - start, "turns": len(flat),
            "prompt_tokens": sum(r.prompt_tokens for r in flat),
            "hit_tokens": sum(r.hit_tokens for r in flat),
            "computed_tokens": sum(r.computed_tokens for r in flat), "records": records,
            "contexts": [a.context for a in runs]}


def run_agents(cluster: LocalCluster, trajectories: list[tuple[list[int], list[list[int]]]],
               gen: int, mode: str, progress: Any = lambda: None,
               timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run every agent to its last turn, ``gen`` tokens a turn; JCT, turns and token totals."""
    agents = [[AgentTurn(first, gen), *(AgentTurn(a, gen) for a in appends)]
              for first, appends in trajectories]
    row = run_turns(cluster, agents, mode, progress, timeout_s)
    del row["records"], row["contexts"]
    return row


STORE_SEGMENT_MB = 2048  # a local mooncake_store's memory for the run
COMPUTE_PER_STORAGE = 8  # compute-NIC cap per engine / storage-NIC cap per node (DESIGN §6)


def testbed_config(store: Path, mode: str, *, dtype: str, block_size: int,
                   read_cap_mb_s: float, compute_cap_mb_s: float | None,
                   read_deadline_s: float, device: str = "cpu", **cluster: Any) -> ClusterConfig:
    """The capped testbed of the demo and ``bench agents``: one-thread engines on ``device``
    (each on its own GPU where there are several: ``LocalCluster``), a storage-NIC read cap per
    node and compute NICs at ``compute_cap_mb_s`` (default :data:`COMPUTE_PER_STORAGE` × the
    storage cap); ``cluster`` sets other ClusterConfig fields."""
    cnic = compute_cap_mb_s or COMPUTE_PER_STORAGE * read_cap_mb_s
    return ClusterConfig(
        engine=EngineConfig(dtype=dtype, threads=1, block_size=block_size, device=device),
        storage=StorageConfig(root=str(store), read_cap_mb_s=read_cap_mb_s,
                              read_deadline_s=read_deadline_s),
        traffic=TrafficConfig(compute_send_cap_mb_s=cnic, compute_recv_cap_mb_s=cnic),
        mode=mode, **cluster)


def _config(args: argparse.Namespace, store: Path, engine: EngineConfig,
            mode: str) -> ClusterConfig:
    return ClusterConfig(
        engine=engine, mode=mode,
        storage=StorageConfig(backend=args.storage_backend, root=str(store),
                              read_cap_mb_s=args.read_cap_mb_s,
                              mooncake_key_prefix=f"bench-{mode}"),
        traffic=TrafficConfig(compute_send_cap_mb_s=args.compute_cap_mb_s,
                              compute_recv_cap_mb_s=args.compute_cap_mb_s),
        num_prefill=args.prefill, num_decode=args.decode, profile_path=args.profile)


LINK_KINDS = ("local", "caps", "shaped")  # see --links


@contextlib.contextmanager
def _cluster(kind: str, model_dir: Path, config: ClusterConfig,
             log_dir: Path) -> Iterator[LocalCluster]:
    """``local``: engines are children here, software caps; ``caps``: each node a network
    namespace, software caps; ``shaped``: the same namespaces with tc-shaped links. A local
    ``mooncake_store`` gets a master and segment holder here for the run."""
    if kind != "local":
        from dualpath.bench.netns_cluster import NetnsCluster

        with NetnsCluster(model_dir, config, shaped=kind == "shaped", log_dir=log_dir) as c:
            yield c
        return
    with contextlib.ExitStack() as stack:
        if config.storage.backend == "mooncake_store":
            from dualpath.storage.mooncake_service import local_mooncake

            master = stack.enter_context(local_mooncake(STORE_SEGMENT_MB, log_dir=log_dir))
            config = replace(config, storage=replace(config.storage, mooncake_master=master))
        yield stack.enter_context(LocalCluster(model_dir, config, log_dir=log_dir))


def _link_kinds(raw: str) -> list[str]:
    kinds = [k.strip() for k in raw.split(",") if k.strip()]
    bad = [k for k in kinds if k not in LINK_KINDS]
    if bad or not kinds:
        raise DualPathError(f"--links takes {', '.join(LINK_KINDS)}; got {raw!r}")
    if any(k != "local" for k in kinds):
        from dualpath.bench.netns import netns_unavailable

        reason = netns_unavailable()
        if reason is not None:
            raise DualPathError(f"--links {raw}: {reason}")
    return kinds


def run_cluster_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode on a fresh cluster (per link kind); JSON + PNG with the JCTs and the
    dualpath/basic ratio of each link kind."""
    from dualpath.cli import engine_config
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    model_dir = resolve_model(args.model)
    vocab = load_spec(model_dir).vocab_size
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    kinds = _link_kinds(args.links)
    trajs = make_trajectories(args.agents, args.turns, args.first, args.append, vocab, args.seed)
    work = Path(args.dir or tempfile.mkdtemp(prefix="dualpath-bench-cluster-"))
    rows = []
    with Progress(transient=True) as bar:
        for kind in kinds:
            for mode in modes:
                task = bar.add_task(f"{mode} ({kind})", total=args.agents * args.turns)
                run = work / kind / mode
                store = run / "kv"
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir(parents=True)
                config = _config(args, store, engine_config(args), mode)
                with _cluster(kind, model_dir, config, run / "logs") as cluster:
                    row = run_agents(cluster, trajs, args.gen, mode,
                                     lambda t=task: bar.advance(t))
                    row["metrics"] = cluster.metrics()
                row["links"] = kind
                rows.append(row)
    summary = _summary(rows, kinds)
    result = {"benchmark": "cluster", "machine": machine_profile(),
              "workload": {"agents": args.agents, "turns": args.turns, "first": args.first,
                           "append": args.append, "gen": args.gen, "seed": args.seed},
              "caps_mb_s": {"read": args.read_cap_mb_s, "compute": args.compute_cap_mb_s},
              "storage_backend": args.storage_backend,
              "links": {k: link_note(k, args.storage_backend) for k in kinds}, "rows": rows,
              "summary": summary}
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        path = write_json(args.json, result)
        bar_chart(path.with_suffix(".png"), "Cluster: JCT per mode",
                  [f"{args.agents} agents x {args.turns} turns, {k} links" for k in kinds],
                  {m: [summary["jct_s_by_links"][k].get(m, 0.0) for k in kinds]
                   for m in modes}, "JCT (s)")
    Console().print(cluster_table(result))
    return result


def link_note(kind: str, backend: str) -> str:
    """How the NICs of a ``kind`` run are emulated (stated in the results)."""
    if kind == "local":
        return "engines on this host; the traffic manager's token buckets cap the NICs"
    if kind == "caps":
        return "each node a network namespace (veth links, unshaped); token buckets cap the NICs"
    storage = ("storage links to the store host shaped by tc tbf at the storage caps"
               if backend == "mooncake_store" else
               "storage NIC: token bucket (a shared-folder store's reads cross no link)")
    return ("each node a network namespace; compute links shaped by tc tbf at the compute cap "
            f"(no software compute cap); {storage}")


def _summary(rows: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """JCT per mode (of the first link kind, and per kind) and each kind's dualpath/basic."""
    by_kind = {k: {r["mode"]: r["jct_s"] for r in rows if r["links"] == k} for k in kinds}
    summary: dict[str, Any] = {"jct_s": by_kind[kinds[0]], "jct_s_by_links": by_kind}
    for kind, jct in by_kind.items():
        if "basic" in jct and "dualpath" in jct:
            ratio = jct["dualpath"] / jct["basic"]
            summary[f"dualpath_vs_basic_jct_ratio_{kind}"] = ratio
            if kind == kinds[0]:
                summary["dualpath_vs_basic_jct_ratio"] = ratio
    return summary
