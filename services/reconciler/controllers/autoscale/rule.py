"""The autoscaler's decisions: replica counts from demand. Pure, with given clocks.

Input: the folded state (each autoscaled model's spec, its desired count, its
latest ModelScaled) and the routers' demand summaries, combined per model into
`ScaleSignals` (`combine`). Output: ModelScaled events.

A disaggregated model's pools (prefill, decode) scale apart, each by its own
spec, with the same rule: a pool's signals are its endpoints' in-flight
requests, capacity, ready count and engine queues (the routers' per-pool
demand), plus the model's queue in admission, which every pool will serve.
Everything keyed "per model" below is keyed by the pair (model, role), role ""
for a whole model; the event records the role.

The rule (`propose`) reads one number, the spec's `signal`:

- `load` (the default): requests in flight plus queued in admission, over the
  batch capacity of the ready replicas. 1.0 is every batch slot busy with
  nothing waiting.
- `queue`: requests waiting (in admission, every band, and in the engines' own
  queues) per ready replica. It rises only once the replicas are full, so it
  scales up late but never on a learned capacity's guess; it cannot say how
  many replicas could go (it is 0 at 95% of capacity as at 5%), so scale-down
  reads the load: to the fewest replicas that hold what is in flight at
  1 - tolerance of their capacity.

Admission's saturation is recorded too, but cannot drive the count alone: it is
0 whenever nothing queues, so a fleet at 95% of its batch capacity would look
idle and shrink until it queued again (flapping). TTFT is not a signal: routers
see only the first token of what they proxy, after admission's wait, and a
percentile over a second of a share of the traffic is noise (docs/autoscale.md).

With `load` (`queue` reads the same with its own number, except scale-down):

- load > target: scale up to ceil(ready * load / target), at least one more,
  at most max, once it held for `scale_up_after_seconds`. With a capacity only
  learned (no declared max_num_seqs), only while something waits (in admission
  or in the engines' queues): the most an engine has run is not all it could
  run. Not while an earlier
  scale-up is still arriving (fewer replicas ready than desired): the load of
  the ready ones says nothing yet, and a scale-up that placement cannot meet
  (no free GPU: PlacementFailed says why) is not asked for again.
- load < target * (1 - tolerance): scale down to ceil(ready * load / (target *
  (1 - tolerance))), never below min, once it held for
  `scale_down_after_seconds` and as long since the last change (cool-down).
  The new count puts the load at or under the low mark, where neither rule
  fires: a steady demand settles, it does not flap. Scale-down retires
  replicas; reconcile drains them before they stop.
- no replica (desired 0) and any request in flight or queued: one replica (or
  min) at once, rule `from_zero`; routers hold the first requests in admission
  meanwhile. With min 0 the scale-down rule takes an idle model to 0.

A condition is timed from the first summary that showed it (`Track`); a gap in
the summaries longer than `max_gap` or another outcome restarts the timing.
Durations (how long a condition held, the cool-down) are measured on the
leader's monotonic clock (`now`); the wall clock (`wall`) only stamps the
events. Each event records the signals, the per-router inputs they were
combined from (at most INPUTS_CAP), the rule and how long it held, so
`llmgw audit replay` re-derives it (`check`) from the log alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw import contracts as c
from llmgw.reconciler.state.ids import event_id
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.state.wording import clock_text

SCALE_UP = "scale_up"
SCALE_DOWN = "scale_down"
FROM_ZERO = "from_zero"

# A summary is combined while it is younger than this (routers send one a second).
SUMMARY_TTL = 3.0
# The most per-router inputs a ModelScaled records (the count is in signals.routers):
# an event stays small with any number of routers; replay re-combines only complete ones.
INPUTS_CAP = 64


@dataclass(frozen=True)
class Proposal:
    rule: str
    to: int
    after: float  # seconds the condition must hold before it fires


@dataclass(frozen=True)
class Track:
    """The condition being timed for one model."""

    rule: str = ""
    to: int = 0
    since: float = 0.0
    last_seen: float = 0.0


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 2.0000000001 from float noise is 2, not 3


def value(spec: c.AutoscaleSpec, sig: c.ScaleSignals) -> float:
    """The number the spec's target is in."""
    return sig.queue if spec.signal == "queue" else sig.load


