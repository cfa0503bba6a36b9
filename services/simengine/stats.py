"""The engine's counters and latency histograms, as plain numbers.

The engine updates these on its hot path (one histogram observation per token), so they are
bare lists and ints rather than prometheus_client objects with locks; metrics.py exposes them.
Bucket bounds are vLLM's, so dashboards built for vLLM read the simulator unchanged.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort")
# vLLM's `source` label of vllm:prompt_tokens_by_source (v1/metrics/stats.PromptTokenStats).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs in that bucket (le is inclusive).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs, ending with (inf, count)."""
        out = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # In tokens, as vLLM counts them: queries = prompt tokens looked up, hits = found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # A KV connector's hits (P/D decode legs): queries = prompt tokens the local cache lacked.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Each request's prompt tokens by where its first prefill found them.
    prompt_tokens_by_source: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
    )
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
