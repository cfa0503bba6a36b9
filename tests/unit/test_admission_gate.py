"""The asyncio shell: waiting, cancellation by the proxy, the TTL timer, the token estimate."""

from __future__ import annotations

import asyncio

import pytest

from llmgw import contracts, keys
from llmgw.contracts import EndpointState
from llmgw.router.admission import AdmissionGate, AdmissionRejected, AdmissionSettings
from llmgw.router.admission.config import TenantConfig
from llmgw.router.admission.controller import GRANTED, REJECTED
from llmgw.router.admission.gate import estimate_tokens
from llmgw.router.request.body import Usage


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Ep:
    def __init__(self):
        self.id = "e1"
        self.state = EndpointState.READY
        self.inflight = 0
        self.load = None
        self.spec = contracts.Endpoint(id="e1", url="http://e1", max_running=1)


class Route:
    def __init__(self):
        self.name = "m"
        self.endpoints = (Ep(),)


class Request:
    def __init__(self, body: bytes = b"x" * 400, max_tokens: int | None = 100):
        self.body = body
        self.max_tokens = max_tokens


KEY = "sk-acme"
HEADERS = {b"authorization": f"Bearer {KEY}".encode()}


def admit(g: AdmissionGate, request: Request, route: Route, headers=HEADERS):
    """What the proxy does: authenticate on the headers, admit once the body is parsed."""
    return g.admit(request, route, g.authenticate(headers))


def gate(clock, **settings) -> AdmissionGate:
    settings.setdefault("queue_threshold", 1.0)
    bands = [contracts.Band(name="bronze", ceiling=0.5, queue_ttl_seconds=5)]
    tenants = [
        TenantConfig(
            name="acme",
            band="bronze",
            key_hashes=[keys.hash_key(KEY)],
            quotas=contracts.Quotas(tpm=100_000),
        )
    ]
    return AdmissionGate(AdmissionSettings(**settings), bands, tenants, clock=clock)


async def test_a_queued_request_waits_for_capacity():
    g = gate(Clock())
    route = Route()
    first = await admit(g, Request(), route)
    await admit(g, Request(), route)  # capacity 1 + 1: now at the ceiling
    waiter = asyncio.ensure_future(admit(g, Request(), route))
    await asyncio.sleep(0)
    assert not waiter.done() and g.controller.queued == 1
    first.release(Usage(prompt_tokens=10, completion_tokens=5))
    third = await asyncio.wait_for(waiter, 5)
    assert third.state == GRANTED
    g.close()


async def test_a_cancelled_wait_leaves_the_queue():
    g = gate(Clock())
    route = Route()
    held = [await admit(g, Request(), route) for _ in range(2)]
    waiter = asyncio.ensure_future(admit(g, Request(), route))
    await asyncio.sleep(0)
    ticket = next(iter(g.controller.queues["m"][0]._arrivals))
    waiter.cancel()  # what the proxy does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ticket.state == REJECTED and g.controller.queued == 0
    assert g.controller.directory.by_name["acme"].quotas.in_flight == 2
    held[0].release()
    assert g.controller.detector.pools["m"].active == 1  # nothing granted to the departed
    g.close()


async def test_a_grant_that_races_a_cancellation_is_given_back():
    g = gate(Clock())
    route = Route()
    held = [await admit(g, Request(), route) for _ in range(2)]
    waiter = asyncio.ensure_future(admit(g, Request(), route))
    await asyncio.sleep(0)
    held[0].release()  # grants the waiter; it has not resumed yet
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert g.controller.detector.pools["m"].active == 1
    g.close()


async def test_the_timer_expires_a_queued_request_with_504():
    clock = Clock()
    g = gate(clock, tick_seconds=0.01)
    route = Route()
    for _ in range(2):
        await admit(g, Request(), route)
    waiter = asyncio.ensure_future(admit(g, Request(), route))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # ticks ran, but the fake clock has not reached the TTL
    clock.t += 5.0
    with pytest.raises(AdmissionRejected) as err:
        await asyncio.wait_for(waiter, 5)
    assert (err.value.status, err.value.reason) == (504, "queue_timeout")
    g.close()


async def test_rejections_are_raised_before_any_wait():
    g = gate(Clock())
    with pytest.raises(AdmissionRejected) as err:
        g.authenticate({})  # no body needed to refuse a request without a key
    assert err.value.status == 401
    with pytest.raises(AdmissionRejected) as err:
        await admit(g, Request(max_tokens=200_000), Route())
    assert err.value.reason == "request_too_large"


def test_the_gate_is_skipped_only_when_it_has_nothing_to_do():
    held = [contracts.Band(name="bronze", ceiling=0.8)]
    assert not AdmissionGate(AdmissionSettings(enabled=False)).active
    assert not AdmissionGate(AdmissionSettings()).active  # default band: never held back
    assert AdmissionGate(AdmissionSettings(), held).active
    assert not AdmissionGate(AdmissionSettings(enabled=False), held).active
    assert gate(Clock(), enabled=False).active  # tenants: keys and quotas still apply


def test_token_estimate():
    assert estimate_tokens(400, 100, 256) == 200
    assert estimate_tokens(400, None, 256) == 356
    assert estimate_tokens(0, 0, 256) == 256


def test_live_routers_and_workers_divide_the_quotas():
    g = gate(Clock())
    g.workers = 2
    g.set_routers(3)
    assert g.controller.directory.by_name["acme"].quotas.tpm == 100_000 // 6
    g.set_tenants([])
    assert g.controller.open


async def test_a_tenant_replaced_while_its_body_arrived_is_admitted_as_declared_now():
    g = gate(Clock())
    early = g.authenticate(HEADERS)  # before the body
    stricter = contracts.Quotas(concurrency=1)
    g.set_tenants(
        [TenantConfig(name="acme", band="bronze", key_hashes=[keys.hash_key(KEY)], quotas=stricter)]
    )
    await g.admit(Request(), Route(), early)
    with pytest.raises(AdmissionRejected) as err:
        await g.admit(Request(), Route(), early)  # the new concurrency limit applies
    assert err.value.reason == "rate_limit_concurrency"
    g.set_tenants([TenantConfig(name="other", band="bronze", key_hashes=[keys.hash_key("sk-o")])])
    with pytest.raises(AdmissionRejected) as err:
        await g.admit(Request(), Route(), early)  # revoked meanwhile
    assert (err.value.status, err.value.reason) == (401, "invalid_api_key")
    g.close()