def propose(spec: c.AutoscaleSpec, desired: int, sig: c.ScaleSignals) -> Proposal | None:
    """What the rule says for these signals, ignoring time (replay calls this too)."""
    if desired == 0:
        if sig.in_flight + sig.queued > 0:
            return Proposal(FROM_ZERO, min(spec.max, max(1, spec.min)), 0.0)
        return None
    if spec.signal == "queue":
        return _propose_queue(spec, desired, sig)
    if sig.ready == 0 or sig.capacity <= 0:
        return None  # nothing serves yet: there is no load to measure
    if sig.load > spec.target:
        if sig.ready < desired:
            return None  # the last scale-up is still arriving (or cannot be placed)
        if not sig.capacity_declared and sig.queued + sig.waiting == 0:
            # A learned capacity is the most the engines have run so far: at that level
            # they may have room to spare. Only a queue says they are full.
            return None
        to = min(spec.max, max(desired + 1, _ceil(sig.ready * sig.load / spec.target)))
        return Proposal(SCALE_UP, to, spec.scale_up_after_seconds) if to > desired else None
    low = spec.target * (1 - spec.tolerance)
    if sig.load < low:
        to = max(spec.min, _ceil(sig.ready * sig.load / low))
        return Proposal(SCALE_DOWN, to, spec.scale_down_after_seconds) if to < desired else None
    return None


def _propose_queue(spec: c.AutoscaleSpec, desired: int, sig: c.ScaleSignals) -> Proposal | None:
    if sig.ready == 0:
        return None  # nothing serves yet: a queue says nothing of the replicas' size
    if sig.queue > spec.target:
        if sig.ready < desired:
            return None  # the last scale-up is still arriving (or cannot be placed)
        to = min(spec.max, max(desired + 1, _ceil(sig.ready * sig.queue / spec.target)))
        return Proposal(SCALE_UP, to, spec.scale_up_after_seconds) if to > desired else None
    if sig.queue < spec.target * (1 - spec.tolerance) and sig.capacity > 0:
        # No queue says nothing of how full the replicas are: size down by the load, to
        # the fewest that hold it at 1 - tolerance of their capacity (so it does not queue
        # again at once and scale back up).
        to = max(spec.min, _ceil(sig.ready * sig.load / (1 - spec.tolerance)))
        return Proposal(SCALE_DOWN, to, spec.scale_down_after_seconds) if to < desired else None
    return None


def step(
    spec: c.AutoscaleSpec,
    desired: int,
    sig: c.ScaleSignals | None,
    track: Track,
    now: float,
    last_scaled_at: float | None,
    *,
    max_gap: float = SUMMARY_TTL,
) -> tuple[Proposal | None, Track]:
    """One evaluation: the proposal that fires now (or None), and the track to keep.
    `now` and `last_scaled_at` are on one monotonic clock."""
    prop = propose(spec, desired, sig) if sig is not None else None
    if prop is None:
        return None, Track()
    # The direction, not the exact target count, is what must hold: demand moves a little
    # every second, and the count fired is the one the latest signals call for.
    continuing = track.rule == prop.rule and now - track.last_seen <= max_gap
    since = track.since if continuing else now
    track = Track(prop.rule, prop.to, since, now)
    if now - since < prop.after:
        return None, track
    if prop.rule == SCALE_DOWN and last_scaled_at is not None:
        if now - last_scaled_at < spec.scale_down_after_seconds:
            return None, track  # cool-down after the last change
    return prop, track


def demand_of(d: c.ModelDemand | None, role: str) -> c.ModelDemand | None:
    """What one router said of the model (role "") or of one of its pools: a pool's own
    counts with the model's admission queue and saturation (None: no word of it)."""
    if d is None or not role:
        return d
    pool = d.pools.get(role)
    if pool is None:
        return None
    return c.ModelDemand(
        in_flight=pool.in_flight,
        queued=d.queued,
        saturation=d.saturation,
        capacity=pool.capacity,
        ready=pool.ready,
        capacity_declared=pool.capacity_declared,
        waiting=pool.waiting,
    )


