"""Reconcile: what the state calls for, as events and commands, level-triggered."""

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.state.model import Liveness

from ._cluster import Log, model, node, status

S = c.ShardState


def settle(log: Log, ready: bool = True, rounds: int = 10) -> None:
    """Fold the plan's events until there are none; optionally answer start commands."""
    for _ in range(rounds):
        plan = reconcile.decide(log.state)
        if plan.events:
            log.append(*plan.events)
            continue
        if not ready:
            return
        starts = [cmd for cmd in plan.commands if isinstance(cmd, c.StartShard)]
        if not starts:
            return
        for cmd in starts:
            log.append(status(log.state, cmd.shard_id, S.READY))
    raise AssertionError("did not settle")


def kinds(items) -> list[str]:
    return [type(x).__name__ for x in items]


def test_places_missing_replicas_in_one_plan_without_double_booking():
    log = Log().append(node("a", 2), node("b", 1), model("m", replicas=3))
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["PlacementDecided"] * 3
    gpus = [(a.node, g) for ev in plan.events for a in ev.assignments for g in a.gpus]
    assert len(set(gpus)) == 3
    assert [ev.replica_id for ev in plan.events] == ["m-r1", "m-r2", "m-r3"]
    assert all(ev.based_on_seq == 3 for ev in plan.events)
    assert plan.commands == []  # commands follow once the decisions are in the log
    log.append(*plan.events)
    plan = reconcile.decide(log.state)
    assert plan.events == []
    assert sorted(cmd.key for cmd in plan.commands) == [
        "m-r1-s0:start",
        "m-r2-s0:start",
        "m-r3-s0:start",
    ]
    start = plan.commands[0]
    assert start.profile == log.state.models["m"].profile and start.served_model_name == "m"


def test_identical_failure_is_not_republished_but_a_changed_one_is():
    log = Log().append(node("a", 1), model("m", replicas=2))
    settle(log)
    plan = reconcile.decide(log.state)
    assert plan.events == []  # m-r2's failure is already in the log
    assert log.state.failures["m-r2"].verdicts[0].reason == "0 free GPUs of 1, needs 1"
    log.append(node("b", 0))  # a new node changes the verdicts: worth saying again
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["PlacementFailed"]
    log.append(node("c", 1))
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["PlacementDecided"] and plan.events[0].replica_id == "m-r2"


def test_scale_down_retires_not_ready_then_newest_and_drains_before_stopping():
    log = Log().append(node("a", 4), model("m", replicas=3))
    settle(log, ready=False)
    log.append(status(log.state, "m-r1-s0", S.READY), status(log.state, "m-r3-s0", S.READY))
    log.append(model("m", replicas=1))
    plan = reconcile.decide(log.state)
    assert [(ev.replica_id, ev.reason) for ev in plan.events] == [
        ("m-r2", "scale down: 1 wanted, 3 active"),  # not ready: nothing to lose
        ("m-r3", "scale down: 1 wanted, 3 active"),  # newest of the ready ones
    ]
    log.append(*plan.events)
    cmds = {cmd.shard_id: cmd for cmd in reconcile.decide(log.state).commands}
    assert isinstance(cmds["m-r3-s0"], c.DrainShard)  # ready: drain first
    assert isinstance(cmds["m-r2-s0"], c.StopShard)  # never served: just stop
    assert "m-r1-s0" not in cmds
    log.append(status(log.state, "m-r3-s0", S.DRAINING))
    cmds = {cmd.shard_id: cmd for cmd in reconcile.decide(log.state).commands}
    assert "m-r3-s0" not in cmds  # the drain was answered; the agent stops it after


def test_model_removed_retires_and_drains_everything():
    log = Log().append(node("a", 2), model("m", replicas=2))
    settle(log)
    log.append(c.ModelRemoved(name="m"))
    plan = reconcile.decide(log.state)
    assert {(ev.replica_id, ev.reason) for ev in plan.events} == {
        ("m-r1", "model removed from the catalog"),
        ("m-r2", "model removed from the catalog"),
    }
    log.append(*plan.events)
    assert kinds(reconcile.decide(log.state).commands) == ["DrainShard", "DrainShard"]


def test_lost_node_replica_is_replaced_elsewhere():
    log = Log().append(node("a", 1), node("b", 1), model("m"))
    settle(log)
    first = log.state.replicas["m-r1"].assignments[0].node
    other = "b" if first == "a" else "a"
    log.append(c.NodeUnreachable(node=first, last_seen=1.0))
    assert reconcile.decide(log.state).events == []  # unreachable is not gone yet
    log.append(c.NodeLost(node=first, last_seen=1.0))
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["ReplicaRetired", "PlacementDecided"]
    assert plan.events[0].reason == "shard m-r1-s0 failed: node lost; replaced"
    assert plan.events[1].assignments[0].node == other
    assert log.state.nodes[first].liveness == Liveness.LOST


def test_node_that_comes_back_has_its_orphan_stopped_when_not_needed():
    log = Log().append(node("a", 1), node("b", 1), model("m"))
    settle(log)
    lost = log.state.replicas["m-r1"].assignments[0].node
    log.append(c.NodeLost(node=lost, last_seen=1.0))
    settle(log)
    still = c.ShardInfo(
        shard_id="m-r1-s0", model="m", replica_id="m-r1", state=S.READY, gpus=[f"{lost}-GPU-0"]
    )
    log.append(node(lost, 1, shards=[still]))
    plan = reconcile.decide(log.state)
    assert plan.events == []
    assert [(type(x).__name__, x.shard_id) for x in plan.commands] == [
        ("DrainShard", "m-r1-s0")  # its replica was retired: drain it, then it stops
    ]


