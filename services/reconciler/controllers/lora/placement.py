"""Which replicas of a base model hold which LoRA adapters. Pure: no I/O, no clock.

An engine has `max_loras` adapter slots; a fleet serving many tenants' fine-tunes has
more adapters than slots, so the leader decides which adapters each replica holds from
the routers' demand per adapter. Loading costs (vLLM: 30-150 ms on the tiny model, far
more for a real one, and the requests waiting for it), so the policy's first duty is not
to thrash: Dynamo's LoRA placement cut load/unload churn from 35k to 98 operations in
simulation against loading wherever a request lands. The rules, in order:

1. what can no longer be held is dropped: an adapter removed from the catalog, a
   replica that no longer serves, slots beyond a shrunk `max_loras`. A replica on an
   unreachable node keeps what it holds, untouched (its engine still serves, and
   dropping it would unload everything there the moment the node came back);
2. a pinned adapter is held on `pinned` replicas whatever the demand;
3. an adapter with requests waiting in admission and held nowhere gets a slot at
   once, the longest waiting first (its queue over its rate: how long n requests at r per
   second have been arriving): a free one, or the slot of the least-demanded unpinned
   adapter that has been held at least `waiting_hold` seconds and would see fewer
   requests in the next `horizon` seconds (its requests per second per copy, times
   `horizon`) than the waiting adapter has waiting (none such: it waits, and the
   explanation says so). Requests waiting are weighed against requests expected, one
   count against another: when a queue's length was added to a rate instead, a tail
   adapter's few waiting requests outweighed a popular adapter's rate, which was
   evicted, waited, and evicted another in turn (bench_lora: each of the ten most used
   evicted 6-9 times a minute). The longest queue first left the rarest adapters, whose
   queues grow slowest, behind the others until some of their requests timed out.
   A queue's claim grows with how long its oldest request has waited (`waited`): once
   that is `max_wait` seconds it is weighed over no horizon at all, so any unpinned slot
   held `waiting_hold` whose adapter has fewer requests waiting than it is its (the least
   demanded first: never the popular ones while the tail holds slots), and no queue
   waits much past `max_wait`. Without it a rare adapter's queue of 2 could not outweigh
   any incumbent expecting 2 in the horizon, and waited until admission's 30 s limit
   (bench_lora: 14 requests). All at once rather than a horizon shrinking as the queue
   waits: shrinking it from the first second served the tail sooner for many more loads
   (bench_lora_policy, loads per 1,000, 57 without aging: 82 with the horizon shrinking
   to none over 12 s, 61 as the 4th power over 16 s, 59 all at once at 15 s; each kept
   the longest wait near its limit, from 26 s);
4. otherwise an adapter below its share of replicas (its share of the demand, at least
   one copy while it has any) takes a free slot, or replaces an incumbent only when its
   demand per copy exceeds the incumbent's by `margin` and the incumbent has been held
   at least `min_hold`. An adapter loaded in this decision is never evicted by it.

Demand is what the caller weighed (demand.py: requests per second, smoothed), and
`queued` the requests waiting per adapter and `waited` how long each queue's oldest has
(demand.py: since the queue was first heard of); an adapter nobody asks for stays loaded until a slot is wanted,
since an idle slot costs nothing. Times are wall times from the log (when each adapter
was loaded, the decision's own timestamp), so `llmgw audit replay` re-derives a decision
from the recorded demand exactly.

16 slots hold 79% of bench_lora's requests (40 adapters, Zipf 1.0: its 16 most used), so
the other 21% either wait or load, and `waiting_hold` and `horizon` trade one for the
other; the measures that chose them are in docs/reconciler.md ("LoRA adapters").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmgw import contracts as c
from llmgw.reconciler.state.model import AdapterHoldings, ClusterState, Liveness
from llmgw.reconciler.state.queries import is_ready

# The rule's version, recorded on each AdaptersPlaced: `llmgw audit replay` re-derives a
# decision only with the rule that made it. Bump it with any change that can decide
# otherwise on the same inputs. 0 (not recorded): every rule before 1, the queue added to
# the rate and the longest queue first among them; 1: the queue waiting longest first,
# against what an incumbent expects over the horizon; 2: and over none once it has waited
# `max_wait` (`waited` recorded).
POLICY = 2
MARGIN = 1.5  # a challenger replaces an incumbent only with this much more demand per copy
MIN_HOLD = 30.0  # seconds an adapter stays before its slot can be taken for more demand
# Seconds an adapter stays before its slot can be taken for requests waiting: short, since
# those requests wait in admission meanwhile, yet long enough for the requests that
# waited for it to be served (the control loop to hold it took about 0.7 s here).
WAITING_HOLD = 1.5
# An incumbent gives its slot to a queue longer than the requests it would see in this
# many seconds: longer keeps slots for the popular adapters and makes the tail wait.
HORIZON = 6.0
# Seconds a queue's oldest request may wait before the queue outweighs any incumbent held
# `waiting_hold` (no requests expected of it over a horizon): well under admission's
# 30 s wait, with room for the control loop's, so that a rare adapter's requests are
# served, not turned away.
MAX_WAIT = 15.0
# Requests per second assumed of an adapter with a queue but no rate measured yet, when
# its queue's age is estimated (queue / rate): as rare as an adapter is taken to be.
RARE_RATE = 0.05


@dataclass(frozen=True)
class Tuning:
    margin: float = MARGIN
    min_hold: float = MIN_HOLD
    waiting_hold: float = WAITING_HOLD
    horizon: float = HORIZON
    max_wait: float = MAX_WAIT


@dataclass(frozen=True)
class Inputs:
    """What one decision for one base model is made from."""

    adapters: list[c.AdapterDeclared]  # declared on the base
    replicas: list[str]  # serving replicas of the base, each with `slots` slots
    slots: int
    current: AdapterHoldings | None
    demand: dict[str, float]  # requests per second per adapter, smoothed
    queued: dict[str, int]  # adapters held nowhere -> requests waiting for them
    now: float  # wall time of the decision
    # Adapters held nowhere -> seconds their queue's oldest request has waited.
    waited: dict[str, float] = field(default_factory=dict)
    # Ready replicas on nodes that are unreachable: their engines still serve what they
    # hold, but nobody can tell them to load or unload. Kept as they are, counted as copies.
    unreachable: frozenset[str] = frozenset()


@dataclass
class Placement:
    holdings: dict[str, list[str]]
    changes: list[c.AdapterChange]
    unplaced: list[str] = field(default_factory=list)  # waiting, but no slot could be freed

    def explanation(self) -> str:
        parts = [
            f"{ch.adapter} {'loaded on' if ch.action == 'load' else 'unloaded from'} "
            f"{ch.replica_id}: {ch.reason}"
            for ch in self.changes
        ]
        parts += [
            f"{a} waits: every slot is pinned, expects more requests than {a} has waiting, "
            "or is held under the minimum hold time"
            for a in self.unplaced
        ]
        return "; ".join(parts)


class _Plan:
    """Holdings being decided, with each step's reason and what it may not evict."""

    def __init__(self, inp: Inputs, tuning: Tuning):
        self.inp, self.tuning = inp, tuning
        self.declared = {a.name: a for a in inp.adapters}
        before = inp.current.holdings if inp.current is not None else {}
        self.loaded_at = inp.current.loaded_at if inp.current is not None else {}
        self.before = {rid: list(held) for rid, held in before.items() if held}
        self.held: dict[str, list[str]] = {rid: [] for rid in inp.replicas}
        self.kept = {rid: list(held) for rid, held in self.before.items() if rid in inp.unreachable}
        self.reasons: dict[tuple[str, str, str], str] = {}
        self.fresh: set[tuple[str, str]] = set()  # loaded in this decision
        for rid, held in self.before.items():
            for a in held:
                if rid in self.kept:
                    continue
                if rid not in self.held:
                    self.reasons[(rid, a, "unload")] = f"{rid} no longer serves"
                elif a not in self.declared:
                    self.reasons[(rid, a, "unload")] = "removed from the catalog"
                else:
                    self.held[rid].append(a)

    def demand(self, a: str) -> float:
        return self.inp.demand.get(a, 0.0)

    def copies(self, a: str) -> int:
        return sum(a in held for held in [*self.held.values(), *self.kept.values()])

    def per_copy(self, a: str) -> float:
        return self.demand(a) / max(1, self.copies(a))

    def held_for(self, rid: str, a: str) -> float:
        return self.inp.now - self.loaded_at.get(rid, {}).get(a, self.inp.now)

    def load(self, rid: str, a: str, reason: str) -> None:
        self.held[rid].append(a)
        self.fresh.add((rid, a))
        self.reasons.pop((rid, a, "unload"), None)
        self.reasons[(rid, a, "load")] = reason

    def unload(self, rid: str, a: str, reason: str) -> None:
        self.held[rid].remove(a)
        self.reasons[(rid, a, "unload")] = reason

    def free_replica(self, a: str) -> str | None:
        """The replica with the most free slots that does not hold `a` yet."""
        open_ = [r for r in self.inp.replicas if len(self.held[r]) < self.inp.slots]
        open_ = [r for r in open_ if a not in self.held[r]]
        return min(open_, key=lambda r: (len(self.held[r]), r), default=None)

    def expected(self, a: str, horizon: float) -> float:
        """Requests a copy of `a` would get within `horizon` seconds, counting those
        waiting for it still (decided, but not yet held where the routers see it)."""
        return self.per_copy(a) * horizon + self.inp.queued.get(a, 0)

    def horizon_for(self, a: str) -> float:
        """The horizon `a`'s queue is weighed over: the whole one, or none once its oldest
        request has waited `max_wait` (then only requests waiting for an incumbent count)."""
        if self.inp.waited.get(a, 0.0) >= self.tuning.max_wait:
            return 0.0
        return self.tuning.horizon

    def victim(
        self, a: str, *, hold: float = 0.0, fewer_than: float | None = None, horizon: float = 0.0
    ) -> tuple[str, str] | None:
        """The slot to give up for `a`: the least demand per copy among the incumbents
        held at least `hold` seconds (with `fewer_than`: expecting fewer requests within
        `horizon`)."""
        out = []
        for rid in self.inp.replicas:
            if a in self.held[rid]:
                continue
            for inc in self.held[rid]:
                if (rid, inc) in self.fresh or self.copies(inc) <= self.pinned(inc):
                    continue
                if self.held_for(rid, inc) < hold:
                    continue
                if fewer_than is not None and not self.expected(inc, horizon) < fewer_than:
                    continue
                out.append((self.per_copy(inc), -self.held_for(rid, inc), rid, inc))
        best = min(out, default=None)
        return (best[2], best[3]) if best is not None else None

    def pinned(self, a: str) -> int:
        d = self.declared.get(a)
        return min(d.pinned, len(self.inp.replicas)) if d is not None else 0

    def target(self, a: str, total: float) -> int:
        """Copies `a` should have: its share of the demand as a share of the replicas."""
        n = len(self.inp.replicas)
        share = math.floor(n * self.demand(a) / total + 0.5) if total > 0 else 0
        floor = 1 if self.demand(a) > 0 else 0
        return min(n, max(self.pinned(a), floor, share))


