"""Engine load from a Prometheus /metrics page: vLLM and SGLang names. Pure.

The gauges are scanned by `llmgw.enginemetrics` (the router's fallback scraping
reads them the same way); vLLM's cache_config_info adds the KV geometry, whose
series add up across data-parallel engines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.enginemetrics import KV_USAGE, RUNNING, WAITING, gauges

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}\n]*)\}", re.MULTILINE)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    block_size: int = 0
    num_blocks: int = 0


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return int(float(labels.get(name, "")))
    except ValueError:
        return 0


def parse_load(text: str) -> Load | None:
    """The load an engine reports, or None when the page has none of the known gauges."""
    found = gauges(text.encode())

    def first(names: tuple[str, ...]) -> float | None:
        return next((found[n] for n in names if n in found), None)

    running, waiting, kv = first(RUNNING), first(WAITING), first(KV_USAGE)
    if running is None and waiting is None and kv is None:
        return None
    block_size = num_blocks = 0
    for m in _CACHE_INFO.finditer(text):
        labels = dict(_LABEL.findall(m["labels"]))
        block_size = block_size or _int_label(labels, "block_size")
        num_blocks += _int_label(labels, "num_gpu_blocks")
    return Load(
        running=round(running or 0),
        waiting=round(waiting or 0),
        kv_usage=min(1.0, kv or 0.0),
        block_size=block_size,
        num_blocks=num_blocks,
    )
