"""Setting up the vLLM connector (``dualpath.integrations.vllm.connector``): its
``kv_transfer_config``, the store it opens, and the key space of an instance (model
fingerprint, vLLM's KV layout id and block size), plus the per-request block list its
metadata carries.

The rules (one stored block is one vLLM block; the ``vllm-LBHNC-...`` layout id never equals our
engines' ``kv-...`` ids) are in the connector's docstring and docs/vllm-connector.md.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm

from dualpath.config import StorageConfig, TrafficConfig
from dualpath.integrations.vllm.engines.launch import transfer_config  # noqa: F401 (re-exported)
from dualpath.kv.hashing import KeySpace
from dualpath.kv.layout import KVLayout, key_space_for
from dualpath.model.spec import model_id
from dualpath.traffic.manager import TrafficManager
from dualpath.vocab import EngineKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's logger tree, so the engine's handlers print our lines (tests read them).
log = logging.getLogger("vllm.dualpath")

VLLM_PIN = "0.32."  # the connector API is experimental: what this was written and tested on
_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
LAYER_INDEX = re.compile(r"\.(\d+)\.")

if not vllm.__version__.startswith(VLLM_PIN):
    log.warning("dualpath connector: written for vLLM %sx, running on %s", VLLM_PIN,
                vllm.__version__)


def vllm_layout(vllm_config: VllmConfig) -> KVLayout:
    """The sizes of this instance's KV blocks (vLLM's block size, model shape, KV dtype)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    name = _TORCH_DTYPES.get(dtype, str(dtype))
    return KVLayout(model.get_num_layers(vllm_config.parallel_config),
                    model.get_num_kv_heads(vllm_config.parallel_config), model.get_head_size(),
                    name, cache.block_size)


def storage_config(extra: dict[str, Any]) -> StorageConfig:
    """``StorageConfig`` from ``kv_connector_extra_config`` (``store`` names the backend)."""
    known = {f.name for f in fields(StorageConfig)}
    values = {k: v for k, v in extra.items() if k in known}
    values["backend"] = extra.get("store", values.get("backend", "fs"))
    if "root" not in values and values["backend"] == "fs":
        raise ValueError("kv_connector_extra_config needs a store root: {'root': ...}")
    return StorageConfig(**values)


def key_space(vllm_config: VllmConfig, extra: dict[str, Any]) -> KeySpace:
    """Our key space for this instance: model fingerprint, vLLM layout id, vLLM block size."""
    folder = Path(vllm_config.model_config.model)
    if "model_id" in extra:
        mid = str(extra["model_id"])
    elif folder.is_dir():
        mid = model_id(folder)
    else:
        raise ValueError(f"model {folder} is not a local folder: set model_id in "
                         "kv_connector_extra_config")
    layout = vllm_layout(vllm_config)
    return key_space_for(mid, layout, EngineKind.VLLM)


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: vLLM block ids and their chain's keys,
    as plain values (the metadata crosses from the scheduler's process to the workers')."""

    req_id: str
    salt: str
    block_ids: list[int]
    hashes: list[bytes]
    parents: list[bytes | None]
    token_ids: list[list[int]]

    def keys(self, space: KeySpace) -> list:
        """The ``BlockKey`` of each block."""
        space = space.salted(self.salt)
        return [space.key(h, p, tuple(t))
                for h, p, t in zip(self.hashes, self.parents, self.token_ids, strict=True)]


def prefill_traffic(extra: dict[str, Any]) -> TrafficManager:
    """A prefill worker's traffic manager over its own Mooncake transfer engine, advertised
    at ``extra["host"]`` (its listeners guarded, left open with ``extra["open_listeners"]``:
    ``transfer/guard.py``), with ``extra["traffic"]``'s caps and lane weights. Its grant
    server binds loopback: no peer learns its address, so none asks it for grants."""
    from dualpath.transfer.mooncake import MooncakeBackend

    values = dict(extra.get("traffic") or {})
    if "lane_weights" in values:
        values["lane_weights"] = tuple(tuple(w) for w in values["lane_weights"])
    host = str(extra.get("host", "127.0.0.1"))
    backend = MooncakeBackend(host, "tcp", open_listeners=bool(extra.get("open_listeners")))
    return TrafficManager(backend, TrafficConfig(**values))
