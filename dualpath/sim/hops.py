"""The KV hops of docs/paper.md §2.2–2.4 past the storage NIC: node DRAM, compute NICs, HBM.

Every node's DRAM (reads and writes summed) and each direction of every GPU's compute NIC is
a :class:`PipeLink`: it serves bookings in order, so a transfer books each of its hops at
once and completes when the last one does — one event per transfer, not per hop.

* storage read (either path): storage NIC → the reading node's DRAM;
* :meth:`Hops.copy_in`, under the request's first forward: PE path PE DRAM → PE NIC
  loopback → PE HBM (steps 3–4), DE path DE DRAM → DE NIC → PE NIC → PE HBM (steps 3–5);
* :meth:`Hops.send` + :meth:`Hops.receive` after the prefill: the prompt's KV (DE path: its
  miss tokens) PE HBM → PE NIC → DE NIC → DE DRAM (steps 5–7), then the whole prompt DE DRAM
  → DE NIC loopback → DE HBM (steps 8–9);
* :meth:`Hops.save` as a turn's decode ends: its new full blocks DE HBM → DE NIC loopback →
  DE DRAM → the storage NIC's write direction (§2.4), which nothing waits for.

KV takes the low lanes (loads: ``kv_load``; the hand-off: ``kv_forward``; saves:
``kv_save``); the simulator sets the high lane's EP all-to-all demand on the NICs.
"""

from __future__ import annotations

from typing import Any

from dualpath.sim.engines import DecodeEngine, Job, PrefillEngine
from dualpath.sim.links import Link, PipeLink
from dualpath.sim.profiles import HardwareProfile
from dualpath.traffic.lanes import Lane

LOAD, FORWARD, SAVE = Lane.KV_LOAD, Lane.KV_FORWARD, Lane.KV_SAVE


class Hops:
    """The DRAM of every node and the bookings of the KV hops (``kvb`` bytes per token)."""

    def __init__(self, hw: HardwareProfile, nodes: int, kvb: float,
                 storage_eff: float = 1.0) -> None:
        self.hw, self.kvb = hw, kvb
        self.dram = [PipeLink(hw.dram_bps, f"dram{n}") for n in range(nodes)]
        self.snic_write = [PipeLink(hw.snic_bps * storage_eff, f"snic{n}.write")
                           for n in range(nodes)]

    def into_dram(self, node: int, tokens: int, now: float) -> float:
        """A storage read lands in ``node``'s DRAM (booked as it starts); when it is written."""
        return self.dram[node].book(tokens * self.kvb, now)

    def copy_in(self, pe: PrefillEngine, job: Job, now: float) -> float:
        """Book the copy of ``job``'s hit KV into ``pe``'s HBM from the DRAM it was read
        into (PE node: ``job.h2d_pe``, its DE's node: ``job.h2d_de``); when it ends."""
        end = now
        if job.h2d_pe:
            nbytes = job.h2d_pe * self.kvb
            end = max(end, self.dram[pe.node].book(nbytes, now),
                      pe.nic.tx.book(nbytes, now, LOAD), pe.nic.rx.book(nbytes, now, LOAD))
            job.h2d_pe = 0
        if job.h2d_de:
            nbytes, de = job.h2d_de * self.kvb, job.de
            end = max(end, self.dram[de.node].book(nbytes, now),
                      de.nic.tx.book(nbytes, now, LOAD), pe.nic.rx.book(nbytes, now, LOAD))
            job.h2d_de = 0
        return end

    def send(self, pe: PrefillEngine, tokens: int, now: float) -> float:
        """The PE's NIC sends ``tokens`` of KV to DEs; when the last byte has left."""
        return pe.nic.tx.book(tokens * self.kvb, now, FORWARD)

    def receive(self, de: DecodeEngine, sent: int, prompt: int, now: float) -> float:
        """The DE's side of a hand-off: ``sent`` tokens arrive DE NIC → DE DRAM, then the
        ``prompt`` goes DE DRAM → DE NIC loopback → DE HBM; when the DE holds it in HBM."""
        sent_b, prompt_b = sent * self.kvb, prompt * self.kvb
        return max(de.nic.rx.book(sent_b + prompt_b, now, FORWARD),
                   self.dram[de.node].book(sent_b + prompt_b, now),
                   de.nic.tx.book(prompt_b, now, FORWARD))

    def save(self, de: DecodeEngine, tokens: int, now: float) -> float:
        """Persist ``tokens`` of new full blocks from ``de``'s HBM; when they are stored."""
        if tokens <= 0:
            return now
        nbytes = tokens * self.kvb
        return max(de.nic.tx.book(nbytes, now, SAVE), de.nic.rx.book(nbytes, now, SAVE),
                   self.dram[de.node].book(2 * nbytes, now),
                   self.snic_write[de.node].book(nbytes, now))

    def stats(self, pes: list[PrefillEngine], des: list[DecodeEngine], snic: list[Link],
              prefill_nodes: int, jct: float) -> dict[str, Any]:
        """Bytes per hop class over a run of ``jct`` seconds and the mean (and busiest)
        utilisation of each: DRAM per prefill / decode node, each direction of the PE and
        DE compute NICs (KV lanes), plus the storage NICs' bytes."""
        p, dram_bps, cnic_bps = prefill_nodes, self.hw.dram_bps, self.hw.cnic_bps
        classes = {"dram_prefill": (self.dram[:p], dram_bps),
                   "dram_decode": (self.dram[p:], dram_bps),
                   "pe_tx": ([e.nic.tx for e in pes], cnic_bps),
                   "pe_rx": ([e.nic.rx for e in pes], cnic_bps),
                   "de_tx": ([e.nic.tx for e in des], cnic_bps),
                   "de_rx": ([e.nic.rx for e in des], cnic_bps)}
        span = max(jct, 1e-12)
        out: dict[str, Any] = {"hop_bytes": {}, "hop_util": {}, "hop_util_max": {}}
        for name, (pipes, bps) in classes.items():
            util = [pl.kv_bytes / (bps * span) for pl in pipes]
            out["hop_bytes"][name] = sum(pl.kv_bytes for pl in pipes)
            out["hop_util"][name] = sum(util) / len(util)
            out["hop_util_max"][name] = max(util)
        out["hop_bytes"]["snic_prefill"] = sum(link.work_done for link in snic[:p])
        out["hop_bytes"]["snic_decode"] = sum(link.work_done for link in snic[p:])
        out["hop_bytes"]["snic_write"] = sum(pl.kv_bytes for pl in self.snic_write)
        writes = [pl.kv_bytes / (pl.bandwidth * span) for pl in self.snic_write[p:]]
        out["hop_util"]["snic_write_decode"] = sum(writes) / max(1, len(writes))
        return out
