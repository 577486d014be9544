"""Attention over the paged cache on the GPU: torch's flex attention, and SDPA where it fits.

Unlike the reference path (``attention.py``) this one reads the cache where it lies: no-copy K/V
views of the whole cache, a flex ``BlockMask`` of one cache block per KV block (``p2l`` maps
slots back to positions), decode as a batch of one-token queries, plain causal SDPA for a
prefill from position 0; shapes padded to powers of two. A step's masks (``flex_masks.py``) are
built once, on the first layer; decode is captured into CUDA graphs (``attention_graphs.py``).

Selection (``DUALPATH_ATTENTION``): ``auto`` (default) takes this path when the cache is on
CUDA; ``flex`` forces it on any device (on the CPU flex runs eagerly: for tests); ``reference``
never takes it. A cache whose dtype differs from the compute dtype, or (on CUDA) a block size
that is not a multiple of 16, keeps the reference path. On CUDA the flex calls are
``torch.compile``d; a compile that fails turns this path off for the process, said once in the
log, and the reference path computes.

How it reads the cache, in detail: docs/derivations.md, 'model/attention_flex.py'.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dualpath.model.attention import AttentionBatch, PrefillSlice, paged_attention
from dualpath.model.flex_masks import DecodePlan, PrefillPlan, decode_plan, prefill_plan

log = logging.getLogger("dualpath.attention")

ENV_SWITCH = "DUALPATH_ATTENTION"
MODES = ("auto", "flex", "reference")
NO_PLAN = "reference"  # AttentionBatch.flex once the step has chosen the reference path
_broken: list[str] = []  # why the compiled path was turned off in this process


class AttentionModeError(ValueError):
    """``DUALPATH_ATTENTION`` names no mode."""


def mode() -> str:
    """The attention path asked for: ``auto``, ``flex`` or ``reference``."""
    value = os.environ.get(ENV_SWITCH, "auto")
    if value not in MODES:
        raise AttentionModeError(f"{ENV_SWITCH}={value!r}: use one of {', '.join(MODES)}")
    return value


def forced() -> bool:
    """True when ``DUALPATH_ATTENTION=flex`` forces this path on every device (the C kernels
    then stand aside, ``LlamaForCausalLM.use_kernels``)."""
    return mode() == "flex"


def refusal(device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype,
            block_size: int) -> str | None:
    """Why a step on this cache keeps the reference path, or None when it takes flex."""
    asked = mode()
    if asked == "reference":
        return f"{ENV_SWITCH}=reference"
    if asked == "auto" and device.type != "cuda":
        return "the cache is not on CUDA"
    if kv_dtype != dtype:
        return f"the cache holds {kv_dtype}, the compute dtype is {dtype}"
    if device.type == "cuda" and block_size % 16:
        return f"block size {block_size} (the compiled kernels take multiples of 16)"
    if device.type == "cuda" and _broken:
        return f"the compiled path failed in this process: {_broken[0]}"
    return None


def plan_for(batch: AttentionBatch, kv_layer: torch.Tensor,
             dtype: torch.dtype) -> FlexPlan | None:
    """The step's plan on this cache (built on the first layer, kept on ``batch``), or None
    when the step takes the reference path."""
    plan = batch.flex
    if plan is None:
        block_size = kv_layer.shape[1]
        why = refusal(kv_layer.device, kv_layer.dtype, dtype, block_size)
        plan = NO_PLAN if why else FlexPlan.build(batch, kv_layer.shape[0], block_size,
                                                  kv_layer.device, dtype)
        batch.flex = plan
    return None if plan is NO_PLAN else plan


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
           batch: AttentionBatch, scale: float) -> torch.Tensor:
    """A layer's attention output ``[T, heads, head_dim]`` on the path this step takes: the
    plan's (flex and SDPA), else ``paged_attention``. ``k``/``v`` are the new tokens' K/V,
    already written to ``kv_layer``."""
    plan = plan_for(batch, kv_layer, q.dtype)
    if plan is not None:
        try:
            return plan.attend(q, k, v, kv_layer, scale)
        except compile_errors() as exc:
            if q.device.type != "cuda":
                raise
            compiled_failed(f"{type(exc).__name__}: {exc}")
            batch.flex = NO_PLAN
    return paged_attention(q, kv_layer, batch, scale)


# --- the step's plan --------------------------------------------------------------------------


@dataclass
class FlexPlan:
    """What every layer of one step runs: SDPA slices, the packed prefill, the decode batch."""

    dense: list[tuple[int, int]]  # (q_start, q_len) of prefills from position 0
    prefill: PrefillPlan | None
    decode: DecodePlan | None
    kernel_options: dict[str, int]

    @classmethod
    def build(cls, batch: AttentionBatch, num_blocks: int, block_size: int,
              device: torch.device, dtype: torch.dtype) -> FlexPlan:
        """The plan of ``batch`` over a cache of ``num_blocks`` blocks of ``block_size``."""
        dense = [(p.q_start, p.q_len) for p in batch.prefills if _runs_dense(p)]
        chunks = [p for p in batch.prefills if not _runs_dense(p)]
        prefill = prefill_plan(chunks, num_blocks, block_size, device) if chunks else None
        decode = None
        if batch.decode is not None:
            decode = decode_plan(batch, num_blocks, block_size)
        # the compiled kernels' KV tile must divide a cache block (64 by default)
        options = {"BLOCK_N": block_size} if block_size < 64 else {}
        return cls(dense, prefill, decode, options)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output ``[T, heads, head_dim]`` of the step's queries ``q`` (same
        shape); ``k``/``v`` ``[T, kv_heads, head_dim]`` are the new tokens' K/V, already
        written to ``kv_layer``."""
        out = torch.empty_like(q)
        for start, length in self.dense:
            rows = slice(start, start + length)
            out[rows] = causal_sdpa(q[rows], k[rows], v[rows], scale)
        if self.prefill is None and self.decode is None:
            return out
        cache_k, cache_v = cache_views(kv_layer)
        if self.prefill is not None:
            p = self.prefill
            qp = q.index_select(0, p.source).transpose(0, 1).unsqueeze(0)  # [1, H, Tp, D]
            o = run_flex("prefill", qp, cache_k, cache_v, p.block_mask, scale,
                         self.kernel_options)
            out.index_copy_(0, p.rows, o[0].transpose(0, 1).index_select(0, p.at))
        if self.decode is not None:
            d = self.decode
            qd = q.index_select(0, d.rows)
            if d.padded > qd.shape[0]:
                qd = torch.cat((qd, qd.new_zeros(d.padded - qd.shape[0], *qd.shape[1:])))
            o = run_flex("decode", qd.unsqueeze(2), cache_k, cache_v, d.block_mask, scale,
                         self.kernel_options)
            out.index_copy_(0, d.rows, o[: d.rows.shape[0], :, 0])
        return out


