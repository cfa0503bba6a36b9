"""The simulator's side of prefill/decode disaggregation, driven by invented times: a prefill
leg computes and names its blocks, a decode leg charges no prefill and counts its prompt as
external hits, as vLLM's KV connector counts them."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.router.relay.disagg import REMOTE_DECODE
from llmgw.simengine import kvtransfer, wire
from llmgw.simengine.engine import Engine, EngineParams, Request
from llmgw.simengine.protocol import ApiError, Limits, RequestParser
from tests.unit.test_simengine_engine import run

TIMED = EngineParams(ttft=0.01, prefill_per_token=0.001, itl=0.005, kv_transfer=0.002)


def test_a_decode_leg_charges_no_prefill_only_the_kv_transfer():
    eng = Engine(TIMED)
    aggregated, decode_leg = Request(1000, 3), Request(1000, 3, external_prefill=True)
    eng.add(aggregated, 0.0)
    eng.add(decode_leg, 0.0)
    run(eng, 0.0)
    assert aggregated.first_token_at == pytest.approx(0.01 + 1000 * 0.001)
    assert decode_leg.first_token_at == pytest.approx(0.002)
    assert decode_leg.generated == 3 and decode_leg.finished_reason == "length"
    # Usage reports the whole prompt as cached, as vLLM's (local + external).
    assert decode_leg.cached_tokens == 1000


def test_decode_leg_tokens_count_as_external_hits_and_by_source_as_vllm_counts_them():
    eng = Engine(EngineParams(block_size=16))
    hashes = tuple(range(1, 27))  # 417 tokens: 26 full blocks
    warm = Request(417, 1, block_hashes=hashes)
    eng.add(warm, 0.0)
    run(eng, 0.0)
    # The same prompt as a decode leg: the local cache has 26 blocks (416 tokens, the last
    # token always computed), the rest comes from the prefill engine.
    leg = Request(417, 1, block_hashes=hashes, external_prefill=True)
    plain = Request(100, 1)
    for r in (leg, plain):
        eng.add(r, 0.0)
    run(eng, 0.0)
    s = eng.stats
    assert (s.external_prefix_cache_queries, s.external_prefix_cache_hits) == (1, 1)
    assert s.prompt_tokens_by_source == {
        "local_compute": 417 + 100,  # the warm-up request and the plain one
        "local_cache_hit": 416,
        "external_kv_transfer": 1,
    }
    cold = Engine(EngineParams())
    cold.add(Request(417, 1, external_prefill=True), 0.0)
    run(cold, 0.0)
    c = cold.stats
    assert (c.external_prefix_cache_queries, c.external_prefix_cache_hits) == (417, 417)
    assert c.prompt_tokens_by_source["external_kv_transfer"] == 417
    assert c.prompt_tokens_by_source["local_compute"] == 0
    assert cold.snapshot()["external_prefix_cache_hits"] == 417


def test_a_preempted_decode_leg_recomputes_its_prompt_locally():
    # 4 blocks of 16: the older request's third block can only come from the leg's.
    eng = Engine(EngineParams(num_blocks=4, block_size=16, prefill_per_token=0.001, itl=0.01))
    hog = Request(30, 10)
    eng.add(hog, 0.0)
    eng.step(0.0)
    leg = Request(16, 10, external_prefill=True)
    eng.add(leg, 0.0)
    run(eng, 0.0)
    assert leg.generated == 10 and eng.stats.preemptions == 1
    assert eng.stats.prompt_tokens_by_source["local_compute"] == 30
    # Counted once, at the first admission: the recompute is not a second transfer.
    assert eng.stats.external_prefix_cache_hits == 16


def test_a_prefill_leg_names_its_blocks_in_nixl_connectors_shape():
    eng = Engine(EngineParams(block_size=16))
    leg = Request(40, 1)
    eng.add(leg, 0.0)
    run(eng, 0.0)
    answer = kvtransfer.prefill_answer("engine-a", "chatcmpl-1", leg.final_blocks, 40)
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    # One list per KV cache group (vLLM 0.32's BlockIds), the blocks the prompt filled.
    assert answer["remote_block_ids"] == [leg.final_blocks] and len(leg.final_blocks) == 3
    assert {k for k, v in answer.items() if v is None} == {"remote_blocks_expiry_time"}
    assert set(answer) >= {
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_num_tokens",
    }


def parser() -> RequestParser:
    return RequestParser(Limits(frozenset({"m"}), 4096, "lorem", 8), seed=1)


def test_the_unary_answer_carries_kv_transfer_params_only_when_the_request_did():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = parser().chat(msgspec.json.encode(body))
    leg = parser().chat(msgspec.json.encode({**body, "kv_transfer_params": REMOTE_DECODE}))
    assert kvtransfer.is_prefill_leg(leg.kv_transfer)
    assert not kvtransfer.is_decode_leg(leg.kv_transfer)
    answer = {"do_remote_prefill": True}
    out = msgspec.json.decode(wire.full_response(leg, "r", 0, [1], ["length"], 0, answer))
    assert out["kv_transfer_params"] == answer
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" not in msgspec.json.decode(
        wire.full_response(plain, "r", 0, [1], ["length"], 0)
    )
    null = msgspec.json.decode(wire.full_response(leg, "r", 0, [1], ["length"], 0, None))
    assert null["kv_transfer_params"] is None


def test_kv_transfer_params_that_are_not_an_object_are_a_400_naming_the_field():
    body = {"model": "m", "prompt": "x", "kv_transfer_params": [1]}
    with pytest.raises(ApiError) as info:
        parser().completion(msgspec.json.encode(body))
    assert info.value.status == 400 and info.value.param == "kv_transfer_params"
