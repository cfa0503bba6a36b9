"""The saturation detector: scraped metrics, the router's own view, staleness, capacity."""

from __future__ import annotations

import pytest

from llmgw import contracts
from llmgw.contracts import EndpointState
from llmgw.router.admission.saturation import Detector, Pool
from llmgw.router.endpoints.load import Load

NOW = 500.0


class Ep:
    def __init__(self, id: str, max_running: int | None = None):
        self.id = id
        self.state = EndpointState.READY
        self.inflight = 0
        self.load: Load | None = None
        self.spec = contracts.Endpoint(id=id, url=f"http://{id}", max_running=max_running)

    def scraped(self, running=0, waiting=0, kv=0.0, age=0.1) -> Ep:
        self.load = Load(waiting=waiting, running=running, kv_usage=kv, at=NOW - age)
        return self


def seen(d: Detector, ep: Ep, **sample) -> Ep:
    """A sample lands, as the router's view reports it (the detector learns from it)."""
    ep.scraped(**sample)
    d.observed(ep)
    return ep


def pool(*eps: Ep, active: int = 0) -> Pool:
    p = Pool("m")
    p.endpoints = eps
    p.active = active
    return p


def detector(**kw) -> Detector:
    kw.setdefault("queue_threshold", 5.0)
    kw.setdefault("kv_threshold", 0.8)
    return Detector(**kw)


def test_scraped_waiting_and_kv_the_worse_of_the_two():
    d = detector()
    a = Ep("a").scraped(running=8, waiting=4, kv=0.2)
    b = Ep("b").scraped(running=8, waiting=0, kv=0.4)
    # waiting 4 over 2 endpoints x threshold 5 = 0.4; mean KV 0.3 / 0.8 = 0.375
    assert d.saturation(pool(a, b), NOW) == 0.4
    b.scraped(running=8, kv=1.0)
    assert d.saturation(pool(a, b), NOW) == pytest.approx(0.75)  # mean KV 0.6 / 0.8


def test_the_router_view_counts_queued_work_before_metrics_show_it():
    d = detector()
    a = seen(d, Ep("a"), running=8)  # capacity learned: 8
    a.inflight = 8  # a full batch is not a queue
    assert d.saturation(pool(a), NOW) == 0.0
    a.inflight = 11  # 3 beyond the batch: the engine is queueing, whatever the scrape says
    assert d.saturation(pool(a), NOW) == 0.6
    # Grants not yet dispatched count as well.
    assert d.saturation(pool(a, active=13), NOW) == 1.0


def test_stale_metrics_are_ignored_and_the_router_view_remains():
    d = detector(stale_after=1.0)
    a = seen(d, Ep("a"), running=4, waiting=10, kv=0.9, age=1.5)
    assert d.saturation(pool(a), NOW) == 0.0
    a.inflight = 6  # the learned capacity (4) still applies
    assert d.saturation(pool(a), NOW) == 0.4
    a.scraped(running=4, waiting=10, kv=0.9, age=0.2)
    assert d.saturation(pool(a), NOW) == 1.0


def test_capacity_is_the_hint_or_the_high_water_mark_of_running():
    d = detector(assumed_capacity=1)
    a = Ep("a")
    assert d.capacity(a) == 1  # nothing known yet
    seen(d, a, running=6)
    assert d.capacity(a) == 6
    seen(d, a, running=2)
    assert d.capacity(a) == 6  # a high-water mark: a quiet moment does not shrink it
    b = seen(d, Ep("b", max_running=32), running=5)
    assert d.capacity(b) == 32
    seen(d, b, running=40)
    assert d.capacity(b) == 40


def test_several_routers_each_count_their_share_of_capacity():
    d = detector(routers=2)
    a = Ep("a", max_running=10)
    a.inflight = 8  # 3 beyond this router's half of 10
    assert d.saturation(pool(a), NOW) == 0.6


def test_only_ready_endpoints_count():
    d = detector()
    a = Ep("a", max_running=2)
    b = Ep("b", max_running=100)
    b.state = EndpointState.DRAINING
    a.inflight = 4
    assert d.saturation(pool(a, b), NOW) == 0.4
    assert d.saturation(pool(b), NOW) == 0.0


def test_waiting_this_router_explains_is_not_counted_twice_or_held_after_it_drains():
    d = detector()
    a = Ep("a").scraped(running=8, waiting=2)  # capacity 8; the 2 waiting are ours
    a.inflight = 10
    d.observed(a)
    assert d.saturation(pool(a, active=10), NOW) == pytest.approx(0.4)  # 2 queued, once
    a.inflight = 5  # our requests finished since the sample: its queue is gone
    assert d.saturation(pool(a, active=5), NOW) == 0.0


def test_waiting_beyond_this_routers_requests_is_someone_elses_and_counts():
    d = detector()
    a = Ep("a").scraped(running=8, waiting=3)  # we had only the 8 running there
    a.inflight = 8
    d.observed(a)
    assert d.saturation(pool(a, active=8), NOW) == pytest.approx(0.6)
    a.inflight = 2
    assert d.saturation(pool(a, active=2), NOW) == pytest.approx(0.6)  # until the next sample
