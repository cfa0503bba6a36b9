"""The replica index gives exactly the ids a scan of every replica gives, at O(1) per call.

`scan` below is how the next id was found before the index: every replica ever
placed, parsed on every call. Random histories (placements with the ids
reconcile makes and with odd ones, retirements, models removed and declared
again, names sharing a token) must get the same answers from the index after
every event, after a copy, after a load from the tables and after a fold
continued on a loaded state.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from llmgw import contracts as c
from llmgw import subjects
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.intake.batch import replace_contents
from llmgw.reconciler.state import checks, fold, ids, queries, replica_index
from llmgw.reconciler.state.model import ClusterState, ReplicaView
from llmgw.reconciler.store import rows

# Names that share a token ("a/b", "a.b", "a:b" -> "a_b"; "org/model:v1" and
# "org_model_v1"), a name ending like a replica id, and plain ones.
MODELS = ["m", "q", "a/b", "a.b", "a:b", "x-r2", "org/model:v1", "org_model_v1"]


def scan(state: ClusterState, model: str) -> str:
    token = subjects.safe_token(model)
    top = 0
    for rid, replica in state.replicas.items():
        parsed = ids.parse_replica_id(rid)
        if parsed is not None and (parsed[0] == token or replica.model == model):
            top = max(top, parsed[1])
    return ids.replica_id(model, top + 1)


def assert_same(state: ClusterState, where: str) -> None:
    for m in MODELS:
        assert queries.next_replica_id(state, m) == scan(state, m), f"{where}: model {m}"


def decided(model: str, rid: str) -> c.PlacementDecided:
    return c.PlacementDecided(model=model, replica_id=rid, based_on_seq=0, assignments=[])


def random_event(rng: random.Random, state: ClusterState) -> c.Message:
    model = rng.choice(MODELS)
    roll = rng.random()
    if roll < 0.1:
        return c.ModelDeclared(name=model, replicas=rng.randint(0, 3))
    if roll < 0.15:
        return c.ModelRemoved(name=model)
    if roll < 0.35 and state.replicas:
        rid = rng.choice(list(state.replicas))
        return c.ReplicaRetired(model=model, replica_id=rid, based_on_seq=0, reason="down")
    if roll < 0.7:
        return decided(model, queries.next_replica_id(state, model))
    # Ids reconcile would not make: another model's token, no number, a leading zero,
    # a big number, an id already placed (refused by checks; replaced without them).
    other = subjects.safe_token(rng.choice(MODELS))
    n = rng.randint(1, 40)
    rid = rng.choice(
        [
            f"{other}-r{n}",
            f"{other}-r0{n}",
            f"{other}-r{n * 1000}",
            "weird",
            f"{other}-rx",
            *(list(state.replicas)[-3:] or ["weird"]),
        ]
    )
    return decided(model, rid)


def loaded_from_tables(state: ClusterState) -> ClusterState:
    table_rows = {name: list(by_key.values()) for name, by_key in rows.all_rows(state).items()}
    return rows.state_from_rows(table_rows, state.last_seq)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("seed", range(25))
def test_the_index_gives_the_scans_ids_over_random_histories(seed: int, checked: bool):
    rng = random.Random(seed)
    state = ClusterState()
    seq = 0
    for step in range(300):
        event = random_event(rng, state)
        if checked and checks.refusal(state, event) is not None:
            continue
        seq += 1
        fold.apply(state, seq, event)
        assert_same(state, f"after event {step}")
        if step % 50 == 25:
            assert_same(state.copy(), f"copy after event {step}")
            scratch = reconcile.Scratch(state)
            scratch.apply(decided("q", queries.next_replica_id(state, "q")))
            assert_same(scratch.state, f"plan scratch after event {step}")
            assert_same(state, f"after the plan's scratch at event {step}")
    loaded = loaded_from_tables(state)
    assert_same(loaded, "loaded from the tables")
    # The leader goes on folding on the state it loaded.
    for step in range(100):
        event = random_event(rng, loaded)
        if checked and checks.refusal(loaded, event) is not None:
            continue
        seq += 1
        fold.apply(loaded, seq, event)
        assert_same(loaded, f"loaded, then event {step}")


def test_a_replica_placed_again_under_another_model_no_longer_counts_for_the_first():
    # Only a fold without checks replaces a replica; the index must not keep the number.
    state = ClusterState()
    fold.apply(state, 1, decided("m", "x-r5"))
    assert queries.next_replica_id(state, "m") == "m-r6"
    fold.apply(state, 2, decided("q", "x-r5"))
    assert queries.next_replica_id(state, "m") == scan(state, "m") == "m-r1"
    assert queries.next_replica_id(state, "q") == scan(state, "q") == "q-r6"


def test_a_state_swapped_in_place_for_a_fresh_load_gets_the_loads_ids():
    # The folder replaces the actor's state contents with a load from the tables
    # after a fold crash: the index must follow the new replicas, not the old ones.
    state = ClusterState()
    for seq in range(1, 4):
        fold.apply(state, seq, decided("m", queries.next_replica_id(state, "m")))
    assert queries.next_replica_id(state, "m") == "m-r4"
    fresh = ClusterState()
    fold.apply(fresh, 1, decided("m", "m-r1"))
    replace_contents(state, loaded_from_tables(fresh))
    assert queries.next_replica_id(state, "m") == "m-r2"


class _Counted(ReplicaView):
    """A replica view that counts how often the index reads its model."""

    reads = 0

    def __getattribute__(self, name: str):
        if name == "model":
            type(self).reads += 1
        return super().__getattribute__(name)


def test_asking_again_reads_only_the_replicas_added_since():
    state = ClusterState()
    for n in range(1, 1001):
        state.replicas[f"m-r{n}"] = _Counted(replica_id=f"m-r{n}", model="m", retired=True)
    _Counted.reads = 0
    assert queries.next_replica_id(state, "m") == "m-r1001"
    assert _Counted.reads == 1000  # the first question reads them all, once
    for _ in range(10):
        assert queries.next_replica_id(state, "m") == "m-r1001"
    state.replicas["m-r1001"] = _Counted(replica_id="m-r1001", model="m")
    assert queries.next_replica_id(state, "m") == "m-r1002"
    assert _Counted.reads == 1001  # ten more questions and one new replica: one more read
    assert queries.next_replica_id(state.copy(), "q") == "q-r1"
    assert _Counted.reads == 1001  # a copy carries the index over


def test_the_index_is_not_part_of_the_state():
    with_index = ClusterState()
    fold.apply(with_index, 1, decided("m", "m-r1"))
    queries.next_replica_id(with_index, "m")
    assert replica_index.index_of(with_index).read == 1
    without = loaded_from_tables(with_index)
    assert getattr(without, "_replica_index", None) is None
    assert with_index == without and with_index == with_index.copy()
    assert msgspec.to_builtins(with_index) == msgspec.to_builtins(without)
    assert msgspec.json.encode(with_index) == msgspec.json.encode(without)
    assert rows.all_rows(with_index) == rows.all_rows(without)
