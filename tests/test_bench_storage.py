"""``dualpath bench storage`` runs end to end and writes its summary."""

from __future__ import annotations

import json

import pytest

from dualpath.cli import main


def test_bench_storage_writes_summary(smollm2_dir, tmp_path):
    out = tmp_path / "storage.json"
    args = ["bench", "storage", "--json", str(out), "--dir", str(tmp_path / "store"),
            "--blocks", "8", "--rounds", "1", "--chunk-blocks", "4"]
    assert main(args) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["read_gb_s"] > 0 and summary["write_gb_s"] > 0
    assert summary["read_ratio_vs_raw"] > 0
    assert not (tmp_path / "store").exists()  # cleaned up
    assert out.with_suffix(".png").is_file()


def test_bench_storage_mooncake_store_reads_beside_fs(smollm2_dir, tmp_path):
    pytest.importorskip("mooncake.store", reason="the mooncake package is not installed")
    out = tmp_path / "storage.json"
    args = ["bench", "storage", "--json", str(out), "--dir", str(tmp_path / "store"),
            "--blocks", "8", "--rounds", "1", "--chunk-blocks", "4",
            "--backends", "fs,mooncake_store"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["read_gb_s_fs"] > 0 and summary["read_gb_s_mooncake_store"] > 0
    assert summary["write_gb_s_mooncake_store"] > 0
    assert summary["read_ratio_mooncake_store_vs_fs"] == pytest.approx(
        summary["read_gb_s_mooncake_store"] / summary["read_gb_s_fs"])
    assert summary["read_gb_s"] == summary["read_gb_s_fs"]  # fs keeps its original names
    assert result["setup"]["backends"] == ["fs", "mooncake_store"]
    assert not (tmp_path / "store").exists()  # cleaned up, the Mooncake logs with it


def test_bench_storage_mooncake_store_backends_are_checked():
    from dualpath.bench.storage import parse_backends

    assert parse_backends("fs, mooncake_store,fs") == ["fs", "mooncake_store"]
    with pytest.raises(ValueError, match="unknown"):
        parse_backends("fs,s3")
