"""Routers in control-plane mode against real NATS, real sim engines and the openai SDK.

The projection is written to KV by hand here (as the reconciler would), so each
test controls exactly what the router sees. Latencies are printed, never
asserted (see tests/bench/bench_projection_latency.py for the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
import msgspec
import openai
import pytest

from llmgw import bus, certs, keys, natsconfig, projection, subjects, tlsconfig
from llmgw import contracts as c
from llmgw.dev import servers as localservers
from llmgw.dev.routerkit import running_router, start_router
from llmgw.dev.simkit import start_sim
from llmgw.router import config as rc

MODEL = "m"
KEY = "sk-acme-test"


@pytest.fixture(scope="module")
def sims():
    started = []
    try:
        for _ in range(2):
            started.append(start_sim(model=MODEL, itl_ms=1))
        yield started
    finally:
        for sim in started:
            sim.stop()


def record(*sims, model: str = MODEL) -> c.ModelEndpoints:
    return c.ModelEndpoints(
        model=model,
        endpoints=[c.Endpoint(id=f"shard-{s.port}", url=s.url, node="n1") for s in sims],
    )


async def put(js, record: projection.Record) -> None:
    """Write a record where the reconciler would."""
    bucket, key = projection.key_of(record).target
    await (await js.key_value(bucket)).put(key, projection.encode(record))


async def put_model(js, rec: c.ModelEndpoints) -> None:
    await put(js, rec)


async def put_tenants(js, *tenants: c.TenantRecord) -> None:
    await put(js, c.BandsRecord(bands=[c.Band(name="gold", ceiling=1.5)]))
    for t in tenants:
        await put(js, t)


def config(nats_url: str, router_id: str) -> rc.RouterConfig:
    return rc.RouterConfig(
        nats_url=nats_url,
        router_id=router_id,
        scrape=rc.ScrapeConfig(interval_seconds=0.05, stale_after_seconds=2.0),
    )


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> float:
    """Poll an async predicate; returns the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if await predicate():
            return time.monotonic() - began
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} not reached within {timeout}s")


async def endpoint_ids(http: httpx.AsyncClient, admin_url: str) -> set[str]:
    body = (await http.get(admin_url + "/debug/endpoints")).json()
    return {e["id"] for e in body["endpoints"]}


async def ready(http: httpx.AsyncClient, admin_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (await http.get(admin_url + "/readyz")).status_code == 200
    return False


def chat(**kw):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        **kw,
    }


async def test_the_projection_is_served_and_changes_and_deletes_reach_the_router(nats, sims):
    js = nats.jetstream()
    await bus.provision(js)
    await put_model(js, record(sims[0]))
    async with (
        running_router(config(nats.connected_url.geturl(), "r1")) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        await wait_for(lambda: ready(http, r.admin_url), what="/readyz 200")
        sdk = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0)
        answer = await sdk.chat.completions.create(**chat())
        assert answer.choices[0].message.content
        stream = await sdk.chat.completions.create(**chat(stream=True))
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        # Move the model to the other engine: the change reaches the router.
        began = time.monotonic()
        await put_model(js, record(sims[1]))
        moved = {f"shard-{sims[1].port}"}

        async def moved_there():
            return await endpoint_ids(http, r.admin_url) == moved

        await wait_for(moved_there, what="the changed endpoint set")
        print(f"\nendpoint change visible in the router after {time.monotonic() - began:.4f}s")
        raw = await sdk.chat.completions.with_raw_response.create(**chat())
        assert raw.headers["x-llmgw-endpoint"] == f"shard-{sims[1].port}"

        # The agents' samples feed the view, and the router stops scraping the engine.
        ep_id = f"shard-{sims[1].port}"
        scrapes = f'llmgw_router_scrapes_total{{endpoint="{ep_id}"}}'

        def scraped(text: str) -> float:
            line = next((ln for ln in text.splitlines() if ln.startswith(scrapes)), None)
            return float(line.rsplit(" ", 1)[1]) if line else 0.0

        counts = []
        for i in range(10):
            sample = c.LoadSample(
                node="n1", shard_id=ep_id, model=MODEL, url=sims[1].url, waiting=7, running=2
            )
            await nats.publish(subjects.load("n1"), c.encode(sample))
            await asyncio.sleep(0.1)
            if i in (4, 9):
                counts.append(scraped((await http.get(r.admin_url + "/metrics")).text))
        body = (await http.get(r.admin_url + "/debug/endpoints")).json()
        load = body["endpoints"][0]["load"]
        assert (load["source"], load["waiting"], load["running"]) == ("agent", 7, 2)
        assert counts[0] == counts[1]  # samples flow: no scraping in between

        # The model leaves the catalog: 404 through the SDK.
        await (await js.key_value(projection.ENDPOINTS_BUCKET)).delete(projection.model_key(MODEL))

        async def gone():
            resp = await http.post(r.url + "/v1/chat/completions", json=chat())
            return resp.status_code == 404

        await wait_for(gone, what="404 after the DEL")
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(**chat())


