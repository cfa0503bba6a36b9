"""Placement events stay bounded at any fleet size, and still explain and replay exactly."""

from __future__ import annotations

import msgspec

from llmgw import contracts as c
from llmgw.opcli.explain import render
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.controllers.replicas import verdicts
from llmgw.reconciler.controllers.replicas.placement import place
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState
from llmgw.verdicttext import group_line

from ._cluster import Log, model, node

MIB = 1 << 20


def diverse_fleet(n: int, *, reverse: bool = False) -> ClusterState:
    """`n` nodes whose reasons vary the way a real fleet's do: per-node numbers and times."""
    events: list[c.Message] = []
    for i in reversed(range(n)) if reverse else range(n):
        name = f"node-{i:05d}"
        zone = "z1" if i % 5 else f"z{2 + i % 3}"
        events.append(node(name, 1 + i % 8, labels={"zone": zone, "rack": f"r{i}"}, ts=1000.0 + i))
    for i in range(0, n, 7):  # silent at many different times
        events.append(c.NodeUnreachable(node=f"node-{i:05d}", last_seen=0.0, ts=5000.0 + i))
    state = ClusterState()
    for seq, ev in enumerate(events, 1):
        fold.apply(state, seq, ev)
    for ev in (
        model("m", gpus_per_shard=4, selector={"zone": "z1"}),
        model("huge", gpus_per_shard=16),
    ):
        fold.apply(state, state.last_seq + 1, ev)
    return state


def test_a_placement_event_stays_small_at_20000_nodes():
    state = diverse_fleet(20_000)
    for name in ("m", "huge"):
        summary = place(state, name, f"{name}-r1", 1)
        full = place(state, name, f"{name}-r1", 1, keep_all=True)
        small, big = len(c.encode(summary)), len(c.encode(full))
        # One verdict per node would not even fit in a NATS message (1 MiB).
        assert big > MIB
        assert small < 16 * 1024 and small * 100 < big, (name, small, big)
        assert len(full.verdicts) == 20_000 and not full.verdict_groups
        # Listed and counted together, every node is accounted for exactly once.
        fit = sum(v.fits for v in full.verdicts)
        assert verdicts.node_count(summary) == (fit, 20_000)
        assert f"{fit} of 20000 nodes fit" in summary.explanation
    assert isinstance(summary, c.PlacementFailed)  # "huge" fits nowhere


def test_up_to_200_nodes_every_verdict_is_listed():
    log = Log().append(*(node(f"n{i:03d}", 1) for i in range(200)), model("m", gpus_per_shard=2))
    out = place(log.state, "m", "m-r1", 1)
    assert len(out.verdicts) == 200 and out.verdict_groups == []
    log.append(node("n200", 1))
    out = place(log.state, "m", "m-r1", 1)
    assert out.verdicts == [] and [(g.count, g.reason) for g in out.verdict_groups] == [
        (201, "1 free GPU of 1, needs 2")
    ]


def grouped_fleet() -> Log:
    """300 nodes: 40 fit (zone z1, 4 GPUs), 120 have 1 GPU, 35 sit in other zones,
    60 went silent one after another, 45 run another engine."""
    log = Log()
    for i in range(40):
        log.append(node(f"fit-{i:03d}", 4, labels={"zone": "z1"}))
    for i in range(120):
        log.append(node(f"one-{i:03d}", 1, labels={"zone": "z1"}))
    for i in range(35):
        log.append(node(f"oth-{i:03d}", 4, labels={"zone": "z2" if i < 20 else "z3"}))
    for i in range(60):
        log.append(node(f"sil-{i:03d}", 4, labels={"zone": "z1"}))
        log.append(c.NodeUnreachable(node=f"sil-{i:03d}", last_seen=0.0, ts=3600.0 + i))
    for i in range(45):
        log.append(node(f"eng-{i:03d}", 4, labels={"zone": "z1"}, engines=("sglang",)))
    return log.append(model("m", replicas=2, gpus_per_shard=2, selector={"zone": "z1"}))


def test_the_rest_is_grouped_by_kind_of_reason_with_examples():
    log = grouped_fleet()
    out = place(log.state, "m", "m-r1", log.state.last_seq)
    assert isinstance(out, c.PlacementDecided)
    # The chosen node and the next best-ranked fitting ones, word for word.
    assert [v.node for v in out.verdicts] == [f"fit-{i:03d}" for i in range(5)]
    assert out.verdicts[0].reason.startswith("chosen for shard 0 (fit-000-GPU-0,fit-000-GPU-1)")
    lines = [group_line(g) for g in out.verdict_groups]
    assert lines == [
        "35 nodes: fits: 4 free GPUs, 0 shards of this model: "
        "fit-005, fit-006, fit-007, fit-008, fit-009, ...",
        "120 nodes: 1 free GPU of 1, needs 2: one-000, one-001, one-002, one-003, one-004, ...",
        # Times differ per node: one group of the kind, the first node's words as example.
        "60 nodes: unreachable: sil-000, sil-001, sil-002, sil-003, sil-004, ... "
        "(e.g. sil-000: unreachable since 01:00:00 UTC)",
        "45 nodes: does not run engine sim (runs sglang): "
        "eng-000, eng-001, eng-002, eng-003, eng-004, ...",
        # A few distinct values of one kind: a group each, exact for every node in it.
        "20 nodes: label zone=z2 does not match zone=z1: "
        "oth-000, oth-001, oth-002, oth-003, oth-004, ...",
        "15 nodes: label zone=z3 does not match zone=z1: "
        "oth-020, oth-021, oth-022, oth-023, oth-024, ...",
    ]
    assert [g.fits for g in out.verdict_groups] == [True] + [False] * 5
    assert verdicts.node_count(out) == (40, 300)


