"""The prefill engine (PE): layerwise prefill that assembles each prompt's KV in a DE buffer.

Requests arrive as ``Prefill`` messages. On the PE read path the hit full blocks are read from
storage into this engine's host buffer as soon as the request arrives (the node's read queue),
so reads overlap the compute of earlier requests. Requests whose reads are done are batched
in arrival order under the compute quota (``scheduler/batch.py``, docs/paper.md §5.5): whole
requests while the predicted time fits, then the largest chunk of the next one; the rest of a
chunked request goes into later batches. Without a cost model (no profile) a forward takes the
first request's next chunk of at most ``max_num_batched_tokens`` (whole blocks) and then whole
later requests while the forward's tokens stay within that budget, as vLLM's scheduler does, so
no forward is longer than a step's budget of tokens and the heartbeat's progress moves at the
pace of a chunk's layers.
The queue is in placement order (the router's wire ids: a DE-path request, which
arrives once its DE buffer is filled, takes the place it was given), and a request still
reading is passed over, not waited for, so a long read on this node's storage NIC does not
idle the PE while other requests' KV is ready (docs/paper.md §5.5 is silent on both; the simulator
also passes over reads, queueing a request once its read is done).

The forward computes only the miss tokens; per request, ``PrefillHooks`` load its hit KV
(first chunk) and forward each layer's new blocks to its DE buffer, overlapped with compute.
The forward and the sampling of the first token are ``LLMEngine``'s own (``forward``,
``sample``): this worker only schedules the batches into its own cache blocks.

In the layerwise modes the device cache holds a window of layers (``prefill_layer_window``), so
the same device-KV budget holds ``num_layers / window`` times the blocks and batches grow by as
much; a later chunk of a chunked prompt pulls its earlier blocks back from the DE buffer. A
split read reads the leading hit blocks here and the DE reads the rest.

A read that finds the host pool full waits (FIFO) for earlier requests to free their slots.
A job is ready once no read into its slots can still run (``io_done``): blocks the storage read
deadline gave up on are computed, and a late block can never land in a reused slot. ``abort``
drops a request between forwards, keeping its slots until its read's I/O has ended.

Write fences: ``Prefilled``, ``Failed`` and ``Aborted`` go out only once no write of the request
into its DE buffer can still land (a forward's sends are waited for, or settled when it fails),
and a forward checks before and after every layer whether the router has dropped this engine
(``abandon``): then it stops, settles what it had sent, and pushes nothing further.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from dualpath.engine.faults import forward_hooks
from dualpath.engine.layerwise import LayerPlan, PrefillHooks
from dualpath.engine.llm_engine import Forwarded, LLMEngine
from dualpath.engine.prefill_jobs import BlockRuns, PrefillJob
from dualpath.errors import RequestError
from dualpath.kv.block_plan import load_blocks
from dualpath.kv.host_pool import HostPool
from dualpath.model.hooks import ComposedHooks
from dualpath.protocol import Abort, Aborted, Failed, Message, Prefill, Prefilled, ReadDone
from dualpath.request import Sequence
from dualpath.scheduler.batch import AttentionCostModel, build_prefill_batch
from dualpath.storage.client import ReadFuture, StorageClient
from dualpath.storage.warm import warm_tag
from dualpath.traffic.manager import TrafficManager
from dualpath.vocab import PrefillMode


class PrefillWorker:
    """Turns ``Prefill`` requests into prompt KV in DE buffers plus a first token."""

    def __init__(self, engine: LLMEngine, host_pool: HostPool, traffic: TrafficManager,
                 storage: StorageClient, cost_model: AttentionCostModel | None = None,
                 quota_ms: float = 300.0) -> None:
        self.engine = engine
        self.host_pool = host_pool
        self.traffic = traffic
        self.storage = storage
        self.cost_model = cost_model
        self.quota_ms = quota_ms
        self.block_size = engine.config.block_size
        self._runs = BlockRuns(engine.runner.cache.num_blocks)
        self._jobs: deque[PrefillJob] = deque()
        self._orphan_reads: list[tuple[ReadFuture, list[int]]] = []  # aborted, still reading
        self.num_prefilled = 0
        self.num_forwards = 0
        self.num_chunks = 0  # request chunks computed (> requests when chunking happened)
        self.num_hit_tokens = 0
        self.num_computed_tokens = 0
        self.forward_s_total = 0.0  # wall time of forwards, the step hook included
        self.layer_wait_s_total = 0.0  # of it, blocked on layer loads and sends (layerwise)
        self.max_forward_hit_tokens = 0  # most hit tokens one forward held in device memory
        # Called inside each forward with its computed token count, e.g. the EP traffic
        # generator's exchange (the forward waits for it, as MoE dispatch/combine would).
        self.on_step: Callable[[int], None] = lambda num_tokens: None
        # polled before and after every layer: True once the router dropped this engine (the
        # forward stops sending into buffers that may belong to other requests by now)
        self.abandon: Callable[[], bool] = lambda: False
        self.name = ""  # this engine's name (the test-only mid-forward hang's flag)

    def handle(self, msg: Message) -> list[Message]:
        """A request message from the router: ``Prefill`` or ``Abort``; returns the answers."""
        if isinstance(msg, Prefill):
            self.accept(msg)
            return []
        if isinstance(msg, Abort):
            return self.abort(msg.req_id)
        raise ValueError(f"a prefill engine cannot handle {msg.type!r}")

    def work(self) -> list[Message]:
        """Start the reads that fit the host pool now, then run one forward batch of the ready
        requests (if any); returns the messages to send."""
        self.start_reads()
        return self.run_next() if self.has_work else []

    def metrics(self) -> dict[str, object]:
        """This worker's counters."""
        return {"num_prefilled": self.num_prefilled, "num_forwards": self.num_forwards,
                "num_chunks": self.num_chunks, "num_hit_tokens": self.num_hit_tokens,
                "num_computed_tokens": self.num_computed_tokens,
                "forward_s_total": self.forward_s_total,
                "layer_wait_s_total": self.layer_wait_s_total,
                "max_forward_hit_tokens": self.max_forward_hit_tokens}

    def accept(self, msg: Prefill) -> None:
        """Queue a request and start its storage read (PE read path)."""
        if not 0 <= msg.num_prior_outputs < len(msg.prompt_ids):
            raise RequestError(f"{msg.num_prior_outputs} prior outputs of "
                               f"{len(msg.prompt_ids)} tokens")
        num_blocks = -(-len(msg.prompt_ids) // self.block_size)
        if num_blocks > len(self._runs.free):
            raise RequestError(f"the prompt needs {num_blocks} KV blocks, the PE cache has "
                               f"{len(self._runs.free)}")
        if msg.mode == PrefillMode.BASIC and self.engine.runner.cache.is_window:
            raise RequestError("basic prefill keeps every layer resident; this prefill engine "
                               "holds a layer window (it runs layerwise modes)")
        job = self._new_job(msg)
        job.waiting_slots = job.num_pe_read_blocks > 0
        self._enqueue(job)
        self.start_reads()

    def _enqueue(self, job: PrefillJob) -> None:
        """Queue a job in placement order (the router numbers attempts as it places them): a
        DE-path request arrives once its DE buffer is filled, and takes the place it was
        given then, so its storage read overlaps its wait as a PE-path read does."""
        at = len(self._jobs)
        while at > 0 and self._jobs[at - 1].msg.req_id > job.msg.req_id:
            at -= 1
        self._jobs.insert(at, job)

    def _new_job(self, msg: Prefill) -> PrefillJob:
        """A job and the leading hit blocks it reads here (no more than the pool holds: a
        hit beyond what is read on either side is computed)."""
        hit = msg.num_hit_blocks
        wanted = load_blocks(msg.read_path, hit, msg.num_pe_read_blocks)
        if msg.mode == PrefillMode.ORACLE:
            wanted = 0
        pe_reads = min(wanted, self.host_pool.num_slots)
        if pe_reads < wanted:
            hit = pe_reads
        return PrefillJob(msg, num_hit_blocks=hit, num_pe_read_blocks=pe_reads)

    def start_reads(self) -> None:
        """Start the reads of waiting jobs, in order, while the host pool has room."""
        self._free_orphans()
        for job in self._jobs:
            if not job.waiting_slots:
                continue
            if job.num_pe_read_blocks > self.host_pool.num_free:
                return
            job.waiting_slots = False
            job.slots = self.host_pool.alloc(job.num_pe_read_blocks)
            space = self.engine.key_space.salted(job.msg.cache_salt)
            keys = space.keys(job.msg.prompt_ids)[: job.num_pe_read_blocks]
            job.read_submitted_s = time.monotonic()
            job.read = self.storage.submit_read(
                keys, [self.host_pool.buffer(s) for s in job.slots],
                keep=warm_tag(job.msg.warm_session, job.msg.warm_lease_s))
            job.read.add_done_callback(lambda _, j=job: setattr(j, "read_done_s",
                                                                time.monotonic()))

    def abort(self, req_id: int) -> list[Message]:
        """Drop a request between forwards and free what it holds; answers ``Aborted`` (no send
        of it is in flight between forwards; nothing writes into a PE's slots but its own
        reads, which are waited for)."""
        for job in [j for j in self._jobs if j.msg.req_id == req_id]:
            self._jobs.remove(job)
            self._let_go(job)
        self.start_reads()
        return [Aborted(req_id)]

    def held_requests(self) -> tuple[int, ...]:
        """Req ids this engine holds."""
        return tuple(job.msg.req_id for job in self._jobs)

    def liveness(self) -> tuple[float, float]:
        """When a layer of a forward last finished, and how long the one under way should
        take."""
        clock = self.engine.runner.clock
        return clock.progress_s, clock.budget_s()

    def fenced_requests(self) -> tuple[int, ...]:
        """A prefill engine keeps no buffer for another engine's writes."""
        return ()

    @property
    def read_queue_tokens(self) -> int:
        """The storage client's unfinished reads."""
        return self.storage.read_queue_tokens

    def close(self) -> None:
        """Nothing of its own to stop: the storage client and traffic manager are the
        process's."""

    def settled(self) -> bool:
        """Between forwards no send is in flight (a forward waits for its sends, or settles
        them when it fails or is abandoned)."""
        return True

    def _let_go(self, job: PrefillJob) -> None:
        """Free a job's cache blocks and host slots (the slots once its read has ended)."""
        if job.seq is not None:
            self.engine.sampler.release(job.seq.seq_id)
            self._runs.give_back(job.seq.block_table)
            job.seq = None
        if job.read is not None and not job.read.io_done.done():
            self._orphan_reads.append((job.read, job.slots))
        else:
            self.host_pool.free(job.slots)
        job.slots = []

    def _free_orphans(self) -> None:
        still = []
        for read, slots in self._orphan_reads:
            if read.io_done.done():
                self.host_pool.free(slots)
            else:
                still.append((read, slots))
        self._orphan_reads = still

    @property
    def has_work(self) -> bool:
        """True when some accepted request can be computed now."""
        return any(job.ready for job in self._jobs)

    @property
    def free_kv_blocks(self) -> int:
        """PE cache blocks not held by a request."""
        return self._runs.num_free

    @property
    def has_waiting_reads(self) -> bool:
        """True while reads wait for host-pool room or aborted reads still hold slots."""
        return bool(self._orphan_reads) or any(j.waiting_slots for j in self._jobs)

    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet prefilled."""
        return len(self._jobs)

    def run_next(self) -> list[Message]:
        """Run one forward batch of ready requests; returns the messages to send."""
        out: list[Message] = []
        ready = [job for job in self._jobs if job.ready]  # FIFO, passing over reads in flight
        # A request being chunked (it holds PE cache blocks) goes on first: one placed before
        # it whose read has just ended might find no cache room while it holds them.
        ready.sort(key=lambda job: job.seq is None)
        for job in ready:
            out.extend(self._report_read(job))
        batch = self._pick(ready)
        try:
            out.extend(self._forward(batch))
        except Exception as exc:  # e.g. its DE died mid-transfer: fail these, keep serving
            out.extend(self._fail(batch, f"{type(exc).__name__}: {exc}"))
        self.start_reads()
        return out

    def _fail(self, batch: list[tuple[PrefillJob, int]], error: str) -> list[Message]:
        out: list[Message] = []
        for job, _ in batch:
            if job in self._jobs:
                self._jobs.remove(job)
                self._let_go(job)
            out.append(Failed(job.msg.req_id, error))
        return out

    def _report_read(self, job: PrefillJob) -> list[Message]:
        if job.read is None or job.read_reported:
            return []
        job.read_reported = True
        ok = job.read.result()
        good = next((i for i, good in enumerate(ok) if not good), len(ok))
        if good < job.num_pe_read_blocks:  # the hit ends at the first block not read
            job.num_hit_blocks = job.num_pe_read_blocks = good
        return [ReadDone(job.msg.req_id, job.num_hit_blocks)]

    def _pick(self, ready: list[PrefillJob]) -> list[tuple[PrefillJob, int]]:
        """(job, tokens to compute now) under the compute quota, FIFO; without a cost model
        under the token budget (:meth:`_budget_batch`)."""
        if self.cost_model is None:
            return self._budget_batch(ready)
        fifo = [(i, self._cached(job), self._remaining(job)) for i, job in enumerate(ready)]
        chosen = build_prefill_batch(fifo, self.quota_ms, self.cost_model)
        batch = []
        for i, _, bsz in chosen:
            if ready[i].seq is None and self._start(ready[i]) is None:
                break  # no contiguous cache room: wait for earlier requests to finish
            batch.append((ready[i], bsz))
        return batch or [(ready[0], self._remaining(ready[0]))]

    def _budget_batch(self, ready: list[PrefillJob]) -> list[tuple[PrefillJob, int]]:
        """Without a cost model, vLLM's token budget: the first job's next chunk (at most
        ``max_num_batched_tokens``), then whole later jobs in FIFO order while the batch's
        tokens stay within it. A forward reads every weight once whatever its tokens, so the
        short turns of agents (tens of new tokens on a cached context) share one."""
        first = ready[0]
        batch = [(first, self._chunk(first))]
        budget = self.engine.config.max_num_batched_tokens - batch[0][1]
        for job in ready[1:]:
            need = self._remaining(job)
            if need > budget or (job.seq is None and self._start(job) is None):
                break  # FIFO: no later job jumps one that does not fit
            batch.append((job, need))
            budget -= need
        return batch

    def _chunk(self, job: PrefillJob) -> int:
        """The job's next chunk: what remains, cut to ``max_num_batched_tokens`` rounded down
        to whole blocks (at least one), so every chunk but the last ends on a block boundary."""
        limit = self.engine.config.max_num_batched_tokens // self.block_size * self.block_size
        return min(self._remaining(job), max(limit, self.block_size))

    def _cached(self, job: PrefillJob) -> int:
        return job.seq.num_computed_tokens if job.seq else job.num_hit_blocks * self.block_size

    def _remaining(self, job: PrefillJob) -> int:
        return len(job.msg.prompt_ids) - self._cached(job)

    def _start(self, job: PrefillJob) -> Sequence | None:
        """The job's sequence in a run of free cache blocks (None: no run is free). A moved
        stream's prior outputs are its outputs, so its first token is drawn as output token
        ``num_prior_outputs``; the PE samples that one token and applies no stop rule."""
        msg = job.msg
        blocks = self._runs.take(-(-len(msg.prompt_ids) // self.block_size))
        if blocks is None:
            return None
        num_prompt = len(msg.prompt_ids) - msg.num_prior_outputs
        seq = Sequence(list(msg.prompt_ids[:num_prompt]), msg.params,
                       output_ids=list(msg.prompt_ids[num_prompt:]), cache_salt=msg.cache_salt)
        seq.block_table = blocks
        seq.num_computed_tokens = job.num_hit_blocks * self.block_size
        self.num_hit_tokens += seq.num_computed_tokens
        job.seq = seq
        return seq

    def _forward(self, batch: list[tuple[PrefillJob, int]]) -> list[Message]:
        items: list[tuple[Sequence, int]] = []
        for job, bsz in batch:
            seq = job.seq or self._start(job)
            if seq is None:
                raise RequestError("no contiguous PE cache room for the request")
            items.append((seq, bsz))
        parts = [self._hooks(job, bsz) for job, bsz in batch]
        hooks = ComposedHooks(forward_hooks(self.abandon, self.name, list(parts)))
        started_s = time.monotonic()
        try:
            done = self.engine.forward(items, hooks)
        except Exception:
            for part in parts:  # no load or send of this forward may outlive it
                part.settle()
            raise
        self.on_step(sum(bsz for _, bsz in batch))
        ended_s = time.monotonic()
        self.forward_s_total += ended_s - started_s
        self.layer_wait_s_total += sum(part.wait_s for part in parts)
        for job, _ in batch:
            job.first_forward_s = job.first_forward_s or started_s
            job.last_forward_end_s = ended_s
        self.num_forwards += 1
        hit = sum(job.num_hit_blocks * self.block_size for job, _ in batch if not job.loaded)
        self.max_forward_hit_tokens = max(self.max_forward_hit_tokens, hit)
        self.num_chunks += len(batch)
        for job, bsz in batch:
            job.loaded = True
            job.num_computed_tokens += bsz
            self.num_computed_tokens += bsz
        return self._complete(batch, done) if done.seqs else []

    def _hooks(self, job: PrefillJob, bsz: int) -> PrefillHooks:
        msg, seq = job.msg, job.seq
        assert seq is not None
        first_chunk = not job.loaded
        cached = seq.num_computed_tokens
        window = self.engine.runner.cache.is_window
        plan = LayerPlan(seq.block_table, job.num_hit_blocks, msg.read_path, msg.mode,
                         msg.de_endpoint, msg.de_buffer_addr, job.slots, load_hit=first_chunk,
                         forward_from=None if first_chunk else cached // self.block_size,
                         forward_to=-(-(cached + bsz) // self.block_size),
                         # a window kept no layer of the earlier chunks: they come back from
                         # the DE buffer, where those chunks sent them
                         reload_blocks=0 if first_chunk or not window
                         else -(-cached // self.block_size),
                         num_pe_read_blocks=job.num_pe_read_blocks)
        return PrefillHooks(plan, self.engine.runner.cache, self.traffic, self.host_pool,
                            group_bytes=self.traffic.config.layer_group_bytes)

    def _complete(self, batch: list[tuple[PrefillJob, int]], done: Forwarded) -> list[Message]:
        """Sample the first token of the batch's requests computed to their end (this
        attempt's first output token) and answer ``Prefilled`` for each."""
        jobs = {id(job.seq): job for job, _ in batch}
        tokens = self.engine.sample(done)
        out: list[Message] = []
        for seq, token in zip(done.seqs, tokens, strict=True):
            job = jobs[id(seq)]
            self.engine.sampler.release(seq.seq_id)
            self._runs.give_back(seq.block_table)
            self.host_pool.free(job.slots)
            self._jobs.remove(job)
            self.num_prefilled += 1
            out.append(Prefilled(job.msg.req_id, token, job.num_hit_blocks,
                                 job.num_computed_tokens, **job.timings()))
        return out
