"""Online serving in the simulator: latency statistics and the APS capacity under an SLO.

Agents arrive as a Poisson process at a given APS (agents per second, PAPER §7.7) and replay
their trajectories; each request records its submit time, the end of its prefill (its first
token: the PE samples it), the start of its decode and its last token. From these:

* TTFT = prefill end − submit (queueing, allocation, KV reads and prefill, as in Fig. 12);
* TPOT = (last token − decode start) / generated tokens;
* TTST = decode start − submit + one TPOT (the second token needs the PD transfer and one step).

Statistics are taken over the requests submitted in the steady window: after the first
``warmup`` fraction of the arrival span and before the last agent arrives (the tail, when
arrivals have stopped, is under-loaded). ``aps_capacity`` is the largest APS of a sweep whose
mean TTFT and mean TPOT meet the SLO (TTFT ≤ 4 s, TPOT ≤ 50 ms by default).
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
              tpot_slo_s: float = TPOT_SLO_S) -> bool:
    """Whether a run's mean TTFT and mean TPOT are within the SLO."""
    return (result.get("ttft_s", float("inf")) <= ttft_slo_s
            and result.get("tpot_s", float("inf")) <= tpot_slo_s)


def aps_capacity(rows: list[dict[str, Any]], mode: str, ttft_slo_s: float = TTFT_SLO_S,
                 tpot_slo_s: float = TPOT_SLO_S) -> float | None:
    """The largest APS of ``mode``'s rows that meets the SLO with every lower APS meeting it
    too (None if the lowest already fails)."""
    best = None
    for row in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["aps"]):
        if not meets_slo(row, ttft_slo_s, tpot_slo_s):
            break
        best = row["aps"]
    return best
