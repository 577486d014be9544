"""``dualpath bench storage`` runs end to end and writes its summary."""

from __future__ import annotations

import json

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
