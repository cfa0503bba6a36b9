"""Placement's node filters, one at a time, and the one ranking step after them."""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import placement
from llmgw.reconciler.controllers.replicas.placement import Fit, Need, fit_nodes, rank

from ._cluster import Log, model, node


def run(f: placement.NodeFilter, log: Log, name: str = "m") -> tuple[list[str], dict[str, Fit]]:
    """(the nodes the filter passes, every node's Fit) for all registered nodes."""
    st = log.state
    fits = [Fit(n, st.nodes[n]) for n in sorted(st.nodes)]
    passed = f.select(fits, Need(st, name))
    return [p.node for p in passed], {x.node: x for x in fits}


def test_filters_run_in_the_documented_order():
    assert [f.name for f in placement.NODE_FILTERS] == ["alive", "engine", "selector", "free_gpus"]
    assert [f.name for f in placement.GROUP_FILTERS] == ["fabric"]


def test_alive_rejects_unreachable_and_lost_nodes_with_the_time():
    log = Log().append(
        node("a"),
        node("b"),
        node("c"),
        model("m"),
        c.NodeUnreachable(node="b", last_seen=0.0, ts=3600.5),
        c.NodeLost(node="c", last_seen=0.0, ts=7200.0),
    )
    passed, fits = run(placement.Alive(), log)
    assert passed == ["a"]
    assert (fits["b"].fits, fits["b"].reason, fits["b"].kind) == (
        False,
        "unreachable since 01:00:00 UTC",
        "unreachable",
    )
    assert (fits["c"].reason, fits["c"].kind) == ("lost since 02:00:00 UTC", "lost")
    assert fits["a"].fits and fits["a"].reason == ""


def test_engine_names_what_the_node_runs():
    log = Log().append(node("a", engines=("sim",)), node("b", engines=()), model("m"))
    log.append(model("m", engine="vllm"))
    passed, fits = run(placement.Engine(), log)
    assert passed == []
    assert fits["a"].reason == "does not run engine vllm (runs sim)"
    assert fits["b"].reason == "does not run engine vllm (runs none)"
    assert fits["a"].kind == fits["b"].kind == "does not run engine vllm"


def test_selector_reports_the_first_failing_key_in_key_order():
    log = Log().append(
        node("a", labels={"zone": "z1", "rack": "r1"}),
        node("b", labels={"zone": "z2"}),
        node("c", labels={"zone": "z1", "rack": "r2"}),
        model("m", selector={"zone": "z1", "rack": "r1"}),
    )
    passed, fits = run(placement.Selector(), log)
    assert passed == ["a"]
    # "rack" sorts before "zone": b lacks it before its zone is looked at.
    assert (fits["b"].reason, fits["b"].kind) == (
        "has no label rack, needs rack=r1",
        "has no label rack, needs rack=r1",
    )
    assert (fits["c"].reason, fits["c"].kind) == (
        "label rack=r2 does not match rack=r1",
        "label rack does not match rack=r1",
    )


def test_free_gpus_counts_busy_and_small_gpus_and_keeps_the_fitting_ones():
    log = Log().append(
        node("a", 2),
        node("b", 1),
        node("c", 4, mem_gib=40),
        model("m", gpus_per_shard=2, min_gpu_memory_bytes=80 << 30),
    )
    passed, fits = run(placement.FreeGpus(), log)
    assert passed == ["a"] and len(fits["a"].free) == 2
    assert (fits["b"].reason, fits["b"].kind) == (
        "1 free GPU of 1, needs 2",
        "fewer than 2 free GPUs",
    )
    assert (fits["c"].reason, fits["c"].kind) == (
        "4 free GPUs of 4, 0 with at least 80 GiB, needs 2",
        "fewer than 2 free GPUs with at least 80 GiB",
    )


def test_fabric_rejects_unlabelled_nodes_and_groups_too_small():
    log = Log().append(
        node("a", 2, labels={"fabric": "x"}),
        node("b", 2, labels={"fabric": "y"}),
        node("c", 2, labels={"fabric": "y"}),
        node("d", 2),
        model("w", shards_per_replica=2),
    )
    fits, cands = fit_nodes(log.state, "w")
    by = {f.node: f for f in fits}
    assert sorted(f.node for f in cands) == ["b", "c"]
    assert (by["d"].reason, by["d"].kind) == (
        "has no fabric label, a 2-node replica needs one",
        "has no fabric label, a 2-node replica needs one",
    )
    assert (
        by["a"].reason
        == "2 free GPUs, 0 shards of this model, but fabric=x has 1 fitting node, needs 2"
    )
    assert by["a"].kind == "fits alone, but fewer than 2 fitting nodes share its fabric label"


def test_a_node_gets_the_verdict_of_the_first_filter_that_rejects_it():
    log = Log().append(
        node("a", 1, engines=("sim",), labels={"zone": "z2"}),
        model("m", engine="vllm", gpus_per_shard=2, selector={"zone": "z1"}),
        c.NodeLost(node="a", last_seen=0.0, ts=60.0),
    )
    fits, cands = fit_nodes(log.state, "m")
    assert cands == [] and fits[0].kind == "lost"


def test_fitting_nodes_get_the_fits_verdict_and_the_ranking_picks_by_the_packing_rule():
    log = Log().append(node("a", 4), node("b", 2), node("c", 2), model("m"))
    fits, cands = fit_nodes(log.state, "m")
    assert [f.reason for f in fits] == [
        "fits: 4 free GPUs, 0 shards of this model",
        "fits: 2 free GPUs, 0 shards of this model",
        "fits: 2 free GPUs, 0 shards of this model",
    ]
    assert {f.kind for f in fits} == {placement.FITS_KIND}
    chosen, best, why = rank(cands, 1)
    # Best fit: the fullest node that still fits, then node id.
    assert [f.node for f in chosen] == ["b"] and [f.node for f in best] == ["b", "c", "a"]
    assert why == ""
    assert rank([], 1) == ([], [], "no node fits")
    assert rank([], 3)[2] == "no three fitting nodes share a fabric label"
