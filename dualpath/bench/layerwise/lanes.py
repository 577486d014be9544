"""Part (b) of ``dualpath bench layerwise``: do the QoS lanes keep KV traffic off the EP path?

Prefill engines (``--prefill``, one by default) and 2 decode engines with capped compute NICs
and the expert-parallel traffic generator on (``traffic.ep_bytes_per_token``: every prefill
forward and decode step exchanges that many bytes per token with its group on the high lane and
waits for it). A batch of decode
requests runs alone, then again beside heavy KV traffic: a stream of DE-path requests whose
large stored hits the prefill engines pull layer by layer out of the decode engines' buffers
(through the decode engines' NICs, charged there too). The stream starts once every decode
request is decoding on its DE, and TPOT is measured over the same window in both phases:
from ``settle_s`` after that until the first request ends, so the same batch decodes with and
without the KV traffic. (Time to the second token, the decode request's own KV handoff, is
reported apart: it is KV traffic itself.) Mean prefill forward time is measured too; once with
99:1 lanes and once with one FIFO lane (``traffic.qos_lanes=false``), each on a fresh cluster
over the same warm store.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster
from dualpath.vocab import Role


@dataclass(frozen=True)
class LanesOptions:
    """Sizes of part (b)."""

    decode_requests: int = 8
    decode_tokens: int = 256  # enough that the whole batch decodes together for seconds
    decode_prompt_tokens: int = 64
    kv_prompts: int = 6  # distinct stored prompts the KV traffic pulls
    kv_hit_tokens: int = 1024
    kv_in_flight: int = 4  # DE-path requests kept in flight during the loaded phase
    rounds: int = 2  # quiet/loaded pairs per cluster
    settle_s: float = 1.0  # KV traffic before the TPOT window opens (the same wait when quiet)
    seed: int = 5


class _TokenClock:
    """Arrival times of one request's streamed tokens."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []

    def __call__(self, tokens: tuple[int, ...]) -> None:
        self.times.append((time.perf_counter(), len(tokens)))

    @property
    def decoding(self) -> bool:
        """Whether the second token came: the request decodes on its DE."""
        return len(self.times) >= 2

    def ttst_s(self) -> float | None:
        """Time from the first token (the PE's) to the second (the DE's first)."""
        return self.times[1][0] - self.times[0][0] if self.decoding else None

    def tpot_s(self, start_s: float, end_s: float) -> float | None:
        """Time per output token over the arrivals in [start_s, end_s] (None: fewer than 2)."""
        inside = [(t, n) for t, n in self.times if start_s <= t <= end_s]
        if len(inside) < 2:
            return None
        return (inside[-1][0] - inside[0][0]) / max(1, sum(n for _, n in inside[1:]))


