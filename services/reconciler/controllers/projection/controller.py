"""Projection controller: keep the routers' KV buckets equal to the committed state.

Watches: what the records are made of (models, shards, replicas, tenants,
bands, adapters). Resync: `projection_resync_interval`; a resync re-reads the buckets
and rewrites whatever differs, so drift is repaired even when nothing
changes: an old leader's late write, a bucket recreated empty, a key deleted
by hand. The first pass of a term is such a resync. A failing KV write backs
this controller off alone; placement and commands go on.
"""

from __future__ import annotations

import time

from prometheus_client import Counter

from llmgw.reconciler.controllers.projection.writer import KvProjection
from llmgw.reconciler.controllers.runtime import Context, Controller, Result
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState

KV_WRITES = Counter("llmgw_reconciler_kv_writes_total", "Projection keys written or deleted")
KV_RESYNCS = Counter("llmgw_reconciler_kv_resyncs_total", "Full re-reads of the KV projection")


class ProjectionController(Controller):
    name = "projection"
    watches = frozenset(
        {ch.MODEL, ch.SHARD, ch.REPLICA, ch.TENANT, ch.BANDS, ch.FAILURE, ch.SCALED, ch.ADAPTER}
    )

    def __init__(self, ctx: Context, cfg):
        super().__init__(ctx)
        self.resync = cfg.projection_resync_interval
        self.projection = KvProjection(ctx.js, term=ctx.term)
        self._full_due = 0.0  # monotonic: the first pass is a full resync

    async def start(self) -> None:
        # A state already synced (no events since the term began): resync before
        # anything else runs, so routers see no gap. Otherwise the first pass does it.
        if self.ctx.synced() and self.ctx.gate.is_open:
            await self.projection.load()
            await self.projection.sync_all(self.ctx.state)
            self._full_due = time.monotonic() + self.resync

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        before = self.projection.writes
        try:
            if time.monotonic() >= self._full_due:
                await self.projection.load()
                # load() awaited: read the state again (it may have moved on meanwhile).
                state = await self.ctx.committed()
                plan = self.projection.full_plan(state)
                self._full_due = time.monotonic() + self.resync
                KV_RESYNCS.inc()
            else:
                plan = self.projection.plan(state, changes)
            await self.projection.apply(plan)
        except Exception:
            self._full_due = 0.0  # we may not know what the bucket holds any more
            raise
        finally:
            KV_WRITES.inc(self.projection.writes - before)
        return Result(requeue_after=max(0.0, self._full_due - time.monotonic()))
