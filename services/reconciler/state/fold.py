"""The fold: apply one event from the log to the cluster state. Pure, no I/O, no clock.

`apply(state, seq, event)` mutates `state` and returns what changed, as
`changes.Change` values, so the Postgres projection writes only those rows. An event
whose sequence is not above `state.last_seq` changes nothing: that is what
makes redelivery after a crash harmless.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state import replica_index
from llmgw.reconciler.state.changes import Change
from llmgw.reconciler.state.model import (
    NODE_LOST,
    AdapterHoldings,
    ClusterState,
    Liveness,
    NodeView,
    ReplicaView,
    ShardView,
    autoscale_specs,
    pool_profile,
    profile_digest,
)


def apply(state: ClusterState, seq: int, event: c.Message) -> set[Change]:
    if seq <= state.last_seq:
        return set()
    state.last_seq = seq
    handler = _HANDLERS.get(type(event))
    if handler is None:
        return set()
    changes = handler(state, seq, event)
    term = getattr(event, "term", 0) if isinstance(event, _CONTROL) else 0
    if term > state.term:
        # A newer leader spoke: from now on its predecessors' events are refused.
        state.term = term
        changes.add(Change(ch.TERM, str(term)))
    return changes


def _node_registered(state: ClusterState, seq: int, ev: c.NodeRegistered) -> set[Change]:
    changes: set[Change] = {Change(ch.NODE, ev.node)}
    state.nodes[ev.node] = NodeView(
        node=ev.node,
        gpus=dict(ev.gpus),
        host=ev.host,
        labels=dict(ev.labels),
        engines=list(ev.engines),
        boot_id=ev.boot_id,
        liveness=Liveness.ALIVE,
        liveness_since=ev.ts,
        registered_seq=seq,
        registered_at=ev.ts,
    )
    # A shard the log places on another node is not this node's to report (checks.py
    # refuses such a status outright; a registration's inventory is kept).
    owned = [
        sh
        for sh in ev.shards
        if (known := state.shards.get(sh.shard_id)) is None or known.node in ("", ev.node)
    ]
    reported = {sh.shard_id: sh for sh in owned}
    for info in owned:
        # A shard the log never placed (or placed and forgot) is recorded too, so
        # the reconciler can adopt it or stop it.
        shard = _shard_for(state, info.shard_id, info.model, info.replica_id)
        _take_report(shard, ev.node, info, whole=True)
        _touch(shard, seq, ev.ts, changes)
    # What the node no longer runs is gone, whatever the log said before.
    for shard in state.shards_on(ev.node):
        if shard.shard_id in reported or shard.terminal or shard.state == c.ShardState.PENDING:
            continue
        shard.state = c.ShardState.STOPPED
        shard.reason = "not running on the node when it registered"
        _touch(shard, seq, ev.ts, changes)
    return changes


def _take_report(
    shard: ShardView, node: str, info: c.ShardInfo | c.ShardStatus, *, whole: bool
) -> None:
    """Where and how a shard runs, as its node reports it: a registration's inventory
    entry and a status carry the same fields, taken here in one place.

    A registration is the node's whole inventory (`whole`): every field is taken as
    said. A status carries the URL, port and GPUs only when it knows them (a failure
    before the engine listened has none), so what it leaves empty stays as it was.
    """
    shard.node = node
    shard.shard_index = info.shard_index
    shard.state = info.state
    if whole or info.url:
        shard.url = info.url
    if whole or info.port:
        shard.port = info.port
    if whole or info.gpus:
        shard.gpus = list(info.gpus)


def _shard_status(state: ClusterState, seq: int, ev: c.ShardStatus) -> set[Change]:
    shard = _shard_for(state, ev.shard_id, ev.model, ev.replica_id)
    # A report of what the engine holds, in the state it was already in, is about
    # adapters only: why the shard got to that state stays as it was.
    adapters_only = ev.adapters is not None and ev.state == shard.state
    _take_report(shard, ev.node, ev, whole=False)
    if not adapters_only:
        shard.reason = ev.reason
        shard.exit_code = ev.exit_code
        shard.output_tail = list(ev.output_tail)
    if ev.max_running is not None:
        shard.max_running = ev.max_running
    if ev.adapters is not None:
        shard.adapters = list(ev.adapters)
        shard.adapter_errors = dict(ev.adapter_errors)
    elif shard.state not in _SERVING:
        # An engine that left serving (restarting, stopped) holds nothing it loaded.
        shard.adapters = None
        shard.adapter_errors = {}
    changes: set[Change] = set()
    _touch(shard, seq, ev.ts, changes)
    return changes


def _model_declared(state: ClusterState, seq: int, ev: c.ModelDeclared) -> set[Change]:
    state.models[ev.name] = ev
    changes: set[Change] = {Change(ch.MODEL, ev.name)}
    kept = {(ev.name, role) for role, _ in autoscale_specs(ev)}
    for key in _scaling_keys(state, ev.name) - kept:
        del state.scaled[key]  # a fixed count again: the autoscaler's is void
        changes.add(Change(ch.SCALED, key))
    return changes


def _scaling_keys(state: ClusterState, model: str) -> set[tuple[str, str]]:
    return {key for key, ev in state.scaled.items() if ev.model == model}


def _model_removed(state: ClusterState, seq: int, ev: c.ModelRemoved) -> set[Change]:
    state.models.pop(ev.name, None)
    changes: set[Change] = {Change(ch.MODEL, ev.name)}
    if state.adapter_holdings.pop(ev.name, None) is not None:
        changes.add(Change(ch.HOLDINGS, ev.name))
    for key in _scaling_keys(state, ev.name):
        del state.scaled[key]
        changes.add(Change(ch.SCALED, key))
    for rid in [rid for rid, f in state.failures.items() if f.model == ev.name]:
        del state.failures[rid]
        changes.add(Change(ch.FAILURE, rid))
    return changes


def _tenant_declared(state: ClusterState, seq: int, ev: c.TenantDeclared) -> set[Change]:
    state.tenants[ev.name] = ev
    return {Change(ch.TENANT, ev.name)}


def _tenant_removed(state: ClusterState, seq: int, ev: c.TenantRemoved) -> set[Change]:
    state.tenants.pop(ev.name, None)
    return {Change(ch.TENANT, ev.name)}


def _bands_declared(state: ClusterState, seq: int, ev: c.BandsDeclared) -> set[Change]:
    state.bands = list(ev.bands)
    return {Change(ch.BANDS, "")}


def _placement_decided(state: ClusterState, seq: int, ev: c.PlacementDecided) -> set[Change]:
    changes: set[Change] = {Change(ch.REPLICA, ev.replica_id)}
    decl = state.models.get(ev.model)
    if ev.replica_id in state.replicas:
        # Placed again (checks.py refuses it; a fold without checks may not): the
        # index counted the replaced replica's model and cannot uncount it.
        replica_index.forget(state)
    state.replicas[ev.replica_id] = ReplicaView(
        replica_id=ev.replica_id,
        model=ev.model,
        role=ev.role,
        assignments=list(ev.assignments),
        decided_seq=seq,
        # What the replica runs is the profile declared when it was placed (its pool's):
        # a later ModelDeclared with another profile makes it outdated (queries.outdated).
        profile_digest=profile_digest(pool_profile(decl, ev.role)) if decl is not None else "",
    )
    for a in ev.assignments:
        running = state.shards.get(a.shard_id)
        if ev.adopted and running is not None and running.node == a.node:
            # The node already runs it: the shard changes owner, not state.
            running.replica_id = ev.replica_id
            running.model = ev.model
            running.updated_seq = seq
            changes.add(Change(ch.SHARD, a.shard_id))
            continue
        state.shards[a.shard_id] = ShardView(
            shard_id=a.shard_id,
            model=ev.model,
            replica_id=ev.replica_id,
            shard_index=a.shard_index,
            node=a.node,
            gpus=list(a.gpus),
            state=c.ShardState.PENDING,
            updated_seq=seq,
            updated_at=ev.ts,
        )
        changes.add(Change(ch.SHARD, a.shard_id))
    if state.failures.pop(ev.replica_id, None) is not None:
        changes.add(Change(ch.FAILURE, ev.replica_id))
    return changes


def _placement_failed(state: ClusterState, seq: int, ev: c.PlacementFailed) -> set[Change]:
    state.failures[ev.replica_id] = ev
    return {Change(ch.FAILURE, ev.replica_id)}


def _replica_retired(state: ClusterState, seq: int, ev: c.ReplicaRetired) -> set[Change]:
    replica = state.replicas.get(ev.replica_id)
    if replica is None:
        return set()
    replica.retired = True
    replica.retired_reason = ev.reason
    return {Change(ch.REPLICA, ev.replica_id)}


def _model_scaled(state: ClusterState, seq: int, ev: c.ModelScaled) -> set[Change]:
    decl = state.models.get(ev.model)
    if decl is None or ev.role not in dict(autoscale_specs(decl)):
        return set()  # decided just before the model (or pool) left or stopped autoscaling
    key = (ev.model, ev.role)
    state.scaled[key] = ev
    return {Change(ch.SCALED, key)}


def _adapter_declared(state: ClusterState, seq: int, ev: c.AdapterDeclared) -> set[Change]:
    state.adapters[ev.name] = ev
    return {Change(ch.ADAPTER, ev.name)}


def _adapter_removed(state: ClusterState, seq: int, ev: c.AdapterRemoved) -> set[Change]:
    # The adapter placement still lists it until the leader unloads it: that decision
    # is the next AdaptersPlaced, not the fold's.
    state.adapters.pop(ev.name, None)
    return {Change(ch.ADAPTER, ev.name)}


def _adapters_placed(state: ClusterState, seq: int, ev: c.AdaptersPlaced) -> set[Change]:
    if ev.model not in state.models:
        return set()  # decided just before the model left
    before = state.adapter_holdings.get(ev.model)
    since = before.loaded_at if before is not None else {}
    holdings = {rid: sorted(held) for rid, held in ev.holdings.items()}
    state.adapter_holdings[ev.model] = AdapterHoldings(
        model=ev.model,
        holdings=holdings,
        # An adapter a replica kept holds since it was loaded there; a new one since now.
        loaded_at={
            rid: {a: since.get(rid, {}).get(a, ev.ts) for a in held}
            for rid, held in ev.holdings.items()
        },
        decided_seq=seq,
        decided_at=ev.ts,
        explanation=ev.explanation,
        changed_seq=_changed_seq(before, holdings, seq),
    )
    return {Change(ch.HOLDINGS, ev.model)}


def _changed_seq(
    before: AdapterHoldings | None, holdings: dict[str, list[str]], seq: int
) -> dict[str, int]:
    """Each replica's last change: this seq where its set differs from before, else the
    one it had (a row written before the field existed: the decision before, whose seq
    its command was keyed by then)."""
    out = {}
    for rid, held in holdings.items():
        if before is None or sorted(before.holdings.get(rid, [])) != held:
            out[rid] = seq
        else:
            out[rid] = before.changed_seq.get(rid, before.decided_seq)
    return out


def _set_liveness(state: ClusterState, node: str, liveness: Liveness, ts: float) -> set[Change]:
    view = state.nodes.get(node)
    if view is None:
        return set()
    view.liveness = liveness
    view.liveness_since = ts
    return {Change(ch.NODE, node)}


def _node_unreachable(state: ClusterState, seq: int, ev: c.NodeUnreachable) -> set[Change]:
    return _set_liveness(state, ev.node, Liveness.UNREACHABLE, ev.ts)


def _node_lost(state: ClusterState, seq: int, ev: c.NodeLost) -> set[Change]:
    changes = _set_liveness(state, ev.node, Liveness.LOST, ev.ts)
    # A lost node's shards count as gone: their replicas get placed elsewhere.
    for shard in state.shards_on(ev.node):
        if shard.terminal:
            continue
        shard.state = c.ShardState.FAILED
        shard.reason = NODE_LOST
        _touch(shard, seq, ev.ts, changes)
    return changes


def _term_started(state: ClusterState, seq: int, ev: c.TermStarted) -> set[Change]:
    return set()  # apply() moves state.term


def _node_recovered(state: ClusterState, seq: int, ev: c.NodeRecovered) -> set[Change]:
    return _set_liveness(state, ev.node, Liveness.ALIVE, ev.ts)


def _shard_for(state: ClusterState, shard_id: str, model: str, replica_id: str) -> ShardView:
    """The shard's view, created the first time the log mentions the shard."""
    shard = state.shards.get(shard_id)
    if shard is None:
        shard = state.shards[shard_id] = ShardView(
            shard_id=shard_id, model=model, replica_id=replica_id
        )
    return shard


def _touch(shard: ShardView, seq: int, ts: float, changes: set[Change]) -> None:
    shard.updated_seq = seq
    shard.updated_at = ts
    changes.add(Change(ch.SHARD, shard.shard_id))


_HANDLERS = {
    c.NodeRegistered: _node_registered,
    c.ShardStatus: _shard_status,
    c.ModelDeclared: _model_declared,
    c.ModelRemoved: _model_removed,
    c.TenantDeclared: _tenant_declared,
    c.TenantRemoved: _tenant_removed,
    c.BandsDeclared: _bands_declared,
    c.PlacementDecided: _placement_decided,
    c.PlacementFailed: _placement_failed,
    c.ReplicaRetired: _replica_retired,
    c.ModelScaled: _model_scaled,
    c.AdapterDeclared: _adapter_declared,
    c.AdapterRemoved: _adapter_removed,
    c.AdaptersPlaced: _adapters_placed,
    c.NodeUnreachable: _node_unreachable,
    c.NodeLost: _node_lost,
    c.NodeRecovered: _node_recovered,
    c.TermStarted: _term_started,
}

_CONTROL = c.CHANNELS["controlEvents"]
_SERVING = (c.ShardState.READY, c.ShardState.DRAINING)
