"""The soak's report: per-window latency percentiles, the RSS growth after the warm-up, the
summary and its verdict, the PNG and the summary tables printed at the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table

from dualpath.bench.agents.http import HttpTurnRecord
from dualpath.bench.soak.load import RunLog
from dualpath.bench.soak.server import ServeProcess
from dualpath.bench.soak.settings import SoakSettings

PERCENTILES = (50, 90, 99)


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

