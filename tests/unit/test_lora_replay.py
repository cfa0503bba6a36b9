"""`llmgw audit replay` re-derives each adapter placement from the demand it recorded."""

from __future__ import annotations

import msgspec

from llmgw import contracts as c
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.lora import placement
from llmgw.reconciler.controllers.replicas import plan as reconcile

from ._cluster import Log, model, node, status

S = c.ShardState


def decided(log: Log, demand: dict[str, float], queued=None, ts: float = 1000.0):
    """The placement the leader would publish on this state, as an event."""
    queued = queued or {}
    inp = placement.inputs_from(log.state, "m", demand, queued, ts)
    p = placement.place(inp)
    return c.AdaptersPlaced(
        ts=ts,
        model="m",
        holdings=p.holdings,
        changes=p.changes,
        demand=demand,
        waiting=sorted(queued),
        queued=queued,
        based_on_seq=log.state.last_seq,
        explanation=p.explanation(),
        policy=placement.POLICY,
    )


def test_recorded_placements_replay_the_same_and_a_tampered_one_differs():
    log = Log().append(node("a", 2), model("m", replicas=2, max_loras=1))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", S.READY), status(log.state, "m-r2-s0", S.READY))
    for name in ("a", "b", "c"):
        log.append(c.AdapterDeclared(name=name, base="m", source=f"/l/{name}"))
    first = decided(log, {"a": 1.0}, queued={"a": 2})
    log.append(first)
    # a has held m-r1 for 100 s: b, with three times its demand, takes that slot.
    second = decided(log, {"a": 1.0, "b": 3.0, "c": 2.0}, ts=1100.0)
    assert [x.adapter for x in second.changes if x.action == "load"] == ["b", "c"]
    log.append(second)

    result = replay.replay(log.events)
    assert [ac.differences for ac in result.adapters] == [[], []]
    assert "2 adapter placement(s) re-derived, 0 differ" in replay.render(result)

    tampered = Log()
    for _, ev in log.events[:-1]:
        tampered.append(ev)
    tampered.append(msgspec.structs.replace(second, holdings={"m-r1": ["a"], "m-r2": ["c"]}))
    (bad,) = replay.replay(tampered.events).differing()
    assert bad.differences == ["holdings: recorded m-r1 [a]; m-r2 [c], now m-r1 [b]; m-r2 [c]"]


def test_a_placement_of_another_policy_version_is_not_re_derived_and_counted_apart():
    log = Log().append(node("a", 2), model("m", replicas=2, max_loras=1))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", S.READY), status(log.state, "m-r2-s0", S.READY))
    for name in ("a", "b", "c"):
        log.append(c.AdapterDeclared(name=name, base="m", source=f"/l/{name}"))
    log.append(decided(log, {"a": 2.0, "c": 1.0}))
    # Recorded before versions were (policy 0), when a queue was added to the rate: b's 3
    # waiting requests made its demand 3.1 and evicted c 2 s after c was loaded.
    # Today's rule, given no queue, keeps c (held under 30 s): it would say "differs".
    old = c.AdaptersPlaced(
        ts=1002.0,
        model="m",
        holdings={"m-r1": ["a"], "m-r2": ["b"]},
        demand={"a": 2.0, "b": 3.1, "c": 1.0},
        waiting=["b"],
        based_on_seq=log.state.last_seq,
        explanation="b loaded on m-r2: requests waiting",
    )
    assert old.policy == 0 and placement.check(log.state, old) != []
    log.append(old)
    log.append(decided(log, {"a": 2.0, "b": 0.1, "c": 6.0}, ts=1100.0))  # c back, b out

    result = replay.replay(log.events)
    assert [(ac.derivable, ac.differences) for ac in result.adapters] == [
        (True, []),
        (False, []),
        (True, []),
    ]
    assert result.differing() == []
    text = replay.render(result)
    old_seq = log.events[-2][0]
    assert (
        f"seq {old_seq} m adapters (based on seq {old.based_on_seq}): not re-derivable (policy v0)"
    ) in text
    assert (
        "2 adapter placement(s) re-derived, 0 differ; 1 not re-derivable (1 of policy v0; "
        f"this code runs v{placement.POLICY})"
    ) in text
    assert not any("DIFFERS" in line for line in text)
    # --strict: a decision nobody can re-derive fails the audit.
    assert [ac.seq for ac in result.differing(strict=True)] == [old_seq]
