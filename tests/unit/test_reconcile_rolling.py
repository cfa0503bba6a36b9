"""Rolling update: a changed serving profile replaces running replicas, one surge at a time."""

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.state import queries
from llmgw.reconciler.state.model import profile_digest

from ._cluster import Log, model, node, status

S = c.ShardState


def step(log: Log) -> reconcile.Plan:
    """Decide once and fold the plan's events into the log."""
    plan = reconcile.decide(log.state)
    log.append(*plan.events)
    return plan


def make_ready(log: Log) -> None:
    """The agents answer every start command the state calls for."""
    for cmd in reconcile.decide(log.state).commands:
        if isinstance(cmd, c.StartShard):
            log.append(status(log.state, cmd.shard_id, S.READY))


def running(log: Log, n_gpus: int = 4, replicas: int = 2) -> Log:
    log.append(node("a", n_gpus), model("m", replicas=replicas, engine_args=["--old"]))
    step(log)
    make_ready(log)
    assert reconcile.decide(log.state).events == []
    return log


def active(log: Log) -> list[str]:
    return sorted(r.replica_id for r in log.state.active_replicas("m"))


def retired(plan: reconcile.Plan) -> list[str]:
    return [ev.replica_id for ev in plan.events if isinstance(ev, c.ReplicaRetired)]


def placed(plan: reconcile.Plan) -> list[str]:
    return [ev.replica_id for ev in plan.events if isinstance(ev, c.PlacementDecided)]


def test_changed_profile_places_one_surge_replica_and_retires_nothing_yet():
    log = running(Log())
    log.append(model("m", replicas=2, engine_args=["--new"]))
    plan = step(log)
    assert placed(plan) == ["m-r3"] and retired(plan) == []
    assert step(log).events == []  # surge 1: no second extra replica while m-r3 starts
    starts = [cmd for cmd in reconcile.decide(log.state).commands if isinstance(cmd, c.StartShard)]
    assert [(s.replica_id, s.profile.engine_args) for s in starts] == [("m-r3", ["--new"])]


def test_ready_surge_replica_retires_one_outdated_which_drains_first():
    log = running(Log())
    log.append(model("m", replicas=2, engine_args=["--new"]))
    step(log)
    make_ready(log)
    plan = step(log)
    assert retired(plan) == ["m-r2"]  # the newest outdated one, as scale-down picks
    assert "rolling update" in plan.events[0].reason
    assert placed(plan) == ["m-r4"]  # the next surge replica, in the same plan
    cmds = {cmd.shard_id: cmd for cmd in reconcile.decide(log.state).commands}
    assert isinstance(cmds["m-r2-s0"], c.DrainShard)  # ready: drained, not stopped
    ready = [r for r in log.state.active_replicas("m") if queries.is_ready(log.state, r)]
    assert len(ready) == 2  # never below the declared count


def test_roll_repeats_until_no_replica_is_outdated_then_settles():
    log = running(Log())
    log.append(model("m", replicas=2, engine_args=["--new"]))
    for _ in range(6):
        step(log)
        make_ready(log)
        ready = [r for r in log.state.active_replicas("m") if queries.is_ready(log.state, r)]
        assert len(ready) >= 2 and len(active(log)) <= 3
    assert active(log) == ["m-r3", "m-r4"]
    assert queries.outdated(log.state, "m") == []
    assert step(log).events == []


def test_same_profile_declared_again_changes_nothing():
    log = running(Log())
    log.append(model("m", replicas=2, engine_args=["--old"]))  # a new event, same content
    plan = reconcile.decide(log.state)
    assert plan.events == [] and not any(isinstance(x, c.StartShard) for x in plan.commands)


def test_no_room_to_surge_retires_one_outdated_at_a_time():
    log = running(Log(), n_gpus=2, replicas=2)  # every GPU taken: the surge cannot fit
    log.append(model("m", replicas=2, engine_args=["--new"]))
    plan = step(log)
    assert [type(ev).__name__ for ev in plan.events] == ["PlacementFailed", "ReplicaRetired"]
    assert retired(plan) == ["m-r2"]
    assert step(log).events == []  # m-r2 still drains: nothing more given up
    log.append(status(log.state, "m-r2-s0", S.STOPPED))
    assert placed(step(log)) == ["m-r3"]
    make_ready(log)
    step(log)  # surge fails again, so m-r1 makes room in turn
    log.append(status(log.state, "m-r1-s0", S.STOPPED))
    step(log)
    make_ready(log)
    assert active(log) == ["m-r3", "m-r4"] and queries.outdated(log.state, "m") == []


def test_scale_down_during_a_roll_retires_outdated_replicas_first():
    log = running(Log(), replicas=3)
    log.append(model("m", replicas=1, engine_args=["--new"]))
    plan = step(log)
    assert retired(plan) == ["m-r3"] and placed(plan) == []  # 1 wanted + 1 surge
    plan = step(log)
    assert retired(plan) == ["m-r2"]  # spare: m-r1 still serves the one wanted
    assert placed(plan) == ["m-r4"]
    make_ready(log)
    assert retired(step(log)) == ["m-r1"]
    assert active(log) == ["m-r4"]


def test_profile_that_cannot_fit_anywhere_costs_no_serving_replica():
    log = running(Log(), n_gpus=2, replicas=2)
    log.append(model("m", replicas=2, engine_args=["--new"], gpus_per_shard=4))
    plan = step(log)
    assert [type(ev).__name__ for ev in plan.events] == ["PlacementFailed"]
    assert active(log) == ["m-r1", "m-r2"]  # both keep serving the old profile


class _NextProfile(c.ServingProfile, kw_only=True):
    """ServingProfile as a later version might have it: one more field, with a default."""

    speculative_tokens: int | None = None


def test_a_field_added_to_the_profile_rolls_nothing_until_someone_sets_it():
    log = running(Log())

    def redeclare(profile: c.ServingProfile) -> None:
        # After an upgrade the reconciler reads the same declaration through the wider struct.
        log.state.models["m"] = c.ModelDeclared(name="m", replicas=2, profile=profile)

    redeclare(_NextProfile(engine_args=["--old"]))
    assert queries.outdated(log.state, "m") == [] and reconcile.decide(log.state).events == []
    redeclare(_NextProfile(engine_args=["--old"], speculative_tokens=4))
    assert sorted(r.replica_id for r in queries.outdated(log.state, "m")) == ["m-r1", "m-r2"]
    assert placed(reconcile.decide(log.state)) == ["m-r3"]


def test_profile_digests_are_stable_across_versions():
    # Replicas keep the digest they were placed with (Postgres, the event archive's
    # replay): a digest computed differently for the same profile would roll the fleet.
    p = c.ServingProfile(
        engine="vllm",
        model_ref="org/m",
        engine_args=["--a"],
        max_model_len=8192,
        selector={"zone": "z1"},
    )
    assert profile_digest(p) == "4f137402ce530de7"
    assert profile_digest(c.ServingProfile(engine="sim")) == profile_digest(c.ServingProfile())
    assert profile_digest(c.ServingProfile(max_model_len=4096)) != profile_digest(p)
