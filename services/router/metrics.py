"""The router's metrics: plain counters on the hot path, Prometheus text on scrape.

prometheus_client takes a lock and walks its buckets on every update, and in
multiprocess mode also writes an mmap; a streamed request updates a dozen
series, so here an update is a dict operation and the Prometheus families are
built only when /metrics is read (with prometheus_client's own exposition).

Several worker processes: each worker writes a snapshot of its series to a
shared directory about once a second; the parent process serves /metrics and
merges them (counters and histograms add up; each gauge declares how workers
combine). See docs/router.md.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
SCORE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Counter:
    kind = "counter"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]):
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], n: float = 1.0) -> None:
        values = self.values
        values[key] = values.get(key, 0.0) + n

    def get(self, key: tuple[str, ...]) -> float:
        return self.values.get(key, 0.0)


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], merge: str = "sum"):
        self.name, self.doc, self.labels = name, doc, labels
        self.merge = merge  # how worker processes combine: sum | max | min
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, key: tuple[str, ...], value: float) -> None:
        self.values[key] = value


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]):
        self.name, self.doc, self.labels = name, doc, labels
        self.buckets = buckets
        # per series: one count per bucket, one for +Inf, then the sum (not cumulative)
        self.values: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        series = self.values.get(key)
        if series is None:
            series = self.values[key] = [0.0] * (len(self.buckets) + 2)
        series[bisect_left(self.buckets, value)] += 1
        series[-1] += value

    def count(self, key: tuple[str, ...]) -> float:
        series = self.values.get(key)
        return 0.0 if series is None else sum(series[:-1])


Series = Counter | Gauge | Histogram


def _family(m: Series, values: dict[tuple[str, ...], Any]) -> Metric:
    labels = list(m.labels)
    if isinstance(m, Counter):
        fam: Metric = CounterMetricFamily(m.name, m.doc, labels=labels)
        for key, v in values.items():
            fam.add_metric(list(key), v)
    elif isinstance(m, Gauge):
        fam = GaugeMetricFamily(m.name, m.doc, labels=labels)
        for key, v in values.items():
            fam.add_metric(list(key), v)
    else:
        fam = HistogramMetricFamily(m.name, m.doc, labels=labels)
        bounds = [*(repr(float(b)) for b in m.buckets), "+Inf"]
        for key, series in values.items():
            cumulative, running = [], 0.0
            for bound, c in zip(bounds, series[:-1], strict=True):
                running += c
                cumulative.append((bound, running))
            fam.add_metric(list(key), cumulative, series[-1])
    return fam


class Registry:
    """A fixed set of series; `collect` for one process, `merge` for several."""

    def __init__(self, series: Iterable[Series]):
        self.series = list(series)

    def collect(self) -> Iterator[Metric]:
        for m in self.series:
            yield _family(m, m.values)

    def snapshot(self) -> dict[str, list[list[Any]]]:
        """The values as plain data (written by each worker, read by the parent).

        A histogram's bucket list is copied: the snapshot is encoded in a thread later,
        and must hold the values as of now, like the counters beside it."""
        return {
            m.name: [[list(k), list(v) if isinstance(v, list) else v] for k, v in m.values.items()]
            for m in self.series
        }

    def merged(
        self,
        every: list[dict[str, list[list[Any]]]],
        live: list[dict[str, list[list[Any]]]],
    ) -> Iterator[Metric]:
        """Families combining workers' snapshots: counters and histograms over every
        worker that ever ran (totals never go backwards), gauges over live ones."""
        for m in self.series:
            combined: dict[tuple[str, ...], Any] = {}
            for snap in live if isinstance(m, Gauge) else every:
                for key, value in snap.get(m.name, []):
                    k = tuple(key)
                    prev = combined.get(k)
                    if prev is None:
                        combined[k] = list(value) if isinstance(value, list) else value
                    elif isinstance(m, Histogram):
                        combined[k] = [a + b for a, b in zip(prev, value, strict=True)]
                    elif isinstance(m, Gauge) and m.merge == "max":
                        combined[k] = max(prev, value)
                    elif isinstance(m, Gauge) and m.merge == "min":
                        combined[k] = min(prev, value)
                    else:
                        combined[k] = prev + value
            yield _family(m, combined)


class RequestSeries:
    """What the request path counts: answers, their latencies and tokens, retries and
    fallbacks, failed attempts, clients gone."""

    def __init__(self) -> None:
        self.requests = Counter(
            "llmgw_router_requests_total",
            "Requests answered, by model, endpoint that served it, and HTTP status "
            "(499: the client went away).",
            ("model", "endpoint", "status"),
        )
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds",
            "Time from the request's arrival to its last byte.",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Time from arrival to the first streamed event relayed to the client.",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "llmgw_router_inter_token_latency_seconds",
            "Gap between successive deliveries of streamed events from the engine.",
            ("model",),
            ITL_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "llmgw_router_prompt_tokens_total",
            "Prompt tokens, from the engine's usage (streams: when include_usage was asked).",
            ("model",),
        )
        self.completion_tokens = Counter(
            "llmgw_router_completion_tokens_total",
            "Completion tokens, from the engine's usage.",
            ("model",),
        )
        self.retries = Counter(
            "llmgw_router_retries_total",
            "Attempts on another endpoint after one failed before the first byte.",
            ("model",),
        )
        self.fallbacks = Counter(
            "llmgw_router_fallbacks_total",
            "Requests moved to a fallback model after every endpoint of a model failed.",
            ("model", "fallback"),
        )
        self.migrations = Counter(
            "llmgw_router_migrations_total",
            "Streams cut after their first byte and continued on another endpoint.",
            ("model",),
        )
        self.upstream_errors = Counter(
            "llmgw_router_upstream_errors_total",
            "Failed attempts by endpoint and kind (connect, status_5xx, headers_timeout, "
            "first_token_timeout, idle_timeout, total_timeout, broken, truncated).",
            ("endpoint", "kind"),
        )
        self.disconnects = Counter(
            "llmgw_router_client_disconnects_total",
            "Clients that went away before their answer ended (the upstream is cancelled).",
            ("model",),
        )

    def request_series(self) -> list[Series]:
        return [
            self.requests,
            self.duration,
            self.ttft,
            self.itl,
            self.prompt_tokens,
            self.completion_tokens,
            self.retries,
            self.fallbacks,
            self.migrations,
            self.upstream_errors,
            self.disconnects,
        ]


class DisaggregationSeries:
    """What the two-leg relay of a disaggregated model counts (relay/disagg.py): each
    leg's attempts, the prefill leg's duration, and the requests served another way."""

    def __init__(self) -> None:
        self.pd_legs = Counter(
            "llmgw_router_pd_legs_total",
            "Attempts of a disaggregated request's legs, by model, leg (prefill, decode, "
            "release: the decode leg re-sent for a gone client's KV) and outcome (ok, failed, "
            "refused).",
            ("model", "leg", "outcome"),
        )
        self.pd_prefill_duration = Histogram(
            "llmgw_router_pd_prefill_duration_seconds",
            "Time from a prefill leg's start to the prefill engine's answer (every attempt "
            "it took), for the prefill legs that succeeded.",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.pd_fallbacks = Counter(
            "llmgw_router_pd_fallbacks_total",
            "Requests of a disaggregated model meant for the prefill leg and served whole "
            "by a decode endpoint instead, by reason (no_prefill_endpoint, prefill_failed, "
            "prefill_refused).",
            ("model", "reason"),
        )
        self.pd_whole = Counter(
            "llmgw_router_pd_whole_total",
            "Requests of a disaggregated model that skip the prefill leg by design, by "
            "reason (short_prompt, api_kind).",
            ("model", "reason"),
        )

    def disaggregation_series(self) -> list[Series]:
        return [self.pd_legs, self.pd_prefill_duration, self.pd_fallbacks, self.pd_whole]


class SchedulingSeries:
    """What the scheduling pipeline reports of each pick (its `Observer`): the endpoints
    each filter dropped, and each scorer's value for the endpoint picked."""

    def __init__(self) -> None:
        self.scorer_value = Histogram(
            "llmgw_router_scorer_value",
            "Each scorer's value (0..1) for the endpoint that was picked.",
            ("model", "scorer"),
            SCORE_BUCKETS,
        )
        self.filter_drops = Counter(
            "llmgw_router_filter_drops_total",
            "Endpoints removed from consideration, by model and filter.",
            ("model", "filter"),
        )

    def scheduling_series(self) -> list[Series]:
        return [self.scorer_value, self.filter_drops]

    def dropped(self, model: str, filter_name: str, count: int) -> None:
        self.filter_drops.inc((model, filter_name), count)

    def scored(self, model: str, scorer_name: str, value: float) -> None:
        self.scorer_value.observe((model, scorer_name), value)


