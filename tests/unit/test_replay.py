"""Audit replay: a recorded log re-derives to the same decisions; a changed rule shows."""

import msgspec

from llmgw import contracts as c
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.replicas import placement
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.controllers.replicas.placement import Fit

from ._cluster import Log, model, node, status

S = c.ShardState


def recorded_history() -> Log:
    """A log the reconciler would write: plans folded in, shards come up, a node is lost."""
    log = Log().append(
        node("a", 8, ts=100.0),
        node("b", 2, ts=101.0),
        node("c", 4, labels={"zone": "z1"}, ts=102.0),
        model("m", replicas=3),
        model("z", replicas=1, gpus_per_shard=2, selector={"zone": "z1"}),
    )

    def step() -> None:
        plan = reconcile.decide(log.state, ts=200.0 + len(log.events))
        log.append(*plan.events)
        for cmd in plan.commands:
            if isinstance(cmd, c.StartShard):
                log.append(status(log.state, cmd.shard_id, S.READY))

    for _ in range(3):
        step()
    log.append(c.NodeLost(node="b", last_seen=150.0, ts=300.0))
    for _ in range(3):
        step()
    log.append(model("m", replicas=1))
    step()
    log.append(model("big", gpus_per_shard=16))
    step()
    return log


def test_recorded_log_replays_without_differences():
    log = recorded_history()
    kinds = {type(ev).__name__ for _, ev in log.events}
    assert {"PlacementDecided", "PlacementFailed", "ReplicaRetired", "NodeLost"} <= kinds
    result = replay.replay(log.events)
    assert len(result.checks) >= 6
    assert result.differing(strict=True) == []
    assert msgspec.to_builtins(result.state) == msgspec.to_builtins(log.state)
    assert "0 differ" in replay.render(result)[-1]


def worst_fit(state, model_name, rid, base, **kw):
    """The same placement with the packing rule flipped: most free GPUs first."""
    original = Fit.rank
    Fit.rank = property(lambda f: (f.model_shards, -len(f.free), f.node))
    try:
        return placement.place(state, model_name, rid, base, **kw)
    finally:
        Fit.rank = original


def test_a_changed_placement_rule_shows_a_difference():
    log = recorded_history()
    result = replay.replay(log.events, placer=worst_fit)
    bad = result.differing()
    assert bad, "flipping best fit to worst fit must change some decision"
    first = bad[0]
    assert any(d.startswith("assignments:") for d in first.differences)
    text = "\n".join(replay.render(result))
    assert "DIFFERS" in text and f"seq {first.seq} {first.recorded.replica_id}" in text


def test_from_and_to_seq_limit_what_is_checked_but_fold_from_the_start():
    log = recorded_history()
    full = replay.replay(log.events)
    middle = full.checks[len(full.checks) // 2].seq
    part = replay.replay(log.events, from_seq=middle, to_seq=middle)
    assert [ch.seq for ch in part.checks] == [middle]
    assert part.differing() == [] and part.last_seq == middle


def test_a_tampered_record_is_caught():
    log = recorded_history()
    seq, ev = next(
        (s, e) for s, e in log.events if isinstance(e, c.PlacementDecided) and e.model == "m"
    )
    ev.assignments[0].gpus = ["a-GPU-7"]  # not what placement would have picked
    result = replay.replay(log.events)
    assert [ch.seq for ch in result.differing()] == [seq]


def test_explain_shows_the_inputs_of_one_decision():
    log = recorded_history()
    seq, ev = next((s, e) for s, e in log.events if isinstance(e, c.PlacementFailed))
    inp = replay.inputs_at(log.events, seq)
    assert inp.state.last_seq >= ev.based_on_seq
    text = "\n".join(replay.render_inputs(inp))
    assert f"based on seq {ev.based_on_seq}" in text
    assert "  c: alive since" in text and "labels zone=z1" in text
    assert "recorded verdicts:" in text and "re-derived: not placed" in text
    try:
        replay.inputs_at(log.events, 1)
    except LookupError as exc:
        assert "not a placement" in str(exc)
    else:
        raise AssertionError("seq 1 is a registration")


def test_adoption_is_checked_not_replaced():
    log = Log().append(node("a", 1), model("m"))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", S.READY))
    log.append(c.NodeLost(node="a", last_seen=1.0))
    log.append(*reconcile.decide(log.state).events)  # retire r1, r2 fails: no capacity
    shard = c.ShardInfo(
        shard_id="m-r1-s0", model="m", replica_id="m-r1", state=S.READY, gpus=["a-GPU-0"]
    )
    log.append(node("a", 1, shards=[shard]))
    plan = reconcile.decide(log.state)
    assert plan.events and plan.events[0].adopted
    log.append(*plan.events)
    result = replay.replay(log.events)
    adopted = [ch for ch in result.checks if getattr(ch.recorded, "adopted", False)]
    assert len(adopted) == 1 and adopted[0].differences == []
    # An adoption of a shard the node never reported is flagged.
    seq, ev = log.events[-1]
    ev.assignments[0].shard_id = "m-r1-s9"
    assert replay.replay(log.events).differing()
