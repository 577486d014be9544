"""Which Mooncake build is installed, and whether it can move an engine's device memory.

Two PyPI distributions provide the one ``mooncake`` module: ``mooncake-transfer-engine-non-cuda``
(CPU machines) and ``mooncake-transfer-engine`` (built with CUDA). The non-CUDA build registers
GPU memory without complaint and then fails every transfer of it (``writeBody ... Bad
address``, measured on an H200), so an engine on CUDA checks, before it builds its transfer
backend, that the CUDA build is the one installed (``require_mooncake_for``) and fails at start
with a ``MooncakeBuildError`` naming the package to install. The check reads the installed
distributions (``importlib.metadata``), not the module, which both builds name alike; with both
installed, the files are whichever came last, so that is refused too. A ``mooncake`` module
from no distribution (a source build) is taken as it is.

The CUDA build links the CUDA 12 runtime (``libcudart.so.12``), which a machine whose torch is
built for another CUDA may not have on its library path: ``load_cuda_runtime`` then loads it
from the ``nvidia-cuda-runtime-cu12`` wheel (the ``cuda`` extra installs it) before Mooncake is
imported, or fails saying what to install. Engines on the CPU need neither check.

Pure: the standard library only (``importlib.metadata``, ``ctypes``); no torch.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from dualpath.devices import is_cuda
from dualpath.errors import TransferError

CPU_DIST = "mooncake-transfer-engine-non-cuda"
CUDA_DIST = "mooncake-transfer-engine"
VERSION = "0.3.13.post1"  # requirements-{cpu,cuda}.lock pin either build at it
CUDA_RUNTIME = "libcudart.so.12"  # what the CUDA build's engine.so and store.so link
CUDA_RUNTIME_DIST = "nvidia-cuda-runtime-cu12"
CUDA_RUNTIME_WHEEL_PATH = ("nvidia", "cuda_runtime", "lib", CUDA_RUNTIME)


class MooncakeBuildError(TransferError):
    """The installed Mooncake cannot move this engine's memory (or cannot load): the message
    names the package to install."""


def installed_builds(version_of: Callable[[str], str] = importlib.metadata.version
                     ) -> dict[str, str]:
    """The Mooncake distributions installed here, name → version."""
    found = {}
    for name in (CPU_DIST, CUDA_DIST):
        try:
            found[name] = version_of(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _cuda_install(version: str) -> str:
    return (f"pip uninstall -y {CPU_DIST} {CUDA_DIST} && pip install {CUDA_DIST}=={version} "
            f"(or `pip install 'dualpath[cuda]'`; `make setup` does it where `nvidia-smi -L` "
            f"sees a GPU)")


def check_build(device: str, installed: Mapping[str, str], module_found: bool = True) -> None:
    """Raise ``MooncakeBuildError`` unless the installed builds (``installed_builds``) can move
    ``device``'s memory: any build for the CPU, the CUDA one alone for ``cuda``/``cuda:N``.
    ``module_found``: whether a ``mooncake`` module is importable at all (with neither
    distribution installed, a source build is taken as it is)."""
    if not is_cuda(device):
        return
    version = installed.get(CUDA_DIST) or installed.get(CPU_DIST) or VERSION
    if CUDA_DIST in installed and CPU_DIST in installed:
        raise MooncakeBuildError(
            f"both {CPU_DIST} {installed[CPU_DIST]} and {CUDA_DIST} {installed[CUDA_DIST]} are "
            "installed; they provide the same `mooncake` module, so its files are whichever "
            f"came last. An engine on {device} needs the CUDA build alone: "
            f"{_cuda_install(version)}")
    if CPU_DIST in installed:
        raise MooncakeBuildError(
            f"an engine on {device} needs the CUDA build of Mooncake ({CUDA_DIST}); installed "
            f"is {CPU_DIST} {installed[CPU_DIST]}, which cannot move GPU memory (every "
            f"transfer of it fails with `writeBody ... Bad address`): {_cuda_install(version)}")
    if CUDA_DIST not in installed and not module_found:
        raise MooncakeBuildError(f"an engine on {device} needs Mooncake's CUDA build: "
                                 f"{_cuda_install(version)}")


def _load_global(path: str) -> None:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def load_cuda_runtime(search_paths: Iterable[str] | None = None,
                      load: Callable[[str], None] = _load_global) -> str:
    """Make ``libcudart.so.12`` loadable for the CUDA build: from the library path if it is
    there, else from an ``nvidia-cuda-runtime-cu12`` wheel under ``search_paths`` (default
    ``sys.path``), loaded globally; returns what was loaded. ``MooncakeBuildError`` when
    neither has it."""
    try:
        load(CUDA_RUNTIME)
        return CUDA_RUNTIME
    except OSError:
        pass
    for entry in (sys.path if search_paths is None else search_paths):
        candidate = Path(entry or ".").joinpath(*CUDA_RUNTIME_WHEEL_PATH)
        if candidate.is_file():
            try:
                load(str(candidate))
            except OSError as exc:
                raise MooncakeBuildError(f"cannot load {candidate}: {exc}") from exc
            return str(candidate)
    raise MooncakeBuildError(
        f"Mooncake's CUDA build links the CUDA 12 runtime ({CUDA_RUNTIME}), which is neither "
        f"on the library path nor installed as a wheel: pip install {CUDA_RUNTIME_DIST} (the "
        "engine loads it from there), or put CUDA 12's lib64 on LD_LIBRARY_PATH")


def require_mooncake_for(device: str) -> None:
    """Fail with ``MooncakeBuildError`` unless this process's Mooncake can move ``device``'s
    memory (the CUDA build for a CUDA device, its CUDA runtime loadable); nothing to check
    for the CPU."""
    if not is_cuda(device):
        return
    installed = installed_builds()
    check_build(device, installed, importlib.util.find_spec("mooncake") is not None)
    if CUDA_DIST in installed:
        load_cuda_runtime()
