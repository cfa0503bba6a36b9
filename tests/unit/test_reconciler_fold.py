from llmgw import contracts as c
from llmgw.reconciler.state import fold, queries
from llmgw.reconciler.state.model import ClusterState, Liveness


def gpu(i: int) -> c.GpuInfo:
    return c.GpuInfo(uuid=f"GPU-{i}", index=i, name="H200", memory_bytes=80 << 30)


def registered(node: str, shards=()) -> c.NodeRegistered:
    return c.NodeRegistered(
        node=node, gpus={f"GPU-{i}": gpu(i) for i in range(2)}, shards=list(shards)
    )


def decided(model="m", rid="m-r1", node="a") -> c.PlacementDecided:
    return c.PlacementDecided(
        model=model,
        replica_id=rid,
        based_on_seq=1,
        assignments=[
            c.ShardAssignment(shard_id=f"{rid}-s0", shard_index=0, node=node, gpus=["GPU-0"])
        ],
    )


def test_redelivered_or_old_sequences_change_nothing():
    st = ClusterState()
    assert fold.apply(st, 1, registered("a")) == {("node", "a")}
    assert fold.apply(st, 1, registered("b")) == set()
    assert fold.apply(st, 0, registered("c")) == set()
    assert set(st.nodes) == {"a"} and st.last_seq == 1


def test_placement_then_status_then_node_lost():
    st = ClusterState()
    fold.apply(st, 1, registered("a"))
    fold.apply(st, 2, decided())
    assert st.shards["m-r1-s0"].state == c.ShardState.PENDING
    assert queries.busy_gpus(st)["a"] == {"GPU-0"}
    assert queries.next_replica_id(st, "m") == "m-r2"
    fold.apply(
        st,
        3,
        c.ShardStatus(
            node="a",
            shard_id="m-r1-s0",
            model="m",
            replica_id="m-r1",
            state=c.ShardState.READY,
            url="http://x",
        ),
    )
    assert st.shards["m-r1-s0"].state == c.ShardState.READY
    fold.apply(st, 4, c.NodeUnreachable(node="a", last_seen=1.0))
    assert st.nodes["a"].liveness == Liveness.UNREACHABLE
    assert st.shards["m-r1-s0"].state == c.ShardState.READY  # unreachable is not gone
    changes = fold.apply(st, 5, c.NodeLost(node="a", last_seen=1.0))
    assert ("shard", "m-r1-s0") in changes
    assert (
        st.shards["m-r1-s0"].state == c.ShardState.FAILED
        and queries.busy_gpus(st).get("a", set()) == set()
    )


def test_registration_is_the_truth_about_what_a_node_runs():
    st = ClusterState()
    fold.apply(st, 1, registered("a"))
    fold.apply(st, 2, decided())
    fold.apply(
        st,
        3,
        c.ShardStatus(
            node="a", shard_id="m-r1-s0", model="m", replica_id="m-r1", state=c.ShardState.READY
        ),
    )
    orphan = c.ShardInfo(
        shard_id="x-r9-s0", model="x", replica_id="x-r9", state=c.ShardState.READY, gpus=["GPU-1"]
    )
    fold.apply(st, 4, registered("a", [orphan]))
    assert st.shards["m-r1-s0"].state == c.ShardState.STOPPED
    assert st.shards["x-r9-s0"].node == "a" and queries.busy_gpus(st)["a"] == {"GPU-1"}