async def test_tenants_from_kv_require_a_key(nats, sims):
    js = nats.jetstream()
    await bus.provision(js)
    acme = c.TenantRecord(name="acme", band="gold", key_hashes=[keys.hash_key(KEY)])
    await put_tenants(js, acme)
    await put_model(js, record(sims[0]))
    async with (
        running_router(config(nats.connected_url.geturl(), "r1")) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        await wait_for(lambda: ready(http, r.admin_url), what="/readyz 200")
        resp = await http.post(r.url + "/v1/chat/completions", json=chat())
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key"
        sdk = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0)
        assert (await sdk.chat.completions.create(**chat())).choices
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(
                base_url=r.url + "/v1", api_key="sk-wrong", max_retries=0
            ).chat.completions.create(**chat())


async def test_a_tenants_cache_isolation_from_kv_keeps_its_prefix_cache_its_own(nats, sims):
    js = nats.jetstream()
    await bus.provision(js)
    isolated = [
        c.TenantRecord(
            name=name, band="gold", key_hashes=[keys.hash_key(f"sk-{name}")], cache_isolation=iso
        )
        for name, iso in (("iso-a", "tenant"), ("iso-b", "tenant"))
    ]
    await put_tenants(js, *isolated)
    await put_model(js, record(sims[0]))
    system = {"role": "system", "content": "A system prompt no other test sends. " * 20}

    async def cached(http: httpx.AsyncClient, url: str, tenant: str, user: str) -> int:
        body = chat(messages=[system, {"role": "user", "content": user}])
        resp = await http.post(url, json=body, headers={"Authorization": f"Bearer sk-{tenant}"})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with (
        running_router(config(nats.connected_url.geturl(), "r1")) as r,
        httpx.AsyncClient(timeout=10) as http,
    ):
        await wait_for(lambda: ready(http, r.admin_url), what="/readyz 200")
        url = r.url + "/v1/chat/completions"
        assert await cached(http, url, "iso-a", "one") == 0
        assert await cached(http, url, "iso-a", "two") > 0
        assert await cached(http, url, "iso-b", "one") == 0


