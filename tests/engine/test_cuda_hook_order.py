"""Hook order of the layerwise prefill on a GPU, proved with CUDA events (skipped without CUDA).

A real forward of a random-weight model with Llama-3-8B's layer shape (6 layers, a 2-layer
window, 2,048 new tokens over a 2-block hit) runs through ``PrefillHooks`` on a real traffic
manager: each layer's hit KV is copied from a pinned host pool by the copy stream, and each
layer's new KV is "sent" through a backend that only records when it was called. Timing events
on the compute stream mark each layer's start (after its hooks) and end; the copy stream's
own events (handed to the compute stream through ``CopyIssue``) mark when each load landed.

- layer i's load completes before layer i's compute starts (device time);
- layer i's load completed before layer i−1's compute ended: it ran in that layer's shadow,
  so layer i never waited for it;
- layer i's send starts once layer i's compute has completed, and, for every layer but the
  last two, before the forward's last layer has (no whole-forward or whole-stream wait);
- the compute stream waited on every load's events and the bytes that landed are the pool's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from dualpath.config import EngineConfig
from dualpath.engine.layerwise import LayerPlan, PrefillHooks
from dualpath.engine.llm_engine import LLMEngine
from dualpath.kv.host_pool import HostPool
from dualpath.model.dummy import write_dummy_model
from dualpath.model.hooks import LayerHooks
from dualpath.request import SamplingParams
from dualpath.request import Sequence as Seq
from dualpath.traffic.manager import TrafficManager
from dualpath.transfer.base import Segment, TransferBackend

pytestmark = pytest.mark.gpu

NUM_LAYERS = 6
BLOCK = 64
NUM_HIT = 2
NEW_TOKENS = 2048
DE_BUFFER = 1 << 40  # the DE buffer's address: the recording backend moves no byte


class TimedEvent(torch.cuda.Event):
    """Every event with timing on (the copy stream's too), so they can be compared."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False):
        return super().__new__(cls, enable_timing=True, blocking=blocking,
                               interprocess=interprocess)


class RecordingBackend(TransferBackend):
    """Records, per layer, whether that layer's compute (and the last layer's) had completed
    on the device when its send was called."""

    def __init__(self, lb: int) -> None:
        self.probe: Probe | None = None  # set once the hooks exist (they need the manager)
        self.lb = lb
        self.sends: dict[int, tuple[bool, bool]] = {}
        self.lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        pass

    def write(self, peer: str, segments: Sequence[Segment]) -> None:
        assert self.probe is not None
        layer = (segments[0][1] - DE_BUFFER) // (self.probe.num_blocks * self.lb)
        own = self.probe.end[layer].query() and self.probe.recorded(layer)
        last = self.probe.recorded(NUM_LAYERS - 1) and self.probe.end[NUM_LAYERS - 1].query()
        with self.lock:
            self.sends.setdefault(layer, (own, last))

    def read(self, peer: str, segments: Sequence[Segment]) -> None:
        raise AssertionError("this test reads nothing over the network")

    def close(self) -> None:
        pass


class Probe(PrefillHooks):
    """``PrefillHooks`` that keep the copy-stream events of each layer's load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layer = 0
        self.copy_events: dict[int, list[torch.cuda.Event]] = {}
        self.end = [TimedEvent() for _ in range(NUM_LAYERS)]
        self._recorded: set[int] = set()
        self.num_blocks = len(self.plan.pe_blocks)

    def before_layer(self, layer_idx: int) -> None:
        self.layer = layer_idx
        super().before_layer(layer_idx)

    def _await_load(self, load) -> None:
        self.copy_events[self.layer] = [e for f in load.issued for e in f.result()]
        super()._await_load(load)

    def recorded(self, layer_idx: int) -> bool:
        return layer_idx in self._recorded

    def mark_end(self, layer_idx: int) -> None:
        self.end[layer_idx].record()
        self._recorded.add(layer_idx)


class Timed(LayerHooks):
    """Compute-stream events around each layer's compute, outside the probe's own hooks."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.start = [TimedEvent() for _ in range(NUM_LAYERS)]

    def before_layer(self, layer_idx: int) -> None:
        self.probe.before_layer(layer_idx)
        self.start[layer_idx].record()

    def after_layer(self, layer_idx: int) -> None:
        self.probe.mark_end(layer_idx)
        self.probe.after_layer(layer_idx)

    def finish(self) -> None:
        self.probe.finish()


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    folder = write_dummy_model(tmp_path_factory.mktemp("llama3-shape"), "llama-3-8b",
                               num_hidden_layers=NUM_LAYERS, vocab_size=1024)
    blocks = -(-(NUM_HIT * BLOCK + NEW_TOKENS) // BLOCK) + 2
    return LLMEngine(folder, EngineConfig(dtype="bfloat16", device="cuda", block_size=BLOCK,
                                          num_kv_blocks=blocks, layer_window=2))


def test_cuda_events_order_each_layers_load_compute_and_send(engine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", TimedEvent)
    cache = engine.runner.cache
    assert cache.is_window and cache.data.is_cuda
    pool = HostPool(engine.layout.full_block_bytes, NUM_HIT, pin=True)
    slots = pool.alloc(NUM_HIT)
    for slot in slots:
        pool.tensor(slot).copy_(torch.randint(0, 60, (pool.payload_bytes,), dtype=torch.uint8))
    num_blocks = -(-(NUM_HIT * BLOCK + NEW_TOKENS) // BLOCK)
    pe_blocks = list(range(1, num_blocks + 1))
    plan = LayerPlan(pe_blocks, NUM_HIT, "pe", "layerwise", "de", DE_BUFFER, slots)
    seq = Seq(list(range(1, NUM_HIT * BLOCK + NEW_TOKENS + 1)),
              SamplingParams(max_tokens=1, ignore_eos=True))
    seq.block_table = pe_blocks
    seq.num_computed_tokens = NUM_HIT * BLOCK
    inputs = engine.runner.prepare([(seq, NEW_TOKENS)])
    engine.runner.run(inputs)  # warm-up: kernels compiled and caches allocated
    torch.cuda.synchronize()

    lb = cache.data[0, 0].numel() * cache.data.element_size()
    backend = RecordingBackend(lb)
    with TrafficManager(backend) as traffic:
        probe = backend.probe = Probe(plan, cache, traffic, pool)
        timed = Timed(probe)
        engine.runner.run(inputs, timed)
        torch.cuda.synchronize()

    assert probe.num_stream_waits >= NUM_LAYERS
    for i in range(NUM_LAYERS):
        copies = probe.copy_events[i]
        assert copies, f"layer {i} loaded nothing through the copy stream"
        landed = copies[-1]
        assert landed.elapsed_time(timed.start[i]) >= 0, f"layer {i} computed before its load"
        if i:
            lead_ms = landed.elapsed_time(probe.end[i - 1])
            assert lead_ms >= 0, (f"layer {i}'s load landed {-lead_ms:.3f} ms after layer "
                                  f"{i - 1}'s compute ended: it did not overlap it")
    assert sorted(backend.sends) == list(range(NUM_LAYERS))
    for i, (own_done, last_done) in backend.sends.items():
        assert own_done, f"layer {i}'s send started before its compute completed"
        if i < NUM_LAYERS - 2:
            assert not last_done, f"layer {i}'s send waited for the whole forward"
    # the loaded bytes are the pool's (the last two layers are still in the window)
    for i in (NUM_LAYERS - 2, NUM_LAYERS - 1):
        for j, slot in enumerate(slots):
            got = cache.layer(i)[pe_blocks[j]].reshape(-1).view(torch.uint8).cpu()
            assert torch.equal(got, pool.tensor(slot)[i * lb:(i + 1) * lb])
