"""Learned capacity falls when an engine shows it runs less, and only then.

Sample times are a fake clock (every `load.at` is set by the test): each rule is
checked at the exact sample where it must act.
"""

from __future__ import annotations

from llmgw import contracts
from llmgw.contracts import EndpointState
from llmgw.router.admission import AdmissionSettings, Controller
from llmgw.router.admission.saturation import Detector, Pool
from llmgw.router.endpoints.load import Load

STEP = 0.25  # seconds between samples (the scrape interval; exact in binary)


class Ep:
    def __init__(self, id: str = "e1", max_running: int | None = None):
        self.id = id
        self.models = frozenset({"m"})
        self.state = EndpointState.READY
        self.inflight = 0
        self.load: Load | None = None
        self.spec = contracts.Endpoint(id=id, url=f"http://{id}", max_running=max_running)


class Samples:
    """Feeds one endpoint's samples to a detector, STEP apart unless told otherwise."""

    def __init__(self, d: Detector, ep: Ep):
        self.d, self.ep, self.t = d, ep, 100.0

    def __call__(self, running: int, waiting: int = 0, gap: float = STEP) -> int:
        self.t += gap
        self.ep.load = Load(waiting=waiting, running=running, kv_usage=0.0, at=self.t)
        self.d.observed(self.ep)
        return self.d.capacity(self.ep)

    def repeat(self, n: int, running: int, waiting: int) -> list[int]:
        return [self(running, waiting) for _ in range(n)]


SHORT_OF_5S = 20  # samples that span 0 to 4.75 s: the next one ends a 5 s stretch


def detector(**kw) -> Detector:
    kw.setdefault("relearn_after", 5.0)
    kw.setdefault("stale_after", 1.0)
    return Detector(queue_threshold=5.0, **kw)


def test_a_smaller_engine_behind_the_same_id_is_relearned_after_the_window():
    d = detector()
    ep = Ep()
    sample = Samples(d, ep)
    assert sample(64) == 64
    # Restarted with max-num-seqs 16: requests wait there, it never runs more than 16.
    before = sample.repeat(SHORT_OF_5S, running=16, waiting=48)
    assert set(before) == {64}  # not yet: 4.75 s of evidence
    assert sample(16, waiting=48) == 16  # 5 s after the stretch began
    # The router now sees the queue its own requests make there.
    ep.inflight = 64
    p = Pool("m")
    p.endpoints = (ep,)
    assert d.saturation(p, sample.t) == 1.0
    # And it rises again as soon as the engine runs more.
    assert sample(20) == 20


def test_it_falls_to_the_most_the_engine_ran_during_the_stretch():
    d = detector()
    sample = Samples(d, Ep())
    sample(32)
    for i in range(SHORT_OF_5S + 1):
        sample(20 + i % 9, waiting=3)  # 20..28, always with a queue
    assert d.capacity(sample.ep) == 28


def test_a_full_batch_or_an_empty_queue_ends_the_stretch():
    d = detector()
    sample = Samples(d, Ep())
    sample(32)
    # Caught between two engine steps: one finished, the next not yet scheduled.
    sample.repeat(SHORT_OF_5S, running=31, waiting=1)
    assert sample(32, waiting=1) == 32  # a full batch: the learned value is right
    sample.repeat(SHORT_OF_5S, running=31, waiting=1)
    assert sample(20, waiting=0) == 32  # nothing waiting: a quiet engine says nothing
    assert set(sample.repeat(SHORT_OF_5S, running=31, waiting=1)) == {32}
    assert sample(31, waiting=1) == 31  # 5 s unbroken: it does run 31 now


def test_a_gap_in_the_samples_restarts_the_stretch():
    d = detector()
    sample = Samples(d, Ep())
    sample(64)
    sample.repeat(12, running=16, waiting=10)  # 2.75 s
    assert sample(16, waiting=10, gap=1.5) == 64  # scrapes failed for 1.5 s (> stale_after)
    assert set(sample.repeat(SHORT_OF_5S - 1, running=16, waiting=10)) == {64}
    assert sample(16, waiting=10) == 16


