"""LoRA adapters in the router: names, routes, the adapter filter and lora_affinity scorer,
the wait in admission while no replica holds one, and the demand per adapter."""

from __future__ import annotations

import asyncio

import pytest

from llmgw import contracts as c
from llmgw.contracts import AdapterRoute, Endpoint, ModelEndpoints
from llmgw.router.admission import AdmissionGate, AdmissionRejected, AdmissionSettings
from llmgw.router.admission.controller import GRANTED
from llmgw.router.admission.demand import summary
from llmgw.router.endpoints import routes
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.kvcache.indexer import PromptWork
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.lora import adapter_spec

NOW = 1000.0


def ep(ident: str, adapters=(), max_loras=2) -> Endpoint:
    return Endpoint(id=ident, url=f"http://{ident}:1", adapters=list(adapters), max_loras=max_loras)


def base(*eps: Endpoint, adapters=("a1", "a2"), tenants=(), **kw) -> ModelEndpoints:
    return ModelEndpoints(
        model="llama",
        endpoints=list(eps),
        adapters=[AdapterRoute(name=a, tenants=list(tenants)) for a in adapters],
        **kw,
    )


# ------------------------------------------------------------------ names and routes


def test_an_adapter_resolves_by_its_name_and_by_sglangs_base_colon_adapter():
    view = EndpointView()
    view.replace([base(ep("e1", ["a1"]), ep("e2")), ModelEndpoints(model="other", aliases=["o"])])
    route = view.resolve("a1")
    assert route is not None and route.name == "a1" and route.adapter_of == "llama"
    assert view.resolve("llama:a1") is route  # SGLang's form names the same route
    assert view.resolve("other:a1") is None  # not an adapter of that model
    assert view.resolve("o:a1") is None
    assert view.resolve("a9") is None and view.resolve("llama:a9") is None
    assert view.resolve("llama").adapter_of == ""  # the model itself is untouched
    assert view.route("a1") is route  # by name, as admission and a waited request look it up


def test_an_adapter_route_has_the_holders_and_waits_while_there_are_none():
    view = EndpointView()
    view.replace([base(ep("e1", ["a1"]), ep("e2", ["a1", "a2"]), ep("e3"))])
    a1, a2 = view.resolve("a1"), view.resolve("a2")
    assert [e.id for e in a1.endpoints] == ["e1", "e2"]
    assert [e.id for e in a2.endpoints] == ["e2"]
    assert a1.fallbacks == () and a1.scale_from_zero  # waits for a holder, never falls back
    assert view.endpoints["e2"].models == {"llama", "a1", "a2"}
    # The model's own requests still see every replica.
    assert len(view.resolve("llama").endpoints) == 3
    # The agents report a2 loaded on e3: the next route has it.
    view.replace([base(ep("e1", ["a1"]), ep("e2", ["a1", "a2"]), ep("e3", ["a2"]))])
    assert [e.id for e in view.resolve("a2").endpoints] == ["e2", "e3"]
    assert [a.name for a in view.adapters()] == ["a1", "a2"]


def test_an_adapter_that_clashes_with_a_model_an_alias_or_another_adapter_is_dropped():
    table, problems = routes.build(
        [
            ModelEndpoints(
                model="llama",
                aliases=["ll"],
                adapters=[AdapterRoute(name=n) for n in ("mistral", "ll", "a1", "ok")],
            ),
            ModelEndpoints(model="mistral", adapters=[AdapterRoute(name="a1")]),
        ]
    )
    assert set(table.adapters) == {"a1", "ok"}
    assert table.adapters["a1"][0] == "llama"
    assert problems == [
        "model 'llama': adapter 'mistral' is model",
        "model 'llama': adapter 'll' is an alias of model 'llama'",
        "model 'mistral': adapter 'a1' is already an adapter of model 'llama'",
    ]


class Caller:
    def __init__(self, owner):
        self.owner = owner


def test_an_adapter_limited_to_tenants_is_theirs_alone():
    view = EndpointView()
    view.replace([base(ep("e1", ["a1"]), adapters=("a1",), tenants=("acme",))])
    route = view.resolve("a1")
    assert route.allows(Caller("acme"))
    assert not route.allows(Caller("globex"))
    assert not route.allows(None)  # no tenant at all
    assert view.resolve("llama").allows(None)


# ------------------------------------------------------------------ filter and scorer


def ctx(adapter: str | None) -> sc.Context:
    context = sc.Context(NOW, adapter or "llama")
    context.adapter = adapter
    return context


def runtimes(view: EndpointView, *ids: str):
    return [view.endpoints[i] for i in ids]


def sample(running=(), waiting=(), age=0.0) -> Load:
    return Load(
        waiting=0,
        running=0,
        kv_usage=0.0,
        at=NOW - age,
        running_adapters=frozenset(running),
        waiting_adapters=frozenset(waiting),
    )


def test_the_adapter_filter_keeps_holders_for_an_adapter_request_and_all_for_the_model():
    view = EndpointView()
    view.replace([base(ep("e1", ["a1"]), ep("e2"))])
    cands = runtimes(view, "e1", "e2")
    holds = sc.FILTERS["adapter"](sc.Settings())
    assert [e.id for e in holds.select(cands, ctx("a1"))] == ["e1"]
    assert [e.id for e in holds.select(cands, ctx(None))] == ["e1", "e2"]
    # It reads the endpoint's state now: unloaded since the route was resolved, not kept.
    view.replace([base(ep("e1"), ep("e2"))])
    assert holds.select(cands, ctx("a1")) == []


