"""Prefill/decode disaggregation over real sockets: a router in front of fake engines
given roles (`config_for(roles=...)`). The prefill engine gets the rewritten body, the
decode engine the params it returned, the client one whole answer; failures of either
leg are retried or served whole, and models without disaggregation are untouched."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from llmgw.contracts import DeadlineSpec, DisaggregationSpec, MigrationSpec
from llmgw.dev.routerkit import FakeEngine, config_for, fake_engines, metric_sum, running_router
from llmgw.router import config as rc

PROMPT = "Summarise the following report. " * 8
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": PROMPT}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 4,
}


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as s:
        yield s


def pd(engines: list[FakeEngine], roles: dict[str, str]):
    """A config whose model `m` is disaggregated with these roles."""
    return config_for(engines, roles=roles)


async def post(client, url: str, body: dict, path: str = "/v1/chat/completions"):
    async with client.post(url + path, json=body) as resp:
        return resp.status, resp.headers.get("x-llmgw-endpoint"), await resp.read()


def stream_text(raw: bytes) -> tuple[str, dict | None, bytes]:
    """A stream's text, its usage, and its last event."""
    events = [e for e in raw.split(b"\n\n") if e]
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return text, usage, events[-1]


async def metrics_of(client, r) -> str:
    return await (await client.get(r.admin_url + "/metrics")).text()


async def prefilling(client, r) -> dict[str, int]:
    """Per endpoint, `prefilling`: streams before their first event, prefill legs whole."""
    async with client.get(r.admin_url + "/debug/endpoints") as resp:
        return {e["id"]: e["prefilling"] for e in (await resp.json())["endpoints"]}


async def when_seen(engines: list[FakeEngine]) -> FakeEngine:
    """The first of `engines` to receive a request."""
    async with asyncio.timeout(5):
        while not any(e.seen for e in engines):
            await asyncio.sleep(0.002)
    return next(e for e in engines if e.seen)


async def test_the_prefill_leg_then_the_decode_stream_reach_the_client_whole(client):
    async with fake_engines("p1", "d1") as (p1, d1):
        async with running_router(pd([p1, d1], {"p1": "prefill", "d1": "decode"})) as r:
            status, endpoint, raw = await post(client, r.url, CHAT)
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == "d1"
    text, usage, last = stream_text(raw)
    assert text == "t0 t1 t2 t3 " and last == b"data: [DONE]"
    assert usage is not None and usage["completion_tokens"] == 4
    # The prefill engine got the prompt as one whole, one-token answer asking for remote decode.
    (prefill,) = p1.seen
    assert prefill.body["stream"] is False and prefill.body["max_tokens"] == 1
    assert "stream_options" not in prefill.body
    assert prefill.body["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill.body["messages"] == CHAT["messages"]
    # The decode engine got the client's request with the params the prefill returned.
    (decode,) = d1.seen
    params = decode.body.pop("kv_transfer_params")
    assert params["remote_engine_id"] == "p1" and params["remote_port"] == p1.port
    assert params["do_remote_prefill"] is True
    assert decode.body == CHAT
    assert prefill.headers["x-request-id"] == decode.headers["x-request-id"]
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="prefill", outcome="ok") == 1
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="decode", outcome="ok") == 1
    assert metric_sum(metrics, "llmgw_router_pd_prefill_duration_seconds_count", model="m") == 1


async def test_a_non_streamed_request_and_a_connector_that_returns_no_params(client):
    async with fake_engines("p1", "d1", kv_connector="example") as (p1, d1):
        async with running_router(pd([p1, d1], {"p1": "prefill", "d1": "decode"})) as r:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 7}
            status, endpoint, raw = await post(client, r.url, body, "/v1/completions")
    assert status == 200 and endpoint == "d1"
    assert json.loads(raw)["choices"][0]["message"]["content"] == "from d1"
    assert p1.seen[0].body["max_tokens"] == 1 and p1.seen[0].path == "/v1/completions"
    # ExampleConnector's null: the decode engine finds the KV by the prompt.
    assert d1.seen[0].body == body


