"""A model scaled to zero: its first requests wait in admission for a replica, and the
router's demand summary shows them to the autoscaler."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from llmgw import contracts
from llmgw.contracts import EndpointState
from llmgw.router.admission import AdmissionGate, AdmissionRejected, AdmissionSettings
from llmgw.router.admission.controller import GRANTED
from llmgw.router.admission.demand import model_demand
from llmgw.router.endpoints.load import Load


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Ep:
    def __init__(self, ident="e1"):
        self.id = ident
        self.state = EndpointState.READY
        self.inflight = 0
        self.load = None
        self.spec = contracts.Endpoint(id=ident, url=f"http://{ident}", max_running=4)


@dataclass
class Route:
    name: str = "m"
    endpoints: tuple = ()
    scale_from_zero: bool = True
    unplaceable: str = ""


class Request:
    body = b"x" * 40
    max_tokens = 10


def open_gate(clock) -> AdmissionGate:
    bands = [contracts.Band(name="default", ceiling=2.0, queue_ttl_seconds=30)]
    g = AdmissionGate(AdmissionSettings(), bands, (), clock=clock, quiet=True)
    g.routes_changed(True)
    return g


async def admit(g, route):
    return await g.admit(Request(), route, g.authenticate({}))


async def queued(g, n: int) -> None:
    """Until `n` requests wait in admission (the waiter task has started and queued)."""
    async with asyncio.timeout(10):
        while g.controller.queued < n:
            await asyncio.sleep(0)


async def test_an_open_gate_turns_on_for_a_model_that_scales_from_zero():
    g = AdmissionGate(AdmissionSettings(), (), (), quiet=True)
    assert not g.active  # no tenants, no band that holds back: the router skips it
    g.routes_changed(True)
    assert g.active


async def test_a_request_waits_for_the_first_replica_then_goes_to_it():
    clock = Clock()
    g = open_gate(clock)
    cold = Route()
    current = {"m": cold}
    g.route_of = current.get
    waiter = asyncio.ensure_future(admit(g, cold))
    await queued(g, 1)
    assert not waiter.done() and g.controller.queued == 1
    # The demand summary shows it waiting, with no replica ready.
    clock.t += 2.5
    d = model_demand(g.controller, "m", cold.endpoints, clock())
    assert d.queued["default"].queued == 1 and d.queued["default"].oldest_wait_seconds == 2.5
    assert (d.ready, d.capacity) == (0, 0)
    g.controller.tick()  # a tick with no endpoint keeps it waiting (saturation 0 would not)
    assert not waiter.done()
    ready = Route(endpoints=(Ep(),))
    current["m"] = ready
    g.endpoints_changed(lambda m: current[m].endpoints)
    ticket = await asyncio.wait_for(waiter, 5)
    # Granted; the proxy then dispatches to the model's current route
    # (test_router_scale_from_zero).
    assert ticket.state == GRANTED


async def test_no_replica_can_be_placed_503_with_retry_after():
    g = open_gate(Clock())
    route = Route(unplaceable="no node has a free GPU")
    with pytest.raises(AdmissionRejected) as exc:
        await admit(g, route)
    assert exc.value.status == 503 and exc.value.reason == "no_replica"
    assert (b"retry-after", b"10") in exc.value.headers
    assert "no node has a free GPU" in exc.value.message


async def test_a_waiting_request_gets_503_when_placement_fails_meanwhile():
    g = open_gate(Clock())
    cold = Route()
    current = {"m": cold}
    g.route_of = current.get
    waiter = asyncio.ensure_future(admit(g, cold))
    await queued(g, 1)
    current["m"] = Route(unplaceable="no node has a free GPU")
    g.endpoints_changed(lambda m: current[m].endpoints)
    with pytest.raises(AdmissionRejected) as exc:
        await asyncio.wait_for(waiter, 5)
    assert exc.value.status == 503 and exc.value.reason == "no_replica"
    assert g.controller.queued == 0


async def test_the_wait_is_bounded_by_the_band_ttl():
    clock = Clock()
    g = open_gate(clock)
    waiter = asyncio.ensure_future(admit(g, Route()))
    await queued(g, 1)
    clock.t += 31
    g.controller.tick()
    with pytest.raises(AdmissionRejected) as exc:
        await asyncio.wait_for(waiter, 5)
    assert exc.value.status == 504


async def test_demand_counts_in_flight_and_capacity_of_ready_endpoints():
    clock = Clock()
    g = open_gate(clock)
    eps = (Ep("e1"), Ep("e2"))
    eps[0].inflight = 3
    draining = Ep("e3")
    draining.state = EndpointState.DRAINING
    d = model_demand(g.controller, "m", (*eps, draining), clock())
    assert (d.in_flight, d.ready, d.capacity, d.capacity_declared) == (3, 2, 8, True)
    assert d.queued == {} and d.waiting == 0
    # An engine without a declared batch size, whose fresh sample shows a queue.
    learned = Ep("e4")
    learned.spec = contracts.Endpoint(id="e4", url="http://e4")
    learned.load = Load(waiting=5, running=2, kv_usage=0.1, at=clock())
    d = model_demand(g.controller, "m", (*eps, learned), clock())
    assert (d.capacity_declared, d.waiting) == (False, 5)
    learned.load = Load(waiting=5, running=2, kv_usage=0.1, at=clock() - 60)  # stale
    assert model_demand(g.controller, "m", (*eps, learned), clock()).waiting == 0


async def test_demand_of_a_disaggregated_model_counts_each_pool_on_its_own_endpoints():
    clock = Clock()
    g = open_gate(clock)
    prefill, decode_a, decode_b = Ep("p1"), Ep("d1"), Ep("d2")
    for ep, role, inflight in (
        (prefill, "prefill", 1),
        (decode_a, "decode", 3),
        (decode_b, "decode", 2),
    ):
        ep.spec = contracts.Endpoint(id=ep.id, url=f"http://{ep.id}", max_running=4, role=role)
        ep.inflight = inflight
    decode_b.state = EndpointState.DRAINING
    d = model_demand(g.controller, "m", (prefill, decode_a, decode_b), clock())
    assert d.pools == {
        "prefill": contracts.PoolDemand(in_flight=1, capacity=4, ready=1),
        "decode": contracts.PoolDemand(in_flight=5, capacity=4, ready=1),
    }
    assert (d.in_flight, d.ready, d.capacity) == (6, 2, 8)  # the whole model, as before
    # An aggregated model reports no pools.
    assert model_demand(g.controller, "m", (Ep("e1"),), clock()).pools == {}


async def test_the_summary_does_not_change_the_endpoints_admission_decides_on():
    clock = Clock()
    g = open_gate(clock)
    serving = Route(endpoints=(Ep("e1"),))
    ticket = await admit(g, serving)  # admission now has a pool for m, on e1
    assert ticket.state == GRANTED
    pool = g.controller.detector.pools["m"]
    before = pool.endpoints
    # The presence tick's view may differ from admission's (a route change not yet
    # applied): the summary judges it, and leaves admission's pool as it was.
    d = model_demand(g.controller, "m", (Ep("e1"), Ep("e2")), clock())
    assert (d.ready, d.capacity, d.in_flight) == (2, 8, 1)
    assert g.controller.detector.pools["m"].endpoints is before
