"""``dualpath serve``: a PD cluster behind the OpenAI-compatible API, until SIGINT/SIGTERM.

Starts the router and has the configured launcher place the engines (``serve.launcher``: local
child processes, Ray actors, or none — engines that join by ``dualpath engine --router``),
waits until every engine said hello, writes the resolved configuration beside the engines'
logs, prints the endpoints and serves HTTP with uvicorn. On SIGINT or SIGTERM uvicorn stops
accepting requests, then every engine is told to shut down (and killed if it lingers): no
process is left behind. Engines whose server died without a word stop by themselves (they find
their router silent).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import replace
from pathlib import Path

from dualpath.config import StorageConfig
from dualpath.config_file import AppConfig, config_to_json
from dualpath.model.default_model import cache_dir, resolve_model
from dualpath.model.spec import load_spec
from dualpath.model.tokenizer import Tokenizer
from dualpath.server.api import ModelInfo, build_app
from dualpath.server.launch import ClusterBase, ExternalCluster, LocalCluster
from dualpath.server.metrics import ServeMetrics


def model_info(model_dir: Path, name: str | None, kv_tokens: int) -> ModelInfo:
    """The served model as the API sees it (its tokenizer is required)."""
    spec = load_spec(model_dir)
    tokenizer = Tokenizer(model_dir)
    return ModelInfo(name or model_dir.name, spec.vocab_size, min(spec.max_position, kv_tokens),
                     tokenizer.encode, tokenizer.decode, tokenizer.encode_chat)


def serve(config: AppConfig, log_dir: Path | None = None) -> None:
    """Run the cluster and the HTTP server until a signal stops them."""
    import uvicorn

    settings = config.serve
    if config.cluster.storage.root == StorageConfig().root:  # the default: under the cache
        storage = replace(config.cluster.storage, root=str(cache_dir() / "kv-store"))
        config = replace(config, cluster=replace(config.cluster, storage=storage))
    model_dir = resolve_model(settings.model)
    log_dir = log_dir or cache_dir() / "serve" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "config.json").write_text(config_to_json(config))
    with _launcher(model_dir, config, log_dir) as cluster:
        router = cluster.router
        assert router is not None
        info = model_info(model_dir, settings.model_name, router.state.capacity.kv_tokens)
        app = build_app(router, info, settings, ServeMetrics(router))
        server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                               log_level="warning", timeout_graceful_shutdown=5))
        base = f"http://{settings.host}:{settings.port}"
        print(f"dualpath serve: {config.cluster.num_prefill} prefill + "
              f"{config.cluster.num_decode} decode engines of {info.name} ready\n"
              f"  {base}/v1/chat/completions  {base}/v1/completions  {base}/v1/models\n"
              f"  {base}/health  {base}/metrics  {base}/docs\n"
              f"  logs and resolved config: {log_dir}", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises it once it has stopped
        with contextlib.suppress(KeyboardInterrupt):  # SIGINT or SIGTERM
            server.run()  # then leaving the block stops every engine
    print("dualpath serve: stopped", flush=True)


def _launcher(model_dir: Path, config: AppConfig, log_dir: Path) -> ClusterBase:
    """The cluster whose launcher ``serve.launcher`` names (Ray is imported only for it)."""
    launcher = config.serve.launcher
    if launcher == "ray":
        from dualpath.server.launch_ray import RayCluster

        return RayCluster(model_dir, config.cluster, log_dir=log_dir,
                          ray_address=config.serve.ray_address)
    if launcher == "none":
        return ExternalCluster(model_dir, config.cluster, log_dir=log_dir)
    return LocalCluster(model_dir, config.cluster, log_dir=log_dir)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
