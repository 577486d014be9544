"""One mode of ``dualpath bench agents`` on one cluster: through the Python cluster API or
through a ``dualpath serve`` process and its OpenAI API, with the NICs sampled meanwhile.

Both ways give the same per-turn record (:func:`python_record`, :func:`http_record`): agent,
turn, submit offset, prompt and hit tokens, TTFT, time to second token, TPOT, latency, and
(Python API only: the HTTP API does not carry it) the router's TTFT breakdown.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import httpx2

from dualpath.bench.agents.nics import (
    NicSampler,
    cluster_node_bytes,
    prometheus_node_bytes,
)
from dualpath.bench.replay import NO_PACING, Pacing, TurnRecord, run_turns
from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.server.launch import LocalCluster
from dualpath.workloads.turns import AgentTurn

SERVE_STARTUP_S = 240.0


def python_record(agent: int, turn: int, r: TurnRecord) -> dict[str, Any]:
    """A turn served through the cluster API, as a plain record."""
    return {"agent": agent, "turn": turn, "submitted_s": r.submitted_s,
            "prompt_tokens": r.prompt_tokens, "hit_tokens": r.hit_tokens,
            "computed_tokens": r.computed_tokens, "ttft_s": r.ttft_s, "ttst_s": r.ttst_s,
            "tpot_s": r.tpot_s, "latency_s": r.latency_s, "read_path": r.read_path,
            "attempts": r.attempts, "timings": r.timings}


def http_record(r: Any, began_s: float) -> dict[str, Any]:
    """A turn served through the OpenAI API (an ``HttpTurnRecord``), as a plain record."""
    return {"agent": r.agent, "turn": r.turn, "submitted_s": r.submitted_s - began_s,
            "prompt_tokens": r.prompt_tokens, "hit_tokens": r.cached_tokens or 0,
            "ttft_s": r.ttft_s, "ttst_s": r.time_to_second_token_s, "tpot_s": r.tpot_s,
            "latency_s": r.latency_s, "error": r.error, "status": r.status}


def empty_store(store: Path, pending_writes: Any, timeout_s: float = 120.0) -> None:
    """Delete every stored block once ``pending_writes()`` says no write is queued."""
    deadline = time.monotonic() + timeout_s
    while pending_writes():
        if time.monotonic() > deadline:
            raise DualPathError(f"block writes still pending after {timeout_s:.0f} s")
        time.sleep(0.2)
    for child in store.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _cluster_pending(cluster: LocalCluster) -> bool:
    return any(m.get("storage_write_queue_tokens", 0) for m in cluster.metrics().values())


class PythonRun:
    """A :class:`LocalCluster` driven through its Python API (the router in this process)."""

    def __init__(self, model_dir: Path, config: ClusterConfig, submit_mode: str,
                 log_dir: Path) -> None:
        self.cluster = LocalCluster(model_dir, config, log_dir=log_dir)
        self.submit_mode = submit_mode
        self.store = Path(config.storage.root)  # type: ignore[arg-type]

    def __enter__(self) -> PythonRun:
        self.cluster.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    def empty(self) -> None:
        """Wait for block writes, then empty the store."""
        empty_store(self.store, lambda: _cluster_pending(self.cluster))

    def wait_for_writes(self, timeout_s: float = 120.0) -> None:
        """Return once no engine has a block write queued."""
        deadline = time.monotonic() + timeout_s
        while _cluster_pending(self.cluster) and time.monotonic() < deadline:
            time.sleep(0.2)

    def run(self, agents: list[list[AgentTurn]], offsets_s: list[float] | None,
            progress: Any, timeout_s: float, cut_after_s: float | None = None,
            pacing: Pacing = NO_PACING) -> tuple[list[dict[str, Any]], float]:
        """Every agent to its last turn (or until every turn submitted by ``cut_after_s``
        returned), paced by ``pacing`` (:func:`run_turns`); the records and the JCT (s)."""
        row = run_turns(self.cluster, agents, self.submit_mode, progress, timeout_s,
                        label="bench agents", start_offsets_s=offsets_s,
                        cut_after_s=cut_after_s, pacing=pacing)
        records = [python_record(a, t, r) for a, recs in enumerate(row["records"])
                   for t, r in enumerate(recs)]
        return records, row["jct_s"]

    def sampler(self) -> NicSampler:
        """A NIC sampler over the engines' counters."""
        return NicSampler(lambda: cluster_node_bytes(self.cluster.metrics()))

    def busy_s(self) -> dict[str, dict[str, float]]:
        """Per engine, seconds so far: in forwards (PE) or decode steps (DE), ``busy_s``; its
        loop thread on a CPU, ``loop_cpu_s``, and runnable but waiting for one,
        ``loop_runqueue_wait_s`` (where the kernel keeps schedstat); counts too: the loop's
        ``loop_preemptions`` and the process's ``thread_wakeups`` (``sched_counters``)."""
        return {name: engine_seconds(m) for name, m in self.cluster.metrics().items()}

    def counters(self) -> dict[str, Any]:
        """The router's counters (retries, drops)."""
        assert self.cluster.router is not None
        return self.cluster.router.counters()


