"""Which device each engine of a cluster runs on, and how much of a shared GPU it may take.

The rule (``plan_devices``; the local launcher applies it, the Ray launcher its own share):

* ``cpu``: nothing changes; no engine environment is touched.
* ``auto``: ``cuda`` when the host sees a GPU, else ``cpu`` (``resolve_device``).
* ``cuda``: the engines, in ``engine_roles`` order (prefill first), take the visible GPUs round
  robin: engine i gets GPU ``i mod n``. ``cuda:N``: every engine gets visible GPU N.
* Each engine process is started with ``CUDA_VISIBLE_DEVICES`` naming its one GPU, so inside it
  the device is ``cuda`` (``cuda:0``); the cluster's config says ``cuda``.
* Engines that share a GPU split its memory explicitly: each process may allocate
  ``gpu_memory_fraction`` of it (torch's per-process memory fraction, passed in
  ``DUALPATH_GPU_MEMORY_FRACTION``), by default ``1 / k`` for the ``k`` engines on that GPU
  (a whole GPU for an engine alone). The paged KV takes ``kv_cache_mb`` of that share; weights
  and activations the rest. Fractions that add up to more than a GPU are refused.

Pure: no torch here. The GPU count comes from the caller (``torch.cuda.device_count()`` in the
launcher, a fake in tests).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dualpath.errors import DualPathError

GPU_ENV = "CUDA_VISIBLE_DEVICES"
MEMORY_FRACTION_ENV = "DUALPATH_GPU_MEMORY_FRACTION"
_CUDA = re.compile(r"cuda(?::(\d+))?")


class DevicePlacementError(DualPathError):
    """A cluster asks for GPUs this host (or Ray cluster) does not have, or overcommits one."""


def is_cuda(device: str) -> bool:
    """Whether ``device`` names a CUDA device (``cuda`` or ``cuda:N``)."""
    return _CUDA.fullmatch(device) is not None


def resolve_device(device: str, gpu_count: int) -> str:
    """``device`` with ``auto`` resolved: ``cuda`` when ``gpu_count`` > 0, else ``cpu``. A CUDA
    device on a host without one (or ``cuda:N`` beyond the count) is a
    ``DevicePlacementError``."""
    if device == "auto":
        return "cuda" if gpu_count > 0 else "cpu"
    match = _CUDA.fullmatch(device)
    if match is None:
        return device
    if gpu_count <= 0:
        raise DevicePlacementError(f"device {device!r}, but no CUDA device is visible here")
    if match.group(1) is not None and int(match.group(1)) >= gpu_count:
        raise DevicePlacementError(f"device {device!r}, but only {gpu_count} CUDA device(s) "
                                   "are visible here")
    return device


def visible_gpu_ids(env: Mapping[str, str], gpu_count: int) -> list[str]:
    """The ids to hand to engines in ``CUDA_VISIBLE_DEVICES``, one per GPU this process sees:
    the entries of its own ``CUDA_VISIBLE_DEVICES`` when set (indices or UUIDs; the first
    ``gpu_count``), else ``0 .. gpu_count - 1``."""
    own = env.get(GPU_ENV)
    if own is None:
        return [str(i) for i in range(gpu_count)]
    return [entry.strip() for entry in own.split(",") if entry.strip()][:gpu_count]


@dataclass(frozen=True)
class EngineDevice:
    """One engine's GPU (an id for ``CUDA_VISIBLE_DEVICES``) and its share of that GPU's
    memory; ``gpu`` None: the engine runs on the CPU."""

    gpu: str | None = None
    memory_fraction: float | None = None

    def env(self) -> dict[str, str]:
        """The environment variables that place this engine (none for a CPU engine)."""
        if self.gpu is None:
            return {}
        out = {GPU_ENV: self.gpu}
        if self.memory_fraction is not None:
            out[MEMORY_FRACTION_ENV] = f"{self.memory_fraction:.6g}"
        return out


@dataclass(frozen=True)
class DevicePlan:
    """Where a cluster's engines run: the device their config names (``cpu`` or ``cuda``) and
    each engine's GPU and memory share."""

    device: str
    engines: dict[str, EngineDevice] = field(default_factory=dict)

    def env(self, name: str) -> dict[str, str]:
        """Engine ``name``'s placement variables (empty for an engine not on a GPU)."""
        return self.engines.get(name, EngineDevice()).env()

    def engines_per_gpu(self) -> dict[str, int]:
        """How many engines each GPU holds."""
        counts: dict[str, int] = {}
        for placed in self.engines.values():
            if placed.gpu is not None:
                counts[placed.gpu] = counts.get(placed.gpu, 0) + 1
        return counts