def _trim(plan: _Plan) -> None:
    """Slots beyond `max_loras` (it shrank): the least-demanded adapters go first."""
    for rid, held in plan.held.items():
        while len(held) > plan.inp.slots:
            worst = min(held, key=lambda a: (plan.demand(a), a))
            plan.unload(rid, worst, f"over the {plan.inp.slots} adapter slot(s) of {rid}")


def _place_pinned(plan: _Plan) -> None:
    for a in sorted(plan.declared):
        while plan.copies(a) < plan.pinned(a):
            rid = plan.free_replica(a)
            if rid is None:
                spot = plan.victim(a)  # pinned wins over hold time
                if spot is None:
                    break
                rid, inc = spot
                plan.unload(rid, inc, f"made room for {a}, pinned")
            plan.load(rid, a, f"pinned on {plan.pinned(a)} replica(s)")


def _place_waiting(plan: _Plan) -> list[str]:
    unplaced, queued = [], plan.inp.queued

    def waited(a: str) -> float:
        return queued[a] / max(plan.demand(a), RARE_RATE)

    for a in sorted(queued, key=lambda a: (-waited(a), a)):
        if a not in plan.declared or plan.copies(a) > 0:
            continue
        rid = plan.free_replica(a)
        if rid is None:
            # Never an adapter that would queue more requests than this one has waiting:
            # they would wait next, and evict in turn.
            horizon = plan.horizon_for(a)
            spot = plan.victim(
                a, hold=plan.tuning.waiting_hold, fewer_than=queued[a], horizon=horizon
            )
            if spot is None:
                unplaced.append(a)
                continue
            rid, inc = spot
            aged = horizon == 0.0 and plan.tuning.horizon > 0.0
            why = f"waiting {plan.inp.waited[a]:.0f} s" if aged else "waiting"
            plan.unload(rid, inc, f"made room for {a}, which had requests {why}")
        plan.load(rid, a, "requests waiting and held nowhere")
    return unplaced


