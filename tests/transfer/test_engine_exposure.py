"""A real local cluster (1 PE + 2 DEs, capped compute NICs, EP traffic on) as a stranger on the
same machine sees it (issue 42): ``ss -ltnp`` shows no engine listener on a wildcard address
that a fence of that engine does not cover; the fences go with the engines; the engines' grant
servers answer each other (the EP bytes one sends are the bytes its peer's NIC granted) and
nobody without a cluster key."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq

from dualpath.config import ClusterConfig, EngineConfig, StorageConfig, TrafficConfig
from dualpath.control_keys import KeyPair
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.transfer.firewall import fence_unavailable, fenced_ports
from dualpath.transfer.listeners import listeners

ENGINE = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + 13 * j) % 290 + 3 for j in range(30 + 9 * i)] for i in range(4)]
EP_BYTES = 16 << 10


def wait_for(holds: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Until ``holds()``; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def config(tmp_path: Path) -> ClusterConfig:
    traffic = TrafficConfig(compute_send_cap_mb_s=400.0, compute_recv_cap_mb_s=400.0,
                            ep_bytes_per_token=EP_BYTES)
    return ClusterConfig(engine=ENGINE, storage=StorageConfig(root=str(tmp_path / "kv")),
                         traffic=traffic, host_pool_blocks=64)


def ss_wildcard_ports(pid: int) -> set[int]:
    """The ports ``ss -ltnp`` shows ``pid`` listening on on every interface."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        address, _, port = line.split()[3].rpartition(":")
        if f"pid={pid}," in line and address in ("0.0.0.0", "*", "[::]"):
            ports.add(int(port))
    return ports


def heard(address: str, keys: KeyPair | None, server_public: str) -> bool:
    """Whether a socket on a grant port hears an answer to a ping (no key, or ``keys``)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey = keys.secret.encode(), keys.public.encode()
        sock.curve_serverkey = server_public.encode()
    sock.connect(address)
    try:
        try:
            sock.send(msgpack.packb(["ping", 0]), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return bool(sock.poll(1500))
    finally:
        sock.close()


def test_engines_listen_only_fenced_and_their_grants_only_to_each_other(tiny_chaotic_dir,
                                                                       tmp_path):
    fence = fence_unavailable()
    with LocalCluster(tiny_chaotic_dir, config(tmp_path), log_dir=tmp_path / "logs") as cluster:
        wait_for(lambda: all(m["ep_peers"] == 1 for m in cluster.metrics().values()
                             if m["role"] == "decode"), what="the DEs to know each other")
        outputs = cluster.generate(PROMPTS, PARAMS, timeout_s=120)
        metrics = cluster.metrics()
        engines = dict(cluster.router.engines)
        keys = cluster.router.keys
        pids = {name: cluster.process(name).pid for name in engines}
        wildcard = {name: ss_wildcard_ports(pid) for name, pid in pids.items()}
        found = {name: {x.port for x in listeners([pid]) if x.wildcard}
                 for name, pid in pids.items()}
        fences = fenced_ports()
        strangers = {}
        for name, info in engines.items():
            server, other = keys.engines[name].public, next(n for n in engines if n != name)
            strangers[name] = (heard(info.nic_address, None, ""),
                               heard(info.nic_address, KeyPair.new(), server),
                               heard(info.nic_address, keys.engines[other], server))
    assert len(outputs) == len(PROMPTS)
    # ss shows each engine's Mooncake ports on every interface, and each is fenced by that
    # engine's own table (as long as the engine runs)
    for name, pid in pids.items():
        assert wildcard[name] and wildcard[name] == found[name]
        if fence is None:
            mine = {p for table, ports in fences.items()
                    if table.startswith(f"dualpath_{pid}_") for p in ports}
            assert wildcard[name] <= mine, (name, wildcard[name], fences)
    gone = fenced_ports()
    assert not [t for t in gone for pid in pids.values() if t.startswith(f"dualpath_{pid}_")]
    # the engines' grants work over authenticated sockets: what one DE sent its peer's NIC
    # granted and counted, and nothing timed out
    des = sorted(n for n, m in metrics.items() if m["role"] == "decode")
    decoded = {o.decode_engine for o in outputs}
    assert decoded
    for name, other in zip(des, reversed(des), strict=True):
        sent = metrics[name]["ep_bytes_sent"]
        assert metrics[name]["ep_failed_exchanges"] == 0
        assert (sent > 0) == (name in decoded)
        assert metrics[other]["cnic_recv_passive_lane_bytes_high"] == pytest.approx(sent,
                                                                                    rel=0.05)
    assert all(m["grant_timeouts"] == 0 for m in metrics.values())
    # a stranger: no key, an unknown key; a cluster engine's key is heard
    for name, (no_key, unknown, member) in strangers.items():
        assert not no_key and not unknown, name
        assert member, name
