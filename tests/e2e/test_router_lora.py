"""LoRA adapters through a real `llmgw router` process in control-plane mode.

Real NATS; the projection is written into its KV bucket by hand, as the reconciler
writes it once agents report which adapters each engine holds. Two real sim engines
stand in for vLLM replicas of one base model: each serves the base model's name plus the
adapters it "holds" (its served names), and answers 404 for any other name, as vLLM does
for an adapter it has not loaded. So a request the router sent to the wrong replica, or
with the wrong `model` in its body, fails here.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.dev.routerkit import start_router
from llmgw.dev.simkit import start_sim
from tests.integration.test_router_controlplane import put_model, wait_for

pytestmark = pytest.mark.e2e

BASE = "llama"


@pytest.fixture(scope="module")
def sims():
    # s0 holds a1; s1 will hold a2 once "loaded" (it serves the name from the start:
    # the router must not send it a2's requests before the projection says it holds it).
    started = [
        start_sim(model=BASE, served_model_name=[BASE, "a1"], itl_ms=1),
        start_sim(model=BASE, served_model_name=[BASE, "a2"], itl_ms=1),
    ]
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def record(sims, held: dict[str, list[str]]) -> c.ModelEndpoints:
    return c.ModelEndpoints(
        model=BASE,
        endpoints=[
            c.Endpoint(
                id=f"s{i}", url=s.url, node="n1", max_loras=2, adapters=held.get(f"s{i}", [])
            )
            for i, s in enumerate(sims)
        ],
        adapters=[
            c.AdapterRoute(name="a1"),
            c.AdapterRoute(name="a2"),
            c.AdapterRoute(name="a3", tenants=["acme"]),
        ],
    )


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_adapter_requests_reach_holders_wait_for_a_load_and_unknown_ones_get_404(
    nats, sims, tmp_path
):
    js = nats.jetstream()
    await bus.provision(js)
    await put_model(js, record(sims, {"s0": ["a1"]}))
    latest: dict[str, c.DemandSummary] = {}

    async def on_summary(msg) -> None:
        summary = c.decode(msg.data, c.DemandSummary)
        latest[summary.router_id] = summary

    sub = await nats.subscribe(subjects.DEMAND_ALL, cb=on_summary)
    url = nats.connected_url.geturl()
    router = start_router(tmp_path, f"log_level: warning\nnats_url: '{url}'\nrouter_id: r1\n")
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
            # /v1/models lists the adapters with their parent, not a3 (another tenant's).
            listed = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
            assert set(listed) == {BASE, "a1", "a2"}
            assert listed["a1"]["parent"] == BASE and "parent" not in listed[BASE]
            assert (await http.get("/v1/models/a1")).json()["parent"] == BASE
            assert (await http.get("/v1/models/a3")).status_code == 404

            # An adapter's requests go to its holder, with the adapter as the model.
            for name in ("a1", "a1", "a1", f"{BASE}:a1"):
                answer = await http.post("/v1/chat/completions", json=chat(name))
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-llmgw-endpoint"] == "s0"
                assert answer.json()["model"] == "a1"  # SGLang's form goes as vLLM's

            # Undeclared, or declared for another tenant: the same OpenAI-shaped 404.
            for name in ("ghost", "a3", f"{BASE}:ghost"):
                refused = await http.post("/v1/chat/completions", json=chat(name))
                assert refused.status_code == 404, refused.text
                error = refused.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
                assert name in error["message"]

            # a2 is declared but no replica holds it: the request waits, and the demand
            # summary shows it waiting under the base model for the leader to place.
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=chat("a2")))

            async def a2_waits() -> bool:
                s = latest.get("r1")
                model = s.models.get(BASE) if s is not None else None
                return model is not None and model.adapters.get("a2", c.AdapterDemand()).waiting

            await wait_for(a2_waits, timeout=30, what="a2 waiting in r1's demand summary")
            assert not waiting.done()

            # The agent reports a2 loaded on s1: the waiting request goes there.
            await put_model(js, record(sims, {"s0": ["a1"], "s1": ["a2"]}))
            answer = await asyncio.wait_for(waiting, 30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-llmgw-endpoint"] == "s1"
            assert answer.json()["model"] == "a2"
    finally:
        await sub.unsubscribe()
        assert router.stop() == 0, router.log_tail()


def chat_n(model: str, n: int) -> dict:
    """Distinct bodies (the scheduler breaks ties in turn, so these spread)."""
    return {"model": model, "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 4}


async def test_a_replica_listed_as_holding_an_adapter_it_unloaded_never_costs_a_client_a_404(
    nats, sims, tmp_path
):
    # The projection still lists s1 as holding a1, as it does between the agent's unload
    # and its report reaching the routers; s1 answers 404 for a1 like vLLM after an unload.
    js = nats.jetstream()
    await bus.provision(js)
    await put_model(js, record(sims, {"s0": ["a1"], "s1": ["a1"]}))
    url = nats.connected_url.geturl()
    router = start_router(tmp_path, f"log_level: warning\nnats_url: '{url}'\nrouter_id: r2\n")

    async def s1_holds_a1(http) -> bool:
        body = (await http.get(router.admin_url + "/debug/endpoints")).json()
        return any(e["id"] == "s1" and "a1" in e["adapters"] for e in body["endpoints"])

    def misses_on_s1(http_text: str) -> float:
        for line in http_text.splitlines():
            if line.startswith("llmgw_router_upstream_errors_total{") and (
                'endpoint="s1"' in line and 'kind="adapter_not_loaded"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
            await wait_for(lambda: s1_holds_a1(http), timeout=30, what="s1 listed with a1")
            n = 0
            while await s1_holds_a1(http):
                assert n < 40, "no request was ever scheduled on s1"
                answer = await http.post("/v1/chat/completions", json=chat_n("a1", n))
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-llmgw-endpoint"] == "s0"
                assert answer.json()["model"] == "a1"
                n += 1
            # s1 said it does not hold a1: the router sends it no more a1 requests.
            for m in range(n, n + 10):
                answer = await http.post("/v1/chat/completions", json=chat_n("a1", m))
                assert answer.status_code == 200, answer.text
                assert answer.headers["x-llmgw-endpoint"] == "s0"
            metrics = (await http.get(router.admin_url + "/metrics")).text
            assert misses_on_s1(metrics) == 1

            # A new record listing only s1: the router believes it again. When the only
            # holder answers 404, the request waits for the next one rather than failing.
            await put_model(js, record(sims, {"s1": ["a1"]}))
            await wait_for(lambda: s1_holds_a1(http), timeout=30, what="s1 listed with a1 again")
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=chat_n("a1", 99)))

            async def s1_refuted_a1() -> bool:
                return not await s1_holds_a1(http)

            await wait_for(s1_refuted_a1, timeout=30, what="s1's 404 for a1 seen")
            assert not waiting.done()
            # The leader moved a1 to s0: the waiting request is answered there.
            await put_model(js, record(sims, {"s0": ["a1"]}))
            answer = await asyncio.wait_for(waiting, 30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-llmgw-endpoint"] == "s0"
            assert answer.json()["model"] == "a1"
    finally:
        assert router.stop() == 0, router.log_tail()
