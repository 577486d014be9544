"""PNG figures for the simulator's results: the presets (Fig. 7, ablation, scale, online) and plans.

Each figure draws the simulated values and, where the result carries them, the paper's
readings as black ``x`` markers; a missing paper value (``None`` or an absent key) draws no
marker, and a missing simulated value draws no bar. :func:`plot_result` picks the figure from
``result["preset"]`` (or a plan dict, recognised by its ``candidates``), and
:func:`png_path_for` names the PNG written beside a JSON result.

matplotlib (Agg backend) is imported inside the functions, so importing this module pulls in
neither matplotlib nor torch, and nothing here runs the simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dualpath.sim.plot_helpers import (
    Result,
    Row,
    _agent_counts,
    _auto_log,
    _fmt_x,
    _grouped_bars,
    _legend,
    _modes,
    _num,
    _paper_points,
    _present,
    _pyplot,
    _ratio,
    _rows,
    _save,
    _summary,
    _table,
)
from dualpath.vocab import Rung

TTFT_SLO_S = 4.0  # default online SLOs (a result's summary may override them)
TPOT_SLO_S = 0.050


def png_path_for(json_path: str | Path) -> Path:
    """The PNG beside ``json_path``: same folder and name, suffix ``.png``."""
    return Path(json_path).with_suffix(".png")


# --- Fig. 7 --------------------------------------------------------------------------------


def _speedup_labels(agents: list[int], sim: dict[tuple[str, int], float | None],
                    paper: dict[tuple[str, int], float | None],
                    summary: dict[str, Any]) -> list[str]:
    """Group labels: agent count, simulated and paper Basic/DualPath speedup."""
    paper_speedup = summary.get("paper_speedup")
    paper_speedup = paper_speedup if isinstance(paper_speedup, dict) else {}
    labels = []
    for n in agents:
        s = _ratio(sim.get(("basic", n)), sim.get(("dualpath", n)))
        p = _num(paper_speedup.get(str(n))) or _ratio(paper.get(("basic", n)),
                                                       paper.get(("dualpath", n)))
        label = f"{n:,}"
        if s is not None:
            label += f"\nspeedup {_fmt_x(s)}"
            label += f"\n(paper {_fmt_x(p)})" if p is not None else ""
        labels.append(label)
    return labels


def plot_fig7(result: Result, path: str | Path, log_y: bool | None = None) -> Path:
    """Fig. 7: simulated Basic / DualPath / Oracle JCT per agent count, paper values as ``x``.

    Group labels carry the Basic/DualPath speedup (simulated and paper). ``log_y``: force
    log (True) or linear (False) y; None picks log when the values span more than 8×.
    """
    rows = _rows(result)
    agents, modes = _agent_counts(rows), _modes(rows)
    sim, paper = _table(rows, "jct_s"), _table(rows, "paper_jct_s")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    _grouped_bars(ax, _speedup_labels(agents, sim, paper, _summary(result)),
                  {m: [sim.get((m, n)) for n in agents] for m in modes},
                  {m: [paper.get((m, n)) for n in agents] for m in modes})
    _auto_log(ax, list(sim.values()) + list(paper.values()), log_y)
    ax.set_xlabel("agents (concurrent trajectories)")
    ax.set_ylabel("job completion time, JCT (s)")
    if result.get("preset") == "paper-fig7":
        ax.set_title("Fig. 7: JCT per agent count and mode, simulated (bars) vs paper (x)")
    else:
        ax.set_title(f"{result.get('preset')} ({result.get('workload', '')}): simulated JCT "
                     "per agent count and mode")
    _legend(ax)
    return _save(fig, path)


# --- ablation ------------------------------------------------------------------------------


def _reductions(rows: list[Row]) -> dict[tuple[str, int], float | None]:
    """``reduction_pct`` per (mode, agents), computed from Basic's JCT where a row lacks it."""
    out = _table(rows, "reduction_pct")
    jct = _table(rows, "jct_s")
    for (mode, n), value in out.items():
        own, base = jct.get((mode, n)), jct.get(("basic", n))
        if value is None and own is not None and base:
            out[mode, n] = 100 * (own / base - 1)
    return out


def plot_ablation(result: Result, path: str | Path) -> Path:
    """Ablation: JCT change vs Basic (%) per agent count and mode, simulated vs paper ``x``."""
    rows = _rows(result)
    agents = _agent_counts(rows)
    modes = [m for m in _modes(rows) if m != Rung.BASIC]
    sim, paper = _reductions(rows), _table(rows, "paper_fig_reduction_pct")
    for key, value in _table(rows, "paper_reduction_pct").items():
        paper.setdefault(key, value)
    groups = [f"{n:,}" for n in agents]
    sim_bars = {m: [sim.get((m, n)) for n in agents] for m in modes}
    paper_marks = {m: [paper.get((m, n)) for n in agents] for m in modes}
    summary = _summary(result)
    mean, reported = summary.get("reduction_pct_mean"), summary.get("paper_reduction_pct")
    if isinstance(mean, dict) and isinstance(reported, dict):  # the paper reports the means
        groups.append("mean\n(paper's figures)")
        for m in modes:
            sim_bars[m].append(_num(mean.get(m)))
            paper_marks[m].append(_num(reported.get(m)))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _grouped_bars(ax, groups, sim_bars, paper_marks, fmt="{:+.1f}%")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("agents (concurrent trajectories); paper x: figure readings, reported means")
    ax.set_ylabel("JCT change vs Basic (%, negative = faster)")
    ax.set_title("Ablation: JCT change vs Basic per mode, simulated (bars) vs paper (x)")
    _legend(ax)
    return _save(fig, path)