def _place_by_demand(plan: _Plan) -> None:
    total = sum(plan.demand(a) for a in plan.declared)
    ranked = sorted(plan.declared, key=lambda a: (-plan.demand(a), a))
    for a in ranked:
        while plan.copies(a) < plan.target(a, total):
            wanted = f"demand {plan.demand(a):.2f} wants {plan.target(a, total)} replica(s)"
            rid = plan.free_replica(a)
            if rid is None:
                spot = plan.victim(a, hold=plan.tuning.min_hold)
                if spot is None:
                    break
                rid, inc = spot
                mine = plan.demand(a) / (plan.copies(a) + 1)
                theirs = plan.per_copy(inc)
                if not mine > plan.tuning.margin * theirs:
                    break  # the weakest incumbent is strong enough: no thrash for a small edge
                plan.unload(
                    rid, inc, f"{a} has {mine:.2f} per copy against its {theirs:.2f} (margin)"
                )
            plan.load(rid, a, wanted)


def place(inp: Inputs, tuning: Tuning | None = None) -> Placement:
    """The new holdings of one base model, and the steps from the current ones."""
    plan = _Plan(inp, tuning or Tuning())
    _trim(plan)
    _place_pinned(plan)
    unplaced = _place_waiting(plan)
    _place_by_demand(plan)
    holdings = {rid: sorted(held) for rid, held in [*plan.held.items(), *plan.kept.items()]}
    changes = []
    for rid in sorted(set(plan.before) | set(holdings)):
        old, new = set(plan.before.get(rid, [])), set(holdings.get(rid, []))
        steps = [(a, "load") for a in sorted(new - old)] + [
            (a, "unload") for a in sorted(old - new)
        ]
        for a, action in steps:
            reason = plan.reasons.get((rid, a, action), "")
            changes.append(c.AdapterChange(adapter=a, replica_id=rid, action=action, reason=reason))
    return Placement(holdings, changes, unplaced)


