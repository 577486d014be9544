"""The single-engine runner: ``step()`` is schedule → run → postprocess.

``LLMEngine`` loads a model folder, owns the paged KV cache, and serves any number of
requests with continuous batching, chunked prefill and prefix reuse. Its ``forward`` and
``sample`` are also the prefill engine's (``engine/prefill.py``), which schedules its own
batches into cache blocks of its own and passes the layer hooks that move their KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dualpath.config import EngineConfig
from dualpath.ending import eos_ids, finish_reason
from dualpath.engine.batcher import Batcher
from dualpath.engine.runner import ModelRunner
from dualpath.engine.sampler import Sampler
from dualpath.kv.block_pool import BlockPool
from dualpath.kv.cache import TORCH_DTYPES, PagedKVCache
from dualpath.kv.hashing import extend_block_hashes, salted_seed
from dualpath.kv.layout import engine_layout, key_space_for
from dualpath.model.hooks import NO_HOOKS, LayerHooks
from dualpath.model.kernels import load_kernels
from dualpath.model.loader import load_model
from dualpath.model.spec import load_spec, model_id, resolve_dtype
from dualpath.model.tokenizer import Tokenizer
from dualpath.request import SamplingParams, SeqStatus, Sequence

log = logging.getLogger("dualpath.engine")


@dataclass
class RequestOutput:
    """A finished request."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int


@dataclass
class Forwarded:
    """What a forward leaves to sample: the sequences whose every token is now computed, and
    the final hidden state of each one's last token (``[len(seqs), hidden]``)."""

    seqs: list[Sequence]
    hidden: torch.Tensor


