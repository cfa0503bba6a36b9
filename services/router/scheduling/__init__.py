"""Step 4 of a request's path, `http -> request -> admission -> scheduling -> relay`: where.

Filters, then weighted scorers, then a picker, each a small named plugin; a model's
pipeline (`pipeline`) is assembled from the catalog's `scheduling` section. The plugins
live by role: `filters`, `scorers` (load and session), `prefix` (the approximate prefix
matcher: chained block hashes, an LRU per endpoint), `cached` (the precise one, reading
`llmgw.router.kvcache`) and `pickers`.
"""
