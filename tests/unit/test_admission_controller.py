"""Queue discipline of the admission controller, against a fake clock, with no sockets.

Pools are built from stand-ins for the router's endpoints (id, state, inflight,
load, spec): the detector reads exactly those attributes.
"""

from __future__ import annotations

import pytest

from llmgw import contracts, keys
from llmgw.contracts import EndpointState
from llmgw.router.admission import QUEUED, AdmissionRejected, AdmissionSettings, Controller
from llmgw.router.admission.config import TenantConfig
from llmgw.router.admission.controller import DONE, GRANTED, REJECTED, Metrics
from llmgw.router.endpoints.load import Load


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Ep:
    def __init__(self, id: str, max_running: int | None = None):
        self.id = id
        self.state = EndpointState.READY
        self.inflight = 0
        self.load: Load | None = None
        self.spec = contracts.Endpoint(id=id, url=f"http://{id}", max_running=max_running)
        self.models = frozenset({"m"})


class Recorder(Metrics):
    def __init__(self):
        self.events: list[tuple] = []

    def admitted(self, band, tenant, waited):
        self.events.append(("admitted", band, tenant, waited is not None))

    def rejected(self, band, tenant, reason):
        self.events.append(("rejected", band, tenant, reason))

    def cancelled(self, band, tenant):
        self.events.append(("cancelled", band, tenant))


BANDS = [
    contracts.Band(name="platinum", ceiling=1.5),
    contracts.Band(name="gold", ceiling=1.0),
    contracts.Band(name="bronze", ceiling=0.5, queue_capacity=3, queue_ttl_seconds=10),
]


def tenant(name: str, band: str, **quotas) -> TenantConfig:
    return TenantConfig(
        name=name,
        band=band,
        key_hashes=[keys.hash_key(f"sk-{name}")],
        quotas=contracts.Quotas(**quotas),
    )


def make(clock, *, tenants=None, bands=BANDS, capacity=2, **settings):
    """One pool 'm' on one endpoint of `capacity`; queue_threshold 2 unless given, so
    saturation = (granted - capacity) / 2: bronze (0.5) is held from capacity + 1 granted,
    gold (1.0) from capacity + 2, platinum (1.5) never."""
    settings.setdefault("queue_threshold", 2.0)
    tenants = tenants or [
        tenant("p", "platinum"),
        tenant("g", "gold"),
        tenant("a", "bronze"),
        tenant("b", "bronze"),
        tenant("c", "bronze"),
    ]
    metrics = Recorder()
    c = Controller(AdmissionSettings(**settings), bands, tenants, clock=clock, metrics=metrics)
    ep = Ep("e1", max_running=capacity)
    return c, ep, metrics


def admit(c: Controller, ep: Ep, who: str, tokens: int = 10):
    return c.admit(c.directory.by_name[who], "m", (ep,), tokens)


def woken(order: list, label: str):
    return lambda _t: order.append(label)


def test_bands_flow_below_their_ceiling_then_queue():
    c, ep, _ = make(Clock())
    bronze = [admit(c, ep, "a") for _ in range(4)]
    assert [t.state for t in bronze] == [GRANTED] * 3 + [QUEUED]
    assert c.saturation("m") == 0.5
    gold = [admit(c, ep, "g") for _ in range(2)]
    assert [t.state for t in gold] == [GRANTED, QUEUED]
    assert c.saturation("m") == 1.0
    # Above 1 means never held back, even at full saturation and behind queued work.
    assert all(admit(c, ep, "p").state == GRANTED for _ in range(20))
    assert c.saturation("m") == 1.0  # clamped


def test_strict_priority_when_capacity_frees():
    c, ep, _ = make(Clock())
    granted = [admit(c, ep, "a") for _ in range(3)]
    order: list[str] = []
    queued_bronze = admit(c, ep, "b")
    queued_bronze.wake = woken(order, "bronze")
    admit(c, ep, "g")  # flows: 4 granted
    queued_gold = admit(c, ep, "g")
    queued_gold.wake = woken(order, "gold")
    assert (queued_bronze.state, queued_gold.state) == (QUEUED, QUEUED)

    granted[0].release()  # 4 granted -> saturation 0.5: gold may go, bronze not yet
    assert order == ["gold"] and queued_bronze.state == QUEUED
    granted[1].release()
    granted[2].release()  # 3 granted -> 0.5 ... 2 granted -> 0: bronze goes
    assert order == ["gold", "bronze"]
    assert queued_bronze.state == GRANTED


def test_a_higher_band_never_waits_behind_a_lower_one():
    c, ep, _ = make(Clock())
    for _ in range(4):
        admit(c, ep, "a")
    assert c.queue_depths()[("m", "bronze")] == 1
    assert admit(c, ep, "g").state == GRANTED


