"""Audit replay: re-fold the log and ask whether today's code decides the same.

`replay(events)` is a pure function over the log as (seq, event) pairs. It
folds every event into a scratch ClusterState and, at each recorded placement
decision or failure, re-runs placement on the state *as it was at the
decision's `based_on_seq`* with the current code, then compares the recorded
answer with the re-derived one.

"As it was" includes the earlier events of the same plan: the reconciler
decides several replicas on one state and applies each decision to a scratch
copy before the next (so two placements never take one GPU). Replay keeps a
snapshot per base sequence and applies the recorded events of that plan to it
in log order, reproducing exactly what the reconciler saw.

A decision *differs* when the outcome (placed or not), the assignments (node
and GPUs per shard), or which nodes fit changed. A change in the wording of a
verdict alone is reported as wording, and counts only with `strict`. In a
large fleet a decision lists some nodes and counts the others in groups
(verdicts.py): which nodes are listed, and each group's fit, size and example
nodes, are part of the decision; a group's words are wording. An event that
lists every node (recorded before groups existed) is re-derived the same way,
so old logs replay node by node. Adopted
replicas are not re-placed: replay checks that each adopted shard was indeed
running, ready and unowned on its node at the base sequence.

Each autoscaling decision (ModelScaled) is checked against the rule on the
state just before it: the count it started from, the rule and count its
recorded signals call for, how long the condition had held, and the cool-down
since the model's previous decision (autoscale.check); a pool's decision (its
role set) against its pool's spec, count and previous decision.

Each adapter placement (AdaptersPlaced) is placed again on the state as it was at its
`based_on_seq` (a snapshot of its own: another controller's events of the same base
are not in it) with the demand and waiting adapters it recorded, at its own time, and
the holdings compared (lora.placement.check). Only a decision of the rule this code runs
is re-derived (its `policy`, the rule's version): one of another version is reported as
not re-derivable and counted apart, since today's rule deciding otherwise says nothing
about whether it was right. It fails the replay only with `strict`.

`inputs_at(events, seq)` returns the snapshot one decision was based on, for
`llmgw audit replay --explain SEQ`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from llmgw import contracts as c
from llmgw.reconciler.controllers.autoscale import rule as autoscale
from llmgw.reconciler.controllers.lora import placement as adapter_placement
from llmgw.reconciler.controllers.replicas import placement, verdicts
from llmgw.reconciler.state import fold, queries
from llmgw.reconciler.state.ids import parse_replica_id, replica_token
from llmgw.reconciler.state.model import ClusterState, pool_profile
from llmgw.reconciler.state.wording import clock_text, gib
from llmgw.verdicttext import group_line

Decision = c.PlacementDecided | c.PlacementFailed
# (state, model, replica id, based_on_seq, keep_all=, role=): placement.place's signature.
Placer = Callable[..., Decision]
PLAN_EVENTS = (c.PlacementDecided, c.PlacementFailed, c.ReplicaRetired)


@dataclass
class Check:
    seq: int
    recorded: Decision
    derived: Decision | None  # None for adopted replicas (checked, not re-placed)
    differences: list[str] = field(default_factory=list)
    wording: list[str] = field(default_factory=list)

    def differs(self, strict: bool = False) -> bool:
        return bool(self.differences or (strict and self.wording))


@dataclass
class ScaleCheck:
    """An autoscaling decision against the rule, on the state just before it."""

    seq: int
    recorded: c.ModelScaled
    differences: list[str] = field(default_factory=list)

    def differs(self, strict: bool = False) -> bool:
        return bool(self.differences)


@dataclass
class AdapterCheck:
    """An adapter placement against the policy, on the state at its base sequence."""

    seq: int
    recorded: c.AdaptersPlaced
    differences: list[str] = field(default_factory=list)

    @property
    def derivable(self) -> bool:
        """Decided by the rule this code runs. One of another version is not re-derived:
        today's rule would report it as different though nothing was wrong with it."""
        return self.recorded.policy == adapter_placement.POLICY

    def differs(self, strict: bool = False) -> bool:
        return bool(self.differences) or (strict and not self.derivable)


