"""``python -m dualpath.bench.soak`` (``make soak``): agents against ``dualpath serve`` for
minutes, watching every process's memory, the latencies and the errors.

It starts the real stack users run, ``dualpath serve`` (a subprocess: the router and the API,
plus its engine processes, 1 prefill + 2 decode by default; the KV store in a temporary
folder), then runs ``--agents`` concurrent agents until ``--duration-s`` is over. Each agent
replays multi-turn trajectories through streamed token-id completions
(:func:`dualpath.bench.agents.http.run_agent_http`): a first prompt of ``--first-tokens`` random
ids, then turns appending ``--append-tokens`` and generating ``--gen-tokens``, each prompt being
the context so far plus the new ids (so every later turn hits the store). A trajectory whose
next turn would pass ``--max-context-tokens`` ends and the agent starts a fresh one. No turn
starts after the deadline; the turns in flight then get ``--drain-s`` to finish, and those
still running are cut off (closed, so the server aborts them): counted apart, not as errors.

Every ``--sample-s`` the resident memory (RSS) of the serve process and of each of its child
processes is sampled. The report (JSON, default ``results/soak.json``, and a PNG beside it)
has per-window latency percentiles (TTFT, turn latency) and errors, the RSS samples, and a
``summary``: requests, errors, TTFT and latency percentiles, each process's RSS after the
warm-up (the first ``--warmup-fraction`` of the run) and at the end, its growth between the two
and the largest growth; ``ok`` when there was no error and no process grew more than
``--max-rss-growth``. The exit status is 1 when not ok.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import numpy as np
import psutil
from rich import box
from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dualpath.bench.agents.http import HttpTurnRecord, open_client, run_agent_http
from dualpath.errors import DualPathError
from dualpath.workloads.turns import AgentTurn

if TYPE_CHECKING:
    from argparse import ArgumentParser

PERCENTILES = (50, 90, 99)
ERROR_PAUSE_S = 1.0  # an agent whose turn failed waits this long before a fresh trajectory
STOP_TIMEOUT_S = 30.0  # SIGINT to exit before the server is killed
MB = 1 << 20


class SoakError(DualPathError):
    """The soak could not run (the server did not start, or died)."""


@dataclass(frozen=True)
class SoakSettings:
    """What one soak run does."""

    agents: int = 100
    duration_s: float = 600.0
    model: str | None = None  # None: the default model
    json_path: str = "results/soak.json"
    prefill: int = 1
    decode: int = 2
    first_tokens: int = 256
    append_tokens: int = 64
    gen_tokens: int = 16
    max_context_tokens: int = 2048
    sample_s: float = 5.0
    warmup_fraction: float = 0.2
    max_rss_growth: float = 0.10
    drain_s: float = 60.0
    startup_timeout_s: float = 300.0
    seed: int = 0
    serve_sets: tuple[str, ...] = ()  # KEY=VALUE overrides passed to `dualpath serve --set`

    def __post_init__(self) -> None:
        if self.agents < 1 or self.duration_s <= 0 or self.sample_s <= 0:
            raise ValueError("agents, duration and sample interval must be positive")
        if min(self.first_tokens, self.append_tokens, self.gen_tokens) < 1:
            raise ValueError("first, append and gen token counts must be >= 1")
        if self.first_tokens + self.gen_tokens > self.max_context_tokens:
            raise ValueError("the first turn alone exceeds --max-context-tokens")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("--warmup-fraction must be in [0, 1)")


# -- the server ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServeProcess:
    """A running ``dualpath serve`` subprocess."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def engine_log_dir(self) -> str | None:
        """Where it wrote the engines' logs (the path it prints when ready)."""
        for line in self.log_tail(20_000).splitlines():
            if "logs and resolved config:" in line:
                return line.split("logs and resolved config:", 1)[1].strip()
        return None


def serve_command(settings: SoakSettings, port: int, storage: Path) -> list[str]:
    """The ``dualpath serve`` command line of a soak."""
    cmd = [sys.executable, "-m", "dualpath.cli", "serve", "--port", str(port),
           "--prefill", str(settings.prefill), "--decode", str(settings.decode),
           "--storage", str(storage)]
    if settings.model:
        cmd += ["--model", settings.model]
    for item in settings.serve_sets:
        cmd += ["--set", item]
    return cmd


