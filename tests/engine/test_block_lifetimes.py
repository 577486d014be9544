"""A saved block is always its own request's KV: no device block goes back to the pool while a
queued or running save still reads it (finish, abort, reuse), with the compute NIC capped so
the saves really lag behind the decode loop."""

from __future__ import annotations

import time

import pytest
import torch

from dualpath.config import EngineConfig, TrafficConfig
from dualpath.engine.decode import DecodeWorker
from dualpath.engine.llm_engine import LLMEngine
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import AllocBuffer, BufferReady, Decode, Finished
from dualpath.request import SamplingParams
from dualpath.storage.client import StorageClient
from dualpath.storage.memory import MemoryStore
from dualpath.storage.verify import verify_store
from dualpath.traffic.manager import TrafficManager

BLOCK = 16
PROMPTS = ([5 + (i * 7) % 250 for i in range(40)], [9 + (i * 13) % 280 for i in range(36)])


def _engine(model_dir, num_blocks: int = 8) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=num_blocks,
                                             dtype="float32", cpu_kernels=False))


def _reference(model_dir, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy output of ``prompt`` and the KV of every block of prompt + output (the last one
    partly) from one plain prefill, as stored blocks ``[blocks, layers, tokens, 2, kv_heads,
    head_dim]``."""
    ref = _engine(model_dir)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = ref.generate([prompt], params)[0].output_ids
    seq = ref.add_request(prompt + out, SamplingParams(max_tokens=1, ignore_eos=True))
    while not seq.is_finished:
        ref.step()
    data = ref.runner.cache.data
    return out, torch.stack([data[:, b].clone() for b in seq.block_table])


def _fill_buffer(de: DecodeWorker, ready: BufferReady, kv: torch.Tensor) -> None:
    """Put the prompt's KV into the DE's layer-major buffer (what a PE's sends would do)."""
    slots = de.buffers.slots[ready.req_id]
    layer_major = de.buffers.layer_major(slots).view(kv.dtype)
    layer_major = layer_major.view(kv.shape[1], len(slots), *kv.shape[2:])
    for b in range(len(slots)):
        layer_major[:, b] = kv[b]


class _Cluster:
    """One decode worker on the tiny model, saves paced by a capped compute NIC."""

    def __init__(self, model_dir, send_cap_mb_s: float) -> None:
        # 5 blocks, all of which the first request takes: the second one gets its freed blocks
        self.engine = _engine(model_dir, num_blocks=5)
        layout = self.engine.layout
        self.store = MemoryStore(layout.full_block_bytes)
        traffic = TrafficManager(None, TrafficConfig(compute_send_cap_mb_s=send_cap_mb_s,
                                                     burst_chunks=0,
                                                     kv_chunk_bytes=layout.full_block_bytes))
        self.de = DecodeWorker(self.engine, HostPool(layout.full_block_bytes, 32, pin=False),
                               traffic, StorageClient(self.store, BLOCK), staging_blocks=8)
        self.traffic = traffic

    def start(self, req_id: int, prompt: list[int], kv: torch.Tensor, first_token: int,
              max_tokens: int) -> None:
        n = -(-len(prompt) // BLOCK)
        (ready,) = self.de.buffers.alloc_buffer(AllocBuffer(req_id, tuple(prompt), n, 0))
        assert isinstance(ready, BufferReady)
        _fill_buffer(self.de, ready, kv)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        assert self.de.start_decode(Decode(req_id, first_token, 0, params)) == []

    def run(self, until, timeout_s: float = 30.0) -> list:
        out = []
        deadline = time.monotonic() + timeout_s
        while not until(out):
            assert time.monotonic() < deadline, "the decode worker did not get there in time"
            out += self.de.drain_events()
            if self.de.has_work:
                out += self.de.step()
            else:
                time.sleep(0.002)
        return out

    def stored(self, tokens: list[int]) -> torch.Tensor:
        """The stored blocks of ``tokens``' chain, as cache blocks."""
        keys = self.engine.key_space.keys(tokens)
        data = self.engine.runner.cache.data
        bufs = [bytearray(self.engine.layout.full_block_bytes) for _ in keys]
        assert all(self.store.get_into(keys, bufs)), "a block of the chain is not stored"
        return torch.stack([torch.frombuffer(b, dtype=data.dtype).view(data.shape[0],
                                                                      *data.shape[2:])
                            for b in bufs])


def _finished(req_id):
    return lambda out: any(isinstance(m, Finished) and m.req_id == req_id for m in out)


@pytest.mark.parametrize("end", ["finish", "abort"])
def test_saved_blocks_are_the_requests_own_after_its_blocks_are_reused(tiny_chaotic_dir, end):
    """Request 1's last blocks are still queued for saving (a 0.05 MB/s send cap: ~250 ms
    per block) when it ends; request 2 takes its freed device blocks and copies its own KV in.
    What storage holds under request 1's keys must be request 1's KV."""
    first, second = PROMPTS
    out1, kv1 = _reference(tiny_chaotic_dir, first, 40)
    out2, kv2 = _reference(tiny_chaotic_dir, second, 8)
    cluster = _Cluster(tiny_chaotic_dir, send_cap_mb_s=0.05)
    try:
        cluster.start(1, first, kv1, out1[0], 40)
        if end == "finish":  # its sequence ended (its answer waits for the saves)
            cluster.run(lambda out: 1 in cluster.de._finishing or _finished(1)(out))
        else:
            cluster.run(lambda _: any(len(a.seq.output_ids) >= 30
                                      for a in cluster.de._active.values()))
            cluster.de.abort(1)
        cluster.start(2, second, kv2, out2[0], 8)
        cluster.run(_finished(2))
        cluster.run(lambda _: cluster.de._staging_in_use == 0)  # every save has ended
        assert cluster.de.num_saves_dropped == 0
        tokens = first + (out1 if end == "finish" else out1[:30])
        num_full = (len(tokens) - 1) // BLOCK  # the last token's KV is never computed
        stored = cluster.stored(tokens[: num_full * BLOCK])
        assert stored.shape[0] == num_full >= 4
        for b in range(num_full):
            assert torch.allclose(stored[b], kv1[b], atol=1e-4, rtol=1e-3), (
                f"stored block {b} of request 1 is not request 1's KV: max error "
                f"{(stored[b] - kv1[b]).abs().max():.3g}")
        assert cluster.engine.pool.num_free_blocks == 5  # every hold was let go
        report = verify_store(cluster.store, tiny_chaotic_dir, sample=None)  # the audit agrees
        assert report.ok and report.num_checked >= num_full + 1, report.to_dict()
    finally:
        cluster.traffic.close()
