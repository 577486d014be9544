"""The report of ``dualpath bench sessions`` (``bench/sessions.py``): a table per experiment,
the comparisons, and the JSON with a PNG of hit rate, JCT and TTFT p50 per row beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_report(result: dict[str, Any], console: Console) -> None:
    """Each experiment's rows as a table, then the comparisons."""
    regime = result["summary"]["regime"]
    if regime.get("line"):
        console.print(f"regime ({regime['of_row']} row): {regime['line']}")
    titles = {"warm": "unbounded store: sessions unknown (cold), DRAM copies and prefetch "
                      "(warm), and short turns prefilled on their decode engine (local)",
              "api": "through the OpenAI API: dualpath serve and plain vllm serve",
              "retention": f"store at {regime['store_fraction']:.0%} of the working set",
              "online": "online: Poisson arrivals, the best trial at the TTFT SLO"}
    for experiment, title in titles.items():
        rows = [r for r in result["rows"].values() if r["experiment"] == experiment]
        if not rows:
            continue
        table = Table(title=title)
        for col in ("row", "hit rate", "JCT (s)", "TTFT p50 (s)", "p90",
                    *EXTRA_COLUMNS[experiment]):
            table.add_column(col)
        for row in rows:
            table.add_row(row["row"], f"{row['hit_rate']:.1%}", f"{row['jct_s']:.1f}",
                          f"{row['ttft_p50_s']:.2f}", f"{row['ttft_p90_s']:.2f}",
                          *extra_cells(experiment, row))
        console.print(table)
    s = result["summary"]
    if "ttft_p50_reduction" in s:
        console.print(f"warm vs cold: TTFT p50 {s['ttft_p50_reduction']:.0%} lower, JCT "
                      f"{s['jct_speedup_warm']:.2f}x, {s['warm_hit_share']:.0%} of hits from DRAM")
    if "ttft_p50_reduction_local" in s:
        console.print(f"local vs cold: TTFT p50 {s['ttft_p50_reduction_local']:.0%} lower, JCT "
                      f"{s['jct_speedup_local']:.2f}x, {s['local_share']:.0%} of turns "
                      "prefilled on their decode engine")
    if "api_ttft_p50_ratio" in s:
        console.print(f"API: dualpath's TTFT p50 {s['api_ttft_p50_ratio']:.2f}x vLLM's, JCT "
                      f"{s['api_jct_speedup_vs_vllm']:.2f}x faster, {s['api_errors']} errors")
    if s.get("aps_speedup_local") is not None:
        console.print(f"online: APS at the TTFT SLO ({s['ttft_slo_s']:g} s) "
                      f"{s['aps_capacity_cold']:.3f} sessions unknown, "
                      f"{s['aps_capacity_local']:.3f} with the defaults "
                      f"({s['aps_speedup_local']:.2f}x)")
    if "hit_rate_gain_points" in s:
        console.print(f"sessions vs recency: hit rate {s['hit_rate_gain_points']:+.1f} points, "
                      f"JCT {s['jct_speedup_sessions']:.2f}x")
    if "hit_rate_gain_points_hints" in s:
        console.print(f"sessions with hinted returns vs recency: hit rate "
                      f"{s['hit_rate_gain_points_hints']:+.1f} points, "
                      f"JCT {s['jct_speedup_hints']:.2f}x")


# each experiment's own columns: where the hit came from and where turns were prefilled; the
# API's errors; what eviction took
EXTRA_COLUMNS = {"warm": ("from DRAM", "on its DE", "prefetched"),
                 "api": ("on its DE", "errors"),
                 "retention": ("evicted", "live", "ended", "live before ended"),
                 "online": ("APS at the SLO", "trials", "on its DE")}


def extra_cells(experiment: str, row: dict[str, Any]) -> tuple[str, ...]:
    """A row's cells under ``EXTRA_COLUMNS[experiment]``."""
    if experiment == "warm":
        return (f"{row['warm_hit_share']:.0%}", f"{row.get('local_share', 0):.0%}",
                f"{row.get('prefetch_turn_share', 0):.0%}")
    if experiment == "api":
        return f"{row.get('local_share', 0):.0%}", str(row.get("errors", 0))
    if experiment == "online":
        trials = ", ".join(f"{t['aps']:.2f}{'+' if t['meets_slo'] else '-'}"
                           for t in row["trials"])
        aps = row["capacity_aps"]
        return (f"{aps:.3f}" if aps is not None else "below the lowest", trials,
                f"{row.get('local_share', 0):.0%}")
    e = row["evicted"]
    return (str(e["blocks_evicted"]), str(e["live_blocks_evicted"]),
            str(e["ended_blocks_evicted"]), str(e["live_evicted_before_ended"]))


def write_report(result: dict[str, Any], path: Path, console: Console) -> None:
    """The JSON and, beside it, a PNG of hit rate, JCT and TTFT p50 per row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    colors = ["#999" if r["row"] in ("cold", "recency", "vllm-api", "cold-online") else "#2a7"
              for r in rows.values()]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label, scale in ((axes[0], "hit_rate", "hit rate (%)", 100),
                                  (axes[1], "jct_s", "JCT (s)", 1),
                                  (axes[2], "ttft_p50_s", "TTFT p50 (s)", 1)):
        ax.bar(list(rows), [rows[p][key] * scale for p in rows], color=colors)
        ax.set_title(label)
    fig.suptitle("agent sessions: DRAM copies (cold, warm) and eviction at "
                 f"{result['summary']['regime']['store_fraction']:.0%} of the working set "
                 "(recency, sessions, hints)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)
    console.print(f"wrote {path} and {path.with_suffix('.png')}")
