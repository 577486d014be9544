"""A decoder layer on the C kernels: the fused path ``LlamaForCausalLM.use_kernels`` installs.

Per layer: RMSNorm, the q/k/v projection, one ``attend`` (rotary embedding, KV write and
attention over the paged cache), the output projection, the residual add fused with the second
RMSNorm, gate/up, SiLU-and-mul, down, and the second residual add: four kernel calls, four
GEMMs. The weights, their packed forms and the layer's sizes are read once, when the layer is
built, so a step pays no module attribute lookups (27,550 a 50-step run at batch 1 cost 0.4 ms a
step, 3% of it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from dualpath.model.attention import AttentionBatch
from dualpath.model.kernels import CpuKernels
from dualpath.model.linear import Linear

if TYPE_CHECKING:
    from dualpath.model.llama import DecoderLayer

Projection = Callable[[torch.Tensor], torch.Tensor]


def projection(linear: Linear) -> Projection:
    """``linear`` as a plain function: oneDNN on its packed weight, else ``F.linear``."""
    weight, bias, packed = linear.weight, linear.bias, linear.packed
    if packed is None:
        return lambda x: nn.functional.linear(x, weight, bias)
    op = torch.ops.mkldnn._linear_pointwise
    return lambda x: op(x, packed, bias, "none", [], "")


class FusedLayer:
    """One ``DecoderLayer`` computed on ``kernels`` (call it as the layer's forward)."""

    def __init__(self, layer: DecoderLayer, kernels: CpuKernels, window: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.kernels = kernels
        self.norm_in = (layer.input_layernorm.weight, layer.input_layernorm.eps)
        self.norm_post = (layer.post_attention_layernorm.weight,
                          layer.post_attention_layernorm.eps)
        self.qkv, self.o = projection(attn.qkv_proj), projection(attn.o_proj)
        self.gate_up, self.down = projection(mlp.gate_up_proj), projection(mlp.down_proj)
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.scale, self.window, self.intermediate = attn.scale, window, mlp.intermediate

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_layer: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The residual stream after the layer: ``x`` itself, updated in place."""
        k = self.kernels
        h = k.rms_norm(x, *self.norm_in)
        heads, kv_heads, dim = self.heads
        attn = k.attend(self.qkv(h), heads, kv_heads, dim, cos, sin, kv_layer,
                        batch.kernel_meta, self.window, self.scale)
        h = k.add_rms_norm(x, self.o(attn), *self.norm_post)  # x += attention
        return x.add_(self.down(k.silu_mul(self.gate_up(h), self.intermediate)))