# --- scale ---------------------------------------------------------------------------------


def _cluster_label(row: Row) -> str:
    p, d, n = (_num(row.get(k)) for k in ("P", "D", "agents"))
    size = "?" if p is None or d is None else f"{p:.0f}P{d:.0f}D"
    return size if n is None else f"{size}\n{n:,.0f} agents"


def _scale_note(result: Result, sim: list[float | None], paper: list[float | None]) -> str:
    """'large/small JCT ratio: sim …, paper …' from the summary or the rows."""
    summary = _summary(result)
    s = _num(summary.get("jct_ratio_large_vs_small"))
    p = _num(summary.get("paper_ratio"))
    if len(sim) == 2:
        s = s if s is not None else _ratio(sim[1], sim[0])
        p = p if p is not None else _ratio(paper[1], paper[0])
    return f"large/small JCT ratio: sim {_fmt_x(s)}, paper {_fmt_x(p)}"


def plot_scale(result: Result, path: str | Path) -> Path:
    """Scale: JCT of the small and the large cluster, simulated (bars) vs paper ``x``."""
    rows = _rows(result)
    mode = _modes(rows)[0] if rows else "dualpath"
    sim = [_num(r.get("jct_s")) for r in rows]
    paper = [_num(r.get("paper_jct_s")) for r in rows]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _grouped_bars(ax, [_cluster_label(r) for r in rows], {mode: sim}, {mode: paper})
    ax.text(0.02, 0.97, _scale_note(result, sim, paper), transform=ax.transAxes,
            va="top", fontsize=8)
    top = max(_present(sim + paper), default=1.0)
    ax.set_ylim(0, top * 1.25)
    ax.set_xlabel("cluster (prefill P × decode D nodes)")
    ax.set_ylabel("job completion time, JCT (s)")
    ax.set_title(f"Scale: {mode} JCT per cluster size, sim (bars) vs paper (x)")
    _legend(ax, loc="upper right")
    return _save(fig, path)


# --- online --------------------------------------------------------------------------------


def _series(rows: list[Row], mode: str, key: str, scale: float = 1.0,
            ) -> tuple[list[float], list[float]]:
    """(APS, ``key`` × ``scale``) points of ``mode``, sorted by APS, missing values dropped."""
    pts = sorted((aps, v * scale) for r in rows if str(r.get("mode", "?")) == mode
                 and (aps := _num(r.get("aps"))) is not None
                 and (v := _num(r.get(key))) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _online_panel(ax: Any, rows: list[Row], key: str, scale: float, slo: float,
                  unit: str) -> None:
    """One metric vs APS: a line per mode, paper ``x`` where rows carry ``paper_<key>``."""
    values: list[float | None] = [slo]
    paper_labelled = False
    for mode in _modes(rows):
        xs, ys = _series(rows, mode, key, scale)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=4, label=mode)
            values += ys
        pxs, pys = _series(rows, mode, f"paper_{key}", scale)
        paper_labelled = _paper_points(ax, pxs, list(pys), not paper_labelled) or paper_labelled
        values += pys
    ax.axhline(slo, color="red", linestyle="--", linewidth=1,
               label=f"SLO {slo:g} {unit}")
    _auto_log(ax, values, None)
    ax.set_xlabel("arrival rate, APS (agents/s)")
    _legend(ax)


def plot_online(result: Result, path: str | Path) -> Path:
    """Online: TTFT (s) and TPOT (ms) vs APS per mode, with the SLO lines (4 s, 50 ms).

    A summary's ``ttft_slo_s`` / ``tpot_slo_s`` replace the default SLOs.
    """
    rows, summary = _rows(result), _summary(result)
    ttft_slo = _num(summary.get("ttft_slo_s")) or TTFT_SLO_S
    tpot_slo = _num(summary.get("tpot_slo_s")) or TPOT_SLO_S
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    _online_panel(left, rows, "ttft_s", 1.0, ttft_slo, "s")
    left.set_ylabel("time to first token, TTFT (s)")
    left.set_title("TTFT vs arrival rate")
    _online_panel(right, rows, "tpot_s", 1e3, tpot_slo * 1e3, "ms")
    right.set_ylabel("time per output token, TPOT (ms)")
    right.set_title("TPOT vs arrival rate")
    fig.suptitle(f"{result.get('preset', 'online')}: TTFT and TPOT vs APS per mode, "
                 "SLOs dashed")
    return _save(fig, path)


# --- plan ----------------------------------------------------------------------------------