def start_server(settings: SoakSettings, work: Path, attempts: int = 3) -> ServeProcess:
    """Start ``dualpath serve`` and wait until ``/health`` answers 200 (another port when the
    probed one was taken meanwhile)."""
    for attempt in range(attempts):
        port = _free_port()
        log_path = work / f"serve-{attempt}.log"
        with log_path.open("w") as out:
            proc = subprocess.Popen(serve_command(settings, port, work / "kv"), stdout=out,
                                    stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        server = ServeProcess(proc, f"http://127.0.0.1:{port}", log_path)
        if _wait_ready(server, settings.startup_timeout_s):
            return server
    raise SoakError(f"no free port for dualpath serve in {attempts} tries")


def _wait_ready(server: ServeProcess, timeout_s: float) -> bool:
    """True once healthy; False if its port was taken; SoakError if it failed otherwise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            if "address already in use" in server.log_tail().lower():
                return False
            raise SoakError(f"dualpath serve exited with {server.proc.returncode}:\n"
                            f"{server.log_tail()}")
        try:
            if httpx2.get(f"{server.base_url}/health", timeout=2,
                          trust_env=False).status_code == 200:
                return True
        except httpx2.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise SoakError(f"dualpath serve not ready within {timeout_s:g} s:\n{server.log_tail()}")


def served_model(server: ServeProcess) -> str:
    """The model name the server serves (``/v1/models``)."""
    reply = httpx2.get(f"{server.base_url}/v1/models", timeout=30, trust_env=False)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def stop_server(server: ServeProcess) -> int | None:
    """SIGINT (the server stops its engines), then kill it and any engine left; its exit code."""
    children = _children(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    _, alive = psutil.wait_procs(children, timeout=5)
    for proc in alive:
        proc.kill()
    return server.proc.returncode


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


# -- memory -------------------------------------------------------------------------------------


def _label(proc: psutil.Process) -> str:
    """An engine's ``--name`` (pe0, de1 …), else the process name and pid."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        cmd = []
    if "--name" in cmd[:-1]:
        return cmd[cmd.index("--name") + 1]
    try:
        return f"{proc.name()}-{proc.pid}"
    except psutil.Error:
        return f"pid-{proc.pid}"


def tree_rss_mb(pid: int) -> dict[str, float]:
    """RSS (MB) of process ``pid`` (as ``serve``) and each of its descendants, by label."""
    rss: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        rss["serve"] = root.memory_info().rss / MB
    except psutil.Error:
        return rss
    for child in _children(pid):
        try:
            rss[_label(child)] = child.memory_info().rss / MB
        except psutil.Error:
            continue  # gone meanwhile
    return rss


# -- the agents ---------------------------------------------------------------------------------


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


# -- the report ---------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90 and p99 of ``values`` (None when empty)."""
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    points = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, points, strict=True)}


