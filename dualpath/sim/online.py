"""Online serving in the simulator: latency statistics and the APS capacity under an SLO.

Agents arrive as a Poisson process at a given APS (agents per second, docs/paper.md §7.7) and replay
their trajectories; each request records its submit time, the end of its prefill (its first
token: the PE samples it), the start of its decode and its last token. From these:

* TTFT = prefill end − submit (queueing, allocation, KV reads and prefill, as in Fig. 12);
* TPOT = (last token − decode start) / generated tokens;
* TTST = decode start − submit + one TPOT (the second token needs the PD transfer and one step).

Statistics are taken over the requests submitted in the steady window: after the first
``warmup`` fraction of the arrival span and before the last agent arrives (the tail, when
arrivals have stopped, is under-loaded). ``aps_capacity`` is the APS at which the mean TTFT
reaches 4 s — the paper ends a run when TTFT exceeds 4 s; TPOT (SLO 50 ms) is reported beside
it and can be required too.
"""

from __future__ import annotations

from typing import Any

TTFT_SLO_S = 4.0
TPOT_SLO_S = 0.050


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_stats(records: list[tuple[float, float, float, float, int]], step_s: float,
                  warmup: float = 0.2) -> dict[str, Any]:
    """Mean/p50/p90 TTFT, TTST and TPOT over the steady window of ``records``
    (``(submit, prefilled, decode_start, done, generated)`` per request)."""
    if not records:
        return {"requests": 0}
    last_submit = max(r[0] for r in records)
    lo, hi = warmup * last_submit, last_submit
    window = [r for r in records if lo <= r[0] <= hi] or records
    ttft = [p - s for s, p, _, _, _ in window]
    tpot = [(d - ds) / max(1, g) for _, _, ds, d, g in window]
    ttst = [ds - s + t for (s, _, ds, _, _), t in zip(window, tpot, strict=True)]
    out: dict[str, Any] = {"requests": len(window), "window_s": [lo, hi],
                           "min_step_s": step_s}
    for name, values in (("ttft_s", ttft), ("ttst_s", ttst), ("tpot_s", tpot)):
        out[name] = sum(values) / len(values)
        out[name.replace("_s", "_p50_s")] = _pct(values, 0.5)
        out[name.replace("_s", "_p90_s")] = _pct(values, 0.9)
    return out


def meets_slo(result: dict[str, Any], ttft_slo_s: float = TTFT_SLO_S,
              tpot_slo_s: float | None = None) -> bool:
    """Whether a run's mean TTFT (and, if ``tpot_slo_s`` is given, mean TPOT) meet the SLO."""
    if result.get("ttft_s", float("inf")) > ttft_slo_s:
        return False
    return tpot_slo_s is None or result.get("tpot_s", float("inf")) <= tpot_slo_s


def aps_capacity(rows: list[dict[str, Any]], mode: str, ttft_slo_s: float = TTFT_SLO_S,
                 tpot_slo_s: float | None = None) -> float | None:
    """The APS at which ``mode``'s mean TTFT reaches the SLO (the paper stops a run when TTFT
    exceeds 4 s): linear interpolation between the last APS of the sweep that meets the SLO
    (every lower one meeting it too) and the next one; the largest APS swept if all meet it,
    None if the lowest already fails. With ``tpot_slo_s`` a run must meet that as well."""
    ordered = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["aps"])
    best = None
    for lo, hi in zip([None, *ordered], ordered, strict=False):
        if meets_slo(hi, ttft_slo_s, tpot_slo_s):
            best = hi["aps"]
            continue
        if lo is not None and tpot_slo_s is None and hi["ttft_s"] > lo["ttft_s"]:
            frac = (ttft_slo_s - lo["ttft_s"]) / (hi["ttft_s"] - lo["ttft_s"])
            best = lo["aps"] + frac * (hi["aps"] - lo["aps"])
        break
    return best
