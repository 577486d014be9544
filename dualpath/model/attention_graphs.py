"""CUDA graphs for pure decode steps on the flex attention path.

A decode step of a small batch launches hundreds of small kernels (about 45 a layer); at batch
1 on a GPU their launch cost, not the weights' bytes, sets the step time. A captured graph
replays the whole forward with one launch.

What is captured: the model's forward over static device buffers (token ids, positions, new
slots, block tables ``[B, table_width]``, context lengths) for one padded batch size
(``flex_masks.decode_bucket``: powers of two up to ``max_batch``), the flex decode plan
included (it is device-only, so it is rebuilt inside the graph from the buffers each replay).
A step copies its tensors into the buffers and replays; padded rows repeat row 0 (the same
token at the same position writing the same K/V to the same slot, an idempotent write), and
their outputs are dropped. Block tables wider than the step's are left as they were: the plan
reads only each row's own blocks. A batch size is captured the first time it is seen, after
one eager run of the step on the buffers (it compiles the flex kernels and is the step's
result). Steps with hooks (layerwise loads and sends), prefill rows, more rows than
``max_batch`` or a table wider than ``table_width`` run eagerly.

On by default with a CUDA cache on the flex path; ``DUALPATH_CUDA_GRAPHS=0`` turns it off. A
capture that fails turns graphs off for the engine, said once in the log (the step's result
is the eager run's). ``EagerCapture`` stands in for the CUDA capture in CPU tests: its
"replay" reruns the forward on the same buffers, so the buffer filling and padding are tested
anywhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import torch

from dualpath.model import attention_flex, flex_masks
from dualpath.model.attention import AttentionBatch, DecodeSlice

log = logging.getLogger("dualpath.attention")

ENV_SWITCH = "DUALPATH_CUDA_GRAPHS"
MAX_BATCH = 256  # the largest captured batch (static buffers of this many rows)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor]
Replay = Callable[[], torch.Tensor]


class GraphCapture(Protocol):
    """Records ``fn`` (which returns the forward's output) as something to replay."""

    def capture(self, fn: Replay) -> Replay:
        """A callable that reruns ``fn``'s work on the same buffers and returns its output."""
        ...


class CudaCapture:
    """``torch.cuda.graph`` capture into one memory pool shared by every batch size (graphs
    never run at once, and each output is copied out before the next replay)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Replay) -> Replay:
        """Capture ``fn`` (not run: the caller ran it once before, as the warm-up)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """A stand-in for tests: the "graph" reruns ``fn`` on the static buffers."""

    def capture(self, fn: Replay) -> Replay:
        """``fn`` itself."""
        return fn


def enabled() -> bool:
    """True unless ``DUALPATH_CUDA_GRAPHS=0``."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


class DecodeGraphs:
    """Captured decode steps of one model over one cache, one graph per padded batch size."""

    def __init__(self, forward: Forward, cache_layer: torch.Tensor, window: int | None,
                 table_width: int, dtype: torch.dtype, capture: GraphCapture,
                 max_batch: int = MAX_BATCH) -> None:
        device = cache_layer.device
        self.forward = forward
        self.cache_layer = cache_layer  # a layer view: the flex path's choice depends on it
        self.block_size = cache_layer.shape[1]
        self.window = window
        self.table_width = table_width
        self.dtype = dtype
        self.capture_with = capture
        self.max_batch = max_batch
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = torch.arange(max_batch, device=device)
        self.tables = torch.zeros(max_batch, table_width, dtype=torch.int32, device=device)
        self.ctx_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.replays: dict[int, Replay] = {}
        self.failed = ""  # why capture was turned off, once it failed

    def fits(self, batch: AttentionBatch) -> bool:
        """True when ``batch`` (decode rows only, rows 0..B-1) can replay a graph."""
        d = batch.decode
        if self.failed or d is None or batch.prefills or not enabled():
            return False
        if d.token_idx.shape[0] > self.max_batch or d.block_table.shape[1] > self.table_width:
            return False
        layer = self.cache_layer
        return attention_flex.refusal(layer.device, layer.dtype, self.dtype,
                                      self.block_size) is None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            batch: AttentionBatch) -> torch.Tensor:
        """The final hidden states ``[B, hidden]`` of a decode step that ``fits``."""
        rows = input_ids.shape[0]
        padded = flex_masks.decode_bucket(rows)
        self._fill(input_ids, positions, batch, rows, padded)
        replay = self.replays.get(padded)
        if replay is not None:
            return replay()[:rows].clone()
        out = self._forward(padded)  # the warm-up: compiles, and is this step's result
        if not self.fits(batch):  # the compile failed: the reference path cannot be captured
            return out[:rows]
        try:
            self.replays[padded] = self.capture_with.capture(lambda: self._forward(padded))
        except (RuntimeError, *attention_flex.compile_errors()) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("dualpath decode CUDA graphs off: capture failed: %s", self.failed)
        return out[:rows]

    def _forward(self, padded: int) -> torch.Tensor:
        decode = DecodeSlice(self.rows[:padded], self.tables[:padded], self.ctx_lens[:padded],
                             self.block_size, self.window)
        batch = AttentionBatch(self.slots[:padded], [], decode)
        return self.forward(self.ids[:padded], self.positions[:padded], batch)

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
              rows: int, padded: int) -> None:
        d = batch.decode
        assert d is not None
        width = d.block_table.shape[1]
        pairs = ((self.ids, input_ids), (self.positions, positions),
                 (self.slots, batch.slot_mapping), (self.ctx_lens, d.ctx_lens))
        for static, step in pairs:
            static[:rows].copy_(step, non_blocking=True)
            static[rows:padded].copy_(step[:1].expand(padded - rows), non_blocking=True)
        self.tables[:rows, :width].copy_(d.block_table, non_blocking=True)
        self.tables[rows:padded, :width].copy_(d.block_table[:1].expand(padded - rows, width),
                                               non_blocking=True)
