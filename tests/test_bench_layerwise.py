"""``dualpath bench layerwise``: one invocation, one JSON with a summary and a PNG, on a tiny
model (the default model's figures are in docs/results.md)."""

from __future__ import annotations

import json

import pytest

from dualpath.cli import main


def _run(tmp_path, model_dir, parts: str, *extra: str) -> dict:
    out = tmp_path / "layerwise.json"
    args = ["bench", "layerwise", "--model", str(model_dir), "--parts", parts, "--json", str(out),
            "--block-size", "16", "--dir", str(tmp_path / "work"), *extra]
    assert main(args) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    data = json.loads(out.read_text())
    assert data["machine"]["cpu_model"]
    return data


def test_layerwise_prefill_holds_more_than_basic_with_the_same_tokens(tiny_deep_dir, tmp_path):
    """A 1 MiB PE budget: 42 full blocks of this model in basic, 3x that with a 2-of-6-layer
    window; the ladder's top (60 blocks) fits only layerwise, and prompts both complete give
    the same greedy tokens."""
    data = _run(tmp_path, tiny_deep_dir, "a", "--prefill-kv-blocks", "40",
                "--hit-blocks", "4,20,40,60")
    summary, rows = data["summary"], data["parts"]["a"]
    assert summary["max_prefill_hit_tokens"] == {"basic": 40 * 16, "layerwise": 60 * 16}
    assert summary["max_prefill_tokens_ratio_layerwise_vs_basic"] == pytest.approx(1.5)
    assert summary["same_tokens_checked_hit_blocks"] == [4, 20, 40]
    failed = [s for s in rows["basic"]["steps"] if not s["ok"]]
    assert len(failed) == 1 and "device KV" in failed[0]["error"]  # refused at once, clearly
    assert rows["layerwise"]["pe_max_forward_hit_tokens"] == 60 * 16


def test_split_reads_part_reports_jct_and_reads_per_node(tiny_llama_dir, tmp_path):
    data = _run(tmp_path, tiny_llama_dir, "c", "--dtype", "float32", "--agents", "2",
                "--turns", "3", "--first", "64", "--append", "16", "--gen", "4",
                "--read-cap-mb-s", "2")
    summary, rows = data["summary"], data["parts"]["c"]
    assert summary["split_read_jct_ratio"] > 0
    assert rows["split_on"]["read_paths"].get("split", 0) > 0  # some hits were split
    assert "split" not in rows["split_off"]["read_paths"]
    on = summary["read_bytes_per_node"]["split_on"]
    assert len(on) == 3 and sum(on.values()) > 0


def test_lanes_part_measures_tpot_quiet_and_loaded_with_ep_traffic(tiny_llama_dir, tmp_path):
    """Part (b) on a tiny model: both lane settings run quiet and loaded phases; the DEs
    exchanged EP bytes and the PE pulled KV out of the DE buffers while loaded."""
    data = _run(tmp_path, tiny_llama_dir, "b", "--kv-hit-tokens", "96", "--decode-tokens", "600",
                "--settle-s", "0.05", "--compute-cap-mb-s", "20", "--chunk-kb", "16",
                "--ep-bytes-per-token", "4096", "--rounds", "1")
    summary, rows = data["summary"], data["parts"]["b"]
    for name in ("lanes", "fifo"):
        assert summary[f"tpot_inflation_{name}"] > 0
        assert summary[f"tpot_inflation_{name}_nic_only"] > 0
        for phase in ("quiet", "loaded"):
            for r in rows[name][phase]["rounds"]:
                assert r["de_ep_bytes"] > 0 and r["tpot_s"] > 0 and r["ttst_s"] > 0
                assert r["window_s"] > 0 and len(r["tpot_s_each"]) == 8  # the whole batch
                assert r["de_loop_cpu_s"] > 0 and r["de_loop_runqueue_wait_s"] >= 0
        assert rows[name]["quiet"]["pe_forward_s"] > 0  # the batch's own prefills
        loaded = rows[name]["loaded"]["rounds"]
        assert all(r["kv_requests"] > 0 and r["pe_cnic_recv_bytes"] > 0 for r in loaded)
        assert summary["pe_kv_recv_mb_s"][f"{name}_loaded"] > 0
    traffic = data["configs"]["b"]["traffic"]
    assert traffic["ep_bytes_per_token"] == 4096
    assert (traffic["chunk_bytes"], traffic["kv_chunk_bytes"], traffic["burst_chunks"]) == (
        16 << 10, 256 << 10, 0)


def test_token_clock_measures_tpot_inside_the_window_and_ttst_apart():
    from dualpath.bench.layerwise.lanes import _TokenClock

    clock = _TokenClock()
    clock.times = [(0.0, 1), (2.0, 1), (2.1, 1), (2.2, 2), (2.4, 1), (9.0, 1)]
    assert clock.decoding and clock.ttst_s() == 2.0  # the handoff, kept out of TPOT
    # arrivals in [2.05, 2.5]: 2.1, 2.2 (2 tokens), 2.4 (1): 3 tokens in 0.3 s
    assert clock.tpot_s(2.05, 2.5) == pytest.approx(0.1)
    assert clock.tpot_s(2.3, 2.5) is None  # one arrival: no interval
    assert not _TokenClock().decoding and _TokenClock().ttst_s() is None
