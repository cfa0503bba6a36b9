"""Events the fold refuses, given the state: stale leaders, impossible decisions, impostors.

The fold is the last place where two writers meet: an old leader's late
decision, a decision based on a state that has moved on, an agent speaking for
a shard of another node. `refusal(state, event)` says why such an event must
be dead-lettered instead of folded (None: fold it). Pure; the folder calls it
for every event before `fold.apply`, so neither the state nor the archive ever
holds a refused event, and replay never sees one.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.state import queries
from llmgw.reconciler.state.model import ClusterState

_CONTROL = c.CHANNELS["controlEvents"]


def refusal(state: ClusterState, event: c.Message) -> str | None:
    if isinstance(event, _CONTROL):
        term = event.term  # type: ignore[attr-defined]
        if term < state.term:
            return f"from leader term {term}, older than term {state.term} already folded"
    check = _CHECKS.get(type(event))
    return check(state, event) if check is not None else None


def _placement_decided(state: ClusterState, ev: c.PlacementDecided) -> str | None:
    if ev.role and ev.role not in c.PD_ROLES:
        # A replica of no known pool would be started with a connector role no engine has.
        return f"role {ev.role!r} is not one of {', '.join(c.PD_ROLES)} (or empty: aggregated)"
    if ev.replica_id in state.replicas:
        return f"replica {ev.replica_id} is already placed"
    taken = queries.gpu_holders(state)
    for a in ev.assignments:
        node = state.nodes.get(a.node)
        if node is None:
            return f"shard {a.shard_id}: node {a.node} is not registered"
        missing = [g for g in a.gpus if g not in node.gpus]
        if missing:
            return f"shard {a.shard_id}: node {a.node} has no GPU {', '.join(missing)}"
        for gpu in a.gpus:
            holder = taken.get((a.node, gpu))
            # Adoption takes over the shard that already holds the GPU: that is the point.
            if holder is not None and not (ev.adopted and holder == a.shard_id):
                return f"shard {a.shard_id}: GPU {gpu} on {a.node} is held by shard {holder}"
            taken[(a.node, gpu)] = a.shard_id
    return None


def _shard_status(state: ClusterState, ev: c.ShardStatus) -> str | None:
    known = state.shards.get(ev.shard_id)
    if known is not None and known.node and known.node != ev.node:
        return f"shard {ev.shard_id} belongs to node {known.node}, not {ev.node}"
    return None


def _node_silent(state: ClusterState, ev: c.NodeUnreachable | c.NodeLost) -> str | None:
    node = state.nodes.get(ev.node)
    # based_on_seq 0: published before the field was filled in; not judged.
    if node is not None and 0 < ev.based_on_seq < node.registered_seq:
        return (
            f"based on seq {ev.based_on_seq}, but node {ev.node} registered again at seq "
            f"{node.registered_seq}: the silence it reports is over"
        )
    return None


_CHECKS = {
    c.PlacementDecided: _placement_decided,
    c.ShardStatus: _shard_status,
    c.NodeUnreachable: _node_silent,
    c.NodeLost: _node_silent,
}
