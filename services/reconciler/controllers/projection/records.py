"""The router projection's records: what each JetStream KV key should hold. Pure.

Routers watch two buckets and never need Postgres; which key holds which
record, and their bytes, are `llmgw.projection`'s (the routers read with it):
  - a ModelEndpoints per model with the model's serving endpoints (ready, or
    draining: finish what runs, take nothing new; each with its adapter slots
    and the adapters its engine reports holding), aliases, fallbacks,
    scheduling, deadlines, capacity hints and the adapters declared on it; the key is deleted when the model
    leaves the catalog;
  - a TenantRecord per tenant, and the bands as one BandsRecord.

An endpoint is one replica, reached through its shard 0 (the rank that serves
HTTP; `projection.endpoint_id` names the endpoint after it). A replica is
listed when every shard is ready or draining; it is draining when any shard
drains or the replica is retired (scale down, model removed), so routers stop
sending new work there before the drain command even lands. Shards of an
unreachable node stay listed: engines keep serving while an agent is down,
and routers have their own circuit breakers.

`record_for(state, key)` is what a key should hold, `affected(state, changes)`
which keys a batch of fold changes can touch, and `comparable(record)` the
content a write is judged by (writer.py writes only what differs).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from llmgw import contracts as c
from llmgw import projection as pj
from llmgw.projection import Key
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import Change
from llmgw.reconciler.state.model import ClusterState, pool_profile
from llmgw.reconciler.state.queries import next_replica_id

SERVING = (c.ShardState.READY, c.ShardState.DRAINING)

Target = tuple[str, str]  # where a record is stored: (bucket, KV key)


def model_record(state: ClusterState, model: str) -> c.ModelEndpoints:
    decl = state.models[model]
    endpoints: list[c.Endpoint] = []
    for rid in sorted(state.replicas):
        replica = state.replicas[rid]
        if replica.model != model:
            continue
        shards = [state.shards.get(sid) for sid in replica.shard_ids]
        if not shards or any(
            sh is None or sh.replica_id != rid or sh.state not in SERVING for sh in shards
        ):
            continue
        head = min(shards, key=lambda sh: sh.shard_index)
        draining = replica.retired or any(sh.state == c.ShardState.DRAINING for sh in shards)
        profile = pool_profile(decl, replica.role)
        endpoints.append(
            c.Endpoint(
                id=pj.endpoint_id(head.shard_id),
                url=head.url,
                node=head.node,
                replica_id=rid,
                state=c.EndpointState.DRAINING if draining else c.EndpointState.READY,
                engine=profile.engine,
                max_running=head.max_running or profile.max_num_seqs,
                max_loras=profile.max_loras,
                # What the engine holds, as its agent reported: a placement not yet
                # loaded is not routed to as if it were.
                adapters=sorted(head.adapters or []),
                role=replica.role,
            )
        )
    return c.ModelEndpoints(
        model=model,
        endpoints=endpoints,
        aliases=list(decl.aliases),
        fallbacks=list(decl.fallbacks),
        scheduling=decl.scheduling,
        deadlines=decl.deadlines,
        based_on_seq=state.last_seq,
        upstream=decl.upstream,
        owned_by=decl.owned_by,
        api_kinds=list(decl.api_kinds),
        max_model_len=decl.profile.max_model_len,
        scale_from_zero=decl.autoscale is not None and decl.autoscale.min == 0,
        unplaceable=_unplaceable(state, model),
        term=state.term,
        adapters=[
            c.AdapterRoute(name=a.name, tenants=list(a.tenants)) for a in state.adapters_of(model)
        ],
        migration=decl.migration,
        disaggregation=decl.disaggregation,
    )


def _unplaceable(state: ClusterState, model: str) -> str:
    """Why the replica reconcile tries to place next cannot be placed, while one is missing
    (the first pool's, for a disaggregated model).

    Only that replica id counts: a failure recorded for a replica that is no longer
    wanted (scaled down before it could be placed) stays in the state but says nothing.
    """
    for role in state.pools(model):
        if len(state.active_replicas(model, role)) >= state.desired_replicas(model, role):
            continue
        failed = state.failures.get(next_replica_id(state, model, role))
        if failed is not None:
            return failed.explanation
    return ""


def tenant_record(state: ClusterState, name: str) -> c.TenantRecord:
    t = state.tenants[name]
    return c.TenantRecord(
        name=name,
        band=t.band,
        key_hashes=list(t.key_hashes),
        quotas=t.quotas,
        cache_isolation=t.cache_isolation,
        term=state.term,
    )


def record_for(state: ClusterState, key: Key) -> pj.Record | None:
    """The record a key should hold now, or None when it should not exist."""
    if key.kind == pj.MODEL:
        return model_record(state, key.name) if key.name in state.models else None
    if key.kind == pj.TENANT:
        return tenant_record(state, key.name) if key.name in state.tenants else None
    return c.BandsRecord(bands=list(state.bands), term=state.term)


def all_keys(state: ClusterState) -> dict[Target, Key]:
    """Every key the state projects, keyed by the KV (bucket, key) it lands on."""
    keys = [Key.model(m) for m in state.models] + [Key.tenant(t) for t in state.tenants]
    return {key.target: key for key in [*keys, pj.BANDS]}


def affected(state: ClusterState, changes: Iterable[Change]) -> set[Key]:
    """The records a batch of fold changes can touch."""
    out: set[Key] = set()
    for change in changes:
        kind, key = change
        model = None
        if kind == ch.MODEL:
            model = key
        elif kind == ch.SHARD and key in state.shards:
            model = state.shards[key].model
        elif kind == ch.REPLICA and key in state.replicas:
            model = state.replicas[key].model
        elif kind == ch.FAILURE:
            failed = state.failures.get(key)
            # A failure cleared by a placement changes the replica, which names the model.
            model = failed.model if failed is not None else None
        elif kind == ch.SCALED:
            model, _ = key
        elif kind == ch.ADAPTER:
            declared = state.adapters.get(key)
            # A removed adapter no longer says its base: every model's record is
            # compared (the writer writes only those that differ). Catalog changes are rare.
            if declared is None:
                out.update(Key.model(m) for m in state.models)
            model = declared.base if declared is not None else None
        elif kind == ch.TENANT:
            out.add(Key.tenant(key))
        elif kind == ch.BANDS:
            out.add(pj.BANDS)
        if model is not None:
            out.add(Key.model(model))
    return out


def comparable(record: pj.Record) -> bytes:
    """The record's content without what changes on every write."""
    fields: dict[str, object] = {"id": "", "ts": 0.0, "term": 0}
    if isinstance(record, c.ModelEndpoints):
        fields["based_on_seq"] = 0
    return pj.encode(msgspec.structs.replace(record, **fields))
