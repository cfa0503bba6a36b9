"""`llmgw sim-engine`: run a vLLM-compatible engine simulator.

Every flag overrides the same key from `--config FILE` / `LLMGW_*` (see config.SimConfig).
"""

from __future__ import annotations

import argparse
import sys

from llmgw import config as llmgw_config
from llmgw import logs
from llmgw.simengine.config import SimConfig, validate

# (flag, config key, type, help); fault flags live under the `faults` key.
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "model name (default sim-model)"),
    ("--host", "host", str, "listen address (default 127.0.0.1)"),
    ("--port", "port", int, "listen port, 0 for any free one (default 8000)"),
    ("--max-num-seqs", "max_num_seqs", int, "most requests running at once (default 256)"),
    ("--kv-blocks", "kv_blocks", int, "KV cache size in blocks (default 4096)"),
    ("--block-size", "block_size", int, "tokens per KV block (default 16)"),
    ("--max-model-len", "max_model_len", int, "prompt + output limit in tokens (default 8192)"),
    ("--ttft-ms", "ttft_ms", float, "fixed prefill overhead per request"),
    (
        "--prefill-ms-per-token",
        "prefill_ms_per_token",
        float,
        "prefill time per uncached prompt token",
    ),
    ("--itl-ms", "itl_ms", float, "decode step time with an empty batch"),
    (
        "--itl-ms-per-running",
        "itl_ms_per_running",
        float,
        "decode step time added per running request",
    ),
    ("--kv-transfer-ms", "kv_transfer_ms", float, "P/D decode leg: wait for the prompt's KV"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        int,
        "with --enable-chunked-prefill: tokens one step may carry (default 2048)",
    ),
    ("--seed", "seed", int, "seed for lorem text and fault decisions (default 0)"),
    (
        "--default-output-tokens",
        "default_output_tokens",
        int,
        "lorem tokens when max_tokens is unset",
    ),
    (
        "--startup-seconds",
        "startup_seconds",
        float,
        "wait this long, port closed, before listening",
    ),
    (
        "--drain-seconds",
        "drain_seconds",
        float,
        "on SIGTERM, time in-flight requests get to finish",
    ),
    ("--embedding-dim", "embedding_dim", int, "length of /v1/embeddings vectors (default 256)"),
    (
        "--responses-store-size",
        "responses_store_size",
        int,
        "responses kept for GET /v1/responses/{id} (default 1024)",
    ),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--max-loras", "max_loras", int, "LoRA adapter slots (default 0: no adapters)"),
    ("--max-lora-rank", "max_lora_rank", int, "largest adapter rank accepted (default 16)"),
    (
        "--lora-load-seconds",
        "lora_load_seconds",
        float,
        "time to load an adapter into a slot (default 0)",
    ),
    (
        "--kv-events-config",
        "kv_events_config",
        str,
        "vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557"}\'',
    ),
]
_FAULT_FLAGS: list[tuple[str, str, type, str]] = [
    (
        "--error-rate",
        "error_rate",
        float,
        "fraction (0-1) of requests answered with --error-status",
    ),
    ("--error-status", "error_status", int, "HTTP status of injected errors (default 500)"),
    (
        "--hang-after-tokens",
        "hang_after_tokens",
        int,
        "stop producing after N tokens, connection open",
    ),
    ("--slow-first-token-ms", "slow_first_token_ms", float, "extra delay before every first token"),
    (
        "--exit-after-requests",
        "exit_after_requests",
        int,
        "exit (status 1) after N completed requests",
    ),
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file (keys as in SimConfig)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="names clients use (default: --model)",
    )
    parser.add_argument("--mode", choices=["echo", "lorem"], help="output text (default lorem)")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse cached prompt blocks (default on)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill chunks share the decode steps, stalling running decodes (default off)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="accepted as vLLM's is; adapters are on when --max-loras is above 0",
    )
    parser.add_argument(
        "--lora-on-demand",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve any adapter name, loading it into a slot on its first request",
    )
    for flag, key, typ, help_text in _FLAGS:
        parser.add_argument(flag, dest=key, type=typ, help=help_text)
    faults = parser.add_argument_group("fault injection (also POST /sim/faults)")
    for flag, key, typ, help_text in _FAULT_FLAGS:
        faults.add_argument(flag, dest=f"fault_{key}", type=typ, help=help_text)


def overrides(args: argparse.Namespace) -> dict:
    out = {key: getattr(args, key) for _, key, _, _ in _FLAGS}
    out["served_model_name"] = args.served_model_name
    out["mode"] = args.mode
    out["enable_prefix_caching"] = args.enable_prefix_caching
    out["enable_chunked_prefill"] = args.enable_chunked_prefill
    out["lora_on_demand"] = args.lora_on_demand
    faults = {key: getattr(args, f"fault_{key}") for _, key, _, _ in _FAULT_FLAGS}
    out["faults"] = {k: v for k, v in faults.items() if v is not None}
    return out


def run(args: argparse.Namespace) -> int:
    from llmgw.simengine import server

    try:
        cfg = validate(llmgw_config.load(SimConfig, args.config, overrides=overrides(args)))
    except llmgw_config.ConfigError as exc:
        print(f"llmgw sim-engine: {exc}", file=sys.stderr)
        return 2
    logs.setup("sim-engine", cfg.log_level)
    import uvloop

    try:
        return uvloop.run(server.serve(cfg, on_ready=server.print_ready))
    except llmgw_config.ConfigError as exc:  # a socket the config names cannot be bound
        print(f"llmgw sim-engine: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"llmgw sim-engine: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