def test_a_new_request_does_not_overtake_its_own_band():
    c, ep, _ = make(Clock(), capacity=1, queue_threshold=1.0)
    first = admit(c, ep, "g")
    admit(c, ep, "g")  # 2 granted: saturation 1.0, gold held
    waiting = admit(c, ep, "g")
    assert waiting.state == QUEUED
    first.release()  # back below the ceiling: the queued one goes first ...
    assert waiting.state == GRANTED
    assert admit(c, ep, "g").state == QUEUED  # ... and the newcomer queues behind nothing


def test_tenants_take_turns_and_each_tenant_is_fifo():
    c, ep, _ = make(
        Clock(),
        bands=[contracts.Band(name="bronze", ceiling=0.5)],
        tenants=[tenant(n, "bronze") for n in "abc"],
    )
    running = [admit(c, ep, "a") for _ in range(3)]
    order: list[str] = []
    for who, n in (("a", 5), ("b", 2), ("c", 1)):
        for i in range(n):
            t = admit(c, ep, who)
            assert t.state == QUEUED
            t.wake = woken(order, f"{who}{i + 1}")
            running.append(t)
    # Free capacity one request at a time: each release admits exactly one.
    while len(order) < 8:
        done = next(t for t in running if t.state == GRANTED)
        done.release()
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3", "a4", "a5"]


def test_full_queue_answers_503_and_holds_nothing():
    c, ep, metrics = make(Clock(), tenants=[tenant("a", "bronze", concurrency=100, tpm=10_000)])
    for _ in range(3):
        admit(c, ep, "a")
    for _ in range(3):  # queue_capacity 3
        assert admit(c, ep, "a", tokens=100).state == QUEUED
    quotas = c.directory.by_name["a"].quotas
    used = (quotas.in_flight, quotas.tokens.total)
    with pytest.raises(AdmissionRejected) as err:
        admit(c, ep, "a", tokens=100)
    e = err.value
    assert (e.status, e.reason) == (503, "queue_full")
    assert b'"code":"queue_full"' in e.body() and b'"type":"server_error"' in e.body()
    assert (quotas.in_flight, quotas.tokens.total) == used  # refunded
    assert metrics.events[-1] == ("rejected", "bronze", "a", "queue_full")


def test_queued_past_the_band_ttl_answers_504():
    clock = Clock()
    c, ep, metrics = make(clock)
    for _ in range(3):
        admit(c, ep, "a")
    order: list[str] = []
    early = admit(c, ep, "a")
    early.wake = woken(order, "early")
    clock.t += 6
    late = admit(c, ep, "b")
    late.wake = woken(order, "late")
    assert c.next_deadline() == 1010.0
    clock.t += 3.9
    c.tick()
    assert order == []
    clock.t += 0.1  # 10 s after `early` queued
    c.tick()
    assert order == ["early"] and early.state == REJECTED and late.state == QUEUED
    assert (early.error.status, early.error.reason) == (504, "queue_timeout")
    assert b"waited 10.0s" in early.error.body()
    assert c.queue_depths()[("m", "bronze")] == 1
    assert c.directory.by_name["a"].quotas.in_flight == 3
    assert ("rejected", "bronze", "a", "queue_timeout") in metrics.events


def test_a_cancelled_request_leaves_the_queue_and_holds_no_capacity():
    c, ep, metrics = make(Clock())
    running = [admit(c, ep, "a") for _ in range(3)]
    order: list[str] = []
    gone = admit(c, ep, "a")
    gone.wake = woken(order, "gone")
    nxt = admit(c, ep, "b")
    nxt.wake = woken(order, "next")
    gone.release()  # what the proxy's cleanup does when the client disconnects
    assert gone.state == REJECTED
    assert c.queue_depths()[("m", "bronze")] == 1
    assert c.directory.by_name["a"].quotas.in_flight == 3
    assert ("cancelled", "bronze", "a") in metrics.events
    running[0].release()
    assert order == ["next"]  # the freed capacity went to the next in line
    assert c.detector.pools["m"].active == 3
    gone.release()  # idempotent
    assert c.detector.pools["m"].active == 3


def test_release_is_idempotent_and_frees_capacity_once():
    c, ep, _ = make(Clock())
    t = admit(c, ep, "a")
    t.release()
    t.release()
    assert t.state == DONE and c.detector.pools["m"].active == 0


def test_a_burst_is_held_before_anything_is_dispatched():
    # Granted but not yet dispatched requests are invisible to engine metrics and to
    # in-flight counts; the controller counts them itself, so a burst cannot pass en masse.
    c, ep, _ = make(Clock())
    burst = [admit(c, ep, "a") for _ in range(6)]
    assert [t.state for t in burst] == [GRANTED] * 3 + [QUEUED] * 3
    assert ep.inflight == 0


