"""Step 4 of a request's path, `http -> request -> admission -> scheduling -> relay`: where.

Filters, then weighted scorers, then a picker, each a small named plugin; a model's
pipeline is assembled from the catalog's `scheduling` section. `prefix` is the
approximate prefix matcher (chained block hashes, an LRU per endpoint); the precise one
reads `llmgw.router.kvcache`.
"""
