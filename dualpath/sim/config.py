"""Frozen configuration of one simulated run, and the cost models derived from the profiles.

Modes (DESIGN §7): ``basic`` (PE-side reads only; a request's whole hit KV must sit in PE HBM
from the start of its read to the end of its prefill, and reads do not overlap that request's
compute), ``layerwise`` (PE-side reads, layer-streamed: no PE HBM hold), ``dualpath`` (read
side chosen by the scheduler), ``round_robin`` (the scheduler's round-robin baseline, read side
alternating) and ``oracle`` (no storage reads, no PD transfers).

Efficiency parameters (the only fitted ones): ``prefill_eff`` (achieved fraction of dense peak
FLOP/s in a prefill forward) and ``decode_eff`` (the same for the per-request part of a decode
step). They are fitted on oracle points only (see :mod:`dualpath.sim.presets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.scheduler.batch import AttentionCostModel
from dualpath.sim.profiles import HardwareProfile, ModelProfile, get_hardware, get_model
from dualpath.sim.workload import WorkloadConfig

MODES = ("basic", "layerwise", "dualpath", "round_robin", "oracle")


@dataclass(frozen=True)
class SimConfig:
    """One run: cluster shape, profiles, mode, workload and the few model constants."""

    model: str = "ds660b"
    hardware: str = "hopper"
    prefill_nodes: int = 2
    decode_nodes: int = 4
    mode: str = "dualpath"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    prefill_eff: float = 0.12
    decode_eff: float = 0.05
    decode_base_s: float = 0.02  # per-step time independent of batch (weights, collectives)
    decode_ctx: int = 32_768  # context the per-request decode cost is evaluated at
    quota_ms: float = 300.0
    fetch_interval_s: float = 0.05  # pull period of the engine groups
    hbm_reserve: float = 0.1  # fraction of HBM kept for activations
    kv_bytes_per_token: float | None = None  # override the model's
    alpha_s: float = 3.0
    beta_s: float = 5.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill_nodes <= 0 or self.decode_nodes <= 0:
            raise ValueError("need at least one prefill and one decode node")
        if not 0 < self.prefill_eff <= 1 or not 0 < self.decode_eff <= 1:
            raise ValueError("efficiencies must be in (0, 1]")

    def hw(self) -> HardwareProfile:
        """The hardware profile."""
        return get_hardware(self.hardware)

    def model_profile(self) -> ModelProfile:
        """The model profile (with the KV bytes/token override applied)."""
        m = get_model(self.model)
        return m if self.kv_bytes_per_token is None else m.with_kv_bytes(self.kv_bytes_per_token)

    def prefill_cost(self) -> AttentionCostModel:
        """Forward time of a PE batch (ms) as the scheduler's quota model: ``a`` prices the
        keys that grow with context (dense attention, DSA indexer), ``b`` the per-token work
        (linear layers and top-k sparse attention)."""
        m, rate = self.model_profile(), self.hw().peak_flops * self.prefill_eff
        per_key = m.indexer_flops_per_key + (0.0 if m.topk else m.attn_flops_per_key)
        per_tok = m.linear_flops + (m.attn_flops_per_key * m.topk if m.topk else 0.0)
        return AttentionCostModel(a=per_key / rate * 1e3, b=per_tok / rate * 1e3)

    def decode_step_s(self, batch: int) -> float:
        """Time of one decode step with ``batch`` running requests."""
        m = self.model_profile()
        per_req = m.flops_per_token(self.decode_ctx) / (self.hw().peak_flops * self.decode_eff)
        return self.decode_base_s + batch * per_req

    def kv_capacity_tokens(self, role_nodes: int) -> int:
        """KV tokens one GPU holds after its share of the weights (EP over the role's GPUs)."""
        hw, m = self.hw(), self.model_profile()
        free = hw.hbm_bytes * (1 - self.hbm_reserve) - m.weight_bytes / (
            role_nodes * hw.gpus_per_node)
        if free <= 0:
            raise ValueError(f"{m.name} does not fit on {role_nodes} {hw.name} nodes")
        return int(free // m.kv_bytes_per_token)
