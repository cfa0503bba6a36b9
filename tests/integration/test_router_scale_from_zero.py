"""A router in control-plane mode with a model scaled to zero: the request waits for a replica.

Real NATS, a real router and a real sim engine; the projection is written to KV by
hand, as the reconciler would. The router has no tenants and no band that holds
back, so its admission gate is off until a model that scales from zero appears.
The demand summaries it publishes are read off the real subject.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.dev.routerkit import running_router
from llmgw.dev.simkit import start_sim
from tests.integration.test_router_controlplane import config, put_model, wait_for


@pytest.fixture
def sim():
    with start_sim(model="z", itl_ms=1) as engine:
        yield engine


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_request_waits_at_zero_then_is_served_and_an_unplaceable_model_gets_503(nats, sim):
    js = nats.jetstream()
    await bus.provision(js)
    await put_model(js, c.ModelEndpoints(model="z", scale_from_zero=True))
    latest: dict[str, c.DemandSummary] = {}

    async def on_summary(msg) -> None:
        summary = c.decode(msg.data, c.DemandSummary)
        latest[summary.router_id] = summary

    sub = await nats.subscribe(subjects.DEMAND_ALL, cb=on_summary)
    try:
        async with (
            running_router(config(nats.connected_url.geturl(), "r1")) as r,
            httpx.AsyncClient(timeout=60) as http,
        ):

            async def knows(model: str) -> bool:
                s = latest.get("r1")
                return s is not None and model in s.models

            await wait_for(lambda: knows("z"), what="r1's summary naming z")
            request = asyncio.create_task(http.post(r.url + "/v1/chat/completions", json=chat("z")))

            async def queued() -> bool:
                z = latest["r1"].models.get("z")
                return z is not None and sum(b.queued for b in z.queued.values()) == 1

            await wait_for(queued, what="the request queued in r1's summary")
            assert not request.done()  # no replica: it waits instead of a 503
            assert latest["r1"].models["z"].ready == 0

            # The replica the autoscaler asked for is ready: the waiting request goes to it.
            endpoint = c.Endpoint(id="z-r1-s0", url=sim.url, node="n1", max_running=4)
            await put_model(
                js, c.ModelEndpoints(model="z", scale_from_zero=True, endpoints=[endpoint])
            )
            answer = await asyncio.wait_for(request, 30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"]
            assert answer.headers["x-llmgw-endpoint"] == "z-r1-s0"

            # A model at zero whose replica cannot be placed answers at once.
            why = "y-r1 cannot be placed: no node fits (0 of 1 node fit)"
            await put_model(js, c.ModelEndpoints(model="y", scale_from_zero=True, unplaceable=why))
            await wait_for(lambda: knows("y"), what="r1's summary naming y")
            refused = await http.post(r.url + "/v1/chat/completions", json=chat("y"))
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "10"
            assert refused.headers["x-llmgw-reason"] == "no_replica"
            assert why in refused.json()["error"]["message"]
    finally:
        await sub.unsubscribe()


async def test_a_request_waiting_beside_a_draining_replica_goes_to_the_new_one(nats, sim):
    # Scaling a model back up while its retired replica still drains: the route the
    # request resolved lists only the draining endpoint; when the new replica is ready
    # the request must be sent there, not 503 for want of a ready endpoint.
    js = nats.jetstream()
    await bus.provision(js)
    old = c.Endpoint(
        id="z-r0-s0", url="http://127.0.0.1:9", node="n0", state=c.EndpointState.DRAINING
    )
    await put_model(js, c.ModelEndpoints(model="z", scale_from_zero=True, endpoints=[old]))
    url = nats.connected_url.geturl()
    async with running_router(config(url, "r1")) as r, httpx.AsyncClient(timeout=60) as http:

        async def routed():
            return r.service.view.route("z") is not None

        await wait_for(routed, what="the route of z")
        req = asyncio.create_task(http.post(r.url + "/v1/chat/completions", json=chat("z")))

        async def waiting():
            return r.service.admission.controller.queued == 1

        await wait_for(waiting, what="the request to wait in admission")
        new = c.Endpoint(id="z-r1-s0", url=sim.url, node="n1", max_running=4)
        await put_model(js, c.ModelEndpoints(model="z", scale_from_zero=True, endpoints=[old, new]))
        answer = await asyncio.wait_for(req, 30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
