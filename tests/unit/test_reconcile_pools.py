"""A disaggregated model's prefill and decode pools: placed, started, scaled, rolled and
replayed each on its own, as pure decisions over folded events."""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.opcli import explain
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.projection import records
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.controllers.replicas.backoff import ReplacementBackoff
from llmgw.reconciler.state import checks, queries
from llmgw.reconciler.store import rows

from ._cluster import Log, model, node, status

S = c.ShardState
CONNECTOR = c.ConnectorSpec(kind="ExampleConnector", shared_path="/mnt/kv")


def pd_model(
    prefill: int = 1, decode: int = 2, decode_profile: c.ServingProfile | None = None
) -> c.ModelDeclared:
    return c.ModelDeclared(
        name="m",
        replicas=0,
        profile=c.ServingProfile(engine="sim", max_num_seqs=8),
        disaggregation=c.DisaggregationSpec(
            prefill=c.PoolSpec(replicas=prefill),
            decode=c.PoolSpec(replicas=decode, profile=decode_profile),
            connector=CONNECTOR,
            min_prompt_tokens=64,
        ),
    )


def settle(log: Log, rounds: int = 10) -> None:
    """Fold the plan's events until there are none, answering start commands with ready."""
    for _ in range(rounds):
        plan = reconcile.decide(log.state)
        if plan.events:
            log.append(*plan.events)
            continue
        starts = [cmd for cmd in plan.commands if isinstance(cmd, c.StartShard)]
        if not starts:
            return
        for cmd in starts:
            log.append(status(log.state, cmd.shard_id, S.READY))
    raise AssertionError("did not settle")


def placed(log: Log) -> dict[str, str]:
    """Active replica id -> role."""
    return {r.replica_id: r.role for r in log.state.replicas.values() if not r.retired}


def test_each_pool_gets_its_count_with_its_role_and_a_replica_id_naming_it():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=2))
    plan = reconcile.decide(log.state)
    got = [(ev.replica_id, ev.role) for ev in plan.events]
    assert got == [
        ("m-prefill-r1", "prefill"),
        ("m-decode-r1", "decode"),
        ("m-decode-r2", "decode"),
    ]
    assert all(isinstance(ev, c.PlacementDecided) for ev in plan.events)
    assert "(decode pool) placed on a" in plan.events[1].explanation
    assert all(v.node == "a" for ev in plan.events for v in ev.verdicts)
    log.append(*plan.events)
    assert placed(log) == {
        "m-prefill-r1": "prefill",
        "m-decode-r1": "decode",
        "m-decode-r2": "decode",
    }


def test_start_carries_the_role_the_connector_and_the_pools_profile():
    decode_profile = c.ServingProfile(engine="sim", max_num_seqs=32)
    log = Log().append(node("a", 4), pd_model(decode=1, decode_profile=decode_profile))
    log.append(*reconcile.decide(log.state).events)
    starts = {cmd.replica_id: cmd for cmd in reconcile.decide(log.state).commands}
    prefill, decode = starts["m-prefill-r1"], starts["m-decode-r1"]
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.connector == decode.connector == CONNECTOR
    assert prefill.profile.max_num_seqs == 8  # the model's profile: the pool has none
    assert decode.profile == decode_profile


def test_an_aggregated_model_starts_without_role_or_connector():
    log = Log().append(node("a", 1), model("m"))
    log.append(*reconcile.decide(log.state).events)
    (start,) = reconcile.decide(log.state).commands
    assert (start.role, start.connector, start.replica_id) == ("", None, "m-r1")


def test_scaling_one_pool_down_retires_only_that_pools_replicas():
    log = Log().append(node("a", 4), pd_model(prefill=2, decode=2))
    settle(log)
    log.append(pd_model(prefill=2, decode=1))
    plan = reconcile.decide(log.state)
    assert [(type(ev).__name__, ev.replica_id) for ev in plan.events] == [
        ("ReplicaRetired", "m-decode-r2")
    ]
    assert plan.events[0].reason == "scale down: decode pool 1 wanted, 2 active"
    log.append(*plan.events)
    drains = [cmd.shard_id for cmd in reconcile.decide(log.state).commands]
    assert drains == ["m-decode-r2-s0"]


def test_changing_one_pools_profile_rolls_only_that_pool():
    log = Log().append(node("a", 6), pd_model(prefill=1, decode=2))
    settle(log)
    before = placed(log)
    log.append(pd_model(prefill=1, decode=2, decode_profile=c.ServingProfile(max_num_seqs=4)))
    assert queries.outdated(log.state, "m", "prefill") == []
    assert len(queries.outdated(log.state, "m", "decode")) == 2
    settle(log)
    after = placed(log)
    assert "m-prefill-r1" in after  # never touched
    assert sorted(r for r in after if r not in before) == ["m-decode-r3", "m-decode-r4"]
    assert sum(1 for role in after.values() if role == "decode") == 2


