"""The router projection as stored in JetStream KV: which key holds which record, and the codec.

The reconciler writes the projection (reconciler/controllers/projection/records.py) and every router
reads it (router/controlplane/feeds.py, view.py, kvfeed.py); both sides go through this module,
so neither spells a key or the endpoint-id rule itself.

    bucket            key                          record
    ENDPOINTS_BUCKET  model_key(model)             ModelEndpoints
    TENANTS_BUCKET    tenant_key(name)             TenantRecord
    TENANTS_BUCKET    BANDS_KEY                    BandsRecord

Tenants and bands share a bucket and the key says which record it holds
(`kind_of`): every tenant key has the `tenant.` prefix, so a tenant named like
the bands key still has a key of its own. A model's or tenant's name becomes
one subject token in its key (`subjects.safe_token`), so a key does not give
the name back: a record names what it is for, and `decode` checks that the
record's key is the key it was read from.

An endpoint is one replica, served over HTTP by its shard 0 (the other shards of
a multi-node replica run headless), and its id is that shard's id
(`endpoint_id`, and back: `serving_shard`). Load samples and KV event batches
name the shard they come from: a router indexes its endpoints by serving shard
to find theirs, and asks that shard for a snapshot of the endpoint's KV cache.

The bytes are `contracts.encode` of the record, with nothing around it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from llmgw import contracts as c
from llmgw import subjects

# The bucket names live with every other NATS name (subjects.py: provisioning and
# permissions need them too); what each bucket holds is defined here.
ENDPOINTS_BUCKET = subjects.ENDPOINTS_BUCKET
TENANTS_BUCKET = subjects.TENANTS_BUCKET
BUCKETS = (ENDPOINTS_BUCKET, TENANTS_BUCKET)

Kind = Literal["model", "tenant", "bands"]
MODEL: Kind = "model"
TENANT: Kind = "tenant"
BANDS_KIND: Kind = "bands"

Record = c.ModelEndpoints | c.TenantRecord | c.BandsRecord

_BUCKET_OF: dict[Kind, str] = {
    MODEL: ENDPOINTS_BUCKET,
    TENANT: TENANTS_BUCKET,
    BANDS_KIND: TENANTS_BUCKET,
}

# KV keys allow dots, but one token per model keeps watches simple.
_TENANT_PREFIX = "tenant."
BANDS_KEY = "bands"


def model_key(model: str) -> str:
    return subjects.safe_token(model)


def tenant_key(name: str) -> str:
    return _TENANT_PREFIX + subjects.safe_token(name)


class Key(NamedTuple):
    """One record of the projection: what it is for, by kind and by the name the catalog
    declares (the model's or the tenant's; "" for the bands, one record for all)."""

    kind: Kind
    name: str = ""

    @classmethod
    def model(cls, name: str) -> Key:
        return cls(MODEL, name)

    @classmethod
    def tenant(cls, name: str) -> Key:
        return cls(TENANT, name)

    @property
    def bucket(self) -> str:
        return _BUCKET_OF[self.kind]

    @property
    def kv_key(self) -> str:
        if self.kind == MODEL:
            return model_key(self.name)
        if self.kind == TENANT:
            return tenant_key(self.name)
        return BANDS_KEY

    @property
    def target(self) -> tuple[str, str]:
        """Where the record is stored: (bucket, KV key)."""
        return self.bucket, self.kv_key


BANDS = Key(BANDS_KIND)


def key_of(record: Record) -> Key:
    """The key a record belongs under."""
    if isinstance(record, c.ModelEndpoints):
        return Key.model(record.model)
    if isinstance(record, c.TenantRecord):
        return Key.tenant(record.name)
    if isinstance(record, c.BandsRecord):
        return BANDS
    raise TypeError(f"{type(record).__name__} is not a record of the router projection")


def kind_of(bucket: str, kv_key: str) -> Kind | None:
    """Which record a KV key holds; None when the key is not one the projection writes."""
    if bucket == ENDPOINTS_BUCKET:
        return MODEL if kv_key and model_key(kv_key) == kv_key else None
    if bucket == TENANTS_BUCKET:
        if kv_key == BANDS_KEY:
            return BANDS_KIND
        if kv_key.startswith(_TENANT_PREFIX) and len(kv_key) > len(_TENANT_PREFIX):
            return TENANT
    return None


class Misplaced(c.ContractError):
    """A well-formed record under a key that is not its own, or a key the projection
    never writes."""


def encode(record: Record) -> bytes:
    return c.encode(record)


def decode(bucket: str, kv_key: str, raw: bytes) -> Record:
    """The record a KV entry holds, checked against the key it was read from.

    Raises Misplaced for a key the projection does not write or a record that belongs
    under another key, and contracts.ContractError for bytes that are no projection record.
    """
    if kind_of(bucket, kv_key) is None:
        raise Misplaced(f"{kv_key!r} is not a key of the projection in {bucket}", raw)
    record: Record = c.decode(raw, Record)
    own = key_of(record)
    if own.target != (bucket, kv_key):
        what = "the bands" if own.kind == BANDS_KIND else f"{own.kind} {own.name!r}"
        where = "" if own.bucket == bucket else f" in {own.bucket}"
        raise Misplaced(f"it is for {what}, whose key is {own.kv_key!r}{where}", raw)
    return record


def endpoint_id(serving_shard_id: str) -> str:
    """The id of the endpoint a replica serves through its shard 0, from that shard's id."""
    return serving_shard_id


def serving_shard(endpoint: str) -> str:
    """The id of the shard that serves an endpoint: the inverse of `endpoint_id`."""
    return endpoint
