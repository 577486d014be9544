"""``dualpath bench agents`` results: per-mode figures, the summary, the table, the plots, and
the simulator's prediction of the same workload.

The summary's ratios: ``speedup_dualpath_vs_basic`` (basic JCT / dualpath JCT),
``dualpath_vs_oracle`` (oracle JCT / dualpath JCT), ``recompute_vs_basic`` (recompute JCT /
basic JCT: what reusing KV is worth), ``speedup_dualpath_vs_plain_vllm`` (with
vLLM engines: the plain vLLM row's JCT / dualpath JCT, at the same device KV; the budget and the
working set are ``summary.plain_vllm``), ``aps_ratio_dualpath_vs_basic`` (online
capacities; ``..._at_least`` where basic met the SLO at no APS tried), the measured hit rate
beside the workload's expected one, and each node's storage-NIC busy fraction
(bytes read / (cap × JCT)) per mode.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from dualpath.bench.agents.kv_budget import PLAIN_ROW
from dualpath.bench.cluster import COMPUTE_PER_STORAGE
from dualpath.bench.report import write_json
from dualpath.regime import ladder_regime, recompute_s_per_token
from dualpath.vocab import Mode, Rung

BREAKDOWN = ("queue_s", "read_s", "prefill_s", "other_s", "transfer_s", "queue_router_s",
             "queue_pe_s", "read_pe_s")


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return mean(kept) if kept else None


def mode_figures(row: dict[str, Any]) -> dict[str, Any]:
    """One offline mode's figures from its records and NIC samples."""
    records = row["records"]
    prompt = sum(r["prompt_tokens"] for r in records)
    nodes = row["nics"]["nodes"]
    timed = [r["timings"] for r in records if r.get("timings")]
    return {
        "jct_s": row["jct_s"], "turns": len(records),
        "mean_ttft_s": _mean([r["ttft_s"] for r in records]),
        "mean_ttst_s": _mean([r["ttst_s"] for r in records]),
        "mean_tpot_s": _mean([r["tpot_s"] for r in records]),
        "mean_latency_s": _mean([r["latency_s"] for r in records]),
        "hit_rate": sum(r["hit_tokens"] for r in records) / max(1, prompt),
        "hit_tokens": sum(r["hit_tokens"] for r in records), "prompt_tokens": prompt,
        "recompute_s_per_token": _recompute_s_per_token(row, records),
        "read_paths": dict(Counter(r.get("read_path", "?") for r in records)),
        "snic_read_mb": {n: v["snic_bytes"] / 1e6 for n, v in nodes.items()},
        "snic_busy": {n: v.get("snic_busy") for n, v in nodes.items()},
        "cnic_mb": {n: v["cnic_bytes"] / 1e6 for n, v in nodes.items()},
        "roles": {n: v["role"] for n, v in nodes.items()},
        "ttft_breakdown_s": {k: _mean([t.get(k) for t in timed]) for k in BREAKDOWN}
        if timed else None,
        "retried_turns": sum(r.get("attempts", 1) > 1 for r in records),
        # seconds each engine spent in forwards (PE) or decode steps (DE) / JCT
        "engine_busy": {e: s / row["jct_s"] for e, s in row.get("engine_busy_s", {}).items()},
        "prefill_time_s": prefill_time(row),
        "engine_thread_wakeups": thread_wakeups(row),
        "host_cpu": row.get("host_cpu"),
    }


def prefill_time(row: dict[str, Any]) -> dict[str, float] | None:
    """Where the prefill engines' forward time went in the timed run, summed over them:
    ``forwards_s`` (their wall time), the loop thread's ``on_cpu_s`` and ``waiting_for_core_s``
    (runnable, no core free: Linux schedstat), how often it was preempted (``loop_preemptions``,
    a count) and ``layer_waits_s`` (blocked on layerwise loads and sends). On a small testbed
    the engines and the NIC emulation share the cores, so this says how much of a mode's gap
    to the oracle is the machine rather than the mechanism. The loop's counters include its
    time between forwards (small while it is busy). None without the counters (``--via
    http``)."""
    busy, loops = row.get("engine_busy_s", {}), row.get("engine_loop_s", {})
    names = [e for e in busy if e.startswith("pe") and "loop_cpu_s" in loops.get(e, {})]
    if not names:
        return None
    return {"forwards_s": sum(busy[e] for e in names),
            "on_cpu_s": sum(loops[e]["loop_cpu_s"] for e in names),
            "waiting_for_core_s": sum(loops[e].get("loop_runqueue_wait_s", 0.0) for e in names),
            "loop_preemptions": sum(loops[e].get("loop_preemptions", 0.0) for e in names),
            "layer_waits_s": sum(loops[e].get("layer_wait_s_total", 0.0) for e in names)}


