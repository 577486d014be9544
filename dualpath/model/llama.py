"""Decoder-only Llama-family forward (Llama, Qwen2, Mistral) over a paged KV cache.

Module names mirror the Hugging Face checkpoints so the loader maps weights by name; q/k/v and
gate/up are fused into single matmuls and loaded shard by shard.

Two paths compute the same layers: plain torch ops (the reference), and, once
``use_kernels`` hands the model the C kernels of ``model/kernels.py``, a fused path: one pass
each for RMSNorm with its residual add, the rotary embedding with the KV write, SiLU-and-mul
and attention over the paged cache. Both call every ``DecoderLayer`` module, so module hooks
see each layer compute either way. On the torch path, attention over a CUDA cache reads it in
place through flex attention (and SDPA for prefills from position 0), ``attention_flex.py``;
the reference ``paged_attention`` is the CPU's.

On the fast path each weight is held once, packed (``pack_weights``: oneDNN's layout for every
linear, the dense matrices dropped; ``use_kernels``: an output head tied to the embeddings in
the kernels' panel layout, which the embedding look-up reads too). A model the kernels do not
cover runs the torch ops, said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from dualpath.model import attention_flex
from dualpath.model.attention import AttentionBatch, write_kv
from dualpath.model.fused import FusedLayer
from dualpath.model.hooks import NO_HOOKS, LayerHooks
from dualpath.model.kernels import CpuKernels
from dualpath.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from dualpath.model.linear import Linear
from dualpath.model.spec import ModelSpec

log = logging.getLogger("dualpath.kernels")


class Attention(nn.Module):
    """Grouped-query self-attention with a fused q/k/v projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)

    def qkv_shard_rows(self, shard: str) -> slice:
        """Rows of the fused projection that hold shard ``q``, ``k`` or ``v``."""
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        return slice(start, start + (self.q_size if shard == "q" else self.kv_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = RotaryEmbedding.apply(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(tokens, self.num_kv_heads, -1)
        write_kv(kv_layer, batch.slot_mapping, k, v)
        out = attention_flex.attend(q, k, v, kv_layer, batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    fused: FusedLayer | None = None  # set by LlamaForCausalLM.use_kernels

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The residual stream after this layer (on the kernels: ``x`` itself, updated)."""
        if self.fused is not None:
            return self.fused(x, cos, sin, kv_layer, batch)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class TiedHead(nn.Module):
    """The embedding table of a model whose output head is tied to it, held once in the C
    kernels' head layout (``CpuKernels.pack_head``): the head's GEMM streams it, and the
    embedding look-up reads its rows from it. (oneDNN's packed layout cannot be read row by
    row, so packing the head for oneDNN kept a second copy of the table: 113 MB for SmolLM2 in
    fp32.)"""

    def __init__(self, weight: torch.Tensor, kernels: CpuKernels) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.kernels = kernels
        self.packed = kernels.pack_head(weight.detach().contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.embed_rows(self.packed, self.num_embeddings, self.embedding_dim, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, dim] @ table.T`` in the table's dtype."""
        return self.kernels.head_logits(self.packed, self.num_embeddings, self.embedding_dim,
                                        hidden)

    def dense_weight(self) -> torch.Tensor:
        """The table ``[vocab, dim]``, read back into a new dense tensor."""
        return self.forward(torch.arange(self.num_embeddings))


class DecoderBody(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # an empty weight skips the random init: under the meta device that init imports
        # torch._dynamo (seconds in every engine process); the checkpoint fills it
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model; ``forward`` returns final hidden states, ``logits`` projects them."""

    kernels: CpuKernels | None = None  # the fused path's kernels (use_kernels)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_layers: Sequence[torch.Tensor], hooks: LayerHooks = NO_HOOKS) -> torch.Tensor:
        """Run all layers on a flat token batch; hooks fire around every layer."""
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            hooks.before_layer(i)
            x = layer(x, cos, sin, kv_layers[i], batch)
            hooks.after_layer(i)
        hooks.finish()
        norm = self.model.norm
        if self.kernels is not None:
            return self.kernels.rms_norm(x, norm.weight, norm.eps)
        return norm(x)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's weight is never packed)."""
        return self.model.norm.weight.dtype

    @property
    def is_packed(self) -> bool:
        """True once any weight has been packed (the dense form is gone)."""
        return isinstance(self.model.embed_tokens, TiedHead) or any(
            m.packed is not None for m in self.modules() if isinstance(m, Linear))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids ``[N]``: ``[N, hidden]``."""
        return self.model.embed_tokens(ids)

    def use_kernels(self, kernels: CpuKernels | None) -> bool:
        """Run the fused path on ``kernels`` (None: the torch ops); False, the torch ops and
        one log line saying why when they do not cover this model's dtype and attention shape.
        Call after ``pack_weights`` (the fused layers take the packed weights as they are
        then). With the kernels, a head tied to the embeddings is packed here, once."""
        spec = self.spec
        if kernels is not None and attention_flex.forced():
            log.warning("dualpath CPU kernels off: %s=flex forces the flex attention path",
                        attention_flex.ENV_SWITCH)
            kernels = None
        if kernels is not None:
            why = kernels.refusal(self.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                  spec.max_position)
            if why is not None:
                log.warning("dualpath CPU kernels do not cover this model (%s): running plain "
                            "torch ops", why)
                kernels = None
        self.kernels = kernels
        window = spec.sliding_window or 0
        for layer in self.model.layers:
            layer.fused = None if kernels is None else FusedLayer(layer, kernels, window)
        embed = self.model.embed_tokens
        if kernels is not None and self.lm_head is None and isinstance(embed, nn.Embedding):
            self.model.embed_tokens = TiedHead(embed.weight, kernels)  # the table goes
        return kernels is not None

    def pack_weights(self) -> int:
        """Prepack every linear weight for oneDNN in place of its dense form, where this
        device and dtype allow it (``model/linear.py``); how many were packed. Call once the
        weights are final. (A head tied to the embeddings stays the table: ``use_kernels``
        packs it for the kernels, once.)"""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def dense_weights(self) -> dict[str, torch.Tensor]:
        """Every weight by its parameter name as loaded, dense (packed ones read back)."""
        out = {name: p for name, p in self.named_parameters()}
        for name, module in self.named_modules():
            if isinstance(module, Linear | TiedHead) and getattr(module, "weight", None) is None:
                out[f"{name}.weight"] = module.dense_weight()
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights held: the dense parameters and every packed form."""
        total = sum(p.nbytes for p in self.parameters())
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is not None:
                total += torch.ops.mkldnn._nbytes(module.packed)
            elif isinstance(module, TiedHead):
                total += module.packed.nbytes
        return total

    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Vocabulary logits for hidden states ``[N, hidden]``: fp32, or in the model's dtype
        when ``fp32`` is False (what greedy sampling needs: the conversion of 32 rows of a 49k
        vocabulary cost 1.2 ms a step in bf16)."""
        embed = self.model.embed_tokens
        if self.lm_head is not None:
            out = self.lm_head(hidden)
        elif isinstance(embed, TiedHead):
            out = embed.logits(hidden)
        else:
            out = nn.functional.linear(hidden, embed.weight)
        return out.float() if fp32 else out