def test_lora_affinity_prefers_running_then_room_then_waiting():
    view = EndpointView()
    eps = [ep(f"e{i}", ["a1", "b", "c"], max_loras=2) for i in range(5)]
    view.replace([base(*eps, adapters=("a1", "b", "c"))])
    e0, e1, e2, e3, e4 = runtimes(view, "e0", "e1", "e2", "e3", "e4")
    e0.load = sample(running=["a1", "b"])  # running it: joins the batch
    e1.load = sample(running=["b"])  # held, a free adapter slot
    e2.load = sample(running=["b"], waiting=["a1", "c"])  # queued there, no slot
    e3.load = sample(running=["b", "c"])  # held, every slot busy with others
    e4.load = sample(running=["b", "c"], age=5.0)  # stale: nothing says it is busy
    scorer = sc.SCORERS["lora_affinity"](sc.Settings(stale_after=1.0))
    out = [0.0] * 5
    scorer.score([e0, e1, e2, e3, e4], ctx("a1"), out)
    assert out == [1.0, 0.8, 0.6, 0.0, 0.8]
    base_request = [0.0] * 5
    scorer.score([e0, e1, e2, e3, e4], ctx(None), base_request)
    assert base_request == [0.0] * 5  # a model's own request: neutral


def test_an_adapter_request_goes_to_the_holder_running_it():
    view = EndpointView()
    view.replace([base(ep("e1", ["a1"]), ep("e2", ["a1"]), ep("e3"))])
    e1, e2 = runtimes(view, "e1", "e2")
    e1.load = sample(running=["a2", "b"])
    e2.load = sample(running=["a1"])
    route = view.resolve("a1")
    assert route.pipeline.pick(route.endpoints, ctx("a1")).id == "e2"


def test_the_adapter_pipeline_adds_its_plugins_and_keeps_the_models_weights():
    spec = c.SchedulingSpec(scorers={"queue": 1.0, "lora_affinity": 0.0})
    got = adapter_spec(spec)
    assert got.filters == ["serves_model", "ready", "circuit", "adapter"]
    assert got.scorers == {"queue": 1.0, "lora_affinity": 0.0}  # turned off stays off
    assert adapter_spec(c.SchedulingSpec()).scorers["lora_affinity"] == 2.0
    assert adapter_spec(got) == got


def test_an_adapters_prompt_blocks_are_rooted_at_the_adapter():
    from llmgw import kvblocks

    assert PromptWork("a1").root == kvblocks.root_for("a1") != kvblocks.ROOT
    assert PromptWork().root == kvblocks.ROOT


# ------------------------------------------------------------------ admission and demand


class Request:
    body = b"x" * 40
    max_tokens = 10


def gate() -> AdmissionGate:
    bands = [c.Band(name="default", ceiling=2.0, queue_ttl_seconds=30)]
    g = AdmissionGate(AdmissionSettings(), bands, (), clock=lambda: NOW, quiet=True)
    g.routes_changed(True)
    return g


async def until_queued(g: AdmissionGate, n: int) -> None:
    async with asyncio.timeout(10):
        while g.controller.queued < n:
            await asyncio.sleep(0)


async def test_a_request_for_an_adapter_nobody_holds_waits_then_goes_when_one_does():
    view = EndpointView()
    view.replace([base(ep("e1"), ep("e2"))])
    g = gate()
    g.route_of = view.route
    waiter = asyncio.ensure_future(g.admit(Request(), view.resolve("a1"), g.authenticate({})))
    await until_queued(g, 1)
    # The model's own requests are not held behind it.
    own = await g.admit(Request(), view.resolve("llama"), g.authenticate({}))
    assert own.state == GRANTED
    own.release()
    # The urgent summary sent as it starts waiting shows it waiting and leaves its arrival
    # to the next: the leader may never read the urgent one (it keeps a router's latest).
    urgent = summary("r1", g.controller, view, take_arrivals=False).models["llama"].adapters
    assert urgent["a1"] == c.AdapterDemand(requests=0, in_flight=0, waiting=1)
    # The demand summary shows the adapter waiting, under its model.
    demand = summary("r1", g.controller, view).models["llama"].adapters
    assert demand["a1"] == c.AdapterDemand(requests=1, in_flight=0, waiting=1)
    assert demand["a2"] == c.AdapterDemand()
    assert not waiter.done()
    # An agent reports a1 loaded on e2.
    view.replace([base(ep("e1"), ep("e2", ["a1"]))])
    g.endpoints_changed(lambda m: view.route(m).endpoints if view.route(m) else ())
    ticket = await asyncio.wait_for(waiter, 5)
    assert ticket.state == GRANTED
    demand = summary("r1", g.controller, view).models["llama"].adapters
    # The arrival was taken by the previous summary; now it is in flight.
    assert demand["a1"] == c.AdapterDemand(requests=0, in_flight=1, waiting=0)


async def test_an_adapter_not_loaded_within_the_queue_ttl_gets_503_with_retry_after():
    now = [NOW]
    view = EndpointView()
    view.replace([base(ep("e1"))])
    bands = [c.Band(name="default", ceiling=2.0, queue_ttl_seconds=30)]
    g = AdmissionGate(AdmissionSettings(), bands, (), clock=lambda: now[0], quiet=True)
    waiter = asyncio.ensure_future(g.admit(Request(), view.resolve("a1"), g.authenticate({})))
    await until_queued(g, 1)
    now[0] += 31
    g.controller.tick()
    with pytest.raises(AdmissionRejected) as exc:
        await asyncio.wait_for(waiter, 5)
    assert exc.value.status == 503 and exc.value.reason == "adapter_not_loaded"
    assert (b"retry-after", b"5") in exc.value.headers
    assert "'a1'" in exc.value.message
