"""Model runner: turns one scheduled step into tensors, runs the forward, returns logits.

It owns the model and the paged KV cache. The model sees the flat cache slot of every new
token, each prefilling sequence's context slots and each decoding sequence's block table.

A step's index tensors are built on the host and reach a CUDA device in one non-blocking copy
from pinned memory (``attention.upload``); the longest decode context is known on the host, so
no layer reads a length back from the device. Pure decode steps replay CUDA graphs where they
fit (``model/attention_graphs.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.engine.progress import NO_WORK, LayerWork, StepClock
from dualpath.kv.cache import PagedKVCache
from dualpath.model import attention_graphs
from dualpath.model.attention import AttentionBatch, DecodeSlice, PrefillSlice, upload
from dualpath.model.attention_graphs import CudaCapture, DecodeGraphs, GraphCapture
from dualpath.model.hooks import NO_HOOKS, LayerHooks
from dualpath.model.llama import LlamaForCausalLM
from dualpath.model.spec import ModelSpec
from dualpath.request import Sequence


@dataclass
class StepInputs:
    """Flat token batch of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    last_rows: list[int]  # row of each item's last token in the flat batch
    decode_only: bool = False  # every item decodes one token: rows 0..B-1 are the decode rows
    work: LayerWork = NO_WORK  # one layer's work (the heartbeat's step budget)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    """Runs the model on steps of (sequence, number of new tokens) items."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache,
                 capture: GraphCapture | None = None) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.window = model.spec.sliding_window
        self._kv_layers = cache.layers()
        self.device = cache.data.device
        self.graphs = self.decode_graphs(capture)
        # when a layer of a forward last finished and how long the one under way should take:
        # a long forward still shows progress (the engine's heartbeat reports both)
        self.clock = StepClock(layer_params(model.spec), model.spec.num_heads
                               * model.spec.head_dim, time.monotonic())

    def prepare(self, items: list[tuple[Sequence, int]]) -> StepInputs:
        """Build the flat inputs and attention metadata for ``items``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills, last_rows = [], []
        decode_rows, decode_tables, decode_ctx = [], [], []
        bs = self.block_size
        num_pairs = 0.0
        for seq, num_new in items:
            start = seq.num_computed_tokens
            ctx = start + num_new
            num_pairs += num_new * (start + (num_new + 1) / 2)
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
        inputs = StepInputs(torch.tensor(ids, dtype=torch.long),
                            torch.tensor(positions, dtype=torch.long), batch, last_rows,
                            decode_only=not prefills, work=LayerWork(len(ids), num_pairs))
        return inputs if self.device.type == "cpu" else to_device(inputs, self.device)

    def decode_graphs(self, capture: GraphCapture | None = None) -> DecodeGraphs | None:
        """Decode graphs on a CUDA cache holding every layer (``capture`` stands in for CUDA's
        in tests); None where they do not apply or ``DUALPATH_CUDA_GRAPHS=0``."""
        if self.cache.is_window or not attention_graphs.enabled():
            return None
        if capture is None:
            if self.device.type != "cuda":
                return None
            capture = CudaCapture()
        width = -(-self.model.spec.max_position // self.block_size)
        return DecodeGraphs(self._forward, self._kv_layers[0], self.window, width,
                            self.model.dtype, capture)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 batch: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch, self._kv_layers)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, hooks: LayerHooks = NO_HOOKS) -> torch.Tensor:
        """Forward the step; return final hidden states of every row ``[T, hidden]``. A
        decode-only step without hooks replays a CUDA graph where one fits."""
        graphs, clock = self.graphs, self.clock
        clock.begin(inputs.work, time.monotonic())
        try:
            if (hooks is NO_HOOKS and inputs.decode_only and graphs is not None
                    and graphs.fits(inputs.batch)):
                return graphs.run(inputs.input_ids, inputs.positions, inputs.batch)
            return self.model(inputs.input_ids, inputs.positions, inputs.batch,
                              self._kv_layers, _Progress(clock, hooks))
        finally:
            clock.end(time.monotonic())

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits of the given hidden rows: fp32, or in the model's dtype (for the sampler)."""
        return self.model.logits(hidden, fp32)


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """Host-built ``inputs`` on ``device``: every index tensor in one non-blocking copy (from
    pinned memory where CUDA is), the decode tables and lengths turned int32 there."""
    batch, d = inputs.batch, inputs.batch.decode
    parts = [inputs.input_ids, inputs.positions, batch.slot_mapping,
             *(p.slot_ids for p in batch.prefills)]
    if d is not None:
        parts += [d.token_idx, d.block_table.reshape(-1), d.ctx_lens]
    moved = upload(parts, device)
    ids, positions, slots = moved[:3]
    contexts = moved[3 : 3 + len(batch.prefills)]
    prefills = [PrefillSlice(p.q_start, p.q_len, c, p.pos0, p.window)
                for p, c in zip(batch.prefills, contexts, strict=True)]
    decode = None
    if d is not None:
        rows, table, ctx = moved[-3:]
        decode = DecodeSlice(rows, table.view(d.block_table.shape).to(torch.int32),
                             ctx.to(torch.int32), d.block_size, d.window, d.max_ctx)
    return StepInputs(ids, positions, AttentionBatch(slots, prefills, decode), inputs.last_rows,
                      inputs.decode_only, inputs.work)


def layer_params(spec: ModelSpec) -> int:
    """Weights of one decoder layer (attention projections and MLP; norms are negligible)."""
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return spec.hidden_size * (2 * q_width + 2 * kv_width) + 3 * spec.hidden_size \
        * spec.intermediate_size


class _Progress(LayerHooks):
    """``hooks``, and the runner's step clock told after every layer."""

    def __init__(self, clock: StepClock, hooks: LayerHooks) -> None:
        self.clock = clock
        self.hooks = hooks

    def before_layer(self, layer_idx: int) -> None:
        self.hooks.before_layer(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        self.hooks.after_layer(layer_idx)
        self.clock.layer_done(time.monotonic())

    def finish(self) -> None:
        self.hooks.finish()
