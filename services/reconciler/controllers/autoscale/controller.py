"""The autoscale controller: routers' demand summaries in, ModelScaled events out.

Routers publish a DemandSummary about once a second on core NATS
(`llmgw.demand.<router>`); the leader keeps the latest per router (demand.py,
shared with the LoRA placement) and, every
`autoscale_tick` seconds (the actor's config), combines those younger than
`rule.SUMMARY_TTL` per autoscaled model, or per autoscaled pool of a
disaggregated model (keyed by the pair (model, role)), and asks the pure
`rule.decide` what to do. Each decision goes into the log as a ModelScaled event;
the fold turns it into the model's desired count, and the replicas controller
places or retires replicas from there (retired ones drain first). Summaries are not persisted: the event
records the combined values it was decided on and the per-router inputs they
were combined from (at most `rule.INPUTS_CAP`), which is what `llmgw audit
replay` checks.

It runs the way every controller runs, with one difference: summaries arrive on
core NATS, not through the fold, so it watches no change kind and wakes on time
(`resync`) rather than on changes. It decides on committed state only, and
publishes through the term-stamping context, so an older leader's decision is
fenced off like any other control event. It does not decide again until the
fold has seen its last event (the desired count it reads must be the one its
decision made).

Time is measured on the monotonic clock (`monotonic`): a summary's age, how
long a condition held, the cool-down since the model's last change and the
wait for the fold. The wall clock (`clock`) only stamps events; a change made
before this leader took over is placed on the monotonic clock once, from its
event's wall time, when first seen.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from llmgw import contracts as c
from llmgw.reconciler.controllers.autoscale import rule as autoscale
from llmgw.reconciler.controllers.runtime import Context, Controller, Result
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState

log = logging.getLogger(__name__)

SCALED = Counter("llmgw_reconciler_model_scaled_total", "Autoscaling decisions", ["rule"])
TICKS = Counter(
    "llmgw_reconciler_autoscale_evaluations_total",
    "Autoscaler evaluations (ticks not spent waiting for the fold)",
)


class AutoscaleController(Controller):
    name = "autoscale"
    watches = frozenset()

    def __init__(self, ctx: Context, cfg):  # the actor's config (ActorConfig)
        super().__init__(ctx)
        self.cfg = cfg
        self.resync = cfg.autoscale_tick
        self.clock = ctx.clock  # wall clock: stamps events, never measures time
        self.monotonic = ctx.monotonic  # measures: summary age, conditions held, cool-down, waits
        self.demand = ctx.demand  # the routers' summaries, shared with the LoRA placement
        self.tracks: dict[tuple[str, str], autoscale.Track] = {}
        # (model, role) -> (id of its latest ModelScaled, when it happened on the monotonic clock)
        self.changed: dict[tuple[str, str], tuple[str, float]] = {}
        self._awaiting: tuple[int, float] | None = None  # (our event's seq, since)
        self.ticks = 0  # evaluations made (not waiting for the fold): tests wait on it

    async def start(self) -> None:
        await self.demand.attach(self.ctx.nc)

    async def stop(self) -> None:
        await self.demand.detach()

    def signals(
        self, state: ClusterState, now: float
    ) -> tuple[dict[tuple[str, str], c.ScaleSignals], dict[tuple[str, str], list[c.RouterInput]]]:
        """Combined signals per autoscaled model or pool (by (model, role)) from the
        summaries still fresh at monotonic `now` (older ones are forgotten), and the
        inputs they came from."""
        live = self.demand.fresh(now, autoscale.SUMMARY_TTL)
        if not live:
            return {}, {}  # no router speaks: nothing is known, nothing is decided
        counted = [(m, r) for m, r, _ in state.autoscaled()]
        return (
            {(m, r): autoscale.combine(live, m, r) for m, r in counted},
            {(m, r): autoscale.inputs_of(live, m) for m, r in counted},
        )

    def changed_at(
        self, state: ClusterState, now: float, wall: float
    ) -> dict[tuple[str, str], float]:
        """When each model or pool last changed (by (model, role)), on the monotonic clock.
        A change this controller
        did not see made (an earlier leader's) is placed once from its event's age; a
        wall-clock step after that moves nothing."""
        for key, ev in state.scaled.items():
            known = self.changed.get(key)
            if known is None or known[0] != ev.id:
                self.changed[key] = (ev.id, now - max(0.0, wall - ev.ts))
        return {key: at for key, (_, at) in self.changed.items()}

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        now, wall = self.monotonic(), self.clock()
        if self._awaiting is not None:
            seq, since = self._awaiting
            if state.last_seq < seq and now - since < self.cfg.fold_wait_timeout:
                return Result()
            self._awaiting = None
        signals, inputs = self.signals(state, now)
        events, self.tracks = autoscale.decide(
            state,
            signals,
            self.tracks,
            now,
            wall=wall,
            changed_at=self.changed_at(state, now, wall),
            inputs=inputs,
        )
        self.ticks += 1
        TICKS.inc()
        for ev in events:
            seq = await self.ctx.publish(ev)
            self._awaiting = (seq, now)
            self.changed[ev.model, ev.role] = (ev.id, now)
            SCALED.labels(ev.rule).inc()
            log.info("%s: %s", ev.model, ev.explanation)
        return Result()