def adapter_models(state: ClusterState) -> list[str]:
    """The declared models with adapters declared on them or placed on their replicas:
    the only ones worth a decision (a fleet of models without adapters costs nothing)."""
    named = {a.base for a in state.adapters.values()} | set(state.adapter_holdings)
    return sorted(m for m in named if m in state.models)


def serving_replicas(
    state: ClusterState, model: str, liveness: Liveness = Liveness.ALIVE
) -> list[str]:
    """The replicas of `model` whose every shard is ready and whose nodes are all at
    `liveness`: alive ones can be told to load and unload (an agent that cannot be
    reached cannot load anything); unreachable ones keep serving what they hold."""
    out = []
    for replica in state.active_replicas(model):
        nodes = [state.nodes.get(a.node) for a in replica.assignments]
        at = all(n is not None and n.liveness == liveness for n in nodes)
        if at and is_ready(state, replica):
            out.append(replica.replica_id)
    return sorted(out)


def inputs_from(
    state: ClusterState,
    model: str,
    demand: dict[str, float],
    queued: dict[str, int],
    now: float,
    waited: dict[str, float] | None = None,
) -> Inputs:
    """A decision's inputs as the folded state has them, plus the demand it was given:
    the leader's and replay's one way to ask."""
    decl = state.models.get(model)
    return Inputs(
        adapters=state.adapters_of(model),
        replicas=serving_replicas(state, model),
        unreachable=frozenset(serving_replicas(state, model, Liveness.UNREACHABLE)),
        slots=decl.profile.max_loras if decl is not None else 0,
        current=state.adapter_holdings.get(model),
        demand=dict(demand),
        queued=dict(queued),
        now=now,
        waited=dict(waited or {}),
    )


def held_now(holdings: dict[str, list[str]]) -> dict[str, list[str]]:
    """Holdings without the replicas that hold nothing: what "changed" is judged on."""
    return {rid: sorted(held) for rid, held in holdings.items() if held}


def check(state: ClusterState, ev: c.AdaptersPlaced) -> list[str]:
    """How a recorded decision of this rule (`ev.policy == POLICY`) differs from what this
    code decides on the same state (as of its `based_on_seq`) and the demand and queues it
    recorded; [] when they agree."""
    if ev.model not in state.models:
        return [f"model {ev.model} was not declared at seq {ev.based_on_seq}"]
    derived = place(inputs_from(state, ev.model, ev.demand, ev.queued, ev.ts, ev.waited))
    recorded, now = held_now(ev.holdings), held_now(derived.holdings)
    if recorded == now:
        return []
    return [f"holdings: recorded {_holdings_text(recorded)}, now {_holdings_text(now)}"]


def _holdings_text(holdings: dict[str, list[str]]) -> str:
    return (
        "; ".join(f"{rid} [{', '.join(held)}]" for rid, held in sorted(holdings.items())) or "none"
    )
