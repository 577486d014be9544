"""``dualpath bench engine`` runs end to end and writes its summary and chart."""

from __future__ import annotations

import json

from dualpath.cli import main


def test_bench_engine_writes_summary(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "engine", "--json", str(out), "--model", str(tiny_llama_dir),
            "--prompt-tokens", "48", "--decode-batches", "1,4", "--decode-tokens", "4",
            "--decode-prompt-tokens", "16", "--repeats", "1", "--dtype", "float32"]
    assert main(args) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    for key in ("prefill_ratio_vs_transformers", "decode_ratio_vs_transformers_b4"):
        assert summary[key] > 0
    assert set(result["measured"]) == {"dualpath", "transformers"}
    assert out.with_suffix(".png").stat().st_size > 1000