def _recompute_s_per_token(row: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    """The prefill engines' seconds per computed prompt token in the timed run: their forward
    time less the waits for layer loads and sends, over the tokens they computed (None
    without the counters, ``--via http``)."""
    time_s = prefill_time(row)
    if time_s is None:
        return None
    computed = sum(r["prompt_tokens"] - r["hit_tokens"] for r in records)
    return recompute_s_per_token(max(0.0, time_s["forwards_s"] - time_s["layer_waits_s"]),
                                 computed)


def thread_wakeups(row: dict[str, Any]) -> float | None:
    """How many times the threads of every engine woke up in the timed run (voluntary context
    switches, ``engine/sched_counters.py``): the hand-offs of moving KV between threads and
    processes, which on a small testbed preempt the forwards. None without the counters."""
    counts = [c["thread_wakeups"] for c in row.get("engine_loop_s", {}).values()
              if "thread_wakeups" in c]
    return sum(counts) if counts else None


def simulate_same(profile: str, sim_turns: list[list[Any]], modes: tuple[str, ...],
                  prefill: int, decode: int) -> dict[str, float]:
    """The simulator's JCT per mode for the very same trajectories on the profiled testbed
    (the ``testbed`` preset's settings: one engine per node, FIFO reads per node); the
    simulator models the rungs that reuse KV, so ``recompute`` has none."""
    from dataclasses import replace

    from dualpath.sim.cluster import simulate
    from dualpath.sim.config import SimConfig
    from dualpath.sim.profiles import testbed_profile

    base = SimConfig(testbed=testbed_profile(profile), prefill_nodes=prefill,
                     decode_nodes=decode, ep_lockstep=False, basic_prefetch=True,
                     read_streams=1)
    out = {}
    for mode in (m for m in modes if m in tuple(Rung) and Rung(m).reuses_kv):
        cfg = replace(base, mode=mode, workload=replace(base.workload, agents=len(sim_turns)))
        out[mode] = float(simulate(cfg, trajectories=sim_turns)["jct_s"])
    return out


def _ratios(jct: dict[str, float], prefix: str = "") -> dict[str, float]:
    out = {}
    if Rung.BASIC in jct and Rung.DUALPATH in jct:
        out[f"{prefix}speedup_dualpath_vs_basic"] = jct[Rung.BASIC] / jct[Rung.DUALPATH]
    if Rung.ORACLE in jct and Rung.DUALPATH in jct:
        out[f"{prefix}dualpath_vs_oracle"] = jct[Rung.ORACLE] / jct[Rung.DUALPATH]
    if PLAIN_ROW in jct and Rung.DUALPATH in jct:
        out[f"{prefix}speedup_dualpath_vs_plain_vllm"] = jct[PLAIN_ROW] / jct[Rung.DUALPATH]
    if Rung.BASIC in jct and Mode.RECOMPUTE in jct:
        out[f"{prefix}recompute_vs_basic"] = jct[Mode.RECOMPUTE] / jct[Rung.BASIC]
    return out


def aps_ratio(online: list[dict[str, Any]]) -> dict[str, float]:
    """``aps_ratio_dualpath_vs_basic`` (dualpath's online capacity / basic's); where basic
    missed the SLO at every APS tried, its capacity lies below the lowest of them, so
    ``aps_ratio_dualpath_vs_basic_at_least`` bounds the ratio from below instead."""
    by_mode = {o["mode"]: o for o in online}
    if Rung.BASIC not in by_mode or Rung.DUALPATH not in by_mode:
        return {}
    dualpath_aps = by_mode[Rung.DUALPATH]["capacity_aps"]
    basic_aps = by_mode[Rung.BASIC]["capacity_aps"]
    if not dualpath_aps:
        return {}
    if basic_aps:
        return {"aps_ratio_dualpath_vs_basic": dualpath_aps / basic_aps}
    lowest_missed_aps = min(t["aps"] for t in by_mode[Rung.BASIC]["trials"])
    return {"aps_ratio_dualpath_vs_basic_at_least": dualpath_aps / lowest_missed_aps}


def build_result(options: Any, workload: Any, model: str, offline: list[dict[str, Any]],
                 online: list[dict[str, Any]], kv_bytes_per_token: int) -> dict[str, Any]:
    """The result: options, workload, every mode's figures and records, online trials, the
    simulator's prediction, and the summary."""
    from dualpath.bench.agents.turns import expected_hit_rate, timed_sim_turns

    modes = {r["mode"]: mode_figures(r) for r in offline}
    jct = {m: f["jct_s"] for m, f in modes.items()}
    summary: dict[str, Any] = {"jct_s": jct, **_ratios(jct),
                               "speedup_vs_basic": {m: jct[Rung.BASIC] / t for m, t in jct.items()}
                               if Rung.BASIC in jct else {},
                               "hit_rate": {m: f["hit_rate"] for m, f in modes.items()},
                               # of the ladder's rungs: plain vLLM's hits are its device's
                               "regime": ladder_regime({m: f for m, f in modes.items()
                                                        if m != PLAIN_ROW}, kv_bytes_per_token,
                                                       options.read_cap_mb_s),
                               "expected_hit_rate": expected_hit_rate(workload, options),
                               "snic_busy": {m: f["snic_busy"] for m, f in modes.items()},
                               "mean_ttft_s": {m: f["mean_ttft_s"] for m, f in modes.items()},
                               "prefill_time_s": {m: f["prefill_time_s"] for m, f in modes.items()
                                                  if f["prefill_time_s"]},
                               "engine_thread_wakeups": {
                                   m: f["engine_thread_wakeups"] for m, f in modes.items()
                                   if f["engine_thread_wakeups"] is not None},
                               "host_cpu_steal_frac": {m: f["host_cpu"]["steal_frac"]
                                                       for m, f in modes.items() if f["host_cpu"]}}
    capacity = {o["mode"]: o["capacity_aps"] for o in online}
    if online:
        summary["online_capacity_aps"] = capacity
        summary["ttft_slo_s"] = online[0]["ttft_slo_s"]
    summary.update(aps_ratio(online))
    sim = None
    if options.profile:
        sim_jct = simulate_same(options.profile, timed_sim_turns(workload, options), tuple(jct),
                                options.prefill, options.decode)
        sim = {"profile": options.profile, "jct_s": sim_jct, **_ratios(sim_jct)}
        summary["simulator"] = {k: v for k, v in sim.items() if k != "profile"}
    return {"benchmark": "agents", "model": model, "options": asdict(options),
            "workload": {"name": workload.name, "agents": len(workload.agents),
                         "turns": sum(map(len, workload.agents)), **workload.info},
            "caps_mb_s": {"read": options.read_cap_mb_s,
                          "compute": options.compute_cap_mb_s
                          or COMPUTE_PER_STORAGE * options.read_cap_mb_s},
            "modes": modes, "offline": offline, "online": online, "simulator": sim,
            "summary": summary}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def offline_table(result: dict[str, Any]) -> Table:
    """Per mode: JCT, speed-up, TTFT and its parts, hit rate, reads and busy per node."""
    m, w = result["machine"], result["workload"]
    table = Table(box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left",
                  title=f"[bold]bench agents, offline[/]: {w['name']}, {w['agents']} agents, "
                  f"{w['turns']} turns; {result['model']}; storage NIC "
                  f"{result['caps_mb_s']['read']:.1f} MB/s per node; {m['cpu_model']}, "
                  f"{m['cpus']} cores\nregime: {result['summary']['regime']['line']} (h: hit "
                  "rate; κ: loading a token over one storage NIC / recomputing it; ρ: Basic's "
                  "storage demand / supply)" + _plain_vllm_line(result),
                  caption="TTFT parts (means): queue / read / prefill / other; then transfer "
                  "to decode. Read: MB each node's storage NIC read (PE node first). Busy: "
                  "bytes read / (cap x JCT).")
    for col in ("mode", "JCT (s)", "vs basic", "TTFT (s)", "q/read/pf/other (s)", "xfer (s)",
                "TPOT (ms)", "hit", "read MB", "busy"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    base = result["summary"]["jct_s"].get("basic")
    for mode, f in result["modes"].items():
        b = f["ttft_breakdown_s"] or {}
        parts = "/".join(_fmt(b.get(k), ".2f") for k in BREAKDOWN[:4]) if b else "-"
        busy = ", ".join(_fmt(v, ".0%") for v in f["snic_busy"].values())
        reads = ", ".join(f"{v:,.0f}" for v in f["snic_read_mb"].values())
        tpot = f["mean_tpot_s"] * 1e3 if f["mean_tpot_s"] is not None else None
        table.add_row(mode, f"{f['jct_s']:.1f}", f"{base / f['jct_s']:.2f}x" if base else "-",
                      _fmt(f["mean_ttft_s"], ".2f"), parts, _fmt(b.get("transfer_s"), ".2f"),
                      _fmt(tpot, ".0f"), f"{f['hit_rate']:.1%}", reads, busy)
    return table


def _plain_vllm_line(result: dict[str, Any]) -> str:
    """The title's line on the vLLM instances' device KV and the working set ("" without)."""
    plain = result["summary"].get("plain_vllm")
    if not plain:
        return ""
    return (f"\nvLLM instances (plain and ours): {plain['instances']} x "
            f"{plain['kv_budget_bytes_each'] / 1e6:,.1f} MB device KV "
            f"({plain['kv_budget_blocks_each']} blocks each); working set "
            f"{plain['working_set_bytes'] / 1e6:,.1f} MB = "
            f"{plain['working_set_over_budget']:.1f}x their total; sessions sticky")


def online_table(result: dict[str, Any]) -> Table:
    """Per mode and APS: TTFT, TTST, TPOT over the steady window; the capacity."""
    slo = result["summary"].get("ttft_slo_s")
    table = Table(box=box.SIMPLE_HEAD, title_justify="left",
                  title=f"[bold]bench agents, online[/]: Poisson arrivals; SLO mean TTFT <= "
                  f"{slo:g} s (testbed scale)")
    for col in ("mode", "APS", "TTFT (s)", "p90", "TTST (s)", "TPOT (ms)", "SLO", "capacity"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for o in result["online"]:
        for t in o["trials"]:
            tpot = t["tpot_s"] * 1e3 if t["tpot_s"] is not None else None
            table.add_row(o["mode"], f"{t['aps']:.3f}", _fmt(t["ttft_s"], ".2f"),
                          _fmt(t["ttft_p90_s"], ".2f"), _fmt(t["ttst_s"], ".2f"),
                          _fmt(tpot, ".0f"), "met" if t["meets_slo"] else "missed",
                          _fmt(o["capacity_aps"], ".3f"))
    return table


def print_report(result: dict[str, Any], console: Console) -> None:
    """The tables and the headline ratios."""
    s = result["summary"]
    if result["modes"]:
        console.print(offline_table(result))
    if result["online"]:
        console.print(online_table(result))
    lines = [f"{k}: {s[k]:.2f}" for k in ("speedup_dualpath_vs_basic", "dualpath_vs_oracle",
                                          "recompute_vs_basic",
                                          "speedup_dualpath_vs_plain_vllm",
                                          "aps_ratio_dualpath_vs_basic",
                                          "aps_ratio_dualpath_vs_basic_at_least") if k in s]
    lines.append(f"hit rate measured {', '.join(f'{m} {v:.1%}' for m, v in s['hit_rate'].items())}"
                 f"; expected {s['expected_hit_rate']:.1%}")
    for mode, t in s.get("prefill_time_s", {}).items():
        steal = s.get("host_cpu_steal_frac", {}).get(mode)
        wakeups = s.get("engine_thread_wakeups", {}).get(mode)
        lines.append(f"PE forwards, {mode}: {t['forwards_s']:.1f} s; its loop on a core "
                     f"{t['on_cpu_s']:.1f} s, waiting for one {t['waiting_for_core_s']:.1f} s "
                     f"(preempted {t.get('loop_preemptions', 0):,.0f} times), for layer "
                     f"loads/sends {t['layer_waits_s']:.1f} s"
                     + (f"; the engines' threads woke {wakeups:,.0f} times"
                        if wakeups is not None else "")
                     + (f"; the hypervisor stole {steal:.0%} of the host's CPU"
                        if steal is not None else ""))
    if "simulator" in s:
        sim = s["simulator"]
        lines.append("simulator on the same workload: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sim.items() if not isinstance(v, dict)))
    for line in lines:
        console.print(line)


def write_report(result: dict[str, Any], json_path: str, console: Console) -> Path:
    """JSON beside a PNG of four panels."""
    from dualpath.bench.agents.plot import plot_agents

    path = write_json(json_path, result)
    png = plot_agents(result, path.with_suffix(".png"))
    console.print(f"wrote {path} and {png}")
    return path
