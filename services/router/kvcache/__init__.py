"""Which engine holds which prompt block, from the engines' own KV events.

State arrives here beside the request path: `feed` takes the agents' relayed KV events
off the bus (and asks for snapshots), `index` keeps block -> endpoints, `tokens` turns a
request's prompt into the engine's token ids, and `indexer` (the read side the kv_prefix
scorer asks) tokenizes, hashes and looks up a prompt's blocks.
"""
