"""The cluster simulator: P prefill nodes × g PEs and D decode nodes × g DEs in virtual time.

It drives the real scheduler: every fetch period a :class:`ClusterView` is built from the
simulated state and :meth:`GlobalScheduler.schedule` places requests and picks read paths; each
PE batches with :func:`build_prefill_batch` (modes in ``quota_modes``) or
:func:`build_token_batch`. Only clocks, links and compute are modelled: storage reads over one
shared storage-NIC :class:`Link` per node and the hops of :mod:`dualpath.sim.hops`
(docs/paper.md §2.2–2.4), EP all-to-all on the compute NICs' high lane, EP lock step
(:class:`LockstepGroup`, ``SimConfig.ep_lockstep``), decode one token per step, and an agent's
next turn submitted as its turn ends (docs/paper.md §7.4). ``basic`` reads a round's whole hit
KV into PE HBM before it computes; layerwise modes stage reads in ``dram_buffer_gb`` of DRAM per
node and stream them into the forward (docs/paper.md §4, §7.8).

What is modelled and how, and the simplifications: docs/derivations.md, 'sim/cluster.py'.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from dualpath.scheduler import (
    ClusterView,
    EngineView,
    GlobalScheduler,
    PendingRequest,
    SchedulerParams,
)
from dualpath.sim.config import SimConfig
from dualpath.sim.engines import DecodeEngine, Job, PrefillEngine
from dualpath.sim.events import EventLoop
from dualpath.sim.hops import Hops
from dualpath.sim.links import DuplexNic, LockstepGroup, RateGroup
from dualpath.sim.reads import StorageReads
from dualpath.sim.rounds import PrefillRounds
from dualpath.vocab import Mode, ReadPath, Rung
from dualpath.workloads.presets import agent_trajectories, arrival_times
from dualpath.workloads.turns import Turn


class Simulator(PrefillRounds):
    """One run; :meth:`run` returns the result dict (``jct_s`` and statistics)."""

    def __init__(self, cfg: SimConfig,
                 progress: Callable[[int, int], None] | None = None,
                 trajectories: list[list[Turn]] | None = None) -> None:
        self.cfg = cfg
        self.loop = EventLoop()
        self.progress = progress
        model = cfg.model_profile()
        self.kvb = model.kv_bytes_per_token
        ep_p, ep_d = cfg.ep_group_nodes()
        self.a2a_pe, self.a2a_de = model.a2a_bytes_per_token(ep_p), model.a2a_bytes_per_token(ep_d)
        self.trajs: list[list[Turn]] = (agent_trajectories(cfg.workload) if trajectories is None
                                        else trajectories)
        self.cost = cfg.prefill_cost()
        self._steps: dict[int, float] = {}
        self._step_model = cfg.decode_step_model()
        self.a2a_bytes = 0.0  # EP all-to-all bytes, each way, summed over the NICs
        self._build_engines()
        self.params = self._scheduler_params()
        self.sched = GlobalScheduler(self.params)
        self.agent_turn = [0] * len(self.trajs)
        self.req_agent: dict[int, int] = {}
        self._next_id = 0
        self._tick_pending = False
        self.done_turns = 0
        self.total_turns = sum(len(t) for t in self.trajs)
        self.finished_at: list[float] = []
        self.reads = {"pe": 0, "de": 0}
        self.rounds = 0
        self.online = cfg.workload.aps is not None
        self.latency: list[tuple[float, float, float, float, int]] = []  # online only
        self._times: dict[int, list[float]] = {}

    def _build_engines(self) -> None:
        cfg, hw = self.cfg, self.cfg.hw()
        g = hw.gpus_per_node
        ep_p, ep_d = cfg.ep_group_nodes()
        pe_cap, de_cap = cfg.kv_capacity_tokens(ep_p), cfg.kv_capacity_tokens(ep_d)
        lanes = cfg.lanes()
        self.pes = [PrefillEngine(f"p{n:03d}-{i}", n, f"pg{n:03d}", pe_cap,
                                  DuplexNic(hw.cnic_bps, f"p{n:03d}-{i}", lanes))
                    for n in range(cfg.prefill_nodes) for i in range(g)]
        members = ep_p * g if cfg.ep_lockstep else 1
        self.pe_groups = [self.pes[i:i + members] for i in range(0, len(self.pes), members)]
        for index, group in enumerate(self.pe_groups):
            for pe in group:
                pe.ep = index
        self._round_busy = [False] * len(self.pe_groups)
        steppers: list[RateGroup | LockstepGroup] = []
        self.des = []
        for n in range(cfg.decode_nodes):
            for i in range(g):
                name = f"d{n:03d}-{i}"
                if not cfg.ep_lockstep:
                    stepper: RateGroup | LockstepGroup = RateGroup(self.loop, self._step_s)
                elif n % ep_d == 0 and i == 0:
                    stepper = LockstepGroup(self.loop, self._step_model, f"ep{n // ep_d}")
                else:
                    stepper = steppers[-1]
                steppers.append(stepper)
                self.des.append(DecodeEngine(name, cfg.prefill_nodes + n, f"dg{n:03d}", de_cap,
                                             DuplexNic(hw.cnic_bps, name, lanes), stepper))
                if self.a2a_de:
                    self.des[-1].nic.set_high_demand(
                        lambda de=self.des[-1]: self._de_all_to_all_bps(de))
        self.engines = {e.name: e for e in [*self.pes, *self.des]}
        self._build_nodes()
        self._index_groups()

    def _build_nodes(self) -> None:
        """Per node: DRAM and the other KV hops, and the storage reads."""
        cfg, hw = self.cfg, self.cfg.hw()
        nodes = cfg.prefill_nodes + cfg.decode_nodes
        self.hops = Hops(hw, nodes, self.kvb, cfg.storage_eff)
        buffer = (None if cfg.dram_buffer_gb is None
                  else max(1, int(cfg.dram_buffer_gb * 1e9 // self.kvb)))
        self.storage = StorageReads(self.loop, self.hops, nodes,
                                    hw.snic_bps * cfg.storage_eff, cfg.read_streams, buffer)
        self.snic = self.storage.snic

    def _index_groups(self) -> None:
        """Engines by role and scheduling group, and the cached per-group views."""
        self._groups: dict[str, dict[str, list[Any]]] = {"prefill": {}, "decode": {}}
        for role, engines in (("prefill", self.pes), ("decode", self.des)):
            for e in sorted(engines, key=lambda e: e.name):
                self._groups[role].setdefault(e.group, []).append(e)
        self._groups = {role: dict(sorted(g.items())) for role, g in self._groups.items()}
        self._group_views: dict[str, dict[str, tuple[EngineView, ...]]] = {
            role: dict.fromkeys(g, ()) for role, g in self._groups.items()}
        self._dirty_groups = {(role, name) for role, g in self._groups.items() for name in g}
        self._view_by_name: dict[str, EngineView] = {}
        self._group_tok: dict[str, int] = {}
        for role, g in self._groups.items():
            for name, members in g.items():
                for e in members:
                    e.dirty_set, e.dirty_key = self._dirty_groups, (role, name)

    def _step_s(self, batch: int) -> float:
        """``SimConfig.decode_step_s``, memoised (it is called on every decode event)."""
        step = self._steps.get(batch)
        if step is None:
            step = self._steps[batch] = self._step_model(batch)
        return step

    def _scheduler_params(self) -> SchedulerParams:
        cfg = self.cfg
        read_tok_s = cfg.hw().snic_bps * cfg.storage_eff / self.kvb
        prompt_tok_s = self._prompt_tokens_per_s()
        path = ReadPath.PE if cfg.mode.mode in (Mode.BASIC, Mode.LAYERWISE) else ReadPath.AUTO
        return SchedulerParams.from_rates(read_tok_s, prompt_tok_s, cfg.alpha_s, cfg.beta_s,
                                          policy=cfg.mode.policy, read_path=path)

    def _prompt_tokens_per_s(self) -> float:
        """Prompt tokens (hit included) one PE gets through per second at the workload's mean
        hit and append — β's unit, as the router's ``dualpath profile`` defines it."""
        turns = [t for traj in self.trajs[:1000] for t in traj]
        hit = sum(t.hit for t in turns) / len(turns)
        miss = max(1.0, sum(t.miss for t in turns) / len(turns))
        ms = self.cost.predict_ms([(round(hit), round(miss))])
        return 1e3 * (hit + miss) / max(1e-9, ms)

    # --- requests ---

    def _turn(self, rid: int) -> Turn:
        agent = self.req_agent[rid]
        return self.trajs[agent][self.agent_turn[agent]]

    def _submit(self, agent: int) -> None:
        turn = self.trajs[agent][self.agent_turn[agent]]
        rid = self._next_id
        self._next_id += 1
        self.req_agent[rid] = agent
        if self.online:
            self._times[rid] = [self.loop.now]
        self.sched.submit(PendingRequest(rid, turn.prompt, turn.hit))
        self._kick()

    def _kick(self) -> None:
        if not self._tick_pending:
            self._tick_pending = True
            self.loop.after(self.cfg.fetch_interval_s, self._tick)

    def _view(self) -> ClusterView:
        """The scheduler's view; engine and node views are rebuilt only where they changed."""
        groups, by_name, group_tok = self._group_views, self._view_by_name, self._group_tok
        for role, name in self._dirty_groups:
            members = self._groups[role][name]
            for e in members:
                if e.view is None:
                    e.view = by_name[e.name] = EngineView(e.name, role, e.node, e.group, e.seq,
                                                          e.tok, e.free_kv)
            groups[role][name] = tuple(e.view for e in members)
            group_tok[name] = sum(e.tok for e in members)
        self._dirty_groups.clear()
        return ClusterView.from_groups(groups, self.storage.node_views(), by_name, group_tok)

    def _tick(self) -> None:
        self._tick_pending = False
        for a in self.sched.schedule(self._view()):
            self._start(a.req_id, a.prefill, a.decode, a.pe_read_tokens, a.de_read_tokens)

    def _start(self, rid: int, pe_name: str, de_name: str, pe_read: int, de_read: int) -> None:
        turn = self._turn(rid)
        pe, de = self.engines[pe_name], self.engines[de_name]
        assert isinstance(pe, PrefillEngine) and isinstance(de, DecodeEngine)
        pe.assign(turn.prompt)
        de.reserve(turn.prompt, turn.gen)
        if self.cfg.mode == Rung.ORACLE or turn.hit == 0:
            self._ready(pe, Job(rid, turn, de))
            return
        if pe_read:
            self.reads["pe"] += 1
        if de_read:
            self.reads["de"] += 1
        if self.cfg.mode == Rung.BASIC:  # the whole KV must be in PE HBM before the forward
            self.storage.queue(pe.node, pe_read)
            if self.cfg.basic_prefetch:
                pe.admit.append(Job(rid, turn, de, hbm=turn.prompt, h2d_pe=pe_read))
                self._admit(pe)
            else:
                self._ready(pe, Job(rid, turn, de, unread=pe_read, h2d_pe=pe_read))
            return
        job = Job(rid, turn, de, de_holds=de_read, staged=pe_read, h2d_pe=pe_read)
        pending = [int(pe_read > 0) + int(de_read > 0)]

        def arrived() -> None:
            pending[0] -= 1
            if not pending[0]:
                self._ready(pe, job)
        if pe_read:
            self.storage.staged(pe.node, pe_read, arrived)
        if de_read:
            self.storage.staged(de.node, de_read, arrived)

    def _decode(self, rid: int, de: DecodeEngine, turn: Turn) -> None:
        if self.online:
            self._times[rid].append(self.loop.now)
        de.decode(turn.gen, lambda: self._decoded(rid, de, turn), context=turn.prompt)
        self.a2a_bytes += turn.gen * self.a2a_de

    def _de_all_to_all_bps(self, de: DecodeEngine) -> float:
        """A DE's EP all-to-all demand now: one token per running request per step."""
        batch, step_s = de.running()
        return batch * self.a2a_de / step_s if batch else 0.0

    def _decoded(self, rid: int, de: DecodeEngine, turn: Turn) -> None:
        de.release(turn.prompt, turn.gen)
        agent = self.req_agent.pop(rid)
        traj, nxt = self.trajs[agent], self.agent_turn[agent] + 1
        if self.cfg.mode != Rung.ORACLE and nxt < len(traj):  # what the next turn reads anew
            self.hops.save(de, traj[nxt].hit - turn.hit, self.loop.now)
        if self.online:
            submit, prefilled, decode_start = self._times.pop(rid)
            self.latency.append((submit, prefilled, decode_start, self.loop.now, turn.gen))
        self.done_turns += 1
        if self.progress is not None and self.done_turns % 1000 == 0:
            self.progress(self.done_turns, self.total_turns)
        self.agent_turn[agent] += 1
        if self.agent_turn[agent] < len(self.trajs[agent]):
            self._submit(agent)
        else:
            self.finished_at.append(self.loop.now)
        self._kick()

    # --- run ---

    def _sample_snics(self) -> None:
        """Every ``balance_window_s``: bytes each storage NIC read in the window (docs/paper.md §7.9
        reports max/avg of these over the storage NICs); stops when every turn is done."""
        served = [link.served() for link in self.snic]
        self._snic_windows.append([now - before for now, before
                                   in zip(served, self._snic_last, strict=True)])
        self._snic_last = served
        if self.done_turns < self.total_turns:
            self.loop.after(self.cfg.balance_window_s, self._sample_snics)

    def _snic_balance(self) -> float | None:
        """Mean over windows with reads of max/avg bytes read per storage NIC."""
        ratios = [max(w) * len(w) / sum(w) for w in self._snic_windows if sum(w) > 0]
        return sum(ratios) / len(ratios) if ratios else None

    def _run_loop(self) -> None:
        """Run the event loop with Python's cyclic garbage collector paused. A run makes
        millions of short-lived objects that reference counting frees; the collector found
        nothing to collect in a 24P48D run, yet each of its full passes rescans every live
        object, and pausing it made that run 8% faster."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.loop.run()
        finally:
            if was_enabled:
                gc.enable()

    def _hop_stats(self, jct: float) -> dict[str, Any]:
        """:meth:`Hops.stats` and ``a2a_util``: EP all-to-all bytes over the compute NICs'
        capacity (each way)."""
        out = self.hops.stats(self.pes, self.des, self.snic, self.cfg.prefill_nodes, jct)
        nics = len(self.pes) + len(self.des)
        out["a2a_util"] = self.a2a_bytes / (self.cfg.hw().cnic_bps * max(jct, 1e-12) * nics)
        return out

    def run(self) -> dict[str, Any]:
        """Simulate until every agent has finished; JCT and statistics."""
        for agent, t in enumerate(arrival_times(self.cfg.workload)):
            self.loop.at(t, lambda a=agent: self._submit(a))
        self._snic_windows: list[list[float]] = []
        self._snic_last = [0.0] * len(self.snic)
        self.loop.after(self.cfg.balance_window_s, self._sample_snics)
        self._run_loop()
        if len(self.finished_at) != len(self.trajs):
            raise RuntimeError("simulation stalled: some agents never finished")
        jct = max(self.finished_at)  # not the loop's end: the last sampling window is later
        util = [link.work_done / (link.bandwidth / self.cfg.storage_eff * jct) if jct else 0.0
                for link in self.snic]
        p = self.cfg.prefill_nodes
        result = {"mode": self.cfg.mode, "P": p, "D": self.cfg.decode_nodes,
                  "agents": len(self.trajs), "jct_s": jct,
                  "snic_util_prefill": sum(util[:p]) / p,
                  "snic_util_decode": sum(util[p:]) / max(1, len(util) - p),
                  "snic_max_over_avg": self._snic_balance(),
                  "reads": dict(self.reads), "events": self.loop.processed,
                  "rounds": self.rounds, **self._hop_stats(jct)}
        if self.online:
            from dualpath.sim.online import latency_stats

            result.update(latency_stats(self.latency, self.cfg.decode_step_s(1, 0)))
        return result


def simulate(cfg: SimConfig, progress: Callable[[int, int], None] | None = None,
             trajectories: list[list[Turn]] | None = None) -> dict[str, Any]:
    """Run one configuration (on ``trajectories`` instead of the workload config's, when
    given: one list of turns per agent); the result dict of :meth:`Simulator.run`."""
    return Simulator(cfg, progress, trajectories).run()
