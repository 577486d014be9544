"""Writing benchmark results: JSON with the machine profile, and a PNG bar chart."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
                "amx_bf16", "amx_int8")  # what decides CPU inference speed


def cpu_flags() -> list[str]:
    """The vector extensions of ``VECTOR_FLAGS`` this CPU has (``/proc/cpuinfo``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                have = set(value.split())
                return [f for f in VECTOR_FLAGS if f in have]
    except OSError:
        pass
    return []


def machine_profile() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


CPU_TIME_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_ticks(stat_path: str = "/proc/stat") -> dict[str, int]:
    """The whole machine's CPU time so far, in clock ticks per ``CPU_TIME_FIELDS`` kind (Linux
    ``/proc/stat``; empty where it cannot be read)."""
    try:
        with open(stat_path) as f:
            fields = f.readline().split()
    except OSError:
        return {}
    if not fields or fields[0] != "cpu":
        return {}
    return {k: int(v) for k, v in zip(CPU_TIME_FIELDS, fields[1:], strict=False)}


def host_cpu_shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float] | None:
    """Between two ``host_cpu_ticks``: the fraction of the machine's CPU time that was busy
    (user, system, interrupts) and stolen by the hypervisor (``steal``: time the guest was
    runnable but another guest had the physical core). None without both readings."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(delta.values())
    if not before or total <= 0:
        return None
    busy = sum(delta.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq"))
    return {"busy_frac": busy / total, "steal_frac": delta.get("steal", 0) / total}


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of KV one token holds in the engines' (and the store's) layout when they compute
    in ``dtype`` (``auto``: the checkpoint's)."""
    from dualpath.kv.layout import engine_layout
    from dualpath.model.spec import load_spec

    spec = load_spec(model_dir)
    return spec.kv_bytes_per_token(engine_layout(spec, dtype, "auto", 1).dtype)


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` (must hold a ``summary``) as indented JSON; returns the path."""
    if "summary" not in result:
        raise ValueError("a benchmark result needs a top-level summary")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def bar_chart(path: str | Path, title: str, groups: list[str],
              series: dict[str, list[float]], ylabel: str) -> Path:
    """A grouped bar chart, one bar per series in each group, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