def engine_seconds(metrics: dict[str, Any]) -> dict[str, float]:
    """An engine's cumulative time counters (see ``PythonRun.busy_s``) from its metrics."""
    out = {"busy_s": float(metrics.get("forward_s_total") or metrics.get("step_s_total") or 0.0)}
    out.update({k: float(metrics[k]) for k in LOOP_KEYS if metrics.get(k) is not None})
    return out


LOOP_KEYS = ("loop_cpu_s", "loop_runqueue_wait_s", "layer_wait_s_total", "loop_preemptions",
             "thread_wakeups")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_overrides(config: ClusterConfig) -> list[str]:
    """``--set key=value`` overrides that turn the default config into ``config`` (every
    field that differs; TOML values)."""
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    want, default = flat(asdict(config)), flat(asdict(ClusterConfig()))
    out = []
    for key, value in want.items():
        if value == default.get(key) or value is None:
            continue
        out.append(f"{key}={json.dumps(value)}")  # JSON scalars and arrays read as TOML
    return out


def replay_http(base_url: str, model: str, agents: list[list[AgentTurn]],
                offsets_s: list[float] | None, progress: Any, timeout_s: float,
                cut_after_s: float | None = None) -> tuple[list[dict[str, Any]], float]:
    """The agents through an OpenAI-compatible server (:func:`run_agents_http`): the records
    and the JCT; ``DualPathError`` naming the first failed turn."""
    from dualpath.bench.agents.http import run_agents_http

    began = time.monotonic()
    per_agent = asyncio.run(run_agents_http(
        base_url, agents, model=model, start_offsets_s=offsets_s,
        progress=lambda _: progress(), timeout_s=timeout_s, cut_after_s=cut_after_s))
    jct = time.monotonic() - began
    records = [http_record(r, began) for recs in per_agent for r in recs]
    failed = [r for r in records if r["error"]]
    if failed:
        raise DualPathError(f"bench agents: {len(failed)} turns failed through {base_url}, "
                            f"first: {failed[0]['status']} {failed[0]['error']}")
    return records, jct


# ``/metrics`` names of the router's counters that differ from ``Router.counters``'
ROUTER_SERIES = {"moved_streams": "moved", "corrected_requests": "corrected"}


class HttpRun:
    """A ``dualpath serve`` process (its own router and engines) driven over HTTP."""

    def __init__(self, model_dir: Path, config: ClusterConfig, log_dir: Path) -> None:
        unset = [f.name for f in fields(config) if getattr(config, f.name) is None
                 and getattr(ClusterConfig(), f.name) is not None]
        if unset:
            raise DualPathError(f"--via http cannot unset {unset}")
        self.model_dir, self.config, self.log_dir = model_dir, config, log_dir
        self.store = Path(config.storage.root)  # type: ignore[arg-type]
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> HttpRun:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "dualpath.cli", "serve", "--model", str(self.model_dir),
               "--port", str(self.port), "--prefill", str(self.config.num_prefill),
               "--decode", str(self.config.num_decode)]
        for item in serve_overrides(self.config):
            cmd += ["--set", item]
        log = (self.log_dir / "serve.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVE_STARTUP_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise DualPathError(f"dualpath serve exited ({self.proc.returncode}); see "
                                    f"{self.log_dir / 'serve.log'}")
            try:
                if httpx2.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    self.model = httpx2.get(f"{self.base_url}/v1/models",
                                            timeout=5.0).json()["data"][0]["id"]
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise DualPathError(f"dualpath serve not ready in {SERVE_STARTUP_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _metrics(self) -> str:
        return httpx2.get(f"{self.base_url}/metrics", timeout=30.0).text

    def empty(self) -> None:
        """Wait until the router has no read queued and the engines report no write, then
        empty the store (block writes are not on ``/metrics``: wait a moment for them)."""
        self.wait_for_writes()
        empty_store(self.store, lambda: False)

    def wait_for_writes(self, timeout_s: float = 120.0) -> None:
        """A decode engine answers a request once its blocks are written; what is left
        (writes of aborted requests) settles in a moment."""
        time.sleep(1.0)

    def run(self, agents: list[list[AgentTurn]], offsets_s: list[float] | None,
            progress: Any, timeout_s: float,
            cut_after_s: float | None = None) -> tuple[list[dict[str, Any]], float]:
        """Every agent to its last turn through the API (or until every turn sent by
        ``cut_after_s`` returned: :func:`run_agents_http`); the records and the JCT."""
        return replay_http(self.base_url, self.model, agents, offsets_s, progress, timeout_s,
                           cut_after_s)

    def sampler(self) -> NicSampler:
        """A NIC sampler over the server's ``/metrics`` page."""
        return NicSampler(lambda: prometheus_node_bytes(self._metrics()), interval_s=2.0)

    def busy_s(self) -> dict[str, dict[str, float]]:
        """Not on ``/metrics``: nothing."""
        return {}

    def counters(self) -> dict[str, Any]:
        """The router's counters its server's ``/metrics`` carries (``dualpath:router_*``
        counters, by the name ``Router.counters`` gives them)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, Any] = {}
        for family in text_string_to_metric_families(self._metrics()):
            name = family.name.removeprefix("dualpath:router_")
            if family.type == "counter" and name != family.name:
                out[ROUTER_SERIES.get(name, name)] = sum(s.value for s in family.samples
                                                         if s.name.endswith("_total"))
        return out