async def test_two_live_routers_halve_a_tenants_quota(nats, sims):
    js = nats.jetstream()
    await bus.provision(js)
    acme = c.TenantRecord(
        name="acme", band="gold", key_hashes=[keys.hash_key(KEY)], quotas=c.Quotas(rpm=4)
    )
    await put_tenants(js, acme)
    await put_model(js, record(sims[0]))
    url = nats.connected_url.geturl()
    auth = {"Authorization": f"Bearer {KEY}"}
    async with (
        running_router(config(url, "r1")) as r1,
        httpx.AsyncClient(timeout=10) as http,
    ):
        async with running_router(config(url, "r2")) as r2:

            async def both_see_two():
                return all(
                    r.service.admission.controller.routers == 2 for r in (r1, r2)
                ) and await ready(http, r1.admin_url)

            await wait_for(both_see_two, what="two live routers")
            statuses = [
                (await http.post(r1.url + "/v1/chat/completions", json=chat(), headers=auth))
                for _ in range(3)
            ]
            assert [s.status_code for s in statuses] == [200, 200, 429]
            # This router's half of the tenant's rpm 4, stated beside the tenant's limit.
            assert "limit 4, 2 of it on this router of 2" in statuses[2].json()["error"]["message"]

        # r2 stopped and left the presence bucket: r1's share is the whole quota again.
        async def one_left():
            return r1.service.admission.controller.routers == 1

        await wait_for(one_left, what="one live router")
        resp = await http.post(r1.url + "/v1/chat/completions", json=chat(), headers=auth)
        assert resp.status_code == 200


async def test_behind_two_routers_the_rate_limit_headers_state_the_tenants_limit(nats, sims):
    # rpm 6,000 behind two routers: each enforces 3,000, the client's limit is 6,000.
    js = nats.jetstream()
    await bus.provision(js)
    acme = c.TenantRecord(
        name="acme",
        band="gold",
        key_hashes=[keys.hash_key(KEY)],
        quotas=c.Quotas(rpm=6000, tpm=1_000_000),
    )
    await put_tenants(js, acme)
    await put_model(js, record(sims[0]))
    url = nats.connected_url.geturl()
    async with (
        running_router(config(url, "r1")) as r1,
        running_router(config(url, "r2")) as r2,
        httpx.AsyncClient(timeout=10) as http,
    ):

        async def both_see_two():
            return all(
                r.service.admission.controller.routers == 2 for r in (r1, r2)
            ) and await ready(http, r1.admin_url)

        await wait_for(both_see_two, what="two live routers")
        sdk = openai.AsyncOpenAI(base_url=r1.url + "/v1", api_key=KEY, max_retries=0)
        raw = await sdk.chat.completions.with_raw_response.create(**chat())
        headers = raw.headers
        assert headers["x-ratelimit-limit-requests"] == "6000"
        # This router's share left (2,999 of 3,000), for the two routers.
        assert headers["x-ratelimit-remaining-requests"] == "5998"
        assert headers["x-ratelimit-limit-tokens"] == "1000000"


async def test_a_nats_outage_keeps_the_router_serving_and_updates_flow_after(tmp_path, sims):
    server = localservers.NatsServer(tmp_path / "nats").start()
    router = None
    try:
        nc = await bus.connect(server.url, "test", wait_for_server=False)
        js = nc.jetstream()
        await bus.provision(js)
        await put_model(js, record(sims[0]))
        await bus.close_quietly(nc)
        router = await asyncio.to_thread(
            start_router, tmp_path, f"nats_url: {server.url}\nrouter_id: outage\n"
        )
        async with httpx.AsyncClient(timeout=10) as http:
            server.stop()

            async def noticed():  # disconnected, reconnecting
                metrics = (await http.get(router.admin_url + "/metrics")).text
                return "llmgw_router_nats_connected 0.0" in metrics

            await wait_for(noticed, what="the router to notice the outage")
            resp = await http.post(router.url + "/v1/chat/completions", json=chat())
            assert resp.status_code == 200
            assert (await http.get(router.admin_url + "/readyz")).status_code == 200

            await asyncio.to_thread(server.start)
            began = time.monotonic()
            nc = await bus.connect(server.url, "test", wait_for_server=False)
            try:
                await put_model(nc.jetstream(), record(sims[1]))
            finally:
                await bus.close_quietly(nc)
            moved = {f"shard-{sims[1].port}"}

            async def moved_there():
                return await endpoint_ids(http, router.admin_url) == moved

            await wait_for(moved_there, timeout=15, what="an update after the restart")
            print(f"\nfirst update after the NATS restart seen in {time.monotonic() - began:.3f}s")
            resp = await http.post(router.url + "/v1/chat/completions", json=chat())
            assert resp.status_code == 200
            assert resp.headers["x-llmgw-endpoint"] == f"shard-{sims[1].port}"
    finally:
        if router is not None:
            router.stop()
        server.stop()


