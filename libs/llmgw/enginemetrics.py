"""The load an engine reports on its Prometheus /metrics page: vLLM and SGLang. Pure.

The one parser of engine pages: the agent (its load samples) and the router
(fallback scraping) both read engines through `parse`. A vLLM page is tens of
kilobytes of histograms, read several times a second per engine, so this is no
exposition parser: one compiled regular expression picks out the few gauges
wanted. Series of one gauge with different labels (data-parallel engines, several
served names) are combined: counts add up, KV use takes the fullest cache, which
is what a new request meets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw.engines import ENGINES

# Each metric family the engine table names, once, in its order: a page with several
# families' queue gauges is read by the first's names.
_FAMILIES = tuple({t.metrics.name: t.metrics for t in ENGINES.values()}.values())
RUNNING = tuple(f.running for f in _FAMILIES)
WAITING = tuple(f.waiting for f in _FAMILIES)
KV_USAGE = tuple(n for f in _FAMILIES for n in f.kv_usage)  # all are 0..1

_LINE = re.compile(
    rb"^("
    + b"|".join(re.escape(n.encode()) for n in (*RUNNING, *WAITING, *KV_USAGE))
    + rb")(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)
_MAXED = frozenset(n.encode() for n in KV_USAGE)
_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{(?P<labels>[^}\n]*)\}", re.MULTILINE)
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# vLLM's adapters of running and waiting requests: a gauge per label set whose value is the
# time it was last set, so every set the engine ever reported stays on the page.
_LORA_INFO = re.compile(
    rb"^vllm:lora_requests_info\{(?P<labels>[^}\n]*)\}[ \t]+(?P<value>\S+)", re.MULTILINE
)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued in the engine
    kv_usage: float = 0.0  # 0..1 of the KV cache in use
    block_size: int = 0  # vLLM's cache geometry (cache_config_info), 0 when not reported
    num_blocks: int = 0
    # "vllm" or "sglang": whose queue gauges the page has; "" when it reports KV use alone.
    source: str = field(default="", compare=False)
    # LoRA adapters of the running and of the waiting requests (vllm:lora_requests_info).
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()


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


def _int_label(labels: dict[bytes, bytes], name: bytes) -> int:
    try:
        return int(float(labels.get(name, b"")))
    except ValueError:
        return 0


def _cache_geometry(text: bytes) -> tuple[int, int]:
    """vLLM's block size and block count; counts add up across data-parallel engines."""
    block_size = num_blocks = 0
    if b"vllm:cache_config_info" not in text:
        return 0, 0
    for m in _CACHE_INFO.finditer(text):
        labels = dict(_LABEL.findall(m["labels"]))
        block_size = block_size or _int_label(labels, b"block_size")
        num_blocks += _int_label(labels, b"num_gpu_blocks")
    return block_size, num_blocks


def _names(value: bytes) -> tuple[str, ...]:
    return tuple(n for n in value.decode(errors="replace").split(",") if n)


def lora_adapters(text: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(running, waiting) adapters from the newest vllm:lora_requests_info series: its
    value is a timestamp, and the older label sets stay on the page."""
    if b"vllm:lora_requests_info" not in text:
        return (), ()
    newest: dict[bytes, bytes] | None = None
    newest_at = float("-inf")
    for m in _LORA_INFO.finditer(text):
        try:
            at = float(m["value"])
        except ValueError:
            continue
        if at >= newest_at:
            newest_at, newest = at, dict(_LABEL.findall(m["labels"]))
    if newest is None:
        return (), ()
    return (
        _names(newest.get(b"running_lora_adapters", b"")),
        _names(newest.get(b"waiting_lora_adapters", b"")),
    )


def parse(text: bytes) -> EngineLoad | None:
    """The load a page reports, or None when it has none of the known gauges.

    A page with vLLM's queue gauges is read by vLLM's names (its KV gauge by the
    current name, else the pre-0.11 one), else one with SGLang's by SGLang's; a page
    with a KV gauge alone gives its KV use and no source.
    """
    found = gauges(text)
    if not found:
        return None
    block_size, num_blocks = _cache_geometry(text)
    running_adapters, waiting_adapters = lora_adapters(text)
    for family in _FAMILIES:
        if family.running in found or family.waiting in found:
            kv = next((found[n] for n in family.kv_usage if n in found), 0.0)
            return EngineLoad(
                running=round(found.get(family.running, 0)),
                waiting=round(found.get(family.waiting, 0)),
                kv_usage=min(max(kv, 0.0), 1.0),
                block_size=block_size,
                num_blocks=num_blocks,
                source=family.name,
                running_adapters=running_adapters,
                waiting_adapters=waiting_adapters,
            )
    kv = next(found[n] for n in KV_USAGE if n in found)
    return EngineLoad(kv_usage=min(max(kv, 0.0), 1.0), block_size=block_size, num_blocks=num_blocks)