def test_a_pool_that_cannot_be_placed_fails_with_its_role_while_the_other_places():
    log = Log().append(
        node("a", 2),
        pd_model(prefill=1, decode=1, decode_profile=c.ServingProfile(gpus_per_shard=4)),
    )
    plan = reconcile.decide(log.state)
    decided, failed = plan.events
    assert (decided.replica_id, decided.role) == ("m-prefill-r1", "prefill")
    assert isinstance(failed, c.PlacementFailed) and failed.role == "decode"
    assert failed.replica_id == "m-decode-r1"
    assert failed.explanation.startswith("m-decode-r1 (decode pool) cannot be placed")
    assert "needs 4 GPUs per shard" in failed.explanation
    log.append(*plan.events)
    assert records.model_record(log.state, "m").unplaceable == failed.explanation


def test_the_projection_has_the_spec_and_each_endpoint_its_role():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=1))
    settle(log)
    rec = records.model_record(log.state, "m")
    assert rec.disaggregation == log.state.models["m"].disaggregation
    assert {e.replica_id: e.role for e in rec.endpoints} == {
        "m-prefill-r1": "prefill",
        "m-decode-r1": "decode",
    }


def test_turning_an_aggregated_model_disaggregated_replaces_its_replicas():
    log = Log().append(node("a", 4), model("m", replicas=2))
    settle(log)
    log.append(pd_model(prefill=1, decode=1))
    settle(log)
    assert placed(log) == {"m-prefill-r1": "prefill", "m-decode-r1": "decode"}


def test_pool_ids_never_collide_with_a_model_named_like_a_pool():
    log = Log().append(node("a", 4), model("m-prefill", replicas=1))
    settle(log)
    log.append(pd_model(prefill=1, decode=1))
    settle(log)
    assert placed(log) == {"m-prefill-r1": "", "m-prefill-r2": "prefill", "m-decode-r1": "decode"}


def test_a_pools_shard_is_adopted_back_only_into_its_own_pool():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=1))
    settle(log)
    shard = log.state.shards["m-prefill-r1-s0"]
    assert queries.adoptable(log.state, "m", "prefill") == []  # owned
    log.append(
        c.ReplicaRetired(model="m", replica_id="m-prefill-r1", based_on_seq=0, reason="test")
    )
    assert [s.shard_id for s in queries.adoptable(log.state, "m", "prefill")] == [shard.shard_id]
    assert queries.adoptable(log.state, "m", "decode") == []
    assert queries.adoptable(log.state, "m") == []


def test_replay_of_pool_placements_is_clean_and_a_wrong_role_is_reported():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=2))
    settle(log)
    log.append(pd_model(prefill=2, decode=1))
    settle(log)
    result = replay.replay(log.events)
    assert len(result.checks) == 4 and result.differing(strict=True) == []
    # The same decision recorded as aggregated: no such pool, and not its id.
    seq, first = next((s, e) for s, e in log.events if isinstance(e, c.PlacementDecided))
    wrong = list(log.events)
    wrong[seq - 1] = (seq, c.PlacementDecided(**{**_fields(first), "role": ""}))
    (bad,) = replay.replay(wrong).differing()
    assert bad.differences[0] == (
        f"role: recorded aggregated, but model m had the prefill pool, the decode pool "
        f"at seq {first.based_on_seq}"
    )
    assert bad.differences[1] == ("replica id: m-prefill-r1 is not an id of aggregated (m-r<n>)")


def _fields(ev: c.Message) -> dict:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}


def test_explain_shows_both_pools_the_connector_and_each_replicas_role():
    sim = {"engine": "sim", "gpus_per_shard": 1, "shards_per_replica": 1}
    data = {
        "model": "m",
        "declared": True,
        "desired_replicas": 3,
        "profile": sim,
        "disaggregation": {
            "connector": {"kind": "ExampleConnector", "shared_path": "/mnt/kv", "extra": {}},
            "min_prompt_tokens": 64,
        },
        "pools": [
            {
                "role": "prefill",
                "desired_replicas": 1,
                "placed": 1,
                "ready": 1,
                "own_profile": False,
                "profile": sim,
            },
            {
                "role": "decode",
                "desired_replicas": 2,
                "placed": 2,
                "ready": 1,
                "own_profile": True,
                "profile": {**sim, "gpus_per_shard": 2},
            },
        ],
        "decisions": [
            {
                "replica_id": "m-decode-r1",
                "role": "decode",
                "seq": 7,
                "based_on_seq": 5,
                "outcome": "decided",
                "assignments": [{"shard_index": 0, "node": "a", "gpus": ["g0"]}],
                "verdicts": [{"node": "a", "fits": True, "reason": "chosen"}],
            },
        ],
        "replicas": [{"replica_id": "m-decode-r1", "role": "decode", "state": "ready"}],
    }
    text = explain.render(data)
    assert text[:5] == [
        "m: 3 replica(s) wanted; engine sim, 1 GPU(s) per shard x 1 shard(s)",
        "disaggregated: a prefill pool computes prompts, a decode pool generates",
        "  prefill  1 wanted, 1 placed, 1 ready; engine sim, 1 GPU(s) per shard x 1 shard(s) "
        "(the model's profile)",
        "  decode   2 wanted, 2 placed, 1 ready; engine sim, 2 GPU(s) per shard x 1 shard(s) "
        "(its own profile)",
        "  connector ExampleConnector, shared path /mnt/kv",
    ]
    assert text[5] == "  prompts under 64 tokens skip prefill (decode pool alone)"
    assert text[7].startswith("m-decode-r1 (decode)  seq 7, based on seq 5")


