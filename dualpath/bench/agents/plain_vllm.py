"""Plain vLLM beside the ladder of ``bench agents --engine vllm``, on the same hardware: as many
``vllm serve`` instances (the peers' environment) as the cluster has engines, each with its own
prefix cache and no storage tier, fed the very same agent turns through their OpenAI API
(``bench/agents/http.py``). What a team running vLLM today gets.

* Sessions are sticky: agent ``i`` runs every turn on instance ``i mod N``
  (``kv_budget.sticky_instance``), as RL frameworks pin a trajectory with a session id.
* Row ``vllm``: each instance has the device-KV budget the ladder's instances have
  (``kv_budget.bounded_kv_budget``: the working set is several times their total), so a
  session's context is often evicted between its turns and recomputed.
* Row ``oracle`` (the vLLM ladder's oracle): the same instances with an unbounded prefix cache
  (``kv_budget.unbounded_kv_bytes``) and the first turns primed: every hit is a device hit,
  nothing is read or recomputed, as our engines' oracle takes every hit as given. Unlike our
  oracle it is N colocated instances rather than 1 prefill + 2 decode engines: vLLM without a
  connector has no disaggregated form to run.

Every instance is warmed up with the warm-up turns, then (``prime_first_turns``) each agent's
primer (its first prompt, or the request before its window of turns) goes into its instance's
prefix cache untimed, as the ladder stores them; then all agents run at once. Neither row moves
KV through storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.progress import Progress

from dualpath.bench.agents.http import HttpSession, HttpTurnRecord, open_client, run_agent_http
from dualpath.bench.agents.kv_budget import PLAIN_ROW, sticky_instance
from dualpath.bench.agents.run import http_record, replay_http
from dualpath.bench.replay import Pacing
from dualpath.bench.report import host_cpu_shares, host_cpu_ticks
from dualpath.config import ClusterConfig
from dualpath.errors import DualPathError
from dualpath.workloads.turns import AgentTurn

__all__ = ["PLAIN_ROW", "PlainVllmFleet", "plain_row", "replay_sticky"]


async def replay_sticky(urls: list[str], model: str, agents: list[list[AgentTurn]],
                        progress: Any, timeout_s: float, pacing: Pacing | None = None,
                        session_hints: bool = False) -> list[list[HttpTurnRecord]]:
    """Every agent's turns on its instance (agent ``i`` on ``urls[i mod len(urls)]``), all
    agents at once; per agent, its records. Turns still running ``timeout_s`` after the call
    are cut off and recorded as failed. With ``pacing``, each agent names its session
    (``HttpSession``), waits its tool times, and at most ``pacing.max_agents`` run at once."""
    deadline = time.monotonic() + timeout_s
    slots = asyncio.Semaphore(pacing.max_agents if pacing and pacing.max_agents else
                              max(1, len(agents)))

    async def agent_run(client: Any, i: int, turns: list[AgentTurn]) -> list[HttpTurnRecord]:
        session = None if pacing is None else HttpSession(f"agent-{i}", pacing, session_hints)
        async with slots:
            records, _ = await run_agent_http(client, turns, model=model, agent=i,
                                              progress=lambda _: progress(), stop_s=deadline,
                                              deadline_s=deadline, session=session)
        return records

    per_instance = [sum(1 for i in range(len(agents)) if sticky_instance(i, len(urls)) == k)
                    for k in range(len(urls))]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(open_client(url, None, timeout_s,
                                                               max(1, count)))
                   for url, count in zip(urls, per_instance, strict=True)]
        runs = [agent_run(clients[sticky_instance(i, len(urls))], i, turns)
                for i, turns in enumerate(agents)]
        return list(await asyncio.gather(*runs))


class PlainVllmFleet:
    """``instances`` plain vLLM instances of ``config`` (its ``vllm`` settings: the KV budget,
    ``max_model_len``), driven like ``HttpRun``."""

    def __init__(self, model_dir: Path, config: ClusterConfig, instances: int, log_dir: Path,
                 name: str = PLAIN_ROW) -> None:
        from dualpath.integrations.vllm.engines.instance import launch_plan
        from dualpath.vocab import Role

        self.config = config
        self.plans = [launch_plan(model_dir, config, Role.DECODE, "127.0.0.1", name=f"{name}{k}",
                                  log_path=log_dir / f"{name}{k}.vllm.log", plain=True)
                      for k in range(instances)]
        self.instances: list[Any] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> PlainVllmFleet:
        from dualpath.integrations.vllm.engines.instance import VllmInstance

        with self._stack as stack:
            for plan in self.plans:  # one at a time: the starts share the host's cores
                instance = VllmInstance.start(plan, self.config.vllm)
                stack.callback(instance.close)
                self.instances.append(instance)
            self._stack = stack.pop_all()
        self.model = self.instances[0].http.model_name()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def urls(self) -> list[str]:
        """Each instance's root URL, in instance order."""
        return [instance.url for instance in self.instances]

    def warm_up(self, warmup: list[list[AgentTurn]]) -> None:
        """The warm-up turns on every instance (each one's first forwards are slow once)."""
        for url in self.urls:
            replay_http(url, self.model, warmup, None, lambda: None, 300.0)

    def run(self, agents: list[list[AgentTurn]], progress: Any, timeout_s: float,
            pacing: Pacing | None = None) -> tuple[list[dict[str, Any]], float]:
        """Every agent to its last turn on its instance (paced by ``pacing``: its sessions'
        ids, tool times, agents at once); the records (each with its ``instance``) and the JCT.
        ``DualPathError`` naming the first failed turn."""
        began = time.monotonic()
        per_agent = asyncio.run(replay_sticky(self.urls, self.model, agents, progress,
                                              timeout_s, pacing))
        jct = time.monotonic() - began
        records = [{**http_record(r, began), "instance": sticky_instance(r.agent, len(self.urls))}
                   for recs in per_agent for r in recs]
        failed = [r for r in records if r["error"]]
        if failed:
            raise DualPathError(f"plain vLLM: {len(failed)} turns failed, first: "
                                f"{failed[0]['status']} {failed[0]['error']}")
        return records, jct


