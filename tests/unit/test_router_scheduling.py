"""The scheduling pipeline: filters, scorers and pickers, driven with a fixed clock and keys."""

from __future__ import annotations

from collections import Counter

from llmgw.contracts import Endpoint, EndpointState, SchedulingSpec
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, ViewSettings
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.pickers import WeightedRandom
from llmgw.router.scheduling.prefix import block_hashes
from llmgw.router.scheduling.profiles import DEFAULT
from llmgw.router.scheduling.scorers import InflightScorer, KvScorer, QueueScorer

NOW = 1000.0
SETTINGS = ViewSettings(circuit_failures=2, circuit_cooldown=10.0)


def ep(name: str, *, waiting=0, kv=0.0, inflight=0, age=0.0, load=True, state="ready"):
    e = EndpointRuntime(
        Endpoint(id=name, url=f"http://{name}", state=EndpointState(state)), SETTINGS
    )
    e.models = frozenset({"m"})
    e.state = EndpointState(state)
    if load:
        e.load = Load(waiting=waiting, running=0, kv_usage=kv, at=NOW - age)
    e.inflight = inflight
    return e


class Recorder:
    def __init__(self):
        self.drops = Counter()
        self.scores = []

    def dropped(self, model, filter_name, count):
        self.drops[filter_name] += count

    def scored(self, model, scorer_name, value):
        self.scores.append((scorer_name, value))


def pipeline(scorers=None, picker="max_score", observer=None, filters=None):
    spec = SchedulingSpec(
        scorers=scorers
        if scorers is not None
        else {"queue": 2, "kv": 2, "inflight": 1, "prefix": 3},
        picker=picker,
        **({"filters": filters} if filters is not None else {}),
    )
    return sc.Pipeline(spec, sc.Settings(stale_after=1.0), observer=observer)


def ctx(**kw):
    return sc.Context(NOW, "m", **kw)


def test_filters_drop_draining_open_and_foreign_endpoints_and_count_drops():
    rec = Recorder()
    draining = ep("draining", state="draining")
    broken = ep("broken")
    broken.circuit.failure(NOW)
    broken.circuit.failure(NOW)
    foreign = ep("foreign")
    foreign.models = frozenset({"other"})
    good = ep("good")
    p = pipeline(observer=rec)
    assert p.pick([draining, broken, foreign, good], ctx()) is good
    assert rec.drops == {"serves_model": 1, "ready": 1, "circuit": 1}
    assert p.pick([draining, broken], ctx()) is None


def test_tried_endpoints_are_excluded():
    a, b = ep("a"), ep("b")
    assert pipeline().pick([a, b], ctx(exclude=["a"])) is b


def test_queue_scorer_prefers_the_shorter_queue_and_rates_stale_load_worst():
    out = [0.0] * 3
    QueueScorer(sc.Settings(stale_after=1.0)).score(
        [ep("a", waiting=0), ep("b", waiting=4), ep("c", waiting=0, age=5.0)], ctx(), out
    )
    assert out == [1.0, 0.0, 0.0]


def test_kv_scorer_prefers_free_cache_and_ignores_stale_or_missing_load():
    out = [0.0] * 3
    KvScorer(sc.Settings(stale_after=1.0)).score(
        [ep("a", kv=0.25), ep("b", kv=0.1, age=2.0), ep("c", load=False)], ctx(), out
    )
    assert out == [0.75, 0.0, 0.0]


def test_inflight_scorer_uses_the_routers_own_count():
    out = [0.0] * 3
    InflightScorer(sc.Settings()).score(
        [ep("a", inflight=2), ep("b", inflight=4), ep("c", inflight=3)], ctx(), out
    )
    assert out == [1.0, 0.0, 0.5]


def test_least_loaded_endpoint_wins_with_the_load_scorers():
    busy = ep("busy", waiting=5, kv=0.9, inflight=3)
    idle = ep("idle", waiting=0, kv=0.1, inflight=0)
    assert pipeline().pick([busy, idle], ctx()) is idle


