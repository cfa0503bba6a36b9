"""The SetShardAdapters the folded state calls for. Pure.

Level-triggered like every command: for each serving replica of a base model with
adapter slots, the set its engine should hold is the latest AdaptersPlaced's for it
(empty if none); while the agent's report (ShardStatus.adapters) differs, the command is
wanted, and the tracker sends it and re-issues it with back-off (a load the engine
refused, whose answer the report carries, is tried again that way). Once the report
matches, the command is no longer wanted and the tracker forgets it. It goes to the
replica's serving shard (index 0), which runs the engine's HTTP API.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.controllers.lora.placement import adapter_models, serving_replicas
from llmgw.reconciler.state.ids import adapters_key
from llmgw.reconciler.state.model import AdapterHoldings, ClusterState


def adapter_commands(state: ClusterState) -> list[c.SetShardAdapters]:
    out: list[c.SetShardAdapters] = []
    for model in adapter_models(state):
        placed = state.adapter_holdings.get(model)
        for rid in serving_replicas(state, model):
            replica = state.replicas[rid]
            head = min(replica.assignments, key=lambda a: a.shard_index)
            shard = state.shards[head.shard_id]
            # An adapter removed from the catalog since the decision has no source: the
            # engine unloads it (the next decision drops it from the holdings too).
            wanted = [
                a
                for a in (placed.holdings.get(rid, []) if placed is not None else [])
                if a in state.adapters
            ]
            if shard.adapters is None and not wanted:
                continue  # nothing reported, nothing wanted
            if sorted(shard.adapters or []) == sorted(wanted):
                continue
            out.append(
                c.SetShardAdapters(
                    key=adapters_key(shard.shard_id, wanted, _changed_at(placed, rid)),
                    node=shard.node,
                    shard_id=shard.shard_id,
                    adapters=[
                        c.AdapterSource(name=a, source=state.adapters[a].source)
                        for a in sorted(wanted)
                    ],
                )
            )
    return out


def _changed_at(placed: AdapterHoldings | None, rid: str) -> int:
    """The seq of the decision that last changed the replica's set: a decision that
    left it as it was is no new command (a slow or failing load is not sent again, nor
    the agent's retries for it started over)."""
    if placed is None:
        return 0
    return placed.changed_seq.get(rid, placed.decided_seq)
