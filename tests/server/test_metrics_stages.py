"""``/metrics``' time-to-first-token stages (``server/metrics.py: observe_stages``): queued,
storage read, prefill compute and first-token delivery, from the router's timeline."""

from __future__ import annotations

import pytest

from dualpath.server.metrics import ServeMetrics
from dualpath.server.router.types import timeline

STAGES = ("request_queue_time_seconds", "request_storage_read_time_seconds",
          "request_prefill_time_seconds", "request_first_token_delivery_seconds")


def sums(metrics: ServeMetrics) -> dict[str, float]:
    """Each stage histogram's sum, by stage name."""
    return {name: metrics.registry.get_sample_value(f"dualpath:{name}_sum") or 0.0
            for name in STAGES}


def test_the_stages_add_up_to_the_time_to_first_token_the_caller_saw():
    marks = {"submitted": 10.0, "dispatched": 10.5, "buffer_ready": 12.0, "prefilled": 13.5}
    timings = timeline(marks, {"wait_s": 0.25, "read_s": 0.5, "forward_s": 0.5})
    metrics = ServeMetrics()
    metrics.observe_stages(timings, ttft_s=4.0)  # the API saw the token 0.5 s after the router
    got = sums(metrics)
    assert got["request_queue_time_seconds"] == pytest.approx(0.75)
    assert got["request_storage_read_time_seconds"] == pytest.approx(2.0)
    assert got["request_prefill_time_seconds"] == pytest.approx(0.5)
    assert got["request_first_token_delivery_seconds"] == pytest.approx(4.0 - 3.25)
    assert sum(got.values()) == pytest.approx(4.0)


def test_a_request_with_no_first_token_observes_no_stage():
    metrics = ServeMetrics()
    metrics.observe_stages(timeline({"submitted": 1.0}, {}), ttft_s=None)
    assert all(metrics.registry.get_sample_value(f"dualpath:{name}_count") == 0
               for name in STAGES)


def test_without_the_apis_own_time_the_router_timeline_is_the_whole():
    timings = timeline({"submitted": 0.0, "dispatched": 1.0, "buffer_ready": 2.0,
                        "prefilled": 4.0}, {"forward_s": 1.5})
    metrics = ServeMetrics()
    metrics.observe_stages(timings, ttft_s=None)
    assert sum(sums(metrics).values()) == pytest.approx(4.0)