def test_node_that_comes_back_is_adopted_when_capacity_ran_out():
    log = Log().append(node("a", 1), model("m"))
    settle(log)
    log.append(c.NodeLost(node="a", last_seen=1.0))
    settle(log)
    assert "m-r2" in log.state.failures  # nowhere to go
    still = c.ShardInfo(
        shard_id="m-r1-s0",
        model="m",
        replica_id="m-r1",
        state=S.READY,
        gpus=["a-GPU-0"],
        url="http://a:8000",
    )
    log.append(node("a", 1, shards=[still]))
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["PlacementDecided"]
    ev = plan.events[0]
    assert ev.adopted and ev.replica_id == "m-r2" and ev.assignments[0].shard_id == "m-r1-s0"
    assert plan.commands == []  # not stopped while being adopted
    log.append(ev)
    shard = log.state.shards["m-r1-s0"]
    assert (shard.replica_id, shard.state, shard.url) == ("m-r2", S.READY, "http://a:8000")
    assert "m-r2" not in log.state.failures
    assert reconcile.decide(log.state).events == []
    assert reconcile.decide(log.state).commands == []


def test_unknown_shard_is_stopped_and_commands_skip_dead_nodes():
    stray = c.ShardInfo(shard_id="x-r9-s0", model="x", replica_id="x-r9", state=S.LOADING)
    log = Log().append(node("a", 1, shards=[stray]), node("b", 1), model("m"))
    plan = reconcile.decide(log.state)
    log.append(*plan.events)
    placed_on = plan.events[0].assignments[0].node
    cmds = reconcile.decide(log.state).commands
    assert ("StopShard", "x-r9-s0", "x-r9-s0:stop") in [
        (type(x).__name__, x.shard_id, x.key) for x in cmds
    ]
    log.append(c.NodeUnreachable(node=placed_on, last_seen=0.0))
    cmds = reconcile.decide(log.state).commands
    assert all(cmd.node != placed_on for cmd in cmds)


def test_multi_node_start_commands_carry_rank_and_rendezvous():
    fab = {"fabric": "ib"}
    log = Log().append(
        node("a", 2, labels=fab),
        node("b", 2, labels=fab),
        model("w", shards_per_replica=2, gpus_per_shard=2),
    )
    log.append(*reconcile.decide(log.state).events)
    cmds = sorted(reconcile.decide(log.state).commands, key=lambda x: x.node_rank)
    assert [(x.node, x.node_rank, x.nnodes) for x in cmds] == [("a", 0, 2), ("b", 1, 2)]
    head = log.state.nodes["a"].host.address
    assert {x.master_addr for x in cmds} == {head}
    assert len({x.master_port for x in cmds}) == 1 and cmds[0].master_port >= 29500


def test_multi_node_replica_with_one_failed_shard_is_replaced_whole():
    fab = {"fabric": "ib"}
    log = Log().append(
        *(node(n, 1, labels=fab) for n in "abcd"),
        model("w", shards_per_replica=2),
    )
    settle(log)
    log.append(status(log.state, "w-r1-s1", S.FAILED, reason="engine exited 1"))
    plan = reconcile.decide(log.state)
    assert kinds(plan.events) == ["ReplicaRetired", "PlacementDecided"]
    log.append(*plan.events)
    cmds = reconcile.decide(log.state).commands
    assert ("DrainShard", "w-r1-s0") in [(type(x).__name__, x.shard_id) for x in cmds]


def test_a_big_change_is_decided_in_bounded_plans():
    log = Log().append(node("a", 8), model("m", replicas=5))
    first = reconcile.decide(log.state, max_placements=2)
    assert [ev.replica_id for ev in first.events] == ["m-r1", "m-r2"]
    log.append(*first.events)
    second = reconcile.decide(log.state, max_placements=2)
    assert [ev.replica_id for ev in second.events] == ["m-r3", "m-r4"]


def test_a_model_whose_shards_keep_failing_is_replaced_ever_more_slowly():
    from llmgw.reconciler.controllers.replicas.backoff import ReplacementBackoff

    log = Log().append(node("a", 2), model("m"))
    backoff = ReplacementBackoff(initial=5.0, maximum=12.0)
    waits = []
    now = 0.0
    for _ in range(4):
        plan = reconcile.decide(log.state, hold=backoff.held(now))
        assert kinds(plan.events)[-1] == "PlacementDecided"
        log.append(*plan.events)
        rid = plan.events[-1].replica_id
        changes = log.apply(status(log.state, f"{rid}-s0", S.FAILED, reason="exit 1"))
        backoff.observe(log.state, changes, now)
        held = reconcile.decide(log.state, hold=backoff.held(now))
        assert kinds(held.events) == ["ReplicaRetired"]  # retired at once, not re-placed yet
        log.append(*held.events)
        waits.append(backoff.next_release(now) - now)
        now = backoff.next_release(now)
    assert waits == [5.0, 10.0, 12.0, 12.0]
    # A ready shard means the profile works: the next failure starts from the beginning.
    plan = reconcile.decide(log.state, hold=backoff.held(now))
    log.append(*plan.events)
    rid = plan.events[-1].replica_id
    backoff.observe(log.state, log.apply(status(log.state, f"{rid}-s0", S.READY)), now)
    assert backoff.held(now) == set() and backoff.failures == {}


def test_a_lost_node_is_no_reason_to_hold_back():
    from llmgw.reconciler.controllers.replicas.backoff import ReplacementBackoff

    log = Log().append(node("a", 1), node("b", 1), model("m"))
    settle(log)
    lost = log.state.replicas["m-r1"].assignments[0].node
    backoff = ReplacementBackoff()
    backoff.observe(log.state, log.apply(c.NodeLost(node=lost, last_seen=0)), 0.0)
    assert backoff.held(0.0) == set()
