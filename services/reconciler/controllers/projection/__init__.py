"""Projection controller: keep the routers' JetStream KV buckets equal to committed state.

`records` builds, purely, the per-model endpoint records, tenants and bands routers read,
and writes them; `controller` decides which keys a change touched.
"""
