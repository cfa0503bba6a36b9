"""The autoscaler's pure decisions, driven second by second with a fake clock."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import contracts as c
from llmgw.opcli import explain
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.autoscale import rule as autoscale
from llmgw.reconciler.controllers.autoscale.rule import FROM_ZERO, SCALE_DOWN, SCALE_UP
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState

SPEC = c.AutoscaleSpec(
    min=1,
    max=6,
    target=0.8,
    scale_up_after_seconds=10,
    scale_down_after_seconds=30,
    tolerance=0.2,
)
SLOTS = 8  # batch capacity of one replica


def sig(ready: int, demand: int, queued: int = 0) -> c.ScaleSignals:
    """Signals for `ready` replicas of SLOTS each with `demand` requests in flight."""
    cap = ready * SLOTS
    return c.ScaleSignals(
        load=round((demand + queued) / cap, 4) if cap else 0.0,
        in_flight=demand,
        queued=queued,
        capacity=cap,
        ready=ready,
        routers=1,
    )


class Model:
    """One autoscaled model in a folded state; ModelScaled events fold like the leader's."""

    def __init__(self, spec: c.AutoscaleSpec = SPEC, start: float = 1000.0):
        self.state = ClusterState()
        self.seq = 0
        self.now = start
        self.tracks: dict[tuple[str, str], autoscale.Track] = {}
        self.fired: list[c.ModelScaled] = []
        self._fold(c.ModelDeclared(name="m", replicas=spec.min, autoscale=spec))

    def _fold(self, ev: c.Message) -> None:
        self.seq += 1
        fold.apply(self.state, self.seq, ev)

    @property
    def desired(self) -> int:
        return self.state.desired_replicas("m")

    def run(self, seconds: int, demand, queued: int = 0, ready=None) -> None:
        """Tick once a second; `demand` is requests in flight (or a function of desired)."""
        for _ in range(seconds):
            self.now += 1
            d = demand(self.desired) if callable(demand) else demand
            r = self.desired if ready is None else ready
            events, self.tracks = autoscale.decide(
                self.state, {("m", ""): sig(r, d, queued)}, self.tracks, self.now
            )
            for ev in events:
                assert autoscale.check(self.state, ev) == [], ev.explanation
                self.fired.append(ev)
                self._fold(ev)


def test_scale_up_waits_for_the_condition_to_hold_then_sizes_to_the_target():
    m = Model()
    m.run(10, demand=16)  # load 2.0 on 1 replica of 8 slots: over target 0.8, 9 s held
    assert m.desired == 1 and not m.fired
    m.run(1, demand=16)
    assert m.desired == 3  # ceil(1 * 2.0 / 0.8)
    (ev,) = m.fired
    assert (ev.rule, ev.from_replicas, ev.to_replicas) == (SCALE_UP, 1, 3)
    assert ev.sustained_seconds == 10
    assert ev.signals.load == 2.0
    assert "scaled 1 → 3" in ev.explanation
    assert "load 2.00 over target 0.8 for 10 s" in ev.explanation


def test_a_short_spike_does_not_scale():
    m = Model()
    for _ in range(5):
        m.run(10, demand=16)  # 9 s over target
        m.run(1, demand=2)  # one second at rest restarts the timing
    assert not m.fired and m.desired == 1


def test_never_above_max_and_never_below_min():
    m = Model(
        c.AutoscaleSpec(
            min=2, max=3, target=0.5, scale_up_after_seconds=1, scale_down_after_seconds=1
        )
    )
    m.run(5, demand=1000)
    assert m.desired == 3
    m.run(5, demand=0)
    assert m.desired == 2
    assert [e.to_replicas for e in m.fired] == [3, 2]


def test_no_second_scale_up_while_the_first_is_still_arriving():
    m = Model()
    m.run(11, demand=16)
    assert m.desired == 3
    # The two new replicas are not ready yet: the load on the one ready stays high.
    m.run(60, demand=16, ready=1)
    assert m.desired == 3 and len(m.fired) == 1


