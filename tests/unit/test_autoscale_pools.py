"""A disaggregated model's pools scale apart: each by its own spec, on its own demand,
and the decision folds, projects to rows, replays and explains as the pool's."""

from __future__ import annotations

import msgspec

from llmgw import contracts as c
from llmgw.opcli import explain
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.autoscale import rule as autoscale
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import rows

SPEC = c.AutoscaleSpec(min=1, max=4, target=0.8, scale_up_after_seconds=5)
SLOTS = 8


def declared(decode: c.AutoscaleSpec | None = SPEC, prefill_replicas: int = 2) -> c.ModelDeclared:
    return c.ModelDeclared(
        name="m",
        replicas=0,
        disaggregation=c.DisaggregationSpec(
            prefill=c.PoolSpec(replicas=prefill_replicas),
            decode=c.PoolSpec(replicas=decode.min if decode else 1, autoscale=decode),
        ),
    )


def summary(prefill_in_flight: int, decode_in_flight: int, state: ClusterState, queued=0):
    """One router's view: each pool's ready endpoints at the count the state wants."""

    def pool(role: str, in_flight: int) -> c.PoolDemand:
        ready = state.desired_replicas("m", role)
        return c.PoolDemand(in_flight=in_flight, capacity=ready * SLOTS, ready=ready)

    pools = {
        "prefill": pool("prefill", prefill_in_flight),
        "decode": pool("decode", decode_in_flight),
    }
    return c.DemandSummary(
        router_id="r1",
        models={
            "m": c.ModelDemand(
                in_flight=prefill_in_flight + decode_in_flight,
                queued={"default": c.BandDemand(queued=queued)} if queued else {},
                capacity=sum(p.capacity for p in pools.values()),
                ready=sum(p.ready for p in pools.values()),
                pools=pools,
            )
        },
    )


def run(state: ClusterState, seconds: int, prefill: int, decode: int, seq0: int = 1):
    """Tick once a second as the leader does; fired events fold. Returns them with seqs."""
    tracks: dict[str, autoscale.Track] = {}
    fired = []
    seq = seq0
    for t in range(seconds):
        now = 1000.0 + t
        live = [summary(prefill, decode, state)]
        keys = [(m, r) for m, r, _ in state.autoscaled()]
        signals = {(m, r): autoscale.combine(live, m, r) for m, r in keys}
        inputs = {(m, r): autoscale.inputs_of(live, m) for m, r in keys}
        events, tracks = autoscale.decide(state, signals, tracks, now, inputs=inputs)
        for ev in events:
            seq += 1
            fired.append((seq, ev))
            fold.apply(state, seq, ev)
    return fired


def test_a_pools_signals_are_its_own_endpoints_plus_the_models_queue():
    state = ClusterState()
    fold.apply(state, 1, declared())
    live = [summary(3, 12, state, queued=4)]
    decode = autoscale.combine(live, "m", "decode")
    prefill = autoscale.combine(live, "m", "prefill")
    assert (decode.in_flight, decode.queued, decode.capacity, decode.ready) == (12, 4, 8, 1)
    assert decode.load == 2.0  # (12 + 4) / 8
    assert (prefill.in_flight, prefill.capacity, prefill.load) == (3, 16, round(7 / 16, 4))
    # A router that reports no pools (an aggregated view) says nothing of a pool.
    bare = c.DemandSummary(router_id="r2", models={"m": c.ModelDemand(in_flight=9)})
    assert autoscale.combine([bare], "m", "decode").in_flight == 0


def test_the_loaded_decode_pool_scales_up_and_the_fixed_prefill_pool_stays():
    state = ClusterState()
    fold.apply(state, 1, declared())
    fired = run(state, 6, prefill=2, decode=16)  # decode load 2.0 over 0.8 for 5 s
    ((_, ev),) = fired
    assert (ev.model, ev.role, ev.from_replicas, ev.to_replicas) == ("m", "decode", 1, 3)
    assert ev.explanation.startswith("decode pool scaled 1 → 3")
    assert state.desired_replicas("m", "decode") == 3
    assert state.desired_replicas("m", "prefill") == 2
    assert state.desired_replicas("m") == 5
    assert state.desired_replicas("m", "") == 0


def test_an_autoscaled_prefill_pool_scales_on_prefill_load_only():
    state = ClusterState()
    decl = declared(decode=None, prefill_replicas=1)
    decl.disaggregation.prefill.autoscale = SPEC
    fold.apply(state, 1, decl)
    assert run(state, 10, prefill=2, decode=40) == []  # decode busy: not the prefill's load
    ((_, ev),) = run(state, 6, prefill=20, decode=0)
    assert (ev.role, ev.to_replicas) == ("prefill", 4)  # ceil(2.5 / 0.8), at most max


def test_a_pools_decision_replays_and_round_trips_the_tables():
    state = ClusterState()
    fold.apply(state, 1, declared())
    fired = run(state, 6, prefill=2, decode=16)
    result = replay.replay([(1, declared()), *fired])
    assert len(result.scaling) == 1 and result.differing() == []
    assert result.state.desired_replicas("m", "decode") == 3
    assert any(
        "m decode pool scaled 1 → 3: same" in line for line in replay.render(result, verbose=True)
    )
    # Forged as the prefill pool's, it is not: that pool is not autoscaled.
    seq, ev = fired[0]
    forged = msgspec.structs.replace(ev, role="prefill")
    (bad,) = replay.replay([(1, declared()), (seq, forged)]).differing()
    assert bad.differences == ["pool prefill of model m was not declared with autoscale"]
    table_rows = {n: list(r.values()) for n, r in rows.all_rows(state).items()}
    (row,) = table_rows["model_scaling"]
    assert (row["model"], row["role"], row["to_replicas"]) == ("m", "decode", 3)
    loaded = rows.state_from_rows(table_rows, state.last_seq)
    assert loaded.desired_replicas("m", "decode") == 3


def test_a_pool_that_stops_autoscaling_drops_its_count_and_its_row():
    state = ClusterState()
    fold.apply(state, 1, declared())
    fired = run(state, 6, prefill=2, decode=16)
    changes = fold.apply(state, 10, declared(decode=None))
    assert state.scaled == {} and state.desired_replicas("m", "decode") == 1
    w = rows.writes_for(state, changes)
    (key,) = w.deletes["model_scaling"]
    assert rows.PROJECTIONS["scaled"].primary_key(key) == {"model": "m", "role": "decode"}
    assert fired  # the decision it dropped


def test_explain_shows_a_pools_bounds_and_last_scaling():
    data = {
        "model": "m",
        "declared": True,
        "desired_replicas": 5,
        "profile": {},
        "disaggregation": {"connector": {"kind": "ExampleConnector"}},
        "pools": [
            {"role": "prefill", "desired_replicas": 2, "placed": 2, "ready": 2},
            {
                "role": "decode",
                "desired_replicas": 3,
                "placed": 3,
                "ready": 1,
                "autoscale": {
                    "min": 1,
                    "max": 4,
                    "target": 0.8,
                    "scale_up_after_seconds": 5,
                    "scale_down_after_seconds": 120,
                },
                "last_scaling": {
                    "seq": 7,
                    "rule": "scale_up",
                    "explanation": "decode pool scaled 1 → 3",
                },
            },
        ],
    }
    text = "\n".join(explain.render(data))
    assert "autoscaled: 1 to 4 replica(s), target load 0.8" in text
    assert "seq 7: decode pool scaled 1 → 3" in text
    assert text.count("autoscaled:") == 1  # the prefill pool has a fixed count
