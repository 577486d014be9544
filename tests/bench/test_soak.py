"""The soak (``make soak``): a short run against a real ``dualpath serve`` of a tiny model, and
its report logic on made-up records and samples.

The tiny random Llama has no tokenizer; the server needs one to start, so the default model's
tokenizer files are copied beside it (the soak sends token ids below the tiny vocabulary, which
that tokenizer decodes like any ids). 3 agents for 10 s against 1 PE + 1 DE take about 25 s
with the server's start.
"""

from __future__ import annotations

import json
import random

import pytest

from dualpath.bench.agents.http import HttpTurnRecord
from dualpath.bench.soak.command import run_soak
from dualpath.bench.soak.load import RunLog, trajectory
from dualpath.bench.soak.report import rss_summary, summarize
from dualpath.bench.soak.settings import SoakSettings

SUMMARY_KEYS = {"ok", "errors", "requests", "ttft_p50_s", "ttft_p99_s", "latency_p50_s",
                "latency_p99_s", "rss_after_warmup_mb", "rss_end_mb", "rss_growth_after_warmup",
                "max_rss_growth_after_warmup"}


def test_a_short_soak_reports_latencies_and_every_process_rss(tiny_with_tokenizer, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("DUALPATH_CACHE_DIR", str(tmp_path / "cache"))  # the server's logs
    out = tmp_path / "results" / "soak.json"
    settings = SoakSettings(
        agents=3, duration_s=10, decode=1, model=str(tiny_with_tokenizer), json_path=str(out),
        first_tokens=64, append_tokens=16, gen_tokens=8, max_context_tokens=200, sample_s=1,
        drain_s=20, serve_sets=("engine.block_size=16", "engine.num_kv_blocks=256",
                                "host_pool_blocks=96"))
    report = run_soak(settings)
    assert out.is_file() and out.with_suffix(".png").stat().st_size > 10_000
    summary = json.loads(out.read_text())["summary"]
    assert not SUMMARY_KEYS - set(summary), SUMMARY_KEYS - set(summary)
    assert summary == report["summary"]
    assert summary["errors"] == 0 and summary["ok"], report.get("error_messages")
    assert summary["requests"] > 20  # tiny turns take well under a second each
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] < 10
    assert summary["ttft_p50_s"] < summary["latency_p50_s"] <= summary["latency_p99_s"]
    assert summary["cached_fraction"] > 0.3  # later turns hit what earlier turns stored
    assert set(summary["rss_end_mb"]) == {"serve", "pe0", "de1"}
    assert all(50 < mb < 4000 for mb in summary["rss_end_mb"].values())
    assert summary["max_rss_growth_after_warmup"] == max(
        summary["rss_growth_after_warmup"].values())
    assert len(report["rss_samples"]) >= 10 and len(report["windows"]) >= 8
    assert report["serve_exit_code"] == 0  # SIGINT stopped it cleanly


def test_trajectories_stay_under_the_context_cap():
    settings = SoakSettings(first_tokens=256, append_tokens=64, gen_tokens=16,
                            max_context_tokens=2048)
    turns = trajectory(random.Random(0), settings, vocab=1000)
    assert len(turns) == 1 + (2048 - 256 - 16) // 80
    last_prompt = 256 + (len(turns) - 1) * 80
    assert last_prompt + 16 <= 2048 < last_prompt + 80 + 16
    assert all(3 <= t < 999 for turn in turns for t in turn.new)


def _record(ok: bool, ttft_s: float = 0.1) -> HttpTurnRecord:
    return HttpTurnRecord(0, 0, 100.0, 64, 8 if ok else 0, 0, ttft_s if ok else None,
                          latency_s=0.5, error=None if ok else "boom", status=200 if ok else 503)


def test_growth_after_warmup_and_errors_decide_ok():
    samples = [{"t_s": t, "rss_mb": {"serve": 100.0 + t, "de1": 200.0}} for t in range(11)]
    memory = rss_summary(samples, warm_s=2.0)
    assert memory["serve"] == {"after_warmup_mb": 102.0, "end_mb": 110.0,
                               "growth": pytest.approx(8 / 102),
                               "growth_last_half": pytest.approx(4 / 106)}  # from t = 6 s
    assert memory["de1"]["growth"] == memory["de1"]["growth_last_half"] == 0.0
    settings = SoakSettings(duration_s=10, max_rss_growth=0.10)
    log = RunLog(100.0, [_record(True), _record(True, 0.3)], samples)
    assert summarize(log, settings)["ok"]
    assert not summarize(log, SoakSettings(duration_s=10, max_rss_growth=0.05))["ok"]
    failed = RunLog(100.0, [_record(True), _record(False)], samples)
    summary = summarize(failed, settings)
    assert not summary["ok"] and summary["errors"] == 1 and summary["requests"] == 2