def test_scale_down_after_the_cool_down_to_a_count_that_does_not_scale_back_up():
    m = Model()
    m.run(11, demand=40)  # load 5.0 -> ceil(1 * 5 / 0.8) = 6 (max)
    assert m.desired == 6
    # Demand falls to 12 in flight: 48 slots, load 0.25, under 0.64 (0.8 less 20%).
    m.run(30, demand=12)
    assert m.desired == 6  # 30 s cool-down since the scale-up, and 30 s held
    m.run(1, demand=12)
    assert m.desired == 3  # ceil(6 * 0.25 / 0.64) = ceil(2.34)
    down = m.fired[-1]
    assert down.rule == SCALE_DOWN and down.sustained_seconds >= 30
    # At 3 replicas the same demand is load 0.5: inside the band, nothing more happens.
    m.run(300, demand=12)
    assert m.desired == 3 and len(m.fired) == 2


def test_steady_demand_around_the_target_never_flaps():
    m = Model()
    # Demand that wobbles +-15% around 2.5 replicas' worth at target.
    wobble = [17, 14, 18, 15, 16, 13, 17]
    for i in range(600):
        m.run(1, demand=wobble[i % len(wobble)])
    ups = [e for e in m.fired if e.rule == SCALE_UP]
    downs = [e for e in m.fired if e.rule == SCALE_DOWN]
    assert len(ups) == 1 and not downs, [e.explanation for e in m.fired]


def test_scale_to_zero_and_back_from_zero():
    spec = c.AutoscaleSpec(
        min=0, max=2, target=0.8, scale_up_after_seconds=10, scale_down_after_seconds=20
    )
    m = Model(spec)
    assert m.desired == 0
    m.run(5, demand=0)
    assert not m.fired  # nothing asked, nothing runs
    m.run(1, demand=0, queued=1)  # a first request waits in admission
    assert m.desired == 1
    assert m.fired[-1].rule == FROM_ZERO and m.fired[-1].sustained_seconds == 0
    m.run(19, demand=1)
    m.run(21, demand=0)  # idle: after the cool-down and 20 s held, back to zero
    assert m.desired == 0
    assert m.fired[-1].rule == SCALE_DOWN and m.fired[-1].to_replicas == 0


def test_a_model_with_min_1_never_goes_to_zero_when_idle():
    m = Model()
    m.run(600, demand=0)
    assert m.desired == 1 and not m.fired


def test_no_signals_no_decision():
    m = Model()
    events, tracks = autoscale.decide(m.state, {}, {}, m.now + 1)
    assert events == [] and tracks == {}


def test_combine_adds_counts_and_takes_capacity_once():
    def summary(router, in_flight, queued, cap, sat):
        return c.DemandSummary(
            router_id=router,
            models={
                "m": c.ModelDemand(
                    in_flight=in_flight,
                    queued={
                        "default": c.BandDemand(queued=queued, oldest_wait_seconds=queued / 10)
                    },
                    saturation=sat,
                    capacity=cap,
                    ready=2,
                )
            },
        )

    idle = c.DemandSummary(router_id="r3", models={})
    got = autoscale.combine(
        [summary("r1", 10, 4, 16, 0.6), summary("r2", 6, 0, 16, 0.2), idle], "m"
    )
    assert (got.in_flight, got.queued, got.capacity, got.ready, got.routers) == (16, 4, 16, 2, 3)
    assert got.load == pytest.approx(20 / 16)
    assert got.saturation == pytest.approx(0.8 / 3, abs=1e-4)
    assert got.oldest_wait_seconds == 0.4


def test_replay_check_catches_a_decision_the_rule_would_not_make():
    m = Model()
    m.run(11, demand=16)
    ev = m.fired[0]
    before = ClusterState()
    fold.apply(before, 1, c.ModelDeclared(name="m", replicas=1, autoscale=SPEC))
    assert autoscale.check(before, ev) == []
    forged = c.ModelScaled(
        **{**{f: getattr(ev, f) for f in ev.__struct_fields__}, "to_replicas": 5}
    )
    assert any("now scale_up to 3" in d for d in autoscale.check(before, forged))
    hasty = c.ModelScaled(
        **{**{f: getattr(ev, f) for f in ev.__struct_fields__}, "sustained_seconds": 2.0}
    )
    assert any("needs 10 s" in d for d in autoscale.check(before, hasty))