def test_a_placement_for_an_unknown_role_is_refused_by_the_fold_checks():
    log = Log().append(node("a", 1), pd_model())
    ev = c.PlacementDecided(
        model="m", replica_id="m-x-r1", based_on_seq=2, assignments=[], role="prefil"
    )
    assert checks.refusal(log.state, ev) == (
        "role 'prefil' is not one of prefill, decode (or empty: aggregated)"
    )
    assert (
        checks.refusal(log.state, c.PlacementDecided(**{**_fields(ev), "role": "decode"})) is None
    )


def test_a_failing_pool_is_held_back_while_the_other_is_still_replaced():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=1))
    settle(log)
    backoff = ReplacementBackoff(initial=5.0)
    for rid in ("m-decode-r1", "m-prefill-r1"):
        changes = log.apply(status(log.state, f"{rid}-s0", S.FAILED, reason="exit 1"))
        backoff.observe(log.state, changes, 0.0)
    log.append(*reconcile.decide(log.state, hold=backoff.held(0.0)).events)  # both retired
    assert backoff.held(0.0) == {("m", "decode"), ("m", "prefill")}
    # The prefill pool's profile works after all: only the decode pool waits.
    log.append(*reconcile.decide(log.state, hold={("m", "decode")}).events)
    backoff.observe(log.state, log.apply(status(log.state, "m-prefill-r2-s0", S.READY)), 1.0)
    assert backoff.held(1.0) == {("m", "decode")}
    assert sorted(placed(log)) == ["m-prefill-r2"]
    plan = reconcile.decide(log.state, hold=backoff.held(6.0))
    assert [(ev.replica_id, ev.role) for ev in plan.events] == [("m-decode-r2", "decode")]


def test_a_killed_prefill_engine_is_replaced_in_its_pool_and_decode_is_untouched():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=2))
    settle(log)
    log.append(status(log.state, "m-prefill-r1-s0", S.FAILED, reason="exit -9"))
    plan = reconcile.decide(log.state)
    assert [(type(ev).__name__, ev.replica_id) for ev in plan.events] == [
        ("ReplicaRetired", "m-prefill-r1"),
        ("PlacementDecided", "m-prefill-r2"),
    ]
    assert plan.events[0].reason == "shard m-prefill-r1-s0 failed: exit -9; replaced"
    log.append(*plan.events)
    assert placed(log) == {
        "m-prefill-r2": "prefill",
        "m-decode-r1": "decode",
        "m-decode-r2": "decode",
    }


def test_a_new_leader_loading_the_tables_keeps_the_pools_and_decides_nothing_new():
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=2))
    settle(log)
    table_rows = {n: list(r.values()) for n, r in rows.all_rows(log.state).items()}
    loaded = rows.state_from_rows(table_rows, log.state.last_seq)
    assert {r.replica_id: r.role for r in loaded.replicas.values()} == placed(log)
    assert reconcile.decide(loaded).events == []
    assert queries.next_replica_id(loaded, "m", "decode") == "m-decode-r3"
    assert queries.next_replica_id(loaded, "m", "prefill") == "m-prefill-r2"


def test_replay_explain_of_a_pool_decision_shows_the_pool_and_its_profile():
    decode_profile = c.ServingProfile(engine="sim", gpus_per_shard=2)
    log = Log().append(node("a", 4), pd_model(prefill=1, decode=1, decode_profile=decode_profile))
    settle(log)
    seq = next(s for s, e in log.events if isinstance(e, c.PlacementDecided) and e.role == "decode")
    lines = replay.render_inputs(replay.inputs_at(log.events, seq))
    assert lines[0].startswith(f"seq {seq}: decision for m-decode-r1 of m")
    assert lines[1] == "pool: decode"
    assert lines[2].startswith("profile: engine sim, 2 GPU(s) per shard x 1 shard(s)")
    assert lines[2].endswith("; 1 replica(s) wanted")
    assert lines[-1] == "re-derived: placed on a[a-GPU-1,a-GPU-2]"