@contextlib.contextmanager
def secure_nats(tmp_path, nodes: list[str], routers: int):
    """A nats-server with mutual TLS and the generated per-identity permissions; yields
    the certificates' folder and the server."""
    cert_dir = tmp_path / "certs"
    certs.init(cert_dir, nodes, routers=routers)
    port = localservers.free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        natsconfig.render(
            certs.read_identities(cert_dir), str(cert_dir), port=port, store_dir=str(tmp_path)
        )
    )
    server = localservers.ConfiguredNatsServer(
        tmp_path / "server", port=port, config_file=conf
    ).start()
    try:
        yield cert_dir, server
    finally:
        server.stop()


async def test_a_router_under_mtls_reads_the_projection_and_announces_itself(
    tmp_path, sims, caplog
):
    caplog.set_level(logging.WARNING, logger="llmgw.bus")
    with secure_nats(tmp_path, ["node-a"], routers=1) as (cert_dir, server):
        opts = tlsconfig.nats_options(tlsconfig.from_certs_dir(cert_dir, "reconciler"))
        nc = await bus.connect(server.url, "reconciler", wait_for_server=False, **opts)
        js = nc.jetstream()
        await bus.provision(js)  # only the reconciler may
        await put_model(js, record(sims[0]))
        cfg = msgspec.structs.replace(
            config(server.url, "router-1"), nats_tls=tlsconfig.from_certs_dir(cert_dir, "router-1")
        )
        async with running_router(cfg) as r, httpx.AsyncClient(timeout=10) as http:
            await wait_for(lambda: ready(http, r.admin_url), what="/readyz 200")
            assert (await http.post(r.url + "/v1/chat/completions", json=chat())).status_code == 200
            presence = await js.key_value(subjects.ROUTERS_BUCKET)

            async def announced():
                with contextlib.suppress(Exception):
                    entry = await presence.get(subjects.router_key("router-1"))
                    return c.decode(entry.value, c.RouterPresence).router_id == "router-1"
                return False

            await wait_for(announced, what="the router's presence")
            # The reconciler's later writes reach it too.
            await put_model(js, record(sims[1]))
            moved = {f"shard-{sims[1].port}"}

            async def moved_there():
                return await endpoint_ids(http, r.admin_url) == moved

            await wait_for(moved_there, what="the changed endpoint set")
        await bus.close_quietly(nc)
    assert "permissions violation" not in caplog.text.lower()


async def test_a_router_under_mtls_takes_its_id_from_its_certificate_and_speaks_as_it(
    tmp_path, caplog
):
    """With no router_id configured, the router with router-2's certificate is router-2: it
    announces, publishes demand and leaves the bucket on stop under that id, which are the
    only presence key and demand subject NATS lets router-2's identity use."""
    caplog.set_level(logging.WARNING, logger="llmgw.bus")
    with secure_nats(tmp_path, [], routers=2) as (cert_dir, server):
        opts = tlsconfig.nats_options(tlsconfig.from_certs_dir(cert_dir, "reconciler"))
        nc = await bus.connect(server.url, "reconciler", wait_for_server=False, **opts)
        await bus.provision(nc.jetstream())
        presence = await nc.jetstream().key_value(subjects.ROUTERS_BUCKET)
        summaries: asyncio.Queue = asyncio.Queue()

        async def on_summary(msg):
            await summaries.put(msg)

        await nc.subscribe(subjects.DEMAND_ALL, cb=on_summary)
        cfg = rc.RouterConfig(
            nats_url=server.url, nats_tls=tlsconfig.from_certs_dir(cert_dir, "router-2")
        )
        key = subjects.router_key("router-2")
        async with running_router(cfg) as r:
            assert r.service.config.router_id == "router-2"

            async def announced():
                with contextlib.suppress(Exception):
                    entry = await presence.get(key)
                    return c.decode(entry.value, c.RouterPresence).router_id == "router-2"
                return False

            await wait_for(announced, what="router-2's presence")
            msg = await asyncio.wait_for(summaries.get(), 15)
            assert msg.subject == subjects.demand("router-2")
            assert c.decode(msg.data, c.DemandSummary).router_id == "router-2"

        async def left():
            try:
                await presence.get(key)
            except Exception:
                return True
            return False

        await wait_for(left, what="router-2 leaving the presence bucket on stop")
        await bus.close_quietly(nc)
    assert "permissions violation" not in caplog.text.lower()


