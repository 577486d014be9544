"""Building and loading dualpath's CPU kernels (``cpu_kernels.c``) as an extension module.

Build: the first process that needs them compiles ``cpu_kernels.c`` with the system C
compiler (``$CC``, else ``cc``/``gcc``; ``-O3 -march=native``, about two seconds) against this
Python's headers into ``$DUALPATH_CACHE_DIR/kernels/``, named by a hash of the source, the
compiler, the flags, the Python and this CPU, and renamed into place, so concurrent engines
never load half a file and another CPU model never loads this one's build. ``kernels.py``
wraps the loaded module (``CpuKernels``) and decides whether to use it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=gnu11", "-fPIC",
          "-shared")
MODULE_NAME = "dualpath_cpu_kernels"

class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


def _compiler() -> str:
    named = os.environ.get("CC")
    if named:
        cc = shutil.which(named)
        if not cc:
            raise KernelBuildError(f"no C compiler: $CC={named} is not an executable")
        return cc
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler: neither cc nor gcc on $PATH (make setup installs "
                               "gcc; or set $CC)")
    return cc


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_id() -> str:
    """The CPU's model and flags: a build for one CPU must not load on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(keep[:2])


def library_path() -> Path:
    """Where this machine's build lives (built now if it is not there yet)."""
    from dualpath.model.default_model import cache_dir

    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.stdout.encode(), " ".join(CFLAGS).encode(),
                 sys.version.encode(), _cpu_id().encode()):
        digest.update(part)
    folder = cache_dir() / "kernels"
    path = folder / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if not path.is_file():
        _build(cc, folder, path)
    return path


def _build(cc: str, folder: Path, path: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        include = sysconfig.get_paths()["include"]
        done = subprocess.run([cc, *CFLAGS, f"-I{include}", str(SOURCE.resolve()), "-o", tmp,
                               "-lm"], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            hint = ("" if (Path(include) / "Python.h").is_file()
                    else f" (no Python.h in {include}: make setup installs the Python headers)")
            raise KernelBuildError(f"{cc} failed on {SOURCE.name}{hint}: "
                                   f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_module(path: Path) -> object:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    if spec is None:
        raise KernelBuildError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
