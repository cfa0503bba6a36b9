"""Load signals: what an engine's /metrics says about its queue and KV cache.

vLLM's current names come first; `vllm:gpu_cache_usage_perc` (removed in vLLM
0.12) is the fallback for older engines; SGLang's names (only with
`--enable-metrics`) for SGLang endpoints. The page is scanned by
`llmgw.enginemetrics`, which the agent's load samples read too.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw import enginemetrics


@dataclass(frozen=True, slots=True)
class Load:
    waiting: int  # requests queued in the engine
    running: int  # requests in the running batch
    kv_usage: float  # 0..1 of the KV cache in use
    at: float  # monotonic time the sample was taken (staleness is measured from it)
    source: str = "vllm"  # which metric family it came from


def parse_metrics(text: bytes, at: float) -> Load | None:
    """The load in a Prometheus text page, or None when it reports no queue.

    A vLLM page is read by vLLM's names (its KV gauge by the current name, else the
    pre-0.11 one), any other by SGLang's (enginemetrics combines the series).
    """
    found = enginemetrics.gauges(text)
    if "vllm:num_requests_waiting" in found or "vllm:num_requests_running" in found:
        kv = found.get("vllm:kv_cache_usage_perc")
        if kv is None:
            kv = found.get("vllm:gpu_cache_usage_perc", 0.0)
        return Load(
            waiting=int(found.get("vllm:num_requests_waiting", 0)),
            running=int(found.get("vllm:num_requests_running", 0)),
            kv_usage=min(max(kv, 0.0), 1.0),
            at=at,
            source="vllm",
        )
    if "sglang:num_queue_reqs" in found or "sglang:num_running_reqs" in found:
        return Load(
            waiting=int(found.get("sglang:num_queue_reqs", 0)),
            running=int(found.get("sglang:num_running_reqs", 0)),
            kv_usage=min(max(found.get("sglang:token_usage", 0.0), 0.0), 1.0),
            at=at,
            source="sglang",
        )
    return None
