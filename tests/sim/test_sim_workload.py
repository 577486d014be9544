"""Table 2 trajectory presets and the replay rule."""

import pytest

from dualpath.sim.workload import WorkloadConfig, summary, trajectory


def test_64k_matches_table_means():
    turns = trajectory(WorkloadConfig("64k", agents=1))
    s = summary(turns, 1)
    assert s["turns"] == 157
    assert s["mean_context"] == pytest.approx(32_721, rel=0.01)
    assert all(t.miss >= 429 and t.gen == 176 for t in turns)
    assert s["hit_rate"] > 0.98


def test_append_gen_growth_and_block_alignment():
    turns = trajectory(WorkloadConfig("32k", agents=1, context_step=None, block_size=64))
    assert turns[0].hit == 0 and turns[0].prompt == 608
    assert turns[1].prompt == 756 + 608 and turns[1].hit == 704
    assert all(t.hit % 64 == 0 for t in turns)


def test_unknown_preset():
    with pytest.raises(ValueError):
        trajectory(WorkloadConfig("1m"))


def test_workload_config_rejects_no_agents_and_bad_rates():
    import pytest

    from dualpath.sim.workload import WorkloadConfig

    with pytest.raises(ValueError, match="agents"):
        WorkloadConfig("64k", agents=0)
    with pytest.raises(ValueError, match="aps"):
        WorkloadConfig("64k", agents=4, aps=0.0)