class LLMEngine:
    """One model on one device, serving many sequences at once."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        torch.set_num_threads(config.threads)
        self.spec = spec = load_spec(model_dir)
        self.dtype = resolve_dtype(config.dtype, spec)
        self.layout = engine_layout(spec, config.dtype, config.kv_dtype, config.block_size)
        self.kv_dtype = self.layout.dtype
        model = load_model(model_dir, TORCH_DTYPES[self.dtype], spec, config.device)
        if config.cpu_kernels and torch.device(config.device).type == "cpu":
            model.pack_weights()
            if self.kv_dtype == self.dtype:  # the kernels write KV in the compute dtype
                model.use_kernels(load_kernels())
            else:
                log.info("CPU kernels off: the KV cache is %s, the compute dtype %s (the "
                         "kernels write KV in the compute dtype)", self.kv_dtype, self.dtype)
        num_blocks = self.layout.cache_blocks(config.num_kv_blocks, config.kv_cache_mb,
                                              config.layer_window)
        cache = PagedKVCache(spec, num_blocks, config.block_size, self.kv_dtype, config.device,
                             config.layer_window)
        self.runner = ModelRunner(model, cache)
        self.pool = BlockPool(num_blocks)
        self.key_space = key_space_for(model_id(model_dir), self.layout)
        self.batcher = Batcher(config, self.pool, self.key_space.seed)
        self.sampler = Sampler(config.seed)
        has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(model_dir) if has_tokenizer else None
        self.eos_token_ids = eos_ids(spec.eos_token_ids, self.tokenizer.eos_token_id
                                     if self.tokenizer is not None else None)
        self._captured: dict[int, list[torch.Tensor]] = {}

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a tokenized prompt; returns its sequence (watch ``is_finished``)."""
        seq = Sequence(list(prompt_ids), params or SamplingParams())
        self.batcher.add(seq)
        return seq

    def reserve_prefilled(self, prompt_ids: list[int], params: SamplingParams,
                          prior_output_ids: list[int] | None = None,
                          cache_salt: str = "", cached_blocks: list[int] | None = None,
                          ) -> Sequence:
        """Allocate cache blocks for a prompt whose KV is computed elsewhere (the decode
        engine's entry); the sequence does not run until ``start_prefilled``
        (``OutOfBlocksError`` when there is no room). ``prior_output_ids``: output tokens an
        earlier engine generated (their KV comes with the prompt's); they count as this
        sequence's outputs for stop rules, ``max_tokens`` and seeded draws. ``cache_salt``
        salts its block hashes (a tenant's). ``cached_blocks``: its leading blocks, already
        holding their KV, whose references the caller hands over (on success)."""
        seq = Sequence(list(prompt_ids), params, output_ids=list(prior_output_ids or ()),
                       cache_salt=cache_salt)
        self.batcher.check_fits(seq)
        cached = list(cached_blocks or ())
        need = -(-(seq.num_tokens + 1) // self.config.block_size) - len(cached)
        seq.block_table = cached + self.pool.allocate(need)
        return seq

    def cached_prefix(self, prompt_ids: list[int] | tuple[int, ...], num_blocks: int,
                      cache_salt: str = "") -> list[int]:
        """A reference on each of the prompt's leading full blocks (at most ``num_blocks``)
        that this engine's prefix cache still holds: the caller frees them, or hands them to
        ``reserve_prefilled``."""
        if not self.config.enable_prefix_caching or num_blocks <= 0:
            return []
        bs = self.config.block_size
        hashes = extend_block_hashes([], list(prompt_ids[: num_blocks * bs]), bs,
                                     salted_seed(self.key_space.seed, cache_salt))
        return self.pool.match_prefix(hashes)

    def start_prefilled(self, seq: Sequence, first_token: int) -> None:
        """The reserved sequence's KV (prompt and prior outputs) is in its blocks: run it from
        ``first_token`` (which may already finish it). Prior outputs that already met a stop
        rule (their engine was lost before it said so) finish it without ``first_token``."""
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SeqStatus.RUNNING
        self.batcher.running.append(seq)
        self.batcher.publish_blocks(seq)
        ended = self._finish_reason(seq, seq.output_ids[-1]) if seq.output_ids else None
        if ended is not None:
            self.batcher.finish(seq, ended)
            return
        self._append(seq, first_token)

    def start_partly_prefilled(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The reserved sequence's first ``num_computed_tokens`` tokens have their KV in its
        blocks: it joins the running batch, which prefills the rest in its steps' token budget
        and samples its first token."""
        if not 0 <= num_computed_tokens < len(seq.prompt_ids) or seq.output_ids:
            raise ValueError(f"{num_computed_tokens} computed tokens of a "
                             f"{len(seq.prompt_ids)}-token prompt")
        seq.num_computed_tokens = num_computed_tokens
        seq.num_cached_prompt_tokens = num_computed_tokens
        seq.status = SeqStatus.RUNNING
        self.batcher.running.append(seq)
        self.batcher.publish_blocks(seq)

    def release_reserved(self, seq: Sequence) -> None:
        """Give back the blocks of a reserved sequence that will never run."""
        self.pool.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"

    def abort(self, seq: Sequence) -> None:
        """Stop a waiting or running sequence and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.batcher.waiting:
            self.batcher.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "abort"
        else:
            self.batcher.finish(seq, "abort")
        self.sampler.release(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.batcher.has_work

    def step(self) -> list[Sequence]:
        """Run one step; return the sequences that finished in it."""
        step = self.batcher.schedule()
        if not step.items:
            return []
        done = self.forward(step.items)
        for seq, _ in step.items:
            self.batcher.publish_blocks(seq)
        if not done.seqs:
            return []
        tokens = self.sample(done)
        return [seq for seq, tok in zip(done.seqs, tokens, strict=True) if self._append(seq, tok)]

    def forward(self, items: list[tuple[Sequence, int]],
                hooks: LayerHooks = NO_HOOKS) -> Forwarded:
        """Compute the KV of each ``(sequence, number of new tokens)`` item into the sequence's
        ``block_table`` blocks and advance its ``num_computed_tokens``; ``hooks`` run around
        every layer. Returns the sequences now computed to their last token, to sample."""
        inputs = self.runner.prepare(items)
        hidden = self.runner.run(inputs, hooks)
        self._capture(items, inputs.last_rows, hidden)
        done = [(seq, row) for (seq, n), row in zip(items, inputs.last_rows, strict=True)
                if seq.num_computed_tokens + n == seq.num_tokens]
        for seq, n in items:
            seq.num_computed_tokens += n
        rows = [row for _, row in done]
        return Forwarded([seq for seq, _ in done], hidden[rows] if rows else hidden[:0])

    def sample(self, done: Forwarded) -> list[int]:
        """The next token of each of ``done``'s sequences, by its ``params``; a seeded draw is
        indexed by the sequence's output count, so whichever engine draws a request's token k
        draws the same one."""
        seqs = done.seqs
        logits = self.runner.logits(done.hidden, fp32=False)
        return self.sampler.sample(logits, [s.params for s in seqs], [s.seq_id for s in seqs],
                                   num_outputs=[len(s.output_ids) for s in seqs])

    def _append(self, seq: Sequence, token: int) -> bool:
        """Record a sampled token and apply the stop rules; True if ``seq`` finished."""
        seq.append_token(token)
        reason = self._finish_reason(seq, token)
        if reason is None:
            return False
        self.batcher.finish(seq, reason)
        self.sampler.release(seq.seq_id)
        return True

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        reason = finish_reason(params, len(seq.output_ids), token, seq.num_tokens,
                               self.eos_token_ids, self.spec.max_position)
        if reason == "stop":
            return reason
        may_stop = len(seq.output_ids) >= params.min_tokens
        if may_stop and params.stop and self._hit_stop_string(seq):  # before a length end
            return "stop"
        return reason

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(seq.output_ids)
        cut = min((i for s in seq.params.stop if (i := text.find(s)) >= 0), default=-1)
        if cut < 0:
            return False
        seq.output_text = text[:cut]
        return True

    def output(self, seq: Sequence) -> RequestOutput:
        """The finished request's result, with its text decoded."""
        text = seq.output_text
        if not text and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids)
        return RequestOutput(seq.seq_id, seq.prompt_ids, seq.output_ids, text,
                             seq.finish_reason or "", seq.num_cached_prompt_tokens)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        with tqdm(total=len(seqs), disable=not progress, desc="generate") as bar:
            while self.has_unfinished:
                bar.update(len(self.step()))
        return [self.output(s) for s in seqs]

    def prompt_logits(self, prompt_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Logits of every computed prompt position and how many leading tokens were cached.

        Runs the prompt like any request (prefix reuse and chunking included) and returns
        ``(logits [num_tokens - num_cached, vocab], num_cached)``.
        """
        seq = self.add_request(prompt_ids, SamplingParams(max_tokens=1, ignore_eos=True))
        self._captured[seq.seq_id] = []
        while not seq.is_finished:
            self.step()
        rows = self._captured.pop(seq.seq_id)
        return self.runner.logits(torch.cat(rows)), seq.num_cached_prompt_tokens

    def _capture(self, items: list[tuple[Sequence, int]], last_rows: list[int],
                 hidden: torch.Tensor) -> None:
        for (seq, n), last in zip(items, last_rows, strict=True):
            if seq.seq_id in self._captured:
                self._captured[seq.seq_id].append(hidden[last - n + 1 : last + 1])

