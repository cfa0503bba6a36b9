"""The adapter placement policy: slots filled by demand, waiting adapters placed at once,
pinned ones always held, and no thrash when the demand is skewed but steady."""

from __future__ import annotations

import random

from llmgw import contracts as c
from llmgw.reconciler.controllers.lora.placement import Inputs, Tuning, place
from llmgw.reconciler.state.model import AdapterHoldings

REPLICAS = ["m-r1", "m-r2"]


def adapters(*names: str, pinned: dict[str, int] | None = None) -> list[c.AdapterDeclared]:
    pins = pinned or {}
    return [
        c.AdapterDeclared(name=n, base="m", source=f"/l/{n}", pinned=pins.get(n, 0)) for n in names
    ]


def held(holdings: dict[str, list[str]], at: float = 0.0) -> AdapterHoldings:
    return AdapterHoldings(
        model="m",
        holdings=holdings,
        loaded_at={rid: {a: at for a in hs} for rid, hs in holdings.items()},
    )


def decide(
    declared,
    current=None,
    demand=None,
    waiting=(),
    now=100.0,
    replicas=REPLICAS,
    slots=2,
    waited=None,
):
    return place(
        Inputs(
            adapters=declared,
            replicas=list(replicas),
            slots=slots,
            current=current,
            demand=demand or {},
            # a list names adapters with one request waiting each; a dict counts them
            queued=dict(waiting) if isinstance(waiting, dict) else dict.fromkeys(waiting, 1),
            now=now,
            waited=waited or {},
        ),
        Tuning(margin=1.5, min_hold=30.0, waiting_hold=5.0, horizon=5.0, max_wait=12.0),
    )


def test_an_adapter_with_requests_waiting_gets_a_free_slot_at_once():
    p = decide(adapters("a", "b"), waiting=["b"], demand={"b": 0.0})
    assert p.holdings == {"m-r1": ["b"], "m-r2": []}
    (change,) = p.changes
    assert (change.adapter, change.replica_id, change.action) == ("b", "m-r1", "load")
    assert "requests waiting" in change.reason and "b loaded on m-r1" in p.explanation()


def test_a_waiting_adapter_takes_the_least_demanded_slot_past_its_hold_time():
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]}, at=0.0)
    demand = {"a": 5.0, "b": 0.2, "c": 3.0, "d": 1.0, "e": 0.5}
    p = decide(adapters(*"abcde"), full, demand, waiting=["e"], now=100.0)
    assert p.holdings == {"m-r1": ["a", "e"], "m-r2": ["c", "d"]}
    assert [(x.adapter, x.action) for x in p.changes] == [("e", "load"), ("b", "unload")]
    # Everything loaded a moment ago (under the 5 s hold for waiting): it waits, and says why.
    p = decide(adapters(*"abcde"), full, demand, waiting=["e"], now=3.0)
    assert p.changes == [] and p.unplaced == ["e"]
    assert "e waits" in p.explanation()


def test_a_waiting_adapter_never_evicts_a_busier_one():
    # e waits with demand 0.5: only an incumbent with less demand per copy gives way.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    p = decide(adapters(*"abcde"), full, {"a": 5, "b": 2, "c": 3, "d": 1, "e": 0.5}, waiting=["e"])
    assert p.changes == [] and p.unplaced == ["e"]


def test_a_queue_takes_the_slot_of_an_adapter_expecting_fewer_requests_in_the_horizon():
    # Over the 5 s horizon b expects 1.5 requests (0.3/s), d 5, a 25, c 15.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    demand = {"a": 5.0, "b": 0.3, "c": 3.0, "d": 1.0, "e": 0.1}
    p = decide(adapters(*"abcde"), full, demand, waiting={"e": 1})
    assert p.changes == [] and p.unplaced == ["e"]  # 1 waiting < 1.5 expected: e waits
    p = decide(adapters(*"abcde"), full, demand, waiting={"e": 2})
    assert [(x.adapter, x.replica_id, x.action) for x in p.changes] == [
        ("e", "m-r1", "load"),
        ("b", "m-r1", "unload"),
    ]
    assert "made room for e" in p.explanation()


