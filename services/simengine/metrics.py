"""vLLM's Prometheus metrics, read from the engine at scrape time.

A collector in the simulator's own CollectorRegistry turns the engine's plain counters into
metric families on each scrape, so the token hot path pays nothing for Prometheus. Names, types
and labels follow vLLM (v1 engine): `model_name` is the first served name, `engine` is "0".
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from llmgw.simengine.engine import Engine
from llmgw.simengine.lora import Adapters
from llmgw.simengine.stats import FINISHED_REASONS, PROMPT_TOKEN_SOURCES, Histogram

LABELS = ["model_name", "engine"]


def _adapter_names(reqs) -> str:
    """vLLM's label value: the distinct adapters of these requests, comma-separated."""
    return ",".join(dict.fromkeys(r.lora_name for r in reqs if r.lora_name))


class EngineCollector:
    def __init__(self, engine: Engine, model_name: str, adapters: Adapters | None = None):
        self.engine = engine
        self.values = [model_name, "0"]
        self.adapters = adapters

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.values, value)
        return c

    def _histogram(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=LABELS)
        buckets = [(floatToGoString(bound), count) for bound, count in h.cumulative()]
        fam.add_metric(self.values, buckets, sum_value=h.sum)
        return fam

    def _lora(self) -> Iterator[Metric]:
        """vLLM's adapter gauge (no model_name or engine label there, and its value the
        time it was set), then the simulator's own load and eviction counts."""
        a = self.adapters
        if a is None or not a.enabled:
            return
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        e = self.engine
        info.add_metric(
            [str(a.max_loras), _adapter_names(e.waiting), _adapter_names(e.running)], time.time()
        )
        yield info
        yield CounterMetricFamily(
            "llmgw_sim_lora_loads",
            "LoRA adapters loaded into a slot, by the API or by a request",
            a.loads,
        )
        yield CounterMetricFamily(
            "llmgw_sim_lora_evictions",
            "LoRA adapters evicted from a slot to make room for another",
            a.evictions,
        )
        yield GaugeMetricFamily(
            "llmgw_sim_lora_resident", "LoRA adapters in a slot now", len(a.resident)
        )

    def collect(self) -> Iterator[Metric]:
        yield from self._lora()
        e = self.engine
        s = e.stats
        p = e.params
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(e.running),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(e.waiting),
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            e.pool.used / e.pool.num_blocks,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [*self.values, str(p.block_size), str(p.num_blocks), str(p.enable_prefix_caching)], 1
        )
        yield info
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            s.external_prefix_cache_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            s.external_prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        for reason in FINISHED_REASONS:
            success.add_metric([*self.values, reason], s.finished[reason])
        yield success
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*LABELS, "source"],
        )
        for source in PROMPT_TOKEN_SOURCES:
            by_source.add_metric([*self.values, source], s.prompt_tokens_by_source[source])
        yield by_source
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        yield self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            s.ttft,
        )
        yield self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            s.itl,
        )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            s.e2e,
        )


def build_registry(
    engine: Engine, model_name: str, adapters: Adapters | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name, adapters))
    return registry
