"""dualpath's CPU kernels (``cpu_kernels.c``): built once per machine as an extension module.

The forward's small ops cost more than their arithmetic on one core: RMSNorm is seven torch
ops, the rotary embedding ten, and attention over the paged cache gathers every sequence's
context into a new tensor on every layer before two batched matmuls and their copies. The C
kernels do each of these in one pass over the data, in place where the torch code makes a new
tensor; attention reads the keys and values where they lie in the paged cache.

Build: the first process that needs them compiles ``cpu_kernels.c`` with the system C
compiler (``$CC``, else ``cc``/``gcc``; ``-O3 -march=native``, about two seconds) against this
Python's headers into ``$DUALPATH_CACHE_DIR/kernels/``, named by a hash of the source, the
compiler, the flags, the Python and this CPU, and renamed into place, so concurrent engines
never load half a file and another CPU model never loads this one's build. Calls go through
the module's fast-call functions (about a microsecond; ctypes took several per call, dozens
of calls a step). No compiler, no AVX-512F, a failed build, a dtype other than fp32 or bf16,
or ``DUALPATH_CPU_KERNELS=0``: the model runs the plain torch ops (the reference the kernels
are tested against) and says why once in the log.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from dualpath.model.attention import KernelMeta

log = logging.getLogger("dualpath.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=gnu11", "-fPIC",
          "-shared")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MODULE_NAME = "dualpath_cpu_kernels"
MAX_HEAD_DIM = 128  # the kernels keep a head in at most 8 vectors of 16 lanes
ENV_SWITCH = "DUALPATH_CPU_KERNELS"

class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler (set $CC, or install gcc)")
    return cc


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
            raise KernelBuildError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_module(path: Path) -> object:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    if spec is None:
        raise KernelBuildError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class CpuKernels:
    """The loaded module: one method per kernel, on torch tensors (CPU, fp32 or bf16). Row
    strides are the tensors' own; rows must be contiguous."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = lib = _load_module(path)
        if not lib.available():
            raise KernelBuildError("this CPU has no AVX-512F, which the kernels are written for")
        self.has_bf16_dot = bool(lib.has_bf16_dot())

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        """True when a model of ``dtype`` with heads of ``head_dim`` can run on the kernels."""
        return dtype in DTYPE_CODES and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of ``x [rows, n]``, as ``layers.RMSNorm``."""
        out = torch.empty_like(x)
        self.lib.rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(),
                          out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place (the residual stream), then the RMSNorm of the new ``x``."""
        out = torch.empty_like(x)
        self.lib.add_rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), delta.data_ptr(),
                              delta.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                              x.shape[0], x.shape[1], eps)
        return out

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
        """Rotate the q part of ``qkv [T, (H + 2 KVH) D]`` in place; write the rotated k and
        the v of token t into cache slot ``slot_mapping[t]`` of ``kv_layer``."""
        self.lib.rope_kv(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0],
                         heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                         kv_layer.data_ptr(), slot_mapping.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [rows, 2 * intermediate]``."""
        out = torch.empty(gate_up.shape[0], intermediate, dtype=gate_up.dtype)
        self.lib.silu_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0),
                          out.data_ptr(), out.stride(0), gate_up.shape[0], intermediate)
        return out

    def decode_attn(self, qkv: torch.Tensor, rows: torch.Tensor, kv_layer: torch.Tensor,
                    block_table: torch.Tensor, ctx_lens: torch.Tensor, heads: int,
                    kv_heads: int, head_dim: int, window: int, scale: float,
                    out: torch.Tensor) -> None:
        """Attention of the one query in row ``rows[b]`` of ``qkv`` over sequence b's paged
        context (``block_table [B, blocks]`` int32, ``ctx_lens [B]`` int32), into the same
        row of ``out``."""
        self.lib.decode_attn(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0),
                             rows.data_ptr(), kv_layer.data_ptr(), block_table.data_ptr(),
                             block_table.stride(0), ctx_lens.data_ptr(), rows.shape[0], heads,
                             kv_heads, head_dim, kv_layer.shape[1], window, scale,
                             out.data_ptr(), out.stride(0))

    def prefill_attn(self, q_rows: torch.Tensor, q_pos0: int, kv_layer: torch.Tensor,
                     slot_ids: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                     window: int, scale: float, out_rows: torch.Tensor) -> None:
        """Causal (and windowed) attention of one sequence's queries ``q_rows`` (the first at
        position ``q_pos0``) over its context, whose cache slots are ``slot_ids`` (int64)."""
        self.lib.prefill_attn(DTYPE_CODES[q_rows.dtype], q_rows.data_ptr(), q_rows.stride(0),
                              q_rows.shape[0], q_pos0, kv_layer.data_ptr(), slot_ids.data_ptr(),
                              slot_ids.shape[0], heads, kv_heads, head_dim, window, scale,
                              out_rows.data_ptr(), out_rows.stride(0))

    def attend(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
               meta: KernelMeta, window: int, scale: float) -> torch.Tensor:
        """A layer's attention in one call: ``rope_kv`` of every new token, then every prefill
        slice's ``prefill_attn`` and the decode rows' ``decode_attn``; the output rows
        ``[T, heads * head_dim]``."""
        out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype)
        self.lib.attend(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0],
                        heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                        kv_layer.data_ptr(), meta.slot_ptr, kv_layer.shape[1], window, scale,
                        out.data_ptr(), out.stride(0), meta.num_prefills, meta.prefill_ptr,
                        meta.num_decodes, meta.rows_ptr, meta.table_ptr, meta.table_stride,
                        meta.ctx_ptr)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of a 2-D tensor with contiguous rows, as int64 (first on ties)."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.lib.argmax_rows(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0],
                             x.shape[1], out.data_ptr())
        return out


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(-1).tolist()`` for a 2-D tensor, on the kernels when they can take it (torch's
    CPU argmax over a 49k vocabulary at 32 rows took 0.9 ms in fp32, 5.3 ms in bf16)."""
    kernels = load_kernels()
    if (kernels is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in DTYPE_CODES
            or x.stride(1) != 1 or x.shape[1] == 0):
        return x.argmax(-1).tolist()
    return kernels.argmax_rows(x).tolist()


@functools.cache
def load_kernels() -> CpuKernels | None:
    """This machine's kernels, built on first use; None (said once in the log) when they
    cannot be had here or ``DUALPATH_CPU_KERNELS=0``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        return CpuKernels(library_path())
    except (KernelBuildError, OSError, ImportError) as exc:
        log.warning("dualpath CPU kernels unavailable, running plain torch ops: %s", exc)
        return None
