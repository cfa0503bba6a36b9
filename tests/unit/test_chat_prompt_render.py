"""The router renders a chat for the simulator byte for byte as the simulator does,
so prefix hashes keep matching after tool-calling turns and multi-part content."""

from __future__ import annotations

import json

from llmgw.kvblocks import prompt_hashes, sim_token_bytes
from llmgw.router.kvcache.tokens import sim_tokens
from llmgw.simengine.protocol import Limits, RequestParser

TOOL_CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
]

MESSAGES = [
    {"role": "system", "content": "You are terse. " * 20},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look at this"},
            {"type": "text", "text": ""},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "and tell me the weather."},
        ],
    },
    {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    {"role": "assistant", "content": [{"type": "text", "text": ""}], "tool_calls": TOOL_CALLS},
    {"role": "user", "content": "And tomorrow?"},
]


def simulator_prompt(messages: list[dict]) -> bytes:
    parser = RequestParser(Limits(frozenset({"m"}), 100_000, "echo", 8), seed=1)
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return parser.chat(body).prompt


def test_router_tokens_equal_the_simulators_after_tool_calls_and_parts():
    raw = json.dumps(MESSAGES).encode()
    expected = sim_token_bytes(simulator_prompt(MESSAGES))
    assert sim_tokens(raw) == expected
    # What a user notices: every full block of the prompt is a hit, not just the first.
    assert prompt_hashes(sim_tokens(raw), 16, 512) == prompt_hashes(expected, 16, 512)


def test_plain_text_chat_still_matches():
    msgs = [{"role": "user", "content": "hello " * 50}]
    assert sim_tokens(json.dumps(msgs).encode()) == sim_token_bytes(simulator_prompt(msgs))
