"""The simulator's prefill rounds: a PE's ready requests, its EP group's lock-step forwards,
and the hand-off of each prefilled request's KV to its DE.

:class:`PrefillRounds` is a part of :class:`dualpath.sim.cluster.Simulator` (a base class of
it), which builds the state named below and holds the requests and the decode side; the read /
compute overlap per mode and the batching are described in :mod:`dualpath.sim.cluster`.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.scheduler import AttentionCostModel, build_prefill_batch, build_token_batch
from dualpath.sim.config import SimConfig
from dualpath.sim.engines import DecodeEngine, Job, PrefillEngine
from dualpath.sim.events import EventLoop
from dualpath.sim.hops import Hops
from dualpath.sim.reads import StorageReads
from dualpath.vocab import Rung
from dualpath.workloads.turns import Turn

Batch = list[tuple[int, int, int]]


class PrefillRounds:
    """A PE group's rounds, from a request ready on its PE to its KV at its DE."""

    # set or defined by Simulator
    cfg: SimConfig
    loop: EventLoop
    cost: AttentionCostModel
    hops: Hops
    storage: StorageReads
    pe_groups: list[list[PrefillEngine]]
    _round_busy: list[bool]
    rounds: int
    a2a_pe: float
    a2a_bytes: float
    online: bool
    _times: dict[int, list[float]]
    _kick: Callable[[], None]
    _decode: Callable[[int, DecodeEngine, Turn], None]

    def _admit(self, pe: PrefillEngine) -> None:
        """Basic with prefetch: read the head requests' KV into PE HBM while it has room for
        their whole prompt (held until the KV has left for the DE); one at a time if none fits."""
        while pe.admit and (pe.hbm_used + pe.admit[0].hbm <= pe.capacity or not pe.hbm_used):
            job = pe.admit.popleft()
            pe.hbm_used += job.hbm
            copied = self.hops.copy_in(pe, job, self.loop.now)  # on as the blocks land
            self.storage.read(pe.node, job.cached, lambda j=job, c=copied: self.loop.when(
                c, lambda: self._ready(pe, j)))

    def _release_hbm(self, pe: PrefillEngine, tokens: int) -> None:
        pe.hbm_used -= tokens
        self._admit(pe)

    def _ready(self, pe: PrefillEngine, job: Job) -> None:
        pe.fifo.append(job)
        self._round(pe.ep)

    def _batch(self, pe: PrefillEngine) -> Batch:
        fifo = ((i, j.cached, j.remaining) for i, j in enumerate(pe.fifo))  # read up to a cut
        if self.cfg.mode in self.cfg.quota_modes:
            return build_prefill_batch(fifo, self.cfg.quota_ms, self.cost)
        return build_token_batch(fifo, self.cfg.token_budget)

    def _round(self, ep: int) -> None:
        """One lock-step forward of EP group ``ep``: as long as its slowest member's batch."""
        if self._round_busy[ep]:
            return
        batches = [(pe, self._batch(pe)) for pe in self.pe_groups[ep] if pe.fifo]
        if not batches:
            return
        self._round_busy[ep] = True
        self.rounds += 1

        def finish() -> None:
            self._round_busy[ep] = False
            for pe, batch in batches:
                if self.a2a_pe:
                    pe.nic.set_high_bps(0.0)
                self._apply(pe, batch)
            self._round(ep)

        pending = [len(batches)]

        def compute() -> None:  # every member's reads are in: the forward runs
            pending[0] -= 1
            if not pending[0]:
                self.loop.at(self._forward(batches), finish)

        for pe, batch in batches:  # Basic without prefetch: the round reads its batch first
            unread, copied = 0, self.loop.now  # (each block copied on into HBM as it lands)
            for idx, _, _ in batch:
                job = pe.fifo[idx]
                if job.unread:
                    unread += job.unread
                    job.unread = 0
                    copied = max(copied, self.hops.copy_in(pe, job, self.loop.now))
            if unread:
                self.storage.read(pe.node, unread, lambda c=copied: self.loop.when(c, compute))
            else:
                compute()

    def _forward(self, batches: list[tuple[PrefillEngine, Batch]]) -> float:
        """Start a lock-step forward; when it ends. It computes as long as its slowest
        member's batch; the hit KV of requests starting in it is copied into HBM layer by
        layer under it (layerwise modes; Basic copied it with the read), and its EP
        all-to-all takes the NICs' high lane meanwhile."""
        now = self.loop.now
        compute_s = max(self.cost.predict_ms([(c, b) for _, c, b in batch])
                        for _, batch in batches) / 1e3
        loaded = now
        for pe, batch in batches:
            for idx, _, _ in batch:
                job = pe.fifo[idx]
                if job.h2d_pe or job.h2d_de:
                    loaded = max(loaded, self.hops.copy_in(pe, job, now))
        end = max(now + compute_s, loaded)
        for pe, batch in batches:
            tokens = sum(bsz for _, _, bsz in batch)
            self.a2a_bytes += tokens * self.a2a_pe
            if self.a2a_pe and end > now:
                pe.nic.set_high_bps(tokens * self.a2a_pe / (end - now))
        return end

    def _apply(self, pe: PrefillEngine, batch: Batch) -> None:
        """A forward of ``batch`` finished on ``pe``: advance its requests, hand off done ones."""
        finished = []
        for idx, _, bsz in batch:
            job = pe.fifo[idx]
            job.cached += bsz
            job.remaining -= bsz
            if job.remaining <= 0:
                finished.append(job)
        if not finished:
            return
        cut = max(idx for idx, _, _ in batch) + 1  # a batch is a head of the FIFO
        pe.fifo[:cut] = [j for j in pe.fifo[:cut] if j.remaining > 0]
        # the PE's NIC sends the KV of the requests its forward finished together, so they
        # share it and arrive together (as flows started at once do), not one after another
        sent = sum(job.turn.prompt - job.de_holds for job in finished)
        sent_at = (self.loop.now if self.cfg.mode == Rung.ORACLE
                   else self.hops.send(pe, sent, self.loop.now))
        for job in finished:
            pe.finish(job.turn.prompt)
            if self.online:
                self._times[job.rid].append(self.loop.now)
            self._hand_off(pe, job, sent_at)
        self._kick()

    def _hand_off(self, pe: PrefillEngine, job: Job, sent_at: float) -> None:
        """Move a prefilled request's KV to its DE (by mode and read path), then decode;
        ``sent_at``: when the PE's NIC has sent it."""
        rid, de, turn, de_holds = job.rid, job.de, job.turn, job.de_holds

        def start() -> None:
            self._decode(rid, de, turn)
        if self.cfg.mode == Rung.ORACLE:
            start()
            return
        end = max(sent_at, self.hops.receive(de, turn.prompt - de_holds, turn.prompt,
                                             self.loop.now))
        if job.hbm:  # Basic with prefetch: PE HBM is free once the KV reached the DE
            def sent() -> None:
                self._release_hbm(pe, job.hbm)
                start()
            self.loop.at(end, sent)
        elif not de_holds:  # PE path: the staged KV has been streamed into the forward
            self.storage.unstage(pe.node, job.staged)
            self.loop.at(end, start)
        else:  # DE path: the hit KV leaves the DE's DRAM for its HBM with the new KV
            def loaded() -> None:
                self.storage.unstage(de.node, de_holds)
                start()
            self.loop.at(end, loaded)
