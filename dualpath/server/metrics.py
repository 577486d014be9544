"""``/metrics``: Prometheus metrics of the server and the cluster behind it.

Names follow vLLM's where one exists (``time_to_first_token_seconds``,
``e2e_request_latency_seconds``, ``num_requests_running`` …) under the ``dualpath:`` prefix.
Request-level series are updated by the API handlers as requests run; cluster-level ones are
read at scrape time from the router's own accounting, its engines' last heartbeats and their
counters (storage bytes and errors per node, compute-NIC bytes per lane per engine). A scrape
never fails for the cluster's sake: without a router thread, or when the router or an engine
does not answer, the page has what could be read (logged), down to the request-level series.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dualpath.server.router.client import Router
    from dualpath.sessions import Session

log = logging.getLogger("dualpath.metrics")
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
# timeline stage -> (series name, what it holds)
TTFT_STAGES = {
    "queue_s": ("queue_time", "queued for placement and for the prefill engine"),
    "read_s": ("storage_read_time", "the hit's storage read (decode engine's, then prefill "
               "engine's)"),
    "prefill_s": ("prefill_time", "the prefill engine's forwards"),
    "delivery_s": ("first_token_delivery", "the rest, from the last forward to the caller "
                   "(messages, loops)"),
}
STORAGE_KEYS = ("snic_read_bytes", "snic_write_bytes", "read_errors", "write_errors",
                "read_deadline_misses", "corrupt", "misses", "hits", "blocks_evicted",
                "live_blocks_evicted", "ended_blocks_evicted", "live_evicted_before_ended",
                "warm_hits", "warm_damaged", "warm_kept_blocks", "warm_sessions_dropped",
                "warm_prefetch_used", "warm_prefetch_wasted", "prefetch_blocks_read")


class ServeMetrics:
    """Every series the server exports, in a registry of its own."""

    def __init__(self, router: Router | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dualpath:requests", "Requests by outcome (finished, failed, "
                                "aborted, timed_out, rejected)", ["outcome"], registry=r)
        self.ttft = Histogram("dualpath:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tt2t = Histogram("dualpath:time_to_second_token_seconds",
                              "Time from the first to the second token",
                              buckets=TOKEN_BUCKETS_S, registry=r)
        self.tpot = Histogram("dualpath:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=TOKEN_BUCKETS_S, registry=r)
        self.e2e = Histogram("dualpath:e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("dualpath:prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("dualpath:prompt_tokens_cached",
                                     "Prompt tokens whose KV came from storage", registry=r)
        self.computed_tokens = Counter("dualpath:prompt_tokens_computed",
                                       "Prompt tokens the prefill engines computed", registry=r)
        self.generation_tokens = Counter("dualpath:generation_tokens", "Generated tokens",
                                         registry=r)
        # where each request's time to first token went (the router's timeline; vLLM names the
        # first and third request_queue_time_seconds and request_prefill_time_seconds)
        self.stages = {stage: Histogram(f"dualpath:request_{name}_seconds",
                                        f"Time to first token: {what}",
                                        buckets=LATENCY_BUCKETS_S, registry=r)
                       for stage, (name, what) in TTFT_STAGES.items()}
        self.session_requests = Counter(
            "dualpath:session_requests", "Requests naming an agent session, by where the id "
            "came from (header: X-Session-ID or x-dynamo-session-id; body: session_id)",
            ["source"], registry=r)
        self.agent_hints = Counter("dualpath:agent_hints", "Requests carrying each agent hint",
                                   ["hint"], registry=r)
        self.read_paths = Counter("dualpath:read_path_choices",
                                  "Read path of finished requests", ["path"], registry=r)
        if router is not None:
            r.register(ClusterCollector(router))

    def count_session(self, session: Session | None) -> None:
        """Count a request's session and the hints it carries."""
        if session is None:
            return
        self.session_requests.labels(session.source).inc()
        for name in session.hint.names() if session.hint is not None else ():
            self.agent_hints.labels(name).inc()

    def observe_stages(self, timings: dict[str, float], ttft_s: float | None) -> None:
        """Split one request's time to first token by stage: ``timings`` is its router timeline
        (``router/types.py: timeline``), ``ttft_s`` what the API measured (None: no token)."""
        if "ttft_s" not in timings:
            return  # no complete timeline (the request never reached its first token)
        computed_s = timings["queue_s"] + timings["read_s"] + timings["prefill_s"]
        total_s = timings["ttft_s"] if ttft_s is None else max(ttft_s, timings["ttft_s"])
        for stage in ("queue_s", "read_s", "prefill_s"):
            self.stages[stage].observe(timings[stage])
        self.stages["delivery_s"].observe(max(0.0, total_s - computed_s))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class RequestTimer:
    """One request's token times, turned into histogram observations."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics
        self.start_s = time.monotonic()
        self.first_s: float | None = None
        self.second_s: float | None = None
        self.ttft_s: float | None = None
        self.num_tokens = 0

    def tokens(self, count: int) -> None:
        """``count`` new tokens arrived now."""
        now = time.monotonic()
        if self.first_s is None and count:
            self.first_s = now
            self.ttft_s = now - self.start_s
            self.metrics.ttft.observe(self.ttft_s)
            count -= 1
            self.num_tokens += 1
        if self.second_s is None and count:
            self.second_s = now
            self.metrics.tt2t.observe(now - self.first_s)  # type: ignore[operator]
        self.num_tokens += count

    def done(self) -> None:
        """The request finished."""
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.start_s)
        if self.first_s is not None and self.num_tokens > 1:
            self.metrics.tpot.observe((now - self.first_s) / (self.num_tokens - 1))


class ClusterCollector(Collector):
    """Scrape-time series from the router and its engines."""

    def __init__(self, router: Router, timeout_s: float = 2.0) -> None:
        self.router = router
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if not self.router.alive:
            log.warning("metrics: the router thread is not running: no cluster series")
            return
        try:
            counters = self.router.counters()
            ages = self.router.heartbeat_ages()
        except Exception as exc:  # a stuck router: its queries time out
            log.warning("metrics: the router did not answer (%r): no cluster series", exc)
            return
        yield _gauge("dualpath:num_requests_waiting", "Requests queued for placement",
                     counters["queued"])
        yield _gauge("dualpath:num_requests_running", "Requests placed on engines",
                     counters["requests"] - counters["queued"])
        yield _gauge("dualpath:read_queue_tokens", "Tokens the router has queued for reading",
                     counters["read_queue_tokens"])
        yield _counter("dualpath:router_dropped_messages", "Late or unknown engine messages",
                       counters["dropped_messages"])
        yield _counter("dualpath:router_corrected_requests",
                       "Requests an engine lost track of, placed again", counters["corrected"])
        yield _counter("dualpath:router_moved_streams",
                       "Streams moved off a lost or failing decode engine", counters["moved"])
        yield _counter("dualpath:router_local_prefills",
                       "Agent turns prefilled on the decode engine where their session is warm",
                       counters["local_prefills"])
        yield _gauge("dualpath:router_fenced_buffers",
                     "Decode buffers kept from reuse until their writer is known to have stopped",
                     counters["fences"])
        family = GaugeMetricFamily("dualpath:heartbeat_age_seconds",
                                   "Seconds since each engine's last heartbeat",
                                   labels=["engine"])
        for name, age in ages.items():
            family.add_metric([name], age)
        yield family
        try:
            engines = self.router.collect_metrics(self.timeout_s)
        except Exception as exc:  # an engine that did not answer in time, a router gone since
            log.warning("metrics: the engine counters could not be collected (%r); the page "
                        "has the router's series only", exc)
            return
        yield from self._engine_counters(engines)

    def _engine_counters(self, engines: dict[str, dict]) -> Iterator[CounterMetricFamily]:
        storage = CounterMetricFamily("dualpath:storage", "Storage counters per node "
                                      "(bytes read and written, errors, misses)",
                                      labels=["engine", "node", "counter"])
        lanes = CounterMetricFamily("dualpath:compute_nic_lane_bytes",
                                    "Compute-NIC bytes per QoS lane per engine",
                                    labels=["engine", "lane"])
        for name, values in engines.items():
            node = str(values.get("node_id", ""))
            for key in STORAGE_KEYS:
                value = values.get(f"storage_{key}")
                if isinstance(value, int | float):
                    storage.add_metric([name, node, key], value)
            for key, value in values.items():
                if key.startswith("lane_bytes_") and isinstance(value, int | float):
                    lanes.add_metric([name, key.removeprefix("lane_bytes_")], value)
        yield storage
        yield lanes


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
