"""Reconcile: compare desired with actual state, say what to do about it. Pure.

`decide(state, ts=...)` returns a `Plan`:
  - `events`: control events to publish into the log, in order (replicas
    retired, shards adopted, replicas placed or failing to place), from the
    plan steps: `retire_removed`, then each model's turn through
    `MODEL_STEPS`. They are computed on a scratch copy of the state to which
    each earlier event of the same plan is already applied, so two placements
    in one plan never take the same GPU; `llmgw audit replay` re-derives them
    the same way.
  - `commands`: the commands the *current* state calls for (level-triggered):
    start pending shards, drain ready shards of retired replicas, stop every
    other shard nobody wants. The command tracker sends new ones and re-issues
    unanswered ones; a command that is no longer called for is closed.

Like a Kubernetes controller, it reacts to state, not to the edge that
changed it: running it twice on the same state yields the same plan, and the
events it already published are recognised (a repeated identical
PlacementFailed is not published again).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import placement
from llmgw.reconciler.state import fold, replica_index
from llmgw.reconciler.state.ids import command_key, event_id
from llmgw.reconciler.state.model import (
    ClusterState,
    Liveness,
    ReplicaView,
    ShardView,
    pool_profile,
)
from llmgw.reconciler.state.queries import (
    adoptable,
    broken_shard,
    freeing,
    is_ready,
    newest_first,
    next_replica_id,
    outdated,
)

MASTER_PORT_BASE = 29500  # multi-node rendezvous port = base + crc32(replica) % span
MASTER_PORT_SPAN = 1000


@dataclass
class Plan:
    events: list[c.Message] = field(default_factory=list)
    commands: list[c.Message] = field(default_factory=list)


@dataclass(frozen=True)
class CommandTimings:
    drain_deadline: float = 60.0
    stop_grace: float = 10.0


def decide(
    state: ClusterState,
    *,
    ts: float = 0.0,
    timings: CommandTimings | None = None,
    max_placements: int | None = None,
    hold: set[tuple[str, str]] = frozenset(),
) -> Plan:
    events, adopted = control_events(state, ts=ts, max_placements=max_placements, hold=hold)
    return Plan(events=events, commands=commands(state, skip=adopted, timings=timings))


# ---------------------------------------------------------------- control events


class Scratch:
    """One plan in the making: the state with the plan's events so far applied, and
    what the plan may still do.

    Each step decides on `state`, so two placements in one plan never take the
    same GPU. Only what the fold of control events mutates is copied, and only
    once the plan has an event.
    """

    def __init__(
        self,
        state: ClusterState,
        *,
        ts: float = 0.0,
        max_placements: int | None = None,
        hold: set[tuple[str, str]] = frozenset(),
    ):
        self.base = state
        self.state = state
        self.seq = state.last_seq
        self.ts = ts  # stamps every event of the plan
        self.budget = max_placements if max_placements is not None else -1  # -1: unbounded
        self.hold = hold  # pools (model, role) that get no new replicas in this plan
        self.unplaceable: set[Pool] = set()  # pools whose next replica failed to place

    def apply(self, event: c.Message) -> None:
        if self.state is self.base:
            s = self.base
            # The fold of control events touches replicas, shards and failures, never
            # nodes or the catalog: share those.
            self.state = ClusterState(
                last_seq=s.last_seq,
                nodes=s.nodes,
                models=s.models,
                tenants=s.tenants,
                bands=s.bands,
                replicas={k: copy.copy(v) for k, v in s.replicas.items()},
                shards={k: copy.copy(v) for k, v in s.shards.items()},
                failures=dict(s.failures),
                scaled=s.scaled,
            )
            replica_index.carry(s, self.state)
        self.seq += 1
        fold.apply(self.state, self.seq, event)


class Pool(NamedTuple):
    """The replicas of one model that one count governs: its aggregated replicas (role
    ""), or one pool (prefill | decode) of a disaggregated model. Each pool takes its own
    turn, so scaling or rolling one never touches the other's replicas."""

    model: str
    role: str = ""


