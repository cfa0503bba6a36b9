"""Placement: where one replica of a model runs, or why it cannot run anywhere.

`place(state, model, replica_id, based_on_seq)` is a pure, deterministic
function of the folded state: no I/O, no clock, no randomness; every
collection is sorted before it is used. Its answer is an event
(PlacementDecided or PlacementFailed) carrying a verdict per registered node
in words an operator reads, so the log alone explains every decision and
`llmgw audit replay` can re-derive it. In a large fleet the event lists the
chosen and best-ranked nodes and counts the others by kind of reason
(verdicts.py), so it stays small whatever the fleet size.

A node can take a shard of the replica when, in this order of checks:
  1. it is alive (not unreachable, not lost);
  2. it runs the profile's engine;
  3. its labels match every selector key of the profile;
  4. it has `gpus_per_shard` free GPUs (not held by a non-finished shard) with
     at least `min_gpu_memory_bytes` each;
  5. for a multi-node replica (`shards_per_replica` > 1): it carries a fabric
     label, and enough fitting nodes share that fabric value.

Ranking among the nodes that fit (the packing rule):
  1. fewest shards of this model already on the node (spread a model's
     replicas, so one node going down takes as few of them as possible);
  2. fewest free fitting GPUs (best fit: fill the fullest node that still fits,
     keeping whole nodes free for wide tensor-parallel shards);
  3. node id.
A multi-node replica takes one shard per node from a single fabric group: the
group whose best nodes give the lowest (shards of this model, free GPUs) sum,
then the lowest fabric value; shard 0 (the rank that serves HTTP) goes to the
best-ranked node.

Within a node, GPUs are taken NVLink-connected first where the inventory says
so, then by lowest index.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import dataclass, field

from llmgw import contracts as c

from . import verdicts
from .state import ClusterState, Liveness, NodeView, shard_id

FABRIC_LABEL = "fabric"

PACKING_RULE = (
    "fewest shards of the model on the node, then fewest free GPUs that fit (best fit), "
    "then node id"
)


def event_id(*parts: object) -> str:
    """A deterministic message id: a decision re-published (even by a new leader) dedupes."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:32]


def clock_text(ts: float) -> str:
    """A time for an explanation; UTC so replay on any machine prints the same words."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(ts))


def gib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(slots=True)
class Fit:
    """One node's answer for one replica: the verdict plus what ranking needs."""

    node: str
    fits: bool
    reason: str
    # What this reason has in common with other nodes' (no per-node numbers or times):
    # the group a large fleet counts the node in instead of listing it.
    kind: str
    free: list[c.GpuInfo] = field(default_factory=list)  # the GPUs that fit, unordered
    model_shards: int = 0
    fabric: str | None = None

    @property
    def rank(self) -> tuple[int, int, str]:
        return (self.model_shards, len(self.free), self.node)


class Usage:
    """Per-node GPU use and per-node shard count of one model, in one pass over shards."""

    def __init__(self, state: ClusterState, model: str):
        self.busy: dict[str, set[str]] = {}
        self.model_shards: dict[str, int] = {}
        for shard in state.shards.values():
            if shard.terminal:
                continue
            self.busy.setdefault(shard.node, set()).update(shard.gpus)
            if shard.model == model:
                replica = state.replicas.get(shard.replica_id)
                if replica is None or not replica.retired:
                    self.model_shards[shard.node] = self.model_shards.get(shard.node, 0) + 1


def _take(eligible: list[c.GpuInfo], want: int) -> list[str]:
    """The `want` GPUs to take: an NVLink-connected set if there is one, else lowest index.

    Computed for chosen nodes only: ranking needs just the count.
    """
    by_index = sorted(eligible, key=lambda g: (g.index, g.uuid))
    if want > 1:
        for seed in by_index:
            linked = [
                g.uuid
                for g in by_index
                if g.uuid != seed.uuid
                and (g.uuid in seed.nvlink_peers or seed.topology.get(g.uuid, "").startswith("NV"))
            ]
            if len(linked) + 1 >= want:
                return [seed.uuid, *linked[: want - 1]]
    return [g.uuid for g in by_index[:want]]


def _too_few(need: int, what: str = "") -> str:
    return f"no free GPU{what}" if need == 1 else f"fewer than {need} free GPUs{what}"


def _node_fit(node: NodeView, profile: c.ServingProfile, usage: Usage) -> Fit:
    name = node.node
    if node.liveness != Liveness.ALIVE:
        since = f"{node.liveness.value} since {clock_text(node.liveness_since)}"
        return Fit(name, False, since, node.liveness.value)
    if profile.engine not in node.engines:
        runs = ", ".join(sorted(node.engines)) or "none"
        kind = f"does not run engine {profile.engine}"
        return Fit(name, False, f"{kind} (runs {runs})", kind)
    for key in sorted(profile.selector):
        want = profile.selector[key]
        have = node.labels.get(key)
        if have is None:
            missing = f"has no label {key}, needs {key}={want}"
            return Fit(name, False, missing, missing)
        if have != want:
            kind = f"label {key} does not match {key}={want}"
            return Fit(name, False, f"label {key}={have} does not match {key}={want}", kind)
    busy = usage.busy.get(name, set())
    free = [g for g in node.gpus.values() if g.uuid not in busy]
    big = [g for g in free if g.memory_bytes >= profile.min_gpu_memory_bytes]
    need = profile.gpus_per_shard
    if len(big) < need:
        total = len(node.gpus)
        if len(big) < len(free):
            memory = f"at least {gib(profile.min_gpu_memory_bytes)}"
            return Fit(
                name,
                False,
                f"{plural(len(free), 'free GPU')} of {total}, {len(big)} with {memory}, "
                f"needs {need}",
                _too_few(need, f" with {memory}"),
            )
        why = f"{plural(len(free), 'free GPU')} of {total}, needs {need}"
        return Fit(name, False, why, _too_few(need))
    shards_here = usage.model_shards.get(name, 0)
    return Fit(
        name,
        True,
        f"fits: {plural(len(big), 'free GPU')}, {plural(shards_here, 'shard')} of this model",
        "fits, ranked below the nodes listed",
        free=big,
        model_shards=shards_here,
        fabric=node.labels.get(FABRIC_LABEL),
    )