def plan_devices(names: Sequence[str], device: str, gpu_ids: Sequence[str],
                 memory_fraction: float | None = None) -> DevicePlan:
    """Place engines ``names`` (in order) for ``device`` on the GPUs ``gpu_ids`` (the module's
    rule); ``memory_fraction`` is the config's ``gpu_memory_fraction`` (None: 1 / engines on
    the GPU)."""
    device = resolve_device(device, len(gpu_ids))
    match = _CUDA.fullmatch(device)
    if match is None:
        return DevicePlan(device)
    pinned = match.group(1)
    gpus = [gpu_ids[int(pinned)] if pinned is not None else gpu_ids[i % len(gpu_ids)]
            for i in range(len(names))]
    sharing = {gpu: gpus.count(gpu) for gpu in gpus}
    for gpu, k in sharing.items():
        _check_share(k, memory_fraction, f"GPU {gpu}")
    return DevicePlan("cuda", {
        name: EngineDevice(gpu, memory_fraction if memory_fraction is not None
                           else 1 / sharing[gpu])
        for name, gpu in zip(names, gpus, strict=True)})


def ray_gpu_share(engines: int, device: str, gpus: float,
                  memory_fraction: float | None = None) -> tuple[str, float | None, float | None]:
    """Under Ray, which picks each actor's GPU itself (``cuda:N`` then means ``cuda``): the
    device the engines' config names, the fraction of a GPU each engine's actor asks for, ``1 /
    k`` with ``k`` the engines that must share a GPU for ``engines`` to fit on ``gpus`` whole
    GPUs (None: no GPU), and each engine's memory share (``memory_fraction``, else that same
    ``1 / k``: at most ``k`` such actors fit on one GPU)."""
    whole = int(gpus)
    device = resolve_device("cuda" if is_cuda(device) else device, whole)
    if not is_cuda(device):
        return device, None, None
    per_gpu = -(-engines // whole)
    _check_share(per_gpu, memory_fraction, f"a GPU (of {whole} for {engines} engines)")
    return "cuda", 1 / per_gpu, memory_fraction if memory_fraction is not None else 1 / per_gpu


def _check_share(engines: int, memory_fraction: float | None, where: str) -> None:
    """``DevicePlacementError`` when ``engines`` that each take ``memory_fraction`` of a GPU
    would take more than all of it."""
    if memory_fraction is not None and engines * memory_fraction > 1 + 1e-9:
        raise DevicePlacementError(
            f"{engines} engines on {where} with gpu_memory_fraction={memory_fraction:g} each "
            f"would take {engines * memory_fraction:.2f} of it: lower the fraction to at most "
            f"{1 / engines:.3g} (or leave it unset for an even split)")


def memory_fraction_from(env: Mapping[str, str], configured: float | None) -> float | None:
    """The memory share an engine process applies: its launcher's (``MEMORY_FRACTION_ENV``),
    else the config's ``gpu_memory_fraction``, else None (no cap: a GPU of its own)."""
    raw = env.get(MEMORY_FRACTION_ENV)
    if raw is None:
        return configured
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise DevicePlacementError(f"{MEMORY_FRACTION_ENV}={raw!r}: expected a fraction in "
                                   "(0, 1]")
    return value


def check_kv_fits(kv_cache_mb: int, num_kv_blocks: int | None, fraction: float,
                  total_mib: int) -> None:
    """``DevicePlacementError`` when an engine's KV budget (``kv_cache_mb``; not checked when
    ``num_kv_blocks`` sets it) is larger than its share (``fraction``) of a GPU of
    ``total_mib``."""
    share_mib = fraction * total_mib
    if num_kv_blocks is None and kv_cache_mb > share_mib:
        raise DevicePlacementError(
            f"kv_cache_mb={kv_cache_mb} does not fit this engine's share of its GPU: "
            f"{fraction:.3g} of {total_mib} MiB = {share_mib:.0f} MiB (weights and activations "
            "need room too): lower kv_cache_mb or put fewer engines on the GPU")