# One step of a pool's turn: the events it adds to the plan, each already applied to
# the scratch state the next step decides on.
Step = Callable[[Scratch, Pool], list[c.Message]]


def control_events(
    state: ClusterState,
    *,
    ts: float = 0.0,
    max_placements: int | None = None,
    hold: set[tuple[str, str]] = frozenset(),
) -> tuple[list[c.Message], set[str]]:
    """The control events the state calls for, and the ids of shards they adopt.

    First the replicas of models no longer declared are retired; then each
    declared model, in name order, takes its turn, pool by pool (state.pools:
    aggregated, or prefill then decode): the steps of `MODEL_STEPS` in order, a
    step in `ENDS_TURN` that added events ending the pool's turn.

    `max_placements` bounds the placement attempts of one plan, so a big
    catalog change is decided in several short plans instead of one long one;
    the rest follow once these are folded. Pools (model, role) in `hold`
    get no new placements this time (their shards keep failing: see backoff.py).
    """
    sc = Scratch(state, ts=ts, max_placements=max_placements, hold=hold)
    events = retire_removed(sc)
    for model in sorted(state.models):
        for role in sc.state.pools(model):
            pool = Pool(model, role)
            for step in MODEL_STEPS:
                added = step(sc, pool)
                events.extend(added)
                if added and step in ENDS_TURN:
                    break
    adopted = {
        a.shard_id
        for ev in events
        if isinstance(ev, c.PlacementDecided) and ev.adopted
        for a in ev.assignments
    }
    return events, adopted


def _retire(sc: Scratch, replica: ReplicaView, reason: str) -> c.ReplicaRetired:
    ev = c.ReplicaRetired(
        id=event_id("retired", replica.replica_id),
        ts=sc.ts,
        model=replica.model,
        replica_id=replica.replica_id,
        based_on_seq=sc.base.last_seq,
        reason=reason,
    )
    sc.apply(ev)
    return ev


def retire_removed(sc: Scratch) -> list[c.Message]:
    """Retire every active replica of a model the catalog no longer declares."""
    out: list[c.Message] = []
    for rid in sorted(sc.base.replicas):
        replica = sc.base.replicas[rid]
        if not replica.retired and replica.model not in sc.base.models:
            out.append(_retire(sc, replica, "model removed from the catalog"))
    return out


def retire_broken(sc: Scratch, pool: Pool) -> list[c.Message]:
    """Retire every active replica with a shard gone, so it is replaced."""
    out: list[c.Message] = []
    for replica in sorted(sc.state.active_replicas(*pool), key=lambda r: r.replica_id):
        broken = broken_shard(sc.state, replica)
        if broken is not None:
            out.append(_retire(sc, replica, f"shard {broken[0]} {broken[1]}; replaced"))
    return out


def scale_down(sc: Scratch, pool: Pool) -> list[c.Message]:
    """Retire the replicas beyond the desired count (plus one surge while a roll runs).

    Not-ready replicas go first (nothing is lost), then outdated ones, then the newest.
    """
    desired = sc.state.desired_replicas(*pool)
    active = sc.state.active_replicas(*pool)
    stale = {r.replica_id for r in outdated(sc.state, *pool)}
    # Surge 1: while outdated replicas run, one extra replica with the new profile.
    surplus = len(active) - desired - (1 if stale else 0)
    if surplus <= 0:
        return []
    order = sorted(
        active,
        key=lambda r: (
            is_ready(sc.state, r),
            r.replica_id not in stale,
            -r.decided_seq,
            newest_first(r.replica_id),
        ),
    )
    what = f"{pool.role} pool " if pool.role else ""
    reason = f"scale down: {what}{desired} wanted, {len(active)} active"
    return [_retire(sc, replica, reason) for replica in order[:surplus]]


