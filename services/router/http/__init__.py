"""Step 1 of a request's path, `http -> request -> admission -> scheduling -> relay`: a client arrives.

The ASGI apps and everything that answers before the request is routed: the public app
and its hot paths (`app`), CORS, the bound on request heads, OpenAI-shaped errors, the
router's own OpenAPI document, `GET /v1/models`, and the admin listener with the worker
snapshots that let several processes share it.
"""
