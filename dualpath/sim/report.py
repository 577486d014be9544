"""Readable tables of ``dualpath sim`` and ``dualpath plan`` results (formatting only).

Each function turns a result dict of :func:`dualpath.sim.presets.run_preset` or
:func:`dualpath.sim.planner.plan` into rich tables; nothing here runs the simulator. A preset
without its own table, or a result whose shape a table does not expect, gets
:func:`summary_table`: its summary as flattened key/value rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rich import box
from rich.table import Table

from dualpath.vocab import Rung

MODE_ORDER = tuple(r for r in Rung if r.reuses_kv)  # the ladder's order, as simulated
DASH = "–"


def fmt_s(x: float | None) -> str:
    """Seconds: thousands without decimals (``2,016``), less with one or two (``15.1``)."""
    if x is None:
        return DASH
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def fmt_pct(x: float | None, scale: float = 100.0) -> str:
    """A signed percentage of a fraction (``scale`` 100) or of points (``scale`` 1)."""
    return DASH if x is None else f"{x * scale:+.1f}%"


def _x(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}x"


def _table(title: str, caption: str | None = None) -> Table:
    """A table at least as wide as its title, so that the title is never wrapped."""
    return Table(box=box.SIMPLE_HEAD, title=title, caption=caption, title_justify="left",
                 caption_justify="left", min_width=len(title) + 2)


def _columns(table: Table, names: Iterable[str]) -> None:
    for i, name in enumerate(names):
        table.add_column(name, justify="left" if i == 0 else "right")


def _modes(rows: list[dict[str, Any]]) -> list[str]:
    """The modes of ``rows``, in :data:`MODE_ORDER` (unknown ones last, as met)."""
    seen = list(dict.fromkeys(r["mode"] for r in rows))
    return sorted(seen, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else len(seen))


def _by_agents(rows: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{agents: {mode: row}}`` in increasing agent count."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["agents"]):
        out.setdefault(r["agents"], {})[r["mode"]] = r
    return out


def _cluster(rows: list[dict[str, Any]]) -> str:
    return f"{rows[0]['P']}P{rows[0]['D']}D" if rows and "P" in rows[0] else "?"


def fig7_table(result: dict[str, Any]) -> Table:
    """Fig. 7: per agent count, each mode's JCT (and its error vs the paper's reading, with the
    reading beside) and DualPath's speedup over Basic (the paper's beside)."""
    rows, summary = result["rows"], result.get("summary", {})
    modes = _modes(rows)
    papered = {m for m in modes if any(r.get("paper_jct_s") for r in rows if r["mode"] == m)}
    paper_speedup = summary.get("paper_speedup") or {}
    caption = None
    worst = summary.get("max_rel_error_vs_paper")
    if papered:
        caption = ("(±%): simulated vs the paper's reading"
                   + ("" if worst is None else f"; at most {worst:.1%} for Basic and DualPath "
                      "at 1,024-4,096 agents")
                   + ". The Oracle at 512 agents is the fitted point.")
    table = _table(f"Fig. 7: offline JCT, {_cluster(rows)}, "
                   f"{result.get('workload', '?')} workload", caption)
    names = ["agents"]
    for m in modes:
        names += [f"{m}\nJCT (s)"] + (["paper\n(s)"] if m in papered else [])
    speedup = Rung.BASIC in modes and Rung.DUALPATH in modes
    if speedup:
        names += ["speedup"] + (["paper"] if paper_speedup else [])
    _columns(table, names)
    for n, by_mode in _by_agents(rows).items():
        cells = [f"{n:,}"]
        for m in modes:
            r = by_mode.get(m, {})
            cell = fmt_s(r.get("jct_s"))
            if r.get("rel_error") is not None:
                cell += f" ({fmt_pct(r['rel_error'])})"
            cells.append(cell)
            if m in papered:
                cells.append(fmt_s(r.get("paper_jct_s")))
        if speedup:
            b, d = by_mode.get("basic", {}).get("jct_s"), by_mode.get("dualpath", {}).get("jct_s")
            cells.append(_x(b / d if b and d else None))
            if paper_speedup:
                cells.append(_x(paper_speedup.get(str(n))))
        table.add_row(*cells)
    return table


def ablation_table(result: dict[str, Any]) -> Table:
    """The ablation: per agent count, each step's JCT and change vs Basic (the paper figure's
    readings beside), and a row of the mean changes against the paper's reported ones."""
    rows, summary = result["rows"], result.get("summary", {})
    modes = _modes(rows)
    papered = any("paper_fig_jct_s" in r for r in rows)
    caption = ("(±%): JCT change vs Basic at the same agent count. Paper: its ablation "
               "figure's readings; the mean row: the reductions the paper reports."
               if papered else "(±%): JCT change vs Basic at the same agent count.")
    table = _table(f"Ablation: offline JCT, {_cluster(rows)}, "
                   f"{result.get('workload', '?')} workload", caption)
    _columns(table, ["agents", *(c for m in modes for c in
                                 ([f"{m}\nJCT (s)"] + (["paper\n(s)"] if papered else [])))])

    def cell(jct: float | None, pct: float | None, basic: bool) -> str:
        return fmt_s(jct) if basic or pct is None else f"{fmt_s(jct)} ({fmt_pct(pct, 1)})"

    for n, by_mode in _by_agents(rows).items():
        cells = [f"{n:,}"]
        for m in modes:
            r = by_mode.get(m, {})
            cells.append(cell(r.get("jct_s"), r.get("reduction_pct"), m == Rung.BASIC))
            if papered:
                cells.append(cell(r.get("paper_fig_jct_s"), r.get("paper_fig_reduction_pct"),
                                  m == Rung.BASIC))
        table.add_row(*cells)
    mean, paper = summary.get("reduction_pct_mean") or {}, summary.get("paper_reduction_pct") or {}
    if mean:
        cells = ["mean"]
        for m in modes:
            cells.append(fmt_pct(mean.get(m), 1) if m in mean else "")
            if papered:
                cells.append(fmt_pct(paper.get(m), 1) if m in paper else "")
        table.add_row(*cells, style="bold")
    return table


