"""The router is not stricter than vLLM: the same request gets the same status.

Each request goes to real vLLM directly and through a router in front of it;
whatever vLLM makes of it (200, or its own 400), the router's client must get the
same, since a gateway that refuses what its engine accepts breaks working clients.
"""

from __future__ import annotations

import httpx
import pytest

from llmgw.dev.routerkit import start_router
from tests.realengine.kit import MODEL

pytestmark = pytest.mark.real_engine

HI = [{"role": "user", "content": "hi"}]

CASES = {
    "temperature above 2": ("/v1/chat/completions", {"messages": HI, "temperature": 2.5}),
    "top_logprobs 21": (
        "/v1/chat/completions",
        {"messages": HI, "logprobs": True, "top_logprobs": 21},
    ),
    "max_tokens as a float": ("/v1/chat/completions", {"messages": HI, "max_tokens": 10.0}),
    "max_tokens as a string": ("/v1/chat/completions", {"messages": HI, "max_tokens": "10"}),
    "no messages": ("/v1/chat/completions", {}),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}),
    "n of 1000": ("/v1/chat/completions", {"messages": HI, "n": 1000, "max_tokens": 1}),
    "embeddings as messages": ("/v1/embeddings", {"messages": HI}),
    "prompt_embeds without a prompt": ("/v1/completions", {"prompt_embeds": "AAAA"}),
    "prompt null": ("/v1/completions", {"prompt": None}),
    "completion": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    "tokenize": ("/tokenize", {"prompt": "hello world"}),
    "detokenize": ("/detokenize", {"tokens": [1, 2, 3]}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
}


@pytest.fixture(scope="module")
def router(vllm_engine, tmp_path_factory):
    body = (
        "log_level: warning\n"
        "admission: {enabled: false}\n"
        f"models: [{{name: {MODEL}}}]\n"
        f"endpoints:\n  - {{id: v0, url: '{vllm_engine.url}', models: [{MODEL}], engine: vllm}}\n"
    )
    r = start_router(tmp_path_factory.mktemp("router"), body)
    try:
        yield r
    finally:
        assert r.stop() == 0, r.log_tail()


@pytest.mark.parametrize("case", list(CASES))
def test_the_router_answers_what_vllm_answers(case, router, vllm_engine):
    path, fields = CASES[case]
    body = {"model": MODEL, **fields}
    with httpx.Client(timeout=120) as http:
        direct = http.post(vllm_engine.url + path, json=body)
        routed = http.post(router.url + path, json=body)
    assert routed.status_code == direct.status_code, (case, direct.text[:300], routed.text[:300])
    if direct.status_code >= 400:
        # The engine's own refusal, relayed as it sent it (FastAPI's {"detail"} for a route
        # this model does not serve, OpenAI's {"error"} otherwise).
        assert routed.json().keys() == direct.json().keys()
    print(f"{case}: {direct.status_code}")