def _bound(result: Result, summary_key: str, range_key: str) -> float | None:
    """An eq. 9 bound from the summary, else from ``result["range"]``."""
    value = _num(_summary(result).get(summary_key))
    rng = result.get("range")
    if value is None and isinstance(rng, dict):
        value = _num(rng.get(range_key))
    return value


def _shade_range(ax: Any, result: Result, xs: list[float]) -> None:
    """Shade the eq. 9 P/D range (an open upper bound is cut just past the candidates)."""
    lo, hi = _bound(result, "pd_min", "lower"), _bound(result, "pd_max", "upper")
    if lo is None or hi is None or lo <= 0 or lo > hi:
        ax.text(0.02, 0.97, "no feasible eq. 9 P/D range", transform=ax.transAxes,
                va="top", fontsize=8)
        return
    hi = min(hi, max([*xs, lo]) * 4)
    label = _summary(result).get("pd_range") or f"{lo:.3g} .. {hi:.3g}"
    ax.axvspan(lo, hi, color="tab:green", alpha=0.15, label=f"eq. 9 range {label}")
    ax.set_xlim(min([*xs, lo]) / 1.5, max([*xs, hi]) * 1.5)


def _candidate_points(cands: list[Row]) -> list[tuple[float, float | None, Row]]:
    """(P/D, JCT or None, row) per candidate with P and D, sorted by P/D."""
    pts = []
    for c in cands:
        p, d = _num(c.get("P")), _num(c.get("D"))
        if p is not None and d:
            pts.append((p / d, _num(c.get("jct_s")), c))
    return sorted(pts, key=lambda t: t[0])


def _draw_candidates(ax: Any, pts: list[tuple[float, float | None, Row]],
                     recommended: Any) -> bool:
    """JCT per candidate (or a strip when none simulated); True when JCTs were drawn."""
    simulated = [(x, y, c) for x, y, c in pts if y is not None]
    shown = simulated or [(x, 1.0, c) for x, _, c in pts]
    inside = [t for t in shown if t[2].get("in_range", True)]
    outside = [t for t in shown if not t[2].get("in_range", True)]
    ax.plot([t[0] for t in inside], [t[1] for t in inside], marker="o",
            linestyle="-" if simulated else "none", label="candidate")
    if outside:
        ax.plot([t[0] for t in outside], [t[1] for t in outside], marker="o",
                linestyle="none", mfc="none", color="tab:red", label="outside eq. 9")
    for x, y, c in shown:
        name = f"{c.get('P')}P{c.get('D')}D"
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7)
        if recommended and name == recommended:
            ax.scatter([x], [y], marker="*", s=180, color="gold", edgecolors="black",
                       zorder=5, label=f"recommended {name}")
    return bool(simulated)


def plot_plan(result: Result, path: str | Path) -> Path:
    """Plan: simulated JCT per candidate P/D ratio, the eq. 9 range shaded.

    Without simulated JCTs the candidates are drawn as a strip inside the shaded range.
    """
    pts = _candidate_points([c for c in result.get("candidates") or [] if isinstance(c, dict)])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.set_xscale("log", base=2)
    simulated = _draw_candidates(ax, pts, _summary(result).get("recommended"))
    _shade_range(ax, result, [t[0] for t in pts])
    if pts:
        ax.set_xticks([t[0] for t in pts], [str(t[2].get("ratio", f"{t[0]:.3g}")) for t in pts])
        ax.minorticks_off()
    hw = result.get("hardware") if isinstance(result.get("hardware"), dict) else {}
    where = f" ({hw['name']})" if hw.get("name") else ""
    if simulated:
        ax.set_ylabel("job completion time, JCT (s)")
        ax.set_title(f"P/D plan{where}: simulated JCT per candidate P/D, eq. 9 range shaded")
    else:
        ax.set_yticks([])
        ax.set_title(f"P/D plan{where}: candidate P/D ratios (not simulated), eq. 9 range shaded")
    ax.set_xlabel("prefill/decode node ratio P/D (log scale)")
    _legend(ax)
    return _save(fig, path)


# --- dispatch ------------------------------------------------------------------------------

PLOTTERS: dict[str, Callable[[Result, str | Path], Path]] = {
    "paper-fig7": plot_fig7, "paper-ablation": plot_ablation, "paper-scale": plot_scale,
    "paper-online": plot_online, "testbed": plot_fig7,  # JCT per mode and agent count
}


def plot_result(result: Result, path: str | Path) -> Path:
    """Write the figure for ``result`` to ``path``: by ``result["preset"]``, or a plan dict.

    A plan is recognised by its ``candidates``; a preset whose name starts with
    ``paper-online`` gets the online figure. ValueError for anything else.
    """
    if "candidates" in result:
        return plot_plan(result, path)
    name = str(result.get("preset"))
    plotter = PLOTTERS.get(name) or (plot_online if name.startswith("paper-online") else None)
    if plotter is None:
        raise ValueError(f"no plot for preset {name!r}; known: {sorted(PLOTTERS)} or a plan")
    return plotter(result, path)
