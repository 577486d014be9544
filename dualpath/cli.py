"""Command line: ``dualpath generate``, ``prepare-model``, ``store verify``, ``bench engine``,
``bench storage``."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from dualpath.config import EngineConfig
from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from dualpath.bench.demo import DemoOptions
    from dualpath.config_file import AppConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model folder (Llama/Qwen2/Mistral); default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size in tokens")
    _add_device_arg(p, "auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an EngineConfig field, e.g. --set kv_cache_mb=256")


DEVICE_HELP = ("the engines' device: cpu, cuda, cuda:N or auto (cuda where this host has a GPU, "
               "else cpu); a local cluster puts each engine on its own GPU, round robin")


def _add_device_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--device", default=default,
                   help=DEVICE_HELP + (f" (default {default})" if default else ""))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the common flags plus ``--set key=value`` overrides; a device of
    ``auto`` is resolved against this host's GPUs."""
    values: dict[str, object] = {"dtype": args.dtype, "threads": args.threads,
                                 "block_size": args.block_size, "device": args.device}
    types = {f.name: f.type for f in fields(EngineConfig)}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in types:
            raise DualPathError(f"--set {item!r}: expected KEY=VALUE with KEY in {sorted(types)}")
        values[key] = _parse_value(raw)
    if values["device"] != "cpu":
        from dualpath.server.launch import resolve_local_device

        values["device"] = resolve_local_device(str(values["device"]))
    return EngineConfig(**values)  # type: ignore[arg-type]


