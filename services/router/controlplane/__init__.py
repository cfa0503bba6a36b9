"""What arrives from NATS: the projection, tenants, load samples and peers.

State arrives here, beside the request path, and feeds `llmgw.router.endpoints` and
admission: `source` is the view's control-plane source, `watch` follows one JetStream KV
bucket (snapshot, then changes), `feeds` decodes and checks its entries, `samples` takes
agents' load samples, and `presence` counts the live routers.
"""