def _requirements(model: c.ModelDeclared) -> str:
    p = model.profile
    parts = [f"{plural(p.gpus_per_shard, 'GPU')} per shard", f"engine {p.engine}"]
    if p.shards_per_replica > 1:
        parts.insert(0, f"{p.shards_per_replica} shards on nodes sharing a {FABRIC_LABEL} label")
    if p.min_gpu_memory_bytes:
        parts.append(f"at least {gib(p.min_gpu_memory_bytes)} per GPU")
    for key in sorted(p.selector):
        parts.append(f"{key}={p.selector[key]}")
    return ", ".join(parts)


def place(
    state: ClusterState,
    model: str,
    replica_id: str,
    based_on_seq: int,
    *,
    ts: float = 0.0,
    keep_all: bool = False,
) -> c.PlacementDecided | c.PlacementFailed:
    """Place one replica of `model` on `state`; `ts` only stamps the event envelope.

    `keep_all` lists every node's verdict however large the fleet (replay of an
    event recorded that way); otherwise a large fleet's verdicts are summarised.
    """
    decl = state.models[model]
    profile = decl.profile
    usage = Usage(state, model)
    fits = [_node_fit(state.nodes[n], profile, usage) for n in sorted(state.nodes)]
    width = profile.shards_per_replica
    chosen, why = _multi_node(fits, width) if width > 1 else ([], "no node fits")
    # After _multi_node: a node that cannot join a fabric group no longer fits.
    best = heapq.nsmallest(verdicts.KEEP_BEST, (f for f in fits if f.fits), key=lambda f: f.rank)
    if width == 1 and best:
        chosen, why = best[:1], ""
    listed = {f.node for f in chosen + best}

    fitting = sum(f.fits for f in fits)
    considered = f"{fitting} of {plural(len(fits), 'node')} fit"
    if not chosen:
        reason = why if fits else "no nodes are registered"
        shown, groups = verdicts.summarise(fits, listed, keep_all=keep_all)
        return c.PlacementFailed(
            id=event_id("failed", replica_id, based_on_seq),
            ts=ts,
            model=model,
            replica_id=replica_id,
            based_on_seq=based_on_seq,
            verdicts=shown,
            verdict_groups=groups,
            explanation=f"{replica_id} cannot be placed: {reason} "
            f"(needs {_requirements(decl)}; {considered})",
        )

    need = profile.gpus_per_shard
    taken = {f.node: (i, _take(f.free, need)) for i, f in enumerate(chosen)}
    assignments = [
        c.ShardAssignment(shard_id=shard_id(replica_id, i), shard_index=i, node=node, gpus=gpus)
        for node, (i, gpus) in taken.items()
    ]
    for f in chosen:
        i, gpus = taken[f.node]
        f.reason = f"chosen for shard {i} ({','.join(gpus)}); {f.reason}"
    shown, groups = verdicts.summarise(fits, listed, keep_all=keep_all)
    where = ", ".join(f"{a.node} ({','.join(a.gpus)})" for a in assignments)
    return c.PlacementDecided(
        id=event_id("decided", replica_id),
        ts=ts,
        model=model,
        replica_id=replica_id,
        based_on_seq=based_on_seq,
        assignments=assignments,
        verdicts=shown,
        verdict_groups=groups,
        explanation=f"{replica_id} placed on {where}; {considered}; ranked by {PACKING_RULE}",
    )


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def _multi_node(fits: list[Fit], width: int) -> tuple[list[Fit], str]:
    """The best `width` fitting nodes of one fabric group, or why there are none.

    A node that fits alone but cannot join a large enough group gets fits=False
    and a reason saying so: for this replica it cannot host a shard.
    """
    groups: dict[str, list[Fit]] = {}
    for f in fits:
        if not f.fits:
            continue
        if f.fabric is None:
            f.fits = False
            f.reason = f.kind = f"has no {FABRIC_LABEL} label, a {width}-node replica needs one"
            continue
        groups.setdefault(f.fabric, []).append(f)
    best: tuple[tuple[int, int, str], list[Fit]] | None = None
    for fabric in sorted(groups):
        members = sorted(groups[fabric], key=lambda f: f.rank)
        if len(members) < width:
            for f in members:
                f.fits = False
                f.reason = (
                    f"{f.reason.removeprefix('fits: ')}, but {FABRIC_LABEL}={fabric} has "
                    f"{plural(len(members), 'fitting node')}, needs {width}"
                )
                f.kind = (
                    f"fits alone, but fewer than {width} fitting nodes share its "
                    f"{FABRIC_LABEL} label"
                )
            continue
        pick = members[:width]
        key = (sum(f.model_shards for f in pick), sum(len(f.free) for f in pick), fabric)
        if best is None or key < best[0]:
            best = (key, pick)
    if best is not None:
        return best[1], ""
    count = _WORDS.get(width, str(width))
    return [], f"no {count} fitting nodes share a {FABRIC_LABEL} label"