def roll_step(sc: Scratch, pool: Pool) -> list[c.Message]:
    """Retire one outdated replica once the surge replica has made it spare.

    It is spare when more than `replicas` are active and retiring it leaves at
    least `replicas` ready (an outdated replica that is not ready costs nothing).
    """
    stale = outdated(sc.state, *pool)
    active = sc.state.active_replicas(*pool)
    desired = sc.state.desired_replicas(*pool)
    if not stale or len(active) <= desired:
        return []
    victim = min(stale, key=lambda r: is_ready(sc.state, r))  # stable: newest first
    ready = sum(1 for r in active if is_ready(sc.state, r))
    if is_ready(sc.state, victim) and ready - 1 < desired:
        return []
    reason = f"rolling update: profile changed since {victim.replica_id} was placed"
    return [_retire(sc, victim, reason)]


def _missing(sc: Scratch, pool: Pool) -> int:
    """Replicas the pool still lacks in this plan: the desired count, plus the surge
    replica while outdated ones run; none for a pool held back."""
    if pool in sc.hold:
        return 0
    wanted = sc.state.desired_replicas(*pool) + (1 if outdated(sc.state, *pool) else 0)
    return max(0, wanted - len(sc.state.active_replicas(*pool)))


def adopt(sc: Scratch, pool: Pool) -> list[c.Message]:
    """Missing replicas first from shards a node still runs for the pool unowned."""
    out: list[c.Message] = []
    for shard in adoptable(sc.state, *pool)[: _missing(sc, pool)]:
        rid = next_replica_id(sc.state, *pool)
        ev = c.PlacementDecided(
            id=event_id("decided", rid),
            ts=sc.ts,
            model=pool.model,
            replica_id=rid,
            role=pool.role,
            based_on_seq=sc.base.last_seq,
            assignments=[
                c.ShardAssignment(
                    shard_id=shard.shard_id, shard_index=0, node=shard.node, gpus=list(shard.gpus)
                )
            ],
            verdicts=[
                c.NodeVerdict(
                    node=shard.node,
                    fits=True,
                    reason=f"already runs {shard.shard_id} ({','.join(shard.gpus)}), ready",
                )
            ],
            explanation=(
                f"{rid} adopts {shard.shard_id} (of {shard.replica_id}) that {shard.node} "
                "still runs"
            ),
            adopted=True,
        )
        sc.apply(ev)
        out.append(ev)
    return out


def place(sc: Scratch, pool: Pool) -> list[c.Message]:
    """Place the replicas still missing, within the plan's placement budget.

    The first that cannot be placed ends the pool's placements (the next would
    fail the same way); its failure is published unless the same one already is.
    """
    out: list[c.Message] = []
    for _ in range(_missing(sc, pool)):
        if sc.budget == 0:
            break
        sc.budget -= 1
        rid = next_replica_id(sc.state, *pool)
        result = placement.place(
            sc.state, pool.model, rid, sc.base.last_seq, ts=sc.ts, role=pool.role
        )
        if isinstance(result, c.PlacementFailed):
            sc.unplaceable.add(pool)
            if not _same_failure(sc.state.failures.get(rid), result):
                out.append(result)
                sc.apply(result)
            break
        out.append(result)
        sc.apply(result)
    return out


def make_room(sc: Scratch, pool: Pool) -> list[c.Message]:
    """No room for the surge replica: retire one outdated replica so the new one fits.

    Only after a placement of the model failed in this plan, and only when every
    active replica runs, none is missing and no retired one still drains, so the
    roll gives up at most one replica's capacity at a time (the Kubernetes
    maxUnavailable=1 fallback): the retired one drains, then its GPUs take the
    new profile.
    """
    if pool not in sc.unplaceable:
        return []
    stale = outdated(sc.state, *pool)
    active = sc.state.active_replicas(*pool)
    if not stale or len(active) != sc.state.desired_replicas(*pool):
        return []
    if not all(is_ready(sc.state, r) for r in active) or freeing(sc.state, pool.model):
        return []
    victim = stale[0]
    # A new profile that would not fit even in the victim's place (a selector no
    # node matches, more GPUs than a node has) must not cost a serving replica.
    trial = sc.state.copy()
    for sid in victim.shard_ids:
        if sid in trial.shards:
            trial.shards[sid].state = c.ShardState.STOPPED
    rid = next_replica_id(trial, *pool)
    tried = placement.place(trial, pool.model, rid, sc.base.last_seq, role=pool.role)
    if isinstance(tried, c.PlacementFailed):
        return []
    reason = (
        f"rolling update: profile changed since {victim.replica_id} was placed; no room to surge"
    )
    return [_retire(sc, victim, reason)]