def test_a_status_keeps_what_it_leaves_empty_a_registration_takes_every_field():
    st = ClusterState()
    fold.apply(st, 1, registered("a"))
    fold.apply(st, 2, decided())
    url = "http://a:8000"
    ready = c.ShardStatus(
        node="a",
        shard_id="m-r1-s0",
        model="m",
        replica_id="m-r1",
        state=c.ShardState.READY,
        url=url,
        port=8000,
        gpus=["GPU-0"],
    )
    fold.apply(st, 3, ready)
    # A failure before anything listens says no URL, port or GPUs: the known ones stay.
    failed = c.ShardStatus(
        node="a", shard_id="m-r1-s0", model="m", replica_id="m-r1", state=c.ShardState.FAILED
    )
    fold.apply(st, 4, failed)
    shard = st.shards["m-r1-s0"]
    assert (shard.state, shard.url, shard.port, shard.gpus) == (
        c.ShardState.FAILED,
        url,
        8000,
        ["GPU-0"],
    )
    # A registration is the node's whole inventory: what it says is what the shard is.
    again = c.ShardInfo(
        shard_id="m-r1-s0", model="m", replica_id="m-r1", state=c.ShardState.LOADING, gpus=["GPU-1"]
    )
    fold.apply(st, 5, registered("a", [again]))
    shard = st.shards["m-r1-s0"]
    assert (shard.state, shard.url, shard.port, shard.gpus) == (
        c.ShardState.LOADING,
        "",
        0,
        ["GPU-1"],
    )


def test_copy_is_deep():
    st = ClusterState()
    fold.apply(st, 1, registered("a"))
    other = st.copy()
    fold.apply(other, 2, c.NodeLost(node="a", last_seen=0))
    assert st.nodes["a"].liveness == Liveness.ALIVE and st == st.copy()


# ---------------------------------------------------------------- LoRA adapters


def ready(**kw) -> c.ShardStatus:
    return c.ShardStatus(
        node="a", shard_id="m-r1-s0", model="m", replica_id="m-r1", state=c.ShardState.READY, **kw
    )


def test_an_adapter_report_in_the_same_state_keeps_the_shards_lifecycle():
    st = ClusterState()
    fold.apply(st, 1, registered("a"))
    fold.apply(st, 2, decided())
    fold.apply(st, 3, ready(reason="healthy after 25 s", output_tail=["listening"]))
    changes = fold.apply(st, 4, ready(adapters=["sql"], adapter_errors={"chat": "404 no such"}))
    shard = st.shards["m-r1-s0"]
    assert changes == {("shard", "m-r1-s0")}
    assert (shard.adapters, shard.adapter_errors) == (["sql"], {"chat": "404 no such"})
    assert (shard.state, shard.reason, shard.output_tail) == (
        c.ShardState.READY,
        "healthy after 25 s",
        ["listening"],
    )
    # A status without a report leaves the adapters as they were, while the engine serves.
    fold.apply(st, 5, ready())
    assert shard.adapters == ["sql"]
    # An engine that restarts holds nothing it loaded before.
    loading = c.ShardStatus(
        node="a", shard_id="m-r1-s0", model="m", replica_id="m-r1", state=c.ShardState.LOADING
    )
    fold.apply(st, 6, loading)
    assert (shard.adapters, shard.adapter_errors) == (None, {})


def test_adapters_declared_and_placed_are_folded_with_when_each_was_loaded():
    st = ClusterState()
    fold.apply(st, 1, c.ModelDeclared(name="m", profile=c.ServingProfile(max_loras=2)))
    assert fold.apply(st, 2, c.AdapterDeclared(name="sql", base="m", source="/l/sql")) == {
        ("adapter", "sql")
    }
    assert [a.name for a in st.adapters_of("m")] == ["sql"]
    fold.apply(st, 3, c.AdaptersPlaced(model="m", holdings={"m-r1": ["sql"]}, ts=100.0))
    fold.apply(st, 4, c.AdaptersPlaced(model="m", holdings={"m-r1": ["sql", "b"]}, ts=160.0))
    held = st.adapter_holdings["m"]
    assert held.holdings == {"m-r1": ["b", "sql"]} and held.decided_seq == 4
    assert held.loaded_at == {"m-r1": {"sql": 100.0, "b": 160.0}}  # sql kept its time
    # A placement for a model no longer declared is void; the model's removal ends it.
    fold.apply(st, 5, c.AdaptersPlaced(model="gone", holdings={"g-r1": ["x"]}))
    assert "gone" not in st.adapter_holdings
    assert ("holdings", "m") in fold.apply(st, 6, c.ModelRemoved(name="m"))
    assert "m" not in st.adapter_holdings
    fold.apply(st, 7, c.AdapterRemoved(name="sql"))
    assert st.adapters == {}