def scale_table(result: dict[str, Any]) -> Table:
    """Scale: DualPath JCT of the small and the large cluster, the paper's beside."""
    summary = result.get("summary", {})
    caption = (f"JCT ratio large / small: {summary.get('jct_ratio_large_vs_small', 0):.3f} "
               f"(paper {summary.get('paper_ratio', 0):.3f})")
    table = _table("Scale: DualPath offline JCT", caption)
    _columns(table, ["cluster", "agents", "JCT (s)", "paper (s)", "error"])
    for r in result["rows"]:
        table.add_row(f"{r['P']}P{r['D']}D", f"{r['agents']:,}", fmt_s(r["jct_s"]),
                      fmt_s(r.get("paper_jct_s")), fmt_pct(r.get("rel_error")))
    return table


def _ms(x: float | None) -> str:
    return DASH if x is None else f"{x * 1000:.1f}"


def _slo(row: dict[str, Any], ttft_slo: float, tpot_slo: float) -> str:
    ttft, tpot = row.get("ttft_s"), row.get("tpot_s")
    if ttft is None or ttft > ttft_slo:
        return "no"
    return "yes" if tpot is not None and tpot <= tpot_slo else "TTFT only"


def online_table(result: dict[str, Any]) -> Table:
    """Online: per mode and APS, mean and p90 TTFT, TTST and TPOT and whether the SLO holds."""
    summary = result.get("summary", {})
    ttft_slo, tpot_slo = summary.get("ttft_slo_s", 4.0), summary.get("tpot_slo_s", 0.05)
    table = _table(f"Online serving, {_cluster(result['rows'])}, "
                   f"{result.get('workload', '?')} workload (steady-window means and p90)",
                   f"SLO: mean TTFT ≤ {ttft_slo:g} s and mean TPOT ≤ {tpot_slo * 1000:g} ms "
                   "(TTFT only: TPOT above it)")
    _columns(table, ["mode", "APS", "agents", "TTFT\n(s)", "TTFT p90\n(s)", "TTST\n(s)",
                     "TPOT\n(ms)", "TPOT p90\n(ms)", "within\nSLO"])
    order = _modes(result["rows"])
    for r in sorted(result["rows"], key=lambda r: (order.index(r["mode"]), r.get("aps", 0))):
        table.add_row(r["mode"], f"{r.get('aps', 0):g}", f"{r.get('agents', 0):,}",
                      fmt_s(r.get("ttft_s")), fmt_s(r.get("ttft_p90_s")),
                      fmt_s(r.get("ttst_s")), _ms(r.get("tpot_s")), _ms(r.get("tpot_p90_s")),
                      _slo(r, ttft_slo, tpot_slo))
    return table


