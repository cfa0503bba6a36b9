"""What the leader tells agents about adapters, and the demand it weighs."""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.config import ReconcilerConfig, validate
from llmgw.reconciler.controllers.lora.commands import adapter_commands
from llmgw.reconciler.controllers.lora.demand import DemandSmoother, QueueAges
from llmgw.reconciler.controllers.manager import ActorConfig
from llmgw.reconciler.controllers.replicas import plan as reconcile

from ._cluster import Log, model, node, status

S = c.ShardState


def ready_base() -> Log:
    log = Log().append(node("a", 2), model("m", replicas=2, max_loras=2))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", S.READY), status(log.state, "m-r2-s0", S.READY))
    log.append(c.AdapterDeclared(name="sql", base="m", source="/l/sql"))
    return log


def test_the_whole_set_goes_to_the_serving_shard_until_the_engine_reports_it():
    log = ready_base()
    assert adapter_commands(log.state) == []  # nothing placed, nothing reported
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r2": ["sql"], "m-r1": []}))
    (cmd,) = adapter_commands(log.state)
    assert (cmd.node, cmd.shard_id) == ("a", "m-r2-s0")
    assert cmd.adapters == [c.AdapterSource(name="sql", source="/l/sql")]
    assert cmd.key.startswith("m-r2-s0:adapters@")
    # A failed load is reported with the engine's answer: the command is still wanted.
    log.append(status(log.state, "m-r2-s0", S.READY, adapters=[], adapter_errors={"sql": "404"}))
    assert [x.key for x in adapter_commands(log.state)] == [cmd.key]
    log.append(status(log.state, "m-r2-s0", S.READY, adapters=["sql"]))
    assert adapter_commands(log.state) == []
    # Removed from the catalog: the engine is told to hold nothing (another key).
    log.append(c.AdapterRemoved(name="sql"))
    (unload,) = adapter_commands(log.state)
    assert unload.adapters == [] and unload.key != cmd.key


def test_a_replica_that_no_longer_serves_gets_no_command():
    log = ready_base()
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r2": ["sql"]}))
    log.append(status(log.state, "m-r2-s0", S.LOADING))
    assert adapter_commands(log.state) == []


def test_a_set_asked_for_again_after_another_is_a_new_command():
    # An agent answers a key it has handled without redoing it: the second ask for [sql]
    # must not reuse the first one's key, or the engine keeps what it holds.
    log = ready_base()
    log.append(c.AdapterDeclared(name="py", base="m", source="/l/py"))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["sql"]}))
    (first,) = adapter_commands(log.state)
    log.append(status(log.state, "m-r1-s0", S.READY, adapters=["sql"]))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["py"]}))
    log.append(status(log.state, "m-r1-s0", S.READY, adapters=["py"]))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["sql"]}))
    (again,) = adapter_commands(log.state)
    assert again.adapters == first.adapters and again.key != first.key


def summary(sid: str, requests: int, waiting: int = 0) -> c.DemandSummary:
    ad = c.AdapterDemand(requests=requests, waiting=waiting)
    return c.DemandSummary(id=sid, router_id="r1", models={"m": c.ModelDemand(adapters={"x": ad})})


def test_demand_is_smoothed_counted_once_per_summary_and_waiting_is_counted_apart():
    sm = DemandSmoother(half_life=10.0)
    sm.update([], 0.0)
    sm.heard(s1 := summary("s1", 10))
    demand, waiting = sm.update([s1], 10.0)  # 1 req/s for 10 s, half weight
    assert abs(demand["m"]["x"] - 0.5) < 1e-9 and waiting == {}
    demand, _ = sm.update([s1], 20.0)  # the same summary read again: no requests
    assert abs(demand["m"]["x"] - 0.25) < 1e-9
    sm.heard(s2 := summary("s2", 0, waiting=3))
    demand, waiting = sm.update([s2], 30.0)
    # A queue is a count the placement weighs against expected requests (placement.py),
    # never added to a rate: added, a tail queue outweighed a popular adapter's rate.
    assert abs(demand["m"]["x"] - 0.125) < 1e-9 and waiting == {"m": {"x": 3}}


def test_every_summary_heard_counts_though_a_later_one_replaced_it_before_a_decision():
    # A router sends one at once when a request starts waiting: the leader keeps only its
    # latest, so counting from the latest lost the arrivals of the one it replaced.
    sm = DemandSmoother(half_life=10.0)
    sm.update([], 0.0)
    sm.heard(summary("s1", 6))
    sm.heard(latest := summary("s2", 4, waiting=1))
    demand, waiting = sm.update([latest], 10.0)
    assert abs(demand["m"]["x"] - 0.5) < 1e-9 and waiting == {"m": {"x": 1}}


def test_a_queue_is_aged_from_when_it_was_first_heard_of_until_it_empties():
    ages = QueueAges()
    assert ages.update({"m": {"x": 2}}, 10.0) == {"m": {"x": 0.0}}
    assert ages.update({"m": {"x": 3, "y": 1}}, 14.0) == {"m": {"x": 4.0, "y": 0.0}}
    assert ages.update({"m": {"y": 1}}, 15.0) == {"m": {"y": 1.0}}  # x served
    assert ages.update({"m": {"x": 1, "y": 1}}, 16.0) == {"m": {"x": 0.0, "y": 2.0}}


def test_the_lora_tick_must_be_positive():
    (problem,) = validate(ReconcilerConfig(actor=ActorConfig(lora_tick=0)))
    assert problem.startswith("actor.lora_tick = 0")


def test_a_decision_that_leaves_a_replica_as_it_was_keeps_its_command_key():
    # m-r2's load is slow: a decision that changes m-r1 only must not give m-r2's command
    # a new key, which the tracker sends as new and the agent starts its retries over for.
    log = ready_base()
    log.append(c.AdapterDeclared(name="py", base="m", source="/l/py"))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": [], "m-r2": ["sql"]}))
    (slow,) = adapter_commands(log.state)
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["py"], "m-r2": ["sql"]}))
    keys = {x.shard_id: x.key for x in adapter_commands(log.state)}
    assert keys["m-r2-s0"] == slow.key and keys["m-r1-s0"] != slow.key
    # The key is the state's, as a new leader loads it: the same after a replay.
    assert log.state.adapter_holdings["m"].changed_seq == {
        "m-r1": log.state.last_seq,
        "m-r2": log.state.last_seq - 1,
    }
