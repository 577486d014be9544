"""``dualpath engine``: one prefill or decode engine process that joins a router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from argparse import ArgumentParser


@dataclass(frozen=True)
class EngineProcessOptions:
    """The ``dualpath engine`` command line."""

    role: str
    node_id: int
    router: str
    name: str | None = None
    key: str | None = None
    model: str | None = None
    host: str | None = None
    rdma_devices: str = ""
    sets: tuple[str, ...] = ()
    join_timeout_s: float = 120.0
    vllm_url: str | None = None


def add_arguments(parser: ArgumentParser) -> None:
    """The options of :class:`EngineProcessOptions`."""
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--node-id", type=int, required=True,
                        help="this host's node (engines of one node share its storage NIC)")
    parser.add_argument("--name", default=None,
                        help="unique engine name (default: the one its key names)")
    parser.add_argument("--key", default=None,
                        help="this engine's control-plane key file (`dualpath keys`, or "
                        "written by `serve --launcher none`; default: the key in "
                        "$DUALPATH_ENGINE_KEY, which local launchers set)")
    parser.add_argument("--router", required=True,
                        help="the router's engine endpoint, tcp://HOST:PORT; the engine takes "
                        "the cluster's configuration from it")
    parser.add_argument("--model", default=None,
                        help="this host's copy of the router's checkpoint (default: SmolLM2)")
    parser.add_argument("--host", default=None,
                        help="address other engines reach this one at (default: this host's "
                        "address on the route to the router)")
    parser.add_argument("--rdma-devices", default="",
                        help="RDMA devices for transfer_protocol=rdma, e.g. mlx5_0,mlx5_1")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="host-local override of the router's config, e.g. "
                        "storage.root=/mnt/kv (repeatable)")
    parser.add_argument("--join-timeout-s", type=float, default=120.0,
                        help="give up when the router has not answered by then")
    parser.add_argument("--vllm-url", default=None,
                        help="with engine_kind=vllm: drive the vLLM instance at this URL "
                        "(http://HOST:PORT, started by you with dualpath's KV connector) "
                        "instead of starting one")


def run(options: EngineProcessOptions) -> int:
    """Join the router, then serve until it ends the engine."""
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
    from dualpath.engine.loop import EngineIdentity, EngineProcess, apply_process_settings
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import model_id

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    key = engine_key_from(options.key, options.name)
    name = options.name or key.name
    host = options.host or local_address_towards(router_host(options.router))
    model_dir = resolve_model(options.model)
    joined = join_router(options.router, name, options.role, options.node_id,
                         options.join_timeout_s, key)
    check_model(joined, model_id(model_dir), str(model_dir))
    config = override_cluster_config(joined.config, list(options.sets))
    advertised = Advertised(host, config.transfer_protocol, options.rdma_devices)
    config = localized(config, advertised)
    identity = EngineIdentity(name, options.role, options.node_id)
    apply_process_settings(config.engine)  # torch threads, GIL interval: before any model
    parts = _parts_factory(config.engine_kind)(model_dir, config, identity.role, name,
                                               host=advertised.host, url=options.vllm_url)
    return EngineProcess(identity, parts, options.router, key, advertised,
                         joined.cluster_id).serve()


def _parts_factory(kind: str) -> Any:
    """What builds the parts of an engine of ``kind`` (``engine/parts.py``): ours, or a vLLM
    instance's (the engine process imports no integration itself)."""
    from dualpath.vocab import EngineKind

    if EngineKind(kind) != EngineKind.VLLM:
        from dualpath.engine.parts import native_engine_parts

        return native_engine_parts
    from dualpath.integrations.vllm.engines.instance import vllm_engine_parts

    return vllm_engine_parts
