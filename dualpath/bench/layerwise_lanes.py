"""Part (b) of ``dualpath bench layerwise``: do the QoS lanes keep KV traffic off the EP path?

2 prefill + 2 decode engines with capped compute NICs and the expert-parallel traffic generator
on (``traffic.ep_bytes_per_token``: every prefill forward and decode step exchanges that many
bytes per token with its group on the high lane and waits for it). Decode requests run alone,
then again beside heavy KV traffic: a stream of DE-path requests whose large stored hits the
prefill engines pull layer by layer out of the decode engines' buffers (through the decode
engines' NICs, charged there too). TPOT and mean prefill forward time are measured in both
phases, once with 99:1 lanes and once with one FIFO lane (``traffic.qos_lanes=false``), each on
a fresh cluster over the same warm store.
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
from dualpath.request import SamplingParams
from dualpath.server.launch import LocalCluster


@dataclass(frozen=True)
class LanesOptions:
    """Sizes of part (b)."""

    decode_requests: int = 8
    decode_tokens: int = 64
    decode_prompt_tokens: int = 64
    kv_prompts: int = 6  # distinct stored prompts the KV traffic pulls
    kv_hit_tokens: int = 1024
    kv_in_flight: int = 4  # DE-path requests kept in flight during the loaded phase
    rounds: int = 2  # quiet/loaded pairs per cluster
    seed: int = 5


class _TokenClock:
    """Arrival times of one request's streamed tokens."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []

    def __call__(self, tokens: tuple[int, ...]) -> None:
        self.times.append((time.perf_counter(), len(tokens)))

    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two arrivals)."""
        if len(self.times) < 2:
            return None
        count = sum(n for _, n in self.times[1:])
        return (self.times[-1][0] - self.times[0][0]) / max(1, count)


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
            "de_step_s": statistics.mean(r["de_step_s"] or 0.0 for r in rounds),
            "de_ep_wait_s": statistics.mean(waits) if waits else None,
            "pe_forward_s": statistics.mean(forwards) if forwards else None,
            "rounds": rounds}


def _phase(cluster: LocalCluster, decode_prompts: list[list[int]], kv_prompts: list[list[int]],
           options: LanesOptions, rand: Any) -> dict[str, Any]:
    """Run the decode requests (beside a stream of DE-path KV requests when ``kv_prompts``)."""
    before = cluster.metrics()
    params = SamplingParams(max_tokens=options.decode_tokens, ignore_eos=True)
    clocks = [_TokenClock() for _ in decode_prompts]
    stop = threading.Event()
    pulled = [0]
    loader = threading.Thread(target=_kv_stream, args=(cluster, kv_prompts, options, rand, stop,
                                                       pulled), daemon=True)
    if kv_prompts:
        loader.start()
        time.sleep(1.0)  # let the pulls build up before decoding starts
    futures = [cluster.submit(p, params, on_tokens=c) for p, c in zip(decode_prompts, clocks,
                                                                       strict=True)]
    for future in futures:
        future.result(timeout=1800)
    stop.set()
    if kv_prompts:
        loader.join(timeout=600)
    after = cluster.metrics()
    tpots = [t for c in clocks if (t := c.tpot_s()) is not None]
    return {"tpot_s": statistics.mean(tpots), "tpot_s_each": tpots,
            "kv_requests": pulled[0], **_engine_deltas(before, after)}


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


def _engine_deltas(before: dict[str, dict], after: dict[str, dict]) -> dict[str, Any]:
    """Per-role sums of what moved during a phase, and the PEs' mean forward time."""
    def delta(role: str, key: str) -> float:
        return sum(float(a.get(key) or 0) - float(before[n].get(key) or 0)
                   for n, a in after.items() if a["role"] == role)

    forwards = delta("prefill", "num_forwards")
    return {"pe_forward_s": delta("prefill", "forward_s_total") / forwards if forwards else None,
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
                 if a["role"] == "decode"), default=0.0)}
