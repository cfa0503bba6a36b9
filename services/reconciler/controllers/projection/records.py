"""The router projection: per-model endpoint sets, tenants and bands in JetStream KV.

Routers watch two buckets and never need Postgres; which key holds which
record, and their bytes, are `llmgw.projection`'s (the routers read with it):
  - a ModelEndpoints per model with the model's serving endpoints (ready, or
    draining: finish what runs, take nothing new), aliases, fallbacks,
    scheduling, deadlines and capacity hints; the key is deleted when the model
    leaves the catalog;
  - a TenantRecord per tenant, and the bands as one BandsRecord.

An endpoint is one replica, reached through its shard 0 (the rank that serves
HTTP; `projection.endpoint_id` names the endpoint after it). A replica is
listed when every shard is ready or draining; it is draining when any shard
drains or the replica is retired (scale down, model removed), so routers stop
sending new work there before the drain command even lands. Shards of an
unreachable node stay listed: engines keep serving while an agent is down,
and routers have their own circuit breakers.

`record_for(state, key)` and `affected(state, changes)` are pure; `KvProjection` writes a key only when its content
changed, comparing the record without its envelope (id, ts) and without
`based_on_seq` and `term`, so unrelated events never rewrite every key.

Every record carries the folded leader term. Writes are compare-and-set on
the revision this leader last saw for the key: an old leader's late write
fails instead of overwriting a newer one, and a write that finds the key
changed behind its back re-reads it and writes again. `load()` re-reads what
the buckets hold; the projection controller does that at term start and
periodically, then rewrites what differs (a late foreign write, a bucket
recreated empty).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)

from llmgw import contracts as c
from llmgw import projection as pj
from llmgw.projection import Key
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import Change
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.state.queries import next_replica_id

log = logging.getLogger(__name__)

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
        endpoints.append(
            c.Endpoint(
                id=pj.endpoint_id(head.shard_id),
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
        term=state.term,
    )


def _unplaceable(state: ClusterState, model: str) -> str:
    """Why the replica reconcile tries to place next cannot be placed, while one is missing.

    Only that replica id counts: a failure recorded for a replica that is no longer
    wanted (scaled down before it could be placed) stays in the state but says nothing.
    """
    if len(state.active_replicas(model)) >= state.desired_replicas(model):
        return ""
    failed = state.failures.get(next_replica_id(state, model))
    return failed.explanation if failed is not None else ""


def tenant_record(state: ClusterState, name: str) -> c.TenantRecord:
    t = state.tenants[name]
    return c.TenantRecord(
        name=name, band=t.band, key_hashes=list(t.key_hashes), quotas=t.quotas, term=state.term
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
            model = key
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


class Superseded(RuntimeError):
    """A newer leader wrote the key: this one must not overwrite it."""


class KvProjection:
    """Writes the projection to KV; remembers what it wrote to skip unchanged keys."""

    def __init__(self, js: JetStreamContext, term: int = 0):
        self.js = js
        self.term = term  # the leader term writing: a key of a newer term is not ours
        self._kv: dict[str, object] = {}
        self._written: dict[Target, bytes] = {}  # (bucket, kv key) -> comparable
        self._rev: dict[Target, int] = {}  # (bucket, kv key) -> revision we saw
        self.writes = 0
        self.conflicts = 0  # writes that found the key changed by someone else

    async def _bucket(self, bucket: str):
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def load(self) -> None:
        """Learn what the buckets hold now, so only what differs is rewritten."""
        written: dict[Target, bytes] = {}
        revs: dict[Target, int] = {}
        for bucket in pj.BUCKETS:
            kv = await self._bucket(bucket)
            try:
                keys = await kv.keys()
            except NoKeysError:
                continue
            for key in keys:
                body, rev, _ = await self._read(kv, (bucket, key))
                if rev is not None:
                    written[(bucket, key)] = body
                    revs[(bucket, key)] = rev
        self._written, self._rev = written, revs

    async def _read(self, kv, target: Target) -> tuple[bytes, int | None, int]:
        """(comparable, revision, leader term) of what a key holds; revision None: nothing."""
        try:
            entry = await kv.get(target[1])
        except (KeyNotFoundError, KeyDeletedError):
            return b"", None, 0
        try:
            record = pj.decode(*target, entry.value or b"")
        except c.ContractError:
            return b"?", entry.revision, 0  # unreadable or misplaced: rewrite or delete it
        return comparable(record), entry.revision, getattr(record, "term", 0)

    def full_plan(self, state: ClusterState) -> list[tuple[Target, pj.Record | None]]:
        """Every key the state projects, and a delete of every other key we know of. Pure."""
        wanted = all_keys(state)
        plan: list[tuple[Target, pj.Record | None]] = [
            (target, None) for target in sorted(set(self._written) - set(wanted))
        ]
        plan += [(target, record_for(state, wanted[target])) for target in sorted(wanted)]
        return plan

    async def sync_all(self, state: ClusterState) -> None:
        """Make the buckets match the state: write what differs, delete what is gone."""
        await self.apply(self.full_plan(state))

    def plan(self, state: ClusterState, changes) -> list[tuple[Target, pj.Record | None]]:
        """The (target, record or None) writes a set of changes calls for. Pure over `state`."""
        keys = sorted(affected(state, changes), key=lambda key: key.target)
        return [(key.target, record_for(state, key)) for key in keys]

    async def apply(self, plan: list[tuple[Target, pj.Record | None]]) -> None:
        for target, record in plan:
            if record is None:
                await self._delete(target)
            else:
                await self._write(target, record)

    async def _write(self, target: Target, record: pj.Record | None) -> None:
        if record is None:
            return
        body = comparable(record)
        if self._written.get(target) == body:
            return
        kv = await self._bucket(target[0])
        raw = pj.encode(record)
        for _attempt in range(3):
            rev = self._rev.get(target)
            try:
                if rev is None:
                    new_rev = await kv.create(target[1], raw)
                else:
                    new_rev = await kv.update(target[1], raw, last=rev)
            except KeyWrongLastSequenceError:
                # Someone else wrote it (an old leader's late put, an operator): look again.
                self.conflicts += 1
                log.warning("KV key %s/%s changed behind us: re-reading it", *target)
                found, seen, term = await self._read(kv, target)
                self._check_not_superseded(target, term)
                if seen is None:
                    self._rev.pop(target, None)
                else:
                    self._rev[target] = seen
                if found == body:
                    self._written[target] = body
                    return
                continue
            self._written[target] = body
            self._rev[target] = new_rev
            self.writes += 1
            return
        raise RuntimeError(f"KV key {target[0]}/{target[1]} keeps changing behind us")

    def _check_not_superseded(self, target: Target, term: int) -> None:
        if term > self.term:
            raise Superseded(
                f"KV key {target[0]}/{target[1]} was written by leader term {term}; "
                f"this leader's term is {self.term}: not overwriting it"
            )

    async def _delete(self, target: Target) -> None:
        if target not in self._written:
            return
        kv = await self._bucket(target[0])
        try:
            await kv.delete(target[1], last=self._rev.get(target))
        except KeyWrongLastSequenceError:
            self.conflicts += 1
            _, seen, term = await self._read(kv, target)
            self._check_not_superseded(target, term)
            if seen is not None:
                await kv.delete(target[1], last=seen)  # what is there now must go as well
        del self._written[target]
        self._rev.pop(target, None)
        self.writes += 1
