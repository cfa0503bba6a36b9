"""State <-> rows: what the projection tables hold is exactly the folded state."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import contracts as c
from llmgw.reconciler.state import fold, queries
from llmgw.reconciler.state.model import (
    AdapterHoldings,
    ClusterState,
    NodeView,
    ReplicaView,
    ShardView,
)
from llmgw.reconciler.store import rows


def events() -> list[c.Message]:
    gpus = {
        f"GPU-{i}": c.GpuInfo(uuid=f"GPU-{i}", index=i, name="H200", memory_bytes=141 << 30)
        for i in range(2)
    }
    return [
        c.BandsDeclared(bands=[c.Band(name="hi", ceiling=1.5), c.Band(name="lo")]),
        c.ModelDeclared(name="m", replicas=2, aliases=["mm"]),
        c.TenantDeclared(name="t", band="hi", quotas=c.Quotas(rpm=10)),
        c.NodeRegistered(node="a", gpus=gpus, labels={"fabric": "ib"}),
        c.PlacementDecided(
            model="m",
            replica_id="m-r1",
            based_on_seq=4,
            assignments=[
                c.ShardAssignment(shard_id="m-r1-s0", shard_index=0, node="a", gpus=["GPU-0"])
            ],
            verdicts=[c.NodeVerdict(node="a", fits=True, reason="2 free GPUs")],
        ),
        c.PlacementFailed(model="m", replica_id="m-r2", based_on_seq=5, explanation="no room"),
        c.ShardStatus(
            node="a",
            shard_id="m-r1-s0",
            model="m",
            replica_id="m-r1",
            state=c.ShardState.FAILED,
            exit_code=1,
            output_tail=["boom"],
        ),  # fmt: skip
        c.NodeUnreachable(node="a", last_seen=1.0),
        c.ModelDeclared(name="auto", replicas=1, autoscale=c.AutoscaleSpec(min=1, max=3)),
        c.ModelScaled(
            model="auto",
            from_replicas=1,
            to_replicas=3,
            rule="scale_up",
            signals=c.ScaleSignals(load=2.5, in_flight=20, capacity=8, ready=1, routers=2),
            sustained_seconds=30.0,
            explanation="scaled 1 → 3",
            inputs=[
                c.RouterInput(router_id="r1", process=7, demand=c.ModelDemand(in_flight=20)),
                c.RouterInput(router_id="r2"),
            ],
            since_last_change_seconds=42.5,
        ),
        c.ModelDeclared(
            name="base", replicas=1, profile=c.ServingProfile(max_loras=2, max_lora_rank=8)
        ),
        c.AdapterDeclared(name="sql", base="base", source="/lora/sql", tenants=["t"], pinned=1),
        c.AdaptersPlaced(
            model="base", holdings={"base-r1": ["sql"]}, demand={"sql": 1.5}, explanation="x"
        ),
        c.ShardStatus(
            node="a",
            shard_id="base-r1-s0",
            model="base",
            replica_id="base-r1",
            state=c.ShardState.READY,
            adapters=["sql"],
            adapter_errors={"chat": "404 NotFoundError"},
        ),
    ]


def folded() -> ClusterState:
    st = ClusterState()
    for seq, ev in enumerate(events(), 1):
        fold.apply(st, seq, ev)
    return st


def builtins(state: ClusterState):
    return msgspec.to_builtins(state)


def test_rows_round_trip_to_the_same_state():
    st = folded()
    table_rows = {name: list(by_key.values()) for name, by_key in rows.all_rows(st).items()}
    back = rows.state_from_rows(table_rows, st.last_seq)
    assert builtins(back) == builtins(st)
    assert [b.name for b in back.bands] == ["hi", "lo"]  # priority order survives


def test_writes_follow_the_change_set_including_deletes():
    st = folded()
    changes = fold.apply(st, 100, c.ModelRemoved(name="m"))
    w = rows.writes_for(st, changes)
    assert w.deletes == {"models": ["m"], "placement_failures": ["m-r2"]}
    assert w.upserts == {} and w.bands is None
    changes = fold.apply(st, 101, c.BandsDeclared(bands=[c.Band(name="only")]))
    assert rows.writes_for(st, changes).bands == [
        {
            "name": "only",
            "ceiling": 1.0,
            "queue_capacity": 1000,
            "queue_ttl_seconds": 30.0,
            "position": 0,
        }
    ]


def test_the_next_replica_id_comes_back_from_the_tables_after_a_retirement():
    # Numbers are derived from the replicas, which keep a retired one's row: loading
    # the tables must not hand its id out again (a late status of it would land on it).
    st = folded()
    fold.apply(
        st, 200, c.ReplicaRetired(model="m", replica_id="m-r1", based_on_seq=9, reason="scale down")
    )
    loaded = rows.state_from_rows(
        {name: list(r.values()) for name, r in rows.all_rows(st).items()}, st.last_seq
    )
    assert queries.next_replica_id(loaded, "m") == queries.next_replica_id(st, "m") == "m-r2"


def test_a_change_kind_without_a_table_is_an_error():
    with pytest.raises(ValueError, match="no projection table"):
        rows.writes_for(ClusterState(), {("mystery", "x")})


def test_decision_rows_keep_every_verdict():
    ev = events()[4]
    row = rows.decision_row(9, ev)
    assert row["outcome"] == "decided" and row["seq"] == 9
    assert row["verdicts"] == [{"node": "a", "fits": True, "reason": "2 free GPUs"}]
    assert rows.decision_row(10, events()[5])["outcome"] == "failed"
    assert rows.decision_row(11, events()[0]) is None


def test_every_part_of_the_state_has_a_table_whose_columns_are_its_fields():
    """A field added to the state or a view without a projection column fails here first."""
    covered = {p.attr for p in rows.PROJECTIONS.values()} | {"bands", "last_seq", "term"}
    assert covered == set(ClusterState.__struct_fields__)
    views = {
        "node": NodeView,
        "shard": ShardView,
        "replica": ReplicaView,
        "holdings": AdapterHoldings,
    }
    messages = {
        "adapter": c.AdapterDeclared,
        "model": c.ModelDeclared,
        "tenant": c.TenantDeclared,
        "failure": c.PlacementFailed,
        "scaled": c.ModelScaled,
    }
    for kind, proj in rows.PROJECTIONS.items():
        columns = {col.name for col in proj.table.columns}
        if kind in views:
            assert columns == set(views[kind].__struct_fields__), kind
        elif kind in messages:
            envelope = {"v", "id", "ts"}
            fields = set(messages[kind].__struct_fields__) - envelope
            assert columns == fields | {"event_id", "event_ts"}, kind
    band_columns = {col.name for col in rows.BANDS_TABLE.columns}
    assert band_columns == set(c.Band.__struct_fields__) | {"position"}
