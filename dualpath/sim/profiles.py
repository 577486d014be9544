"""Hardware and model profiles for the simulator, with the derivations written down.

Hardware (per node): ``g`` GPUs, one compute NIC per GPU (``cnic_bps`` bytes/s), one storage
NIC per node (``snic_bps``), DRAM bandwidth ``dram_bps``, dense peak FLOP/s per GPU at the
compute dtype the paper serves with (FP8 for DeepSeek), and HBM per GPU. The paper's node
(docs/paper.md §1.3, §7.1) is 8 Hopper GPUs, 8 × 400 Gbps CNICs (50 GB/s each), 1 × 400 Gbps SNIC
(50 GB/s) and ≈ 500 GB/s DRAM.

Models: KV bytes per token and FLOPs per new token are derived from the architecture (see each
profile's ``notes``). Prefill FLOPs of one new token at context ``ctx`` are
``linear + attn_per_key · min(ctx, topk) + indexer_per_key · ctx`` (``topk`` = 0 means dense
attention, every key). ``testbed_profile`` reads the JSON that ``dualpath profile`` writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from math import comb
from pathlib import Path
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    """One node type: GPUs per node, NIC and DRAM bandwidths (bytes/s), peak FLOP/s, HBM."""

    name: str
    gpus_per_node: int = 8
    cnic_bps: float = 50 * GB  # one 400 Gbps compute NIC per GPU
    snic_bps: float = 50 * GB  # one 400 Gbps storage NIC per node
    dram_bps: float = 500 * GB
    peak_flops: float = 1979e12  # dense FP8 Tensor-Core FLOP/s per GPU
    hbm_bytes: float = 80 * GB
    hbm_bps: float = 3.35e12  # HBM bandwidth per GPU (H800/H100 SXM: 3.35 TB/s)
    notes: str = ""

    @property
    def storage_ratio(self) -> float:
        """``s``: storage NIC bandwidth in units of one compute NIC (docs/paper.md §3 notation)."""
        return self.snic_bps / self.cnic_bps

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields plus ``s``."""
        return {**self.__dict__, "s": self.storage_ratio}


HARDWARE: dict[str, HardwareProfile] = {
    "hopper": HardwareProfile(
        "hopper", notes="the paper's node: 8 Hopper (H800-class, 80 GB, 1,979 TFLOPS dense "
        "FP8), 8 x 400 Gbps CNIC, 1 x 400 Gbps SNIC, DRAM ~500 GB/s (PAPER 1.3, 3.3)"),
    "h200": HardwareProfile(
        "h200", hbm_bytes=141 * GB, hbm_bps=4.8e12,
        notes="H200: Hopper compute, 141 GB HBM3e; same NICs"),
    "b200": HardwareProfile(
        "b200", cnic_bps=100 * GB, snic_bps=50 * GB, dram_bps=800 * GB, peak_flops=4500e12,
        hbm_bytes=192 * GB, hbm_bps=8e12,
        notes="B200-class: 4.5 PFLOPS dense FP8, 192 GB, 8 x 800 Gbps "
        "CNIC (ConnectX-8), 1 x 400 Gbps SNIC, ~800 GB/s DRAM"),
}


