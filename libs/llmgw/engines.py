"""What each engine kind (vLLM, SGLang, the simulator) is, in one table. Pure.

The agent launches engines, the router scores and scrapes them, the catalog accepts
them; each needs a few facts about an engine kind. Stated in each place, they
drifted: SGLang got KV events but the router's feed, which lists the engines whose
events the agents relay, was never told, so an idle SGLang engine stayed unindexed
until its first event. Every reader now derives what it needs from `ENGINES`, and a
new engine kind is one entry here (plus its launch adapter, agent/launch.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class MetricFamily:
    """The load gauges an engine's Prometheus /metrics page names (enginemetrics reads them)."""

    name: str  # EngineLoad.source of a page read by this family's names
    running: str  # requests in the running batch
    waiting: str  # requests queued in the engine
    kv_usage: tuple[str, ...]  # 0..1 of the KV cache in use, the first name present wins


VLLM_METRICS = MetricFamily(
    name="vllm",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    # vllm:gpu_cache_usage_perc is the name before vLLM 0.11 (removed in 0.12).
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)
SGLANG_METRICS = MetricFamily(
    name="sglang",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
)


@dataclass(frozen=True)
class RuntimeLora:
    """How an engine loads and unloads LoRA adapters while it serves (the agent's lora.py).

    Both paths take a JSON POST: load `{"lora_name", "lora_path"}`, unload `{"lora_name"}`;
    a loaded adapter is served under its name as a request's `model`, and listed in
    `/v1/models` with `parent` = the base model."""

    load_path: str
    unload_path: str
    env: tuple[tuple[str, str], ...] = ()  # what the engine needs in its environment for it


VLLM_RUNTIME_LORA = RuntimeLora(
    load_path="/v1/load_lora_adapter",
    unload_path="/v1/unload_lora_adapter",
    # vLLM registers the two endpoints only with this set.
    env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),),
)


@dataclass(frozen=True)
class PdConnector:
    """How an engine takes part in prefill/decode disaggregation (docs/disaggregation.md).

    A StartShard with a role (prefill | decode) on an engine without this trait is refused
    before launch: it would serve as an aggregated engine and every request would pay its
    prefill twice."""

    # The engine is launched with the connector (vLLM's --kv-transfer-config) and reads or
    # writes the KV in the connector's shared folder, which the agent makes sure it can
    # write. False: it answers the protocol from the requests' kv_transfer_params alone.
    launch_flags: bool


@dataclass(frozen=True)
class EngineTraits:
    name: str
    # Publishes KV cache events that the agent relays: routers index its blocks from them
    # and ask the agent for a snapshot when its endpoint appears.
    kv_events: bool
    # Its events carry a block's extra keys (vLLM's cache salt); without them its blocks are
    # never stored under a salt, so a salted request cannot be scored by its events.
    events_carry_extra_keys: bool
    metrics: MetricFamily  # the gauges its /metrics page names
    default_command: tuple[str, ...]  # the agent's executable prefix for it, unless configured
    # The module whose presence means the engine is installed (checked without importing
    # it); None: the executable resolving is enough.
    installed_module: str | None
    # The router computes its token ids itself (the simulator's byte tokens of the prompt
    # it renders), not through the catalog's tokenizer.
    sim_tokens: bool
    # Loads LoRA adapters at run time (profile.max_loras > 0 turns it on), and how; None:
    # a profile with adapter slots is refused before launch.
    runtime_lora: RuntimeLora | None = None
    # Serves a disaggregated model's prefill or decode pool, and how; None: it cannot.
    pd_connector: PdConnector | None = None


ENGINES: MappingProxyType[str, EngineTraits] = MappingProxyType(
    {
        "vllm": EngineTraits(
            name="vllm",
            kv_events=True,
            events_carry_extra_keys=True,
            metrics=VLLM_METRICS,
            default_command=("vllm",),
            installed_module=None,
            sim_tokens=False,
            runtime_lora=VLLM_RUNTIME_LORA,
            pd_connector=PdConnector(launch_flags=True),
        ),
        # Its KV events and metrics read from SGLang's source (docs/agent.md). SGLang has
        # runtime adapters too (`--enable-lora --max-loras-per-batch N`, POST
        # /load_lora_adapter and /unload_lora_adapter with vLLM's body, no /v1 prefix), but
        # the agent does not drive them yet: a profile with adapter slots is refused. Its
        # own disaggregation (--disaggregation-mode, Mooncake/NIXL transfer) speaks another
        # protocol (a bootstrap room, not kv_transfer_params): no prefill or decode role.
        "sglang": EngineTraits(
            name="sglang",
            kv_events=True,
            events_carry_extra_keys=False,
            metrics=SGLANG_METRICS,
            default_command=("python3", "-m", "sglang.launch_server"),
            installed_module="sglang",
            sim_tokens=False,
        ),
        # The simulator speaks vLLM's /metrics names and KV event wire.
        "sim": EngineTraits(
            name="sim",
            kv_events=True,
            events_carry_extra_keys=True,
            metrics=VLLM_METRICS,
            default_command=(sys.executable, "-m", "llmgw.cli", "sim-engine"),
            installed_module="llmgw.simengine.cli",
            sim_tokens=True,
            runtime_lora=RuntimeLora(
                load_path="/v1/load_lora_adapter", unload_path="/v1/unload_lora_adapter"
            ),
            # It needs no flag: a request's kv_transfer_params say which leg it is.
            pd_connector=PdConnector(launch_flags=False),
        ),
    }
)
