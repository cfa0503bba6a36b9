"""What `llmgw dev` applies and tells its user: the catalogs, and the try-it facts. Pure.

The demo catalog runs sim engines; `--engine vllm` runs real vLLM engines on a tiny
local model instead (CPU settings, so any machine with a vLLM environment runs it).
Whatever catalog is applied, the model and key printed come from that catalog: a
demo key is printed only when the catalog's tenants accept it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmgw import keys

VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"
VLLM_MODEL = "tiny-llama"
# A CPU vLLM: no CUDA graphs, float32 (the CPU kernels' safe choice); a tool parser so
# tool-call requests are served, not refused (max_model_len is in the profile).
VLLM_CPU_ENGINE_ARGS = [
    "--enforce-eager",
    "--dtype", "float32",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes",
    # The agent reads /metrics several times a second and polls /health: without this the
    # output tail a crash reports is nothing but those requests.
    "--disable-access-log-for-endpoints", "/health,/metrics",
]  # fmt: skip
VLLM_CPU_MAX_MODEL_LEN = 1024
# GiB of KV cache per CPU engine (vLLM's default takes a large share of the host's memory);
# no thread pinning: every CPU engine on a host pins its worker to the same core by
# default, and one busy engine then starves another's start for many minutes.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_command(python: str) -> list[str]:
    """The engine command for a vLLM environment's Python (`python -m` works where the
    `vllm` console script does not, as in vllm-cpu)."""
    return [python, "-m", VLLM_API_SERVER]


def vllm_agent_env(python: str, base: dict[str, str]) -> dict[str, str]:
    """Environment for agents that launch real vLLM from `python`'s environment; the CPU
    settings only where `base` (the caller's environment) does not set them."""
    env = {"LLMGW_VLLM_COMMAND": json.dumps(vllm_command(python))}
    env.update({k: v for k, v in VLLM_CPU_ENV.items() if k not in base})
    return env


def vllm_profile(model_path: str) -> dict[str, Any]:
    return {
        "engine": "vllm",
        "model_ref": model_path,
        "gpus_per_shard": 1,
        "max_model_len": VLLM_CPU_MAX_MODEL_LEN,
        "engine_args": list(VLLM_CPU_ENGINE_ARGS),
    }


def vllm_catalog(demo: dict[str, Any], model_path: str, replicas: int = 2) -> dict[str, Any]:
    """The demo catalog's bands and tenants, serving one real vLLM model."""
    return {
        **demo,
        "models": [{"name": VLLM_MODEL, "replicas": replicas, "profile": vllm_profile(model_path)}],
    }


@dataclass(frozen=True)
class TryIt:
    models: dict[str, int]  # model name -> replicas, as applied
    model: str  # the one the try-it line names ("" when the catalog has none)
    api_key: str | None  # a key the applied tenants accept; None: none we know
    key_note: str  # what to tell the user about keys


def try_it(catalog: dict[str, Any], demo_keys: dict[str, str]) -> TryIt:
    """The model and key to print for `catalog`, the catalog actually applied."""
    models = {
        m["name"]: int(m.get("replicas", 1))
        for m in catalog.get("models") or []
        if isinstance(m, dict) and m.get("name")
    }
    model = next((name for name, n in models.items() if n > 0), next(iter(models), ""))
    tenants = [t for t in catalog.get("tenants") or [] if isinstance(t, dict)]
    if not tenants:
        return TryIt(models, model, None, "none needed: the catalog declares no tenants")
    for key in demo_keys.values():
        digest = keys.hash_key(key)
        for t in tenants:
            if digest in (t.get("key_hashes") or []):
                band = t.get("band", "")
                return TryIt(models, model, key, f"tenant {t.get('name')}, {band} band")
    names = ", ".join(str(t.get("name")) for t in tenants)
    return TryIt(
        models, model, None, f"one of the catalog's own keys (tenants: {names}); no demo key"
    )
