"""``dualpath bench cluster``: multi-turn agents on a real local cluster, JCT per mode.

``agents`` agents each replay ``turns`` turns on a :class:`LocalCluster` (1 PE + 2 DE processes
by default, Mooncake transfers, KV in files): turn i's prompt is the previous prompt, the
tokens the previous turn generated and ``append`` new random tokens, and every turn generates
exactly ``gen`` tokens (the paper's replay rule, docs/paper.md §7.4, zero tool latency). Agents run
independently (:func:`dualpath.bench.replay.run_turns`): each submits its next turn as soon as
its previous one returned. JCT is the time until the last agent's last turn. The storage and
compute NIC caps emulate the testbed's NICs (storage reads must be the bottleneck for DualPath
to matter, as in the paper).

Each mode runs on a fresh cluster with an empty store, in the order given. The summary holds
every mode's JCT and the ``dualpath`` / ``basic`` JCT ratio, which ``dualpath sim --preset
testbed`` predicts from a ``dualpath profile`` of the same engine and caps.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import Progress

from dualpath.bench.cluster_report import cluster_table
from dualpath.bench.replay import run_turns
from dualpath.bench.report import bar_chart, machine_profile, write_json
from dualpath.commands.args import EngineOptions, add_engine_arguments
from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.errors import DualPathError
from dualpath.server.launch import LocalCluster
from dualpath.vocab import Mode
from dualpath.workloads.turns import AgentTurn

if TYPE_CHECKING:
    from argparse import ArgumentParser


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
    """Run every agent to its last turn, ``gen`` tokens a turn; JCT, turns and token totals."""
    agents = [[AgentTurn(first, gen), *(AgentTurn(a, gen) for a in appends)]
              for first, appends in trajectories]
    row = run_turns(cluster, agents, mode, progress, timeout_s)
    del row["records"], row["contexts"]
    return row


STORE_SEGMENT_MB = 2048  # a local mooncake_store's memory for the run
COMPUTE_PER_STORAGE = 8  # compute-NIC cap per engine / storage-NIC cap per node (docs/design.md §6)
# A layerwise prefill engine on a CPU keeps every layer resident (a window this wide holds any
# model). The window saves GPU memory; a CPU's KV budget is host memory it has plenty of, and
# a window of 2 only keeps each move to one layer (``kv/layer_groups.py``): bench agents gave
# dualpath 0.90x basic with it and 1.13x without it on a 2-core EPYC (docs/results.md).
CPU_LAYER_WINDOW = 1 << 16


def testbed_config(store: Path, mode: str, *, dtype: str, block_size: int,
                   read_cap_mb_s: float, compute_cap_mb_s: float | None,
                   read_deadline_s: float, device: str = "cpu", **cluster: Any) -> ClusterConfig:
    """The capped testbed of the demo and ``bench agents``: one-thread engines on ``device``
    (each on its own GPU where there are several: ``LocalCluster``), a storage-NIC read cap per
    node and compute NICs at ``compute_cap_mb_s`` (default :data:`COMPUTE_PER_STORAGE` × the
    storage cap); on a CPU every layer resident (:data:`CPU_LAYER_WINDOW`); ``cluster`` sets
    other ClusterConfig fields."""
    cnic = compute_cap_mb_s or COMPUTE_PER_STORAGE * read_cap_mb_s
    if device == "cpu":
        cluster.setdefault("prefill_layer_window", CPU_LAYER_WINDOW)
    return ClusterConfig(
        engine=EngineConfig(dtype=dtype, threads=1, block_size=block_size, device=device),
        storage=StorageConfig(root=str(store), read_cap_mb_s=read_cap_mb_s,
                              read_deadline_s=read_deadline_s),
        traffic=TrafficConfig(compute_send_cap_mb_s=cnic, compute_recv_cap_mb_s=cnic),
        mode=mode, **cluster)


def _config(options: ClusterBenchOptions, store: Path, engine: EngineConfig,
            mode: str) -> ClusterConfig:
    return ClusterConfig(
        engine=engine, mode=mode,
        storage=StorageConfig(backend=options.storage_backend, root=str(store),
                              read_cap_mb_s=options.read_cap_mb_s,
                              mooncake_key_prefix=f"bench-{mode}"),
        traffic=TrafficConfig(compute_send_cap_mb_s=options.compute_cap_mb_s,
                              compute_recv_cap_mb_s=options.compute_cap_mb_s),
        num_prefill=options.prefill, num_decode=options.decode, profile_path=options.profile)


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


@dataclass(frozen=True, kw_only=True)
class ClusterBenchOptions(EngineOptions):
    """The ``dualpath bench cluster`` command line."""

    json: str | None = None
    modes: str = "basic,dualpath"
    agents: int = 4
    turns: int = 8
    first: int = 256
    append: int = 256
    gen: int = 32
    seed: int = 0
    prefill: int = 1
    decode: int = 2
    read_cap_mb_s: float = 20.0
    compute_cap_mb_s: float = 200.0
    profile: str | None = None
    dir: str | None = None
    keep: bool = False
    storage_backend: str = "fs"
    links: str = "local"


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`ClusterBenchOptions`."""
    parser.add_argument("--json", default=None, help="where to write the results (+ PNG)")
    parser.add_argument("--modes", default="basic,dualpath")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first", type=int, default=256, help="tokens of the first prompt")
    parser.add_argument("--append", type=int, default=256, help="tokens appended per turn")
    parser.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill", type=int, default=1, help="prefill engines (one per node)")
    parser.add_argument("--decode", type=int, default=2, help="decode engines (one per node)")
    parser.add_argument("--read-cap-mb-s", type=float, default=20.0, help="storage NIC cap")
    parser.add_argument("--compute-cap-mb-s", type=float, default=200.0,
                        help="compute NIC cap")
    parser.add_argument("--profile", default=None,
                        help="dualpath profile JSON (α, β, cost model)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the store and logs")
    parser.add_argument("--storage-backend", default="fs", choices=("fs", "mooncake_store"),
                        help="the store: a folder (fs) or Mooncake Store (a master and segment "
                        "holder are started for the run; on their own host with --links)")
    parser.add_argument("--links", default="local",
                        help="comma-separated, each a full run: local (engines here, "
                        "token-bucket caps), caps (a network namespace per node, token-bucket "
                        "caps), shaped (the same, links shaped by tc instead: compute links, "
                        "and storage links with --storage-backend mooncake_store); root only "
                        "for caps and shaped")
    add_engine_arguments(parser)


