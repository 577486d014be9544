"""This host's GPUs as torch counts them, and a device of ``auto`` resolved against them
(``devices.py`` has the rules; torch is imported only when a GPU count is needed, so a CPU
cluster never asks); whether this host's device computes bfloat16 natively, for the
benchmarks' dtype of ``auto``.

The local launcher (``server/launch.py``), the command lines' engine options
(``commands/args.py``) and the benchmarks resolve ``auto`` here."""

from __future__ import annotations

import os
from collections.abc import Mapping

from dualpath.devices import resolve_device, visible_gpu_ids


def local_gpu_ids(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process sees, as ids for ``CUDA_VISIBLE_DEVICES`` (torch's count; no CUDA
    context is created)."""
    import torch

    return visible_gpu_ids(os.environ if env is None else env, torch.cuda.device_count())


def resolve_local_device(device: str) -> str:
    """``device`` for engines on this host: ``auto`` becomes ``cuda`` where it has a GPU, else
    ``cpu``; a CUDA device it does not have is a ``DevicePlacementError``."""
    if device == "cpu":
        return device
    return resolve_device(device, len(local_gpu_ids()))


# CPU flags of native bfloat16 arithmetic (dot products, or AMX tiles): without them torch
# converts, and one of our engines prefilled 111-120 tok/s in bf16 against 286-369 in float32
# (a Xeon with AVX-512 but no AVX512_BF16); with them bf16 is faster (an AMD EPYC: the demo's
# oracle 2.1 s against 3.0 s, docs/results.md)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; none where absent)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def bench_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """A benchmark's engine dtype: ``auto`` is bfloat16 where ``device`` (resolved) computes it
    natively (CUDA, or a CPU with ``NATIVE_BF16_FLAGS``), else float32; others as given."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags) \
        else "float32"
