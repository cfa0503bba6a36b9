"""Engine load from a Prometheus /metrics page: vLLM and SGLang names. Pure.

A lean line scanner rather than a full exposition parser: it runs several times a
second per engine and needs a handful of gauges out of pages with hundreds of
histogram lines. Series of one metric with different labels (data-parallel
engines, several served names) are combined: counts add up, KV use takes the
worst engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# vllm:gpu_cache_usage_perc is the name before vLLM 0.11 (removed in 0.12); all are 0..1.
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage", "vllm:gpu_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"
_WANTED = frozenset((*RUNNING, *WAITING, *KV_USAGE, CACHE_INFO))


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    block_size: int = 0
    num_blocks: int = 0


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return int(float(labels.get(name, "")))
    except ValueError:
        return 0


def parse_load(text: str) -> Load | None:
    """The load an engine reports, or None when the page has none of the known gauges."""
    series: dict[str, list[float]] = {}
    block_size = num_blocks = 0
    for line in text.splitlines():
        if not line.startswith(("vllm:", "sglang:")):
            continue
        m = _LINE.match(line)
        if m is None or m["name"] not in _WANTED:
            continue
        if m["name"] == CACHE_INFO:
            labels = dict(_LABEL.findall(m["labels"] or ""))
            block_size = block_size or _int_label(labels, "block_size")
            num_blocks += _int_label(labels, "num_gpu_blocks")
            continue
        value = _number(m["value"])
        if value is not None:
            series.setdefault(m["name"], []).append(value)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((series[n] for n in names if n in series), None)

    running, waiting, kv = first(RUNNING), first(WAITING), first(KV_USAGE)
    if running is None and waiting is None and kv is None:
        return None
    return Load(
        running=round(sum(running or ())),
        waiting=round(sum(waiting or ())),
        kv_usage=min(1.0, max(kv or (0.0,))),
        block_size=block_size,
        num_blocks=num_blocks,
    )
