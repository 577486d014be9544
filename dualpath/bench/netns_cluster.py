"""A cluster whose engines run on hosts of their own: one network namespace per node.

``NetnsCluster`` is a ``LocalCluster`` whose router (in this process, the root namespace) binds
the compute network's gateway and whose engine of node ``i`` runs in host ``n<i>``'s
namespace, joining the router over that host's compute link ``c0``.

Storage: with the ``fs`` backend the store is a shared folder, whose reads cross no link, so
the storage NIC stays a token bucket. With ``mooncake_store`` the store runs on a host of its
own (``store``: the master and one segment holder) on a storage network, and every node
reaches it over its storage link ``s0``: storage bytes cross a real link.

With ``shaped=True`` the links are shaped by ``tc`` at the config's caps (``c0`` at the
compute-NIC caps; ``s0``, when there is one, at the storage read cap inbound and the write cap
outbound) and the traffic manager's and storage client's software caps of those NICs are
off; with ``shaped=False`` the links are unshaped and the software caps apply, as on one host.
Root only.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from dualpath.bench.netns import LinkShape, NetnsHosts
from dualpath.config import ClusterConfig
from dualpath.server.launch import LocalCluster

STORE_HOST = "store"
STORE_SEGMENT_MB = 2048  # the store host's memory for KV blocks (mooncake_store)
MASTER_PORT = 50051


def node_host(node_id: int) -> str:
    """The host (namespace) name of node ``node_id``."""
    return f"n{node_id}"


def _uses_store_host(config: ClusterConfig) -> bool:
    return config.storage.backend == "mooncake_store"


class NetnsCluster(LocalCluster):
    """Router here, each engine in its node's namespace (a context manager owning both)."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig, shaped: bool,
                 log_dir: str | Path | None = None, tag: str = "dpc", net: int = 3) -> None:
        nodes = [node_host(i) for i in range(config.num_prefill + config.num_decode)]
        store = _uses_store_host(config)
        self.hosts = NetnsHosts(nodes + ([STORE_HOST] if store else []), tag=tag, net=net,
                                links=("c0", "s0") if store else ("c0",))
        self.shaped = shaped
        self._compute = LinkShape(config.traffic.compute_send_cap_mb_s,
                                  config.traffic.compute_recv_cap_mb_s)
        self._storage = LinkShape(config.storage.write_cap_mb_s, config.storage.read_cap_mb_s)
        self._store_procs: list = []
        super().__init__(model_dir, self._host_config(config), log_dir)

    def _host_config(self, config: ClusterConfig) -> ClusterConfig:
        """The router on the compute gateway; the store on its host; software caps off for
        the links that carry them."""
        traffic, storage = config.traffic, config.storage
        store = _uses_store_host(config)
        if self.shaped:
            traffic = replace(traffic, compute_send_cap_mb_s=None, compute_recv_cap_mb_s=None)
            if store:
                storage = replace(storage, read_cap_mb_s=None, write_cap_mb_s=None)
        if store:
            storage = replace(storage, mooncake_local_host=self.hosts.gateway("s0"),
                              mooncake_master=f"{self._store_address()}:{MASTER_PORT}")
        return replace(config, router_host=self.hosts.gateway(), traffic=traffic,
                       storage=storage)

    def _store_address(self) -> str:
        return self.hosts.address(STORE_HOST, "s0")

    def start(self) -> None:
        """Create the hosts (shaping their links when asked) and the store host's processes,
        then start as a LocalCluster."""
        self.hosts.up()
        try:
            for i in range(self.config.num_prefill + self.config.num_decode):
                self._shape(node_host(i))
            if _uses_store_host(self.config):
                self._start_store()
            super().start()
        except BaseException:
            self._teardown()
            raise

    def _shape(self, host: str) -> None:
        if not self.shaped:
            return
        self.hosts.shape(host, self._compute, "c0")
        if "s0" in self.hosts.links:
            self.hosts.shape(host, self._storage, "s0")

    def _start_store(self) -> None:
        from dualpath.storage import mooncake_service as svc

        wrap = self.hosts.exec_argv(STORE_HOST, [])
        address, logs = self._store_address(), self.log_dir
        logs.mkdir(parents=True, exist_ok=True)
        self._store_procs.append(svc.start_master(
            MASTER_PORT, host=address, wrap=wrap, log_path=logs / "mooncake_master.log"))
        self._store_procs.append(svc.start_segment_holder(
            f"{address}:{MASTER_PORT}", STORE_SEGMENT_MB, host=address, wrap=wrap,
            log_path=logs / "mooncake_segment.log"))

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        argv = super()._engine_argv(name, role, node_id)
        host = node_host(node_id)
        if "s0" in self.hosts.links:  # its store client talks over its storage link
            argv += ["--set", f"storage.mooncake_local_host={self.hosts.address(host, 's0')}"]
        return self.hosts.exec_argv(host, argv)

    def stop(self) -> None:
        """Stop the engines and the router, then the store host, then remove the hosts."""
        try:
            super().stop()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        from dualpath.storage import mooncake_service as svc

        for proc in reversed(self._store_procs):
            with contextlib.suppress(Exception):
                svc.stop(proc)
        self._store_procs.clear()
        self.hosts.down()
