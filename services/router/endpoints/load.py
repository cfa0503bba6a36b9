"""Load signals: what an engine's /metrics says about its queue and KV cache.

The page is parsed by `llmgw.enginemetrics`, the parser the agent's load samples
use too (vLLM's names, their pre-0.11 fallback, SGLang's).
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
    # The LoRA adapters of the engine's running and of its waiting requests (vLLM's
    # vllm:lora_requests_info, as agents report it): what lora_affinity reads.
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()


def parse_metrics(text: bytes, at: float) -> Load | None:
    """The load in a Prometheus text page, or None when it reports no queue
    (`llmgw.enginemetrics` reads it, as it does for the agent)."""
    found = enginemetrics.parse(text)
    if found is None or not found.source:
        return None
    return Load(
        waiting=found.waiting,
        running=found.running,
        kv_usage=found.kv_usage,
        at=at,
        source=found.source,
    )
