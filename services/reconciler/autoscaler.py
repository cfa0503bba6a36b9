"""The autoscale controller: the I/O around autoscale.py, run by the leader.

Routers publish a DemandSummary about once a second on core NATS
(`llmgw.demand.<router>`); the leader keeps the latest per router and, every
`tick` seconds, combines those younger than `autoscale.SUMMARY_TTL` per model
and asks the pure `autoscale.decide` what to do. Each decision goes into the
log as a ModelScaled event; the fold turns it into the model's desired count,
and reconcile places or retires replicas from there (retired ones drain
first). Summaries are not persisted: the event records the combined values
it was decided on, which is what `llmgw audit replay` checks.

The controller is one task: `run()` subscribes, ticks and unsubscribes when
cancelled, so the actor owns it like its other tasks. It publishes through the
actor's publisher, so the actor's reconcile loop waits for the fold to catch
up with a scaling decision as it does with its own. It does not decide again
until the fold has seen its last event (the desired count it reads must be
the one its decision made).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import Counter

from llmgw import config
from llmgw import contracts as c
from llmgw import subjects as s

from . import autoscale
from .state import ClusterState

log = logging.getLogger(__name__)

SCALED = Counter("llmgw_reconciler_model_scaled_total", "Autoscaling decisions", ["rule"])
SUMMARIES = Counter(
    "llmgw_reconciler_demand_summaries_total", "Router demand summaries received", ["result"]
)


class AutoscaleConfig(config.ConfigStruct, kw_only=True):
    tick: float = 1.0  # seconds between evaluations
    fold_wait_timeout: float = 30.0  # give up waiting for our own event to be folded


class AutoscaleController:
    def __init__(
        self, cfg: AutoscaleConfig | None = None, *, clock: Callable[[], float] = time.time
    ):
        self.cfg = cfg or AutoscaleConfig()
        self.clock = clock  # wall clock: event times are wall times, cool-downs compare them
        # (router id, worker process) -> (arrival, latest summary)
        self.summaries: dict[tuple[str, int], tuple[float, c.DemandSummary]] = {}
        self.tracks: dict[str, autoscale.Track] = {}
        self._awaiting: tuple[int, float] | None = None  # (our event's seq, since)

    async def run(
        self,
        nc: NATS,
        state_of: Callable[[], ClusterState],
        publish: Callable[[c.Message], Awaitable[int]],
    ) -> None:
        """Until cancelled: collect summaries, decide every tick, publish decisions."""
        self.summaries.clear()
        self.tracks.clear()
        self._awaiting = None
        sub = await nc.subscribe(s.DEMAND_ALL, cb=self._on_summary)
        try:
            while True:
                await asyncio.sleep(self.cfg.tick)
                try:
                    await self._tick(state_of(), publish)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("autoscale tick failed; retrying next tick")
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_summary(self, msg: Msg) -> None:
        try:
            summary = c.decode(msg.data, c.DemandSummary)
        except c.ContractError as exc:
            SUMMARIES.labels("malformed").inc()
            log.warning("dropped a malformed demand summary on %s: %s", msg.subject, exc.reason)
            return
        SUMMARIES.labels("ok").inc()
        self.summaries[(summary.router_id, summary.process)] = (self.clock(), summary)

    def signals(self, state: ClusterState, now: float) -> dict[str, c.ScaleSignals]:
        """Combined signals per autoscaled model, from the summaries still fresh."""
        for key in [k for k, (at, _) in self.summaries.items() if now - at > autoscale.SUMMARY_TTL]:
            del self.summaries[key]
        live = [summary for _, summary in self.summaries.values()]
        if not live:
            return {}  # no router speaks: nothing is known, nothing is decided
        return {
            model: autoscale.combine(live, model)
            for model, decl in state.models.items()
            if decl.autoscale is not None
        }

    async def _tick(
        self, state: ClusterState, publish: Callable[[c.Message], Awaitable[int]]
    ) -> None:
        now = self.clock()
        if self._awaiting is not None:
            seq, since = self._awaiting
            if state.last_seq < seq and now - since < self.cfg.fold_wait_timeout:
                return
            self._awaiting = None
        events, self.tracks = autoscale.decide(state, self.signals(state, now), self.tracks, now)
        for ev in events:
            seq = await publish(ev)
            self._awaiting = (seq, now)
            SCALED.labels(ev.rule).inc()
            log.info("%s: %s", ev.model, ev.explanation)
