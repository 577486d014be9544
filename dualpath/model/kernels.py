"""dualpath's CPU kernels (``cpu_kernels.c``): built once per machine as an extension module.

The forward's small ops cost more than their arithmetic on one core: RMSNorm is seven torch
ops, the rotary embedding ten, and attention over the paged cache gathers every sequence's
context into a new tensor on every layer before two batched matmuls and their copies. The C
kernels do each of these in one pass over the data, in place where the torch code makes a new
tensor; attention reads the keys and values where they lie in the paged cache. An output head
tied to the embedding table is kept once, packed for the kernels' head GEMM, and the embedding
look-up reads its rows from there.

Build: the first process that needs them compiles and loads them (``kernel_build.py``: the
system C compiler, a build per source, compiler, flags, Python and CPU). Calls go through
the module's fast-call functions (about a microsecond; ctypes took several per call, dozens
of calls a step). No compiler, no AVX-512F, a failed build, or ``DUALPATH_CPU_KERNELS=0``:
the model runs the plain torch ops (the reference the kernels are tested against) and the log
says why once (``kernel_status()`` gives the reason; ``make setup`` installs the compiler and
the Python headers). A model the kernels do not cover (``CpuKernels.refusal``: dtype, heads,
KV heads, head size, context length) runs the torch ops too, said once when it is loaded.

Safety: the kernels are handed the cache's block and slot counts, the step's rows and each
block table's width, and check every index against them before writing anything (IndexError,
as the torch path's ``index_copy_`` raises); a scratch allocation that fails is MemoryError.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from dualpath.model.attention import KernelMeta
from dualpath.model.kernel_build import KernelBuildError, cpu_flags, library_path, load_module

log = logging.getLogger("dualpath.kernels")

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 128  # the kernels keep a head in at most 8 vectors of 16 lanes
MAX_HEADS = 1024  # cpu_kernels.c's DP_MAX_HEADS: every per-head buffer is sized from the shape
MAX_CONTEXT = 1 << 24  # DP_MAX_CONTEXT: prefill's scratch grows with the context (1 KB a token)
ENV_SWITCH = "DUALPATH_CPU_KERNELS"


def _check_cache(qkv: torch.Tensor, kv_layer: torch.Tensor, kv_heads: int,
                 head_dim: int) -> None:
    """The layer's cache must be the ``[blocks, block_size, 2, kv_heads, head_dim]`` rows the
    kernels index, in the compute dtype (they write keys and values of that size)."""
    if (kv_layer.dtype != qkv.dtype or kv_layer.dim() != 5
            or kv_layer.shape[2:] != (2, kv_heads, head_dim) or not kv_layer.is_contiguous()):
        raise ValueError(f"the kernels take a contiguous {qkv.dtype} cache of rows "
                         f"[2, {kv_heads}, {head_dim}], not {kv_layer.dtype} "
                         f"{tuple(kv_layer.shape)}")


def _check_rows(t: torch.Tensor, rows: int, width: int, name: str) -> None:
    """``t`` must be ``[rows, >= width]`` with contiguous rows (what the C side walks)."""
    if t.dim() != 2 or t.shape[0] < rows or t.shape[1] < width or t.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, {width}] with contiguous rows, not "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _check_rope(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
    tokens = qkv.shape[0]
    _check_rows(qkv, tokens, (heads + 2 * kv_heads) * head_dim, "qkv")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != qkv.dtype or not table.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {qkv.dtype} table")
        _check_rows(table, tokens, head_dim, name)
        if table.shape[1] != head_dim:
            raise ValueError(f"{name} rows must hold {head_dim} values, not {table.shape[1]}")


class CpuKernels:
    """The loaded module: one method per kernel, on torch tensors (CPU, fp32 or bf16). Row
    strides are the tensors' own; rows must be contiguous."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = lib = load_module(path)
        if not lib.available():
            raise KernelBuildError("this CPU has no AVX-512F, which the kernels are written for")
        self.has_bf16_dot = bool(lib.has_bf16_dot())

    def refusal(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                max_context: int) -> str | None:
        """Why a model of this dtype and attention shape cannot run on the kernels, or None
        when it can: every shape within these bounds is one the kernels size their buffers
        for (``cpu_kernels.c``'s ``dp_check_heads``)."""
        if dtype not in DTYPE_CODES:
            return f"{dtype} (the kernels take float32 and bfloat16)"
        if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
            return f"head_dim {head_dim} (the kernels take multiples of 16 up to {MAX_HEAD_DIM})"
        if not 1 <= heads <= MAX_HEADS:
            return f"heads {heads} (the kernels take 1 to {MAX_HEADS})"
        if not 1 <= kv_heads <= heads or heads % kv_heads:
            return f"kv_heads {kv_heads} do not group {heads} query heads"
        if max_context > MAX_CONTEXT:
            return f"context {max_context} tokens (the kernels take {MAX_CONTEXT})"
        return None

    def supports(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 max_context: int) -> bool:
        """True when a model of ``dtype`` and this attention shape can run on the kernels."""
        return self.refusal(dtype, heads, kv_heads, head_dim, max_context) is None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of ``x [rows, n]``, as ``layers.RMSNorm``."""
        _check_rows(x, x.shape[0], weight.shape[0], "x")
        if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
            raise ValueError(f"a norm weight of {x.shape[1]} {x.dtype} values, not "
                             f"{tuple(weight.shape)} {weight.dtype}")
        out = torch.empty_like(x)
        self.lib.rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(),
                          out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``x += delta`` in place (the residual stream), then the RMSNorm of the new ``x``."""
        _check_rows(x, x.shape[0], weight.shape[0], "x")
        _check_rows(delta, x.shape[0], x.shape[1], "delta")
        if weight.shape != (x.shape[1],) or not x.dtype == delta.dtype == weight.dtype:
            raise ValueError(f"x, delta and the norm weight must share a dtype and width "
                             f"{x.shape[1]}")
        out = torch.empty_like(x)
        self.lib.add_rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), delta.data_ptr(),
                              delta.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                              x.shape[0], x.shape[1], eps)
        return out

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
        """Rotate the q part of ``qkv [T, (H + 2 KVH) D]`` in place; write the rotated k and
        the v of token t into cache slot ``slot_mapping[t]`` (int64) of ``kv_layer``
        (IndexError, and nothing written, when a slot is outside it)."""
        _check_cache(qkv, kv_layer, kv_heads, head_dim)
        _check_rope(qkv, heads, kv_heads, head_dim, cos, sin)
        slots = _index_tensor(slot_mapping, torch.long, qkv.shape[0], "slot_mapping")
        self.lib.rope_kv(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0],
                         heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                         kv_layer.data_ptr(), slots.data_ptr(),
                         kv_layer.shape[0] * kv_layer.shape[1])

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [rows, 2 * intermediate]``."""
        _check_rows(gate_up, gate_up.shape[0], 2 * intermediate, "gate_up")
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
        row of ``out`` (IndexError when a row, block or length is outside what it is given)."""
        _check_cache(qkv, kv_layer, kv_heads, head_dim)
        batch = rows.shape[0]
        rows = _index_tensor(rows, torch.long, batch, "rows")
        ctx_lens = _index_tensor(ctx_lens, torch.int32, batch, "ctx_lens")
        if (block_table.dtype != torch.int32 or block_table.dim() != 2
                or block_table.shape[0] != batch or block_table.stride(1) != 1):
            raise ValueError("block_table must be int32 [B, blocks] with contiguous rows")
        _check_rows(qkv, qkv.shape[0], (heads + 2 * kv_heads) * head_dim, "qkv")
        _check_rows(out, qkv.shape[0], heads * head_dim, "out")
        self.lib.decode_attn(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0),
                             rows.data_ptr(), kv_layer.data_ptr(), block_table.data_ptr(),
                             block_table.stride(0), ctx_lens.data_ptr(), batch, heads,
                             kv_heads, head_dim, kv_layer.shape[1], window, scale,
                             out.data_ptr(), out.stride(0), qkv.shape[0], block_table.shape[1],
                             kv_layer.shape[0])

    def prefill_attn(self, q_rows: torch.Tensor, q_pos0: int, kv_layer: torch.Tensor,
                     slot_ids: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                     window: int, scale: float, out_rows: torch.Tensor) -> None:
        """Causal (and windowed) attention of one sequence's queries ``q_rows`` (the first at
        position ``q_pos0``) over its context, whose cache slots are ``slot_ids`` (int64)."""
        _check_cache(q_rows, kv_layer, kv_heads, head_dim)
        slots = _index_tensor(slot_ids, torch.long, slot_ids.shape[0], "slot_ids")
        _check_rows(q_rows, q_rows.shape[0], heads * head_dim, "q_rows")
        _check_rows(out_rows, q_rows.shape[0], heads * head_dim, "out_rows")
        self.lib.prefill_attn(DTYPE_CODES[q_rows.dtype], q_rows.data_ptr(), q_rows.stride(0),
                              q_rows.shape[0], q_pos0, kv_layer.data_ptr(), slots.data_ptr(),
                              slots.shape[0], heads, kv_heads, head_dim, window, scale,
                              out_rows.data_ptr(), out_rows.stride(0),
                              kv_layer.shape[0] * kv_layer.shape[1])

    def attend(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
               meta: KernelMeta, window: int, scale: float) -> torch.Tensor:
        """A layer's attention in one call: ``rope_kv`` of every new token, then every prefill
        slice's ``prefill_attn`` and the decode rows' ``decode_attn``; the output rows
        ``[T, heads * head_dim]``. Every index of ``meta`` is checked against the step's rows
        and the cache's blocks first: IndexError, and nothing written, when one is outside."""
        _check_cache(qkv, kv_layer, kv_heads, head_dim)
        _check_rope(qkv, heads, kv_heads, head_dim, cos, sin)
        if meta.num_tokens != qkv.shape[0]:
            raise ValueError(f"the batch has {meta.num_tokens} slots for {qkv.shape[0]} rows")
        out = torch.empty(qkv.shape[0], heads * head_dim, dtype=qkv.dtype)
        self.lib.attend(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0],
                        heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                        kv_layer.data_ptr(), meta.slot_ptr, kv_layer.shape[1], window, scale,
                        out.data_ptr(), out.stride(0), meta.num_prefills, meta.prefill_ptr,
                        meta.num_decodes, meta.rows_ptr, meta.table_ptr, meta.table_stride,
                        meta.ctx_ptr, meta.table_width, kv_layer.shape[0])
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of a 2-D tensor with contiguous rows, as int64 (first on ties)."""
        _check_rows(x, x.shape[0], x.shape[1], "x")
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.lib.argmax_rows(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0],
                             x.shape[1], out.data_ptr())
        return out

    def pack_head(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [V, K]`` in the head's panel layout (``cpu_kernels.c``): what
        ``head_logits`` multiplies by and ``embed_rows`` reads rows back from; 16-row panels,
        K rounded up to even in bf16."""
        if weight.dim() != 2 or weight.stride(1) != 1 or weight.dtype not in DTYPE_CODES:
            raise ValueError("pack_head takes a float32 or bfloat16 [V, K] with contiguous rows")
        vocab, k = weight.shape
        packed = torch.empty(head_numel(vocab, k, weight.dtype), dtype=weight.dtype)
        self.lib.pack_head(DTYPE_CODES[weight.dtype], weight.data_ptr(), weight.stride(0), vocab,
                           k, packed.data_ptr())
        return packed

    def embed_rows(self, packed: torch.Tensor, vocab: int, k: int,
                   ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the packed ``[vocab, k]`` weight: ``[*ids.shape, k]``
        (IndexError when an id is outside the vocabulary)."""
        _check_head(packed, vocab, k)
        flat = ids.reshape(-1).to(torch.long).contiguous()
        out = torch.empty(flat.shape[0], k, dtype=packed.dtype)
        self.lib.embed_rows(DTYPE_CODES[packed.dtype], packed.data_ptr(), vocab, k,
                            flat.data_ptr(), flat.shape[0], out.data_ptr(), out.stride(0))
        return out.view(*ids.shape, k)

    def head_logits(self, packed: torch.Tensor, vocab: int, k: int,
                    x: torch.Tensor) -> torch.Tensor:
        """``x [rows, k] @ W.T`` for the packed ``W [vocab, k]``: fp32 sums rounded once to the
        dtype, as ``F.linear``."""
        _check_head(packed, vocab, k)
        if x.shape[-1] != k:
            raise ValueError(f"hidden rows of {x.shape[-1]} values for a head of {k}")
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != packed.dtype:
            x = x.reshape(-1, x.shape[-1]).to(packed.dtype).contiguous()
        out = torch.empty(x.shape[0], vocab, dtype=packed.dtype)
        self.lib.head_logits(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), x.shape[0],
                             packed.data_ptr(), vocab, x.shape[1], out.data_ptr(), out.stride(0))
        return out


def head_numel(vocab: int, k: int, dtype: torch.dtype) -> int:
    """Values in ``pack_head``'s layout of a ``[vocab, k]`` weight."""
    pair = 2 if dtype == torch.bfloat16 else 1
    return -(-vocab // 16) * 16 * (-(-k // pair) * pair)


def _check_head(packed: torch.Tensor, vocab: int, k: int) -> None:
    if packed.dtype not in DTYPE_CODES or packed.numel() != head_numel(vocab, k, packed.dtype):
        raise ValueError(f"not a packed [{vocab}, {k}] head: {packed.numel()} {packed.dtype}")


def _index_tensor(t: torch.Tensor, dtype: torch.dtype, length: int, name: str) -> torch.Tensor:
    """``t`` as a contiguous 1-D ``dtype`` tensor of at least ``length`` entries (what the C
    side reads through its address)."""
    if t.dim() != 1 or t.shape[0] < length:
        raise ValueError(f"{name} must be 1-D with {length} entries, not {tuple(t.shape)}")
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(-1).tolist()`` for a 2-D tensor, on the kernels when they can take it (torch's
    CPU argmax over a 49k vocabulary at 32 rows took 0.9 ms in fp32, 5.3 ms in bf16)."""
    kernels = load_kernels()
    if (kernels is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in DTYPE_CODES
            or x.stride(1) != 1 or x.shape[1] == 0):
        return x.argmax(-1).tolist()
    return kernels.argmax_rows(x).tolist()


def try_load_kernels() -> tuple[CpuKernels | None, str]:
    """This machine's kernels (built now if need be) and ``""``, or None and why not: the
    switch, no AVX-512F, no compiler, or the build's error text."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"turned off by {ENV_SWITCH}=0"
    flags = cpu_flags()
    if flags and "avx512f" not in flags:
        return None, "this CPU has no AVX-512F, which the kernels are written for"
    try:
        return CpuKernels(library_path()), ""
    except (KernelBuildError, OSError, ImportError) as exc:
        return None, str(exc)


@functools.cache
def kernel_status() -> tuple[CpuKernels | None, str]:
    """``try_load_kernels()`` once per process; the reason they are off is logged once."""
    kernels, why = try_load_kernels()
    if kernels is None:
        log.warning("dualpath CPU kernels unavailable, running plain torch ops: %s", why)
    return kernels, why


def load_kernels() -> CpuKernels | None:
    """This machine's kernels, built on first use; None (said once in the log, and in
    ``kernel_status()``) when they cannot be had here or ``DUALPATH_CPU_KERNELS=0``."""
    return kernel_status()[0]
