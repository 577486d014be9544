"""The PNG of ``dualpath bench layerwise``: one panel per part that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_layerwise(path: str | Path, result: dict[str, Any]) -> Path:
    """(a) largest prefill per mode, (b) TPOT quiet vs loaded per lane setting, (c) JCT and
    read bytes per node with split reads off and on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = result["parts"]
    panels = [p for p in ("a", "b", "c") if p in parts]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4))
    axes = axes if len(panels) > 1 else [axes]
    for ax, part in zip(axes, panels, strict=False):
        {"a": _plot_batch, "b": _plot_lanes, "c": _plot_split}[part](ax, parts[part])
    fig.suptitle(f"dualpath bench layerwise — {result['machine']['cpu_model']}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax: Any, names: list[str], values: list[float], color: str, fmt: str,
          ylabel: str, title: str) -> None:
    """Two labelled bars: the baseline in grey, the mechanism in ``color``."""
    bars = ax.bar(names, values, color=["grey", color])
    ax.bar_label(bars, fmt=fmt)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


def _plot_batch(ax: Any, rows: dict[str, Any]) -> None:
    modes = ["basic", "layerwise"]
    _bars(ax, modes, [rows[m]["max_hit_tokens"] for m in modes], "tab:blue", "%d",
          "hit tokens", "(a) largest prefill, same device-KV budget")


def _plot_lanes(ax: Any, rows: dict[str, Any]) -> None:
    names, width = ["lanes", "fifo"], 0.38
    for i, phase in enumerate(("quiet", "loaded")):
        xs = [k + (i - 0.5) * width for k in range(len(names))]
        values = [1000 * rows[n][phase]["tpot_s"] for n in names]
        bars = ax.bar(xs, values, width, label=f"{phase} (no KV traffic)" if phase == "quiet"
                      else "heavy KV traffic")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(names)), ["99:1 lanes", "one FIFO lane"])
    ax.set_ylabel("decode TPOT (ms)")
    ax.set_title("(b) TPOT with the EP generator on", fontsize=9)
    ax.legend(fontsize=8)


def _plot_split(ax: Any, rows: dict[str, Any]) -> None:
    names = ["split_off", "split_on"]
    _bars(ax, names, [rows[n]["jct_s"] for n in names], "tab:green", "%.1f s", "JCT (s)",
          "(c) split reads: JCT")
    notes = [f"{n}: " + ", ".join(f"node {k} {v / 1e6:.0f} MB"
                                  for k, v in sorted(rows[n]["read_bytes_per_node"].items()))
             for n in names]
    ax.text(0.02, -0.25, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="top")