def test_audit_replay_rederives_scaling_decisions_from_the_log():
    m = Model()
    m.run(11, demand=16)  # 1 -> 3
    m.run(40, demand=4)  # load 4/24: down to ceil(3 * 0.1667 / 0.64) = 1
    assert [e.to_replicas for e in m.fired] == [3, 1]
    log = [(1, c.ModelDeclared(name="m", replicas=1, autoscale=SPEC))]
    log += [(i + 2, ev) for i, ev in enumerate(m.fired)]
    result = replay.replay(log)
    assert len(result.scaling) == 2 and result.differing() == []
    assert result.state.desired_replicas("m") == 1
    # A decision taken before the cool-down had passed is caught: by the leader's own
    # measure, or by the events' wall times in events written before it was recorded.
    assert m.fired[1].since_last_change_seconds == m.fired[1].ts - m.fired[0].ts
    for early in (
        msgspec.structs.replace(m.fired[1], since_last_change_seconds=5.0),
        msgspec.structs.replace(m.fired[1], ts=m.fired[0].ts + 5, since_last_change_seconds=None),
    ):
        result = replay.replay([*log[:2], (3, early)])
        (bad,) = result.differing()
        assert any("cool-down: 5.0 s" in d for d in bad.differences)
        assert any("DIFFERS" in line for line in replay.render(result))


def test_explain_shows_the_scaling_history():
    m = Model()
    m.run(11, demand=16)
    data = {
        "model": "m",
        "declared": True,
        "desired_replicas": 3,
        "profile": {"engine": "sim"},
        "autoscale": msgspec.to_builtins(SPEC),
        "scaling": [dict(msgspec.to_builtins(m.fired[0]), seq=7)],
        "decisions": [],
        "replicas": [],
    }
    text = "\n".join(explain.render(data))
    assert "m: 3 replica(s) wanted" in text
    assert "autoscaled: 1 to 6 replica(s), target load 0.8" in text
    assert "seq 7: scaled 1 → 3 at " in text
    assert "load 2.00 over target 0.8 for 10 s" in text


def test_explain_says_when_placement_cannot_meet_a_scale_up():
    data = {
        "model": "m",
        "declared": True,
        "desired_replicas": 4,
        "profile": {"engine": "sim"},
        "autoscale": msgspec.to_builtins(SPEC),
        "scaling": [],
        "decisions": [
            {
                "seq": 9,
                "replica_id": "m-r3",
                "based_on_seq": 8,
                "outcome": "failed",
                "explanation": "m-r3 cannot be placed: no node fits (0 of 1 node fit)",
            }
        ],
        "replicas": [
            {"replica_id": "m-r1", "state": "ready", "retired": False},
            {"replica_id": "m-r2", "state": "ready", "retired": False},
        ],
    }
    text = "\n".join(explain.render(data))
    assert "only 2 of 4 placed: m-r3 cannot be placed: no node fits" in text


def test_a_learned_capacity_scales_up_only_while_requests_wait():
    full = sig(1, 8)  # 8 in flight on 8 slots: load 1.0
    learned = msgspec.structs.replace(full, capacity_declared=False)
    assert autoscale.propose(SPEC, 1, full).rule == SCALE_UP
    # The engine has run 8 at most so far: that may be all it was asked, not all it can.
    assert autoscale.propose(SPEC, 1, learned) is None
    queueing = msgspec.structs.replace(learned, waiting=3, load=11 / 8)
    assert autoscale.propose(SPEC, 1, queueing).rule == SCALE_UP


def test_combine_takes_the_engines_waiting_once_and_declared_only_if_all_say_so():
    def summary(router, declared, waiting):
        d = c.ModelDemand(
            in_flight=2, capacity=8, ready=1, capacity_declared=declared, waiting=waiting
        )
        return c.DemandSummary(router_id=router, models={"m": d})

    got = autoscale.combine([summary("r1", True, 3), summary("r2", False, 2)], "m")
    assert (got.waiting, got.capacity_declared) == (3, False)
    got = autoscale.combine([summary("r1", True, 0), c.DemandSummary(router_id="r2")], "m")
    assert got.capacity_declared


