"""The demo's figures: reads per node, one mode's summary, the table, and warnings."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from dualpath.regime import recompute_s_per_token
from dualpath.vocab import Role

COUNTERS = ("read_bytes", "read_deadline_misses", "compute_s", "computed_tokens", "forwards")


def node_reads(metrics: dict[str, dict]) -> list[dict[str, Any]]:
    """Per node (sorted by id): its role, the bytes its storage NIC read, and its prefill
    engines' compute (forward time less the waits for layer loads and sends) and tokens."""
    nodes: dict[int, dict[str, Any]] = {}
    for m in metrics.values():
        node = nodes.setdefault(int(m["node_id"]), {"node_id": int(m["node_id"]),
                                                    "role": m["role"],
                                                    **dict.fromkeys(COUNTERS, 0)})
        node["read_bytes"] += int(m.get("storage_snic_read_bytes", 0))
        node["read_deadline_misses"] += int(m.get("storage_read_deadline_misses", 0))
        node["compute_s"] += m.get("forward_s_total", 0.0) - m.get("layer_wait_s_total", 0.0)
        node["computed_tokens"] += int(m.get("num_computed_tokens", 0))
        node["forwards"] += int(m.get("num_forwards", 0))
    return [nodes[k] for k in sorted(nodes)]


def summarize(row: dict[str, Any], read_cap_mb_s: float, cores: int) -> dict[str, Any]:
    """The table's figures of one mode's run (``run_turns`` output plus ``nodes`` and the
    engines' ``cpu_s`` by role) on a host of ``cores`` CPUs."""
    records = [r for recs in row["records"] for r in recs]
    n = max(1, len(records))
    pe = [x["read_bytes"] for x in row["nodes"] if x["role"] == Role.PREFILL]
    de = [x["read_bytes"] for x in row["nodes"] if x["role"] == Role.DECODE]
    compute_s = sum(x["compute_s"] for x in row["nodes"] if x["role"] == Role.PREFILL)
    computed = sum(x["computed_tokens"] for x in row["nodes"] if x["role"] == Role.PREFILL)
    return {"jct_s": row["jct_s"], "mean_ttft_s": sum(r.ttft_s for r in records) / n,
            "mean_turn_latency_s": sum(r.latency_s for r in records) / n,
            "hit_rate": row["hit_tokens"] / max(1, row["prompt_tokens"]),
            "hit_tokens": row["hit_tokens"], "prompt_tokens": row["prompt_tokens"],
            "recompute_s_per_token": recompute_s_per_token(compute_s, computed),
            "pe_read_bytes": pe, "de_read_bytes": de,
            # bytes the busiest prefill-node NIC read / what its cap allows over the JCT
            "pe_snic_busy": max(pe, default=0) / (read_cap_mb_s * 1e6 * row["jct_s"]),
            "read_deadline_misses": sum(x["read_deadline_misses"] for x in row["nodes"]),
            "retried_turns": sum(r.attempts > 1 for r in records),
            "engine_cpu_s": sum(row.get("cpu_s", {}).values()),
            # the engines' CPU-seconds / what the host's cores give over the JCT: near 100%,
            # the mode is CPU-bound whatever its NICs could carry
            "cores_busy": sum(row.get("cpu_s", {}).values()) / (max(1, cores) * row["jct_s"])}


def minus_reads(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-node counters of ``after`` less those of ``before`` (same nodes, same order)."""
    return [{**a, **{k: a[k] - b[k] for k in COUNTERS}}
            for a, b in zip(after, before, strict=True)]


def _mb(values: list[int]) -> str:
    return ", ".join(f"{v / 1e6:,.0f}" for v in values) or "-"


def render_table(result: dict[str, Any]) -> Table:
    """The demo's one table: per mode JCT, TTFT, turn latency, hit rate, reads, speed-up."""
    w, m = result["workload"], result["machine"]
    table = Table(box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left",
                  title=f"[bold]DualPath demo[/]: {w['sessions']} Weka agent sessions, turns 2-"
                  f"{w['turns']} timed (tokens / {w['scale']}), {result['model']} ("
                  f"{result['cluster']['dtype']}), 1 PE + 2 DE, storage NIC "
                  f"{result['caps_mb_s']['read']:g} MB/s per node; {m['cpu_model']}, "
                  f"{m['cpus']} cores\nregime: {result['summary']['regime']['line']} "
                  "(h: hit rate; κ: loading a token over one storage NIC / recomputing it; "
                  "ρ: Basic's storage demand / supply)",
                  caption="JCT: until the last agent's last turn. TTFT: submit to first token; "
                  "turn: submit to last token (means over turns). Hit: prompt tokens loaded "
                  "from storage. Read: MB through each node's storage NIC. PE busy: PE node "
                  "reads / (cap x JCT). Cores busy: the engines' CPU-seconds / (cores x JCT). "
                  "Speed-up: basic JCT / JCT.")
    for col in ("mode", "JCT\n(s)", "TTFT\n(s)", "turn\n(s)", "hit\nrate", "read PE\n(MB)",
                "read DEs\n(MB)", "PE\nbusy", "cores\nbusy", "speed-\nup"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    base = result["summary"]["jct_s"].get("basic")
    for mode, s in result["modes"].items():
        speedup = f"{base / s['jct_s']:.2f}x" if base else "-"
        table.add_row(mode, f"{s['jct_s']:.1f}", f"{s['mean_ttft_s']:.2f}",
                      f"{s['mean_turn_latency_s']:.2f}", f"{s['hit_rate']:.1%}",
                      _mb(s["pe_read_bytes"]), _mb(s["de_read_bytes"]),
                      f"{s['pe_snic_busy']:.0%}", f"{s['cores_busy']:.0%}", speedup)
    return table


def warn_if_misleading(result: dict[str, Any], console: Console) -> None:
    """Say so when a figure is not what it seems (reads given up at their deadline)."""
    for mode, s in result["modes"].items():
        if s["retried_turns"]:
            console.print(f"[yellow]{mode}: {s['retried_turns']} turns were placed more than "
                          "once (an engine failed them or lost track of them)[/]")
        if s["read_deadline_misses"]:
            console.print(f"[yellow]{mode}: {s['read_deadline_misses']} block reads missed "
                          "their deadline and were recomputed[/]")
