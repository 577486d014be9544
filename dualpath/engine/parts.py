"""An engine process's parts by engine kind: the one seam between the loop and a model.

``EngineProcess`` (``engine/loop.py``) builds what every engine has alike once: its storage
client, its transfer backend and traffic manager, its sockets. The parts bring the rest: the KV
layout and the host pool the data plane registers, the role's worker, and what they own besides
(a model, or a model server started for it). ``commands/engine.py`` picks the parts by
``engine_kind``: ``NativeEngineParts`` here for ours, ``VllmEngineParts``
(``integrations/vllm/engines/instance.py``) for an engine that drives a vLLM instance. The loop
imports no integration.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from dualpath.config import ClusterConfig, EngineConfig, engine_config_for
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.device_setup import prepare_engine_device
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillWorker
from dualpath.engine.worker import Worker
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.scheduler.batch import AttentionCostModel
from dualpath.storage.client import StorageClient
from dualpath.traffic.ep import EpTraffic
from dualpath.traffic.manager import TrafficManager
from dualpath.vocab import Role


class Instance(Protocol):
    """A model server an engine drives instead of a model of its own (a vLLM instance)."""

    url: str
    log_path: Path

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited."""
        ...

    def alive(self) -> bool:
        """Whether it is still running."""
        ...

    def log_tail(self) -> str:
        """The end of its log."""
        ...

    def close(self) -> None:
        """Stop it (if this engine started it)."""
        ...


class EngineParts(Protocol):
    """What an engine of one kind brings to its process besides storage, traffic and sockets."""

    config: ClusterConfig  # the cluster's configuration as this engine runs it (device resolved)
    layout: KVLayout  # the KV layout of its blocks (the store's keys and block bytes)
    host_pool: HostPool  # its host buffer of KV blocks (owned: ``close`` releases it)
    engine: LLMEngine | None  # its own model, or None when it drives a model server
    instance: Instance | None  # the model server it drives, once ``worker`` has started it
    ep: EpTraffic | None  # the EP traffic generator its steps wait for, once ``worker`` built it

    def regions(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of the memory other engines' transfers may reach (the traffic
        manager registers each with the transfer backend)."""
        ...

    def worker(self, storage: StorageClient, traffic: TrafficManager) -> Worker:
        """The role's worker on these parts (a model server is started, or reached, here)."""
        ...

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the engine must stop now (the model server it drives exited, with its log's
        end), or None while it can serve. ``wait_s`` > 0: a model server that stopped
        answering gets that long to exit before the answer is given."""
        ...

    def close(self) -> None:
        """Stop what the parts started (a model server) and release the host pool; called once
        the worker, storage client and traffic manager are closed."""
        ...


class NativeEngineParts:
    """Our engine: the model on this process's device, a host pool of full KV blocks, and the
    role's worker with the EP traffic generator when ``traffic.ep_bytes_per_token`` > 0."""

    instance: Instance | None = None

    def __init__(self, model_dir: Path, config: ClusterConfig, role: Role) -> None:
        """Resolve the device (``auto``, Mooncake's build checked against it, a GPU's share set:
        before anything is loaded), then load the model and pin the host pool."""
        self.role = Role(role)
        device = prepare_engine_device(engine_config_for(config, self.role))
        self.config = replace(config, engine=replace(config.engine, device=device))
        self.engine: LLMEngine | None = LLMEngine(model_dir,
                                                  engine_config_for(self.config, self.role))
        self.layout = self.engine.layout
        self.host_pool = HostPool(self.layout.full_block_bytes, config.host_pool_blocks,
                                  touch=True)
        self.ep: EpTraffic | None = None

    def regions(self) -> list[tuple[int, int]]:
        """The host pool and the device cache (a peer's transfers land in either)."""
        assert self.engine is not None
        cache = self.engine.runner.cache.data
        return [(self.host_pool.base_address, self.host_pool.nbytes),
                (cache.data_ptr(), cache.numel() * cache.element_size())]

    def worker(self, storage: StorageClient, traffic: TrafficManager) -> Worker:
        """``PrefillWorker`` or ``DecodeWorker``; each step waits for its EP all-to-all, as
        long as its peers' grants take at most."""
        engine, config = self.engine, self.config
        assert engine is not None
        worker: PrefillWorker | DecodeWorker
        if self.role == Role.PREFILL:
            worker = PrefillWorker(engine, self.host_pool, traffic, storage,
                                   cost_model=_cost_model(config),
                                   quota_ms=config.prefill_quota_ms)
        else:
            worker = DecodeWorker(engine, self.host_pool, traffic, storage,
                                  staging_blocks=config.save_staging_blocks)
        self.ep = _ep_traffic(traffic, config, engine.config, self.role)
        if self.ep is not None:
            worker.on_step = engine.runner.clock.bounded(self.ep.exchange,
                                                         config.traffic.grant_timeout_s)
        return worker

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Never: the model runs in this process."""
        return None

    def close(self) -> None:
        """Unpin the host pool."""
        self.host_pool.close()


def native_engine_parts(model_dir: Path, config: ClusterConfig, role: Role, name: str,
                        host: str = "127.0.0.1", url: str | None = None) -> NativeEngineParts:
    """Our engine's parts (``name``, ``host`` and ``url`` concern model servers: unused)."""
    return NativeEngineParts(Path(model_dir), config, role)


def _ep_traffic(traffic: TrafficManager, config: ClusterConfig, engine: EngineConfig,
                role: Role) -> EpTraffic | None:
    """The EP traffic generator when ``traffic.ep_bytes_per_token`` > 0 (else None), its buffer
    sized for the role's largest step: a decode step's running sequences, a prefill forward's
    token budget (a longer forward's shares wrap around the buffer). A peer that does not
    finish in ``grant_timeout_s`` is left out for ``engine_timeout_s``, by when the router has
    declared a dead one lost."""
    per_token = config.traffic.ep_bytes_per_token
    if per_token <= 0:
        return None
    tokens = engine.max_num_seqs if role == Role.DECODE else engine.max_num_batched_tokens
    return EpTraffic(traffic, per_token, tokens, timeout_s=config.traffic.grant_timeout_s,
                     retry_s=config.engine_timeout_s)


def _cost_model(config: ClusterConfig) -> AttentionCostModel | None:
    """The PE's compute-quota cost model, from the profile when there is one."""
    if not config.profile_path:
        return None
    profile = json.loads(Path(config.profile_path).read_text())
    return AttentionCostModel.from_dict(profile["cost_model"])
