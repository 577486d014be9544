"""The PNG of ``dualpath bench agents``: JCT per mode; APS vs TTFT (online); each node's
storage-NIC read rate over time in ``basic`` and ``dualpath``; the TTFT breakdown per mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PARTS = (("queue_s", "queue"), ("read_s", "storage read"), ("prefill_s", "prefill"),
         ("other_s", "other"))


def _jct(ax: Any, result: dict[str, Any]) -> None:
    jct = result["summary"]["jct_s"]
    bars = ax.bar(list(jct), list(jct.values()), color="tab:blue")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("JCT (s)")
    ax.set_title("Offline JCT per mode")
    ax.tick_params(axis="x", labelsize=8)


def _online(ax: Any, result: dict[str, Any]) -> None:
    for o in result["online"]:
        trials = sorted(o["trials"], key=lambda t: t["aps"])
        ax.plot([t["aps"] for t in trials], [t["ttft_s"] for t in trials], "o-",
                label=o["mode"])
    slo = result["summary"].get("ttft_slo_s")
    if slo:
        ax.axhline(slo, color="gray", ls="--", lw=1, label=f"SLO {slo:g} s")
    ax.set_xlabel("agents per second")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Online: TTFT vs APS")
    ax.legend(fontsize=8)


def _snic(ax: Any, result: dict[str, Any]) -> None:
    styles = {"basic": "--", "dualpath": "-"}
    for row in result["offline"]:
        if row["mode"] not in styles:
            continue
        nics = row["nics"]
        for node, series in nics["nodes"].items():
            ax.plot(nics["t_s"], series["snic_mb_s"], styles[row["mode"]], lw=1,
                    label=f"{row['mode']} node {node} ({series['role'][:1].upper()}E)")
    ax.axhline(result["caps_mb_s"]["read"], color="gray", lw=1, ls=":", label="cap")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("storage NIC read (MB/s)")
    ax.set_title("Storage NIC per node over time")
    ax.legend(fontsize=7)


def _breakdown(ax: Any, result: dict[str, Any]) -> None:
    modes = [m for m, f in result["modes"].items() if f["ttft_breakdown_s"]]
    bottom = [0.0] * len(modes)
    for key, label in PARTS:
        values = [result["modes"][m]["ttft_breakdown_s"][key] or 0.0 for m in modes]
        ax.bar(modes, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("Where the TTFT goes")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)


def plot_agents(result: dict[str, Any], path: str | Path) -> Path:
    """Four panels (those without data left empty with a note); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = ((_jct, bool(result["modes"])), (_online, bool(result["online"])),
              (_snic, bool(result["offline"])),
              (_breakdown, any(f["ttft_breakdown_s"] for f in result["modes"].values())))
    for ax, (draw, has_data) in zip(axes.flat, panels, strict=True):
        if has_data:
            draw(ax, result)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center")
            ax.set_axis_off()
    m = result["machine"]
    fig.suptitle(f"dualpath bench agents: {result['workload']['name']}, {result['model']}, "
                 f"{m['cpu_model']} ({m['cpus']} cores)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
