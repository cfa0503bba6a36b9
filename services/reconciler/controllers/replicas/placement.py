"""Placement: where one replica of a model runs, or why it cannot run anywhere.

`place(state, model, replica_id, based_on_seq)` is a pure, deterministic
function of the folded state: no I/O, no clock, no randomness; every
collection is sorted before it is used. Its answer is an event
(PlacementDecided or PlacementFailed) carrying a verdict per registered node
in words an operator reads, so the log alone explains every decision and
`llmgw audit replay` can re-derive it. In a large fleet the event lists the
chosen and best-ranked nodes and counts the others by kind of reason
(verdicts.py), so it stays small whatever the fleet size.

A replica's nodes are chosen as the router chooses an endpoint: named filters
in order, then one ranking step. The filters (each rejects a node with a
verdict whose kind is its own test, see verdicts.py):
  1. alive: not unreachable, not lost;
  2. engine: it runs the profile's engine;
  3. selector: its labels match every selector key of the profile;
  4. free_gpus: it has `gpus_per_shard` free GPUs (not held by a non-finished
     shard, see queries.busy_gpus) with at least `min_gpu_memory_bytes` each;
  5. fabric, for a multi-node replica (`shards_per_replica` > 1) only: it
     carries a fabric label, and enough nodes that passed 1-4 share its value.

Ranking among the nodes left (the packing rule):
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

import heapq
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import verdicts
from llmgw.reconciler.state import queries
from llmgw.reconciler.state.ids import event_id, shard_id
from llmgw.reconciler.state.model import ClusterState, Liveness, NodeView, pool_profile
from llmgw.reconciler.state.wording import clock_text, gib, plural

FABRIC_LABEL = "fabric"

PACKING_RULE = (
    "fewest shards of the model on the node, then fewest free GPUs that fit (best fit), "
    "then node id"
)


@dataclass(slots=True)
class Fit:
    """One node's answer for one replica: the verdict plus what ranking needs."""

    node: str
    view: NodeView = field(repr=False)
    fits: bool = True
    reason: str = ""
    # What this reason has in common with other nodes' (no per-node numbers or times):
    # the group a large fleet counts the node in instead of listing it.
    kind: str = ""
    free: list[c.GpuInfo] = field(default_factory=list)  # the GPUs that fit, unordered
    model_shards: int = 0
    fabric: str | None = None

    @property
    def rank(self) -> tuple[int, int, str]:
        return (self.model_shards, len(self.free), self.node)

    def reject(self, reason: str, kind: str) -> None:
        self.fits, self.reason, self.kind = False, reason, kind


class Need:
    """What one replica asks of every node, and the GPU use it is judged against."""

    __slots__ = ("profile", "width", "busy", "model_shards")

    def __init__(self, state: ClusterState, model: str, role: str = ""):
        self.profile = pool_profile(state.models[model], role)
        self.width = self.profile.shards_per_replica
        self.busy = queries.busy_gpus(state)
        self.model_shards = queries.model_shards(state, model)


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


# ------------------------------------------------------------------ node filters
#
# Each filter passes the candidates that may host a shard and rejects the others
# with a verdict: the reason in words, and its kind, which names the filter's
# test without per-node numbers (verdicts.py groups a large fleet's nodes by it).
# They run in order; a node's verdict is the first filter that rejects it.


class NodeFilter(Protocol):
    name: ClassVar[str]

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        """The candidates that pass; every other one is rejected (`Fit.reject`)."""


class Alive:
    """Not unreachable, not lost. Kinds: "unreachable", "lost"."""

    name = "alive"

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        out = []
        for f in cands:
            node = f.view
            if node.liveness == Liveness.ALIVE:
                out.append(f)
            else:
                since = f"{node.liveness.value} since {clock_text(node.liveness_since)}"
                f.reject(since, node.liveness.value)
        return out


class Engine:
    """Runs the profile's engine. Kind: "does not run engine <engine>"."""

    name = "engine"

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        engine = need.profile.engine
        kind = f"does not run engine {engine}"
        out = []
        for f in cands:
            if engine in f.view.engines:
                out.append(f)
            else:
                f.reject(f"{kind} (runs {', '.join(sorted(f.view.engines)) or 'none'})", kind)
        return out


class Selector:
    """Carries every label of the profile's selector, with its value, checked in key order.
    Kinds: "has no label <k>, needs <k>=<v>", "label <k> does not match <k>=<v>"."""

    name = "selector"

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        selector = need.profile.selector
        if not selector:
            return cands
        keys = sorted(selector)
        out = []
        for f in cands:
            labels = f.view.labels
            for key in keys:
                want = selector[key]
                have = labels.get(key)
                if have is None:
                    missing = f"has no label {key}, needs {key}={want}"
                    f.reject(missing, missing)
                    break
                if have != want:
                    f.reject(
                        f"label {key}={have} does not match {key}={want}",
                        f"label {key} does not match {key}={want}",
                    )
                    break
            else:
                out.append(f)
        return out


def _too_few(need: int, what: str = "") -> str:
    return f"no free GPU{what}" if need == 1 else f"fewer than {need} free GPUs{what}"


