"""The decode side of an engine process that drives a vLLM instance (``engine_kind = "vllm"``;
``vllm/engines/prefill.py`` has the prefill side and what both share).

``VllmDecodeWorker`` is the decode node's buffer service: it owns the host buffer, a shared
file mapping (``HostPool(shm_path=...)``) that the decode instance's connector maps read-only,
allocates a request's buffer as a contiguous run of slots and reads its DE-path hit into it,
layer-major (as ``engine/decode_storage.py`` does), answering ``BufferReady`` once the read's
I/O is done. On ``Decode`` it streams a completion of the prompt plus the first token from the
instance (``kv_transfer_params["dualpath"]`` tells the connector where the buffer is), turns
each chunk's token ids into ``Tokens`` and the end into ``Finished``, indexed as
``DecodeWorker`` does. The buffer is freed with the first chunk that carries tokens (the
instance has copied it in by then) or when the call ends; an abort closes the stream (vLLM
aborts the request) and frees it — or, when a PE may still write into it (``fenced``), keeps it
until the router's ``Unfence`` (``engine/prompt_buffers.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dualpath.ending import finish_reason
from dualpath.engine.prompt_buffers import PromptBuffers
from dualpath.integrations.vllm.engines.http import HttpCall, VllmHttp
from dualpath.integrations.vllm.engines.prefill import (
    DE_STREAM_THREADS,
    VllmWorkerBase,
    error_detail,
    sampling_body,
)
from dualpath.integrations.vllm.plan import (
    SEAL_BYTES,
    DecodeParams,
    seal_of,
    seal_offset,
    vllm_salt,
)
from dualpath.kv.hashing import KeySpace
from dualpath.kv.host_pool import HostPool
from dualpath.kv.layout import KVLayout
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    Decode,
    Failed,
    Finished,
    Message,
    Tokens,
    Unfence,
)
from dualpath.request import SamplingParams
from dualpath.storage.client import StorageClient


@dataclass(eq=False)
class _DecodeCall:
    req_id: int
    slots: list[int]  # the prompt buffer, until the first chunk (then freed: [])
    call: HttpCall
    outputs: list[int]  # prior outputs, the first token, then what vLLM streamed
    num_streamed: int  # outputs the router has
    finish_reason: str = ""
    started_s: float = field(default_factory=time.monotonic)
    # its prompt: an unsealed buffer is recomputed before the first token (the liveness budget)
    num_prompt_tokens: int = 1
    answering: bool = False  # the instance has begun streaming (a chunk came)


class VllmDecodeWorker(VllmWorkerBase):
    """The decode node's buffer service (``AllocBuffer``, DE-path reads) and, on ``Decode``, a
    streamed completion on the decode instance, whose connector copies the buffer in."""

    def __init__(self, http: VllmHttp, model: str, layout: KVLayout, key_space: KeySpace,
                 host_pool: HostPool, storage: StorageClient,
                 eos_token_ids: frozenset[int] = frozenset(), max_position: int | None = None,
                 threads: int = DE_STREAM_THREADS) -> None:
        """``host_pool`` must be a shared one (``shm_path``): the instance maps its file.
        ``key_space``: vLLM's (its ``vllm_layout_id``); ``eos_token_ids`` and ``max_position``
        end a request on its first token without a call, as ``DecodeWorker`` would."""
        if not host_pool.shm_path:
            raise ValueError("the vLLM decode worker's host pool must be shared (shm_path)")
        if host_pool.payload_bytes < layout.full_block_bytes + SEAL_BYTES:
            raise ValueError("the host pool's slots need room for a block and a seal "
                             f"({layout.full_block_bytes} + {SEAL_BYTES} bytes)")
        super().__init__(http, model, layout.block_size, threads)
        self.layout = layout
        self.key_space = key_space
        self.host_pool = host_pool
        self.storage = storage
        self.eos_token_ids = eos_token_ids
        self.max_position = max_position
        # the buffers, as our decode engine's (a finished read reaches the loop by ``_post``)
        self.buffers = PromptBuffers(host_pool, storage, layout, key_space, self._read_io_done,
                                     self._new_buffer)
        self._streams: dict[int, _DecodeCall] = {}
        self.num_decoded_tokens = 0
        self.num_finished_without_call = 0
        self.num_persisted_blocks = 0  # stored here, of requests that never reached vLLM
        self.num_unsealed_ends = 0  # such requests whose buffer had no seal: nothing stored

    def handle(self, msg: Message) -> list[Message]:
        """``AllocBuffer``, ``Decode`` or ``Abort``; returns the answers."""
        if isinstance(msg, AllocBuffer):
            return self.buffers.alloc_buffer(msg)
        if isinstance(msg, Decode):
            return self.start_decode(msg)
        if isinstance(msg, Abort):
            return self.abort(msg.req_id, msg.fenced)
        if isinstance(msg, Unfence):
            return self.buffers.unfence(msg)
        raise ValueError(f"a decode engine cannot handle {msg.type!r}")

    def settled(self) -> bool:
        """The decode side writes into no other engine's memory."""
        return True

    def work(self) -> list[Message]:
        """Finished reads, stream chunks and ends; returns the messages to send (one
        ``Tokens`` for every stream's new tokens)."""
        out = self.drain()
        tokens = [m for m in out if isinstance(m, Tokens)]
        rest = [m for m in out if not isinstance(m, Tokens)]
        items = tuple(item for m in tokens for item in m.items)
        return ([Tokens(items)] if items else []) + rest

    # -- buffer (``PromptBuffers``, as our decode engine's) -------------------------------------
    def _read_io_done(self, req_id: int, first: int, future: Future[list[bool]]) -> None:
        """A DE-path read's I/O ended: the loop runs the buffers' ``read_done`` (``drain``)."""
        self._post(lambda: self.buffers.read_done(req_id, first, future))

    def _new_buffer(self, slots: list[int]) -> None:
        """Zero a new buffer's seal: the decode instance copies it in only once the prefill
        has written this request's seal, after its last push (``vllm_plan.seal_of``)."""
        where = seal_offset(len(slots), self.layout.full_block_bytes)
        self.host_pool.region(slots[0], len(slots))[where : where + SEAL_BYTES] = 0

    # -- decode ---------------------------------------------------------------------------------
    def start_decode(self, msg: Decode) -> list[Message]:
        """Stream the completion of the prompt plus the first token from the instance (or end
        the request now when the first token already ends it)."""
        alloc = self.buffers.allocs.get(msg.req_id)
        if alloc is None:
            return [Failed(msg.req_id, "no prompt buffer for this request")]
        prompt = alloc.prompt_ids
        if not 0 <= msg.num_prior_outputs < len(prompt):
            return [Failed(msg.req_id, f"{msg.num_prior_outputs} prior outputs of "
                                       f"{len(prompt)} tokens")]
        if msg.local:  # the router prefills locally on our engines only
            return [Failed(msg.req_id, "a vLLM decode engine takes no local prefill")]
        _, slots = self.buffers.take(msg.req_id)
        prior = list(prompt[len(prompt) - msg.num_prior_outputs:])
        job = _DecodeCall(msg.req_id, slots, HttpCall(), prior, msg.num_prior_outputs or 1,
                          num_prompt_tokens=len(prompt))
        self.num_requests += 1
        reason = self._ends(prior, msg.params, len(prompt) - msg.num_prior_outputs)
        if reason is None:
            job.outputs.append(msg.first_token)
            reason = self._ends(job.outputs, msg.params, len(prompt) - msg.num_prior_outputs)
        if reason is not None:
            self.num_finished_without_call += 1
            out = self._persist_then_free(msg.req_id, alloc, slots, msg.num_stored_blocks)
            return out + self._finish(job, reason)
        body = self.decode_body(msg, alloc, slots, len(job.outputs))
        self._streams[msg.req_id] = job
        self._pool.submit(self._stream, job, body)
        return []

    def _persist_then_free(self, req_id: int, alloc: AllocBuffer, slots: list[int],
                           num_stored: int) -> list[Message]:
        """Store the prompt's full blocks past the ``num_stored`` leading ones from the buffer,
        then free it. A request that ends on its first token (``max_tokens`` 1, an EOS) never
        reaches the decode instance, whose connector persists a prompt's blocks otherwise; its
        KV is in the buffer all the same, complete once the prefill's seal is there (no seal:
        nothing is stored, as the instance would recompute)."""
        num_full = len(alloc.prompt_ids) // self.layout.block_size
        if num_full <= num_stored or not self._sealed(req_id, slots):
            return self._free(slots)
        keys = self.key_space.salted(alloc.cache_salt).keys(alloc.prompt_ids)[num_stored:num_full]
        parts = self.buffers.block_parts(slots, num_stored, num_full)
        self.num_persisted_blocks += len(keys)
        future = self.storage.submit_write(keys, parts)  # never raises: a failure is a miss
        future.add_done_callback(lambda _: self._post(lambda: self._free(slots)))
        return []

    def _sealed(self, req_id: int, slots: list[int]) -> bool:
        """Whether the prefill sealed request ``req_id``'s buffer (its pushes all landed)."""
        where = seal_offset(len(slots), self.layout.full_block_bytes)
        seal = bytes(self.host_pool.region(slots[0], len(slots))[where : where + SEAL_BYTES])
        if seal == seal_of(req_id):
            return True
        self.num_unsealed_ends += 1
        return False

    def _free(self, slots: list[int]) -> list[Message]:
        """Slots back to the pool; the allocations that waited for them start."""
        self.host_pool.free(slots)
        return self.buffers.start_allocs()

    def _ends(self, outputs: list[int], params: SamplingParams, num_prompt: int) -> str | None:
        """Why a request whose outputs are ``outputs`` has ended (None: it has not), by
        ``DecodeWorker``'s rules on its last token (EOS, ``max_tokens``, the model's context;
        stop strings are vLLM's business)."""
        if not outputs:
            return None
        return finish_reason(params, len(outputs), outputs[-1], num_prompt + len(outputs),
                             self.eos_token_ids, self.max_position)

    def decode_body(self, msg: Decode, alloc: AllocBuffer, slots: list[int],
                    num_outputs: int) -> dict[str, Any]:
        """The streamed completion request of a ``Decode`` (the connector's contract);
        ``num_outputs``: the outputs so far, the first token included."""
        params, salt = msg.params, alloc.cache_salt
        body: dict[str, Any] = {
            "model": self.model, "prompt": [*alloc.prompt_ids, msg.first_token],
            "max_tokens": params.max_tokens - num_outputs, **sampling_body(params),
            "stop": list(params.stop), "ignore_eos": params.ignore_eos,
            "min_tokens": max(0, params.min_tokens - num_outputs),
            "return_token_ids": True, "stream": True}
        if salt:
            body["cache_salt"] = vllm_salt(salt)  # vLLM's limits; keys use the salt itself
        offset = self.host_pool.address(slots[0]) - self.host_pool.base_address
        body["kv_transfer_params"] = DecodeParams(
            msg.req_id, self.host_pool.shm_path, offset, len(slots), len(alloc.prompt_ids),
            msg.num_stored_blocks, salt).to_params()
        return body

    def _stream(self, job: _DecodeCall, body: dict[str, Any]) -> None:
        """Run one stream (a call thread): post each chunk's tokens, then its end."""
        error: Exception | None = None
        try:
            with self.http.stream_completions(body, job.call) as stream:
                for chunk in stream:
                    job.answering = True
                    choice = (chunk.get("choices") or [{}])[0]
                    tokens = [int(t) for t in choice.get("token_ids") or ()]
                    reason = str(choice.get("finish_reason") or "")
                    self._post(lambda t=tokens, r=reason: self._chunk(job, t, r))
        except Exception as exc:  # reported to the router as this request's failure
            error = exc
        self._post(lambda: self._stream_end(job, error))

    def _chunk(self, job: _DecodeCall, tokens: list[int], reason: str) -> list[Message]:
        if self._streams.get(job.req_id) is not job:
            return []  # aborted
        if job.slots and (tokens or reason):  # the instance has copied the buffer in
            self.host_pool.free(job.slots)
            job.slots = []
            out = self.buffers.start_allocs()
        else:
            out = []
        job.outputs.extend(tokens)
        self.num_decoded_tokens += len(tokens)
        job.finish_reason = reason or job.finish_reason
        return out + self._new_tokens(job)

    def _new_tokens(self, job: _DecodeCall) -> list[Message]:
        if len(job.outputs) <= job.num_streamed:
            return []
        item = (job.req_id, job.num_streamed, tuple(job.outputs[job.num_streamed:]))
        job.num_streamed = len(job.outputs)
        return [Tokens((item,))]

    def _stream_end(self, job: _DecodeCall, error: Exception | None) -> list[Message]:
        if self._streams.get(job.req_id) is not job:
            return []  # aborted: answered then
        del self._streams[job.req_id]
        self.http_s_total += time.monotonic() - job.started_s
        out: list[Message] = []
        if job.slots:  # the call ended before any chunk
            self.host_pool.free(job.slots)
            job.slots = []
            out = self.buffers.start_allocs()
        if error is not None:
            self.num_failures += 1
            return [*out, Failed(job.req_id, f"vllm decode instance {self.http.url}: "
                                             f"{error_detail(error)}")]
        return out + self._finish(job, job.finish_reason)

    def _finish(self, job: _DecodeCall, reason: str) -> list[Message]:
        """Stream what the router lacks, then ``Finished`` with every output token."""
        return [*self._new_tokens(job), Finished(job.req_id, tuple(job.outputs), reason)]

    # -- abort and state ------------------------------------------------------------------------
    def abort(self, req_id: int, fenced: bool = False) -> list[Message]:
        """Drop a request in any phase: close its stream (vLLM aborts it) and free its buffer
        (once unfenced when a PE may still write into it: ``fenced``); answers ``Aborted``."""
        self.buffers.drop(req_id, fenced)
        job = self._streams.pop(req_id, None)
        if job is not None:
            job.call.close()
            self.buffers.release(req_id, job.slots, fenced)
            job.slots = []
            self.num_aborted += 1
        return [Aborted(req_id), *self.buffers.start_allocs()]

    def _open_calls(self) -> list[HttpCall]:
        return [job.call for job in list(self._streams.values())]

    def _calls_waiting(self) -> list[tuple[float, int]]:
        """Streams whose first chunk has not come yet."""
        return [(job.started_s, job.num_prompt_tokens) for job in list(self._streams.values())
                if not job.answering]

    def held_requests(self) -> tuple[int, ...]:
        """Req ids held in any phase."""
        ids = self.buffers.held() | set(self._streams)
        return tuple(sorted(ids - self.buffers.orphans))

    def fenced_requests(self) -> tuple[int, ...]:
        """Req ids whose buffer is fenced (``PromptBuffers``)."""
        return self.buffers.fenced_requests()

    @property
    def read_queue_tokens(self) -> int:
        """The storage client's unfinished reads."""
        return self.storage.read_queue_tokens

    def metrics(self) -> dict[str, object]:
        """This worker's counters."""
        return {**self.base_metrics(), "num_waits": self.buffers.num_waits,
                "num_decoded_tokens": self.num_decoded_tokens,
                "num_finished_without_call": self.num_finished_without_call,
                "num_persisted_blocks": self.num_persisted_blocks,
                "num_unsealed_ends": self.num_unsealed_ends}
