"""Development tooling, never imported by a running service: `llmgw dev` (cluster.py),
the real servers it and the tests start (servers.py: nats-server and PostgreSQL from the
`dev` extra), its demo catalog (catalog.py), the tiny vLLM model builder (tinymodel.py),
and the test kits for routers and the simulator (routerkit.py, simkit.py)."""