async def test_a_prefill_attempt_past_the_first_token_deadline_is_retried_on_another(client):
    async with fake_engines("p1", "p2", "d1", prefill_delay=30) as (p1, p2, d1):
        config = pd([p1, p2, d1], {"p1": "prefill", "p2": "prefill", "d1": "decode"})
        async with running_router(config) as r:
            task = asyncio.create_task(post(client, r.url, CHAT))
            first = await when_seen([p1, p2])
            other = p2 if first is p1 else p1
            other.prefill_delay = 0
            status, endpoint, raw = await task
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == "d1"
    assert stream_text(raw)[0] == "t0 t1 t2 t3 "
    # The slow prefill was abandoned (its connection closed: the engine frees its KV),
    # and the decode leg carries the params of the one that answered.
    assert first.cancelled == 1 and len(other.seen) == 1
    assert d1.seen[0].body["kv_transfer_params"]["remote_engine_id"] == other.name
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="prefill", outcome="failed") == 1
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="prefill", outcome="ok") == 1


async def test_every_prefill_failing_serves_the_request_whole_on_decode(client):
    async with fake_engines("p1", "p2", "d1") as (p1, p2, d1):
        p1.status = p2.status = 500
        config = pd([p1, p2, d1], {"p1": "prefill", "p2": "prefill", "d1": "decode"})
        async with running_router(config) as r:
            status, endpoint, raw = await post(client, r.url, CHAT)
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == "d1"
    assert stream_text(raw)[0] == "t0 t1 t2 t3 "
    assert len(p1.seen) == 1 and len(p2.seen) == 1
    assert d1.seen[0].body == CHAT  # no params: it computes the prompt itself
    assert metric_sum(metrics, "llmgw_router_pd_fallbacks_total", reason="prefill_failed") == 1


async def test_an_empty_prefill_pool_serves_the_request_whole_on_decode(client):
    async with fake_engines("d1") as (d1,):
        async with running_router(pd([d1], {"d1": "decode"})) as r:
            status, endpoint, _ = await post(client, r.url, CHAT)
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == "d1"
    assert d1.seen[0].body == CHAT
    assert metric_sum(metrics, "llmgw_router_pd_fallbacks_total", reason="no_prefill_endpoint") == 1


async def test_a_request_the_prefill_engine_refuses_gets_the_decode_engines_own_answer(client):
    async with fake_engines("p1", "d1") as (p1, d1):
        p1.status = 400  # a prompt too long, say: the decode engine judges it again
        async with running_router(pd([p1, d1], {"p1": "prefill", "d1": "decode"})) as r:
            status, endpoint, _ = await post(client, r.url, CHAT)
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == "d1" and len(p1.seen) == 1
    assert metric_sum(metrics, "llmgw_router_pd_fallbacks_total", reason="prefill_refused") == 1


async def test_a_decode_failing_before_its_first_byte_is_retried_with_the_same_params(client):
    async with fake_engines("p1", "d1", "d2", hang_before_headers=True) as (p1, d1, d2):
        p1.hang_before_headers = False
        config = pd([p1, d1, d2], {"p1": "prefill", "d1": "decode", "d2": "decode"})
        async with running_router(config) as r:
            task = asyncio.create_task(post(client, r.url, CHAT))
            first = await when_seen([d1, d2])
            other = d2 if first is d1 else d1
            other.hang_before_headers = False
            status, endpoint, raw = await task
            metrics = await metrics_of(client, r)
    assert status == 200 and endpoint == other.name
    assert stream_text(raw)[0] == "t0 t1 t2 t3 "
    assert len(p1.seen) == 1  # one prefill leg for both decode attempts
    params = first.seen[0].body["kv_transfer_params"]
    assert params["remote_engine_id"] == "p1"
    assert other.seen[0].body["kv_transfer_params"] == params
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="decode", outcome="failed") == 1


async def test_a_client_gone_during_the_prefill_leg_cancels_it_and_no_decode_is_sent(client):
    async with fake_engines("p1", "d1", prefill_delay=30) as (p1, d1):
        async with running_router(pd([p1, d1], {"p1": "prefill", "d1": "decode"})) as r:
            task = asyncio.create_task(post(client, r.url, CHAT))
            await when_seen([p1])
            during = await prefilling(client, r)  # the leg is all prefill: counted whole
            task.cancel()
            async with asyncio.timeout(5):
                while not p1.cancelled:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # time for a decode leg that should not come
            metrics = await metrics_of(client, r)
            after = await prefilling(client, r)
    assert during == {"p1": 1, "d1": 0} and after == {"p1": 0, "d1": 0}
    assert p1.cancelled == 1 and not d1.seen
    assert metric_sum(metrics, "llmgw_router_client_disconnects_total", model="m") == 1


