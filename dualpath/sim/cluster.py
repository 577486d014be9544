"""The cluster simulator: P prefill nodes × g PEs and D decode nodes × g DEs in virtual time.

It drives the real scheduler: every fetch period a :class:`ClusterView` is built from the
simulated state and :meth:`GlobalScheduler.schedule` places requests and picks read paths;
each PE forms its forward batches with :func:`build_prefill_batch` under the compute quota.
Only clocks, links and compute are modelled:

* hit KV is read over the chosen side's storage NIC (one shared :class:`Link` per node); on
  the DE path it then crosses the DE's compute NIC to the PE; after prefill the prompt's KV
  crosses the PE's compute NIC to the DE (oracle: no reads, no transfers);
* a prefill forward lasts the cost model's prediction (``SimConfig.prefill_cost``);
* a DE's running requests advance one token per step of ``SimConfig.decode_step_s(batch)``;
* when an agent's turn has generated its tokens, its next turn is submitted at once (offline
  replay with zero tool latency, PAPER §7.4); JCT is when the last agent finishes.

Read/compute overlap per mode (PAPER §4, §7.8):

* ``basic`` (no layerwise prefill): the PEs form each forward in lock step (one EP group over
  the prefill side). A round reads the hit KV of the requests that start in it into PE HBM,
  waits until every PE's reads have arrived (the EP barrier), then computes for the longest
  PE's predicted forward. Reads and compute therefore alternate: time ≈ read + compute.
* layerwise modes (``layerwise``, ``dualpath``, ``round_robin``): a request's KV streams layer
  by layer into the running forwards, so reads proceed while PEs compute; PEs run their
  forwards independently and a request joins its PE's queue once its read has arrived —
  time ≈ max(read, compute) plus the last read (no PE HBM hold).

Simplifications: no EP barrier in the layerwise modes, decode write-back to storage is not
modelled (separate NIC direction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    NodeView,
    PendingRequest,
    SchedulerParams,
    build_prefill_batch,
)
from dualpath.sim.config import SimConfig
from dualpath.sim.engines import DecodeEngine, PrefillEngine
from dualpath.sim.events import EventLoop
from dualpath.sim.links import Link
from dualpath.sim.workload import Turn, trajectory


class Simulator:
    """One offline run; :meth:`run` returns the result dict (``jct_s`` and statistics)."""

    def __init__(self, cfg: SimConfig,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.cfg = cfg
        self.loop = EventLoop()
        self.progress = progress
        hw, m = cfg.hw(), cfg.model_profile()
        self.kvb = m.kv_bytes_per_token
        self.turns: list[Turn] = trajectory(cfg.workload)
        g = hw.gpus_per_node
        pe_cap = cfg.kv_capacity_tokens(cfg.prefill_nodes)
        de_cap = cfg.kv_capacity_tokens(cfg.decode_nodes)
        self.cost = cfg.prefill_cost()
        self.pes = [PrefillEngine(f"p{n:03d}-{i}", n, f"pg{n:03d}", pe_cap,
                                  Link(self.loop, hw.cnic_bps))
                    for n in range(cfg.prefill_nodes) for i in range(g)]
        base = cfg.prefill_nodes
        self.des = [DecodeEngine(f"d{n:03d}-{i}", base + n, f"dg{n:03d}", de_cap,
                                 Link(self.loop, hw.cnic_bps), self.loop, cfg.decode_step_s)
                    for n in range(cfg.decode_nodes) for i in range(g)]
        self.engines = {e.name: e for e in [*self.pes, *self.des]}
        nodes = cfg.prefill_nodes + cfg.decode_nodes
        self.snic = [Link(self.loop, hw.snic_bps, f"snic{n}") for n in range(nodes)]
        self.read_q = [0] * nodes
        read_tok_s = hw.snic_bps / self.kvb
        prompt_tok_s = 1e3 * 8 * 4096 / max(1e-9, self.cost.predict_ms([(8 * 4096, 4096)]))
        policy = "round_robin" if cfg.mode == "round_robin" else "dualpath"
        path = "pe" if cfg.mode in ("basic", "layerwise") else "auto"
        self.params = SchedulerParams.from_rates(read_tok_s, prompt_tok_s, cfg.alpha_s,
                                                 cfg.beta_s, policy=policy, read_path=path)
        self.sched = GlobalScheduler(self.params)
        self.agent_turn: dict[int, int] = {}
        self.req_agent: dict[int, int] = {}
        self._next_id = 0
        self._tick_pending = False
        self.done_turns = 0
        self.total_turns = len(self.turns) * cfg.workload.agents
        self.finished_at: list[float] = []
        self.reads = {"pe": 0, "de": 0}
        self._round_busy = False
        self.rounds = 0

    # --- requests ---

    def _submit(self, agent: int) -> None:
        turn = self.turns[self.agent_turn[agent]]
        rid = self._next_id
        self._next_id += 1
        self.req_agent[rid] = agent
        self.sched.submit(PendingRequest(rid, turn.prompt, turn.hit))
        self._kick()

    def _kick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            self.loop.after(self.cfg.fetch_interval_s, self._tick)

    def _view(self) -> ClusterView:
        engines = tuple(EngineView(e.name, role, e.node, e.group, e.seq, e.tok, e.free_kv)
                        for role, group in (("prefill", self.pes), ("decode", self.des))
                        for e in group)
        nodes = tuple(NodeView(n, q) for n, q in enumerate(self.read_q))
        return ClusterView(engines, nodes)

    def _tick(self) -> None:
        self._tick_pending = False
        for a in self.sched.schedule(self._view()):
            self._start(a.req_id, a.prefill, a.decode, a.pe_read_tokens, a.de_read_tokens)

    def _start(self, rid: int, pe_name: str, de_name: str, pe_read: int, de_read: int) -> None:
        turn = self.turns[self.agent_turn[self.req_agent[rid]]]
        pe, de = self.engines[pe_name], self.engines[de_name]
        assert isinstance(pe, PrefillEngine) and isinstance(de, DecodeEngine)
        pe.assign(turn.prompt)
        de.reserve(turn.prompt, turn.gen)
        ready = lambda: self._ready(rid, pe, de, turn)  # noqa: E731
        if self.cfg.mode == "oracle" or turn.hit == 0:
            self.loop.after(0.0, ready)
        elif de_read:
            self.reads["de"] += 1
            self._read(de.node, de_read, lambda: de.cnic.transfer(de_read * self.kvb, ready))
        else:
            self.reads["pe"] += 1
            if self.cfg.mode == "basic":  # read inside the lock-step round (see _round)
                self.read_q[pe.node] += pe_read
                pe.fifo.append([rid, turn.hit, turn.miss, de, turn, pe_read])
                if self.cfg.basic_lockstep:
                    self._round()
                else:
                    self._forward(pe)
            else:
                self._read(pe.node, pe_read, ready)

    def _read(self, node: int, tokens: int, then: Callable[[], None],
              queued: bool = False) -> None:
        if not queued:
            self.read_q[node] += tokens

        def done() -> None:
            self.read_q[node] -= tokens
            then()
        self.snic[node].transfer(tokens * self.kvb, done)

    def _ready(self, rid: int, pe: PrefillEngine, de: DecodeEngine, turn: Turn) -> None:
        pe.fifo.append([rid, turn.hit, turn.miss, de, turn, 0])
        if self.cfg.mode == "basic" and self.cfg.basic_lockstep:
            self._round()
        else:
            self._forward(pe)

    def _batch(self, pe: PrefillEngine) -> list[tuple[int, int, int]]:
        return build_prefill_batch([(i, f[1], f[2]) for i, f in enumerate(pe.fifo)],
                                   self.cfg.quota_ms, self.cost)

    def _round(self) -> None:
        """Basic: one lock-step forward of every PE: read phase, barrier, compute phase."""
        if self._round_busy:
            return
        batches = [(pe, self._batch(pe)) for pe in self.pes if pe.fifo]
        if not batches:
            return
        self._round_busy = True
        self.rounds += 1
        pending = [len(batches)]

        def compute() -> None:
            pending[0] -= 1
            if pending[0]:
                return
            ms = max(self.cost.predict_ms([(c, b) for _, c, b in batch]) for _, batch in batches)
            self.loop.after(ms / 1e3, finish)

        def finish() -> None:
            self._round_busy = False
            for pe, batch in batches:
                self._apply(pe, batch)
            self._round()

        for pe, batch in batches:
            unread = 0
            for idx, _, _ in batch:
                unread += pe.fifo[idx][5]
                pe.fifo[idx][5] = 0
            if unread:
                self._read(pe.node, unread, compute, queued=True)
            else:
                self.loop.after(0.0, compute)

    def _forward(self, pe: PrefillEngine) -> None:
        if pe.busy or not pe.fifo:
            return
        batch = self._batch(pe)
        pe.busy = True
        unread = 0
        for idx, _, _ in batch:  # Basic without the barrier: this PE loads, then computes
            unread += pe.fifo[idx][5]
            pe.fifo[idx][5] = 0
        if unread:
            self._read(pe.node, unread, lambda: self._compute(pe, batch), queued=True)
        else:
            self._compute(pe, batch)

    def _compute(self, pe: PrefillEngine, batch: list[tuple[int, int, int]]) -> None:
        self.loop.after(self.cost.predict_ms([(c, b) for _, c, b in batch]) / 1e3,
                        lambda: self._forward_done(pe, batch))

    def _forward_done(self, pe: PrefillEngine, batch: list[tuple[int, int, int]]) -> None:
        pe.busy = False
        self._apply(pe, batch)
        self._forward(pe)

    def _apply(self, pe: PrefillEngine, batch: list[tuple[int, int, int]]) -> None:
        """A forward of ``batch`` finished on ``pe``: advance its requests, hand off done ones."""
        finished = []
        for idx, _, bsz in batch:
            entry = pe.fifo[idx]
            entry[1] += bsz
            entry[2] -= bsz
            if entry[2] <= 0:
                finished.append(entry)
        pe.fifo = [f for f in pe.fifo if f[2] > 0]
        for rid, _, _, de, turn, _ in finished:
            pe.finish(turn.prompt)
            if self.cfg.mode == "oracle":
                de.decode(turn.gen, lambda r=rid, d=de, t=turn: self._decoded(r, d, t))
            else:
                pe.cnic.transfer(turn.prompt * self.kvb, lambda r=rid, d=de, t=turn: d.decode(
                    t.gen, lambda: self._decoded(r, d, t)))
        if finished:
            self._kick()

    def _decoded(self, rid: int, de: DecodeEngine, turn: Turn) -> None:
        de.release(turn.prompt, turn.gen)
        agent = self.req_agent.pop(rid)
        self.done_turns += 1
        if self.progress is not None and self.done_turns % 1000 == 0:
            self.progress(self.done_turns, self.total_turns)
        self.agent_turn[agent] += 1
        if self.agent_turn[agent] < len(self.turns):
            self._submit(agent)
        else:
            self.finished_at.append(self.loop.now)
        self._kick()

    # --- run ---

    def run(self) -> dict[str, Any]:
        """Simulate until every agent has finished; JCT and statistics."""
        for agent in range(self.cfg.workload.agents):
            self.agent_turn[agent] = 0
            self._submit(agent)
        jct = self.loop.run()
        if len(self.finished_at) != self.cfg.workload.agents:
            raise RuntimeError("simulation stalled: some agents never finished")
        util = [link.work_done / (link.bandwidth * jct) if jct else 0.0 for link in self.snic]
        p = self.cfg.prefill_nodes
        return {"mode": self.cfg.mode, "P": p, "D": self.cfg.decode_nodes,
                "agents": self.cfg.workload.agents, "jct_s": jct,
                "snic_util_prefill": sum(util[:p]) / p,
                "snic_util_decode": sum(util[p:]) / max(1, len(util) - p),
                "reads": dict(self.reads), "events": self.loop.processed,
                "rounds": self.rounds}


def simulate(cfg: SimConfig, progress: Callable[[int, int], None] | None = None,
             ) -> dict[str, Any]:
    """Run one configuration; the result dict of :meth:`Simulator.run`."""
    return Simulator(cfg, progress).run()
