"""This host's GPUs as torch counts them, and a device of ``auto`` resolved against them
(``devices.py`` has the rules; torch is imported only when a GPU count is needed, so a CPU
cluster never asks).

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