def _aps(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}"


def capacity_table(result: dict[str, Any]) -> Table:
    """Online: the APS capacity per mode (simulated, with the TPOT SLO too, the paper's) and
    DualPath's latencies at 0.4 APS against the paper's."""
    s = result.get("summary", {})
    at, paper_at = s.get("dualpath_at_0.4_aps"), s.get("paper_at_0.4_aps") or {}
    caption = None
    if at:
        caption = ("DualPath at 0.4 APS: " + ", ".join(
            f"{k[:4].upper()} {fmt_s(at.get(k))} s (paper {fmt_s(paper_at.get(k))} s)"
            for k in ("ttft_s", "ttst_s", "tpot_s")))
    table = _table(f"APS capacity: the APS at which mean TTFT reaches "
                   f"{s.get('ttft_slo_s', 4.0):g} s", caption)
    cap, tpot, paper = (s.get(k) or {} for k in ("aps_capacity", "aps_capacity_with_tpot_slo",
                                                 "paper_aps_capacity"))
    modes = list(cap)
    _columns(table, ["", *modes, "dualpath / basic"])
    table.add_row("simulated", *(_aps(cap.get(m)) for m in modes), _x(s.get("capacity_ratio")))
    table.add_row("with the TPOT SLO", *(_aps(tpot.get(m)) for m in modes), "")
    if paper:
        table.add_row("paper", *(_aps(paper.get(m)) for m in modes),
                      _x(s.get("paper_capacity_ratio")))
    return table


def _real_agents(result: dict[str, Any]) -> int | None:
    """The agent count of the rows the real benchmark was compared with (its simulated JCTs
    are the summary's ``sim_jct_s``)."""
    sim = result["summary"].get("sim_jct_s") or {}
    for n, by_mode in _by_agents(result["rows"]).items():
        if sim and all(by_mode.get(m, {}).get("jct_s") == v for m, v in sim.items()):
            return n
    return None


