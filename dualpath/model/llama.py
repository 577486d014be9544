"""Decoder-only Llama-family forward (Llama, Qwen2, Mistral) over a paged KV cache.

Module names mirror the Hugging Face checkpoints so the loader maps weights by name; q/k/v and
gate/up are fused into single matmuls and loaded shard by shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dualpath.model.attention import AttentionBatch, paged_attention, write_kv
from dualpath.model.hooks import NO_HOOKS, LayerHooks
from dualpath.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from dualpath.model.spec import ModelSpec


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
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)

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
        write_kv(kv_layer, batch.slot_mapping, k, v.view(tokens, self.num_kv_heads, -1))
        out = paged_attention(q, kv_layer, batch, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole model; ``forward`` returns final hidden states, ``logits`` projects them."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderBody(spec)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_layers: Sequence[torch.Tensor], hooks: LayerHooks = NO_HOOKS) -> torch.Tensor:
        """Run all layers on a flat token batch; hooks fire around every layer."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            hooks.before_layer(i)
            x = layer(x, cos, sin, kv_layers[i], batch)
            hooks.after_layer(i)
        hooks.finish()
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (fp32) for hidden states ``[N, hidden]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()