@dataclass(frozen=True)
class ModelProfile:
    """What the simulator needs from a model: KV bytes/token, FLOPs/token terms, weights."""

    name: str
    layers: int
    kv_bytes_per_token: float
    linear_flops: float  # 2 × active parameters per new token
    attn_flops_per_key: float  # FLOPs of one new token against one cached key, all layers
    topk: int = 0  # sparse attention keys per token (0: dense)
    indexer_flops_per_key: float = 0.0  # DSA lightning indexer, all layers
    weight_bytes: float = 0.0
    index_bytes_per_token: float = 0.0  # DSA indexer key bytes/token, all layers
    moe_layers: int = 0  # layers with routed experts (0: a dense model, no EP all-to-all)
    hidden: int = 0
    routed_experts: int = 0
    active_experts: int = 0
    node_limit: int = 0  # most nodes a token is routed to (0: no limit)
    notes: str = ""

    def flops_per_token(self, ctx: int) -> float:
        """FLOPs to prefill one new token with ``ctx`` keys before it."""
        keys = min(ctx, self.topk) if self.topk else ctx
        return (self.linear_flops + self.attn_flops_per_key * keys
                + self.indexer_flops_per_key * ctx)

    def decode_read_bytes(self, ctx: int) -> float:
        """HBM bytes one decode step reads for one request at context ``ctx``: its attended
        KV (top-k keys under sparse attention, every key otherwise) plus the indexer keys."""
        keys = min(ctx, self.topk) if self.topk else ctx
        return keys * self.kv_bytes_per_token + ctx * self.index_bytes_per_token

    def gb_per_pflop(self, ctx: int, append: int) -> float:
        """Cache-compute ratio of docs/paper.md §1.2 Table 1: GB of hit KV per PFLOP of prefill."""
        flops = sum(self.flops_per_token(ctx + i) for i in range(0, append, max(1, append // 16)))
        flops *= append / len(range(0, append, max(1, append // 16)))
        return ctx * self.kv_bytes_per_token / GB / (flops / 1e15)

    def a2a_bytes_per_token(self, ep_nodes: int) -> float:
        """EP all-to-all bytes one token puts on its GPU's compute NIC, each way, with the
        experts spread evenly over ``ep_nodes`` nodes (traffic inside a node uses NVLink).

        Per MoE layer and remote node the token is dispatched once in FP8 (``hidden`` bytes
        plus a 4-byte scale per 128 values) and its result combined once in BF16
        (``2·hidden``), as DeepEP's inter-node kernels do. Its ``k`` experts out of ``E``
        reach ``N·(1 − C(E − E/N, k)/C(E, k))`` distinct nodes on average, at most
        ``node_limit`` of them, and a fraction ``(N − 1)/N`` of those is remote. Balanced
        dispatch makes what a NIC receives for other GPUs' tokens equal what it sends."""
        n = ep_nodes
        if not self.moe_layers or n <= 1:
            return 0.0
        e, k = self.routed_experts, self.active_experts
        hit_one = 1 - comb(e - e // n, k) / comb(e, k)
        nodes = n * hit_one if not self.node_limit else min(n * hit_one, self.node_limit)
        per_node = self.hidden + self.hidden // 128 * 4 + 2 * self.hidden
        return self.moe_layers * per_node * nodes * (n - 1) / n

    def with_kv_bytes(self, kv_bytes_per_token: float) -> ModelProfile:
        """The same model with another KV bytes/token (e.g. BF16 latent)."""
        return replace(self, kv_bytes_per_token=kv_bytes_per_token)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields."""
        return dict(self.__dict__)


# DeepSeek-V3.2 (MLA + DSA). KV: per layer the FP8 latent (512 B) + BF16 RoPE key (64 × 2 B)
# + 16 B of scales = 656 B; × 61 layers = 40,016 B/token. Alternatives (docs/paper.md §7.2): ~48 KB
# with the indexer's FP8 keys (128 B + scale per layer), 70,272 B with a BF16 latent
# (576 × 2 × 61). Linear: 37B active parameters → 74 GFLOP. Attention (absorbed MLA, 128
# heads): QK over 576 dims + PV over 512 → 2·128·(576+512) = 278,528 FLOPs/key/layer × 61 =
# 1.70e7, on at most top-k = 2,048 keys. Indexer: 64 heads × 128 dims × 2 × 61 = 1.0e6/key.
# Indexer keys read by every decode step: FP8 128 dims + 4 B scale per layer = 8,052 B/token.
# At 32.7K context and 429 appended tokens this gives ≈ 21 GB/PFLOP (PAPER Table 1: ~22).
# EP: 58 MoE layers (3 dense), hidden 7,168, 8 of 256 routed experts, at most 4 nodes per
# token (DeepSeek-V3's node-limited routing): ≈ 1.26 MB/token each way over 2 nodes.
DS_V32 = ModelProfile(
    "ds660b", layers=61, kv_bytes_per_token=656 * 61, linear_flops=2 * 37e9,
    attn_flops_per_key=2 * 128 * (576 + 512) * 61, topk=2048,
    indexer_flops_per_key=64 * 128 * 2 * 61, weight_bytes=671e9,
    index_bytes_per_token=(128 + 4) * 61, moe_layers=58, hidden=7168, routed_experts=256,
    active_experts=8, node_limit=4,
    notes="DeepSeek-V3.2 660B; FP8 MLA latent 656 B x 61 layers = 40,016 B/token "
    "(alternatives: ~48 KB with indexer keys, 70,272 B BF16 latent)")

# The 27B variant (docs/paper.md §7.2 / A.2): hidden 2560, 30 layers, 32 heads, 72 routed experts
# (6 active) + 2 shared of intermediate 1536, 1 dense layer of 12288, top-k 1024, no Q LoRA.
# Active per token: experts 29 × 8 × 3·2560·1536 = 2.74B, dense 3·2560·12288 = 94M, attention
# ≈ 32M × 30 (q 2560·32·192, kv_a 2560·576, kv_b 512·32·256, o 32·128·2560) = 0.96B,
# LM head 129,280 × 2560 = 0.33B → ≈ 4.1B active → 8.3 GFLOP. MLA latent as V3.2: 656 × 30 B.
DS_27B = ModelProfile(
    "ds27b", layers=30, kv_bytes_per_token=656 * 30, linear_flops=2 * 4.13e9,
    attn_flops_per_key=2 * 32 * (576 + 512) * 30, topk=1024,
    indexer_flops_per_key=32 * 64 * 2 * 30, weight_bytes=27e9,
    index_bytes_per_token=(64 + 4) * 30, moe_layers=29, hidden=2560, routed_experts=72,
    active_experts=6, node_limit=4,
    notes="DS 27B (A.2); FP8 MLA latent 656 B x 30 layers = 19,680 B/token")

# Qwen2.5-32B: 64 layers, GQA 40 query / 8 KV heads of 128, FP16 KV: 2·8·128·2 B × 64 =
# 262,144 B = 256 KiB/token. Linear 2 × 32.5B. Dense attention: QK + PV = 2·2·40·128 per key
# per layer × 64 = 1.31e6 FLOPs/key. Dense and served DP only (docs/paper.md §7.3): no all-to-all.
QWEN_32B = ModelProfile(
    "qwen32b", layers=64, kv_bytes_per_token=2 * 8 * 128 * 2 * 64, linear_flops=2 * 32.5e9,
    attn_flops_per_key=2 * 2 * 40 * 128 * 64, weight_bytes=65e9,
    notes="Qwen2.5-32B GQA, FP16 KV 256 KiB/token, dense attention")

MODELS: dict[str, ModelProfile] = {m.name: m for m in (DS_V32, DS_27B, QWEN_32B)}


def get_hardware(name: str) -> HardwareProfile:
    """A hardware preset by name (ValueError listing the known ones)."""
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[name]


def get_model(name: str) -> ModelProfile:
    """A model preset by name (ValueError listing the known ones)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]


@dataclass(frozen=True)
class TestbedProfile:
    """Rates measured on the real engine by ``dualpath profile`` (one engine = one 'GPU' on
    its own 'node'): the prefill cost model (ms), the decode step (ms = base + per_seq · batch),
    KV bytes per token and per-engine KV capacity, and the testbed's emulated NIC caps."""

    __test__ = False  # not a pytest class

    prefill_tokens_per_s: float
    read_tokens_per_s: float
    cost_model: tuple[float, float, float]  # AttentionCostModel (a, b, c), ms
    model: str = "testbed"
    kv_bytes_per_token: float = 0.0
    kv_capacity_tokens: int = 0
    decode_step_ms: tuple[float, float] = (0.0, 0.0)  # (base, per running sequence)
    compute_cap_bps: float = 1.5e9  # the testbed's compute-NIC cap (loopback transfer rate)
    cpus: int = 0  # cores of the machine it was measured on (0: unknown)

    def cpu_share(self, prefill_engines: int) -> float:
        """Fraction of a core an engine gets on the testbed, where all engines of a local
        cluster share the machine's cores: the prefill engines' forwards split them, and the
        decode engines, whose short steps leave their core idle most of the time, are not
        counted. Measured (2026-12-03, 1 PE + 2 DE on 2 cores, the default agents run): the
        PE's forwards took what the profile's one-engine cost model says (31 s in the oracle
        against 34 s), and the simulator matched the real basic and dualpath JCTs within 1%
        this way, where slowing every engine to 2/3 of a core predicted 72 s for an oracle of
        37 s."""
        return 1.0 if not self.cpus else min(1.0, self.cpus / max(1, prefill_engines))

    def hardware(self) -> HardwareProfile:
        """One engine per node: the storage NIC reads ``read_tokens_per_s`` tokens."""
        return HardwareProfile("testbed", gpus_per_node=1, cnic_bps=self.compute_cap_bps,
                               snic_bps=self.read_tokens_per_s * self.kv_bytes_per_token,
                               notes=f"measured by dualpath profile ({self.model})")

    def model_profile(self) -> ModelProfile:
        """The model as the simulator sees it: KV bytes per token (compute is measured)."""
        return ModelProfile(self.model, layers=1, kv_bytes_per_token=self.kv_bytes_per_token,
                            linear_flops=0.0, attn_flops_per_key=0.0)


def testbed_profile(path: str | Path) -> TestbedProfile:
    """Load the JSON ``dualpath profile`` wrote (``summary`` rates + ``cost_model``).

    ValueError naming the file when it lacks what the simulator needs."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the profile {path}: {exc}") from None
    try:
        summary, cost = data["summary"], data["cost_model"]
        return TestbedProfile(
            float(summary["prefill_tokens_per_s"]), float(summary["read_tokens_per_s"]),
            (float(cost["a"]), float(cost.get("b", 0.0)), float(cost.get("c", 0.0))),
            str(data.get("model", "testbed")),
            float(summary.get("kv_bytes_per_token", 0.0)),
            int(summary.get("kv_capacity_tokens", 0)),
            tuple(float(x) for x in summary.get("decode_step_ms", (0.0, 0.0))),  # type: ignore[arg-type]
            float(summary.get("compute_cap_bps", 1.5e9)),
            int((data.get("machine") or {}).get("cpus") or 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a dualpath profile ({exc})") from None
