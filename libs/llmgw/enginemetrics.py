"""The load gauges on an engine's Prometheus /metrics page: vLLM and SGLang names. Pure.

Read by the agent (its load samples) and by the router (fallback scraping). A
vLLM page is tens of kilobytes of histograms, read several times a second per
engine, so this is no exposition parser: one compiled regular expression picks
out the few gauges wanted. Series of one gauge with different labels
(data-parallel engines, several served names) are combined: counts add up, KV
use takes the fullest cache, which is what a new request meets.
"""

from __future__ import annotations

import re

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# vllm:gpu_cache_usage_perc is the name before vLLM 0.11 (removed in 0.12); all are 0..1.
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage", "vllm:gpu_cache_usage_perc")

_LINE = re.compile(
    rb"^("
    + b"|".join(re.escape(n.encode()) for n in (*RUNNING, *WAITING, *KV_USAGE))
    + rb")(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)
_MAXED = frozenset(n.encode() for n in KV_USAGE)


def gauges(text: bytes) -> dict[str, float]:
    """The load gauges the page has, by name, each gauge's series combined; NaN and
    values that are not numbers are skipped."""
    found: dict[bytes, float] = {}
    for m in _LINE.finditer(text):
        name = m.group(1)
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        if name in _MAXED:
            found[name] = max(found.get(name, 0.0), value)
        else:
            found[name] = found.get(name, 0.0) + value
    return {name.decode(): value for name, value in found.items()}
