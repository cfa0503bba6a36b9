"""What the router knows of each engine: the state every request step reads.

`view` holds name -> model route -> endpoints, fed by an `EndpointSource` (the config
file, or `llmgw.router.controlplane`); `routes` builds names, aliases and fallback chains
from the per-model records; `load` and `scraper` give each endpoint its load signals,
and `capacity` the batch size learned from them, which admission and scheduling share.
"""