def _runs_dense(part: PrefillSlice) -> bool:
    return part.pos0 == 0 and (part.window is None or part.q_len <= part.window)


def cache_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's cache ``[num_blocks, block_size, 2, kv_heads, head_dim]`` as
    ``[1, kv_heads, num_blocks * block_size, head_dim]`` views (slot s = block s // block_size,
    offset s % block_size)."""
    blocks, block_size, _, kv_heads, head_dim = kv_layer.shape
    k = kv_layer[:, :, 0].reshape(blocks * block_size, kv_heads, head_dim)
    v = kv_layer[:, :, 1].reshape(blocks * block_size, kv_heads, head_dim)
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One sequence's causal attention from position 0 over its own new K/V: ``q [L, H, D]``,
    ``k``/``v`` ``[L, KVH, D]``; the output ``[L, H, D]``."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                       k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)



# --- running flex -----------------------------------------------------------------------------


def run_flex(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_mask: BlockMask, scale: float, options: dict[str, int]) -> torch.Tensor:
    """``flex_attention`` of ``q [B, H, L, D]`` over the cache views, compiled on CUDA
    (``kind`` names the compiled function, ``decode`` or ``prefill``)."""
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return _compiled(kind)(q, k, v, block_mask, scale, options)


def compiled_failed(why: str) -> None:
    """Turn the compiled path off for this process (said once in the log)."""
    if not _broken:
        log.error("dualpath flex attention failed to compile, running the reference path: %s",
                  why)
        _broken.append(why)


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed ``torch.compile`` of the flex calls raises (Dynamo's and Inductor's)."""
    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    inductor = getattr(torch._inductor.exc, "InductorError", None)  # torch >= 2.7
    if inductor is not None:
        errors.append(inductor)
    return tuple(errors)


@functools.cache
def _compiled(kind: str) -> Callable[..., torch.Tensor]:
    # static shapes: one compiled entry per decode batch bucket (flex decoding needs a static
    # batch) and per packed prefill length bucket and chunk count; a recompile limit below
    # that would drop to eager flex, which scores the whole cache
    config = torch._dynamo.config
    for name, floor in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), floor))
    fn = _decode_call if kind == "decode" else _prefill_call
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _decode_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                 scale: float, options: dict[str, int]) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=options or None)


def _prefill_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                  scale: float, options: dict[str, int]) -> torch.Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=options or None)