@dataclass
class ReplayResult:
    events: int = 0
    last_seq: int = 0
    checks: list[Check] = field(default_factory=list)
    scaling: list[ScaleCheck] = field(default_factory=list)
    adapters: list[AdapterCheck] = field(default_factory=list)
    state: ClusterState = field(default_factory=ClusterState)

    def differing(self, strict: bool = False) -> list[Check | ScaleCheck | AdapterCheck]:
        return [ch for ch in [*self.checks, *self.scaling, *self.adapters] if ch.differs(strict)]


def _default_placer(
    state: ClusterState, model: str, rid: str, base: int, *, keep_all: bool = False, role: str = ""
) -> Decision:
    return placement.place(state, model, rid, base, keep_all=keep_all, role=role)


def outcome(d: Decision | None) -> str:
    """One line: where a decision put the replica, or that it could not."""
    if d is None:
        return "-"
    if isinstance(d, c.PlacementFailed):
        fit, nodes = verdicts.node_count(d)
        return f"not placed ({fit} of {nodes} nodes fit)"
    where = " ".join(f"{a.node}[{','.join(a.gpus)}]" for a in d.assignments)
    return ("adopted " if d.adopted else "placed on ") + where


def compare(recorded: Decision, derived: Decision) -> tuple[list[str], list[str]]:
    """(differences in the decision, differences in wording only)."""
    diffs: list[str] = []
    if recorded.role != derived.role:
        diffs.append(f"role: recorded {_pool(recorded.role)}, now {_pool(derived.role)}")
    if type(recorded) is not type(derived):
        diffs.append(f"outcome: recorded {outcome(recorded)}, now {outcome(derived)}")
    elif isinstance(recorded, c.PlacementDecided):
        old = [(a.shard_index, a.node, a.gpus) for a in recorded.assignments]
        new = [(a.shard_index, a.node, a.gpus) for a in derived.assignments]
        if old != new:
            diffs.append(f"assignments: recorded {outcome(recorded)}, now {outcome(derived)}")
    before = {v.node: v for v in recorded.verdicts}
    after = {v.node: v for v in derived.verdicts}
    wording: list[str] = []
    grouped = bool(recorded.verdict_groups or derived.verdict_groups)
    for node in sorted(set(before) | set(after)):
        b, a = before.get(node), after.get(node)
        if b is None or a is None:
            # With groups, a node listed on one side only is counted in a group on the other.
            missing = "only counted in a group" if grouped else "not considered"
            was = f'"{b.reason}"' if b is not None else missing
            now = f'"{a.reason}"' if a is not None else missing
            diffs.append(f"{node}: recorded {was}, now {now}")
        elif b.fits != a.fits:
            diffs.append(f'{node}: recorded "{b.reason}", now "{a.reason}"')
        elif b.reason != a.reason:
            wording.append(f'{node}: recorded "{b.reason}", now "{a.reason}"')
    group_diffs, group_wording = _compare_groups(recorded.verdict_groups, derived.verdict_groups)
    return diffs + group_diffs, wording + group_wording


def _pool(role: str) -> str:
    return f"the {role} pool" if role else "aggregated"


def _compare_groups(
    recorded: list[c.VerdictGroup], derived: list[c.VerdictGroup]
) -> tuple[list[str], list[str]]:
    """Groups are matched by their first node: a node is in one group only, so a group
    whose members are unchanged keeps its first node, whatever its words say."""
    before = {g.nodes[0]: g for g in recorded if g.nodes}
    after = {g.nodes[0]: g for g in derived if g.nodes}
    diffs: list[str] = []
    wording: list[str] = []
    for first in sorted(set(before) | set(after)):
        b, a = before.get(first), after.get(first)
        if b is None or a is None:
            side = "recorded" if a is None else "now"
            diffs.append(f"group {side} only: {group_line(b or a)}")
        elif (b.fits, b.count, b.nodes) != (a.fits, a.count, a.nodes):
            diffs.append(f"group: recorded {group_line(b)}, now {group_line(a)}")
        elif b.digest != a.digest:
            diffs.append(f"group: same size, other members now: {group_line(a)}")
        elif (b.kind, b.reason, b.same) != (a.kind, a.reason, a.same):
            wording.append(f"group: recorded {group_line(b)}, now {group_line(a)}")
    return diffs, wording


