"""Per-node NIC utilization over time, sampled while ``dualpath bench agents`` runs.

A :class:`NicSampler` thread reads every engine's counters at a fixed interval — from the
cluster API (``LocalCluster.metrics``) or from a ``dualpath serve``'s ``/metrics`` page — and
keeps, per node, the cumulative bytes its storage NIC read and its compute NIC sent and
received. :func:`utilization` turns the samples into per-interval rates over the caps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

NodeBytes = dict[int, dict[str, Any]]  # node id -> role, snic_read_bytes, cnic_bytes


def cluster_node_bytes(metrics: dict[str, dict]) -> NodeBytes:
    """Per node: its role, the bytes its storage NIC read and its compute NIC moved (sent and
    received, as the side that started a transfer or the one it was started on), summed over
    the node's engines (``LocalCluster.metrics()`` values)."""
    nodes: NodeBytes = {}
    for m in metrics.values():
        node = nodes.setdefault(int(m["node_id"]), {"role": m["role"], "snic_read_bytes": 0,
                                                    "cnic_bytes": 0})
        node["snic_read_bytes"] += int(m.get("storage_snic_read_bytes", 0))
        node["cnic_bytes"] += sum(int(m.get(f"cnic_{side}_{kind}bytes", 0))  # both ends
                                  for side in ("send", "recv") for kind in ("", "passive_"))
    return nodes


def prometheus_node_bytes(text: str) -> NodeBytes:
    """The same from a ``/metrics`` page: ``dualpath:storage`` (snic_read_bytes per engine and
    node) and ``dualpath:compute_nic_lane_bytes`` (per engine; its node from the storage
    series). Engine names start with their role's letter (``pe0``, ``de1``)."""
    from prometheus_client.parser import text_string_to_metric_families

    nodes: NodeBytes = {}
    node_of: dict[str, int] = {}
    lanes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("dualpath:storage") and labels.get("node"):
                engine, node_id = labels["engine"], int(labels["node"])
                node_of[engine] = node_id
                role = "prefill" if engine.startswith("p") else "decode"
                node = nodes.setdefault(node_id, {"role": role, "snic_read_bytes": 0,
                                                  "cnic_bytes": 0})
                if labels.get("counter") == "snic_read_bytes":
                    node["snic_read_bytes"] += int(sample.value)
            elif sample.name.startswith("dualpath:compute_nic_lane_bytes"):
                lanes[labels["engine"]] = lanes.get(labels["engine"], 0.0) + sample.value
    for engine, value in lanes.items():
        if engine in node_of:
            nodes[node_of[engine]]["cnic_bytes"] += int(value)
    return nodes


class NicSampler:
    """Samples ``read()`` every ``interval_s`` on a thread, from ``start()`` to ``stop()``."""

    def __init__(self, read: Callable[[], NodeBytes], interval_s: float = 1.0) -> None:
        self.read = read
        self.interval_s = interval_s
        self.samples: list[tuple[float, NodeBytes]] = []  # (seconds since start, counters)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nic-sampler", daemon=True)
        self._began = 0.0

    def start(self) -> NicSampler:
        """Take the first sample and start the thread."""
        self._began = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, NodeBytes]]:
        """Take a last sample, stop the thread and return every sample."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.samples

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            counters = self.read()
        except Exception:  # a slow or busy engine skips one sample; the rates span the gap
            return
        self.samples.append((time.perf_counter() - self._began, counters))


def even_spacing(samples: list[tuple[float, NodeBytes]],
                 interval_s: float) -> list[tuple[float, NodeBytes]]:
    """The samples, dropping any taken less than ``interval_s`` / 2 after the one kept before
    it (a late sample followed by a prompt one would make a short interval whose rate is a
    burst's, not the NIC's), and always keeping the last."""
    kept = samples[:1]
    for sample in samples[1:-1]:
        if sample[0] - kept[-1][0] >= interval_s / 2:
            kept.append(sample)
    if len(samples) > 1:
        if samples[-1][0] - kept[-1][0] < interval_s / 2 and len(kept) > 1:
            kept.pop()
        kept.append(samples[-1])
    return kept


def utilization(samples: list[tuple[float, NodeBytes]], snic_cap_mb_s: float | None,
                cnic_cap_mb_s: float | None, interval_s: float = 1.0) -> dict[str, Any]:
    """Per node, the storage-NIC read rate and compute-NIC rate (MB/s) per sampling interval
    (samples closer than half ``interval_s`` merged: :func:`even_spacing`), and each NIC's busy
    fraction over the whole run (bytes / (cap × span)); ``t_s`` holds each interval's end."""
    samples = even_spacing(samples, interval_s)
    if len(samples) < 2:
        return {"t_s": [], "nodes": {}}
    out: dict[str, Any] = {"t_s": [round(t, 3) for t, _ in samples[1:]], "nodes": {}}
    span_s = samples[-1][0] - samples[0][0]
    for node_id in sorted(samples[-1][1]):
        series: dict[str, Any] = {"role": samples[-1][1][node_id]["role"]}
        for key, cap in (("snic_read_bytes", snic_cap_mb_s), ("cnic_bytes", cnic_cap_mb_s)):
            values = [s.get(node_id, {}).get(key, 0) for _, s in samples]
            rates = [(b - a) / 1e6 / max(1e-9, t1 - t0) for (t0, _), (t1, _), a, b
                     in zip(samples, samples[1:], values, values[1:], strict=False)]
            name = key.removesuffix("_bytes").removesuffix("_read")
            series[f"{name}_mb_s"] = [round(r, 3) for r in rates]
            series[f"{name}_bytes"] = values[-1] - values[0]
            if cap:
                series[f"{name}_busy"] = (values[-1] - values[0]) / (cap * 1e6 * max(1e-9, span_s))
        out["nodes"][str(node_id)] = series
    return out
