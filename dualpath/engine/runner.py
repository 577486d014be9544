"""Model runner: turns one scheduled step into tensors, runs the forward, returns logits.

It owns the model and the paged KV cache. The model sees the flat cache slot of every new
token, each prefilling sequence's context slots and each decoding sequence's block table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.kv.cache import PagedKVCache
from dualpath.model.attention import AttentionBatch, DecodeSlice, PrefillSlice
from dualpath.model.hooks import NO_HOOKS, LayerHooks
from dualpath.model.llama import LlamaForCausalLM
from dualpath.request import Sequence


@dataclass
class StepInputs:
    """Flat token batch of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    last_rows: list[int]  # row of each item's last token in the flat batch


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    """Runs the model on steps of (sequence, number of new tokens) items."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.window = model.spec.sliding_window
        self._kv_layers = cache.layers()
        self.device = cache.data.device
        # monotonic seconds when a layer of a forward last finished: a long forward still
        # shows progress (the engine's heartbeat reports its age; see engine/loop.py)
        self.layer_done_s = time.monotonic()

    def prepare(self, items: list[tuple[Sequence, int]]) -> StepInputs:
        """Build the flat inputs and attention metadata for ``items``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills, last_rows = [], []
        decode_rows, decode_tables, decode_ctx = [], [], []
        bs = self.block_size
        for seq, num_new in items:
            start = seq.num_computed_tokens
            ctx = start + num_new
            row = len(ids)
            ids.extend(seq.token_ids[start:ctx])
            last_rows.append(row + num_new - 1)
            if num_new == 1:  # decode: plain ints, the context stays in the cache
                table = seq.block_table
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_rows.append(row)
                decode_tables.append(table)
                decode_ctx.append(ctx)
                continue
            ctx_slots = _slots(torch.tensor(seq.block_table, dtype=torch.long),
                               torch.arange(ctx), bs)
            positions.extend(range(start, ctx))
            slots.extend(ctx_slots[start:].tolist())
            prefills.append(PrefillSlice(row, num_new, ctx_slots, start, self.window))
        decode = (DecodeSlice.build(decode_rows, decode_tables, decode_ctx, bs, self.window)
                  if decode_rows else None)
        batch = AttentionBatch(torch.tensor(slots, dtype=torch.long), prefills, decode)
        return StepInputs(torch.tensor(ids, dtype=torch.long).to(self.device),
                          torch.tensor(positions, dtype=torch.long).to(self.device),
                          batch.to(self.device), last_rows)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, hooks: LayerHooks = NO_HOOKS) -> torch.Tensor:
        """Forward the step; return final hidden states of every row ``[T, hidden]``."""
        return self.model(inputs.input_ids, inputs.positions, inputs.batch, self._kv_layers,
                          _Progress(self, hooks))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits of the given hidden rows: fp32, or in the model's dtype (for the sampler)."""
        return self.model.logits(hidden, fp32)


class _Progress(LayerHooks):
    """``hooks``, and the runner's ``layer_done_s`` stamped after every layer."""

    def __init__(self, runner: ModelRunner, hooks: LayerHooks) -> None:
        self.runner = runner
        self.hooks = hooks

    def before_layer(self, layer_idx: int) -> None:
        self.hooks.before_layer(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        self.hooks.after_layer(layer_idx)
        self.runner.layer_done_s = time.monotonic()

    def finish(self) -> None:
        self.hooks.finish()