async def test_short_prompts_and_other_api_kinds_skip_the_prefill_leg(client):
    async with fake_engines("p1", "d1") as (p1, d1):
        spec = rc.ModelConfig(name="m", disaggregation=DisaggregationSpec(min_prompt_tokens=100))
        config = config_for([p1, d1], roles={"p1": "prefill", "d1": "decode"}, models=[spec])
        async with running_router(config) as r:
            short = {**CHAT, "messages": [{"role": "user", "content": "hi"}]}
            status, endpoint, _ = await post(client, r.url, short)
            assert status == 200 and endpoint == "d1"
            embed = {"model": "m", "input": PROMPT * 10}
            status, endpoint, _ = await post(client, r.url, embed, "/v1/embeddings")
            assert status == 200 and endpoint == "d1"
            metrics = await metrics_of(client, r)
    assert not p1.seen
    assert [s.body for s in d1.seen] == [short, embed]
    assert metric_sum(metrics, "llmgw_router_pd_whole_total", reason="short_prompt") == 1
    assert metric_sum(metrics, "llmgw_router_pd_whole_total", reason="api_kind") == 1


async def test_a_cut_decode_stream_continues_on_another_decode_engine_without_params(client):
    async with fake_engines("p1", "d1", "d2", tokens=6, hang_after=2) as (p1, d1, d2):
        deadlines = DeadlineSpec(connect=1.0, headers=1.0, first_token=1.0, idle=0.5, total=10.0)
        config = config_for(
            [p1, d1, d2],
            roles={"p1": "prefill", "d1": "decode", "d2": "decode"},
            models=[
                rc.ModelConfig(
                    name="m", disaggregation=DisaggregationSpec(), migration=MigrationSpec(max=1)
                )
            ],
            model_defaults=rc.ModelDefaults(deadlines=deadlines),
        )
        async with running_router(config) as r:
            task = asyncio.create_task(post(client, r.url, {**CHAT, "max_tokens": 6}))
            first = await when_seen([d1, d2])
            other = d2 if first is d1 else d1
            other.hang_after = None
            status, _, raw = await task
    assert status == 200
    text, _, last = stream_text(raw)
    assert last == b"data: [DONE]" and text.startswith("t0 t1 ")
    assert len(p1.seen) == 1  # no second prefill leg
    assert "kv_transfer_params" in first.seen[0].body
    assert "kv_transfer_params" not in other.seen[0].body  # it computes its own prompt


async def test_a_model_without_disaggregation_is_untouched(client):
    async with fake_engines("a1", "a2") as engines:
        async with running_router(config_for(engines)) as r:
            status, _, raw = await post(client, r.url, CHAT)
            metrics = await metrics_of(client, r)
    assert status == 200 and stream_text(raw)[0] == "t0 t1 t2 t3 "
    (seen,) = [s for e in engines for s in e.seen]
    assert seen.body == CHAT
    assert metric_sum(metrics, "llmgw_router_pd_legs_total") == 0
    assert metric_sum(metrics, "llmgw_router_pd_whole_total") == 0


async def test_a_client_gone_before_the_decode_leg_answered_has_its_kv_read_anyway(client):
    """NixlConnector keeps the prompt's KV on the prefill engine until a decode engine
    reads it: the router sends the decode leg once more, one token, answer dropped."""
    async with fake_engines("p1", "d1", hang_before_headers=True) as (p1, d1):
        p1.hang_before_headers = False
        async with running_router(pd([p1, d1], {"p1": "prefill", "d1": "decode"})) as r:
            task = asyncio.create_task(post(client, r.url, CHAT))
            await when_seen([d1])
            d1.hang_before_headers = False
            task.cancel()
            async with asyncio.timeout(5):
                while 'leg="release"' not in (metrics := await metrics_of(client, r)):
                    await asyncio.sleep(0.02)
    decode, release = d1.seen
    assert release.body["max_tokens"] == 1 and release.body["stream"] is False
    assert "stream_options" not in release.body
    assert release.body["messages"] == CHAT["messages"]
    assert release.body["kv_transfer_params"] == decode.body["kv_transfer_params"]
    assert release.body["kv_transfer_params"]["remote_engine_id"] == "p1"
    assert len(p1.seen) == 1  # the KV is read, not computed again
    assert metric_sum(metrics, "llmgw_router_pd_legs_total", leg="release", outcome="ok") == 1
    assert metric_sum(metrics, "llmgw_router_client_disconnects_total", model="m") == 1