def _check_adoption(snapshot: ClusterState, ev: c.PlacementDecided) -> list[str]:
    if ev.model not in snapshot.models:
        return [f"adoption: model {ev.model} was not declared"]
    candidates = {s.shard_id: s for s in queries.adoptable(snapshot, ev.model, ev.role)}
    out = []
    for a in ev.assignments:
        shard = candidates.get(a.shard_id)
        if shard is None or shard.node != a.node:
            out.append(f"adoption: {a.shard_id} was not a ready, unowned shard on {a.node}")
    return out


class _Snapshots:
    """State copies at the base sequences later decisions refer to, freed after last use."""

    def __init__(
        self, events: Sequence[tuple[int, c.Message]], kinds: tuple[type, ...] = PLAN_EVENTS
    ):
        last_use: dict[int, int] = {}
        for seq, ev in events:
            if isinstance(ev, kinds):
                last_use[ev.based_on_seq] = seq
        self.bases = sorted(last_use)
        self.last_use = last_use
        self.taken: dict[int, ClusterState] = {}
        self._next = 0

    def before(self, seq: int, state: ClusterState) -> None:
        """Called before folding `seq`: snapshot every base now behind us."""
        while self._next < len(self.bases) and self.bases[self._next] < seq:
            base = self.bases[self._next]
            self.taken[base] = state.copy()
            self._next += 1

    def done(self, seq: int) -> None:
        for base in [b for b, last in self.last_use.items() if last == seq]:
            self.taken.pop(base, None)
            del self.last_use[base]


