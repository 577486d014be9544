"""Step scheduling inside one engine: continuous batching with chunked prefill.

Every step first gives each running sequence its next tokens (one for a decode, the next
chunk for a prompt still being prefilled), then admits waiting sequences while the token
budget, the sequence limit and the free KV blocks allow. Leading prompt blocks already in the
prefix cache are reused instead of computed. When decodes run out of blocks the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dualpath.config import EngineConfig
from dualpath.errors import RequestError
from dualpath.kv.block_pool import BlockPool
from dualpath.kv.hashing import extend_block_hashes, salted_seed
from dualpath.request import SeqStatus, Sequence


@dataclass
class ScheduledStep:
    """What one step computes: (sequence, number of new tokens) pairs."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)


class Batcher:
    """Waiting queue, running set and their KV blocks."""

    def __init__(self, config: EngineConfig, pool: BlockPool, hash_seed: str) -> None:
        self.config = config
        self.pool = pool
        self.hash_seed = hash_seed
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # sequences evicted to be recomputed, since start

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; reject one that could never fit in the KV cache."""
        self.check_fits(seq)
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """``RequestError`` if prompt + max_tokens could never fit in the whole KV cache."""
        max_tokens = len(seq.prompt_ids) + seq.params.max_tokens  # outputs count in max_tokens
        if self._blocks_for(max_tokens) > self.pool.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {max_tokens} tokens exceeds the KV cache "
                f"({self.pool.num_blocks * self.block_size} tokens)"
            )

    @property
    def has_work(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        """Pick this step's work."""
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_pending_tokens, budget)
            if not self._grow(seq, num_new):
                continue
            step.items.append((seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SeqStatus.RUNNING
            step.items.append((seq, num_new))
            budget -= num_new
        return step

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks (they stay in the prefix cache).

        The block table is kept: until the next ``schedule()`` hands the blocks out again their
        KV can still be read (the decode engine saves the last full blocks from there).
        """
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.pool.free(seq.block_table)

    def publish_blocks(self, seq: Sequence) -> None:
        """Make newly completed full blocks of ``seq`` findable by later prompts."""
        if not self.config.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full > len(seq.block_hashes):
            extend_block_hashes(seq.block_hashes, seq.token_ids[: num_full * self.block_size],
                                self.block_size, salted_seed(self.hash_seed, seq.cache_salt))
        for k in range(seq.num_registered_blocks, num_full):
            self.pool.register(seq.block_table[k], seq.block_hashes[k])
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Give ``seq`` blocks for ``num_new`` more tokens, preempting others if needed."""
        need = self._blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
        while need > self.pool.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table += self.pool.allocate(need) if need > 0 else []
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Reuse cached prefix blocks and allocate the first chunk; 0 if it must wait."""
        if self.config.enable_prefix_caching:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size,
                                salted_seed(self.hash_seed, seq.cache_salt))
            max_hit = (seq.num_tokens - 1) // self.block_size  # compute at least one token
            seq.block_table = self.pool.match_prefix(seq.block_hashes[:max_hit])
            seq.num_computed_tokens = len(seq.block_table) * self.block_size
            seq.num_registered_blocks = len(seq.block_table)
            if not seq.output_ids:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
        num_new = min(seq.num_pending_tokens, budget)
        need = self._blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
        if need > self.pool.num_free_blocks:
            self.pool.free(seq.block_table)
            seq.block_table, seq.num_computed_tokens, seq.num_registered_blocks = [], 0, 0
            return 0
        seq.block_table += self.pool.allocate(need)
        return num_new