QUEUE = msgspec.structs.replace(SPEC, signal="queue", target=2.0)


def qsig(ready: int, in_flight: int, queued: int = 0, waiting: int = 0) -> c.ScaleSignals:
    """Signals as combine() makes them, for `ready` replicas of SLOTS each."""
    cap = ready * SLOTS
    return c.ScaleSignals(
        load=round((in_flight + queued) / cap, 4) if cap else 0.0,
        queue=round((queued + waiting) / ready, 4) if ready else 0.0,
        in_flight=in_flight,
        queued=queued,
        waiting=waiting,
        capacity=cap,
        ready=ready,
        routers=1,
    )


def test_a_queue_target_scales_up_on_requests_waiting_per_replica():
    # Full but nothing waiting: a load target would grow, a queue target does not.
    assert autoscale.propose(SPEC, 2, qsig(2, 16)).rule == SCALE_UP
    assert autoscale.propose(QUEUE, 2, qsig(2, 16)) is None
    # 6 queued in admission and 4 in the engines on 2 replicas: 5 per replica over 2.
    prop = autoscale.propose(QUEUE, 2, qsig(2, 16, queued=6, waiting=4))
    assert (prop.rule, prop.to) == (SCALE_UP, 5)  # ceil(2 * 5 / 2)
    assert autoscale.propose(QUEUE, 2, qsig(2, 16, queued=1, waiting=2)) is None  # 1.5


def test_a_queue_target_scales_down_by_the_load_not_to_min():
    # No queue at 15 of 16 slots: the queue reads 0 as it would idle; the count holds.
    assert autoscale.propose(QUEUE, 2, qsig(2, 15)) is None
    # 5 in flight on 4 replicas (32 slots): 2 hold them at 80% of their capacity at most.
    prop = autoscale.propose(QUEUE, 4, qsig(4, 5))
    assert (prop.rule, prop.to) == (SCALE_DOWN, 1)  # ceil(4 * 0.1562 / 0.8) = 1
    prop = autoscale.propose(QUEUE, 4, qsig(4, 12))
    assert (prop.rule, prop.to) == (SCALE_DOWN, 2)  # 12 of 16 slots: 75%


def test_a_queue_target_settles_without_flapping_and_replays():
    m = Model(QUEUE)

    def signals(desired: int, in_flight: int) -> c.ScaleSignals:
        # 20 requests offered: what the replicas cannot run waits in their queues.
        cap = desired * SLOTS
        return qsig(desired, min(in_flight, cap), waiting=max(0, in_flight - cap))

    for _ in range(300):
        m.now += 1
        events, m.tracks = autoscale.decide(
            m.state, {("m", ""): signals(m.desired, 20)}, m.tracks, m.now
        )
        for ev in events:
            assert autoscale.check(m.state, ev) == [], ev.explanation
            m.fired.append(ev)
            m._fold(ev)
    # 20 on 1 replica: 12 waiting per replica, up to ceil(12 / 2) = 6; then 20 in flight
    # on 48 slots is a load of 0.42: down to ceil(6 * 0.4167 / 0.8) = 4 (20 of 32, no
    # queue), where it stays.
    assert [(e.rule, e.to_replicas) for e in m.fired] == [(SCALE_UP, 6), (SCALE_DOWN, 4)]
    assert all(e.signal == "queue" for e in m.fired)
    assert "queue 12.00 per replica over target 2" in m.fired[0].explanation
    assert "load 0.42 fits 4 replica(s) at 80%" in m.fired[1].explanation
    log = [(1, c.ModelDeclared(name="m", replicas=1, autoscale=QUEUE))]
    log += [(i + 2, ev) for i, ev in enumerate(m.fired)]
    assert replay.replay(log).differing() == []
    # The same decisions replayed against a load target do not hold.
    log[0] = (1, c.ModelDeclared(name="m", replicas=1, autoscale=SPEC))
    (first, *_) = replay.replay(log).differing()
    assert any("signal: recorded queue" in d for d in first.differences)


