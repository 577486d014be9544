"""What the router is built from: the cluster's control keys, its bound engine socket, the KV
one engine holds, and the global scheduler's α and β.
"""

from __future__ import annotations

import json
from pathlib import Path

import zmq

from dualpath.config import ClusterConfig, engine_config_for, engine_roles
from dualpath.control_keys import ClusterKeys
from dualpath.control_socket import router_socket
from dualpath.errors import DualPathError
from dualpath.kv.layout import KVLayout
from dualpath.scheduler.global_scheduler import SchedulerParams
from dualpath.vocab import Role


def cluster_keys(config: ClusterConfig) -> ClusterKeys:
    """The control keys of ``config.control_keys``, else new ones for the engines it names."""
    if config.control_keys:
        return ClusterKeys.load(config.control_keys)
    return ClusterKeys.generate(name for name, _, _ in engine_roles(config))


def bind(host: str, port: int, keys: ClusterKeys,
         context: zmq.Context) -> tuple[zmq.Socket, str]:
    """The engine endpoint, bound; and the address a local engine connects to."""
    try:
        socket, port = router_socket(host, port, keys, context)
    except zmq.ZMQError as exc:
        raise DualPathError(f"the router cannot bind tcp://{host}:{port or '*'}: {exc}") from exc
    local = "127.0.0.1" if host in ("0.0.0.0", "*") else host
    return socket, f"tcp://{local}:{port}"


def kv_tokens(config: ClusterConfig, layout: KVLayout, role: Role) -> int:
    """Tokens of KV one engine of ``role`` holds (a layerwise PE: with its layer window)."""
    engine = engine_config_for(config, role)
    return layout.cache_blocks(engine.num_kv_blocks, engine.kv_cache_mb,
                               engine.layer_window) * layout.block_size


def scheduler_params(config: ClusterConfig, full_block_bytes: int) -> SchedulerParams:
    """α and β: as configured, else from the profile, else α from the storage read cap.

    Without any of these α and β are unbounded: every node counts as short-queued and no PE as
    overloaded, so PE choice is least-tokens and the path the shorter queue.
    """
    unbounded = 1 << 40
    alpha, beta = config.alpha_tokens, config.beta_tokens
    if config.profile_path:
        profiled = json.loads(Path(config.profile_path).read_text())["summary"]
        alpha = alpha if alpha is not None else int(profiled["alpha_tokens"])
        beta = beta if beta is not None else int(profiled["beta_tokens"])
    if alpha is None and config.storage.read_cap_mb_s:
        tokens_per_s = config.storage.read_cap_mb_s * 1e6 / full_block_bytes
        alpha = int(3.0 * tokens_per_s * config.engine.block_size)
    return SchedulerParams(alpha_tokens=unbounded if alpha is None else alpha,
                           beta_tokens=unbounded if beta is None else beta, policy=config.policy,
                           block_size=config.engine.block_size, split_read=config.split_read)
