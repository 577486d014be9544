"""``dualpath bench cluster``: agents replay turns on a real local cluster, JCT per mode."""

from __future__ import annotations

import json

from dualpath.bench.cluster import make_trajectories
from dualpath.cli import main


def test_trajectories_are_random_and_reproducible():
    a = make_trajectories(3, 4, first=20, append=7, vocab=300, seed=1)
    assert a == make_trajectories(3, 4, first=20, append=7, vocab=300, seed=1)
    assert len(a) == 3 and all(len(first) == 20 and len(app) == 3 for first, app in a)
    assert a[0][0] != a[1][0]


def test_bench_cluster_runs_basic_and_dualpath(tiny_llama_dir, tmp_path):
    out = tmp_path / "cluster.json"
    args = ["bench", "cluster", "--json", str(out), "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--block-size", "16", "--agents", "2", "--turns", "3",
            "--first", "40", "--append", "20", "--gen", "4", "--read-cap-mb-s", "5",
            "--dir", str(tmp_path / "work")]
    assert main(args) == 0
    data = json.loads(out.read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"basic", "dualpath"}
    for row in rows.values():
        assert row["turns"] == 6 and row["jct_s"] > 0
        assert row["hit_tokens"] > 0  # later turns load their context from storage
    assert data["summary"]["dualpath_vs_basic_jct_ratio"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # cleaned unless --keep