def test_the_summary_is_deterministic_whatever_the_order_of_the_log():
    one = place(diverse_fleet(1_000), "m", "m-r1", 7)
    again = place(diverse_fleet(1_000), "m", "m-r1", 7)
    reordered = place(diverse_fleet(1_000, reverse=True), "m", "m-r1", 7)
    assert one.verdict_groups, "1,000 nodes are summarised"
    assert c.encode(one) == c.encode(again) == c.encode(reordered)


def placed_log() -> tuple[Log, int, c.PlacementDecided]:
    log = grouped_fleet()
    log.append(*reconcile.decide(log.state, ts=4000.0).events)
    seq, ev = next((s, e) for s, e in log.events if isinstance(e, c.PlacementDecided))
    assert ev.verdict_groups
    return log, seq, ev


def test_replay_of_a_summarised_log_finds_no_difference():
    log, _, _ = placed_log()
    result = replay.replay(log.events)
    assert len(result.checks) == 2 and result.differing(strict=True) == []


def test_replay_reports_a_changed_summary():
    log, seq, ev = placed_log()
    ev.verdict_groups[1].count -= 1  # the "1 free GPU" group, recorded one node short
    check = replay.replay(log.events).checks[0]
    assert check.seq == seq and check.differs()
    assert check.differences == [
        "group: recorded 119 nodes: 1 free GPU of 1, needs 2: one-000, one-001, one-002, "
        "one-003, one-004, ..., now 120 nodes: 1 free GPU of 1, needs 2: one-000, one-001, "
        "one-002, one-003, one-004, ..."
    ]

    # Same size, same examples, other members: the membership digest tells.
    log, seq, ev = placed_log()
    ev.verdict_groups[2].digest = verdicts.member_digest(["sil-000", "x"])
    check = replay.replay(log.events).checks[0]
    assert [d.split(":")[0] for d in check.differences] == ["group"]
    assert "same size, other members" in check.differences[0]

    # A node listed in the record but only counted now (or the reverse) is a difference.
    log, seq, ev = placed_log()
    ev.verdicts.append(c.NodeVerdict(node="one-007", fits=False, reason="1 free GPU of 1, needs 2"))
    check = replay.replay(log.events).checks[0]
    assert 'one-007: recorded "1 free GPU of 1, needs 2", now only counted in a group' in (
        check.differences
    )

    # Only the words of a group changed: wording, a difference only with --strict.
    log, seq, ev = placed_log()
    ev.verdict_groups[2].kind = "silent"
    check = replay.replay(log.events).checks[0]
    assert check.differences == [] and check.differs(strict=True)
    assert check.wording[0].startswith("group: recorded 60 nodes: silent:")


def old_event(ev: c.Message) -> c.Message:
    """`ev` as an encoder from before verdict groups wrote it: no such field at all."""
    raw = msgspec.json.decode(c.encode(ev))
    assert raw.pop("verdict_groups") == []
    return c.decode(msgspec.json.encode(raw))


def test_old_events_that_list_every_node_still_replay_and_render():
    log = grouped_fleet()
    base = log.state.last_seq
    full = place(log.state, "m", "m-r1", base, ts=4000.0, keep_all=True)
    recorded = old_event(full)
    assert len(recorded.verdicts) == 300 and recorded.verdict_groups == []
    log.append(recorded)
    result = replay.replay(log.events)
    # Re-derived node by node, as recorded: nothing differs, not even wording.
    assert result.differing(strict=True) == []
    assert len(result.checks[0].derived.verdicts) == 300

    lie = next(v for v in log.events[-1][1].verdicts if v.node == "fit-000")
    lie.fits = False  # an old record that was wrong about fit-000
    check = replay.replay(log.events).checks[0]
    assert any(d.startswith("fit-000: recorded") for d in check.differences)

    answer = {
        "model": "m",
        "declared": True,
        "decisions": [
            {"seq": 9, "outcome": "decided", "based_on_seq": base, "ts": 4000.0,
             **{k: v for k, v in msgspec.to_builtins(recorded).items() if k != "verdict_groups"}}
        ],
    }  # fmt: skip
    text = render(answer)
    assert sum(line.startswith(("  + ", "  - ")) for line in text) == 300
    assert "  - sil-059  unreachable since 01:00:59 UTC" in text


def test_explain_prints_the_groups_after_the_listed_verdicts():
    log, seq, ev = placed_log()
    answer = {
        "model": "m",
        "declared": True,
        "decisions": [{"seq": seq, "outcome": "decided", **msgspec.to_builtins(ev)}],
    }
    text = render(answer)
    listed = text.index("  + fit-004  fits: 4 free GPUs, 0 shards of this model")
    assert text.index("  - 120 nodes: 1 free GPU of 1, needs 2: one-000, one-001, one-002, "
                      "one-003, one-004, ...") > listed  # fmt: skip
    assert "  + 35 nodes: fits: 4 free GPUs, 0 shards of this model: fit-005, fit-006, " \
           "fit-007, fit-008, fit-009, ..." in text  # fmt: skip
    assert "why: m-r1 placed on fit-000 (fit-000-GPU-0,fit-000-GPU-1); 40 of 300 nodes fit" in (
        "\n".join(text)
    )
