"""The simulator's configuration: one Struct, loaded like every llmgw service's.

Defaults < YAML (`--config`) < `LLMGW_*` environment < command-line flags. Latencies default to
zero so a simulator is never the bottleneck unless a test asks for realism.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from llmgw import config

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class FaultConfig(config.ConfigStruct):
    """Failures to inject. Every field off by default; `POST /sim/faults` replaces the set."""

    # Fraction (0-1) of completion requests answered with `error_status` instead of tokens.
    error_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    error_status: Annotated[int, msgspec.Meta(ge=400, le=599)] = 500
    # Each request stops producing after this many tokens and holds its slot and KV blocks,
    # the connection open and silent, until the client goes away (a wedged engine).
    hang_after_tokens: NonNegInt | None = None
    # Extra delay before each request's first token, on top of the modelled prefill.
    slow_first_token_ms: NonNegFloat = 0.0
    # The process exits (status 1, no drain) once this many more requests have completed.
    exit_after_requests: PositiveInt | None = None


class SimConfig(config.ConfigStruct):
    model: str = "sim-model"
    # Names clients may use; the first is the `model_name` metric label. Default: [model].
    served_model_name: list[str] = []
    host: str = "127.0.0.1"
    # 0 picks a free port; the chosen URL is printed on stdout once listening.
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    max_num_seqs: PositiveInt = 256
    kv_blocks: PositiveInt = 4096
    block_size: PositiveInt = 16
    max_model_len: PositiveInt = 8192
    enable_prefix_caching: bool = True
    # Time to first token = ttft_ms + uncached prompt tokens * prefill_ms_per_token.
    ttft_ms: NonNegFloat = 0.0
    prefill_ms_per_token: NonNegFloat = 0.0
    # One decode step (one token for every running request) = itl_ms + itl_ms_per_running * running.
    itl_ms: NonNegFloat = 0.0
    itl_ms_per_running: NonNegFloat = 0.0
    # Prefill/decode disaggregation: a decode leg's wait for its prompt's KV (no prefill).
    kv_transfer_ms: NonNegFloat = 0.0
    # Prefill shares the decode steps, as vLLM's chunked prefill does: a step carries every
    # decoding request's token plus prompt chunks up to max_num_batched_tokens, and lasts
    # itl_ms + itl_ms_per_running * running + prompt tokens in it * prefill_ms_per_token.
    # Off: each prefill runs on its own timer beside the decode steps.
    enable_chunked_prefill: bool = False
    max_num_batched_tokens: PositiveInt = 2048
    mode: Literal["echo", "lorem"] = "lorem"
    seed: int = 0
    # Tokens a lorem request without max_tokens produces before its simulated end of sequence.
    default_output_tokens: PositiveInt = 64
    # Length of /v1/embeddings vectors (a request's `dimensions` may ask for fewer).
    embedding_dim: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    # Responses kept for GET /v1/responses/{id} (the oldest are forgotten first).
    responses_store_size: NonNegInt = 1024
    # Seconds to wait, port closed, before listening (as vLLM does while loading weights).
    startup_seconds: NonNegFloat = 0.0
    # On SIGTERM, in-flight requests get this long to finish before they are aborted.
    drain_seconds: NonNegFloat = 10.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # LoRA adapter slots (vLLM's --max-loras; 0: no adapters) and what loading one into a
    # slot takes; --enable-lora and --max-lora-rank are accepted as vLLM's are.
    max_loras: NonNegInt = 0
    max_lora_rank: PositiveInt = 16
    lora_load_seconds: NonNegFloat = 0.0
    # Serve any adapter name, registered on its first request and loaded into a slot then
    # (the benchmark's baseline: load wherever the request lands).
    lora_on_demand: bool = False
    # vLLM's `--kv-events-config` JSON: publish KV cache events over ZMQ in vLLM's format.
    kv_events_config: str = ""
    faults: FaultConfig = msgspec.field(default_factory=FaultConfig)

    @property
    def served_names(self) -> list[str]:
        return list(self.served_model_name) or [self.model]


def validate(cfg: SimConfig) -> SimConfig:
    """Cross-field checks msgspec cannot express; raises ConfigError naming the fields."""
    if cfg.kv_blocks * cfg.block_size < cfg.max_model_len:
        raise config.ConfigError(
            f"kv_blocks * block_size = {cfg.kv_blocks * cfg.block_size} tokens cannot hold one "
            f"request of max_model_len = {cfg.max_model_len}: raise kv_blocks or lower max_model_len"
        )
    from llmgw.simengine.kvevents import parse_config

    parse_config(cfg.kv_events_config)  # raises ConfigError naming the field
    if cfg.enable_chunked_prefill:
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise config.ConfigError(
                f"max_num_batched_tokens = {cfg.max_num_batched_tokens} is below max_num_seqs = "
                f"{cfg.max_num_seqs}: a step could not carry every running request's token"
            )
        if cfg.ttft_ms:
            raise config.ConfigError(
                "ttft_ms must be 0 with enable_chunked_prefill: a chunked prefill costs its "
                "prompt tokens in the steps (prefill_ms_per_token), no fixed overhead"
            )
    if any(not name for name in cfg.served_names):
        raise config.ConfigError("served_model_name: names must not be empty")
    return cfg