def test_explain_names_a_queue_target():
    data = {
        "model": "m",
        "declared": True,
        "desired_replicas": 1,
        "profile": {"engine": "sim"},
        "autoscale": msgspec.to_builtins(QUEUE),
        "scaling": [],
        "decisions": [],
        "replicas": [],
    }
    text = "\n".join(explain.render(data))
    assert "autoscaled: 1 to 6 replica(s), target queued request(s) per replica 2.0" in text


def demand(in_flight: int, cap: int = 8, ready: int = 1) -> c.ModelDemand:
    return c.ModelDemand(in_flight=in_flight, capacity=cap, ready=ready)


UP_AT_ONCE = msgspec.structs.replace(SPEC, scale_up_after_seconds=0)


def decided_on(summaries: list[c.DemandSummary]) -> c.ModelScaled:
    """The scale-up a fresh model decides on these summaries."""
    st = ClusterState()
    fold.apply(st, 1, c.ModelDeclared(name="m", replicas=1, autoscale=UP_AT_ONCE))
    signals = {("m", ""): autoscale.combine(summaries, "m")}
    inputs = {("m", ""): autoscale.inputs_of(summaries, "m")}
    (ev,), _ = autoscale.decide(st, signals, {}, 100.0, inputs=inputs)
    return ev


def test_a_decision_records_each_routers_input_and_replay_combines_them_again():
    summaries = [
        c.DemandSummary(router_id="r2", process=7, models={"m": demand(10)}),
        c.DemandSummary(router_id="r1", process=3, models={"m": demand(6)}),
        c.DemandSummary(router_id="r3", models={}),  # does not route m
    ]
    ev = decided_on(summaries)
    assert [(i.router_id, i.process) for i in ev.inputs] == [("r1", 3), ("r2", 7), ("r3", 0)]
    assert [i.demand.in_flight if i.demand else None for i in ev.inputs] == [6, 10, None]
    # Through the log's encoding and back, replay re-combines them to what was recorded.
    ev = c.decode(c.encode(ev), c.ModelScaled)
    assert autoscale.recombine(ev) == ev.signals
    st = ClusterState()
    fold.apply(st, 1, c.ModelDeclared(name="m", replicas=1, autoscale=UP_AT_ONCE))
    assert autoscale.check(st, ev) == []
    # Signals that the inputs do not add up to (a bug in combine, or a forged event).
    forged = msgspec.structs.replace(
        ev, signals=msgspec.structs.replace(ev.signals, in_flight=40, load=5.0)
    )
    (diff,) = [d for d in autoscale.check(st, forged) if d.startswith("signals:")]
    assert "in_flight 40 (inputs give 16)" in diff and "load 5.0 (inputs give 2.0)" in diff


def test_recorded_inputs_are_capped_and_older_events_still_replay():
    many = [
        c.DemandSummary(router_id=f"r{i:03d}", models={"m": demand(1, cap=8)}) for i in range(70)
    ]
    ev = decided_on(many)
    assert ev.signals.routers == 70 and len(ev.inputs) == autoscale.INPUTS_CAP == 64
    assert ev.inputs[0].router_id == "r000" and ev.inputs[-1].router_id == "r063"
    assert autoscale.recombine(ev) is None  # not all there: only the rule is checked
    # An event written before inputs (and the monotonic cool-down) were recorded.
    old = msgspec.json.decode(c.encode(ev))
    for name in ("inputs", "signal", "since_last_change_seconds"):
        old.pop(name)
    old = c.decode(msgspec.json.encode(old), c.ModelScaled)
    assert (old.inputs, old.signal, old.since_last_change_seconds) == ([], "load", None)
    st = ClusterState()
    fold.apply(st, 1, c.ModelDeclared(name="m", replicas=1, autoscale=UP_AT_ONCE))
    assert autoscale.check(st, old) == []
