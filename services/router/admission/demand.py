"""What this router sees of each model's demand: the autoscaler's input.

`summary()` reads the admission controller and the endpoint view as they are
now, O(models + endpoints), and returns a DemandSummary the router publishes
about once a second on core NATS (presence.py). Per model:

- in_flight: requests admission granted that have not finished, or the
  endpoints' in-flight counts if higher (admission may be off: no tenants and
  no band that holds back, and the proxy still counts what it dispatched);
- queued: waiting in admission, per band, with the oldest wait;
- saturation: the pool's saturation as admission computes it, unclamped;
- capacity and ready: the ready endpoints and their batch slots, as learned
  from load samples or declared (whole engines: the leader takes them once,
  not once per router), and whether every one was declared;
- waiting: what the engines' fresh load samples show waiting in their own
  queues (whole engines too);
- pools: for a disaggregated model, per pool (prefill, decode) the same counts
  over that pool's endpoints only: the requests on them (a prefill leg on a
  prefill endpoint, a decode leg on a decode one), their capacity, ready count
  and engine queues. Admission's queue stays the model's (each pool reads it);
- adapters: per LoRA adapter declared on the model, the requests that arrived since
  this router's previous summary (the summary takes the count), those admitted and
  not finished, and those waiting in admission because no replica holds the adapter:
  what the leader places adapters by.

Each router sees only its share of the requests; the leader adds them up.
"""

from __future__ import annotations

import os
from typing import Any

from llmgw import contracts as c
from llmgw.contracts import EndpointState

from .controller import Controller
from .saturation import Pool


def model_demand(controller: Controller, model: str, endpoints: Any, now: float) -> c.ModelDemand:
    detector = controller.detector
    # Judged on a local pool: admission's own (if any) is only read. Its endpoints are
    # admission's to set (on its ticks and route changes); writing the presence tick's
    # view into it would change what admission decides on between its own updates.
    live = detector.pools.get(model)
    pool = Pool(model)
    pool.endpoints = endpoints
    pool.active = live.active if live is not None else 0
    in_flight = max(pool.active, sum(ep.inflight for ep in endpoints))
    queued: dict[str, c.BandDemand] = {}
    for band, queue in zip(controller.bands, controller.queues.get(model, ()), strict=False):
        if queue.depth:
            oldest = queue.oldest()
            wait = now - oldest.created if oldest is not None else 0.0
            queued[band.name] = c.BandDemand(queued=queue.depth, oldest_wait_seconds=round(wait, 3))
    whole = pool_demand(controller, endpoints, now)
    roles = sorted({ep.spec.role for ep in endpoints if ep.spec.role})
    return c.ModelDemand(
        in_flight=in_flight,
        queued=queued,
        saturation=round(detector.unclamped(pool, now), 4),
        capacity=whole.capacity,
        ready=whole.ready,
        capacity_declared=whole.capacity_declared,
        waiting=whole.waiting,
        pools={
            role: pool_demand(controller, [ep for ep in endpoints if ep.spec.role == role], now)
            for role in roles
        },
    )


def pool_demand(controller: Controller, endpoints: Any, now: float) -> c.PoolDemand:
    """The counts a set of endpoints shows (a whole model's, or one pool's)."""
    detector = controller.detector
    ready = [ep for ep in endpoints if ep.state is EndpointState.READY]
    fresh = now - detector.stale_after
    return c.PoolDemand(
        in_flight=sum(ep.inflight for ep in endpoints),
        capacity=sum(detector.capacity(ep) for ep in ready),
        ready=len(ready),
        capacity_declared=all(ep.spec.max_running for ep in ready),
        waiting=sum(
            int(ep.load.waiting) for ep in ready if ep.load is not None and ep.load.at >= fresh
        ),
    )


def adapter_demand(controller: Controller, adapter: str, take: bool = True) -> c.AdapterDemand:
    """One adapter's demand from its admission pool; the arrivals counted are taken, or
    left for the next summary (`take` False: requests 0)."""
    pool = controller.detector.pools.get(adapter)
    if pool is None:
        return c.AdapterDemand()
    requests = 0
    if take:
        requests, pool.arrived = pool.arrived, 0
    # Held because no replica holds it (queued behind busy holders is not that: the
    # leader reads this as "load it somewhere now").
    waiting = sum(q.depth for q in controller.queues.get(adapter, ())) if pool.cold else 0
    return c.AdapterDemand(requests=requests, in_flight=pool.active, waiting=waiting)


def summary(
    router_id: str, controller: Controller, view: Any, take_arrivals: bool = True
) -> c.DemandSummary:
    """This router's demand for every model its view routes (aliases are not models;
    adapters are counted under their model). An urgent summary, sent between ticks because
    requests started waiting for an adapter, leaves the adapters' arrivals to the next
    (`take_arrivals` False): the leader keeps only each router's latest summary, so one
    replaced before the leader read it would lose the requests it took."""
    now = controller.clock()
    models = {}
    for name, canonical in view.models():
        if canonical is not None:
            continue
        route = view.route(name)
        if route is not None:
            models[name] = model_demand(controller, name, route.endpoints, now)
    for route in view.adapters():
        demand = models.get(route.adapter_of)
        if demand is not None:
            demand.adapters[route.name] = adapter_demand(controller, route.name, take_arrivals)
    return c.DemandSummary(router_id=router_id, process=os.getpid(), models=models)
