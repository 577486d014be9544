"""``dualpath bench layerwise``: the paper's mechanisms, measured on a real local cluster.

(a) **Layerwise memory**: the largest prefill (hit tokens) a prefill engine with a fixed
    device-KV budget completes, ``basic`` (every layer resident) vs ``layerwise`` (a window of
    ``prefill_layer_window`` layers) — ``layerwise_batch.py``.
(b) **Traffic isolation**: decode TPOT and prefill forward time with the expert-parallel
    traffic generator on, with and without heavy concurrent KV traffic, 99:1 lanes vs one FIFO
    lane — ``layerwise_lanes.py``.
(c) **Split reads**: the JCT of a storage-bound multi-turn run (``dualpath`` mode) with one
    request's hit read partly on each side vs one side per request, and the bytes each node's
    storage NIC read.

One invocation writes one JSON (``summary`` on top, the resolved configs, the machine) and one
PNG beside it. NIC caps and the EP generator are testbed emulation, stated in the result.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from dualpath.bench.cluster import make_trajectories, run_agents
from dualpath.bench.layerwise.batch import BatchOptions, largest_prefill
from dualpath.bench.layerwise.lanes import LanesOptions, lanes_experiment
from dualpath.bench.layerwise.plot import plot_layerwise
from dualpath.bench.report import machine_profile, write_json
from dualpath.commands.args import positive_int
from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.server.launch import LocalCluster

if TYPE_CHECKING:
    from argparse import ArgumentParser

if TYPE_CHECKING:
    pass

PARTS = ("a", "b", "c")


@dataclass(frozen=True)
class LayerwiseOptions:
    """The ``dualpath bench layerwise`` command line (see :func:`add_arguments`)."""

    model: str | None = None
    json: str = "results/layerwise.json"
    parts: str = "a,b,c"
    dtype: str = "float32"
    block_size: int = 64
    prefill_kv_blocks: int = 8
    hit_blocks: str = "2,4,7,15,31,63,118"
    compute_cap_mb_s: float = 20.0
    ep_bytes_per_token: int = 48 << 10
    chunk_kb: int = 64
    kv_chunk_kb: int = 256
    burst_chunks: int = 0
    kv_hit_tokens: int = 1024
    kv_in_flight: int = 4
    prefill: int = 1
    decode_tokens: int = 256
    settle_s: float = 1.0
    rounds: int = 2
    read_cap_mb_s: float = 30.0
    agents: int = 4
    turns: int = 4
    first: int = 1024
    append: int = 64
    gen: int = 8
    dir: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`LayerwiseOptions`."""
    parser.add_argument("--model", default=None, help="HF folder (default: the default model)")
    parser.add_argument("--json", default="results/layerwise.json",
                        help="where to write the results (PNG beside)")
    parser.add_argument("--parts", default="a,b,c", help="which parts: a,b,c")
    parser.add_argument("--dtype", default="float32", help="compute and KV dtype")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--prefill-kv-blocks", type=int, default=8,
                        help="(a) the PE's device-KV budget, in full blocks of every layer")
    parser.add_argument("--hit-blocks", default="2,4,7,15,31,63,118",
                        help="(a) the ladder of hit blocks")
    parser.add_argument("--compute-cap-mb-s", type=float, default=20.0,
                        help="(b) every engine's compute-NIC cap, each way")
    parser.add_argument("--ep-bytes-per-token", type=int, default=48 << 10,
                        help="(b) EP traffic generator bytes per token (see engine/ep_traffic)")
    parser.add_argument("--chunk-kb", type=int, default=64,
                        help="(b) the high lane's chunk: the arbitration unit")
    parser.add_argument("--kv-chunk-kb", type=int, default=256,
                        help="(b) the KV lanes' chunk (a KV chunk waiting out its pacing "
                        "yields to a high-lane one; larger costs the high lane no wait, and "
                        "less CPU per byte)")
    parser.add_argument("--burst-chunks", type=int, default=0,
                        help="(b) chunks a capped NIC may run ahead of its rate (0: not even "
                        "an idle NIC sends the EP exchange faster than its line rate, as a "
                        "busy one cannot)")
    parser.add_argument("--kv-hit-tokens", type=int, default=1024, help="(b) hit per KV request")
    parser.add_argument("--kv-in-flight", type=int, default=4,
                        help="(b) DE-path KV requests kept in flight in the loaded phase")
    parser.add_argument("--prefill", type=int, default=1,
                        help="(b) prefill engines (one: each extra one is a busy process on "
                        "a small machine)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="(b) tokens per decode")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="(b) seconds of KV traffic before the TPOT window opens")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="(b) quiet/loaded pairs per lane setting (their mean is reported)")
    parser.add_argument("--read-cap-mb-s", type=float, default=30.0,
                        help="(c) storage-NIC read cap of every node")
    parser.add_argument("--agents", type=int, default=4, help="(c) agents")
    parser.add_argument("--turns", type=int, default=4, help="(c) turns per agent")
    parser.add_argument("--first", type=int, default=1024, help="(c) first prompt tokens")
    parser.add_argument("--append", type=int, default=64, help="(c) tokens appended per turn")
    parser.add_argument("--gen", type=int, default=8, help="(c) tokens generated per turn")
    parser.add_argument("--dir", default=None, help="work folder (stores, logs)")


def run(options: LayerwiseOptions) -> int:
    """``dualpath bench layerwise``: run, write, print the summary."""
    print_summary(run_layerwise_bench(options))
    return 0


def run_layerwise_bench(options: LayerwiseOptions) -> dict[str, Any]:
    """Run the chosen parts; write the JSON and PNG; returns the result."""
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    model_dir = resolve_model(options.model)
    vocab = load_spec(model_dir).vocab_size
    parts = [p.strip() for p in options.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(PARTS)}")
    work = Path(options.dir or tempfile.mkdtemp(prefix="dualpath-bench-layerwise-"))
    engine = EngineConfig(dtype=options.dtype, block_size=options.block_size, threads=1)
    result: dict[str, Any] = {"benchmark": "layerwise", "machine": machine_profile(),
                              "parts": {}, "configs": {}}
    with Progress(transient=True) as bar:
        def step(label: str, total: int) -> Any:
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        if "a" in parts:
            config = _batch_config(options, engine, _fresh(work / "a" / "kv"))
            ladder = tuple(int(k) for k in options.hit_blocks.split(","))
            rows = largest_prefill(model_dir, config, vocab, BatchOptions(hit_blocks=ladder),
                                   work / "a" / "logs", step("(a) largest prefill",
                                                            2 * len(ladder)))
            result["parts"]["a"], result["configs"]["a"] = rows, asdict(config)
        if "b" in parts:
            config = _lanes_config(options, engine, _fresh(work / "b" / "kv"))
            lanes = LanesOptions(kv_hit_tokens=options.kv_hit_tokens,
                                 decode_tokens=options.decode_tokens,
                                 kv_in_flight=options.kv_in_flight, settle_s=options.settle_s,
                                 rounds=options.rounds)
            rows = lanes_experiment(model_dir, config, vocab, lanes, work / "b" / "logs",
                                    step("(b) lanes vs FIFO", 4 * lanes.rounds))
            result["parts"]["b"], result["configs"]["b"] = rows, asdict(config)
        if "c" in parts:
            result["parts"]["c"], result["configs"]["c"] = _split_reads(
                options, engine, model_dir, vocab, work / "c", step)
    result["summary"] = _summary(result["parts"], options)
    out = write_json(options.json, result)
    plot_layerwise(out.with_suffix(".png"), result)
    return result


def _fresh(store: Path) -> Path:
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    return store


def _batch_config(options: LayerwiseOptions, engine: EngineConfig, store: Path) -> ClusterConfig:
    from dualpath.kv.layout import KVLayout
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    spec = load_spec(resolve_model(options.model))
    layout = KVLayout.from_spec(spec, options.dtype, options.block_size)
    budget_mb = -(-options.prefill_kv_blocks * layout.full_block_bytes // 2**20)
    return ClusterConfig(engine=engine, storage=StorageConfig(root=str(store)),
                         prefill_kv_cache_mb=budget_mb, num_prefill=1, num_decode=1)


def _lanes_config(options: LayerwiseOptions, engine: EngineConfig, store: Path) -> ClusterConfig:
    cap = options.compute_cap_mb_s
    traffic = TrafficConfig(compute_send_cap_mb_s=cap, compute_recv_cap_mb_s=cap,
                            chunk_bytes=options.chunk_kb << 10, burst_chunks=options.burst_chunks,
                            kv_chunk_bytes=options.kv_chunk_kb << 10,
                            ep_bytes_per_token=options.ep_bytes_per_token)
    return ClusterConfig(engine=engine, storage=StorageConfig(root=str(store)),
                         traffic=traffic, num_prefill=options.prefill, num_decode=2,
                         mode="dualpath")


def _split_reads(options: LayerwiseOptions, engine: EngineConfig, model_dir: Path, vocab: int,
                 work: Path, step: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same storage-bound multi-turn run with split reads off, then on."""
    trajs = make_trajectories(options.agents, options.turns, options.first, options.append,
                              vocab, seed=7)
    # docs/design.md §6: compute NIC = 8 x an engine's storage share
    cnic = 8 * options.read_cap_mb_s
    rows: dict[str, Any] = {}
    config = None
    for name, split in (("split_off", False), ("split_on", True)):
        config = ClusterConfig(
            engine=engine, mode="dualpath", split_read=split,
            storage=StorageConfig(root=str(_fresh(work / name / "kv")),
                                  read_cap_mb_s=options.read_cap_mb_s),
            traffic=TrafficConfig(compute_send_cap_mb_s=cnic, compute_recv_cap_mb_s=cnic))
        with LocalCluster(model_dir, config, log_dir=work / name / "logs") as cluster:
            row = run_agents(cluster, trajs, options.gen, "dualpath",
                             step(f"(c) {name}", options.agents * options.turns))
            metrics = cluster.metrics()
            paths = [d[3] for d in cluster.router.decisions]
        row["read_bytes_per_node"] = {
            str(m["node_id"]): m.get("storage_snic_read_bytes", 0) for m in metrics.values()}
        row["read_paths"] = {p: paths.count(p) for p in sorted(set(paths))}
        rows[name] = row
    return rows, asdict(replace(config, split_read=True)) if config else {}


def _summary(parts: dict[str, Any], options: LayerwiseOptions) -> dict[str, Any]:
    summary: dict[str, Any] = {"parts": sorted(parts)}
    if "a" in parts:
        a = parts["a"]
        basic, lw = a["basic"]["max_hit_tokens"], a["layerwise"]["max_hit_tokens"]
        summary["max_prefill_hit_tokens"] = {"basic": basic, "layerwise": lw}
        summary["max_prefill_tokens_ratio_layerwise_vs_basic"] = lw / basic if basic else None
        summary["prefill_kv_budget_full_blocks"] = options.prefill_kv_blocks
        summary["same_tokens_checked_hit_blocks"] = a["same_tokens_checked"]
    if "b" in parts:
        b = parts["b"]
        summary["tpot_inflation_lanes"] = b["lanes"]["tpot_inflation"]
        summary["tpot_inflation_fifo"] = b["fifo"]["tpot_inflation"]
        summary["tpot_s"] = {f"{name}_{phase}": b[name][phase]["tpot_s"]
                             for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        summary["pe_forward_s"] = {f"{name}_{phase}": b[name][phase]["pe_forward_s"]
                                   for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        # what the NIC adds to a decode step (its EP exchange waits), apart from compute: on a
        # 2-core testbed the KV traffic's own CPU work also slows every step, lanes or not
        summary["de_ep_wait_ms"] = {
            f"{name}_{phase}": 1000 * (b[name][phase]["de_ep_wait_s"] or 0.0)
            for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        summary["de_step_ms"] = {f"{name}_{phase}": 1000 * b[name][phase]["de_step_s"]
                                 for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        # how long a DE's loop was runnable but waited for a CPU (schedstat), per second
        summary["de_loop_runqueue_wait_frac"] = {
            f"{name}_{phase}": b[name][phase]["de_loop_runqueue_wait_frac"]
            for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        summary["pe_kv_recv_mb_s"] = {f"{name}_loaded": b[name]["loaded"]["pe_kv_recv_mb_s"]
                                      for name in ("lanes", "fifo")}
        summary["ttst_s"] = {f"{name}_{phase}": b[name][phase]["ttst_s"]
                             for name in ("lanes", "fifo") for phase in ("quiet", "loaded")}
        for name in ("lanes", "fifo"):
            quiet = b[name]["quiet"]
            added = (b[name]["loaded"]["de_ep_wait_s"] or 0.0) - (quiet["de_ep_wait_s"] or 0.0)
            summary[f"tpot_inflation_{name}_nic_only"] = (quiet["tpot_s"] + added) / quiet["tpot_s"]
        summary["testbed"] = {"compute_cap_mb_s": options.compute_cap_mb_s,
                              "ep_bytes_per_token": options.ep_bytes_per_token,
                              "chunk_bytes": options.chunk_kb << 10,
                              "kv_chunk_bytes": options.kv_chunk_kb << 10,
                              "burst_chunks": options.burst_chunks}
    if "c" in parts:
        c = parts["c"]
        summary["split_read_jct_ratio"] = c["split_on"]["jct_s"] / c["split_off"]["jct_s"]
        summary["jct_s"] = {k: c[k]["jct_s"] for k in ("split_off", "split_on")}
        summary["read_bytes_per_node"] = {k: c[k]["read_bytes_per_node"]
                                          for k in ("split_off", "split_on")}
        summary["storage_read_cap_mb_s"] = options.read_cap_mb_s
    return summary


def print_summary(result: dict[str, Any]) -> None:
    """The summary, for the terminal."""
    Console().print(result["summary"])