def replay(
    events: Iterable[tuple[int, c.Message]],
    *,
    from_seq: int = 0,
    to_seq: int | None = None,
    placer: Placer = _default_placer,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Fold `events` (in seq order) and check each decision recorded in [from_seq, to_seq]."""
    log = [(seq, ev) for seq, ev in events if to_seq is None or seq <= to_seq]
    snaps = _Snapshots(log)
    adapter_bases = _Snapshots(log, (c.AdaptersPlaced,))
    result = ReplayResult()
    for seq, ev in log:
        snaps.before(seq, result.state)
        adapter_bases.before(seq, result.state)
        if isinstance(ev, PLAN_EVENTS) and ev.based_on_seq in snaps.taken:
            snapshot = snaps.taken[ev.based_on_seq]
            if isinstance(ev, (c.PlacementDecided, c.PlacementFailed)) and seq >= from_seq:
                result.checks.append(_check(seq, ev, snapshot, placer))
            fold.apply(snapshot, seq, ev)  # the next decision of the same plan sees it
        if isinstance(ev, c.ModelScaled) and seq >= from_seq:
            # The rule re-derived from the signals the event recorded, on the count
            # and the previous decision the log held just before it.
            result.scaling.append(ScaleCheck(seq, ev, autoscale.check(result.state, ev)))
        if isinstance(ev, c.AdaptersPlaced) and seq >= from_seq:
            base = adapter_bases.taken.get(ev.based_on_seq, result.state)
            found = AdapterCheck(seq, ev)
            if found.derivable:
                found.differences = adapter_placement.check(base, ev)
            result.adapters.append(found)
        fold.apply(result.state, seq, ev)
        snaps.done(seq)
        adapter_bases.done(seq)
        result.events += 1
        result.last_seq = seq
        if progress is not None:
            progress(seq)
    return result


def _check_pool(snapshot: ClusterState, ev: Decision) -> list[str]:
    """The pool the event placed for was one the model had at its base sequence, and
    the replica id is that pool's: a decode replica recorded as aggregated (or the
    reverse) would be started without (or with) the KV connector."""
    pools = snapshot.pools(ev.model)
    out = []
    if ev.role not in pools:
        had = ", ".join(_pool(r) for r in pools)
        out.append(
            f"role: recorded {_pool(ev.role)}, but model {ev.model} had {had} at seq "
            f"{ev.based_on_seq}"
        )
    # Ids of logs from before pools are not all of the form: only a pool's token is checked.
    parsed = parse_replica_id(ev.replica_id)
    token = parsed[0] if parsed is not None else ""
    pool_tokens = {replica_token(ev.model, role) for role in c.PD_ROLES}
    want = replica_token(ev.model, ev.role)
    if (ev.role or token in pool_tokens) and token != want:
        out.append(f"replica id: {ev.replica_id} is not an id of {_pool(ev.role)} ({want}-r<n>)")
    return out


def _check(seq: int, ev: Decision, snapshot: ClusterState, placer: Placer) -> Check:
    pool = _check_pool(snapshot, ev) if ev.model in snapshot.models else []
    if isinstance(ev, c.PlacementDecided) and ev.adopted:
        return Check(seq, ev, None, pool + _check_adoption(snapshot, ev))
    if ev.model not in snapshot.models:
        return Check(seq, ev, None, [f"model {ev.model} was not declared at seq {ev.based_on_seq}"])
    # Derived in the recorded form: an event that lists every node is compared node by node.
    keep_all = not ev.verdict_groups
    # The role is the pool the recorded event says it placed for: placed with that pool's
    # profile now, and a role the pool could not have (a model not disaggregated then)
    # shows as a difference in the node verdicts or the outcome.
    derived = placer(
        snapshot, ev.model, ev.replica_id, ev.based_on_seq, keep_all=keep_all, role=ev.role
    )
    diffs, wording = compare(ev, derived)
    return Check(seq, ev, derived, pool + diffs, wording)


@dataclass
class Inputs:
    """What one decision was based on."""

    seq: int
    recorded: Decision
    state: ClusterState  # as of based_on_seq, plus earlier events of the same plan
    derived: Decision | None


def inputs_at(events: Iterable[tuple[int, c.Message]], seq: int) -> Inputs:
    log = [(s, ev) for s, ev in events if s <= seq]
    if not log or log[-1][0] != seq:
        raise LookupError(f"no event at seq {seq}")
    target = log[-1][1]
    if not isinstance(target, (c.PlacementDecided, c.PlacementFailed)):
        raise LookupError(f"seq {seq} is a {c.type_tag(type(target))} event, not a placement")
    result = replay(log, from_seq=seq, to_seq=seq)
    check = result.checks[-1] if result.checks else None
    # Rebuild the snapshot the check used: fold to the base, then the plan's earlier events.
    state = ClusterState()
    seqs = [s for s, _ in log]
    cut = bisect.bisect_right(seqs, target.based_on_seq)
    for s, ev in log[:cut]:
        fold.apply(state, s, ev)
    for s, ev in log[cut:-1]:
        if isinstance(ev, PLAN_EVENTS) and ev.based_on_seq == target.based_on_seq:
            fold.apply(state, s, ev)
    return Inputs(seq, target, state, check.derived if check else None)


# ---------------------------------------------------------------- rendering


def render(result: ReplayResult, *, strict: bool = False, verbose: bool = False) -> list[str]:
    lines = []
    for ch in result.checks:
        differs = ch.differs(strict)
        if not (differs or verbose or ch.wording):
            continue
        mark = "DIFFERS" if differs else ("wording" if ch.wording else "same")
        rec = ch.recorded
        lines.append(f"seq {ch.seq} {rec.replica_id} (based on seq {rec.based_on_seq}): {mark}")
        lines.append(f"    recorded:   {outcome(rec)}")
        if ch.derived is not None:
            lines.append(f"    re-derived: {outcome(ch.derived)}")
        for d in ch.differences:
            lines.append(f"    ! {d}")
        for w in ch.wording:
            lines.append(f"    ~ {w}")
    for sc in result.scaling:
        if not (sc.differences or verbose):
            continue
        rec = sc.recorded
        mark = "DIFFERS" if sc.differences else "same"
        what = f"{rec.model} {rec.role} pool" if rec.role else rec.model
        lines.append(f"seq {sc.seq} {what} scaled {rec.from_replicas} → {rec.to_replicas}: {mark}")
        lines.append(f"    recorded:   {rec.explanation or rec.rule}")
        for d in sc.differences:
            lines.append(f"    ! {d}")
    lines += _render_adapters(result.adapters, verbose)
    bad = sum(ch.differs(strict) for ch in result.checks)
    if result.scaling:
        scaled_bad = sum(sc.differs() for sc in result.scaling)
        lines.append(
            f"{len(result.scaling)} scaling decision(s) checked against the rule, "
            f"{scaled_bad} differ"
        )
    lines.append(
        f"replayed {result.events} events up to seq {result.last_seq}; "
        f"{len(result.checks)} decisions checked, {bad} differ"
        + ("" if strict else f", {sum(bool(ch.wording) for ch in result.checks)} reworded")
    )
    return lines


def _render_adapters(checks: list[AdapterCheck], verbose: bool) -> list[str]:
    """Each adapter placement that differs (every one with `verbose`), each one of another
    rule's version, and a summary that counts those apart: they were not re-derived."""
    lines = []
    for ac in checks:
        if ac.derivable and not (ac.differences or verbose):
            continue
        rec = ac.recorded
        if not ac.derivable:
            mark = f"not re-derivable (policy v{rec.policy})"
        else:
            mark = "DIFFERS" if ac.differences else "same"
        lines.append(f"seq {ac.seq} {rec.model} adapters (based on seq {rec.based_on_seq}): {mark}")
        lines.append(f"    recorded:   {rec.explanation or 'no change explained'}")
        for d in ac.differences:
            lines.append(f"    ! {d}")
    if not checks:
        return lines
    derived = [ac for ac in checks if ac.derivable]
    others: dict[int, int] = {}
    for ac in checks:
        if not ac.derivable:
            others[ac.recorded.policy] = others.get(ac.recorded.policy, 0) + 1
    summary = (
        f"{len(derived)} adapter placement(s) re-derived, "
        f"{sum(ac.differs() for ac in derived)} differ"
    )
    if others:
        versions = ", ".join(f"{n} of policy v{v}" for v, n in sorted(others.items()))
        summary += (
            f"; {sum(others.values())} not re-derivable ({versions}; "
            f"this code runs v{adapter_placement.POLICY})"
        )
    return [*lines, summary]


