"""Liveness from heartbeats with a controllable clock: transitions are events."""

import pytest

from llmgw import contracts as c
from llmgw.reconciler.controllers.liveness.tracker import LivenessTracker
from llmgw.reconciler.state.model import Liveness

from ._cluster import Log, node


def names(events) -> list[tuple[str, str]]:
    return [(type(e).__name__, e.node) for e in events]


def run(log: Log, tracker: LivenessTracker, now: float):
    events = tracker.check(log.state, now)
    log.append(*events)
    return events


def test_silence_makes_unreachable_then_lost_and_heartbeats_recover():
    log = Log().append(node("a"), node("b"))
    t = LivenessTracker(unreachable_after=10, lost_after=30, started_at=0.0)
    for now in range(0, 12, 2):
        t.seen("a", now)
        t.seen("b", now)
    assert run(log, t, 12.0) == []
    t.seen("a", 14.0)  # b goes quiet after 10
    assert run(log, t, 19.9) == []
    assert names(run(log, t, 20.0)) == [("NodeUnreachable", "b")]
    ev = log.events[-1][1]
    assert ev.last_seen == 10.0 and ev.ts == 20.0
    assert names(run(log, t, 25.0)) == [("NodeUnreachable", "a")]  # a silent since 14
    assert log.state.nodes["a"].liveness == Liveness.UNREACHABLE
    assert names(run(log, t, 40.0)) == [("NodeLost", "b")]
    t.seen("b", 41.0)
    t.seen("a", 41.0)
    assert sorted(names(run(log, t, 42.0))) == [("NodeRecovered", "a"), ("NodeRecovered", "b")]
    assert {v.liveness for v in log.state.nodes.values()} == {Liveness.ALIVE}


def test_a_transition_is_published_once_until_folded():
    log = Log().append(node("a"))
    t = LivenessTracker(unreachable_after=1, lost_after=5, started_at=0.0, pending_timeout=10)
    first = t.check(log.state, 2.0)
    assert names(first) == [("NodeUnreachable", "a")]
    assert t.check(log.state, 2.5) == []  # not folded yet: do not repeat
    log.append(*first)
    assert names(t.check(log.state, 5.0)) == [("NodeLost", "a")]


def test_an_unpublished_transition_is_retried_after_the_pending_timeout():
    log = Log().append(node("a"))
    t = LivenessTracker(unreachable_after=1, lost_after=50, started_at=0.0, pending_timeout=3)
    assert names(t.check(log.state, 2.0)) == [("NodeUnreachable", "a")]  # lost on the way
    assert t.check(log.state, 4.0) == []
    assert names(t.check(log.state, 5.0)) == [("NodeUnreachable", "a")]


def test_a_long_gap_goes_through_unreachable_to_lost_in_order():
    log = Log().append(node("a"))
    t = LivenessTracker(unreachable_after=1, lost_after=5, started_at=0.0)
    assert names(t.check(log.state, 60.0)) == [("NodeUnreachable", "a"), ("NodeLost", "a")]


def test_new_leader_gives_a_grace_period_and_keeps_lost_nodes_lost():
    log = Log().append(node("alive"), node("dead"), c.NodeLost(node="dead", last_seen=1.0))
    # Leadership begins at 1000; the stored heartbeats are old (the old leader was slow).
    t = LivenessTracker(unreachable_after=10, lost_after=30, started_at=1000.0)
    t.seen("alive", 900.0)
    t.seen("dead", 5.0)
    assert run(log, t, 1005.0) == []  # grace: a leadership change alone changes nothing
    t.seen("alive", 1006.0)
    assert run(log, t, 1012.0) == []
    # The dead node's old heartbeat never counts as a recovery; it stays lost, while
    # the other one did go quiet after 1006.
    assert names(run(log, t, 1200.0)) == [("NodeUnreachable", "alive"), ("NodeLost", "alive")]
    assert log.state.nodes["dead"].liveness == Liveness.LOST


def test_rejects_lost_before_unreachable():
    with pytest.raises(ValueError):
        LivenessTracker(unreachable_after=10, lost_after=5, started_at=0)


def test_a_stalled_reconciler_counts_silence_from_the_end_of_the_stall():
    log = Log().append(node("a"))
    t = LivenessTracker(unreachable_after=5, lost_after=10, started_at=0.0)
    t.seen("a", 1.0)
    # The loop was stuck from 2 to 20: heartbeats sat unread, so silence proves nothing.
    t.grace(20.0)
    assert t.check(log.state, 20.0) == []
    assert t.check(log.state, 24.9) == []
    assert names(t.check(log.state, 25.0)) == [("NodeUnreachable", "a")]


def test_a_bus_outage_judges_no_silence_and_counts_it_from_the_reconnect():
    log = Log().append(node("a"), node("b"))
    t = LivenessTracker(unreachable_after=5, lost_after=10, started_at=0.0)
    t.seen("a", 1.0)
    t.seen("b", 1.0)
    # Our connection drops at 2 and returns at 60: every node went quiet at once.
    for now in range(2, 60):
        assert not t.listening(False, float(now))
    assert t.listening(True, 60.0)
    assert run(log, t, 60.0) == []
    t.seen("a", 60.5)  # a's heartbeats come back; b really died during the outage
    assert t.listening(True, 64.9) and run(log, t, 64.9) == []
    assert names(run(log, t, 65.0)) == [("NodeUnreachable", "b")]
    t.seen("a", 69.0)
    assert names(run(log, t, 70.0)) == [("NodeLost", "b")]
    assert log.state.nodes["a"].liveness == Liveness.ALIVE


def test_without_an_outage_listening_changes_nothing():
    log = Log().append(node("a"))
    t = LivenessTracker(unreachable_after=5, lost_after=10, started_at=0.0)
    t.seen("a", 1.0)
    assert t.listening(True, 6.0)
    assert names(run(log, t, 6.0)) == [("NodeUnreachable", "a")]


def test_a_remembered_heartbeat_is_reported_but_proves_nothing():
    log = Log().append(node("a"))
    log.append(c.NodeLost(node="a", last_seen=0.0, based_on_seq=1))
    t = LivenessTracker(unreachable_after=10, lost_after=30, started_at=100.0)
    t.remember("a", 5_000.0)  # stored by a clock far ahead of ours
    assert run(log, t, 101.0) == []  # lost stays lost: no live heartbeat
    t.seen("a", 102.0, wall=5_001.0)
    (ev,) = run(log, t, 103.0)
    assert names([ev]) == [("NodeRecovered", "a")]
    t2 = LivenessTracker(unreachable_after=10, lost_after=30, started_at=100.0)
    log2 = Log().append(node("b"))
    t2.remember("b", -1e9)  # nor death: silence counts from the term's start
    assert run(log2, t2, 105.0) == []
    assert names(run(log2, t2, 110.0)) == [("NodeUnreachable", "b")]
    assert log2.events[-1][1].last_seen == -1e9  # reported as heard