def lanes_experiment(model_dir: Path, base: ClusterConfig, vocab: int, options: LanesOptions,
                     log_dir: Path, progress: Any = lambda: None) -> dict[str, Any]:
    """TPOT and forward time, quiet vs loaded, lanes on vs one FIFO lane."""
    g = torch.Generator().manual_seed(options.seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab - 1, (n,), generator=g).tolist()

    kv_prompts = [rand(options.kv_hit_tokens) for _ in range(options.kv_prompts)]
    decode_prompts = [rand(options.decode_prompt_tokens) for _ in range(options.decode_requests)]
    rows: dict[str, Any] = {}
    with LocalCluster(model_dir, base, log_dir=log_dir / "warm") as cluster:
        cluster.generate(kv_prompts, SamplingParams(max_tokens=1, ignore_eos=True),
                         timeout_s=1800)  # stores the KV prompts' blocks
    os.sync()  # their writeback must not land in the first measured cluster only
    for name, qos in (("lanes", True), ("fifo", False)):
        config = replace(base, traffic=replace(base.traffic, qos_lanes=qos))
        with LocalCluster(model_dir, config, log_dir=log_dir / name) as cluster:
            phases: dict[str, list[dict[str, Any]]] = {"quiet": [], "loaded": []}
            for _ in range(options.rounds):  # alternated, so drift hits both alike
                phases["quiet"].append(_phase(cluster, decode_prompts, [], options, rand))
                progress()
                phases["loaded"].append(_phase(cluster, decode_prompts, kv_prompts, options,
                                               rand))
                progress()
        quiet, loaded = (_merge(phases[k]) for k in ("quiet", "loaded"))
        rows[name] = {"quiet": quiet, "loaded": loaded,
                      "tpot_inflation": loaded["tpot_s"] / quiet["tpot_s"]}
    return rows


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one phase: mean TPOT and forward time, every round kept."""
    forwards = [r["pe_forward_s"] for r in rounds if r["pe_forward_s"] is not None]
    waits = [r["de_ep_wait_s"] for r in rounds if r["de_ep_wait_s"] is not None]
    return {"tpot_s": statistics.mean(r["tpot_s"] for r in rounds),
            "ttst_s": statistics.mean(r["ttst_s"] for r in rounds),
            "de_loop_runqueue_wait_frac": statistics.mean(
                r["de_loop_runqueue_wait_s"] / r["metrics_window_s"] for r in rounds),
            "de_step_s": statistics.mean(r["de_step_s"] or 0.0 for r in rounds),
            "de_ep_wait_s": statistics.mean(waits) if waits else None,
            "pe_kv_recv_mb_s": statistics.mean(  # the KV traffic's weight
                r["pe_cnic_recv_bytes"] / r["metrics_window_s"] / 1e6 for r in rounds),
            "pe_forward_s": statistics.mean(forwards) if forwards else None,
            "rounds": rounds}


def _phase(cluster: LocalCluster, decode_prompts: list[list[int]], kv_prompts: list[list[int]],
           options: LanesOptions, rand: Any) -> dict[str, Any]:
    """Decode a batch; beside a stream of DE-path KV requests, started once the whole batch
    decodes, when ``kv_prompts``. TPOT over [settle_s after that, the first request's end]."""
    params = SamplingParams(max_tokens=options.decode_tokens, ignore_eos=True)
    at_start = cluster.metrics()  # the PE's forwards count over the whole phase
    clocks = [_TokenClock() for _ in decode_prompts]
    futures = [cluster.submit(p, params, on_tokens=c) for p, c in zip(decode_prompts, clocks,
                                                                       strict=True)]
    while not all(c.decoding or f.done() for c, f in zip(clocks, futures, strict=True)):
        time.sleep(0.005)
    stop, pulled = threading.Event(), [0]
    loader = threading.Thread(target=_kv_stream, args=(cluster, kv_prompts, options, rand, stop,
                                                       pulled), daemon=True)
    if kv_prompts:
        loader.start()
    time.sleep(options.settle_s)
    start_s = time.perf_counter()
    before = cluster.metrics()  # a PE answers between forwards: seconds late when loaded
    for future in futures:
        future.result(timeout=1800)
    after, metrics_end_s = cluster.metrics(), time.perf_counter()
    stop.set()
    if kv_prompts:
        loader.join(timeout=600)
    end_s = min(c.times[-1][0] for c in clocks)
    tpots = [t for c in clocks if (t := c.tpot_s(start_s, end_s)) is not None]
    if not tpots:
        raise DualPathError("the decode batch ended before the TPOT window opened: raise "
                            "--decode-tokens or lower --settle-s")
    return {"tpot_s": statistics.mean(tpots), "tpot_s_each": tpots,
            "window_s": end_s - start_s, "metrics_window_s": metrics_end_s - start_s,
            "ttst_s": statistics.mean(t for c in clocks if (t := c.ttst_s()) is not None),
            "kv_requests": pulled[0], **_engine_deltas(before, after),
            "pe_forward_s": _pe_forward_s(at_start, after)}


def _kv_stream(cluster: LocalCluster, kv_prompts: list[list[int]], options: LanesOptions,
               rand: Any, stop: threading.Event, pulled: list[int]) -> None:
    """Keep ``kv_in_flight`` DE-path requests with large hits in flight until ``stop``."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    in_flight: list[Any] = []
    i = 0
    while not stop.is_set() or in_flight:
        while not stop.is_set() and len(in_flight) < options.kv_in_flight:
            prompt = kv_prompts[i % len(kv_prompts)] + rand(16)
            in_flight.append(cluster.submit(prompt, params, read_path="de"))
            i += 1
        done = [f for f in in_flight if f.done()]
        for future in done:
            in_flight.remove(future)
            future.result()
            pulled[0] += 1
        time.sleep(0.01)


def _role_delta(before: dict[str, dict], after: dict[str, dict], role: str, key: str) -> float:
    """How much ``key`` grew between two metrics snapshots, summed over the engines of ``role``."""
    return sum(float(a.get(key) or 0) - float(before[n].get(key) or 0)
               for n, a in after.items() if a["role"] == role)


def _pe_forward_s(before: dict[str, dict], after: dict[str, dict]) -> float | None:
    """The PEs' mean forward time between two metrics snapshots (None: no forward)."""
    forwards = _role_delta(before, after, "prefill", "num_forwards")
    seconds = _role_delta(before, after, "prefill", "forward_s_total")
    return seconds / forwards if forwards else None


def _engine_deltas(before: dict[str, dict], after: dict[str, dict]) -> dict[str, Any]:
    """Per-role sums of what moved during the TPOT window (from ``before`` to ``after``)."""
    def delta(role: str, key: str) -> float:
        return _role_delta(before, after, role, key)

    decodes = sum(1 for a in after.values() if a["role"] == Role.DECODE)
    return {"de_loop_runqueue_wait_s": delta("decode", "loop_runqueue_wait_s") / max(1, decodes),
            "de_loop_cpu_s": delta("decode", "loop_cpu_s") / max(1, decodes),
            "de_step_s": (delta("decode", "step_s_total") / steps
                          if (steps := delta("decode", "num_steps")) else None),
            "de_ep_bytes": delta("decode", "ep_bytes_sent"),
            "de_ep_wait_s": (delta("decode", "ep_wait_s_total") / exchanges
                             if (exchanges := delta("decode", "ep_exchanges")) else None),
            "pe_ep_bytes": delta("prefill", "ep_bytes_sent"),
            "de_cnic_send_bytes": delta("decode", "cnic_send_bytes"),
            "pe_cnic_recv_bytes": delta("prefill", "cnic_recv_bytes"),
            "de_cnic_send_peak_mb_s_100ms": max(
                (float(a.get("cnic_send_peak_mb_s_100ms") or 0) for a in after.values()
                 if a["role"] == Role.DECODE), default=0.0)}
