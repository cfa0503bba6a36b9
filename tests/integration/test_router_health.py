"""Passive health, load scraping, affinity and the admin listener, over real sockets."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.contracts import DeadlineSpec, SchedulingSpec
from llmgw.dev.routerkit import config_for, fake_engines, running_router
from llmgw.router import config as rc

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as s:
        yield s


async def served_by(client, url, body=CHAT, headers=None) -> str:
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200
        return resp.headers["x-llmgw-endpoint"]


async def debug(client, r) -> dict[str, dict]:
    async with client.get(r.admin_url + "/debug/endpoints") as resp:
        return {e["id"]: e for e in (await resp.json())["endpoints"]}


async def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_the_circuit_opens_on_failures_lets_one_probe_through_and_recovers(client):
    async with fake_engines("a", "b") as (a, b):
        a.status = 500
        cfg = config_for(
            [a, b],
            circuit=rc.CircuitConfig(failures=2, cooldown_seconds=1.5),
            model_defaults=rc.ModelDefaults(
                scheduling=rc.SchedulingSpec(scorers={"inflight": 1}, picker="max_score")
            ),
        )
        async with running_router(cfg) as r:
            for _ in range(12):
                opened = time.monotonic()  # the circuit opens during this request, if at all
                assert await served_by(client, r.url) == "b"  # retried when a fails
                if len(a.seen) == 2:
                    break
            assert (await debug(client, r))["a"]["circuit"]["state"] == "open"
            for _ in range(5):
                assert await served_by(client, r.url) == "b"
            if time.monotonic() - opened < 1.5:  # still cooling down: a got nothing more
                assert len(a.seen) == 2
            a.status = 200

            async def a_serves_again():  # after the cooldown: one probe, it succeeds
                return await served_by(client, r.url) == "a"

            await wait_for(a_serves_again)
            assert time.monotonic() - opened > 1.4
            picks = Counter([await served_by(client, r.url) for _ in range(20)])
            state = (await debug(client, r))["a"]["circuit"]["state"]
    assert state == "closed" and picks["a"] > 0


async def test_a_failed_probe_reopens_the_circuit(client):
    async with fake_engines("a", "b") as (a, b):
        a.status = 500
        cfg = config_for([a, b], circuit=rc.CircuitConfig(failures=1, cooldown_seconds=0.2))
        async with running_router(cfg) as r:
            await wait_for(lambda: _served_until(client, r.url, a, 1))
            assert (await debug(client, r))["a"]["circuit"]["state"] == "open"
            await asyncio.sleep(0.25)
            await wait_for(lambda: _served_until(client, r.url, a, 2))  # the probe
            state = (await debug(client, r))["a"]["circuit"]["state"]
    assert state == "open" and len(a.seen) == 2


async def _served_until(client, url, engine, n) -> bool:
    await served_by(client, url)
    return len(engine.seen) >= n


async def test_scraped_load_shows_up_goes_stale_and_steers_traffic(client):
    async with fake_engines("busy", "calm") as (busy, calm):
        busy.waiting, busy.kv_usage = 12, 0.9
        # The scorers that read the scraped sample (the default reads only in-flight
        # counts and caches, so with nothing in flight it would take the two in turn).
        sample_scorers = SchedulingSpec(scorers={"queue": 2, "kv": 2, "inflight": 1})
        cfg = config_for(
            [busy, calm],
            scrape=rc.ScrapeConfig(interval_seconds=0.05, stale_after_seconds=1.0),
            models=[rc.ModelConfig(name="m", scheduling=sample_scorers)],
        )
        async with running_router(cfg) as r:

            async def scraped():
                eps = await debug(client, r)
                return eps["busy"]["load"] is not None and eps["calm"]["load"] is not None

            await wait_for(scraped)
            eps = await debug(client, r)
            assert eps["busy"]["load"] == {
                "waiting": 12,
                "running": 0,
                "kv_usage": 0.9,
                "source": "vllm",
            }
            assert eps["busy"]["stale"] is False
            picks = Counter([await served_by(client, r.url) for _ in range(10)])
            assert picks == {"calm": 10}

            calm.metrics_status = 500  # its scrapes fail: the last sample ages out

            async def stale():
                return (await debug(client, r))["calm"]["stale"]

            await wait_for(stale)
            eps = await debug(client, r)
            assert eps["calm"]["scrape_error"] == "/metrics answered 500"
            async with client.get(r.admin_url + "/metrics") as resp:
                text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    errors = {
        s.labels["endpoint"]: s.value
        for s in families["llmgw_router_scrape_errors"].samples
        if s.name.endswith("_total")
    }
    assert errors.get("calm", 0) >= 1
    waiting = {
        s.labels["endpoint"]: s.value for s in families["llmgw_router_endpoint_waiting"].samples
    }
    assert waiting["busy"] == 12


async def test_shared_prefix_requests_land_on_the_same_engine_while_load_is_even(client):
    async with fake_engines("a", "b", "c") as eps:
        async with running_router(config_for(list(eps))) as r:
            system = {"role": "system", "content": "You answer questions about llamas. " * 30}

            def ask(i, prefix=system):
                return {"model": "m", "messages": [prefix, {"role": "user", "content": f"q{i}"}]}

            shared = [await served_by(client, r.url, ask(i)) for i in range(8)]
            others = [
                await served_by(
                    client, r.url, ask(0, {"role": "system", "content": f"Persona {i}. " * 80})
                )
                for i in range(12)
            ]
    assert len(set(shared)) == 1
    assert len(set(others)) > 1  # different prefixes still spread over the engines


async def test_session_affinity_from_a_header(client):
    async with fake_engines("a", "b", "c") as eps:
        cfg = config_for(
            list(eps),
            model_defaults=rc.ModelDefaults(
                scheduling=rc.SchedulingSpec(scorers={"session": 3, "inflight": 1})
            ),
        )
        async with running_router(cfg) as r:
            one = [await served_by(client, r.url, headers={"x-session-id": "s1"}) for _ in range(6)]
            two = [await served_by(client, r.url, headers={"x-session-id": "s2"}) for _ in range(6)]
    assert len(set(one)) == 1 and len(set(two)) == 1


async def test_admin_listener_health_readiness_and_metrics(client):
    async with fake_engines("a") as (a,):
        async with running_router(config_for([a])) as r:
            for body in (CHAT, {**CHAT, "stream": True, "stream_options": {"include_usage": True}}):
                await served_by(client, r.url, body)
            async with client.get(r.admin_url + "/healthz") as resp:
                assert resp.status == 200
            async with client.get(r.admin_url + "/readyz") as resp:
                assert resp.status == 200
            async with client.get(r.admin_url + "/metrics") as resp:
                text = await resp.text()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert (
        values[
            ("llmgw_router_requests_total", (("endpoint", "a"), ("model", "m"), ("status", "200")))
        ]
        == 2
    )
    # usage: 5 + 7 prompt tokens (non-streamed, then the streamed usage chunk), 3 + 4 completion
    assert values[("llmgw_router_prompt_tokens_total", (("model", "m"),))] == 12
    assert values[("llmgw_router_completion_tokens_total", (("model", "m"),))] == 7
    assert values[("llmgw_router_time_to_first_token_seconds_count", (("model", "m"),))] == 1
    assert values[("llmgw_router_request_duration_seconds_count", (("model", "m"),))] == 2


async def test_readiness_waits_for_an_endpoint():
    cfg = rc.RouterConfig(models=[rc.ModelConfig(name="m")])
    async with running_router(cfg) as r, aiohttp.ClientSession() as s:
        async with s.get(r.admin_url + "/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["detail"] == "no ready endpoint known"


# ------------------------------------------------- vLLM's probes on the public port


async def test_the_public_port_answers_vllms_probes_without_a_key(client):
    # Clients built for vLLM (guidellm) probe /health on the API port before sending
    # load; keys are configured here, and the probes reveal nothing, so none is asked.
    from llmgw import __version__, contracts, keys
    from llmgw.router.admission.config import AdmissionSettings, TenantConfig

    async with fake_engines("a") as (a,):
        cfg = config_for(
            [a],
            admission=AdmissionSettings(),
            tenants=[TenantConfig(name="acme", band="default", key_hashes=[keys.hash_key("sk-x")])],
            bands=[contracts.Band(name="default")],
        )
        async with running_router(cfg) as r:
            async with client.get(r.url + "/health") as resp:
                assert resp.status == 200 and await resp.read() == b""
            for method in ("GET", "POST"):
                async with client.request(method, r.url + "/ping") as resp:
                    assert resp.status == 200
            async with client.get(r.url + "/version") as resp:
                assert resp.status == 200 and await resp.json() == {"version": __version__}
            async with client.get(r.url + "/v1/models") as resp:
                assert resp.status == 401  # the API itself still wants a key
            async with client.get(r.url + "/openapi.json") as resp:
                paths = (await resp.json())["paths"]
            assert paths["/health"]["get"]["security"] == []
            assert set(paths["/ping"]) == {"get", "post"} and "/version" in paths


async def test_the_public_probes_say_503_while_the_router_cannot_route(client):
    # As vLLM answers 503 when its engine is dead: no ready endpoint, nothing to route to.
    from llmgw import __version__

    async with running_router(config_for([])) as r:
        async with client.get(r.admin_url + "/readyz") as resp:
            assert resp.status == 503
        async with client.get(r.url + "/health") as resp:
            assert resp.status == 503 and await resp.read() == b""
        for method in ("GET", "POST"):
            async with client.request(method, r.url + "/ping") as resp:
                assert resp.status == 503
        async with client.get(r.url + "/version") as resp:
            assert resp.status == 200 and await resp.json() == {"version": __version__}


async def test_a_stream_counts_as_prefilling_until_its_first_event(client):
    # The kv_prefix rule weighs the prefill queued at an engine: this router's streamed
    # requests there that have not had their first event. A stuck engine shows both
    # states: `prefilling` sends headers and nothing more, `decoding` one event.
    async with fake_engines("prefilling", "decoding") as (prefilling, decoding):
        prefilling.hang_after, decoding.hang_after = 0, 1
        cfg = config_for(
            [prefilling, decoding],
            model_defaults=rc.ModelDefaults(
                scheduling=rc.SchedulingSpec(scorers={"inflight": 1}, picker="max_score"),
                deadlines=DeadlineSpec(connect=1.0, headers=30, first_token=30, idle=30, total=60),
            ),
        )
        async with running_router(cfg) as r:
            streams = [
                asyncio.create_task(_stream(client, r.url)) for _ in range(2)
            ]  # one each: the inflight scorer sends the second to the other engine

            async def one_prefilling_one_decoding():
                eps = await debug(client, r)
                counts = {name: (e["inflight"], e["prefilling"]) for name, e in eps.items()}
                return counts == {"prefilling": (1, 1), "decoding": (1, 0)}

            await wait_for(one_prefilling_one_decoding)
            async with client.get(r.admin_url + "/metrics") as resp:
                exposition = await resp.text()
            assert 'llmgw_router_endpoint_prefilling{endpoint="prefilling"} 1' in exposition
            assert 'llmgw_router_endpoint_prefilling{endpoint="decoding"} 0' in exposition
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

            async def all_done():
                eps = await debug(client, r)
                return all(e["inflight"] == 0 for e in eps.values())

            await wait_for(all_done)  # the client left: nothing counts any more
            assert all(e["prefilling"] == 0 for e in (await debug(client, r)).values())


async def _stream(client, url):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        async for _ in resp.content:
            pass
