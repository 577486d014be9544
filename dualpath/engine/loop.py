"""One engine process: its model, host buffer, storage client, traffic manager and event loop.

``dualpath engine --role prefill|decode`` runs this. The loop talks to the router over a
ZeroMQ DEALER socket (msgpack control messages), and in between messages it does the role's
work: the PE prefills the oldest request whose storage read is done; the DE finishes storage
reads and writes and runs one decode step of its running batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from dualpath.config import ClusterConfig
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillWorker
from dualpath.engine.traffic import TrafficManager
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import (
    AllocBuffer,
    Decode,
    Failed,
    GetMetrics,
    Hello,
    Message,
    Metrics,
    Prefill,
    Release,
    Shutdown,
    decode,
    encode,
)
from dualpath.scheduler.batch import AttentionCostModel
from dualpath.storage import open_store
from dualpath.storage.client import StorageClient

log = logging.getLogger("dualpath.engine")
IDLE_POLL_MS = 20


@dataclass(frozen=True)
class EngineIdentity:
    """Who this engine process is."""

    name: str
    role: str  # prefill | decode
    node_id: int


class EngineProcess:
    """Everything one engine owns, and its loop."""

    def __init__(self, identity: EngineIdentity, model_dir: Path, config: ClusterConfig,
                 router_address: str) -> None:
        from dualpath.transfer.mooncake import MooncakeBackend

        torch.set_num_threads(config.engine.threads)
        self.identity = identity
        self.engine = LLMEngine(model_dir, config.engine)
        layout = self.engine.layout
        self.storage = StorageClient(open_store(config.storage, layout), layout.block_size,
                                     config.storage)
        self.backend = MooncakeBackend()
        self.traffic = TrafficManager(self.backend, config.traffic)
        self.host_pool = HostPool(layout.full_block_bytes, config.host_pool_blocks)
        cache = self.engine.runner.cache.data
        self.traffic.register(self.host_pool.base_address, self.host_pool.nbytes)
        self.traffic.register(cache.data_ptr(), cache.numel() * cache.element_size())
        args = (self.engine, self.host_pool, self.traffic, self.storage)
        self.worker: PrefillWorker | DecodeWorker
        if identity.role == "prefill":
            self.worker = PrefillWorker(*args, cost_model=_cost_model(config),
                                        quota_ms=config.prefill_quota_ms)
        else:
            self.worker = DecodeWorker(*args)
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity.name.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(router_address)
        self._running = True

    def send(self, messages: list[Message]) -> None:
        """Send control messages to the router."""
        for message in messages:
            self.socket.send(encode(message))

    def serve(self) -> None:
        """Announce this engine, then loop until told to shut down."""
        ident = self.identity
        self.send([Hello(ident.name, ident.role, ident.node_id, self.backend.endpoint)])
        while self._running:
            timeout = 0 if self._has_work() else IDLE_POLL_MS
            while self.socket.poll(timeout):
                self._handle(decode(self.socket.recv()))
                timeout = 0
            try:
                self._work()
            except Exception:  # the engine keeps serving; the failure is in its log
                log.exception("engine work failed")
        self.close()

    def _has_work(self) -> bool:
        if isinstance(self.worker, PrefillWorker):
            return self.worker.has_ready_job
        return self.worker.has_work

    def _work(self) -> None:
        if isinstance(self.worker, PrefillWorker):
            if self.worker.has_ready_job:
                self.send(self.worker.run_next())
            return
        self.send(self.worker.drain_events())
        if self.worker.has_work:
            self.send(self.worker.step())

    def _handle(self, msg: Message) -> None:
        req_id = getattr(msg, "req_id", -1)
        try:
            self.send(self._dispatch(msg))
        except Exception as exc:  # a request fails, the engine keeps serving
            log.exception("request %s failed", req_id)
            self.send([Failed(req_id, f"{type(exc).__name__}: {exc}")])

    def _dispatch(self, msg: Message) -> list[Message]:
        worker = self.worker
        if isinstance(msg, Prefill) and isinstance(worker, PrefillWorker):
            worker.accept(msg)
            return []
        if isinstance(msg, AllocBuffer) and isinstance(worker, DecodeWorker):
            return worker.alloc_buffer(msg)
        if isinstance(msg, Decode) and isinstance(worker, DecodeWorker):
            return worker.start_decode(msg)
        if isinstance(msg, Release) and isinstance(worker, DecodeWorker):
            worker.release(msg.req_id)
            return []
        if isinstance(msg, GetMetrics):
            return [Metrics(self.identity.name, self.metrics())]
        if isinstance(msg, Shutdown):
            self._running = False
            return []
        raise ValueError(f"a {self.identity.role} engine cannot handle {msg.type!r}")

    def metrics(self) -> dict[str, object]:
        """Traffic, storage and engine counters of this process."""
        values: dict[str, object] = {"role": self.identity.role, "node_id": self.identity.node_id}
        values.update(self.traffic.metrics())
        values.update({f"storage_{k}": v for k, v in self.storage.metrics().items()})
        for name in ("num_prefilled", "num_forwards", "num_chunks", "num_hit_tokens",
                     "num_computed_tokens", "num_saved_blocks"):
            if hasattr(self.worker, name):
                values[name] = getattr(self.worker, name)
        return values

    def close(self) -> None:
        """Stop helpers and release the socket."""
        self.storage.close()
        self.traffic.close()
        self.socket.close(0)


def _cost_model(config: ClusterConfig) -> AttentionCostModel | None:
    """The PE's compute-quota cost model, from the profile when there is one."""
    if not config.profile_path:
        return None
    profile = json.loads(Path(config.profile_path).read_text())
    return AttentionCostModel.from_dict(profile["cost_model"])
