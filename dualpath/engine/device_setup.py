"""An engine process's device, set up before its model loads (``dualpath/devices.py`` has the
rule): ``auto`` resolved against the GPUs this process sees, Mooncake's build checked against
the device (``transfer/mooncake_build.py``), and the process's share of a shared GPU's memory
applied as torch's per-process memory fraction, with the KV budget checked against it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from dualpath.config import EngineConfig
from dualpath.devices import (
    GPU_ENV,
    DevicePlacementError,
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
        check_kv_fits(engine, fraction, total_mib)
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("engine on %s (%s=%s): %s of its %d MiB", device, GPU_ENV,
             env.get(GPU_ENV, "unset"), "all" if fraction is None else f"{fraction:.3g}",
             total_mib)
    return device


def check_kv_fits(engine: EngineConfig, fraction: float, total_mib: int) -> None:
    """``DevicePlacementError`` when the engine's KV budget (``kv_cache_mb``; not checked when
    ``num_kv_blocks`` sets it) is larger than its share of the GPU."""
    share_mib = fraction * total_mib
    if engine.num_kv_blocks is None and engine.kv_cache_mb > share_mib:
        raise DevicePlacementError(
            f"kv_cache_mb={engine.kv_cache_mb} does not fit this engine's share of its GPU: "
            f"{fraction:.3g} of {total_mib} MiB = {share_mib:.0f} MiB (weights and activations "
            "need room too): lower kv_cache_mb or put fewer engines on the GPU")
