"""vLLM's two-leg prefill/decode protocol, as a NixlConnector engine answers it.

A disaggregating router sends the prompt to a prefill engine with `kv_transfer_params`
asking for remote decode (`do_remote_decode: true`, `max_tokens: 1`); the engine answers with
parameters that tell the decode engine where the prompt's KV blocks are. The router sends the
client's request to a decode engine with those parameters; `do_remote_prefill: true` there
means "load the prompt's KV instead of computing it". The simulator answers with the keys
vLLM 0.32's NixlConnector returns (nixl/pull_scheduler.py `request_finished`), not null as
ExampleConnector does, so a router's pass-through of the parameters is exercised.
"""

from __future__ import annotations

from typing import Any

# What vLLM's NixlConnector names when no VLLM_NIXL_SIDE_CHANNEL_* is set: nothing listens
# there in the simulator; a decode simulator does not read the blocks, it trusts the leg.
SIDE_CHANNEL_HOST = "localhost"
SIDE_CHANNEL_PORT = 5600


def is_prefill_leg(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def is_decode_leg(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_prefill"))


def prefill_answer(
    engine_id: str, request_id: str, block_ids: list[int], computed_tokens: int
) -> dict[str, Any]:
    """The `kv_transfer_params` of a finished prefill leg: the decode engine may pull these
    blocks (one list per KV cache group; the simulator has one group) from this engine."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": SIDE_CHANNEL_HOST,
        "remote_port": SIDE_CHANNEL_PORT,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": computed_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
