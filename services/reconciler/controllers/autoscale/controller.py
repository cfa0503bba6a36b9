"""The autoscaler as one of the leader's controllers (controller.py).

`AutoscaleController` (autoscaler.py) collects the routers' demand summaries and
turns them into ModelScaled events; this runs it the way every controller runs:
a pass every `autoscale_tick` seconds (the actor's config) (summaries arrive on core NATS, not through the fold,
so it wakes on time rather than on changes), on committed state only, publishing
through the term-stamping context so an older leader's decision is fenced off
like any other control event.
"""

from __future__ import annotations

import contextlib

from llmgw import subjects as s
from llmgw.reconciler.controllers.autoscale.demand import AutoscaleConfig, AutoscaleController
from llmgw.reconciler.controllers.runtime import Context, Controller, Result
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState


class Autoscaler(Controller):
    name = "autoscale"
    watches = frozenset()

    def __init__(self, ctx: Context, cfg):  # the actor's config (ActorConfig)
        super().__init__(ctx)
        self.inner = AutoscaleController(
            AutoscaleConfig(tick=cfg.autoscale_tick, fold_wait_timeout=cfg.fold_wait_timeout),
            clock=ctx.clock,
            monotonic=ctx.monotonic,
        )
        self.resync = self.inner.cfg.tick
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.ctx.nc.subscribe(s.DEMAND_ALL, cb=self.inner._on_summary)

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        await self.inner._tick(state, self.ctx.publish)
        return Result()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
