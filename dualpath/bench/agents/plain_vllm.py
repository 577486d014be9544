"""Plain vLLM beside the ladder of ``bench agents --engine vllm``: one ``vllm serve`` (the
peers' environment) with its own prefix cache and no storage tier, fed the very same agent
turns through its OpenAI API (``bench/agents/http.py``). What a team running vLLM today gets;
its row is ``vllm`` and it moves no KV, so it also calibrates the storage cap when none is
given (as the oracle does for our engines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.progress import Progress

from dualpath.bench.agents.run import replay_http
from dualpath.bench.report import host_cpu_shares, host_cpu_ticks
from dualpath.config import ClusterConfig
from dualpath.workloads.turns import AgentTurn

PLAIN_ROW = "vllm"


class PlainVllmRun:
    """One plain vLLM instance, driven like ``HttpRun``."""

    def __init__(self, model_dir: Path, config: ClusterConfig, log_dir: Path) -> None:
        from dualpath.integrations.vllm_instance import launch_plan
        from dualpath.vocab import Role

        self.config = config
        self.plan = launch_plan(model_dir, config, Role.DECODE, "127.0.0.1", name="plain",
                                log_path=log_dir / "plain.vllm.log", plain=True)
        self.instance: Any = None

    def __enter__(self) -> PlainVllmRun:
        from dualpath.integrations.vllm_instance import VllmInstance

        self.instance = VllmInstance.start(self.plan, self.config.vllm)
        self.model = self.instance.http.model_name()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.instance is not None:
            self.instance.close()

    def run(self, agents: list[list[AgentTurn]], progress: Any,
            timeout_s: float) -> tuple[list[dict[str, Any]], float]:
        """Every agent to its last turn through the API; the records and the JCT."""
        return replay_http(self.instance.url, self.model, agents, None, progress, timeout_s)


def plain_row(config: ClusterConfig, model_dir: Path, agents: list[list[AgentTurn]],
              warmup: list[list[AgentTurn]], prime_first_turns: bool, timeout_s: float,
              log_dir: Path, bar: Progress) -> dict[str, Any]:
    """Plain vLLM offline: warm-up, the first prompts (untimed: into its prefix cache, as our
    modes store them), then all agents at once; the row ``mode_figures`` reads."""
    task = bar.add_task(f"{PLAIN_ROW}: starting", total=sum(map(len, agents)))
    with PlainVllmRun(model_dir, config, log_dir) as run:
        bar.update(task, description=f"{PLAIN_ROW}: warming up")
        run.run(warmup, lambda: None, 300.0)
        if prime_first_turns:
            run.run([a[:1] for a in agents], lambda: None, timeout_s)
        bar.update(task, description=f"{PLAIN_ROW}: offline")
        ticks = host_cpu_ticks()
        records, jct = run.run(agents, lambda: bar.advance(task), timeout_s)
        host_cpu = host_cpu_shares(ticks, host_cpu_ticks())
    bar.update(task, description=f"{PLAIN_ROW}: done")
    return {"mode": PLAIN_ROW, "jct_s": jct, "records": records, "router": {},
            "engine_busy_s": {}, "engine_loop_s": {}, "host_cpu": host_cpu,
            "nics": {"t_s": [], "nodes": {}},
            "config": {"plain_vllm": list(run.plan.command[1:])}}