def test_a_popular_adapter_keeps_its_slot_against_a_short_tail_queue():
    # d, the least used incumbent, expects 5 requests in the horizon: a tail adapter's 4
    # waiting requests do not take its slot (added to a rate, they did), 6 do.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    demand = {"a": 5.0, "b": 2.0, "c": 3.0, "d": 1.0, "e": 0.2}
    assert decide(adapters(*"abcde"), full, demand, waiting={"e": 4}).unplaced == ["e"]
    p = decide(adapters(*"abcde"), full, demand, waiting={"e": 6})
    assert [(x.adapter, x.action) for x in p.changes] == [("e", "load"), ("d", "unload")]


def test_a_queue_that_has_waited_long_outweighs_the_least_demanded_incumbent_only():
    # e's 2 requests against d's 7.5 expected in the 5 s horizon: e waits, until its
    # oldest has waited 12 s (max_wait). Then it takes the least demanded slot, d's,
    # never the most used adapters'.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    demand = {"a": 5.0, "b": 2.0, "c": 3.0, "d": 1.5, "e": 0.2}

    def after(waited: float):
        return decide(adapters(*"abcde"), full, demand, waiting={"e": 2}, waited={"e": waited})

    assert after(0.0).unplaced == ["e"]
    assert after(11.9).unplaced == ["e"]
    for waited in (12.0, 60.0):
        assert [(x.adapter, x.action) for x in after(waited).changes] == [
            ("e", "load"),
            ("d", "unload"),
        ]
    assert "made room for e, which had requests waiting 60 s" in after(60.0).explanation()
    # An incumbent decided but not serving yet keeps the requests waiting for it: the
    # next least demanded gives way.
    p = decide(adapters(*"abcde"), full, demand, waiting={"d": 2, "e": 2}, waited={"d": 1, "e": 60})
    assert [(x.adapter, x.action) for x in p.changes] == [("e", "load"), ("b", "unload")]


def test_an_adapter_decided_but_not_yet_serving_keeps_the_requests_waiting_for_it():
    # b was placed a while ago but the routers still see no holder: its 3 waiting requests
    # count with its expected 1.5, so a queue of 4 does not take its slot; 5 does.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    demand = {"a": 5.0, "b": 0.3, "c": 3.0, "d": 1.0, "e": 0.1}
    assert decide(adapters(*"abcde"), full, demand, waiting={"b": 3, "e": 4}).unplaced == ["e"]
    p = decide(adapters(*"abcde"), full, demand, waiting={"b": 3, "e": 5})
    assert [(x.adapter, x.action) for x in p.changes] == [("e", "load"), ("b", "unload")]


def test_the_queue_waiting_longest_takes_the_one_slot_there_is():
    # e's 4 requests at 2 per second have been arriving for about 2 s, f's 2 at 0.1 per
    # second for about 20 s: f goes first, or the rarest adapters, whose queues grow
    # slowest, wait behind the others until their requests time out.
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    demand = {"a": 5.0, "b": 0.1, "c": 3.0, "d": 2.5, "e": 2.0, "f": 0.1}
    p = decide(adapters(*"abcdef"), full, demand, waiting={"e": 4, "f": 2})
    assert [(x.adapter, x.action) for x in p.changes] == [("f", "load"), ("b", "unload")]
    assert p.unplaced == ["e"]


def test_a_challenger_needs_the_margin_over_the_incumbent():
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]})
    base = {"a": 5.0, "b": 1.0, "c": 4.0, "d": 3.0}
    assert decide(adapters(*"abcde"), full, {**base, "e": 1.4}).changes == []  # 1.4 < 1.5 x 1.0
    p = decide(adapters(*"abcde"), full, {**base, "e": 1.6})
    assert [(x.adapter, x.replica_id, x.action) for x in p.changes] == [
        ("e", "m-r1", "load"),
        ("b", "m-r1", "unload"),
    ]
    assert "margin" in p.changes[1].reason