def windows(records: list[HttpTurnRecord], start_s: float, width_s: float) -> list[dict]:
    """Per ``width_s`` window of turn ends: turns, errors, TTFT and latency percentiles."""
    by_window: dict[int, list[HttpTurnRecord]] = {}
    for record in records:
        by_window.setdefault(int((record.finished_s - start_s) // width_s), []).append(record)
    rows = []
    for index in sorted(by_window):
        group = by_window[index]
        served = [r for r in group if r.ok]
        rows.append({"t_s": (index + 1) * width_s, "turns": len(group),
                     "errors": sum(not r.ok and not r.cut_off for r in group),
                     "ttft_s": percentiles([r.ttft_s for r in served if r.ttft_s is not None]),
                     "latency_s": percentiles([r.latency_s for r in served
                                               if r.latency_s is not None])})
    return rows


def _sample_at(samples: list[dict[str, Any]], t_s: float) -> dict[str, float]:
    """The RSS of the first sample at or after ``t_s`` (else the last)."""
    return next((s for s in samples if s["t_s"] >= t_s), samples[-1])["rss_mb"]


def rss_summary(samples: list[dict[str, Any]], warm_s: float) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first sample after the warm-up and at the last sample, the
    growth between the two (a fraction), and the growth over the second half of that span
    (``growth_last_half``: a leak keeps growing there; memory touched for the first time, such
    as an engine's preallocated host pool filling up to its high-water mark, levels off)."""
    if not samples:
        return {}
    warm = _sample_at(samples, warm_s)
    middle = _sample_at(samples, (warm_s + samples[-1]["t_s"]) / 2)
    end = samples[-1]["rss_mb"]
    return {name: {"after_warmup_mb": warm[name], "end_mb": end[name],
                   "growth": (end[name] - warm[name]) / warm[name],
                   "growth_last_half": (end[name] - middle[name]) / middle[name]}
            for name in warm if name in end and name in middle and warm[name] > 0}


def summarize(log: RunLog, settings: SoakSettings) -> dict[str, Any]:
    """The top-level summary of a run."""
    served = [r for r in log.records if r.ok]
    memory = rss_summary(log.rss, settings.warmup_fraction * settings.duration_s)
    growth = {name: m["growth"] for name, m in memory.items()}
    max_growth = max(growth.values(), default=None)
    errors = log.errors() + (log.serve_exit is not None)
    ttft = percentiles([r.ttft_s for r in served if r.ttft_s is not None])
    latency = percentiles([r.latency_s for r in served if r.latency_s is not None])
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens or 0 for r in served)
    return {
        "ok": errors == 0 and max_growth is not None and max_growth <= settings.max_rss_growth,
        "errors": errors, "requests": len(log.records), "served": len(served),
        "cut_off_at_end": sum(r.cut_off for r in log.records),
        "agents": settings.agents, "duration_s": settings.duration_s,
        "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
        "latency_p50_s": latency["p50"], "latency_p99_s": latency["p99"],
        "tpot_p50_s": percentiles([r.tpot_s for r in served if r.tpot_s is not None])["p50"],
        "generated_tokens": sum(r.generated_tokens for r in served),
        "cached_fraction": cached / prompt if prompt else None,
        "rss_after_warmup_mb": {n: m["after_warmup_mb"] for n, m in memory.items()},
        "rss_end_mb": {n: m["end_mb"] for n, m in memory.items()},
        "rss_growth_after_warmup": growth,
        "rss_growth_last_half": {n: m["growth_last_half"] for n, m in memory.items()},
        "max_rss_growth_after_warmup": max_growth,
        "max_rss_growth_allowed": settings.max_rss_growth,
        "serve_exit_during_run": log.serve_exit,
    }


def build_report(log: RunLog, settings: SoakSettings, server: ServeProcess,
                 model: str) -> dict[str, Any]:
    """The whole JSON report."""
    from dualpath.bench.report import machine_profile

    messages = Counter(f"{r.status}: {r.error}" for r in log.records
                       if not r.ok and not r.cut_off)
    return {"benchmark": "soak", "machine": machine_profile(), "model": model,
            "settings": asdict(settings), "serve_logs": server.engine_log_dir(),
            "windows": windows(log.records, log.start_s, settings.sample_s),
            "rss_samples": log.rss,
            "error_messages": [{"message": m, "count": c} for m, c in messages.most_common(20)],
            "summary": summarize(log, settings)}


def plot_soak(path: Path, report: dict[str, Any]) -> Path:
    """Latency percentiles per window (top) and each process's RSS (bottom) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    rows = report["windows"]
    xs = [r["t_s"] for r in rows]
    for metric, q, style in (("ttft_s", "p50", "-"), ("ttft_s", "p90", "--"),
                             ("ttft_s", "p99", ":"), ("latency_s", "p50", "-"),
                             ("latency_s", "p99", ":")):
        color = "tab:blue" if metric == "ttft_s" else "tab:orange"
        ys = [r[metric][q] if r[metric][q] is not None else float("nan") for r in rows]
        lat.plot(xs, ys, style, color=color, label=f"{metric[:-2]} {q}")
    lat.set_ylabel("seconds")
    lat.set_title(f"soak: {report['settings']['agents']} agents — TTFT and turn latency "
                  f"per {report['settings']['sample_s']:g} s window", fontsize=9)
    lat.legend(fontsize=7, ncol=2)
    samples = report["rss_samples"]
    for name in sorted({n for s in samples for n in s["rss_mb"]}):
        points = [(s["t_s"], s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        mem.plot([p[0] for p in points], [p[1] for p in points], label=name)
    warm = report["settings"]["warmup_fraction"] * report["settings"]["duration_s"]
    mem.axvline(warm, color="grey", linestyle="--", linewidth=1, label="end of warm-up")
    mem.set_xlabel("time since the agents started (s)")
    mem.set_ylabel("RSS (MB)")
    mem.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def render_summary(summary: dict[str, Any]) -> Group:
    """The summary as two tables: the run's figures, then each process's RSS."""
    figures = Table(box=box.SIMPLE, title="dualpath soak", title_justify="left",
                    show_header=False)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    figures.add_row("turns (requests)", str(summary["requests"]))
    figures.add_row("errors", str(summary["errors"]))
    figures.add_row("cut off at the end (no error)", str(summary["cut_off_at_end"]))
    figures.add_row("TTFT p50 / p99", f"{_seconds(summary['ttft_p50_s'])} / "
                                      f"{_seconds(summary['ttft_p99_s'])}")
    figures.add_row("turn latency p50 / p99", f"{_seconds(summary['latency_p50_s'])} / "
                                              f"{_seconds(summary['latency_p99_s'])}")
    figures.add_row("TPOT p50", _seconds(summary["tpot_p50_s"]))
    memory = Table(box=box.SIMPLE_HEAD)
    for name in ("process", "RSS after warm-up", "RSS at the end", "growth",
                 "growth, last half"):
        memory.add_column(name, justify="left" if name == "process" else "right")
    for name, warm in summary["rss_after_warmup_mb"].items():
        memory.add_row(name, f"{warm:.0f} MB", f"{summary['rss_end_mb'][name]:.0f} MB",
                       f"{100 * summary['rss_growth_after_warmup'][name]:+.1f}%",
                       f"{100 * summary['rss_growth_last_half'][name]:+.1f}%")
    verdict = "[green]ok[/green]" if summary["ok"] else "[red]NOT ok[/red]"
    memory.caption = (f"{verdict}: no error and no process's RSS grew more than "
                      f"{100 * summary['max_rss_growth_allowed']:.0f}% after the warm-up")
    memory.caption_justify = "left"
    return Group(figures, memory)


# -- the command --------------------------------------------------------------------------------


def _tick_text(log: RunLog) -> str:
    served = [r.ttft_s for r in log.records[-200:] if r.ok and r.ttft_s is not None]
    p50 = percentiles(served)["p50"]
    ttft = "-" if p50 is None else f"{p50:.2f} s"
    return f"soak: {len(log.records)} turns, {log.errors()} errors, recent TTFT p50 {ttft}"


def run_soak(settings: SoakSettings, console: Console | None = None) -> dict[str, Any]:
    """Start the server, run the load, stop the server; the report (also written to
    ``settings.json_path`` and a PNG beside it)."""
    from dualpath.bench.report import write_json
    from dualpath.model.default_model import resolve_model
    from dualpath.model.spec import load_spec

    console = console or Console()
    vocab = load_spec(resolve_model(settings.model)).vocab_size
    work = Path(tempfile.mkdtemp(prefix="dualpath-soak-"))
    try:
        console.print("soak: starting dualpath serve ...")
        server = start_server(settings, work)
        try:
            model = served_model(server)
            log = _run_with_progress(server, model, settings, vocab, console)
        finally:
            exit_code = stop_server(server)
        report = build_report(log, settings, server, model)
        report["serve_exit_code"] = exit_code
        if not report["summary"]["ok"]:
            report["serve_output_tail"] = server.log_tail()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = write_json(settings.json_path, report)
    plot_soak(path.with_suffix(".png"), report)
    console.print(render_summary(report["summary"]))
    console.print(f"soak: {path} and {path.with_suffix('.png')}")
    return report


def _run_with_progress(server: ServeProcess, model: str, settings: SoakSettings, vocab: int,
                       console: Console) -> RunLog:
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("soak", total=settings.duration_s)

        def tick(log: RunLog) -> None:
            bar.update(task, completed=min(settings.duration_s, time.monotonic() - log.start_s),
                       description=_tick_text(log))

        return asyncio.run(run_load(server, model, settings, vocab, tick))


def add_arguments(p: ArgumentParser) -> None:
    """The options: fields of :class:`SoakSettings`."""
    d = SoakSettings()
    p.add_argument("--agents", type=int, default=d.agents, help="concurrent agents (100)")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="run length (600)")
    p.add_argument("--json", dest="json_path", default=d.json_path,
                   help="report path (PNG beside it)")
    p.add_argument("--model", default=d.model, help="HF model folder (default: SmolLM2)")
    p.add_argument("--prefill", type=int, default=d.prefill, help="prefill engines (1)")
    p.add_argument("--decode", type=int, default=d.decode, help="decode engines (2)")
    p.add_argument("--first-tokens", type=int, default=d.first_tokens)
    p.add_argument("--append-tokens", type=int, default=d.append_tokens)
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens)
    p.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens,
                   help="a trajectory ends before its context would pass this")
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="RSS and window period")
    p.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction)
    p.add_argument("--max-rss-growth", type=float, default=d.max_rss_growth,
                   help="largest RSS growth after the warm-up that is ok (a fraction)")
    p.add_argument("--drain-s", type=float, default=d.drain_s,
                   help="how long turns in flight at the end may take to finish")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--set", dest="serve_sets", action="append", default=[],
                   metavar="KEY=VALUE", help="passed to dualpath serve --set (repeatable)")


def run(options: SoakSettings) -> int:
    """Run a soak; 0 when ok, 1 when not, 2 when it could not run."""
    console = Console()
    try:
        report = run_soak(options, console)
    except (DualPathError, ValueError) as exc:
        console.print(f"[red]soak: {exc}[/red]")
        return 2
    return 0 if report["summary"]["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m dualpath.bench.soak`` is ``dualpath bench soak``."""
    from dualpath.cli import main as cli_main

    return cli_main(["bench", "soak", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