def combine(summaries: Iterable[c.DemandSummary], model: str, role: str = "") -> c.ScaleSignals:
    """One model's (or one pool's, `role`) demand over the live routers' latest summaries.

    Counts add up (each router sees its share of the requests); capacity, ready
    replicas and the engines' own waiting counts are the same engines seen from
    every router, so the largest report is taken (a router that has not learned
    a capacity yet reports less); capacity is declared only if every router
    that sees a ready replica says so;
    saturation is the mean over all routers, a router without the model at 0
    (each router judges its share of the capacity against its share of the work).
    """
    routers = 0
    in_flight = queued = capacity = ready = waiting = 0
    oldest = 0.0
    saturation = 0.0
    declared = True
    for summary in summaries:
        routers += 1
        d = demand_of(summary.models.get(model), role)
        if d is None:
            continue
        in_flight += d.in_flight
        for band in d.queued.values():
            queued += band.queued
            oldest = max(oldest, band.oldest_wait_seconds)
        capacity = max(capacity, d.capacity)
        ready = max(ready, d.ready)
        waiting = max(waiting, d.waiting)
        if d.ready:
            declared = declared and d.capacity_declared
        saturation += d.saturation
    demand = in_flight + queued
    return c.ScaleSignals(
        queue=round((queued + waiting) / ready, 4) if ready else 0.0,
        load=round(demand / capacity, 4) if capacity else 0.0,
        saturation=round(saturation / routers, 4) if routers else 0.0,
        queued=queued,
        in_flight=in_flight,
        oldest_wait_seconds=round(oldest, 3),
        capacity=capacity,
        ready=ready,
        routers=routers,
        capacity_declared=declared,
        waiting=waiting,
    )


def inputs_of(summaries: Iterable[c.DemandSummary], model: str) -> list[c.RouterInput]:
    """What each router said of `model`, by router id, at most INPUTS_CAP of them."""
    ordered = sorted(summaries, key=lambda sm: (sm.router_id, sm.process))[:INPUTS_CAP]
    return [
        c.RouterInput(router_id=sm.router_id, process=sm.process, demand=sm.models.get(model))
        for sm in ordered
    ]


def recombine(ev: c.ModelScaled) -> c.ScaleSignals | None:
    """The signals `ev`'s recorded inputs combine to; None when they are not all there
    (events from before inputs were recorded, or more routers than INPUTS_CAP)."""
    if not ev.inputs or len(ev.inputs) != ev.signals.routers:
        return None
    summaries = [
        c.DemandSummary(
            router_id=i.router_id,
            process=i.process,
            models={} if i.demand is None else {ev.model: i.demand},
        )
        for i in ev.inputs
    ]
    return combine(summaries, ev.model, ev.role)


def explanation(ev: c.ModelScaled, spec: c.AutoscaleSpec) -> str:
    s = ev.signals
    pool = f"{ev.role} pool " if ev.role else ""
    head = f"{pool}scaled {ev.from_replicas} → {ev.to_replicas} at {clock_text(ev.ts)}: "
    held = f"for {ev.sustained_seconds:.0f} s"
    if ev.rule == FROM_ZERO:
        why = f"{s.in_flight + s.queued} request(s) waiting and no replica"
    elif ev.rule == SCALE_UP and ev.signal == "queue":
        why = f"queue {s.queue:.2f} per replica over target {spec.target:g} {held}"
    elif ev.rule == SCALE_UP:
        why = f"load {s.load:.2f} over target {spec.target:g} {held}"
    elif ev.signal == "queue":
        low = spec.target * (1 - spec.tolerance)
        why = (
            f"queue {s.queue:.2f} per replica under {low:.2f} (target {spec.target:g} less "
            f"{spec.tolerance:.0%}) {held}, load {s.load:.2f} fits {ev.to_replicas} "
            f"replica(s) at {1 - spec.tolerance:.0%}"
        )
    else:
        low = spec.target * (1 - spec.tolerance)
        why = f"load {s.load:.2f} under {low:.2f} (target {spec.target:g} less {spec.tolerance:.0%}) {held}"
    learned = "" if s.capacity_declared else " learned"
    other = f"load {s.load:.2f}" if ev.signal == "queue" else f"queue {s.queue:.2f} per replica"
    detail = (
        f" ({other}, saturation {s.saturation:.2f}, {s.in_flight} in flight, {s.queued} queued, "
        f"{s.waiting} waiting in engines, {s.ready} ready of{learned} capacity {s.capacity}, "
        f"{s.routers} router(s))"
    )
    return head + why + detail


