"""An engine process's device, set up before its model loads (``dualpath/devices.py`` has the
rules; this module applies them with torch): ``auto`` resolved against the GPUs this process
sees, Mooncake's build checked against the device (``transfer/mooncake_build.py``), and the
process's share of a shared GPU's memory applied as torch's per-process memory fraction, with
the KV budget checked against it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from dualpath.config import EngineConfig
from dualpath.devices import (
    GPU_ENV,
    check_kv_fits,
    is_cuda,
    memory_fraction_from,
    resolve_device,
)
from dualpath.transfer.mooncake_build import require_mooncake_for

log = logging.getLogger("dualpath.engine")
MIB = 1 << 20


def prepare_engine_device(engine: EngineConfig, env: Mapping[str, str] | None = None) -> str:
    """Set up this process for ``engine`` (the engine's role config); returns its device with
    ``auto`` resolved. Raises ``MooncakeBuildError`` when the installed Mooncake cannot move
    the device's memory, ``DevicePlacementError`` when the KV budget does not fit the share."""
    env = os.environ if env is None else env
    count = 0 if engine.device == "cpu" else torch.cuda.device_count()
    device = resolve_device(engine.device, count)
    if not is_cuda(device):
        return device
    require_mooncake_for(device)
    fraction = memory_fraction_from(env, engine.gpu_memory_fraction)
    index = torch.device(device).index or 0
    total_mib = torch.cuda.get_device_properties(index).total_memory // MIB
    if fraction is not None:
        check_kv_fits(engine.kv_cache_mb, engine.num_kv_blocks, fraction, total_mib)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("engine on %s (%s=%s): %s of its %d MiB", device, GPU_ENV,
             env.get(GPU_ENV, "unset"), "all" if fraction is None else f"{fraction:.3g}",
             total_mib)
    return device
