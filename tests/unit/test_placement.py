"""Placement: pure, deterministic, and explained node by node."""

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas.placement import place

from ._cluster import Log, model, node


def verdicts(result) -> dict[str, str]:
    return {v.node: v.reason for v in result.verdicts}


def test_places_on_a_fitting_node_and_explains_every_candidate():
    log = Log().append(
        node("node-a", 1),
        node("node-b", 4, labels={"zone": "z2"}),
        node("node-c", 4, labels={"zone": "z1"}),
        model("m", gpus_per_shard=2, selector={"zone": "z1"}),
    )
    out = place(log.state, "m", "m-r1", log.state.last_seq)
    assert isinstance(out, c.PlacementDecided)
    assert [(a.node, a.gpus) for a in out.assignments] == [
        ("node-c", ["node-c-GPU-0", "node-c-GPU-1"])
    ]
    why = verdicts(out)
    assert why["node-a"] == "has no label zone, needs zone=z1"
    assert why["node-b"] == "label zone=z2 does not match zone=z1"
    assert why["node-c"].startswith("chosen for shard 0 (node-c-GPU-0,node-c-GPU-1)")
    assert out.based_on_seq == 4 and "1 of 3 nodes fit" in out.explanation


def test_no_capacity_names_each_nodes_reason():
    log = Log().append(
        node("node-a", 2, ts=43263.0),
        node("node-b", 1),
        node("node-c", 2, engines=("sim",)),
        node("node-d", 4, mem_gib=40),
        model("big", engine="vllm", gpus_per_shard=2, min_gpu_memory_bytes=80 << 30),
        c.NodeLost(node="node-a", last_seen=43200.0, ts=43263.0),
    )
    out = place(log.state, "big", "big-r1", log.state.last_seq)
    assert isinstance(out, c.PlacementFailed)
    assert verdicts(out) == {
        "node-a": "lost since 12:01:03 UTC",
        "node-b": "1 free GPU of 1, needs 2",
        "node-c": "does not run engine vllm (runs sim)",
        "node-d": "4 free GPUs of 4, 0 with at least 80 GiB, needs 2",
    }
    assert not any(v.fits for v in out.verdicts)
    assert "no node fits" in out.explanation and "0 of 4 nodes fit" in out.explanation


def test_busy_gpus_are_not_free_and_finished_shards_free_them():
    log = Log().append(node("a", 2), model("m", replicas=3))
    st = log.state
    first = place(st, "m", "m-r1", st.last_seq)
    log.append(first)
    second = place(st, "m", "m-r2", st.last_seq)
    log.append(second)
    third = place(st, "m", "m-r3", st.last_seq)
    assert isinstance(third, c.PlacementFailed)
    assert verdicts(third)["a"] == "0 free GPUs of 2, needs 1"
    assert first.assignments[0].gpus != second.assignments[0].gpus
    from ._cluster import status

    log.append(status(st, "m-r1-s0", c.ShardState.FAILED))
    again = place(st, "m", "m-r3", st.last_seq)
    assert isinstance(again, c.PlacementDecided)
    assert again.assignments[0].gpus == first.assignments[0].gpus


def test_spreads_replicas_then_packs_best_fit():
    # b has fewer free GPUs than a: best fit picks b first, spread then sends r2 to a.
    log = Log().append(node("a", 8), node("b", 2), model("m", replicas=3))
    st = log.state
    picks = []
    for i in range(1, 4):
        out = place(st, "m", f"m-r{i}", st.last_seq)
        picks.append(out.assignments[0].node)
        log.append(out)
    assert picks == ["b", "a", "b"]


def test_deterministic_whatever_the_insertion_order():
    events = [node(n, 4) for n in ("c", "a", "b")] + [model("m", gpus_per_shard=2)]
    one = Log().append(*events).state
    two = Log().append(*reversed(events[:3]), events[3]).state
    a = place(one, "m", "m-r1", 9)
    b = place(two, "m", "m-r1", 9)
    assert c.encode(a) == c.encode(b)  # same id too: a re-published decision dedupes


def test_nvlink_connected_gpus_are_taken_together():
    reg = node("a", 4)
    g = reg.gpus
    # GPU-0 links to nobody; GPU-1 and GPU-3 are NVLink peers.
    g["a-GPU-1"].nvlink_peers = ["a-GPU-3"]
    g["a-GPU-3"].nvlink_peers = ["a-GPU-1"]
    log = Log().append(reg, model("m", gpus_per_shard=2))
    out = place(log.state, "m", "m-r1", 2)
    assert out.assignments[0].gpus == ["a-GPU-1", "a-GPU-3"]


def test_multi_node_needs_a_shared_fabric_label():
    log = Log().append(
        node("a", 2, labels={"fabric": "ib-1"}),
        node("b", 2, labels={"fabric": "ib-2"}),
        node("c", 2),
        model("wide", gpus_per_shard=2, shards_per_replica=2),
    )
    out = place(log.state, "wide", "wide-r1", 4)
    assert isinstance(out, c.PlacementFailed)
    assert "no two fitting nodes share a fabric label" in out.explanation
    why = verdicts(out)
    assert why["c"] == "has no fabric label, a 2-node replica needs one"
    assert (
        why["a"]
        == "2 free GPUs, 0 shards of this model, but fabric=ib-1 has 1 fitting node, needs 2"
    )

    log.append(node("d", 2, labels={"fabric": "ib-2"}))
    out = place(log.state, "wide", "wide-r1", 5)
    assert isinstance(out, c.PlacementDecided)
    assert [(a.shard_index, a.node) for a in out.assignments] == [(0, "b"), (1, "d")]
    assert [a.shard_id for a in out.assignments] == ["wide-r1-s0", "wide-r1-s1"]


def test_multi_node_prefers_the_group_with_fewer_shards_of_the_model():
    fab = {"fabric": "x"}
    log = Log().append(
        *(node(n, 2, labels=fab) for n in ("a", "b")),
        *(node(n, 2, labels={"fabric": "y"}) for n in ("c", "d")),
        model("w", replicas=2, shards_per_replica=2, gpus_per_shard=1),
    )
    st = log.state
    first = place(st, "w", "w-r1", st.last_seq)
    log.append(first)
    second = place(st, "w", "w-r2", st.last_seq)
    assert {a.node for a in first.assignments} == {"a", "b"}
    assert {a.node for a in second.assignments} == {"c", "d"}


def test_unreachable_nodes_are_skipped_with_the_time():
    log = Log().append(
        node("a", 1), model("m"), c.NodeUnreachable(node="a", last_seen=0.0, ts=3600.5)
    )
    out = place(log.state, "m", "m-r1", 3)
    assert verdicts(out) == {"a": "unreachable since 01:00:00 UTC"}
    assert "no node fits" in out.explanation


def test_no_nodes_at_all():
    out = place(Log().append(model("m")).state, "m", "m-r1", 1)
    assert isinstance(out, c.PlacementFailed) and "no nodes are registered" in out.explanation
