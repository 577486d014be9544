"""``dualpath bench transfer`` runs end to end (two processes, Mooncake) and writes its summary."""

from __future__ import annotations

import json

import pytest

from dualpath.cli import main


def test_bench_transfer_writes_summary(smollm2_dir, tmp_path):
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", "--json", str(out), "--blocks", "2", "--repeats", "1"]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["large_gb_s"] > 0 and summary["layer_block_gb_s"] > 0
    assert summary["layer_block_ratio_vs_large"] == pytest.approx(
        summary["layer_block_gb_s"] / summary["large_gb_s"])
    assert summary["per_block_segments_gb_s"] > 0 and summary["large_tm_gb_s"] > 0
    assert result["setup"]["segments"] == 2 * result["setup"]["layers"]
    assert out.with_suffix(".png").is_file()
