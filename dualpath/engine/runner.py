"""Model runner: turns one scheduled step into tensors, runs the forward, returns logits.

It owns the model and the paged KV cache; the model never sees block tables, only the flat
slot indices this runner computes from them.
"""

from __future__ import annotations

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


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


class ModelRunner:
    """Runs the model on steps of (sequence, number of new tokens) items."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.window = model.spec.sliding_window
        self._kv_layers = cache.layers()
        self.device = cache.data.device

    def prepare(self, items: list[tuple[Sequence, int]]) -> StepInputs:
        """Build the flat inputs and attention metadata for ``items``."""
        ids: list[int] = []
        positions, slots, prefills, last_rows = [], [], [], []
        decode_rows, decode_slots, decode_ctx = [], [], []
        for seq, num_new in items:
            start = seq.num_computed_tokens
            ctx = start + num_new
            table = torch.tensor(seq.block_table, dtype=torch.long)
            ctx_pos = torch.arange(ctx)
            ctx_slots = _slots(table, ctx_pos, self.block_size)
            row = len(ids)
            ids.extend(seq.token_ids[start:ctx])
            positions.append(ctx_pos[start:])
            slots.append(ctx_slots[start:])
            last_rows.append(row + num_new - 1)
            if num_new == 1:
                decode_rows.append(row)
                decode_slots.append(ctx_slots)
                decode_ctx.append(ctx)
            else:
                plain = start == 0 and (self.window is None or ctx <= self.window)
                mask = None if plain else _window_mask(ctx_pos[start:], ctx_pos, self.window)
                prefills.append(PrefillSlice(row, num_new, ctx_slots, mask))
        batch = AttentionBatch(torch.cat(slots), prefills,
                               self._decode_slice(decode_rows, decode_slots, decode_ctx))
        return StepInputs(torch.tensor(ids, dtype=torch.long).to(self.device),
                          torch.cat(positions).to(self.device), batch.to(self.device), last_rows)

    def _decode_slice(self, rows: list[int], slots: list[torch.Tensor],
                      ctx_lens: list[int]) -> DecodeSlice | None:
        if not rows:
            return None
        padded = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
        k_pos = torch.arange(padded.shape[1])
        ctx = torch.tensor(ctx_lens)
        mask = _window_mask(ctx - 1, k_pos, self.window)  # also hides the padding
        return DecodeSlice(torch.tensor(rows), padded, mask[:, None, None, :])

    @torch.inference_mode()
    def run(self, inputs: StepInputs, hooks: LayerHooks = NO_HOOKS) -> torch.Tensor:
        """Forward the step; return final hidden states of every row ``[T, hidden]``."""
        return self.model(inputs.input_ids, inputs.positions, inputs.batch, self._kv_layers, hooks)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given hidden rows."""
        return self.model.logits(hidden)
