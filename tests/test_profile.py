"""``dualpath profile`` fits the cost model and derives α/β the router then uses."""

from __future__ import annotations

import json

from dualpath.cli import main
from dualpath.config import ClusterConfig, StorageConfig
from dualpath.scheduler.batch import AttentionCostModel
from dualpath.server.router.setup import scheduler_params


def test_profile_writes_cost_model_and_thresholds(tiny_llama_dir, tmp_path):
    out = tmp_path / "profile.json"
    args = ["profile", "--json", str(out), "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--block-size", "16", "--storage-root", str(tmp_path / "kv"), "--read-blocks", "8"]
    assert main(args) == 0
    profile = json.loads(out.read_text())
    assert len(profile["samples"]) == 9 and all(s["ms"] > 0 for s in profile["samples"])
    model = AttentionCostModel.from_dict(profile["cost_model"])
    assert model.predict_ms([(1024, 512)]) > model.predict_ms([(0, 64)])  # more work, more time
    summary = profile["summary"]
    assert summary["alpha_tokens"] > 0 and summary["beta_tokens"] > 0
    assert not (tmp_path / "kv" / "profile-probe").exists()
    config = ClusterConfig(storage=StorageConfig(root=str(tmp_path / "kv")),
                           profile_path=str(out), beta_tokens=123)
    params = scheduler_params(config, full_block_bytes=4096)
    assert params.alpha_tokens == summary["alpha_tokens"]  # from the profile
    assert params.beta_tokens == 123  # an explicit value wins
    # what the simulator's testbed profile needs
    base_ms, per_seq_ms = summary["decode_step_ms"]
    assert base_ms + per_seq_ms > 0 and per_seq_ms >= 0
    assert summary["kv_bytes_per_token"] > 0 and summary["kv_capacity_tokens"] > 0
    from dualpath.sim.profiles import testbed_profile

    tb = testbed_profile(out)
    assert tb.hardware().snic_bps == summary["read_tokens_per_s"] * tb.kv_bytes_per_token
