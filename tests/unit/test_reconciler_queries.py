"""State queries: ready, busy GPUs, outdated, adoptable and replica ids, answered once."""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.state import ids, queries

from ._cluster import Log, model, node, status


def settle(log: Log, rounds: int = 6) -> Log:
    """Publish what reconcile decides, and report every new shard ready, until quiet."""
    for _ in range(rounds):
        events = reconcile.decide(log.state).events
        if not events:
            break
        log.append(*events)
        for sid, sh in sorted(log.state.shards.items()):
            if sh.state == c.ShardState.PENDING:
                log.append(status(log.state, sid, c.ShardState.READY))
    return log


def active(log: Log, name: str) -> list[str]:
    return sorted(r.replica_id for r in log.state.active_replicas(name))


def test_replica_numbers_are_parsed_from_the_last_r_suffix():
    assert ids.replica_number("m-r12") == 12
    assert ids.replica_number("org_model-v1-r3") == 3
    assert ids.replica_number("a-r-r2") == 2
    assert ids.replica_number("m-rx") is None
    assert ids.replica_number("m") is None
    assert ids.parse_replica_id("org_model_v1-r4") == ("org_model_v1", 4)
    assert ids.parse_replica_id("m-r") is None
    assert ids.parse_replica_id("m-r²") is None  # not an ASCII digit: int() would raise
    assert ids.replica_id("org/model:v1", 4) == "org_model_v1-r4"


def test_next_replica_id_never_reuses_a_number_after_scale_down():
    log = settle(Log().append(node("a", 4), model("m", replicas=3)))
    assert active(log, "m") == ["m-r1", "m-r2", "m-r3"]
    assert queries.next_replica_id(log.state, "m") == "m-r4"
    log.append(model("m", replicas=1))
    settle(log)
    assert active(log, "m") == ["m-r1"]
    # m-r2 and m-r3 are retired but kept: their numbers are not handed out again.
    assert queries.next_replica_id(log.state, "m") == "m-r4"
    log.append(model("m", replicas=2))
    settle(log)
    assert active(log, "m") == ["m-r1", "m-r4"]


def test_a_model_declared_again_continues_its_numbers():
    log = settle(Log().append(node("a", 2), model("m", replicas=1)))
    log.append(c.ModelRemoved(name="m"))
    settle(log)
    assert active(log, "m") == []
    log.append(model("m", replicas=1))
    settle(log)
    assert active(log, "m") == ["m-r2"]


def test_a_new_model_with_the_same_token_does_not_take_a_removed_ones_ids():
    # "a/b" and "a.b" both make ids a_b-r<n>; the catalog refuses them together, not
    # one after the other. Reusing a_b-r1 would be refused by the fold ("already placed"):
    # the new model would never be placed.
    log = settle(Log().append(node("n", 2), model("a/b", replicas=1)))
    assert active(log, "a/b") == ["a_b-r1"]
    log.append(c.ModelRemoved(name="a/b"))
    settle(log)
    log.append(model("a.b", replicas=1))
    settle(log)
    assert active(log, "a.b") == ["a_b-r2"]
    assert log.state.replicas["a_b-r1"].model == "a/b"


def test_the_next_id_is_the_one_a_failure_is_recorded_for():
    log = Log().append(node("a", 1), model("m", replicas=2))
    settle(log)
    assert active(log, "m") == ["m-r1"]
    assert list(log.state.failures) == ["m-r2"] == [queries.next_replica_id(log.state, "m")]


def test_ready_means_every_shard_ready():
    log = Log().append(node("a", 2), model("m", replicas=1))
    log.append(*reconcile.decide(log.state).events)
    replica = log.state.replicas["m-r1"]
    assert not queries.is_ready(log.state, replica)  # pending
    log.append(status(log.state, "m-r1-s0", c.ShardState.READY))
    assert queries.is_ready(log.state, replica)
    log.append(status(log.state, "m-r1-s0", c.ShardState.DRAINING))
    assert not queries.is_ready(log.state, replica)


def test_busy_gpus_holders_and_model_shards():
    running = c.ShardInfo(
        shard_id="x-r9-s0",
        model="m",
        replica_id="x-r9",
        state=c.ShardState.READY,
        gpus=["a-GPU-1"],
    )
    log = Log().append(node("a", 3, shards=[running]), model("m", replicas=1))
    st = log.state
    # An unowned shard a node reports holds its GPU, but no active replica owns it.
    assert queries.busy_gpus(st) == {"a": {"a-GPU-1"}}
    assert queries.busy_gpus(st, owned_only=True) == {}
    assert queries.gpu_holders(st) == {("a", "a-GPU-1"): "x-r9-s0"}
    assert queries.model_shards(st, "m") == {"a": 1}
    log.append(status(st, "x-r9-s0", c.ShardState.STOPPED))
    assert queries.busy_gpus(st) == {} and queries.model_shards(st, "m") == {}


def test_adoptable_takes_ready_unowned_shards_only_once_owned_they_are_busy():
    running = c.ShardInfo(
        shard_id="x-r9-s0",
        model="m",
        replica_id="x-r9",
        state=c.ShardState.READY,
        gpus=["a-GPU-0"],
    )
    log = Log().append(node("a", 2, shards=[running]), model("m", replicas=1))
    assert [s.shard_id for s in queries.adoptable(log.state, "m")] == ["x-r9-s0"]
    log.append(*reconcile.decide(log.state).events)
    assert log.state.replicas["m-r1"].shard_ids == ["x-r9-s0"]
    assert queries.adoptable(log.state, "m") == []
    assert queries.busy_gpus(log.state, owned_only=True) == {"a": {"a-GPU-0"}}


def test_outdated_lists_active_replicas_of_another_profile_newest_first():
    log = settle(Log().append(node("a", 4), model("m", replicas=2)))
    assert queries.outdated(log.state, "m") == []
    log.append(model("m", replicas=2, max_model_len=4096))
    stale = queries.outdated(log.state, "m")
    assert [r.replica_id for r in stale] == ["m-r2", "m-r1"]
    assert queries.outdated(log.state, "missing") == []
    assert not queries.is_outdated("", "abc") and queries.is_outdated("abc", "def")
