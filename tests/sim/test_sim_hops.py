"""The hops of docs/paper.md §2–3 in the simulator: DRAM per node, both directions of every compute
NIC, and the EP all-to-all on the NICs' high lane."""

from dataclasses import replace
from fractions import Fraction

import pytest

from dualpath.sim.cluster import Simulator, simulate
from dualpath.sim.planner import pd_ratio_range
from dualpath.sim.presets import DS660B
from dualpath.sim.profiles import get_hardware
from dualpath.workloads.presets import WorkloadConfig

SMALL = replace(DS660B, workload=WorkloadConfig("64k", agents=32, turns=20))


def _workload_bytes(cfg):
    """Hit and prompt bytes of every turn, and the bytes written back: each turn's new full
    blocks that the agent's next turn reads (its hit less this turn's)."""
    sim = Simulator(cfg)
    hit = sum(t.hit for traj in sim.trajs for t in traj)
    prompt = sum(t.prompt for traj in sim.trajs for t in traj)
    saved = sum(traj[-1].hit - traj[0].hit for traj in sim.trajs)
    return hit * sim.kvb, prompt * sim.kvb, saved * sim.kvb


@pytest.mark.parametrize("mode", ["dualpath", "layerwise", "basic"])
def test_hop_bytes_follow_the_papers_traffic_model(mode):
    """docs/paper.md §3.3, per byte: the PE path reads into PE DRAM and copies it into PE HBM by
    loopback (PE DRAM 2×, PE NIC read + write); the DE path reads into DE DRAM and sends it
    DE NIC → PE NIC; every prompt goes PE → DE DRAM (the DE path: only its miss tokens), then
    DE DRAM → DE HBM by loopback. So DE DRAM carries 3× the DE reads + 2× the PE reads (plus
    the miss tokens twice): eq. (8)'s ``(3 + 2·P/D)·s·B``. The write-back of new blocks (§2.4,
    which eq. 8 leaves out) adds DE HBM → DE NIC loopback → DE DRAM → storage."""
    cfg = replace(SMALL, mode=mode)
    result = simulate(cfg)
    hops, (hit, prompt, saved) = result["hop_bytes"], _workload_bytes(cfg)
    h_pe, h_de = hops["snic_prefill"], hops["snic_decode"]
    assert h_pe > 0 and (h_de > 0) == (mode == "dualpath")
    assert h_pe + h_de == pytest.approx(hit)  # each turn rereads every block, once
    assert hops["snic_write"] == pytest.approx(saved)
    assert hops["dram_prefill"] == pytest.approx(2 * h_pe)
    assert hops["dram_decode"] == pytest.approx(h_de + 2 * prompt + 2 * saved)
    assert hops["pe_tx"] == pytest.approx(h_pe + prompt - h_de)  # steps 3 and 5
    assert hops["pe_rx"] == pytest.approx(h_pe + h_de)  # PE step 4, DE step 5
    assert hops["de_tx"] == pytest.approx(h_de + prompt + saved)  # PE 8, DE 3 and 6, saves
    assert hops["de_rx"] == pytest.approx(2 * prompt - h_de + saved)  # PE 7, 9, DE 7, saves
    assert 0 < result["hop_util"]["dram_decode"] <= result["hop_util_max"]["dram_decode"] < 1


def test_oracle_moves_no_kv():
    result = simulate(replace(SMALL, mode="oracle"))
    assert not any(result["hop_bytes"].values())
    assert result["a2a_util"] > 0  # the forwards and decode steps still exchange tokens


def _ds27b(p: int, d: int, dram_gbps: float) -> dict:
    hw = replace(get_hardware("hopper"), dram_bps=dram_gbps * 1e9)
    cfg = replace(DS660B, model="ds27b", hardware=hw, prefill_nodes=p, decode_nodes=d,
                  kv_bytes_per_token=None, hbm_kv_bytes_per_token=None,
                  workload=WorkloadConfig("64k", agents=1024, turns=12, context_step=5000.0))
    return simulate(cfg)


def test_the_dram_bound_of_eq8_bites_outside_the_range_only():
    """With 200 GB/s of DRAM eq. (8) allows P/D ≤ 1/2: 1P2D is inside, 2P1D outside. In
    simulation the slower DRAM leaves 1P2D as it was and slows 2P1D, whose decode node's
    DRAM becomes its bottleneck."""
    rng = pd_ratio_range(g=8, s=1, B=50, M=200)
    assert rng["upper"] == Fraction(1, 2) and rng["binding_upper"] == ["de_dram_upper (8)"]
    inside = {m: _ds27b(1, 2, m) for m in (500, 200)}
    outside = {m: _ds27b(2, 1, m) for m in (500, 200)}
    assert inside[200]["jct_s"] == pytest.approx(inside[500]["jct_s"], rel=0.01)
    assert outside[200]["jct_s"] > 1.05 * outside[500]["jct_s"]
    assert outside[200]["hop_util_max"]["dram_decode"] > 0.85
    assert inside[200]["hop_util_max"]["dram_decode"] < outside[200]["hop_util_max"][
        "dram_decode"]


def test_all_to_all_is_every_computed_and_generated_token():
    """Each token a PE computes and each token a DE generates crosses its GPU's compute NIC
    once per MoE layer and remote node (:meth:`ModelProfile.a2a_bytes_per_token`), on the
    high lane: while a DE decodes, its NIC's KV bookings get what that traffic leaves."""
    cfg = replace(SMALL, mode="dualpath")
    sim = Simulator(cfg)
    result = sim.run()
    turns = [t for traj in sim.trajs for t in traj]
    expected = (sum(t.miss for t in turns) * sim.a2a_pe + sum(t.gen for t in turns) * sim.a2a_de)
    nics = len(sim.pes) + len(sim.des)
    assert result["a2a_util"] * sim.cfg.hw().cnic_bps * result["jct_s"] * nics == (
        pytest.approx(expected))
    assert sim.a2a_pe > 0 and sim.a2a_de > sim.a2a_pe  # the decode side spans more nodes
    assert all(pe.nic.tx.high_bps == 0 for pe in sim.pes)  # no forward runs at the end
    de = sim.des[0]
    de.decode(100, lambda: None, context=1000)  # one running request: its steps' traffic
    batch, step_s = de.running()
    assert batch == 1 and de.nic.rx.kv_bps() == pytest.approx(
        de.nic.rx.bandwidth - sim.a2a_de / step_s)
    with pytest.raises(ValueError, match="lane"):
        replace(cfg, lane_weights=(("high", 1),))


def test_dense_model_has_no_all_to_all():
    from dualpath.sim.profiles import get_model

    assert get_model("qwen32b").a2a_bytes_per_token(4) == 0
    ds = get_model("ds660b")
    assert ds.a2a_bytes_per_token(1) == 0  # one node: NVLink only
    # over two nodes nearly every token reaches the other node once per MoE layer:
    # 58 layers × (7,168 FP8 + 224 B of scales + 14,336 BF16) ≈ 1.26 MB
    assert ds.a2a_bytes_per_token(2) == pytest.approx(58 * 21_728, rel=0.01)
    assert ds.a2a_bytes_per_token(2) < ds.a2a_bytes_per_token(4) < ds.a2a_bytes_per_token(48)
