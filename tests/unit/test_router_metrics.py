"""Metrics: Prometheus exposition, and merging several workers' snapshots."""

import math

from prometheus_client.parser import text_string_to_metric_families

from llmgw.router.http.admin import _exposition
from llmgw.router.metrics import RouterMetrics


def samples(collect):
    text = _exposition(collect).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_exposition_is_valid_prometheus_text_with_cumulative_buckets():
    m = RouterMetrics()
    m.requests.inc(("m", "e1", "200"))
    m.requests.inc(("m", "e1", "200"))
    m.ttft.observe(("m",), 0.003)
    m.ttft.observe(("m",), 0.2)
    s = samples(m.registry.collect)
    assert (
        s[("llmgw_router_requests_total", (("endpoint", "e1"), ("model", "m"), ("status", "200")))]
        == 2
    )
    assert (
        s[("llmgw_router_time_to_first_token_seconds_bucket", (("le", "0.005"), ("model", "m")))]
        == 1
    )
    assert (
        s[("llmgw_router_time_to_first_token_seconds_bucket", (("le", "0.25"), ("model", "m")))]
        == 2
    )
    assert s[("llmgw_router_time_to_first_token_seconds_count", (("model", "m"),))] == 2


def test_workers_merge_counters_over_every_worker_and_gauges_over_live_ones():
    a, b = RouterMetrics(), RouterMetrics()
    a.requests.inc(("m", "e1", "200"), 3)
    b.requests.inc(("m", "e1", "200"), 4)
    a.itl.observe(("m",), 0.01)
    b.itl.observe(("m",), 0.01)
    a.inflight.set(("e1",), 2)
    b.inflight.set(("e1",), 5)
    a.load_age.set(("e1",), math.inf)
    b.load_age.set(("e1",), 0.1)
    every = [a.registry.snapshot(), b.registry.snapshot()]
    merged = samples(lambda: RouterMetrics().registry.merged(every, every))
    assert (
        merged[
            ("llmgw_router_requests_total", (("endpoint", "e1"), ("model", "m"), ("status", "200")))
        ]
        == 7
    )
    assert merged[("llmgw_router_inter_token_latency_seconds_count", (("model", "m"),))] == 2
    assert merged[("llmgw_router_endpoint_inflight", (("endpoint", "e1"),))] == 7
    assert merged[("llmgw_router_endpoint_load_age_seconds", (("endpoint", "e1"),))] == 0.1
    only_b = samples(lambda: RouterMetrics().registry.merged(every, every[1:]))
    assert only_b[("llmgw_router_endpoint_inflight", (("endpoint", "e1"),))] == 5
    assert (
        only_b[
            ("llmgw_router_requests_total", (("endpoint", "e1"), ("model", "m"), ("status", "200")))
        ]
        == 7
    )