def run(options: ClusterBenchOptions) -> int:
    """``dualpath bench cluster``."""
    run_cluster_bench(options)
    return 0


def run_cluster_bench(options: ClusterBenchOptions) -> dict[str, Any]:
    """Each mode on a fresh cluster (per link kind); JSON + PNG with the JCTs and the
    dualpath/basic ratio of each link kind."""
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    model_dir = resolve_model(options.model)
    vocab = load_spec(model_dir).vocab_size
    modes = [m.strip() for m in options.modes.split(",") if m.strip()]
    kinds = _link_kinds(options.links)
    trajs = make_trajectories(options.agents, options.turns, options.first, options.append,
                              vocab, options.seed)
    work = Path(options.dir or tempfile.mkdtemp(prefix="dualpath-bench-cluster-"))
    rows = []
    with Progress(transient=True) as bar:
        for kind in kinds:
            for mode in modes:
                task = bar.add_task(f"{mode} ({kind})", total=options.agents * options.turns)
                run = work / kind / mode
                store = run / "kv"
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir(parents=True)
                config = _config(options, store, options.engine_config(), mode)
                with _cluster(kind, model_dir, config, run / "logs") as cluster:
                    row = run_agents(cluster, trajs, options.gen, mode,
                                     lambda t=task: bar.advance(t))
                    row["metrics"] = cluster.metrics()
                row["links"] = kind
                rows.append(row)
    summary = _summary(rows, kinds)
    result = {"benchmark": "cluster", "machine": machine_profile(),
              "workload": {"agents": options.agents, "turns": options.turns, "first": options.first,
                           "append": options.append, "gen": options.gen, "seed": options.seed},
              "caps_mb_s": {"read": options.read_cap_mb_s, "compute": options.compute_cap_mb_s},
              "storage_backend": options.storage_backend,
              "links": {k: link_note(k, options.storage_backend) for k in kinds}, "rows": rows,
              "summary": summary}
    if not options.keep:
        shutil.rmtree(work, ignore_errors=True)
    if options.json:
        path = write_json(options.json, result)
        bar_chart(path.with_suffix(".png"), "Cluster: JCT per mode",
                  [f"{options.agents} agents x {options.turns} turns, {k} links" for k in kinds],
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
        if Mode.BASIC in jct and Mode.DUALPATH in jct:
            ratio = jct[Mode.DUALPATH] / jct[Mode.BASIC]
            summary[f"dualpath_vs_basic_jct_ratio_{kind}"] = ratio
            if kind == kinds[0]:
                summary["dualpath_vs_basic_jct_ratio"] = ratio
    return summary