class EndpointSeries:
    """Each endpoint's state: gauges set from the view when metrics are read, and the
    counters of the scraper that reads engines' /metrics."""

    def __init__(self) -> None:
        self.scrape_errors = Counter(
            "llmgw_router_scrape_errors_total",
            "Failed scrapes of an endpoint's /metrics.",
            ("endpoint",),
        )
        self.inflight = Gauge(
            "llmgw_router_endpoint_inflight",
            "Requests this router has in flight to the endpoint.",
            ("endpoint",),
            merge="sum",
        )
        self.prefilling = Gauge(
            "llmgw_router_endpoint_prefilling",
            "Streamed requests this router has at the endpoint that have had no event yet "
            "(and prefill legs it has there): the prefill queued ahead of a new request.",
            ("endpoint",),
            merge="sum",
        )
        self.circuit = Gauge(
            "llmgw_router_endpoint_circuit_state",
            "0 closed, 1 half-open (probing), 2 open; the worst across workers.",
            ("endpoint",),
            merge="max",
        )
        self.waiting = Gauge(
            "llmgw_router_endpoint_waiting",
            "Requests waiting in the engine's queue, as last scraped.",
            ("endpoint",),
            merge="max",
        )
        self.running = Gauge(
            "llmgw_router_endpoint_running",
            "Requests running in the engine, as last scraped.",
            ("endpoint",),
            merge="max",
        )
        self.kv_usage = Gauge(
            "llmgw_router_endpoint_kv_usage",
            "Fraction of the engine's KV cache in use, as last scraped.",
            ("endpoint",),
            merge="max",
        )
        self.load_age = Gauge(
            "llmgw_router_endpoint_load_age_seconds",
            "Age of the endpoint's latest load sample (+Inf: never scraped).",
            ("endpoint",),
            merge="min",
        )
        self.scrapes = Counter(
            "llmgw_router_scrapes_total",
            "Scrapes of an endpoint's /metrics (control-plane mode: only while the agents' "
            "load samples for it are late).",
            ("endpoint",),
        )

    def endpoint_series(self) -> list[Series]:
        return [self.scrape_errors, *self._view_gauges(), self.scrapes]

    def _view_gauges(self) -> tuple[Gauge, ...]:
        """The gauges set from the view at each scrape (cleared first: gone endpoints)."""
        return (
            self.inflight,
            self.prefilling,
            self.circuit,
            self.waiting,
            self.running,
            self.kv_usage,
            self.load_age,
        )

    def set_endpoint_gauges(self, endpoints: Iterable[Any], now: float) -> None:
        """Set the per-endpoint gauges from the view (at scrape time, not per request)."""
        circuit_codes = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
        for gauge in self._view_gauges():
            gauge.values.clear()
        for ep in endpoints:
            key = (ep.id,)
            self.inflight.set(key, float(ep.inflight))
            self.prefilling.set(key, float(ep.prefilling))
            self.circuit.set(key, circuit_codes.get(ep.circuit.state, 0.0))
            load = ep.load
            if load is None:
                self.load_age.set(key, math.inf)
                continue
            self.waiting.set(key, float(load.waiting))
            self.running.set(key, float(load.running))
            self.kv_usage.set(key, load.kv_usage)
            self.load_age.set(key, max(0.0, now - load.at))


