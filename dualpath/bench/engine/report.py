"""``bench engine``'s summary ratios and its chart (medians with min-max bars)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def ratios(measured: dict[str, Any], peers: list[str], batches: list[str]) -> dict[str, float]:
    """dualpath's median over each peer's: ``prefill_ratio_vs_P``, ``decode_ratio_vs_P_bN``;
    and every system's ``cores_busy_S`` and median ``rss_mb_S``."""
    ours = measured["dualpath"]
    summary: dict[str, float] = {}
    for peer in peers:
        theirs = measured[peer]
        summary[f"prefill_ratio_vs_{peer}"] = (ours["prefill_tok_s"]["median"]
                                               / theirs["prefill_tok_s"]["median"])
        for b in batches:
            summary[f"decode_ratio_vs_{peer}_b{b}"] = (ours["decode_tok_s"][b]["median"]
                                                       / theirs["decode_tok_s"][b]["median"])
    for name, m in measured.items():
        summary[f"cores_busy_{name}"] = m["cores_busy"]
        summary[f"rss_mb_{name}"] = m["rss_mb"]["median"]
    return summary


def render_plot(path: Path, result: dict[str, Any]) -> Path:
    """Grouped bars per figure, one per system: the median, whiskers at min and max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["setup"]["decode_batches"]
    labels = ["prefill"] + [f"decode b{b}" for b in batches]
    systems = result["measured"]
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels), 3.8))
    for ax, label, i in zip(axes, labels, range(len(labels)), strict=True):
        stats = [m["prefill_tok_s"] if i == 0 else m["decode_tok_s"][str(batches[i - 1])]
                 for m in systems.values()]
        med = [s["median"] for s in stats]
        err = [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
        bars = ax.bar(range(len(stats)), med, yerr=err, capsize=3,
                      color=[f"C{k}" for k in range(len(stats))])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(stats)), list(systems), fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0].set_ylabel("tokens/s")
    m = result["machine"]
    fig.suptitle(f"{result['model']} {result['dtype']}, one compute thread each; "
                 f"{m['cpu_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