def _same_failure(old: c.PlacementFailed | None, new: c.PlacementFailed) -> bool:
    return (
        old is not None
        and old.model == new.model
        and old.verdicts == new.verdicts
        and old.verdict_groups == new.verdict_groups
    )


# A pool's turn in a plan: these steps, in this order. Retiring comes first, so what is
# placed replaces what this plan retired; adopting before placing takes back a shard a
# node still runs instead of starting one anew elsewhere. A step for LoRA adapters on the
# placed replicas would go last.
MODEL_STEPS: tuple[Step, ...] = (retire_broken, scale_down, roll_step, adopt, place, make_room)
# A scale-down ends the pool's turn: this plan only shrinks it, and whatever rolling is
# left waits for the next plan, which decides on the retirements folded.
ENDS_TURN: frozenset[Step] = frozenset({scale_down})


# ---------------------------------------------------------------- commands


def commands(
    state: ClusterState, *, skip: set[str] = frozenset(), timings: CommandTimings | None = None
) -> list[c.Message]:
    """Commands the state calls for, to alive nodes only, sorted by shard id."""
    t = timings or CommandTimings()
    out: list[c.Message] = []
    for sid in sorted(state.shards):
        shard = state.shards[sid]
        node = state.nodes.get(shard.node)
        if shard.terminal or sid in skip or node is None or node.liveness != Liveness.ALIVE:
            continue
        owner = state.replicas.get(shard.replica_id)
        owned = owner is not None and any(
            a.shard_id == sid and a.node == shard.node for a in owner.assignments
        )
        if owned and not owner.retired:
            if shard.state == c.ShardState.PENDING:
                out.append(_start(state, owner, shard))
        elif shard.state == c.ShardState.READY and owned:
            # Drain before stop: requests in flight finish, routers see "draining".
            out.append(
                c.DrainShard(
                    key=command_key(sid, "drain"),
                    node=shard.node,
                    shard_id=sid,
                    deadline_seconds=t.drain_deadline,
                )
            )
        elif shard.state != c.ShardState.DRAINING:
            out.append(
                c.StopShard(
                    key=command_key(sid, "stop"),
                    node=shard.node,
                    shard_id=sid,
                    grace_seconds=t.stop_grace,
                )
            )
    return out


def _start(state: ClusterState, replica: ReplicaView, shard: ShardView) -> c.StartShard:
    decl = state.models.get(replica.model)
    profile = pool_profile(decl, replica.role) if decl is not None else c.ServingProfile()
    # A pool's engine gets the model's connector (as kv_producer or kv_consumer).
    pools = decl.disaggregation if decl is not None and replica.role else None
    nnodes = len(replica.assignments)
    master_addr, master_port = "", 0
    if nnodes > 1:
        rank0 = min(replica.assignments, key=lambda a: a.shard_index)
        head = state.nodes.get(rank0.node)
        master_addr = head.host.address if head is not None else ""
        span = zlib.crc32(replica.replica_id.encode()) % MASTER_PORT_SPAN
        master_port = MASTER_PORT_BASE + span
    return c.StartShard(
        key=command_key(shard.shard_id, "start"),
        node=shard.node,
        shard_id=shard.shard_id,
        model=replica.model,
        replica_id=replica.replica_id,
        shard_index=shard.shard_index,
        profile=profile,
        gpus=list(shard.gpus),
        served_model_name=replica.model,
        role=replica.role,
        connector=pools.connector if pools is not None else None,
        nnodes=nnodes,
        node_rank=shard.shard_index,
        master_addr=master_addr,
        master_port=master_port,
    )
