"""Admission metrics, in the router's own series types (llmgw.router.metrics).

Counters and the wait histogram are plain dict updates on the request path;
queue depths, saturation, outstanding grants and capacity are gauges set from
the controller only when metrics are read (`refresh`), so they cost nothing
per request. With several worker processes the router merges the series like
its own: counters add up, gauges combine as each one declares.
"""

from __future__ import annotations

from llmgw.router.metrics import Counter, Gauge, Histogram

from .controller import Controller, Metrics

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdmissionMetrics(Metrics):
    def __init__(self) -> None:
        self.admitted_total = Counter(
            "llmgw_admission_admitted_total",
            "Requests admitted, by band, tenant and path (direct: flowed at once; "
            "queued: waited for capacity).",
            ("band", "tenant", "path"),
        )
        self.rejected_total = Counter(
            "llmgw_admission_rejected_total",
            "Requests refused by admission, by reason: missing_api_key, invalid_api_key, "
            "rate_limit_rpm, rate_limit_tpm, rate_limit_concurrency, request_too_large, "
            "queue_full, queue_timeout.",
            ("band", "tenant", "reason"),
        )
        self.cancelled_total = Counter(
            "llmgw_admission_cancelled_total",
            "Queued requests whose client disconnected before they were admitted.",
            ("band", "tenant"),
        )
        self.wait = Histogram(
            "llmgw_admission_wait_seconds",
            "Time from the quota check to admission (0 for requests that flowed at once).",
            ("band",),
            WAIT_BUCKETS,
        )
        self.queue_depth = Gauge(
            "llmgw_admission_queue_depth",
            "Requests waiting for admission.",
            ("model", "band"),
            merge="sum",
        )
        self.saturation = Gauge(
            "llmgw_admission_pool_saturation",
            "Pool saturation 0-1: the worse of queued work and KV use against their thresholds.",
            ("model",),
            merge="max",
        )
        self.outstanding = Gauge(
            "llmgw_admission_outstanding_grants",
            "Requests admitted and not yet finished (dispatched or still on their way).",
            ("model",),
            merge="sum",
        )
        self.capacity = Gauge(
            "llmgw_admission_endpoint_capacity",
            "Batch capacity per endpoint: max_running hint or the capacity learned from running.",
            ("endpoint",),
            merge="max",
        )
        self.routers = Gauge(
            "llmgw_admission_routers",
            "Routers (times worker processes) sharing global quotas and engine capacity.",
            (),
            merge="max",
        )
        self.controller: Controller | None = None  # bound when the router builds its gate
        self.series = [
            self.admitted_total,
            self.rejected_total,
            self.cancelled_total,
            self.wait,
            self.queue_depth,
            self.saturation,
            self.outstanding,
            self.capacity,
            self.routers,
        ]

    def admitted(self, band: str, tenant: str, waited: float | None) -> None:
        self.admitted_total.inc((band, tenant, "direct" if waited is None else "queued"))
        self.wait.observe((band,), waited or 0.0)

    def rejected(self, band: str, tenant: str, reason: str) -> None:
        self.rejected_total.inc((band, tenant, reason))

    def cancelled(self, band: str, tenant: str) -> None:
        self.cancelled_total.inc((band, tenant))

    def refresh(self) -> None:
        """Set the gauges from the controller's state (when metrics are read)."""
        for gauge in (self.queue_depth, self.saturation, self.outstanding, self.capacity):
            gauge.values.clear()
        controller = self.controller
        if controller is None:
            return
        for key, depth in controller.queue_depths().items():
            self.queue_depth.set(key, float(depth))
        detector = controller.detector
        for model, pool in detector.pools.items():
            self.saturation.set((model,), controller.saturation(model))
            self.outstanding.set((model,), float(pool.active))
            for ep in pool.endpoints:
                self.capacity.set((ep.id,), float(detector.capacity(ep)))
        self.routers.set((), float(controller.routers))