def _gigabytes(raw: str) -> float:
    """An argparse type: a size in GB, > 0."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a size in GB > 0, got {raw!r}")
    return value


def _parse_value(raw: str) -> object:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _cmd_generate(args: argparse.Namespace) -> int:
    from dualpath.engine.llm_engine import LLMEngine
    from dualpath.model.default_model import resolve_model
    from dualpath.request import SamplingParams

    engine = LLMEngine(resolve_model(args.model), engine_config(args))
    if engine.tokenizer is None:
        raise DualPathError("the model folder has no tokenizer.json")
    if args.raw:
        ids = engine.tokenizer.encode(args.prompt)
    else:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    print(engine.generate([ids], params)[0].text.strip())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from dualpath.bench.demo import run_demo

    run_demo(demo_options(args))
    return 0


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """The :class:`DemoOptions` of a parsed ``dualpath demo`` command line."""
    from dualpath.bench.demo import DemoOptions

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    return DemoOptions(model=args.model, read_cap_mb_s=args.read_cap_mb_s,
                       compute_cap_mb_s=args.compute_cap_mb_s, sessions=args.sessions,
                       turns=args.turns, modes=modes, block_size=args.block_size,
                       dtype=args.dtype, device=args.device, json_path=args.json or None,
                       work_dir=args.dir)


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    from dualpath.model.default_model import ensure_default_model

    print(ensure_default_model())
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from dualpath.bench.engine.compare import run_engine_bench

    run_engine_bench(args)
    return 0


def _cmd_bench_storage(args: argparse.Namespace) -> int:
    from dualpath.bench.storage import run_storage_bench

    run_storage_bench(args)
    return 0


def _cmd_bench_scheduler(args: argparse.Namespace) -> int:
    from dualpath.bench.scheduler import run_scheduler_bench

    run_scheduler_bench(args)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from dualpath.server.serve import serve

    serve(serve_config(args))
    return 0


def serve_config(args: argparse.Namespace) -> AppConfig:
    """The configuration of a parsed ``dualpath serve`` command line: the file's, then the
    flags, then each ``--set``."""
    from dualpath.config_file import load_config

    base: dict[str, object] = {}
    for key, value in (("serve.host", args.host), ("serve.port", args.port),
                       ("num_prefill", args.prefill), ("num_decode", args.decode),
                       ("serve.model", args.model), ("storage.root", args.storage),
                       ("storage.capacity_gb", args.store_capacity_gb),
                       ("serve.api_key", args.api_key), ("serve.launcher", args.launcher),
                       ("serve.ray_address", args.ray_address), ("engine.device", args.device),
                       ("router_host", args.router_host), ("router_port", args.router_port)):
        if value is not None:
            base[key] = value
    return load_config(args.config, args.set, base)


def _cmd_store_verify(args: argparse.Namespace) -> int:
    import json

    import torch

    from dualpath.config_file import load_config
    from dualpath.model.default_model import resolve_model
    from dualpath.storage.verify import verify_fs_root

    base = {k: v for k, v in (("storage.root", args.storage), ("serve.model", args.model))
            if v is not None}
    config = load_config(args.config, args.set, base)
    storage, engine = config.cluster.storage, config.cluster.engine
    if storage.backend != "fs":
        raise DualPathError(f"store verify lists the blocks of an fs store; {storage.backend} "
                            "cannot (from Python: storage.verify.verify_store(store, model, "
                            "keys=...))")
    torch.set_num_threads(args.threads)
    dtype = args.dtype or (engine.dtype if engine.dtype != "auto" else None)
    report = verify_fs_root(storage.root, resolve_model(config.serve.model),
                            sample=None if args.all else args.sample, seed=args.seed,
                            dtype=dtype, cpu_kernels=engine.cpu_kernels, device=args.device,
                            progress=True)
    text = json.dumps(report.to_dict(), indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if report.ok else 1


def _cmd_keys(args: argparse.Namespace) -> int:
    from dualpath.control_keys import ClusterKeys
    from dualpath.protocol import check_engine

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    for name in names:
        try:
            check_engine(name)
        except ValueError as exc:
            raise DualPathError(str(exc)) from exc
    if not names or len(set(names)) != len(names):
        raise DualPathError("--engines needs distinct engine names, e.g. pe0,de1,de2")
    folder = ClusterKeys.generate(names).write(args.dir)
    print(f"keys for the router and {len(names)} engines in {folder}: start the router with "
          f"`--set control_keys={folder}`; copy {folder}/engines/NAME.json to engine NAME's "
          "host only and start it with `dualpath engine --key FILE`")
    return 0


def _cmd_engine(args: argparse.Namespace) -> int:
    import logging

    from dualpath.config_file import override_cluster_config
    from dualpath.control_keys import engine_key_from
    from dualpath.engine.join import (
        Advertised,
        check_model,
        join_router,
        local_address_towards,
        localized,
        router_host,
    )
    from dualpath.engine.loop import EngineIdentity, EngineProcess
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import model_id

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    key = engine_key_from(args.key, args.name)
    name = args.name or key.name
    host = args.host or local_address_towards(router_host(args.router))
    model_dir = resolve_model(args.model)
    joined = join_router(args.router, name, args.role, args.node_id, args.join_timeout_s, key)
    check_model(joined, model_id(model_dir), str(model_dir))
    config = override_cluster_config(joined.config, args.set)
    advertised = Advertised(host, config.transfer_protocol, args.rdma_devices)
    config = localized(config, advertised)
    identity = EngineIdentity(name, args.role, args.node_id)
    return EngineProcess(identity, model_dir, config, args.router, key, advertised,
                         joined.cluster_id).serve()


def _cmd_bench_cluster(args: argparse.Namespace) -> int:
    from dualpath.bench.cluster import run_cluster_bench

    run_cluster_bench(args)
    return 0


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from dualpath.bench.transfer import run_transfer_bench

    run_transfer_bench(args)
    return 0


def _cmd_bench_layerwise(args: argparse.Namespace) -> int:
    from dualpath.bench.layerwise.mechanisms import print_summary, run_layerwise_bench

    print_summary(run_layerwise_bench(args))
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from dualpath.bench.profile import run_profile

    run_profile(args)
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from dualpath.sim.commands import run_sim
    from dualpath.workloads.sim_traces import ENV_DIR

    if args.trace_dir:  # where the weka and mooncake workloads are read from
        os.environ[ENV_DIR] = args.trace_dir
    run_sim(args)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from dualpath.sim.commands import run_plan

    run_plan(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dualpath`` command."""
    parser = argparse.ArgumentParser(prog="dualpath", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt with the single-engine runner")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    _add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="replay real agent sessions on a local cluster in basic "
                          "and dualpath mode; print JCT, TTFT, hit rate, reads and speed-up")
    demo.add_argument("--read-cap-mb-s", type=float, default=16.0,
                      help="storage NIC read cap per node (default 16: basic storage-bound)")
    demo.add_argument("--compute-cap-mb-s", type=float, default=None,
                      help="compute NIC cap per engine (default 8x the storage cap)")
    demo.add_argument("--sessions", type=int, default=None, help="first N sessions only")
    demo.add_argument("--turns", type=int, default=None, help="first N turns of each")
    demo.add_argument("--modes", default="basic,dualpath")
    demo.add_argument("--json", default="results/demo.json", help="results (+ PNG beside)")
    demo.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    demo.add_argument("--dtype", default="float32", help="compute and KV dtype (default "
                      "float32: faster than bf16 on CPUs without native bf16)")
    demo.add_argument("--block-size", type=int, default=64)
    _add_device_arg(demo, "auto")
    demo.add_argument("--dir", default=None, help="work folder, kept (default: temporary)")
    demo.set_defaults(func=_cmd_demo)

    prep = sub.add_parser("prepare-model", help="convert the default model once and print its path")
    prep.set_defaults(func=_cmd_prepare_model)

    srv = sub.add_parser("serve", help="run a local cluster behind an OpenAI-compatible API")
    srv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    srv.add_argument("--prefill", type=int, default=None, help="prefill engines (default 1)")
    srv.add_argument("--decode", type=int, default=None, help="decode engines (default 2)")
    srv.add_argument("--model", default=None, help="HF model folder (default: SmolLM2)")
    _add_device_arg(srv, None)  # None: the config's engine.device (cpu unless it says)
    srv.add_argument("--storage", default=None, help="KV store root (an fs directory)")
    srv.add_argument("--store-capacity-gb", type=_gigabytes, default=None, metavar="GB",
                     help="cap on the fs store's block files (default: half of the free disk "
                          "plus what the store holds; serve.store_capacity_fraction)")
    srv.add_argument("--config", default=None, help="TOML config file")
    srv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. storage.read_cap_mb_s=200 (repeatable)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--launcher", default=None, choices=("local", "ray", "none"),
                     help="who starts the engines: local child processes (default), Ray "
                          "actors, or none (engines join with `dualpath engine --router`)")
    srv.add_argument("--ray-address", default=None,
                     help="the Ray cluster for --launcher ray (default: a local one)")
    srv.add_argument("--router-host", default=None,
                     help="address the engine endpoint binds (default 127.0.0.1; 0.0.0.0 for "
                          "engines on other hosts)")
    srv.add_argument("--router-port", type=int, default=None,
                     help="engine endpoint port (default: any free one)")
    srv.set_defaults(func=_cmd_serve)

    eng_proc = sub.add_parser("engine", help="run one prefill or decode engine process")
    eng_proc.add_argument("--role", choices=("prefill", "decode"), required=True)
    eng_proc.add_argument("--node-id", type=int, required=True,
                          help="this host's node (engines of one node share its storage NIC)")
    eng_proc.add_argument("--name", default=None,
                          help="unique engine name (default: the one its key names)")
    eng_proc.add_argument("--key", default=None,
                          help="this engine's control-plane key file (`dualpath keys`, or "
                               "written by `serve --launcher none`; default: the key in "
                               "$DUALPATH_ENGINE_KEY, which local launchers set)")
    eng_proc.add_argument("--router", required=True,
                          help="the router's engine endpoint, tcp://HOST:PORT; the engine takes "
                               "the cluster's configuration from it")
    eng_proc.add_argument("--model", default=None,
                          help="this host's copy of the router's checkpoint (default: SmolLM2)")
    eng_proc.add_argument("--host", default=None,
                          help="address other engines reach this one at (default: this host's "
                               "address on the route to the router)")
    eng_proc.add_argument("--rdma-devices", default="",
                          help="RDMA devices for transfer_protocol=rdma, e.g. mlx5_0,mlx5_1")
    eng_proc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="host-local override of the router's config, e.g. "
                               "storage.root=/mnt/kv (repeatable)")
    eng_proc.add_argument("--join-timeout-s", type=float, default=120.0,
                          help="give up when the router has not answered by then")
    eng_proc.set_defaults(func=_cmd_engine)

    store = sub.add_parser("store", help="the KV store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    ver = store_sub.add_parser("verify", help="recompute sampled stored chains with the model "
                               "and compare their KV; exit status 1 on a mismatch")
    ver.add_argument("--storage", default=None,
                     help="KV store root, an fs directory (default: the config's storage.root)")
    ver.add_argument("--model", default=None,
                     help="HF model folder (default: the config's serve.model, else SmolLM2)")
    ver.add_argument("--config", default=None, help="the TOML config the cluster ran with")
    ver.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. engine.cpu_kernels=false (repeatable)")
    ver.add_argument("--sample", type=int, default=64,
                     help="blocks checked per KV layout, each with its whole chain (default 64)")
    ver.add_argument("--all", action="store_true", help="check every stored block")
    ver.add_argument("--seed", type=int, default=0, help="seed of the sample")
    ver.add_argument("--dtype", default=None,
                     help="compute dtype (default: the config's engine.dtype, else the KV's)")
    ver.add_argument("--device", default="cpu", help="where to recompute (default cpu)")
    ver.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ver.add_argument("--json", default=None, help="also write the report here")
    ver.set_defaults(func=_cmd_store_verify)

    keys = sub.add_parser("keys", help="make control-plane keys for a router and its engines "
                          "(engines on other hosts: `serve --set control_keys=DIR`, "
                          "`engine --key DIR/engines/NAME.json`)")
    keys.add_argument("dir", help="where to write router.json and engines/NAME.json")
    keys.add_argument("--engines", required=True,
                      help="comma-separated engine names, e.g. pe0,de1,de2")
    keys.set_defaults(func=_cmd_keys)

    prof = sub.add_parser("profile", help="measure prefill cost and storage read rate (α, β)")
    prof.add_argument("--json", required=True, help="where to write the profile")
    prof.add_argument("--storage-root", default=".cache/kv-store", help="the store to time")
    prof.add_argument("--read-blocks", type=int, default=64)
    prof.add_argument("--read-cap-mb-s", type=float, default=None,
                      help="the storage NIC cap the cluster will run with")
    prof.add_argument("--compute-cap-mb-s", type=float, default=None,
                      help="the compute NIC cap the cluster will run with (for the simulator)")
    _add_engine_args(prof)
    prof.set_defaults(func=_cmd_profile)

    simp = sub.add_parser("sim", help="cluster simulator: reproduce the paper's experiments")
    simp.add_argument("--preset", required=True,
                      choices=("paper-fig7", "paper-ablation", "paper-scale", "paper-online",
                               "testbed"))
    simp.add_argument("--json", default=None,
                      help="write the full result as JSON here, a PNG figure beside it "
                      "(the terminal gets tables of the main numbers)")
    simp.add_argument("--agents", default=None, help="comma-separated agent counts (fig7, "
                      "ablation)")
    simp.add_argument("--aps", default=None, help="comma-separated agents/s (online)")
    simp.add_argument("--workload", default=None,
                      help="32k, 48k, 64k (PAPER Table 2), tiny (testbed scale) or a real "
                      "trace: weka, mooncake (default: 64k; tiny for the testbed preset)")
    simp.add_argument("--trace-dir", default=None,
                      help="the traces folder for --workload weka/mooncake (default: "
                      "$DUALPATH_TRACES_DIR)")
    simp.add_argument("--testbed", default=None,
                      help="profile JSON from dualpath profile (the testbed preset)")
    simp.add_argument("--real", default=None, help="testbed: a dualpath bench cluster JSON "
                      "to compare the predicted dualpath/basic JCT ratio with")
    simp.add_argument("--baseline-batcher", default=None, choices=("stock", "quota"),
                      help="paper presets: how basic, layerwise and round_robin batch — the "
                      "stock chunked prefill (default, the paper's definition) or DualPath's "
                      "compute quota")
    simp.add_argument("--read-queue", default=None, choices=("fifo", "shared"),
                      help="paper presets: a node's storage reads one request at a time in FIFO "
                      "order (default) or all queued reads sharing the NIC")
    simp.add_argument("--token-budget", type=int, default=None,
                      help="paper presets: new tokens per PE forward of the stock batcher "
                      "(default 8192)")
    simp.add_argument("--storage-eff", type=float, default=None,
                      help="paper presets: storage goodput as a fraction of the storage NIC's "
                      "line rate (default 0.8, 3FS's published peak)")
    simp.add_argument("--basic-prefetch", action="store_true",
                      help="paper presets: basic reads KV into PE HBM ahead of its forward as "
                      "far as HBM allows, instead of reading each forward's KV before it")
    simp.add_argument("--lengths", default=None, choices=("same", "varied"),
                      help="paper presets: every agent replays one trajectory (default) or "
                      "trajectories of varied length with Table 2's means")
    simp.set_defaults(func=_cmd_sim)

    planp = sub.add_parser("plan", help="bottleneck-free P/D range (eq. 9) and simulated JCT")
    planp.add_argument("--model", default="ds660b", help="ds660b, ds27b, qwen32b")
    planp.add_argument("--hardware", default="hopper", help="hopper, h200, b200")
    planp.add_argument("--workload", default=None, help="32k, 48k, 64k: also simulate")
    planp.add_argument("--agents", type=int, default=64, help="agents when simulating")
    planp.add_argument("--max-nodes", type=int, default=6, help="largest P + D to consider")
    planp.add_argument("--beyond", action="store_true",
                       help="also simulate P/D ratios outside the eq. 9 range")
    for nic, what in (("dram", "DRAM per node"), ("snic", "storage NIC per node"),
                      ("cnic", "compute NIC per GPU")):
        planp.add_argument(f"--{nic}-gbps", type=float, default=None,
                           help=f"what-if: {what} in GB/s instead of the hardware's")
    planp.add_argument("--json", default=None,
                       help="write the full plan as JSON here, a PNG figure beside it "
                       "(the terminal gets a table of the candidates)")
    planp.set_defaults(func=_cmd_plan)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    eng = bench_sub.add_parser("engine", help="prefill/decode tokens/s against transformers "
                               "and vLLM, each in its own process (JSON + PNG)")
    eng.add_argument("--json", required=True, help="where to write the results")
    eng.add_argument("--prompt-tokens", type=int, default=1024)
    eng.add_argument("--decode-batches", default="1,8,32")
    eng.add_argument("--decode-tokens", type=int, default=128, help="generated tokens per row")
    eng.add_argument("--decode-prompt-tokens", type=int, default=128)
    eng.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    eng.add_argument("--against", default="transformers",
                     help="comma-separated peers, each in its own process: transformers, vllm "
                          "(vllm runs in the peers' environment: make peers)")
    eng.add_argument("--pin-core", type=int, default=None, metavar="K",
                     help="confine every system's whole process tree to core K (vLLM's "
                          "scheduler process included) for a like-for-like run")
    eng.add_argument("--peers-python", default=None,
                     help="the peers' python (default $DUALPATH_PEERS_PYTHON or "
                          ".venv-peers/bin/python)")
    _add_engine_args(eng)
    eng.set_defaults(func=_cmd_bench_engine)

    sto = bench_sub.add_parser("storage", help="store read/write (fs, mooncake_store) vs raw "
                                               "O_DIRECT reads")
    sto.add_argument("--json", required=True, help="where to write the results")
    sto.add_argument("--backends", default="fs",
                     help="comma-separated: fs, mooncake_store (starts its own master and "
                          "segment holder); the same blocks on each, reads side by side")
    sto.add_argument("--model", default=None, help="model whose full-block size to use")
    sto.add_argument("--dir", default=None, help="store folder (default: cache/bench-storage)")
    sto.add_argument("--blocks", type=int, default=256)
    sto.add_argument("--rounds", type=int, default=4)
    sto.add_argument("--chunk-blocks", type=int, default=32, help="blocks per interleaved chunk")
    sto.add_argument("--workers", type=int, default=4)
    sto.add_argument("--keep", action="store_true", help="keep the files afterwards")
    sto.set_defaults(func=_cmd_bench_storage)

    tra = bench_sub.add_parser("transfer", help="Mooncake: layer blocks vs one large transfer")
    tra.add_argument("--json", required=True, help="where to write the results")
    tra.add_argument("--model", default=None, help="model whose layer-block size to use")
    tra.add_argument("--blocks", type=int, default=32, help="full blocks (x layers = segments)")
    tra.add_argument("--repeats", type=int, default=10, help="timed rounds")
    tra.set_defaults(func=_cmd_bench_transfer)

    clu = bench_sub.add_parser("cluster", help="multi-turn agents on a local cluster: JCT "
                               "per mode (the simulator's testbed cross-check)")
    clu.add_argument("--json", default=None, help="where to write the results (+ PNG)")
    clu.add_argument("--modes", default="basic,dualpath")
    clu.add_argument("--agents", type=int, default=4)
    clu.add_argument("--turns", type=int, default=8)
    clu.add_argument("--first", type=int, default=256, help="tokens of the first prompt")
    clu.add_argument("--append", type=int, default=256, help="tokens appended per turn")
    clu.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    clu.add_argument("--seed", type=int, default=0)
    clu.add_argument("--prefill", type=int, default=1, help="prefill engines (one per node)")
    clu.add_argument("--decode", type=int, default=2, help="decode engines (one per node)")
    clu.add_argument("--read-cap-mb-s", type=float, default=20.0, help="storage NIC cap")
    clu.add_argument("--compute-cap-mb-s", type=float, default=200.0, help="compute NIC cap")
    clu.add_argument("--profile", default=None, help="dualpath profile JSON (α, β, cost model)")
    clu.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    clu.add_argument("--keep", action="store_true", help="keep the store and logs")
    clu.add_argument("--storage-backend", default="fs", choices=("fs", "mooncake_store"),
                     help="the store: a folder (fs) or Mooncake Store (a master and segment "
                          "holder are started for the run; on their own host with --links)")
    clu.add_argument("--links", default="local",
                     help="comma-separated, each a full run: local (engines here, token-bucket "
                          "caps), caps (a network namespace per node, token-bucket caps), "
                          "shaped (the same, links shaped by tc instead: compute links, and "
                          "storage links with --storage-backend mooncake_store); root only "
                          "for caps and shaped")
    _add_engine_args(clu)
    clu.set_defaults(func=_cmd_bench_cluster)

    agents = bench_sub.add_parser("agents", help="agentic workloads (Table 2 presets, Weka, "
                                  "Mooncake) through the cluster or its OpenAI API: every mode, "
                                  "offline JCT, online APS, TTFT breakdown, NICs (JSON + PNG)")
    from dualpath.bench.agents.command import add_arguments as _agents_args

    _agents_args(agents)

    lay = bench_sub.add_parser("layerwise", help="the paper's mechanisms: layerwise memory, "
                               "QoS lanes under EP traffic, split reads (JSON + PNG)")
    from dualpath.bench.layerwise.mechanisms import add_arguments as _layerwise_args

    _layerwise_args(lay)
    lay.set_defaults(func=_cmd_bench_layerwise)

    sch = bench_sub.add_parser("scheduler", help="global scheduler decisions/s at 48P96D scale")
    sch.add_argument("--json", required=True, help="where to write the results")
    sch.add_argument("--prefill-nodes", type=int, default=48)
    sch.add_argument("--decode-nodes", type=int, default=96)
    sch.add_argument("--engines-per-node", type=int, default=8)
    sch.add_argument("--requests", type=int, default=20_000)
    sch.add_argument("--policies", default="dualpath,round_robin",
                     help="comma-separated; the first one's rate is summary.decisions_per_s")
    sch.add_argument("--split-read", action="store_true", help="split reads across both sides")
    sch.add_argument("--seed", type=int, default=0)
    sch.add_argument("--no-png", dest="png", action="store_false", help="skip the bar chart")
    sch.set_defaults(func=_cmd_bench_scheduler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input ends with a one-line error and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DualPathError, ValueError) as exc:
        print(f"dualpath: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
