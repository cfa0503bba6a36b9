"""Replacement backoff: a pool whose shards keep failing is re-placed ever more slowly.

Without it, a profile that no engine can run (a bad argument, a model that
does not fit in memory) would fail, be retired, be placed again and fail
again as fast as the loop turns, flooding the log. Each failed shard (on a
node that is alive: a lost node says nothing about the profile) doubles the
wait before the next placement in its pool, up to a cap; a shard of the pool
becoming ready resets it. A pool is a model's aggregated replicas, or one pool
(prefill | decode) of a disaggregated model: each pool has its own profile and
its own ways to fail (a decode node's unwritable connector folder), so a
failing decode pool does not hold back the prefill pool's replacements. Retirements are never held back, only new
placements, and only *when* is affected: *where* stays a pure function of the
state, so replay is unchanged. The clock is a parameter.
"""

from __future__ import annotations

from llmgw import contracts as c
from llmgw.reconciler.state.changes import Change
from llmgw.reconciler.state.model import NODE_LOST, ClusterState

PoolKey = tuple[str, str]  # (model, role): plan.Pool


class ReplacementBackoff:
    def __init__(self, initial: float = 5.0, maximum: float = 300.0):
        self.initial = initial
        self.maximum = maximum
        self.failures: dict[PoolKey, int] = {}
        self.until: dict[PoolKey, float] = {}

    def observe(self, state: ClusterState, changes: set[Change], now: float) -> None:
        for kind, key in changes:
            shard = state.shards.get(key) if kind == "shard" else None
            if shard is None:
                continue
            owner = state.replicas.get(shard.replica_id)
            pool = (shard.model, owner.role if owner is not None else "")
            if shard.state == c.ShardState.READY:
                self.failures.pop(pool, None)
                self.until.pop(pool, None)
            elif shard.state == c.ShardState.FAILED and shard.reason != NODE_LOST:
                n = self.failures[pool] = self.failures.get(pool, 0) + 1
                wait = min(self.maximum, self.initial * 2 ** (n - 1))
                self.until[pool] = max(self.until.get(pool, 0.0), now + wait)

    def held(self, now: float) -> set[PoolKey]:
        """Pools (model, role) whose next placement must wait."""
        return {p for p, t in self.until.items() if t > now}

    def next_release(self, now: float) -> float | None:
        """When the next held pool may be placed again, if any is held."""
        return min((t for t in self.until.values() if t > now), default=None)