def testbed_table(result: dict[str, Any]) -> Table:
    """Testbed: simulated JCT per mode and agent count, the predicted dualpath/basic JCT ratio
    and, with a real benchmark, its measured ratio beside."""
    s, rows = result["summary"], result["rows"]
    modes = _modes(rows)
    real = s.get("real_benchmark_ratio")
    caption = None
    if real is not None:
        jct = s.get("real_jct_s") or {}
        caption = (f"Real ({s.get('real_benchmark')}): " + ", ".join(
            f"{m} {fmt_s(v)} s" for m, v in jct.items() if isinstance(v, int | float)))
    table = _table(f"Testbed ({result.get('profile', '?')}), {_cluster(rows)}, "
                   f"{result.get('workload', '?')} workload: simulated JCT", caption)
    _columns(table, ["agents", *(f"{m}\n(s)" for m in modes), "dualpath / basic\nsimulated",
                     *(["real", "error"] if real is not None else [])])
    ratios, real_n = s.get("dualpath_vs_basic_jct_ratio") or {}, _real_agents(result)
    for n, by_mode in _by_agents(rows).items():
        ratio = ratios.get(str(n))
        cells = [f"{n:,}", *(fmt_s(by_mode.get(m, {}).get("jct_s")) for m in modes),
                 DASH if ratio is None else f"{ratio:.3f}"]
        if real is not None:
            match = n == real_n
            cells += [f"{real:.3f}" if match else "",
                      fmt_pct(s.get("ratio_rel_error")) if match else ""]
        table.add_row(*cells)
    return table


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, text)`` pairs of a nested dict; lists and scalars as short text."""
    if isinstance(obj, dict):
        if not obj and prefix:
            return [(prefix, "{}")]
        return [kv for k, v in obj.items()
                for kv in _flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, float):
        return [(prefix, f"{obj:.4g}")]
    if isinstance(obj, list | tuple):
        text = ", ".join(str(_flatten(v)[0][1]) if not isinstance(v, dict | list) else "…"
                         for v in obj[:8])
        return [(prefix, f"[{text}{', …' if len(obj) > 8 else ''}]")]
    return [(prefix, DASH if obj is None else str(obj))]


def summary_table(summary: dict[str, Any], title: str = "summary") -> Table:
    """Any summary as key/value rows, nested dicts flattened to dotted keys."""
    table = _table(title)
    _columns(table, ["key", "value"])
    for key, value in _flatten(summary):
        table.add_row(key, value)
    return table


SIM_TABLES: dict[str, Callable[[dict[str, Any]], list[Table]]] = {
    "paper-fig7": lambda r: [fig7_table(r)],
    "paper-ablation": lambda r: [ablation_table(r)],
    "paper-scale": lambda r: [scale_table(r)],
    "paper-online": lambda r: [online_table(r), capacity_table(r)],
    "testbed": lambda r: [testbed_table(r)],
}


def sim_tables(result: dict[str, Any]) -> list[Table]:
    """The tables of a ``dualpath sim`` result: its preset's, or :func:`summary_table` of its
    summary for a preset without one or a result shaped otherwise than expected."""
    make = SIM_TABLES.get(result.get("preset", ""))
    if make is not None:
        try:
            return make(result)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
            pass
    return [summary_table(result.get("summary", {}), f"{result.get('preset', 'sim')} summary")]


def resource(key: str) -> str:
    """A planner resource key as text: ``de_cnic_write (7)`` → ``DE CNIC write (7)``."""
    name, _, eq = key.partition(" ")
    words = [w.upper() if w in ("pe", "de", "cnic", "dram") else w for w in name.split("_")]
    return " ".join(words) + (f" {eq}" if eq else "")


def _mark(row: dict[str, Any], summary: dict[str, Any]) -> str:
    name = f"{row['P']}P{row['D']}D"
    if name == summary.get("recommended"):
        return "<- recommended"
    return "<- best in range" if name == summary.get("recommended_in_range") else ""


def plan_table(result: dict[str, Any]) -> Table:
    """``dualpath plan``'s candidates: P, D, P/D, inside eq. 9's range or not, the binding
    resource and its load, and (when simulated) JCT and node-seconds; the recommendation
    marked."""
    summary, rows = result["summary"], result["candidates"]
    simulated = any("jct_s" in r for r in rows)
    hw = (result.get("hardware") or {}).get("name", "?")
    table = _table(f"P/D candidates: {result.get('model', '?')} on {hw}",
                   "binding: the eq. 9 resource with the highest load at this P/D when every "
                   "storage NIC reads at full rate (over 100%: it is the bottleneck)."
                   + (" Recommended: the least JCT x nodes." if simulated else ""))
    _columns(table, ["P", "D", "P/D", "eq. 9\nrange", "binding\nresource", "load",
                     *(["JCT\n(s)", "node-s"] if simulated else []), ""])
    for r in rows:
        cells = [str(r["P"]), str(r["D"]), r["ratio"], "inside" if r["in_range"] else "outside",
                 " = ".join(resource(k) for k in r.get("binding", [])) or DASH,
                 DASH if r.get("binding_load") is None else f"{r['binding_load']:.0%}"]
        if simulated:
            cells += [fmt_s(r.get("jct_s")), fmt_s(r.get("node_seconds"))]
        table.add_row(*cells, _mark(r, summary))
    return table


def plan_range_line(result: dict[str, Any]) -> str:
    """Eq. 9's range in one line, with the constraint(s) that set its upper bound."""
    summary, rng = result["summary"], result.get("range") or {}
    lo, hi = summary["pd_range"].split(" .. ")
    upper = ", ".join(resource(k.replace("_upper", "")) for k in rng.get("binding_upper", []))
    line = (f"eq. 9: {lo} ≤ P/D ≤ {hi} ({summary['pd_min']:.3g} .. {summary['pd_max']:.3g})"
            + (f"; upper bound set by {upper}" if upper else ""))
    if not summary.get("feasible", True):
        line += "; no P/D is bottleneck-free"
    if summary.get("recommended"):
        line += f". Recommended: {summary['recommended']}"
        if summary.get("recommended_in_range") not in (None, summary["recommended"]):
            line += f" (inside the range: {summary['recommended_in_range']})"
    return line
