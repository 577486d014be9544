"""Table 2 trajectory presets and the replay rule."""

import pytest

from dualpath.workloads.presets import WorkloadConfig, summary, trajectory


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

    from dualpath.workloads.presets import WorkloadConfig

    with pytest.raises(ValueError, match="agents"):
        WorkloadConfig("64k", agents=0)
    with pytest.raises(ValueError, match="aps"):
        WorkloadConfig("64k", agents=4, aps=0.0)


@pytest.mark.parametrize("preset, mal", [("32k", 32_768), ("48k", 49_152), ("64k", 65_536)])
def test_varied_lengths_keep_table_2_means_under_the_cap(preset, mal):
    from dualpath.workloads.presets import PRESETS, VARIED, agent_trajectories

    p = PRESETS[preset]
    trajs = agent_trajectories(WorkloadConfig(preset, agents=2048, lengths="varied"))
    turns = [t for traj in trajs for t in traj]
    assert len(turns) / len(trajs) == pytest.approx(p.turns, rel=0.01)
    assert sum(t.prompt - p.append for t in turns) / len(turns) == pytest.approx(
        p.mean_context, rel=0.01)
    assert sum(tr[-1].prompt + tr[-1].gen for tr in trajs) / len(trajs) == pytest.approx(
        p.total_tokens, rel=0.01)
    assert max(t.prompt + t.gen for t in turns) <= mal  # the MAL cuts every trajectory
    longest = max(trajs, key=len)
    assert VARIED[preset].max_len == mal
    assert longest[-1].prompt + round(VARIED[preset].step) + p.gen > mal  # one more would not fit
    assert len({len(t) for t in trajs}) > 10 and longest[0].hit == 0


def test_varied_lengths_are_deterministic_shuffled_and_truncatable():
    from dualpath.workloads.presets import agent_trajectories

    cfg = WorkloadConfig("64k", agents=64, lengths="varied")
    counts = [len(t) for t in agent_trajectories(cfg)]
    assert counts == [len(t) for t in agent_trajectories(cfg)]
    assert counts != sorted(counts)
    short = agent_trajectories(WorkloadConfig("64k", agents=64, lengths="varied", turns=5))
    assert max(len(t) for t in short) == 5
    longer = agent_trajectories(WorkloadConfig("64k", agents=64, lengths="varied",
                                               append_scale=3.0))
    assert max(t.prompt + t.gen for traj in longer for t in traj) <= 65_536  # still cut at MAL


def test_varied_lengths_need_a_table_2_preset():
    from dualpath.workloads.presets import agent_trajectories

    with pytest.raises(ValueError, match="Table 2 preset"):
        agent_trajectories(WorkloadConfig("tiny", agents=2, lengths="varied"))
    with pytest.raises(ValueError, match="lengths"):
        WorkloadConfig("64k", agents=2, lengths="long")
