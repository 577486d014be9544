"""``bench cluster``'s terminal table: per link kind and mode, JCT, its ratio to ``basic``, the
hit rate and what each node's storage NIC read (the full result is the JSON)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from dualpath.vocab import Role


def _read_mb(metrics: dict[str, dict[str, Any]]) -> str:
    """MB each node's storage NIC read, the prefill nodes first."""
    engines = sorted(metrics.values(), key=lambda m: (m["role"] != Role.PREFILL, m["node_id"]))
    return ", ".join(f"{m['storage_bytes_read'] / 1e6:,.0f}" for m in engines)


def cluster_table(result: dict[str, Any]) -> Table:
    """One row per run: links, mode, JCT, JCT / basic's on the same links, hit rate, reads."""
    w, caps, m = result["workload"], result["caps_mb_s"], result["machine"]
    table = Table(box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left",
                  title=f"[bold]bench cluster[/]: {w['agents']} agents x {w['turns']} turns "
                  f"({w['first']} + {w['append']}/turn, {w['gen']} generated); storage NIC "
                  f"{caps['read']:g} MB/s, compute NIC {caps['compute']:g} MB/s; store "
                  f"{result['storage_backend']}; {m['cpu_model']}, {m['cpus']} cores",
                  caption="read MB: what each node's storage NIC read, prefill node first. "
                  "links: " + "; ".join(f"{k}: {v}" for k, v in result["links"].items()))
    for col in ("links", "mode", "JCT (s)", "/ basic", "hit", "read MB"):
        table.add_column(col, justify="left" if col in ("links", "mode") else "right")
    jct = result["summary"]["jct_s_by_links"]
    for row in result["rows"]:
        base = jct[row["links"]].get("basic")
        table.add_row(row["links"], row["mode"], f"{row['jct_s']:.1f}",
                      f"{row['jct_s'] / base:.2f}" if base else "-",
                      f"{row['hit_tokens'] / max(1, row['prompt_tokens']):.1%}",
                      _read_mb(row["metrics"]))
    return table