def test_admission_off_never_queues_but_quotas_still_apply():
    c, ep, _ = make(Clock(), enabled=False, tenants=[tenant("a", "bronze", concurrency=50)])
    tickets = [admit(c, ep, "a") for _ in range(50)]
    assert all(t.state == GRANTED for t in tickets)
    with pytest.raises(AdmissionRejected) as err:
        admit(c, ep, "a")
    assert err.value.reason == "rate_limit_concurrency"
    tickets[0].release()
    assert admit(c, ep, "a").state == GRANTED


def test_a_pool_without_ready_endpoints_lets_requests_through():
    c, ep, _ = make(Clock())
    ep.state = EndpointState.DRAINING
    assert all(admit(c, ep, "a").state == GRANTED for _ in range(10))  # router answers 503


def test_pools_are_independent():
    c, ep, _ = make(Clock())
    for _ in range(4):
        admit(c, ep, "a")
    other = Ep("e2", max_running=2)
    t = c.admit(c.directory.by_name["a"], "other-model", (other,), 10)
    assert t.state == GRANTED


def test_a_load_sample_landing_releases_what_it_allows():
    clock = Clock()
    c, ep, _ = make(clock)
    ep.load = Load(waiting=4, running=2, kv_usage=0.0, at=clock.t)  # someone else's queue
    c.observed(ep)
    queued = admit(c, ep, "a")
    assert queued.state == QUEUED
    clock.t += 0.2
    ep.load = Load(waiting=0, running=2, kv_usage=0.0, at=clock.t)  # it drained
    c.observed(ep)
    assert queued.state == GRANTED


def test_a_scale_up_lets_queued_requests_flow_without_waiting_for_the_next_admission():
    c, ep, _ = make(Clock())
    for _ in range(3):
        admit(c, ep, "a")  # saturation 0.5: bronze is held from here on
    order: list[str] = []
    queued = admit(c, ep, "b")
    queued.wake = woken(order, "bronze")
    assert queued.state == QUEUED
    # The model gains an idle endpoint of the same capacity (a new replica is ready).
    bigger = (ep, Ep("e2", max_running=2))
    c.endpoints_changed(lambda model: bigger if model == "m" else ())
    assert queued.state == GRANTED and order == ["bronze"]


def test_a_stored_response_call_counts_requests_and_concurrency_but_no_tokens():
    clock = Clock()
    c, ep, metrics = make(clock, tenants=[tenant("a", "bronze", rpm=3, concurrency=2, tpm=100)])
    a = c.directory.by_name["a"]
    a.quotas.tokens.add(clock(), 500)  # far over tpm: a call that costs no tokens still flows
    first, second = c.admit_stored(a), c.admit_stored(a)
    assert first.state == second.state == GRANTED and first.pool is None
    with pytest.raises(AdmissionRejected) as busy:
        c.admit_stored(a)
    assert busy.value.reason == "rate_limit_concurrency"
    first.release(None)
    second.release(None)
    assert a.quotas.in_flight == 0 and first.state == DONE
    c.admit_stored(a).release(None)
    with pytest.raises(AdmissionRejected) as rpm:
        c.admit_stored(a)
    assert rpm.value.reason == "rate_limit_rpm"
    assert c.saturation("m") == 0.0  # it held no pool capacity


def test_a_stored_response_call_of_a_tenant_removed_meanwhile_is_refused():
    c, _, _ = make(Clock())
    gone = c.directory.by_name["a"]
    c.set_tenants([tenant("b", "bronze")])
    with pytest.raises(AdmissionRejected) as err:
        c.admit_stored(gone)
    assert err.value.reason == "invalid_api_key"


def test_a_request_starting_to_wait_for_an_unheld_adapter_says_so_at_once():
    # The leader loads an adapter from the demand summary that shows requests waiting for
    # it; the router publishes that summary when this hook fires, not on its next tick.
    c, ep, _ = make(Clock())
    calls = []
    c.on_adapter_wait = lambda: calls.append("now")
    p = c.directory.by_name["p"]
    served = c.admit(p, "m", (ep,), 10, adapter=True)  # a holder: it flows
    assert served.state == GRANTED and calls == []
    waiting = [c.admit(p, "lora", (), 10, cold=True, adapter=True) for _ in range(2)]
    assert [t.state for t in waiting] == [QUEUED, QUEUED] and calls == ["now", "now"]
    c.admit(p, "scaled-to-zero", (), 10, cold=True)  # a model's own wait: the autoscaler's
    assert calls == ["now", "now"]
