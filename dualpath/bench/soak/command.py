"""``dualpath bench soak``: start the server, run the load, stop the server, write and print
the report; the command's arguments and exit status (see :mod:`dualpath.bench.soak`)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dualpath.bench.soak.load import RunLog, run_load
from dualpath.bench.soak.report import build_report, percentiles, plot_soak, render_summary
from dualpath.bench.soak.server import ServeProcess, served_model, start_server, stop_server
from dualpath.bench.soak.settings import SoakSettings
from dualpath.errors import DualPathError

if TYPE_CHECKING:
    from argparse import ArgumentParser


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

