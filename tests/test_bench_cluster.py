"""``dualpath bench cluster``: agents replay turns on a real local cluster, JCT per mode."""

from __future__ import annotations

import json

import pytest

from dualpath.bench.cluster import make_trajectories
from dualpath.bench.netns import netns_unavailable
from dualpath.cli import main


def test_trajectories_are_random_and_reproducible():
    a = make_trajectories(3, 4, first=20, append=7, vocab=300, seed=1)
    assert a == make_trajectories(3, 4, first=20, append=7, vocab=300, seed=1)
    assert len(a) == 3 and all(len(first) == 20 and len(app) == 3 for first, app in a)
    assert a[0][0] != a[1][0]


def test_bench_cluster_runs_basic_and_dualpath(tiny_llama_dir, tmp_path, capsys):
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
    table = capsys.readouterr().out
    assert "bench cluster" in table and "dualpath" in table and "/ basic" in table


@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_bench_cluster_netns_links_caps_and_shaped_side_by_side(tiny_llama_dir, tmp_path):
    out = tmp_path / "links.json"
    args = ["bench", "cluster", "--json", str(out), "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--block-size", "16", "--agents", "2", "--turns", "2",
            "--first", "40", "--append", "20", "--gen", "4", "--read-cap-mb-s", "5",
            "--compute-cap-mb-s", "40", "--links", "caps,shaped"]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert {(r["links"], r["mode"]) for r in data["rows"]} == {
        (k, m) for k in ("caps", "shaped") for m in ("basic", "dualpath")}
    for row in data["rows"]:
        assert row["turns"] == 4 and row["hit_tokens"] > 0
        pe = next(m for m in row["metrics"].values() if m["role"] == "prefill")
        capped_in_software = pe["cnic_send_utilization"] is not None
        assert capped_in_software == (row["links"] == "caps"), (row["links"], pe)
    summary = data["summary"]
    assert summary["dualpath_vs_basic_jct_ratio_caps"] > 0
    assert summary["dualpath_vs_basic_jct_ratio_shaped"] > 0
    assert "tc tbf" in data["links"]["shaped"]


def test_bench_cluster_rejects_unknown_link_kinds(tiny_llama_dir, tmp_path, capsys):
    args = ["bench", "cluster", "--model", str(tiny_llama_dir), "--links", "caps,fibre"]
    assert main(args) == 2
    assert "--links takes local, caps, shaped" in capsys.readouterr().err


@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_bench_cluster_netns_shaped_storage_links_to_a_mooncake_store_host(tiny_llama_dir,
                                                                         tmp_path):
    out = tmp_path / "store.json"
    args = ["bench", "cluster", "--json", str(out), "--model", str(tiny_llama_dir),
            "--dtype", "float32", "--block-size", "16", "--agents", "2", "--turns", "2",
            "--first", "40", "--append", "20", "--gen", "4", "--read-cap-mb-s", "5",
            "--compute-cap-mb-s", "40", "--links", "shaped", "--modes", "dualpath",
            "--storage-backend", "mooncake_store"]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert "storage links to the store host shaped" in data["links"]["shaped"]
    (row,) = data["rows"]
    assert row["hit_tokens"] > 0  # the blocks went to the store host and came back
    for metrics in row["metrics"].values():
        assert metrics["storage_snic_read_utilization"] is None  # the link caps it
