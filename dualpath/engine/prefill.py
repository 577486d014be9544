"""The prefill engine (PE): layerwise prefill that assembles each prompt's KV in a DE buffer.

Requests arrive as ``Prefill`` messages. On the PE read path the hit full blocks are read from
storage into this engine's host buffer as soon as the request arrives (the node's read queue),
so reads overlap the compute of earlier requests; requests are computed in arrival order once
their reads are done. The forward computes only the miss tokens; ``PrefillHooks`` load the
hit KV and forward every layer to the DE buffer.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from dualpath.engine.layerwise import LayerPlan, PrefillHooks
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.traffic import TrafficManager
from dualpath.errors import RequestError
from dualpath.kv.host_pool import HostPool
from dualpath.protocol import Message, Prefill, Prefilled, ReadDone
from dualpath.request import SamplingParams, Sequence
from dualpath.storage.client import StorageClient


@dataclass
class _Job:
    msg: Prefill
    slots: list[int] = field(default_factory=list)
    read: Future[list[bool]] | None = None
    num_hit_blocks: int = 0


class PrefillWorker:
    """Turns ``Prefill`` requests into prompt KV in DE buffers plus a first token."""

    def __init__(self, engine: LLMEngine, host_pool: HostPool, traffic: TrafficManager,
                 storage: StorageClient) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.traffic = traffic
        self.storage = storage
        self.block_size = engine.config.block_size
        self._jobs: deque[_Job] = deque()
        self.num_prefilled = 0
        self.num_hit_tokens = 0
        self.num_computed_tokens = 0

    def accept(self, msg: Prefill) -> None:
        """Queue a request and start its storage read (PE read path)."""
        job = _Job(msg, num_hit_blocks=msg.num_hit_blocks)
        if msg.read_path == "pe" and msg.num_hit_blocks and msg.mode != "oracle":
            job.slots = self.host_pool.alloc(msg.num_hit_blocks)
            keys = self.engine.key_space.keys(msg.prompt_ids)[: msg.num_hit_blocks]
            job.read = self.storage.submit_read(keys, [self.host_pool.buffer(s) for s in job.slots])
        self._jobs.append(job)

    @property
    def has_ready_job(self) -> bool:
        """True when the oldest request can be computed now."""
        return bool(self._jobs) and (self._jobs[0].read is None or self._jobs[0].read.done())

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet prefilled."""
        return len(self._jobs)

    def run_next(self) -> list[Message]:
        """Prefill the oldest ready request; returns the messages to send."""
        job = self._jobs.popleft()
        out: list[Message] = []
        if job.read is not None:
            ok = job.read.result()
            job.num_hit_blocks = next((i for i, good in enumerate(ok) if not good), len(ok))
            out.append(ReadDone(job.msg.req_id, job.num_hit_blocks))
        try:
            first_token = self._prefill(job)
        finally:
            self.host_pool.free(job.slots)
        out.append(Prefilled(job.msg.req_id, first_token, job.num_hit_blocks))
        return out

    def _prefill(self, job: _Job) -> int:
        msg, engine = job.msg, self.engine
        params = SamplingParams(max_tokens=1, temperature=msg.temperature, top_p=msg.top_p,
                                seed=msg.seed, ignore_eos=True)
        seq = Sequence(list(msg.prompt_ids), params)
        num_blocks = -(-len(seq.prompt_ids) // self.block_size)
        if num_blocks > engine.runner.cache.num_blocks:
            raise RequestError(f"the prompt needs {num_blocks} KV blocks, the PE cache has "
                               f"{engine.runner.cache.num_blocks}")
        # The PE holds one request's KV at a time, in blocks 0..n-1: each layer of the request
        # is then one contiguous region, and one segment on the wire.
        seq.block_table = list(range(num_blocks))
        try:
            seq.num_computed_tokens = job.num_hit_blocks * self.block_size
            num_new = seq.num_tokens - seq.num_computed_tokens
            plan = LayerPlan(seq.block_table, job.num_hit_blocks, msg.read_path, msg.mode,
                             msg.de_endpoint, msg.de_buffer_addr, job.slots)
            hooks = PrefillHooks(plan, engine.runner.cache, self.traffic, self.host_pool)
            inputs = engine.runner.prepare([(seq, num_new)])
            hidden = engine.runner.run(inputs, hooks)
            logits = engine.runner.logits(hidden[inputs.last_rows])
            token = engine.sampler.sample(logits, [params], [seq.seq_id])[0]
        finally:
            engine.sampler.release(seq.seq_id)
        self.num_prefilled += 1
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_computed_tokens += num_new
        return token
