"""A cluster whose engines run on hosts of their own: one network namespace per node.

``NetnsCluster`` is a ``LocalCluster`` whose router (in this process, the root namespace) binds
the compute network's gateway and whose engine of node ``i`` runs in host ``n<i>``'s
namespace, joining the router over that host's link. With ``shaped=True`` each host's compute
link is shaped by ``tc`` at the config's compute-NIC caps and the traffic manager's own caps
are turned off, so the emulated NICs are real links; with ``shaped=False`` the links are
unshaped and the traffic manager's token buckets cap them, as on one host. The storage NIC is
a token bucket either way: the store is a shared folder, whose reads cross no link. Root only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dualpath.bench.netns import LinkShape, NetnsHosts
from dualpath.config import ClusterConfig
from dualpath.server.launch import LocalCluster


def node_host(node_id: int) -> str:
    """The host (namespace) name of node ``node_id``."""
    return f"n{node_id}"


def link_config(config: ClusterConfig, gateway: str, shaped: bool) -> ClusterConfig:
    """``config`` with the router on ``gateway`` and, when ``shaped``, no software compute-NIC
    caps (the links carry them)."""
    traffic = config.traffic
    if shaped:
        traffic = replace(traffic, compute_send_cap_mb_s=None, compute_recv_cap_mb_s=None)
    return replace(config, router_host=gateway, traffic=traffic)


class NetnsCluster(LocalCluster):
    """Router here, each engine in its node's namespace (a context manager owning both)."""

    def __init__(self, model_dir: str | Path, config: ClusterConfig, shaped: bool,
                 log_dir: str | Path | None = None, tag: str = "dpc", net: int = 3) -> None:
        nodes = config.num_prefill + config.num_decode
        self.hosts = NetnsHosts([node_host(i) for i in range(nodes)], tag=tag, net=net)
        self.shaped = shaped
        self._caps = LinkShape(config.traffic.compute_send_cap_mb_s,
                               config.traffic.compute_recv_cap_mb_s)
        super().__init__(model_dir, link_config(config, self.hosts.gateway(), shaped), log_dir)

    def start(self) -> None:
        """Create the hosts (shaping their links when asked), then start as a LocalCluster."""
        self.hosts.up()
        try:
            if self.shaped:
                for host in self.hosts.hosts:
                    self.hosts.shape(host, self._caps)
            super().start()
        except BaseException:
            self.hosts.down()
            raise

    def _engine_argv(self, name: str, role: str, node_id: int) -> list[str]:
        return self.hosts.exec_argv(node_host(node_id),
                                    super()._engine_argv(name, role, node_id))

    def stop(self) -> None:
        """Stop the engines and the router, then remove the hosts."""
        try:
            super().stop()
        finally:
            self.hosts.down()