# ------------------------------------------- fallbacks whose record has not arrived yet

NOT_DECLARED = "fallback 'small' is not a declared model or alias"


def with_fallback(sim, model: str, *fallbacks: str) -> c.ModelEndpoints:
    return msgspec.structs.replace(record(sim, model=model), fallbacks=list(fallbacks))


@pytest.mark.parametrize("order", ["snapshot", "fallback first", "model first"])
async def test_a_fallback_whose_record_arrives_after_its_model_is_not_warned_about(
    nats, sims, caplog, order
):
    # The reconciler writes one record per model, one at a time (`llmgw dev` logged
    # this on every start): until the fallback's own record arrives it is pending.
    caplog.set_level(logging.DEBUG, logger="llmgw.router.endpoints")
    js = nats.jetstream()
    await bus.provision(js)
    chat, small = with_fallback(sims[0], "chat", "small"), record(sims[1], model="small")
    first, second = (small, chat) if order == "fallback first" else (chat, small)
    if order == "snapshot":
        await put_model(js, first)
        await put_model(js, second)
    async with running_router(config(nats.connected_url.geturl(), "r1")) as r:
        view = r.service.view
        if order != "snapshot":
            await wait_for(_async(lambda: view.version > 0), what="the first snapshot")
            await put_model(js, first)
            await wait_for(_async(lambda: view.resolve(first.model)), what="the first record")
            await put_model(js, second)

        def chained():
            route = view.resolve("chat")
            return route is not None and route.fallbacks == ("small",)

        await wait_for(_async(chained), what="chat falling back to small")
    warnings = [m for m in caplog.records if m.levelno >= logging.WARNING]
    assert not [m for m in warnings if NOT_DECLARED in m.getMessage()]


async def test_a_fallback_that_is_never_declared_is_warned_about_once(
    nats, sims, caplog, monkeypatch
):
    from llmgw.router.endpoints import problemlog

    caplog.set_level(logging.DEBUG, logger="llmgw.router.endpoints")
    monkeypatch.setattr(problemlog, "GRACE_SECONDS", 0.2)
    js = nats.jetstream()
    await bus.provision(js)
    await put_model(js, with_fallback(sims[0], "chat", "small"))
    async with running_router(config(nats.connected_url.geturl(), "r1")) as r:
        view = r.service.view

        def warned():
            return [
                m
                for m in caplog.records
                if m.levelno == logging.WARNING and NOT_DECLARED in m.getMessage()
            ]

        await wait_for(_async(warned), what="the warning")
        # Later changes of the view do not repeat it, nor start another wait.
        await put_model(js, record(sims[1], model="other"))
        await wait_for(_async(lambda: view.resolve("other")), what="other")
        await put_model(js, with_fallback(sims[0], "chat", "small", "other"))
        await wait_for(_async(lambda: view.resolve("chat").fallbacks == ("other",)), what="chat")
        assert not view.problems.pending
        assert len(warned()) == 1


def _async(predicate):
    async def check():
        return bool(predicate())

    return check
