"""The operator's read side: the admin listener and its JSON API, beside the event path.

`admin` serves /metrics, /healthz, /readyz and the operator API; `auth` decides
who may call which part of the API; `read` answers its queries from the
projection tables, the same on leader and standbys.
"""
