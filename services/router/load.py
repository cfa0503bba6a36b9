"""Load signals: what an engine's /metrics says about its queue and KV cache.

vLLM's current names come first; `vllm:gpu_cache_usage_perc` (removed in vLLM
0.12) is the fallback for older engines; SGLang's names (only with
`--enable-metrics`) for SGLang endpoints. A vLLM /metrics page is tens of
kilobytes of histograms, so the parser does not build a full Prometheus model:
one compiled regular expression picks out the few gauges it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    waiting: int  # requests queued in the engine
    running: int  # requests in the running batch
    kv_usage: float  # 0..1 of the KV cache in use
    at: float  # monotonic time the sample was taken (staleness is measured from it)
    source: str = "vllm"  # which metric family it came from


_NAMES = (
    b"vllm:num_requests_waiting",
    b"vllm:num_requests_running",
    b"vllm:kv_cache_usage_perc",
    b"vllm:gpu_cache_usage_perc",
    b"sglang:num_queue_reqs",
    b"sglang:num_running_reqs",
    b"sglang:token_usage",
)
_LINE = re.compile(
    rb"^(" + b"|".join(re.escape(n) for n in _NAMES) + rb")(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


def parse_metrics(text: bytes, at: float) -> Load | None:
    """The load in a Prometheus text page, or None when it has none of the known gauges.

    Several series of one gauge (one per engine or model label) are summed for
    counts and maxed for KV usage: the fullest cache is what a new request meets.
    """
    found: dict[bytes, float] = {}
    for m in _LINE.finditer(text):
        name = m.group(1)
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        if name.endswith((b"perc", b"usage")):
            found[name] = max(found.get(name, 0.0), value)
        else:
            found[name] = found.get(name, 0.0) + value
    if not found:
        return None
    if b"vllm:num_requests_waiting" in found or b"vllm:num_requests_running" in found:
        kv = found.get(b"vllm:kv_cache_usage_perc")
        if kv is None:
            kv = found.get(b"vllm:gpu_cache_usage_perc", 0.0)
        return Load(
            waiting=int(found.get(b"vllm:num_requests_waiting", 0)),
            running=int(found.get(b"vllm:num_requests_running", 0)),
            kv_usage=min(max(kv, 0.0), 1.0),
            at=at,
            source="vllm",
        )
    if b"sglang:num_queue_reqs" in found or b"sglang:num_running_reqs" in found:
        return Load(
            waiting=int(found.get(b"sglang:num_queue_reqs", 0)),
            running=int(found.get(b"sglang:num_running_reqs", 0)),
            kv_usage=min(max(found.get(b"sglang:token_usage", 0.0), 0.0), 1.0),
            at=at,
            source="sglang",
        )
    return None