class FreeGpus:
    """Has `gpus_per_shard` GPUs no unfinished shard holds, each with at least
    `min_gpu_memory_bytes`; a passing node keeps them (`Fit.free`). Kinds: "no free
    GPU", "fewer than <n> free GPUs", each with " with at least <m> GiB" when memory
    is what is short."""

    name = "free_gpus"

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        profile = need.profile
        want = profile.gpus_per_shard
        floor = profile.min_gpu_memory_bytes
        out = []
        for f in cands:
            node = f.view
            busy = need.busy.get(f.node, ())
            free = [g for g in node.gpus.values() if g.uuid not in busy]
            big = [g for g in free if g.memory_bytes >= floor]
            if len(big) >= want:
                f.free = big
                out.append(f)
                continue
            total = len(node.gpus)
            if len(big) < len(free):
                memory = f"at least {gib(floor)}"
                f.reject(
                    f"{plural(len(free), 'free GPU')} of {total}, {len(big)} with {memory}, "
                    f"needs {want}",
                    _too_few(want, f" with {memory}"),
                )
            else:
                f.reject(
                    f"{plural(len(free), 'free GPU')} of {total}, needs {want}", _too_few(want)
                )
        return out


FITS_KIND = "fits, ranked below the nodes listed"


def _fits(cands: list[Fit], need: Need) -> None:
    """The verdict of a node every per-node filter passed."""
    for f in cands:
        f.model_shards = here = need.model_shards.get(f.node, 0)
        f.fabric = f.view.labels.get(FABRIC_LABEL)
        f.reason = f"fits: {plural(len(f.free), 'free GPU')}, {plural(here, 'shard')} of this model"
        f.kind = FITS_KIND


class Fabric:
    """For a multi-node replica only: carries a fabric label, and enough nodes that
    passed every other filter share its value. Kinds: "has no fabric label, a <n>-node
    replica needs one", "fits alone, but fewer than <n> fitting nodes share its fabric
    label"."""

    name = "fabric"

    def select(self, cands: list[Fit], need: Need) -> list[Fit]:
        width = need.width
        if width <= 1:
            return cands
        groups: dict[str, list[Fit]] = {}
        for f in cands:
            if f.fabric is None:
                no_label = f"has no {FABRIC_LABEL} label, a {width}-node replica needs one"
                f.reject(no_label, no_label)
            else:
                groups.setdefault(f.fabric, []).append(f)
        kind = f"fits alone, but fewer than {width} fitting nodes share its {FABRIC_LABEL} label"
        out = []
        for fabric, members in groups.items():
            if len(members) >= width:
                out += members
                continue
            for f in members:
                f.reject(
                    f"{f.reason.removeprefix('fits: ')}, but {FABRIC_LABEL}={fabric} has "
                    f"{plural(len(members), 'fitting node')}, needs {width}",
                    kind,
                )
        return out


# Applied in this order; `_fits` gives the verdict of the nodes left before Fabric.
NODE_FILTERS: tuple[NodeFilter, ...] = (Alive(), Engine(), Selector(), FreeGpus())
GROUP_FILTERS: tuple[NodeFilter, ...] = (Fabric(),)


def fit_nodes(state: ClusterState, model: str, role: str = "") -> tuple[list[Fit], list[Fit]]:
    """(a verdict per registered node in node-id order, the nodes that fit in that order)
    for a replica of `model`'s pool `role` ("": aggregated)."""
    need = Need(state, model, role)
    fits = [Fit(name, state.nodes[name]) for name in sorted(state.nodes)]
    cands = fits
    for f in NODE_FILTERS:
        cands = f.select(cands, need)
    _fits(cands, need)
    for f in GROUP_FILTERS:
        cands = f.select(cands, need)
    return fits, cands


# ------------------------------------------------------------------ ranking


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def rank(cands: list[Fit], width: int) -> tuple[list[Fit], list[Fit], str]:
    """(the nodes chosen, one per shard; the best-ranked nodes a large fleet lists; why
    none are chosen) by the packing rule, among the nodes that fit.

    A multi-node replica takes the best `width` nodes of one fabric group: the group
    whose best nodes give the lowest (shards of this model, free GPUs) sum, then the
    lowest fabric value.
    """
    best = heapq.nsmallest(verdicts.KEEP_BEST, cands, key=lambda f: f.rank)
    if width == 1:
        return best[:1], best, "" if best else "no node fits"
    groups: dict[str, list[Fit]] = {}
    for f in cands:
        groups.setdefault(f.fabric or "", []).append(f)  # Fabric let only labelled nodes by
    top: tuple[tuple[int, int, str], list[Fit]] | None = None
    for fabric in sorted(groups):
        pick = sorted(groups[fabric], key=lambda f: f.rank)[:width]
        key = (sum(f.model_shards for f in pick), sum(len(f.free) for f in pick), fabric)
        if top is None or key < top[0]:
            top = (key, pick)
    if top is not None:
        return top[1], best, ""
    count = _WORDS.get(width, str(width))
    return [], best, f"no {count} fitting nodes share a {FABRIC_LABEL} label"


def _requirements(p: c.ServingProfile) -> str:
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
    role: str = "",
) -> c.PlacementDecided | c.PlacementFailed:
    """Place one replica of `model` on `state`; `ts` only stamps the event envelope.

    `keep_all` lists every node's verdict however large the fleet (replay of an
    event recorded that way); otherwise a large fleet's verdicts are summarised.
    `role` places a replica of a disaggregated model's pool (prefill | decode), with
    the pool's profile; the event carries it.
    """
    profile = pool_profile(state.models[model], role)
    pool = f" ({role} pool)" if role else ""
    fits, cands = fit_nodes(state, model, role)
    chosen, best, why = rank(cands, profile.shards_per_replica)
    listed = {f.node for f in chosen + best}

    fitting = len(cands)
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
            role=role,
            verdicts=shown,
            verdict_groups=groups,
            explanation=f"{replica_id}{pool} cannot be placed: {reason} "
            f"(needs {_requirements(profile)}; {considered})",
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
        role=role,
        verdicts=shown,
        verdict_groups=groups,
        explanation=f"{replica_id}{pool} placed on {where}; {considered}; ranked by {PACKING_RULE}",
    )