def plain_row(config: ClusterConfig, model_dir: Path, agents: list[list[AgentTurn]],
              warmup: list[list[AgentTurn]], primers: list[AgentTurn] | None,
              timeout_s: float, log_dir: Path, bar: Progress, instances: int,
              kv_cache_bytes: int, row: str = PLAIN_ROW) -> dict[str, Any]:
    """Plain vLLM offline on ``instances`` instances of ``kv_cache_bytes`` device KV each:
    warm-up, the agents' ``primers`` (untimed, agent i's on its instance: into the prefix
    caches, as our modes store them; None: none), then all agents at once; the row
    ``mode_figures`` reads, named ``row``."""
    config = replace(config, vllm=replace(config.vllm, kv_cache_bytes=kv_cache_bytes))
    task = bar.add_task(f"{row}: starting {instances} plain vLLM",
                        total=sum(map(len, agents)))
    with PlainVllmFleet(model_dir, config, instances, log_dir, row) as fleet:
        bar.update(task, description=f"{row}: warming up")
        fleet.warm_up(warmup)
        if primers is not None:
            fleet.run([[p] for p in primers], lambda: None, timeout_s)
        bar.update(task, description=f"{row}: offline")
        ticks = host_cpu_ticks()
        records, jct = fleet.run(agents, lambda: bar.advance(task), timeout_s)
        host_cpu = host_cpu_shares(ticks, host_cpu_ticks())
    bar.update(task, description=f"{row}: done")
    return {"mode": row, "jct_s": jct, "records": records, "router": {},
            "engine_busy_s": {}, "engine_loop_s": {}, "host_cpu": host_cpu,
            "nics": {"t_s": [], "nodes": {}},
            "config": {"plain_vllm": [list(p.command[1:]) for p in fleet.plans],
                       "instances": instances, "kv_cache_bytes_each": kv_cache_bytes}}