def render_inputs(inp: Inputs) -> list[str]:
    st, rec = inp.state, inp.recorded
    decl = st.models.get(rec.model)
    kind = "decision" if isinstance(rec, c.PlacementDecided) else "failure to place"
    lines = [
        f"seq {inp.seq}: {kind} for {rec.replica_id} of {rec.model}, "
        f"based on seq {rec.based_on_seq} (recorded {_clock(rec.ts)})",
    ]
    if decl is not None:
        p = pool_profile(decl, rec.role)
        if rec.role:
            lines.append(f"pool: {rec.role}")
        lines.append(
            f"profile: engine {p.engine}, {p.gpus_per_shard} GPU(s) per shard x "
            f"{p.shards_per_replica} shard(s), min GPU memory {gib(p.min_gpu_memory_bytes)}, "
            f"selector {_labels(p.selector) or '-'}; {st.desired_replicas(rec.model, rec.role)} replica(s) wanted"
        )
    lines.append("nodes at that point:")
    busy_gpus = queries.busy_gpus(st)
    model_shards = queries.model_shards(st, rec.model)
    for name in sorted(st.nodes):
        n = st.nodes[name]
        busy = busy_gpus.get(name, set())
        free = sorted(g.uuid for g in n.gpus.values() if g.uuid not in busy)
        lines.append(
            f"  {name}: {n.liveness.value} since {clock_text(n.liveness_since)}; "
            f"engines {','.join(sorted(n.engines)) or '-'}; labels {_labels(n.labels) or '-'}; "
            f"{len(free)}/{len(n.gpus)} GPUs free {free}; "
            f"{model_shards.get(name, 0)} shard(s) of {rec.model}"
        )
    lines.append("recorded verdicts:")
    lines += [f"  {v.node}: {v.reason}" for v in rec.verdicts]
    lines += [f"  {group_line(g)}" for g in rec.verdict_groups]
    lines.append(f"recorded:   {outcome(rec)}")
    if inp.derived is not None:
        lines.append(f"re-derived: {outcome(inp.derived)}")
        diffs, wording = compare(rec, inp.derived)
        lines += [f"  ! {d}" for d in diffs] + [f"  ~ {w}" for w in wording]
    return lines


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
