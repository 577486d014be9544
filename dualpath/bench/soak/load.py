"""The soak's load: ``--agents`` concurrent agents replaying random multi-turn trajectories
against the server until the deadline, and the RSS sampler beside them (:class:`RunLog`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx2

from dualpath.bench.agents.http import HttpTurnRecord, open_client, run_agent_http
from dualpath.bench.soak.server import ServeProcess, tree_rss_mb
from dualpath.bench.soak.settings import SoakSettings
from dualpath.workloads.turns import AgentTurn

ERROR_PAUSE_S = 1.0  # an agent whose turn failed waits this long before a fresh trajectory


def trajectory(rng: random.Random, settings: SoakSettings, vocab: int) -> list[AgentTurn]:
    """One fresh agent trajectory of random ids: the first turn, then appended turns while
    the prompt plus its generation fits ``max_context_tokens``."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 1) for _ in range(n)]

    step = settings.append_tokens + settings.gen_tokens
    room = settings.max_context_tokens - settings.first_tokens - settings.gen_tokens
    later = room // step
    return [AgentTurn(ids(settings.first_tokens), settings.gen_tokens),
            *(AgentTurn(ids(settings.append_tokens), settings.gen_tokens)
              for _ in range(later))]


@dataclass
class RunLog:
    """What a soak saw: every turn, and the RSS samples (``t_s`` from the start)."""

    start_s: float  # time.monotonic() at the start of the agents
    records: list[HttpTurnRecord] = field(default_factory=list)
    rss: list[dict[str, Any]] = field(default_factory=list)
    serve_exit: int | None = None  # the server's exit code if it died during the run

    def errors(self) -> int:
        """Turns that failed (a turn cut off at the end of the run is no error)."""
        return sum(not r.ok and not r.cut_off for r in self.records)


async def _agent(client: httpx2.AsyncClient, index: int, model: str, settings: SoakSettings,
                 vocab: int, log: RunLog, stop_s: float, deadline_s: float) -> None:
    """One agent: trajectory after trajectory until ``stop_s``."""
    rng = random.Random(settings.seed * 1_000_003 + index)
    turn = 0
    while time.monotonic() < stop_s:
        records, _ = await run_agent_http(
            client, trajectory(rng, settings, vocab), model=model, agent=index,
            first_turn=turn, progress=log.records.append, stop_s=stop_s,
            deadline_s=deadline_s)
        turn += len(records)
        if records and not records[-1].ok:
            await asyncio.sleep(ERROR_PAUSE_S)


async def _sample(server: ServeProcess, settings: SoakSettings, log: RunLog,
                  agents: asyncio.Future, tick: Callable[[RunLog], None]) -> None:
    """Sample RSS every ``sample_s`` until the agents are done; stop them if the server died."""
    while not agents.done():
        log.rss.append({"t_s": time.monotonic() - log.start_s,
                        "rss_mb": tree_rss_mb(server.proc.pid)})
        if server.proc.poll() is not None:
            log.serve_exit = server.proc.returncode
            agents.cancel()
            return
        tick(log)
        await asyncio.wait([agents], timeout=settings.sample_s)
    log.rss.append({"t_s": time.monotonic() - log.start_s,
                    "rss_mb": tree_rss_mb(server.proc.pid)})


async def run_load(server: ServeProcess, model: str, settings: SoakSettings, vocab: int,
                   tick: Callable[[RunLog], None] = lambda _: None) -> RunLog:
    """Run the agents and the sampler; everything the run saw."""
    log = RunLog(time.monotonic())
    stop = log.start_s + settings.duration_s
    deadline = stop + settings.drain_s
    async with open_client(server.base_url, timeout_s=settings.duration_s + settings.drain_s,
                           connections=settings.agents) as client:
        agents = asyncio.gather(*(_agent(client, i, model, settings, vocab, log, stop, deadline)
                                  for i in range(settings.agents)))
        await _sample(server, settings, log, agents, tick)
        try:
            await agents
        except asyncio.CancelledError:
            if log.serve_exit is None:
                raise
    return log