def decide(
    state: ClusterState,
    signals: dict[tuple[str, str], c.ScaleSignals],
    tracks: dict[tuple[str, str], Track],
    now: float,
    *,
    wall: float | None = None,
    changed_at: dict[tuple[str, str], float] | None = None,
    inputs: dict[tuple[str, str], list[c.RouterInput]] | None = None,
) -> tuple[list[c.ModelScaled], dict[tuple[str, str], Track]]:
    """ModelScaled events for every autoscaled model or pool whose rule fires now, and the
    new tracks. One without signals (no live router) is left as it is. Every dict here is
    keyed by (model, role).

    `now` measures (monotonic); `wall` stamps the events (default `now`). `changed_at`:
    when each model last changed, on the clock of `now` (default: the previous event's
    wall time, for callers whose `now` is a wall time). `inputs`: the per-router
    summaries each model's signals were combined from, recorded in the event."""
    events: list[c.ModelScaled] = []
    new_tracks: dict[tuple[str, str], Track] = {}
    for model, role, spec in state.autoscaled():
        key = (model, role)
        desired = state.desired_replicas(model, role)
        if changed_at is not None:
            last_at = changed_at.get(key)
        else:
            last = state.scaled.get(key)
            last_at = last.ts if last is not None else None
        prop, track = step(spec, desired, signals.get(key), tracks.get(key, Track()), now, last_at)
        if track.rule:
            new_tracks[key] = track
        if prop is None:
            continue
        ev = c.ModelScaled(
            id=event_id("scaled", *_id_parts(key), state.last_seq, desired, prop.to),
            ts=now if wall is None else wall,
            model=model,
            role=role,
            from_replicas=desired,
            to_replicas=prop.to,
            rule=prop.rule,
            signals=signals[key],
            sustained_seconds=round(now - track.since, 3),
            based_on_seq=state.last_seq,
            signal=spec.signal,
            inputs=(inputs or {}).get(key, []),
            since_last_change_seconds=round(now - last_at, 3) if last_at is not None else None,
        )
        ev.explanation = explanation(ev, spec)
        events.append(ev)
        new_tracks.pop(key, None)  # the count changes: time the next condition afresh
    return events, new_tracks


def _id_parts(key: tuple[str, str]) -> tuple[str, ...]:
    """The event id's parts for a count: the model, then its pool's role if it has one.
    Each decision keeps the id it had when the key was one string (model, or model and
    role joined by event_id's own separator), so a leader of the older version
    re-publishing it during an upgrade still dedupes."""
    model, role = key
    return (model, role) if role else (model,)


def check(state: ClusterState, ev: c.ModelScaled) -> list[str]:
    """Why `ev` is not what the rule decides on the state just before it (empty: same)."""
    specs = {(m, r): spec for m, r, spec in state.autoscaled()}
    spec = specs.get((ev.model, ev.role))
    if spec is None:
        what = f"pool {ev.role} of model {ev.model}" if ev.role else f"model {ev.model}"
        return [f"{what} was not declared with autoscale"]
    out = []
    desired = state.desired_replicas(ev.model, ev.role)
    if desired != ev.from_replicas:
        out.append(f"from: recorded {ev.from_replicas}, the log says {desired} were wanted")
    if ev.signal != spec.signal:
        out.append(f"signal: recorded {ev.signal}, the model's autoscale.signal is {spec.signal}")
    combined = recombine(ev)
    if combined is not None and combined != ev.signals:
        fields = [
            f"{f} {getattr(ev.signals, f)!r} (inputs give {getattr(combined, f)!r})"
            for f in ev.signals.__struct_fields__
            if getattr(ev.signals, f) != getattr(combined, f)
        ]
        out.append("signals: recorded " + ", ".join(fields))
    prop = propose(spec, ev.from_replicas, ev.signals)
    if prop is None:
        out.append(f"rule: recorded {ev.rule} to {ev.to_replicas}, now no rule fires")
        return out
    if (prop.rule, prop.to) != (ev.rule, ev.to_replicas):
        out.append(f"rule: recorded {ev.rule} to {ev.to_replicas}, now {prop.rule} to {prop.to}")
    if ev.sustained_seconds + 1e-6 < prop.after:
        out.append(f"held {ev.sustained_seconds:g} s, the rule needs {prop.after:g} s")
    last = state.scaled.get((ev.model, ev.role))
    if prop.rule == SCALE_DOWN and last is not None:
        # Measured on the leader's monotonic clock; older events only have wall times.
        gap = ev.since_last_change_seconds
        if gap is None:
            gap = ev.ts - last.ts
        if gap + 1e-6 < spec.scale_down_after_seconds:
            out.append(
                f"cool-down: {gap:.1f} s after the previous change, "
                f"the rule needs {spec.scale_down_after_seconds:g} s"
            )
    return out
