"""The router projection: per-model endpoint sets, tenants and bands in JetStream KV.

Routers watch two buckets and never need Postgres:
  - ENDPOINTS_BUCKET, key `endpoints_key(model)`: a ModelEndpoints record with
    the model's serving endpoints (ready, or draining: finish what runs, take
    nothing new), aliases, fallbacks, scheduling, deadlines and capacity hints;
    the key is deleted when the model leaves the catalog;
  - TENANTS_BUCKET: a TenantRecord per tenant under `tenant_key(name)` and the
    bands as a BandsRecord under BANDS_KEY.

An endpoint is one replica: its shard 0 is the rank that serves HTTP (the
other shards of a multi-node replica run headless). A replica is listed when
every shard is ready or draining; it is draining when any shard drains or the
replica is retired (scale down, model removed), so routers stop sending new
work there before the drain command even lands. Shards of an unreachable node
stay listed: engines keep serving while an agent is down, and routers have
their own circuit breakers.

`records(state)` is pure; `KvProjection` writes a key only when its content
changed, comparing the record without its envelope (id, ts) and without
`based_on_seq`, so unrelated events never rewrite every key.
"""

from __future__ import annotations

import logging

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError

from llmgw import contracts as c
from llmgw import subjects as s

from .fold import Change
from .state import ClusterState, replica_id

log = logging.getLogger(__name__)

SERVING = (c.ShardState.READY, c.ShardState.DRAINING)

Key = tuple[str, str]  # (bucket, key)


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
        endpoints.append(
            c.Endpoint(
                id=head.shard_id,
                url=head.url,
                node=head.node,
                replica_id=rid,
                state=c.EndpointState.DRAINING if draining else c.EndpointState.READY,
                engine=decl.profile.engine,
                max_running=head.max_running or decl.profile.max_num_seqs,
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
    )


def _unplaceable(state: ClusterState, model: str) -> str:
    """Why the replica reconcile tries to place next cannot be placed, while one is missing.

    Only that replica id counts: a failure recorded for a replica that is no longer
    wanted (scaled down before it could be placed) stays in the state but says nothing.
    """
    if len(state.active_replicas(model)) >= state.desired_replicas(model):
        return ""
    failed = state.failures.get(replica_id(model, state.replica_counter.get(model, 0) + 1))
    return failed.explanation if failed is not None else ""


def tenant_record(state: ClusterState, name: str) -> c.TenantRecord:
    t = state.tenants[name]
    return c.TenantRecord(name=name, band=t.band, key_hashes=list(t.key_hashes), quotas=t.quotas)


def record_for(state: ClusterState, key: Key) -> c.Message | None:
    """The record a key should hold now, or None when it should not exist."""
    bucket, name = key
    if bucket == s.ENDPOINTS_BUCKET:
        return model_record(state, name) if name in state.models else None
    if name == s.BANDS_KEY:
        return c.BandsRecord(bands=list(state.bands))
    return tenant_record(state, name) if name in state.tenants else None


def all_keys(state: ClusterState) -> dict[tuple[str, str], Key]:
    """Every key the state projects, keyed by the KV (bucket, key) it lands on."""
    out: dict[tuple[str, str], Key] = {}
    for m in state.models:
        out[(s.ENDPOINTS_BUCKET, s.endpoints_key(m))] = (s.ENDPOINTS_BUCKET, m)
    for t in state.tenants:
        out[(s.TENANTS_BUCKET, s.tenant_key(t))] = (s.TENANTS_BUCKET, t)
    out[(s.TENANTS_BUCKET, s.BANDS_KEY)] = (s.TENANTS_BUCKET, s.BANDS_KEY)
    return out


def affected(state: ClusterState, changes: set[Change]) -> set[Key]:
    """The records a batch of fold changes can touch."""
    out: set[Key] = set()
    for kind, key in changes:
        model = None
        if kind == "model":
            model = key
        elif kind == "shard" and key in state.shards:
            model = state.shards[key].model
        elif kind == "replica" and key in state.replicas:
            model = state.replicas[key].model
        elif kind == "failure":
            failed = state.failures.get(key)
            # A failure cleared by a placement changes the replica, which names the model.
            model = failed.model if failed is not None else None
        elif kind == "scaled":
            model = key
        elif kind == "tenant":
            out.add((s.TENANTS_BUCKET, key))
        elif kind == "bands":
            out.add((s.TENANTS_BUCKET, s.BANDS_KEY))
        if model is not None:
            out.add((s.ENDPOINTS_BUCKET, model))
    return out


def kv_key(key: Key) -> str:
    bucket, name = key
    if bucket == s.ENDPOINTS_BUCKET:
        return s.endpoints_key(name)
    return name if name == s.BANDS_KEY else s.tenant_key(name)


def comparable(record: c.Message) -> bytes:
    """The record's content without what changes on every write."""
    fields = {"id": "", "ts": 0.0}
    if isinstance(record, c.ModelEndpoints):
        fields["based_on_seq"] = 0
    return c.encode(msgspec.structs.replace(record, **fields))


class KvProjection:
    """Writes the projection to KV; remembers what it wrote to skip unchanged keys."""

    def __init__(self, js: JetStreamContext):
        self.js = js
        self._kv: dict[str, object] = {}
        self._written: dict[tuple[str, str], bytes] = {}  # (bucket, kv key) -> comparable
        self.writes = 0

    async def _bucket(self, bucket: str):
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def load(self) -> None:
        """Learn what the buckets hold now, so a new leader rewrites only what differs."""
        self._written.clear()
        for bucket in (s.ENDPOINTS_BUCKET, s.TENANTS_BUCKET):
            kv = await self._bucket(bucket)
            try:
                keys = await kv.keys()
            except NoKeysError:
                continue
            for key in keys:
                try:
                    entry = await kv.get(key)
                    record = c.decode(entry.value or b"")
                except (KeyNotFoundError, c.ContractError):
                    self._written[(bucket, key)] = b"?"  # unreadable: rewrite or delete it
                    continue
                self._written[(bucket, key)] = comparable(record)

    async def sync_all(self, state: ClusterState) -> None:
        """Make the buckets match the state: write what differs, delete what is gone."""
        wanted = all_keys(state)
        for target in sorted(set(self._written) - set(wanted)):
            await self._delete(target)
        for target in sorted(wanted):
            await self._write(target, record_for(state, wanted[target]))

    async def sync(self, state: ClusterState, changes: set[Change]) -> None:
        for key in sorted(affected(state, changes)):
            target = (key[0], kv_key(key))
            record = record_for(state, key)
            if record is None:
                await self._delete(target)
            else:
                await self._write(target, record)

    async def _write(self, target: tuple[str, str], record: c.Message | None) -> None:
        if record is None:
            return
        body = comparable(record)
        if self._written.get(target) == body:
            return
        kv = await self._bucket(target[0])
        await kv.put(target[1], c.encode(record))
        self._written[target] = body
        self.writes += 1

    async def _delete(self, target: tuple[str, str]) -> None:
        if target not in self._written:
            return
        kv = await self._bucket(target[0])
        await kv.delete(target[1])
        del self._written[target]
        self.writes += 1