def test_a_skewed_steady_workload_does_not_thrash():
    # 12 adapters, Zipf-like demand with noise, 4 slots: after the first fill the
    # decisions settle, even though the noise reorders the tail on every tick.
    names = [f"x{i:02d}" for i in range(12)]
    rng = random.Random(7)
    current, loads = None, 0
    for tick in range(200):
        demand = {n: (1.0 / (i + 1)) * rng.uniform(0.7, 1.3) for i, n in enumerate(names)}
        now = tick * 5.0
        p = decide(adapters(*names), current, demand, now=now)
        loads += sum(ch.action == "load" for ch in p.changes)
        if p.changes:
            fold_in = {rid: hs for rid, hs in p.holdings.items()}
            since = current.loaded_at if current else {}
            current = AdapterHoldings(
                model="m",
                holdings=fold_in,
                loaded_at={
                    rid: {a: since.get(rid, {}).get(a, now) for a in hs}
                    for rid, hs in fold_in.items()
                },
            )
    assert sorted(a for hs in current.holdings.values() for a in hs) == names[:4]
    assert loads <= 5  # the first fill and at most one correction: the noise is inside the margin


def test_pinned_adapters_are_held_on_their_replicas_whatever_the_demand():
    full = held({"m-r1": ["a", "b"], "m-r2": ["c", "d"]}, at=99.0)  # all just loaded
    p = decide(adapters(*"abcdp", pinned={"p": 2}), full, {"a": 9, "b": 9, "c": 9, "d": 1})
    assert sum("p" in hs for hs in p.holdings.values()) == 2
    assert {(x.adapter, x.action) for x in p.changes if x.adapter == "p"} == {("p", "load")}
    # Pinned is never evicted for demand.
    q = decide(adapters("p", "z", pinned={"p": 1}), held({"m-r1": ["p"]}), {"z": 99.0},
               replicas=["m-r1"], slots=1)  # fmt: skip
    assert q.holdings == {"m-r1": ["p"]}


def test_a_removed_adapter_and_a_gone_replica_are_unloaded():
    current = held({"m-r1": ["a", "gone"], "m-r3": ["b"]})
    p = decide(adapters("a", "b"), current, {"a": 1.0, "b": 1.0})
    assert p.holdings == {"m-r1": ["a"], "m-r2": ["b"]}  # the emptier replica
    unloads = {(x.adapter, x.replica_id): x.reason for x in p.changes if x.action == "unload"}
    assert unloads == {
        ("gone", "m-r1"): "removed from the catalog",
        ("b", "m-r3"): "m-r3 no longer serves",
    }
    # b had demand: it is loaded again on a serving replica.
    assert any(x.adapter == "b" and x.action == "load" for x in p.changes)


def test_a_popular_adapter_is_held_on_a_share_of_the_replicas():
    p = decide(adapters("hot", "a", "b"), None, {"hot": 8.0, "a": 1.0, "b": 1.0}, slots=2)
    assert all("hot" in hs for hs in p.holdings.values())  # 80% of the demand: both replicas
    assert sorted(a for hs in p.holdings.values() for a in hs) == ["a", "b", "hot", "hot"]


def test_nothing_changes_when_nothing_is_asked():
    current = held({"m-r1": ["a"]})
    assert decide(adapters("a", "b"), current, {}).changes == []


def test_a_replica_on_an_unreachable_node_keeps_what_it_holds_and_counts():
    current = held({"m-r1": ["a"], "m-r2": ["b"]})
    p = place(
        Inputs(
            adapters=adapters("a", "b"),
            replicas=["m-r1"],
            slots=2,
            current=current,
            demand={"a": 1.0, "b": 1.0},
            queued={},
            now=100.0,
            unreachable=frozenset({"m-r2"}),
        )
    )
    assert p.holdings == {"m-r1": ["a"], "m-r2": ["b"]} and p.changes == []
