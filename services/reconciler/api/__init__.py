"""The operator's read side: the admin listener and its JSON API, beside the event path.

`admin` serves /metrics, /healthz, /readyz and the operator API; `read` answers its
queries from the projection tables, the same on leader and standbys.
"""
