"""Prefill/decode disaggregation against two real `llmgw sim-engine` processes: the two legs
vLLM's proxy sends, over real sockets, and the counters a decode engine shows for them."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.dev.simkit import SimProcess, start_sim
from llmgw.router.relay.disagg import REMOTE_DECODE

MODEL = "sim-model"
OPTIONS = dict(
    block_size=16,
    prefill_ms_per_token=0.01,
    itl_ms=1,
    enable_chunked_prefill=True,
    max_num_batched_tokens=512,
)


@pytest.fixture(scope="module")
def sims() -> tuple[SimProcess, SimProcess]:
    with start_sim(**OPTIONS) as prefill, start_sim(**OPTIONS) as decode:
        yield prefill, decode


def metrics(sim: SimProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{sim.url}/metrics", timeout=5).raise_for_status().text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("source", ""))] = s.value
    return out


def test_prefill_leg_answers_nixl_params_and_the_decode_leg_loads_instead_of_computing(sims):
    prefill, decode = sims
    prompt = "a long shared document " * 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    # The sims are the module's: count what this test adds, whichever test ran first.
    d0, p0 = metrics(decode), metrics(prefill)
    first = httpx.post(
        f"{prefill.url}/v1/chat/completions",
        json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE},
        timeout=30,
    ).raise_for_status()
    answer = first.json()
    n_prompt = answer["usage"]["prompt_tokens"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    [blocks] = params["remote_block_ids"]
    assert len(blocks) == -(-(n_prompt + 1) // 16)
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]

    with httpx.stream(
        "POST",
        f"{decode.url}/v1/chat/completions",
        json={
            **body,
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
            "kv_transfer_params": params,
        },
        timeout=30,
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=events[-1][6:]).json()["usage"]
    assert usage["completion_tokens"] == 20
    assert usage["prompt_tokens_details"]["cached_tokens"] == n_prompt

    d1, p1 = metrics(decode), metrics(prefill)
    d = {k: v - d0.get(k, 0.0) for k, v in d1.items()}
    p = {k: v - p0.get(k, 0.0) for k, v in p1.items()}
    assert d[("vllm:external_prefix_cache_hits_total", "")] == n_prompt
    assert d[("vllm:external_prefix_cache_queries_total", "")] == n_prompt
    assert d[("vllm:prompt_tokens_by_source_total", "external_kv_transfer")] == n_prompt
    assert d[("vllm:prompt_tokens_by_source_total", "local_compute")] == 0
    # The prefill engine computed the prompt, and nobody sent it anything external.
    assert p[("vllm:prompt_tokens_by_source_total", "local_compute")] == n_prompt
    assert p[("vllm:external_prefix_cache_hits_total", "")] == 0


def test_a_request_without_kv_transfer_params_is_answered_as_before(sims):
    _, decode = sims
    r = httpx.post(
        f"{decode.url}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
        timeout=30,
    ).raise_for_status()
    assert "kv_transfer_params" not in r.json() and r.json()["usage"]["completion_tokens"] == 3
