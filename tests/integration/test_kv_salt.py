"""cache_salt end to end: simulators cache a salted prompt apart and say so in their KV
events, the agent's relay hashes the salt into the block, and a router sends a salted
request to the engine holding that salt's prefix, not to one holding the same text
unsalted (one NATS server, two simulator processes, a relay, a control-plane router)."""

from __future__ import annotations

import httpx

from llmgw import bus
from llmgw.dev.routerkit import running_router

from .test_kv_events import (
    MODEL,
    blocks_of,
    config,
    fleet,
    index_of,
    messages,
    put_model,
    record,
    wait_for,
)

SALT = "tenant-0-secret"


async def chat(http: httpx.AsyncClient, url: str, msgs: list[dict], salt: str | None = None):
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    r = await http.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r


async def test_a_salted_request_goes_to_the_engine_holding_its_salted_prefix(nats):
    js = nats.jetstream()
    await bus.provision(js)
    url = nats.connected_url.geturl()
    async with (
        fleet(url) as (relays, sims),
        running_router(config(url, "r1")) as router,
        httpx.AsyncClient(timeout=20) as http,
    ):
        await put_model(js, record(sims))
        await wait_for(lambda: router.service.view.route(MODEL), what="the projection")
        await wait_for(
            lambda: all(index_of(router).has_events(f"shard-{i}") for i in (0, 1)),
            what="start-up snapshots",
        )
        # Engine 0 holds the first turn under the salt; engine 1 holds the same text, two
        # turns of it, unsalted: more of the prompt, as far as the text goes.
        await chat(http, sims[0].url, messages(0, 1), SALT)
        await chat(http, sims[1].url, messages(0, 2))
        await wait_for(
            lambda: all(r.blocks.hashes() for r in relays.relays.values()),
            what="the relays hearing both engines",
        )
        warm0 = set(relays.relays["shard-0"].blocks.hashes())
        warm1 = set(relays.relays["shard-1"].blocks.hashes())
        assert not warm0 & warm1  # the salted blocks are not the unsalted ones
        await wait_for(
            lambda: (
                blocks_of(index_of(router), "shard-0") == warm0
                and blocks_of(index_of(router), "shard-1") == warm1
            ),
            what="the router indexing both engines' blocks",
        )
        # The salted third turn: only engine 0 can reuse anything (the old hashes credited
        # engine 1 with the longer prefix and sent it there, to a full prefill).
        before = [s.state()["prefix_cache_hits"] for s in sims]
        resp = await chat(http, router.url, messages(0, 3), SALT)
        assert resp.headers["x-llmgw-endpoint"] == "shard-0"
        assert sims[0].state()["prefix_cache_hits"] > before[0]
        # The unsalted third turn goes where the unsalted prefix is, another salt nowhere warm.
        resp = await chat(http, router.url, messages(0, 3))
        assert resp.headers["x-llmgw-endpoint"] == "shard-1"
        assert sims[1].state()["prefix_cache_hits"] > before[1]
        hits = [s.state()["prefix_cache_hits"] for s in sims]
        await chat(http, router.url, messages(0, 3), "another-tenant")
        assert [s.state()["prefix_cache_hits"] for s in sims] == hits
