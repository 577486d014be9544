"""Frozen configuration of one simulated run, and the cost models derived from the profiles.

Modes (docs/design.md §7): ``basic`` (PE-side reads only, no layerwise prefill: each lock-step
forward first loads its requests' whole hit KV into PE HBM, then computes, so reads and compute
alternate), ``layerwise`` (PE-side reads streamed layer by layer under the running forwards:
reads overlap compute, no PE HBM hold), ``dualpath`` (read
side chosen by the scheduler), ``round_robin`` (the scheduler's round-robin baseline, read side
alternating) and ``oracle`` (no storage reads, no PD transfers).

Efficiency parameters: ``prefill_eff`` (achieved fraction of dense peak FLOP/s in a prefill
forward), ``decode_eff`` (achieved fraction of the roofline in a decode step) and
``storage_eff`` (storage goodput as a fraction of the storage NIC's line rate). The paper
presets fix the first and the last a priori and fit ``decode_eff`` on an Oracle point only
(:func:`dualpath.sim.presets.calibrate`). A ``testbed`` profile (measured by ``dualpath
profile``) replaces the hardware, the model and both cost models with measured rates.

Decode step model (roofline): one step of a DE (one GPU, DP attention + EP MoE over the
decode side's GPUs) with ``b`` running requests reads its share of the weights plus each
request's attended KV (:meth:`ModelProfile.decode_read_bytes`) from HBM and computes ``b``
tokens; its time is ``max(bytes / hbm_bps, b · flops / peak) / decode_eff``. ``decode_eff``
folds in what the roofline leaves out (EP all-to-all per layer, kernel launches, sampling).
The batch is capped by the DE's KV capacity (HBM after its EP group's share of the weights),
which the scheduler sees as the engine's free KV. With ``ep_lockstep`` the DEs of an EP group
step together at the busiest one's step time, and the PEs of an EP group run their forwards
together (``ep_nodes`` sets the group sizes; default: one group per side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dualpath.scheduler.batch import AttentionCostModel
from dualpath.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    TestbedProfile,
    get_hardware,
    get_model,
)
from dualpath.traffic.lanes import DEFAULT_LANE_WEIGHTS, Lane, weights_from_pairs
from dualpath.vocab import Rung
from dualpath.workloads.presets import WorkloadConfig


@dataclass(frozen=True)
class SimConfig:
    """One run: cluster shape, profiles, mode, workload and the few model constants."""

    model: str = "ds660b"
    hardware: str | HardwareProfile = "hopper"  # a preset's name or a profile
    prefill_nodes: int = 2
    decode_nodes: int = 4
    mode: Rung = Rung.DUALPATH  # a rung of the ablation ladder (vocab.LADDER)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    prefill_eff: float = 0.12
    decode_eff: float = 0.15
    decode_base_s: float = 0.0  # extra fixed per-step time (not fitted; 0 by default)
    decode_ctx: int = 32_768  # context the per-request decode cost is evaluated at
    ep_lockstep: bool = True  # forwards/steps in lock step within an EP group (docs/design.md §7)
    ep_nodes: tuple[int, int] | None = None  # (prefill, decode) nodes per EP group; None: a side
    quota_ms: float = 300.0
    # PAPER A.4: the quota is DualPath's
    quota_modes: tuple[Rung, ...] = (Rung.DUALPATH, Rung.ORACLE)
    dram_buffer_gb: float | None = None  # per-node DRAM staging for layerwise reads (None: ∞)
    storage_eff: float = 1.0  # storage goodput as a fraction of the storage NIC's line rate
    read_streams: int | None = None  # request reads in flight per storage NIC (None: all)
    basic_prefetch: bool = False  # Basic: read KV into PE HBM ahead (True) or in the round
    token_budget: int = 8192  # other modes: new tokens per PE forward (a stock chunked prefill)
    fetch_interval_s: float = 0.05  # pull period of the engine groups
    balance_window_s: float = 10.0  # window of the storage-NIC max/avg statistic
    hbm_reserve: float = 0.1  # fraction of HBM kept for activations
    kv_bytes_per_token: float | None = None  # override the model's (storage, transfers)
    hbm_kv_bytes_per_token: float | None = None  # KV layout in HBM, if not the same
    alpha_s: float = 3.0
    beta_s: float = 5.0
    testbed: TestbedProfile | None = None  # measured rates replace hardware/model/cost models
    lane_weights: tuple[tuple[str, int], ...] | None = None  # compute-NIC lanes (None: default)

    def __post_init__(self) -> None:
        if self.mode not in tuple(Rung):
            raise ValueError(f"mode must be one of {tuple(map(str, Rung))}, got {self.mode!r}")
        object.__setattr__(self, "mode", Rung(self.mode))
        if not self.mode.reuses_kv:
            raise ValueError(f"the simulator models the rungs that reuse KV, not {self.mode}")
        if self.prefill_nodes <= 0 or self.decode_nodes <= 0:
            raise ValueError("need at least one prefill and one decode node")
        if not 0 < self.prefill_eff <= 1 or not 0 < self.decode_eff <= 1 or not (
                0 < self.storage_eff <= 1):
            raise ValueError("efficiencies must be in (0, 1]")
        if self.read_streams is not None and self.read_streams <= 0:
            raise ValueError(f"read_streams must be positive or None, got {self.read_streams}")
        self.lanes()  # named error for bad lane weights
        ep_p, ep_d = self.ep_group_nodes()
        if self.prefill_nodes % ep_p or self.decode_nodes % ep_d:
            raise ValueError(f"ep_nodes {self.ep_nodes} must divide {self.prefill_nodes}P"
                             f"{self.decode_nodes}D")

    def ep_group_nodes(self) -> tuple[int, int]:
        """Nodes per EP group on the prefill and the decode side."""
        if self.ep_nodes is None:
            return self.prefill_nodes, self.decode_nodes
        ep_p, ep_d = self.ep_nodes
        if ep_p <= 0 or ep_d <= 0:
            raise ValueError(f"ep_nodes must be positive, got {self.ep_nodes}")
        return ep_p, ep_d

    def hw(self) -> HardwareProfile:
        """The hardware profile."""
        if self.testbed:
            return self.testbed.hardware()
        if isinstance(self.hardware, HardwareProfile):
            return self.hardware
        return get_hardware(self.hardware)

    def lanes(self) -> dict[Lane, int]:
        """The compute NICs' lane weights (``transfer/lanes.py``'s defaults unless given)."""
        if self.lane_weights is None:
            return dict(DEFAULT_LANE_WEIGHTS)
        return weights_from_pairs(self.lane_weights)

    def model_profile(self) -> ModelProfile:
        """The model profile (with the KV bytes/token override applied)."""
        m = self.testbed.model_profile() if self.testbed else get_model(self.model)
        return m if self.kv_bytes_per_token is None else m.with_kv_bytes(self.kv_bytes_per_token)

    def prefill_cost(self) -> AttentionCostModel:
        """Forward time of a PE batch (ms) as the scheduler's quota model: ``a`` prices the
        keys that grow with context (dense attention, DSA indexer), ``b`` the per-token work
        (linear layers and top-k sparse attention)."""
        if self.testbed:
            slow = 1.0 / self.testbed_cpu_share()
            a, b, c = self.testbed.cost_model
            return AttentionCostModel(a * slow, b * slow, c * slow)
        m, rate = self.model_profile(), self.hw().peak_flops * self.prefill_eff
        per_key = m.indexer_flops_per_key + (0.0 if m.topk else m.attn_flops_per_key)
        per_tok = m.linear_flops + (m.attn_flops_per_key * m.topk if m.topk else 0.0)
        return AttentionCostModel(a=per_key / rate * 1e3, b=per_tok / rate * 1e3)

    def decode_step_s(self, batch: int, tokens: float | None = None) -> float:
        """Time of one decode step with ``batch`` running requests holding ``tokens`` KV
        tokens in all (``None``: ``batch × decode_ctx``). Each request is costed at the
        batch's mean context."""
        return self.decode_step_model()(batch, tokens)

    def decode_step_model(self) -> Callable[[int, float | None], float]:
        """:meth:`decode_step_s` as a closure over the profiles' constants (the simulator
        calls it on every change of a decode batch)."""
        if self.testbed:
            base_ms, per_seq_ms = self.testbed.decode_step_ms
            share = self.testbed_cpu_share()
            return lambda batch, tokens=None: (base_ms + per_seq_ms * batch) / 1e3 / share
        hw = self.hw()
        m = self.model_profile().with_kv_bytes(self.hbm_kv_bytes())
        weights = m.weight_bytes / (self.ep_group_nodes()[1] * hw.gpus_per_node)
        hbm_bps, peak = hw.hbm_bps, hw.peak_flops
        base, eff, default_ctx = self.decode_base_s, self.decode_eff, self.decode_ctx

        def step_s(batch: int, tokens: float | None = None) -> float:
            ctx = default_ctx if tokens is None else max(1, round(tokens / max(1, batch)))
            mem = (weights + batch * m.decode_read_bytes(ctx)) / hbm_bps
            comp = batch * m.flops_per_token(ctx) / peak
            return base + max(mem, comp) / eff
        return step_s

    def testbed_cpu_share(self) -> float:
        """Testbed: the core share of one engine (:meth:`TestbedProfile.cpu_share`)."""
        assert self.testbed is not None
        return self.testbed.cpu_share(self.prefill_nodes)

    def kv_capacity_tokens(self, role_nodes: int) -> int:
        """KV tokens one GPU holds after its share of the weights (EP over ``role_nodes``
        nodes' GPUs: pass the EP group's node count)."""
        if self.testbed:
            return self.testbed.kv_capacity_tokens
        hw, m = self.hw(), self.model_profile()
        free = hw.hbm_bytes * (1 - self.hbm_reserve) - m.weight_bytes / (
            role_nodes * hw.gpus_per_node)
        if free <= 0:
            raise ValueError(f"{m.name} does not fit on {role_nodes} {hw.name} nodes")
        return int(free // self.hbm_kv_bytes())

    def hbm_kv_bytes(self) -> float:
        """KV bytes per token as held in HBM (capacity, decode reads)."""
        if self.hbm_kv_bytes_per_token is not None:
            return self.hbm_kv_bytes_per_token
        return self.model_profile().kv_bytes_per_token