class FeedSeries:
    """The control-plane feed (controlplane/): the NATS connection, the routers seen,
    projection entries applied, and the agents' load samples."""

    def __init__(self) -> None:
        self.nats_connected = Gauge(
            "llmgw_router_nats_connected",
            "1 while connected to NATS (control-plane mode); the view is kept while 0.",
            (),
            merge="min",
        )
        self.live_routers = Gauge(
            "llmgw_router_live_routers",
            "Routers seen live in the presence bucket (quotas are divided by it).",
            (),
            merge="max",
        )
        self.projection_updates = Counter(
            "llmgw_router_projection_updates_total",
            "KV entries applied from the control plane, by bucket and op (snapshot, put, delete).",
            ("bucket", "op"),
        )
        self.load_samples = Counter(
            "llmgw_router_load_samples_total",
            "Agents' load samples received, by result: applied, unknown (no such endpoint "
            "in the view), malformed.",
            ("result",),
        )

    def feed_series(self) -> list[Series]:
        return [self.nats_connected, self.live_routers, self.projection_updates, self.load_samples]


class KvSeries:
    """The KV-event feed and index (kvcache/): event batches, snapshots asked, blocks held."""

    def __init__(self) -> None:
        self.kv_events = Counter(
            "llmgw_router_kv_events_total",
            "Relayed engine KV event batches, by result: applied, resync (a gap, a new epoch "
            "or a first batch: a snapshot is fetched), unknown (no such endpoint), foreign (its "
            "subject, payload and endpoint name different nodes: dropped), malformed.",
            ("result",),
        )
        self.kv_snapshots = Counter(
            "llmgw_router_kv_snapshots_total",
            "KV block snapshots asked of agents, by result: ok, failed (no answer in time).",
            ("result",),
        )
        self.kv_index_blocks = Gauge(
            "llmgw_router_kv_index_blocks",
            "Distinct engine blocks in this worker's KV-event index (each worker keeps one).",
            (),
            merge="max",
        )

    def kv_series(self) -> list[Series]:
        return [self.kv_events, self.kv_snapshots, self.kv_index_blocks]


class RouterMetrics(
    RequestSeries, DisaggregationSeries, SchedulingSeries, EndpointSeries, FeedSeries, KvSeries
):
    """Every series the router exposes (see docs/router.md for what each means), declared
    by the part of the router that updates them; the registry lists them in that order."""

    def __init__(self) -> None:
        RequestSeries.__init__(self)
        DisaggregationSeries.__init__(self)
        SchedulingSeries.__init__(self)
        EndpointSeries.__init__(self)
        FeedSeries.__init__(self)
        KvSeries.__init__(self)
        # Admission's series live in the same registry, so workers' snapshots merge them too.
        from llmgw.router.admission.metrics import AdmissionMetrics

        self.admission = AdmissionMetrics()
        self.registry = Registry(
            [
                *self.request_series(),
                *self.disaggregation_series(),
                *self.scheduling_series(),
                *self.endpoint_series(),
                *self.feed_series(),
                *self.kv_series(),
                *self.admission.series,
            ]
        )

    def refresh_endpoints(self, endpoints: Iterable[Any], now: float) -> None:
        """Set the gauges read at scrape time: the endpoints' from the view, admission's
        from its controller."""
        self.set_endpoint_gauges(endpoints, now)
        self.admission.refresh()
