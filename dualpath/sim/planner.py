"""P/D planning: the bottleneck-free P/D range of docs/paper.md §3 (eq. 9) and candidate ratios.

``pd_ratio_range(g, s, B, M)`` returns ``s/(g−s) ≤ P/D ≤ min{(g−2s)/s, (g−s)/(2s),
(M/(B·s) − 3)/2}`` as exact fractions where the inputs allow, with every term named, so a
caller can see which constraint binds. ``plan`` adds candidate (P, D) node counts inside the
range (``beyond=True``: outside it too, marked), each with the load eq. (9)'s traffic model
puts on each resource at its ratio and the binding one, and, when a simulate function is
given, their simulated JCT and a recommendation. The simulator models the DRAM and
compute-NIC hops the range is derived from, so simulating beyond the range shows what
breaking it costs.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from dualpath.sim.profiles import HardwareProfile


def _frac(x: float) -> Fraction:
    return Fraction(x).limit_denominator(10_000)


def pd_ratio_range(g: int = 8, s: float = 1.0, B: float = 50.0,
                   M: float = 500.0) -> dict[str, Any]:
    """Eq. (9): lower/upper P/D bounds (Fractions) and each constraint's value.

    ``g`` GPUs (CNICs) per node, storage NIC = ``s`` × one CNIC of ``B`` GB/s, DRAM ``M`` GB/s.
    """
    if g <= 0 or s <= 0 or B <= 0 or M <= 0:
        raise ValueError("g, s, B and M must be > 0")
    fs, fg = _frac(s), Fraction(g)
    terms = {
        "pe_cnic_write_lower (3)": fs / (fg - fs) if g > s else Fraction(10**9),
        "de_cnic_read_upper (5)": (fg - 2 * fs) / fs,
        "de_cnic_write_upper (7)": (fg - fs) / (2 * fs),
        "de_dram_upper (8)": (_frac(M) / (_frac(B) * fs) - 3) / 2,
    }
    lo = terms["pe_cnic_write_lower (3)"]
    uppers = {k: v for k, v in terms.items() if "upper" in k}
    hi = min(uppers.values())
    return {"lower": lo, "upper": hi, "feasible": lo <= hi,
            "binding_upper": sorted(k for k, v in uppers.items() if v == hi),
            "pe_cnic_read_ok (1)": 2 * fs / fg <= 1, "terms": terms}


def range_for(hw: HardwareProfile) -> dict[str, Any]:
    """Eq. (9) for a hardware profile (B = one CNIC, s = SNIC / CNIC, M = DRAM)."""
    return pd_ratio_range(hw.gpus_per_node, hw.storage_ratio, hw.cnic_bps / 1e9,
                          hw.dram_bps / 1e9)


def eq9_loads(ratio: Fraction, g: int = 8, s: float = 1.0, B: float = 50.0,
              M: float = 500.0) -> dict[str, Fraction]:
    """Each eq. (9) resource's load at ``P/D = ratio`` as a fraction of its capacity, with every
    storage NIC reading at ``s·B`` (docs/paper.md §3: the left-hand sides of (1), (2), (4), (6) and
    the DE DRAM pressure of (8)); keys name the bound each load gives, as in :func:`pd_ratio_range`.

    A load is 1 exactly at its bound, so every load is ≤ 1 inside the range (load (1) does not
    depend on the ratio; :func:`pd_ratio_range` reports it as ``pe_cnic_read_ok``).
    """
    if ratio <= 0:
        raise ValueError(f"P/D must be > 0, got {ratio}")
    fs, fg, r = _frac(s), Fraction(g), Fraction(ratio)
    return {"pe_cnic_read (1)": 2 * fs / fg,
            "pe_cnic_write (3)": fs / fg * (1 + 1 / r),
            "de_cnic_read (5)": fs / fg * (r + 2),
            "de_cnic_write (7)": fs / fg * (2 * r + 1),
            "de_dram (8)": (3 + 2 * r) * _frac(B) * fs / _frac(M)}


def binding(loads: dict[str, Fraction]) -> list[str]:
    """The resources with the highest load (several on an exact tie), sorted."""
    top = max(loads.values())
    return sorted(k for k, v in loads.items() if v == top)


def loads_for(hw: HardwareProfile, ratio: Fraction) -> dict[str, Fraction]:
    """:func:`eq9_loads` for a hardware profile (the inputs of :func:`range_for`)."""
    return eq9_loads(ratio, hw.gpus_per_node, hw.storage_ratio, hw.cnic_bps / 1e9,
                     hw.dram_bps / 1e9)


def candidates(lo: Fraction, hi: Fraction, max_nodes: int = 6,
               fits: Callable[[int, int], bool] | None = None,
               beyond: bool = False) -> list[tuple[int, int]]:
    """(P, D) node pairs with P + D ≤ ``max_nodes`` whose ratio lies in [lo, hi] (any ratio
    with ``beyond``), one per ratio: the smallest pair that ``fits`` (the model fits on both
    sides; default: any)."""
    seen: dict[Fraction, tuple[int, int]] = {}
    for total in range(2, max_nodes + 1):
        for p in range(1, total):
            d = total - p
            r = Fraction(p, d)
            if ((beyond or lo <= r <= hi) and r not in seen
                    and (fits is None or fits(p, d))):
                seen[r] = (p, d)
    return sorted(seen.values(), key=lambda pd: Fraction(*pd))


def jsonable(obj: Any) -> Any:
    """Fractions → {"value": float, "fraction": "a/b"}; recurse into dicts and lists."""
    if isinstance(obj, Fraction):
        return {"value": float(obj), "fraction": str(obj)}
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def _cheapest(rows: list[dict[str, Any]]) -> str | None:
    """``"xPyD"`` of the row with the least node-seconds; None for no rows."""
    if not rows:
        return None
    best = min(rows, key=lambda r: r["node_seconds"])
    return f"{best['P']}P{best['D']}D"


def plan(hw: HardwareProfile, max_nodes: int = 6,
         simulate: Callable[[int, int], float | None] | None = None,
         fits: Callable[[int, int], bool] | None = None, beyond: bool = False,
         ) -> dict[str, Any]:
    """The range, candidate (P, D) pairs and, with ``simulate(P, D) -> JCT``, a recommendation.

    The recommendation is the candidate with the least JCT per node (JCT × (P + D)): the
    cheapest way to finish the job for a fixed cluster budget. ``simulate`` returns None for a
    candidate that cannot run (the model does not fit); it is listed but not recommended.
    With ``beyond`` the ratios outside the range are candidates too (``in_range`` false);
    ``recommended_in_range`` is then the best of those inside. Each candidate carries its
    :func:`eq9_loads` (``loads``), the ``binding`` resource(s) and their ``binding_load``.
    """
    rng = range_for(hw)
    cands = candidates(rng["lower"], rng["upper"], max_nodes, fits, beyond)
    rows = []
    for p, d in cands:
        ratio = Fraction(p, d)
        loads = loads_for(hw, ratio)
        row: dict[str, Any] = {"P": p, "D": d, "ratio": str(ratio),
                               "in_range": rng["lower"] <= ratio <= rng["upper"],
                               "loads": {k: float(v) for k, v in loads.items()},
                               "binding": binding(loads),
                               "binding_load": float(max(loads.values()))}
        if simulate is not None:
            jct = simulate(p, d)
            row.update(jct_s=jct, node_seconds=None if jct is None else jct * (p + d))
        rows.append(row)
    ran = [r for r in rows if r.get("node_seconds") is not None]
    best = _cheapest(ran)
    summary = {"pd_min": float(rng["lower"]), "pd_max": float(rng["upper"]),
               "pd_range": f"{rng['lower']} .. {rng['upper']}", "feasible": rng["feasible"],
               "recommended": best}
    if beyond:
        summary["recommended_in_range"] = _cheapest([r for r in ran if r["in_range"]])
    return jsonable({"summary": summary, "range": rng, "candidates": rows,
                     "hardware": hw.to_dict()})