def test_a_new_url_or_replica_is_a_new_engine_and_learning_starts_over():
    d = detector(assumed_capacity=2)
    ep = Ep()
    sample = Samples(d, ep)
    sample(64)
    ep.spec = contracts.Endpoint(id="e1", url="http://e1")  # a new record, same engine
    assert d.capacity(ep) == 64
    ep.spec = contracts.Endpoint(id="e1", url="http://e1", replica_id="r2")
    assert d.capacity(ep) == 2  # at once, before its first sample
    assert sample(8) == 8
    ep.spec = contracts.Endpoint(id="e1", url="http://elsewhere", replica_id="r2")
    assert d.capacity(ep) == 2


def test_relearning_can_be_switched_off_and_a_declared_hint_stays_a_floor():
    off = detector(relearn_after=0)
    sample = Samples(off, Ep())
    sample(64)
    assert set(sample.repeat(100, running=16, waiting=48)) == {64}

    hinted = detector()
    sample = Samples(hinted, Ep(max_running=32))
    sample(64)
    sample.repeat(SHORT_OF_5S + 1, running=16, waiting=48)
    assert hinted.learned["e1"].value == 16 and hinted.capacity(sample.ep) == 32


def test_with_the_gate_in_the_loop_the_capacity_settles_once_and_stays():
    """A closed loop: admission grants, a fake engine that runs at most 16 (the router
    learned 64 from its predecessor) runs them, its samples feed admission back. Three
    samples in four catch it between two steps (one short of a full batch)."""
    clock_t = [100.0]
    settings = AdmissionSettings(queue_threshold=2.0, capacity_relearn_seconds=5.0)
    bands = [contracts.Band(name="bronze", ceiling=0.5, queue_capacity=10_000)]
    c = Controller(settings, bands, (), clock=lambda: clock_t[0], stale_after=1.0)
    tenant = c.directory.anonymous
    ep = Ep()
    ep.load = Load(waiting=0, running=64, kv_usage=0.0, at=clock_t[0])
    c.observed(ep)  # the engine before the restart ran 64
    batch, backlog = 16, 200
    live: list = []
    caps, engine_waiting = [], []
    for tick in range(320):  # 80 s of samples
        clock_t[0] += STEP
        granted = [t for t in live if t.state == "granted"]
        for t in granted[:4]:  # the engine finishes 4 of its oldest each step
            t.release()
            live.remove(t)
        while len(live) < backlog:  # the client keeps its backlog
            live.append(c.admit(tenant, "m", (ep,), 10))
        ep.inflight = sum(t.state == "granted" for t in live)  # dispatched at once
        running = min(ep.inflight, batch)
        if tick % 4 and running == batch and ep.inflight > running:
            running -= 1  # between two steps
        ep.load = Load(ep.inflight - running, running, 0.0, at=clock_t[0])
        c.observed(ep)
        caps.append(c.detector.capacity(ep))
        engine_waiting.append(ep.load.waiting)
    changes = [(i, caps[i], caps[i + 1]) for i in range(len(caps) - 1) if caps[i] != caps[i + 1]]
    assert [(a, b) for _, a, b in changes] == [(64, 16)]  # once, and never back
    # Once the excess granted before the change has run, the engine's own queue stays
    # within the band's allowance.
    drained = engine_waiting.index(1, changes[0][0])
    assert max(engine_waiting[drained:]) <= 2  # 1 beyond 16, and 1 between two steps


def test_a_stalled_engine_running_nothing_keeps_its_capacity():
    d = detector()
    ep = Ep()
    sample = Samples(d, ep)
    assert sample(32) == 32
    # Hung (or preempting everything) for 10 s with requests queued: not a smaller engine.
    assert set(sample.repeat(2 * SHORT_OF_5S + 2, running=0, waiting=40)) == {32}
    assert sample(32, waiting=10) == 32  # it recovers at its full batch at once


def test_what_was_learned_of_an_endpoint_no_route_serves_is_forgotten():
    d = detector()
    kept, gone = Ep("kept"), Ep("gone")
    Samples(d, kept)(8)
    Samples(d, gone)(16)
    d.pool("m").endpoints = (kept, gone)
    d.forget_gone()
    assert set(d.learned) == {"kept", "gone"}
    d.pool("m").endpoints = (kept,)  # a rolling update replaced "gone"
    d.forget_gone()
    assert set(d.learned) == {"kept"} and set(d._own_at_sample) == {"kept"}
    assert d.capacity(kept) == 8
