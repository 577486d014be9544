"""What every simulator figure of :mod:`dualpath.sim.plots` draws with: the result dict's rows,
summary and numbers read leniently (a missing or odd value is None), matplotlib on the Agg
backend loaded on first use (importing this module loads neither matplotlib nor torch), grouped
bars with the paper's readings as black ``x`` markers, the log-y choice and the legend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dualpath.vocab import Rung

MODE_ORDER = tuple(r for r in Rung if r.reuses_kv)  # the ladder's order, as simulated
PAPER_MARKER: dict[str, Any] = {"marker": "x", "color": "black", "s": 45, "linewidths": 1.6,
                                "zorder": 4}
LOG_SPAN = 8.0  # auto log y when max / min of the plotted values exceeds this

Result = dict[str, Any]
Row = dict[str, Any]


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported here, not at module import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    """Lay out, write ``fig`` as PNG at ``path`` (parents created), close it; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    _pyplot().close(fig)
    return path


def _num(value: Any) -> float | None:
    """``value`` as a finite float, else None; a planner fraction dict gives its ``value``."""
    if isinstance(value, dict):
        value = value.get("value")
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _rows(result: Result) -> list[Row]:
    """The result's row dicts (none when ``rows`` is missing)."""
    return [r for r in result.get("rows") or [] if isinstance(r, dict)]


def _summary(result: Result) -> dict[str, Any]:
    """The result's summary dict (empty when missing)."""
    summary = result.get("summary")
    return summary if isinstance(summary, dict) else {}


def _modes(rows: list[Row]) -> list[str]:
    """Modes present in ``rows``: the known ones in paper order, then any others."""
    seen = list(dict.fromkeys(str(r.get("mode", "?")) for r in rows))
    known = [m for m in MODE_ORDER if m in seen]
    return known + [m for m in seen if m not in known]


def _agent_counts(rows: list[Row]) -> list[int]:
    """Sorted distinct agent counts of ``rows``."""
    return sorted({int(a) for r in rows if (a := _num(r.get("agents"))) is not None})


def _table(rows: list[Row], key: str) -> dict[tuple[str, int], float | None]:
    """``(mode, agents) -> row[key]`` (None where missing)."""
    out: dict[tuple[str, int], float | None] = {}
    for r in rows:
        agents = _num(r.get("agents"))
        if agents is not None:
            out[str(r.get("mode", "?")), int(agents)] = _num(r.get(key))
    return out


def _present(values: list[float | None]) -> list[float]:
    """The non-None values."""
    return [v for v in values if v is not None]


def _auto_log(ax: Any, values: list[float | None], log_y: bool | None = None) -> None:
    """Log y when asked, or (``log_y`` None) when positive values span more than LOG_SPAN×."""
    pos = [v for v in _present(values) if v > 0]
    if log_y is None:
        log_y = bool(pos) and max(pos) / min(pos) > LOG_SPAN
    if log_y and pos:
        ax.set_yscale("log")
        ax.set_ylim(min(pos) / 1.6, max(pos) * 1.6)


def _paper_points(ax: Any, xs: list[float], values: list[float | None], label: bool) -> bool:
    """Black ``x`` at each non-None paper value; True if anything was drawn."""
    pts = [(x, v) for x, v in zip(xs, values, strict=False) if v is not None]
    if not pts:
        return False
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], **PAPER_MARKER,
               label="paper" if label else "_nolegend_")
    return True


def _grouped_bars(ax: Any, groups: list[str], sim: dict[str, list[float | None]],
                  paper: dict[str, list[float | None]], fmt: str = "{:.0f}") -> None:
    """One simulated bar per series in each group (value written inside), paper ``x`` on it."""
    width = 0.8 / max(1, len(sim))
    paper_labelled = False
    for i, (name, values) in enumerate(sim.items()):
        xs = [g + (i - (len(sim) - 1) / 2) * width for g in range(len(groups))]
        heights = [math.nan if v is None else v for v in values]
        bars = ax.bar(xs, heights, width, label=f"{name} (sim)")
        ax.bar_label(bars, labels=["" if v is None else fmt.format(v) for v in values],
                     label_type="center", fontsize=7)
        drawn = _paper_points(ax, xs, paper.get(name, []), not paper_labelled)
        paper_labelled = paper_labelled or drawn
    ax.set_xticks(range(len(groups)), groups)


def _legend(ax: Any, **kwargs: Any) -> None:
    """A small legend, only when something carries a label."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kwargs)


def _ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or ``den`` is 0."""
    return None if num is None or not den else num / den


def _fmt_x(value: float | None) -> str:
    """A speedup or ratio as ``×1.84`` (``n/a`` when missing)."""
    return "n/a" if value is None else f"×{value:.2f}"
