"""Projection controller: keep the routers' JetStream KV buckets equal to committed state.

`records` builds, purely, the per-model endpoint records, tenants and bands routers read,
and says which keys a change touched; `writer` puts them into the buckets, compare-and-set,
only what changed; `controller` runs it on each change and resyncs it.
"""
