"""One engine process: its storage client, traffic manager and event loop around its parts.

``dualpath engine --role prefill|decode`` runs this. The parts (``engine/parts.py``) are what
the engine kind brings: the KV layout, the host buffer, the role's worker and what it owns (our
model, or a vLLM instance it drives); the process builds the rest once, for any kind.

The loop talks to the router over a ZeroMQ DEALER socket (msgpack control messages). It hands
request messages to its role's ``Worker`` (``engine/worker.py``) and in between messages lets
the worker work: the PE prefills the oldest requests whose storage reads are done; the DE
finishes storage reads and writes and runs one decode step of its running batch. The loop
itself answers what every engine answers alike: ``Peers``, ``GetMetrics``, ``Shutdown``.

A heartbeat thread, on a socket of its own (so a long forward does not silence it), reports the
engine's real state every ``heartbeat_s``, with the liveness clocks the router judges it by: how
long ago the loop read its inbox (and what it held then), and how long ago its work made
progress beside how long the step under way should take. If the router declares the engine lost
(it answers ``known=False``, say after a SIGSTOP) a forward under way stops at its next layer
(``engine/faults.py``), the loop drops every request (a DE fences the buffers it announced:
``Abort(fenced=True)``), waits until no transfer it started can still land (``settled``) and
says hello again as the same incarnation, which lifts the router's fences on it; if the router
falls silent for ``router_timeout_s`` the engine stops its work and exits.

The router's ``Peers`` (sent whenever an engine joins or leaves) tells the traffic manager
where each peer's compute NIC grants its bytes, and gives the EP traffic generator
(``engine/ep_traffic.py``, on when ``traffic.ep_bytes_per_token`` > 0) the engines of this
engine's role: every prefill forward and decode step then waits for its all-to-all with them.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import zmq

from dualpath.config import EngineConfig
from dualpath.control_keys import EngineKey
from dualpath.control_socket import engine_socket
from dualpath.engine.faults import FAULT_HANG_ENV, fault_flag, hang_while
from dualpath.engine.join import Advertised
from dualpath.engine.parts import EngineParts, Instance
from dualpath.engine.sched_counters import loop_thread_counters, process_wakeups
from dualpath.engine.worker import Worker
from dualpath.protocol import (
    HEARTBEAT_SUFFIX,
    Abort,
    AllocBuffer,
    Decode,
    Failed,
    GetMetrics,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    Metrics,
    Peers,
    Prefetch,
    Prefill,
    Shutdown,
    decode,
    encode,
)
from dualpath.storage import open_store
from dualpath.storage.client import StorageClient
from dualpath.storage.node_nic import node_nic_account
from dualpath.storage.warm import WarmTag
from dualpath.traffic.engine_plane import admit_peers, data_plane
from dualpath.traffic.ep import EpPeer, ep_metrics_off
from dualpath.vocab import Role

log = logging.getLogger("dualpath.engine")
IDLE_POLL_MS = 20
__all__ = ["FAULT_HANG_ENV", "EngineIdentity", "EngineProcess"]  # FAULT_HANG_ENV: tests use it
ROUTER_GONE_EXIT = 3  # exit status of an engine that stopped because its router fell silent
VLLM_GONE_EXIT = 4  # ... because the vLLM instance it started died
# how long a model server that stopped answering gets to exit before a failed call is told to
# the router (a SIGKILLed vLLM's sockets close before its process is reaped)
INSTANCE_EXIT_WAIT_S = 5.0


@dataclass(frozen=True)
class EngineIdentity:
    """Who this engine process is."""

    name: str
    role: Role
    node_id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError names a bad role


class EngineProcess:
    """Everything one engine owns, and its loop."""

    def __init__(self, identity: EngineIdentity, parts: EngineParts, router_address: str,
                 key: EngineKey, advertised: Advertised | None = None,
                 cluster_id: str = "") -> None:
        """``parts``: the engine kind's layout, host pool and worker (``engine/parts.py``);
        ``key``: this engine's control-plane key (``control_keys.py``). Builds the storage
        client, the transfer backend and the traffic manager, registers the parts' memory with
        it, and has the parts build their worker (a vLLM engine's instance starts there)."""
        self.identity, self.parts, self.config = identity, parts, parts.config
        config, self.host_pool = parts.config, parts.host_pool
        node_nic = node_nic_account(cluster_id, identity.node_id) if cluster_id else None
        advertised = advertised or Advertised("127.0.0.1", config.transfer_protocol)
        with ExitStack() as undo:  # no child, thread or shared file outlives a failed start
            undo.callback(parts.close)
            self.storage = StorageClient(open_store(config.storage, parts.layout),
                                         parts.layout.block_size, config.storage, node_nic=node_nic)
            undo.callback(self.storage.close)
            self.backend, self.traffic = data_plane(advertised, config, key)  # fenced, keyed
            undo.callback(self.traffic.close)
            for address, nbytes in parts.regions():
                self.traffic.register(address, nbytes)
            self.worker: Worker = parts.worker(self.storage, self.traffic)
            undo.pop_all()  # started: close() stops them in the same order
        self.engine = parts.engine  # our model, or None when the engine drives a model server
        self.ep = parts.ep
        self._peer_endpoints: set[str] = set()  # other engines' transfer endpoints, as known
        self.incarnation = secrets.token_hex(8)  # this process, in each of its hellos
        self.socket = engine_socket(identity.name, router_address, key)
        self._running = True
        self._router_gone = False
        # when the work loop last read its inbox, and the req ids it held then (one tuple: the
        # heartbeat thread reads both at once)
        self._inbox_read: tuple[float, tuple[int, ...]] = (time.monotonic(), ())
        self._rejoin = threading.Event()  # the router forgot us: drop everything, say hello
        self._rejoining = False  # dropped everything; hello once the worker has settled
        self.worker.abandon = self._rejoin.is_set  # a forward stops once we are dropped
        self.worker.name = identity.name
        self._heart = threading.Thread(target=self._heartbeat,
                                       args=(engine_socket(identity.name + HEARTBEAT_SUFFIX,
                                                           router_address, key),),
                                       name="heartbeat", daemon=True)

    @property
    def vllm(self) -> Instance | None:
        """The model server this engine drives (a vLLM instance), if any."""
        return self.parts.instance

    def send(self, messages: list[Message]) -> None:
        """Send control messages to the router."""
        for message in messages:
            self.socket.send(encode(message))

    def serve(self) -> int:
        """Announce this engine, then loop until told to shut down (or the router is gone);
        returns the exit status: 0 when told, ``ROUTER_GONE_EXIT`` when the router fell silent."""
        self._hello()
        self._heart.start()
        while self._running:
            if (failure := self.parts.failure()) is not None:
                log.error("%s: stopping", failure)
                self._running = False
                self.close()
                return VLLM_GONE_EXIT
            timeout = 0 if self.worker.has_work else IDLE_POLL_MS
            while self.socket.poll(timeout):
                self._handle(self.socket.recv())
                timeout = 0
            hang_while(fault_flag(self.identity.name), lambda: self._running)
            if self._rejoin.is_set():
                self._drop_everything()
            self._hello_once_settled()
            # what the heartbeat reports: the inbox was read just now, and what it gave us
            self._inbox_read = (time.monotonic(), self.worker.held_requests())
            try:  # may take seconds (a long prefill): the beats say how old this is
                answers = self.worker.work()
            except Exception:  # the workers fail their own requests; this is a bug to log
                log.exception("engine work failed")
                continue
            self.send(self._speakable(answers))
        self.close()
        return ROUTER_GONE_EXIT if self._router_gone else 0

    def _speakable(self, answers: list[Message]) -> list[Message]:
        """The worker's answers, or none once the instance under them died (its calls broke):
        the engine's exit, next round, speaks for all its requests, so the router moves each
        stream once instead of placing it back on this engine first. A failed call whose
        instance no longer answers waits for that instance to exit (``INSTANCE_EXIT_WAIT_S``):
        the call breaks a moment before the exit shows."""
        if not answers:
            return answers
        broke = any(isinstance(answer, Failed) for answer in answers)
        if self.parts.failure(INSTANCE_EXIT_WAIT_S if broke else 0.0) is not None:
            return []
        return answers

    def _hello(self) -> None:
        ident, ep = self.identity, self.ep
        nic = self.traffic.nic_address or ""
        self.send([Hello(ident.name, ident.role, ident.node_id, self.backend.endpoint, nic,
                         ep.buffer_addr if ep else 0, ep.buffer_bytes if ep else 0,
                         self.incarnation)])

    def _peers(self, msg: Peers) -> None:
        """The registered engines changed: tell the traffic manager where the others' NICs
        grant, forget those that left, and hand the EP generator this role's engines."""
        others = {p.endpoint: p for p in msg.peers if p.name != self.identity.name}
        admit_peers(self.backend, self.traffic, others.values())  # their hosts and keys only
        for endpoint in self._peer_endpoints - others.keys():
            self.traffic.forget_peer(endpoint)
        for peer in others.values():
            if peer.nic_address:
                self.traffic.set_peer_nic(peer.endpoint, peer.nic_address)
        self._peer_endpoints = set(others)
        if self.ep is not None:
            self.ep.set_peers(EpPeer(p.name, p.endpoint, p.ep_buffer_addr, p.ep_buffer_bytes)
                              for p in others.values() if p.role == self.identity.role)

    def _drop_everything(self) -> None:
        """The router declared this engine lost: drop its requests (a DE keeps the buffers it
        announced fenced: a PE may still write them) and join afresh once settled. The answers
        go out: a PE's lift the router's fences on those requests."""
        log.warning("the router lost track of this engine: dropping %d requests, rejoining",
                    len(self.worker.held_requests()))
        for req_id in self.worker.held_requests():
            self.send(self.worker.handle(Abort(req_id, fenced=True)))
        self._rejoin.clear()
        self._rejoining = True

    def _hello_once_settled(self) -> None:
        """Rejoining: say hello once no transfer this engine started can still land (the
        router lifts its fences on this incarnation then)."""
        if self._rejoining and self.worker.settled():
            self._rejoining = False
            self._hello()

    def _heartbeat(self, socket: zmq.Socket) -> None:
        """Report state every ``heartbeat_s``; stop the engine when the router is gone.

        The router counts as gone after ``router_timeout_s`` worth of heartbeats went
        unanswered — counted in heartbeats, not wall time, so an engine that was itself stopped
        (SIGSTOP) does not mistake its own pause for the router's silence.
        """
        config, unanswered = self.config, 0
        while self._running:
            socket.send(encode(self._state()))
            unanswered += 1
            deadline = time.monotonic() + config.heartbeat_s
            while (wait_ms := int(1000 * (deadline - time.monotonic()))) > 0:
                if not socket.poll(wait_ms):
                    break
                ack = decode(socket.recv())
                unanswered = 0
                if isinstance(ack, HeartbeatAck) and not ack.known:
                    self._rejoin.set()
            if unanswered * config.heartbeat_s > config.router_timeout_s:
                log.error("no word from the router for %.0f s: stopping", config.router_timeout_s)
                self._router_gone = True
                self._running = False
                time.sleep(config.router_timeout_s)  # the loop may be stuck in a transfer
                os._exit(ROUTER_GONE_EXIT)
        socket.close(0)

    def _state(self) -> Heartbeat:
        """This engine's heartbeat: its resources, and its two liveness clocks — the inbox
        read's age with what it held then, and the progress age beside the step's budget (a
        forward of many seconds still moves; a loop stuck in a transfer or a deadlock does not,
        and the router declares the engine stuck)."""
        now = time.monotonic()
        read_s, held = self._inbox_read
        progress_s, budget_s = self.worker.liveness()
        return Heartbeat(self.identity.name, self.worker.free_kv_blocks, self.host_pool.num_free,
                         self.worker.read_queue_tokens, held,
                         inbox_age_s=round(max(0.0, now - read_s), 3),
                         progress_age_s=round(max(0.0, now - max(read_s, progress_s)), 3),
                         step_budget_s=round(budget_s, 3),
                         fenced=self.worker.fenced_requests(), warm_dropped=self._warm_dropped())

    def _warm_dropped(self) -> tuple[str, ...]:
        """Sessions whose DRAM copy went since the last beat (expired prefetches included)."""
        warm = self.storage.warm
        if warm is None:
            return ()
        warm.expire()
        return warm.take_dropped()

    def _prefetch(self, msg: Prefetch) -> None:
        """Read a session's stored chain into this node's DRAM, in the background (our
        engines only: a vLLM instance reads through its own connector)."""
        if self.engine is None or self.storage.warm is None:
            return
        space = self.engine.key_space.salted(msg.cache_salt)
        self.storage.prefetch(lambda: space.keys(msg.token_ids),
                              WarmTag(msg.warm_session, max(0.0, msg.warm_lease_s)),
                              time.monotonic() + max(0.0, msg.expires_in_s))

    def _handle(self, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except Exception:  # a message we cannot read is logged, never the end of the engine
            log.exception("undecodable control message")
            return
        req_id = msg.req_id if isinstance(msg, (AllocBuffer, Prefill, Decode, Abort)) else -1
        try:
            self.send(self._dispatch(msg))
        except Exception as exc:  # a request fails, the engine keeps serving
            log.exception("request %s failed", req_id)
            self.send([Failed(req_id, f"{type(exc).__name__}: {exc}")])

    def _dispatch(self, msg: Message) -> list[Message]:
        """Answer what every engine answers alike; hand the rest (request messages) to the
        worker."""
        if isinstance(msg, Peers):
            self._peers(msg)
            return []
        if isinstance(msg, GetMetrics):
            return [Metrics(self.identity.name, self.metrics())]
        if isinstance(msg, Shutdown):
            self._running = False
            return []
        if isinstance(msg, Prefetch):
            self._prefetch(msg)
            return []
        return self.worker.handle(msg)

    def metrics(self) -> dict[str, object]:
        """Traffic, EP, storage and engine counters of this process."""
        values: dict[str, object] = {"role": self.identity.role, "node_id": self.identity.node_id}
        values.update(self.traffic.metrics())
        values.update(self.ep.metrics() if self.ep is not None else ep_metrics_off())
        values.update({f"storage_{k}": v for k, v in self.storage.metrics().items()})
        values.update(self.worker.metrics())
        values.update(loop_thread_counters())
        values.update(process_wakeups())
        values["gil_switch_ms"] = sys.getswitchinterval() * 1000
        return values

    def close(self) -> None:
        """Stop the worker's helpers, the storage client and the traffic manager, then the
        parts (a model server this engine started, the host pool); release the socket."""
        self.worker.close()
        self.storage.close()
        self.traffic.close()
        self.parts.close()
        self.socket.close(0)


def apply_process_settings(engine: EngineConfig) -> None:
    """This engine process's torch threads and GIL switch interval."""
    torch.set_num_threads(engine.threads)
    if engine.gil_switch_ms is not None:
        sys.setswitchinterval(engine.gil_switch_ms / 1000)