def test_the_default_takes_equal_endpoints_in_turn_whatever_their_shared_load_sample_says():
    # Every router reads the same load sample, up to `stale_after` old: were its small
    # differences (a's cache a little freer, b's queue a little longer) to break ties,
    # every router would send its ties to `a` until the next sample. The default reads
    # what differs per router (its own requests in flight) and the engines' caches.
    a = ep("a", kv=0.10, waiting=0)
    b = ep("b", kv=0.30, waiting=1)
    p = sc.Pipeline(SchedulingSpec(), sc.Settings(stale_after=1.0))
    picks = [
        p.pick([a, b], ctx(prefix=block_hashes(b"question %d " % i * 40, 256, 128))).id
        for i in range(6)
    ]
    assert picks in (["a", "b"] * 3, ["b", "a"] * 3)
    # Its own requests in flight still count: one more at `a` sends the next to `b`.
    a.inflight = 1
    assert p.pick([a, b], ctx(prefix=block_hashes(b"another", 256, 128))) is b


def test_prefix_affinity_sends_a_shared_prefix_back_where_it_went():
    a, b, c = ep("a"), ep("b"), ep("c")
    p = pipeline()
    system = b'[{"role":"system","content":"' + b"You are a careful assistant. " * 40
    first = p.pick([a, b, c], ctx(prefix=block_hashes(system + b'q1"}]', 256, 128)))
    for question in (b"q2", b"q3", b"q4"):
        hashes = block_hashes(system + question + b'"}]', 256, 128)
        assert p.pick([a, b, c], ctx(prefix=hashes)) is first


def test_session_affinity_follows_the_header_value():
    a, b, c = ep("a"), ep("b"), ep("c")
    p = pipeline(scorers={"session": 5, "inflight": 1})
    first = p.pick([a, b, c], ctx(session="user-1"))
    first.inflight += 1  # even a little busier, the session stays
    assert p.pick([a, b, c], ctx(session="user-1")) is first


def test_max_score_breaks_ties_in_turn():
    eps = [ep(n) for n in "abc"]
    p = pipeline(scorers={"inflight": 1})
    # The same request, or distinct ones: equal endpoints take every third each, in
    # order, not a random split that would send one of them two in a row.
    picks = [p.pick(eps, ctx(key=sc.request_key(b"same"))).id for _ in range(9)]
    assert Counter(picks) == {"a": 3, "b": 3, "c": 3}
    assert all(x != y for x, y in zip(picks, picks[1:], strict=False))
    # Only the tied ones share: a busier endpoint gets none.
    eps[2].inflight = 1
    assert {p.pick(eps, ctx()).id for _ in range(6)} == {"a", "b"}


def test_request_key_covers_both_ends_and_the_length_of_large_bodies():
    head, tail = b"h" * 5000, b"t" * 5000
    assert sc.request_key(head + tail + b"1") != sc.request_key(head + tail + b"2")
    assert sc.request_key(b"1" + head + tail) != sc.request_key(b"2" + head + tail)
    assert sc.request_key(head + b"xy" + tail) != sc.request_key(head + b"x" + tail)


def test_p2c_never_picks_the_single_worst_endpoint_of_three():
    worst = ep("worst", inflight=10)
    eps = [ep("a", inflight=1), ep("b", inflight=1), worst]
    p = pipeline(scorers={"inflight": 1}, picker="p2c")
    picks = Counter(p.pick(eps, ctx(key=sc.request_key(b"%d" % i))).id for i in range(300))
    assert picks["worst"] == 0
    assert picks["a"] > 50 and picks["b"] > 50


def test_weighted_random_picks_in_proportion_to_score():
    picker = WeightedRandom()
    keys = [sc.request_key(b"request %d" % i) for i in range(4000)]
    picks = Counter(picker.pick([3.0, 1.0, 0.0], k) for k in keys)
    assert picks[2] == 0
    assert 2.4 < picks[0] / picks[1] < 3.8
    assert set(Counter(picker.pick([0.0, 0.0], k) for k in keys[:100])) == {0, 1}


def test_the_chosen_endpoints_scores_are_observed_for_real_choices_only():
    rec = Recorder()
    p = pipeline(scorers={"queue": 1, "kv": 1}, observer=rec)
    p.pick([ep("a", waiting=0, kv=0.5), ep("b", waiting=3, kv=0.5)], ctx())
    assert sorted(rec.scores) == [("kv", 0.5), ("queue", 1.0)]
    rec.scores.clear()
    p.pick([ep("solo")], ctx())
    assert rec.scores == []


def test_a_weight_of_zero_turns_a_scorer_off():
    p = pipeline(scorers={"queue": 0, "inflight": 1})
    assert [s.name for s, _ in p.profiles[DEFAULT].scorers] == ["inflight"]
