"""The LoRA controller: routers' demand per adapter in, AdaptersPlaced and SetShardAdapters out.

Every `lora_tick` seconds, when adapters, holdings, shards, replicas, models or nodes
change, and at once when a router's summary has requests waiting for an adapter held
nowhere, it reads the routers' fresh demand summaries (the intake it shares with
the autoscaler), smooths the demand per adapter (demand.py) and asks the pure
`placement.place` for each base model with adapter slots. A decision that changes what
some replica holds goes into the log as AdaptersPlaced, with the demand and the waiting
adapters it was decided on (what `llmgw audit replay` re-derives it from); the fold makes
it the model's holdings, and from the holdings the commands follow (commands.py): the
whole set each changed replica's engine should hold, sent to its node, fenced with this
term and the node's boot id like every command, re-issued with back-off until the
agent reports the engine holds it.

Like the autoscaler, it decides nothing new until the fold has seen its last event (a
second decision on the same holdings would place twice), and it measures on the
monotonic clock; the wall clock stamps events, and hold times are measured between
event timestamps so replay measures them the same way.
"""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import Counter

from llmgw import contracts as c
from llmgw.reconciler.controllers.autoscale.rule import SUMMARY_TTL
from llmgw.reconciler.controllers.lora import placement
from llmgw.reconciler.controllers.lora.commands import adapter_commands
from llmgw.reconciler.controllers.lora.demand import DemandSmoother, QueueAges
from llmgw.reconciler.controllers.replicas.commands import CommandTracker
from llmgw.reconciler.controllers.runtime import Context, Controller, Result
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState

log = logging.getLogger(__name__)

ADAPTER_CHANGES = Counter(
    "llmgw_reconciler_adapter_changes_total", "Adapter loads and unloads decided", ["action"]
)
ADAPTER_COMMANDS = Counter(
    "llmgw_reconciler_adapter_commands_total", "SetShardAdapters sent to agents", ["send"]
)


class LoraController(Controller):
    name = "lora"
    watches = frozenset({ch.ADAPTER, ch.HOLDINGS, ch.SHARD, ch.REPLICA, ch.MODEL, ch.NODE})

    def __init__(self, ctx: Context, cfg):  # the actor's config (ActorConfig)
        super().__init__(ctx)
        self.cfg = cfg
        self.resync = cfg.lora_tick
        self.clock = ctx.clock  # wall clock: stamps events, and so the hold times
        self.monotonic = ctx.monotonic  # measures: summary age, smoothing, waits, retries
        self.demand = ctx.demand
        self.smoother = DemandSmoother()
        self.ages = QueueAges()
        self.tuning = placement.Tuning()
        self.commands = CommandTracker(cfg.command_retry_initial, cfg.command_retry_max)
        self._awaiting: tuple[int, float] | None = None  # (our event's seq, since)

    async def start(self) -> None:
        self.demand.listeners.append(self._heard)
        await self.demand.attach(self.ctx.nc)

    async def stop(self) -> None:
        await self.demand.detach()
        if self._heard in self.demand.listeners:
            self.demand.listeners.remove(self._heard)
        self.commands.clear()

    def _heard(self, summary: c.DemandSummary) -> None:
        """Count the summary's arrivals; with requests waiting for an adapter held nowhere,
        decide now, not on the next tick (they wait in admission until an engine holds it)."""
        self.smoother.heard(summary)
        holdings = self.ctx.state.adapter_holdings
        for model, md in summary.models.items():
            placed = holdings.get(model)
            held = {a for hs in placed.holdings.values() for a in hs} if placed else set()
            if any(ad.waiting > 0 and name not in held for name, ad in md.adapters.items()):
                self.wake_now()
                return

    def _waiting_for_fold(self, state: ClusterState, now: float) -> bool:
        if self._awaiting is None:
            return False
        seq, since = self._awaiting
        if state.last_seq < seq and now - since < self.cfg.fold_wait_timeout:
            return True
        self._awaiting = None
        return False

    def decide(
        self,
        state: ClusterState,
        demand: dict[str, dict[str, float]],
        queued: dict[str, dict[str, int]],
        wall: float,
        waited: dict[str, dict[str, float]] | None = None,
    ) -> list[c.AdaptersPlaced]:
        """The placements that change some replica's adapters, one per base model."""
        out = []
        waited = waited or {}
        for model in placement.adapter_models(state):
            inp = placement.inputs_from(
                state,
                model,
                demand.get(model, {}),
                queued.get(model, {}),
                wall,
                waited.get(model, {}),
            )
            decided = placement.place(inp, self.tuning)
            before = inp.current.holdings if inp.current is not None else {}
            if placement.held_now(decided.holdings) == placement.held_now(before):
                continue
            out.append(
                c.AdaptersPlaced(
                    ts=wall,
                    model=model,
                    holdings=decided.holdings,
                    changes=decided.changes,
                    demand=inp.demand,
                    waiting=sorted(inp.queued),
                    queued=inp.queued,
                    waited=inp.waited,
                    based_on_seq=state.last_seq,
                    explanation=decided.explanation(),
                    policy=placement.POLICY,
                )
            )
        return out

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        now, wall = self.monotonic(), self.clock()
        # Every pass moves the rates on, deciding or not (the arrivals were counted as
        # they were heard, in _heard; the waiting are each router's latest).
        demand, queued = self.smoother.update(self.demand.fresh(now, SUMMARY_TTL), now)
        waited = self.ages.update(queued, now)
        waiting = self._waiting_for_fold(state, now)
        events = [] if waiting else self.decide(state, demand, queued, wall, waited)
        for ev in events:
            seq = await self.ctx.publish(ev)
            self._awaiting = (seq, now)
            for change in ev.changes:
                ADAPTER_CHANGES.labels(change.action).inc()
            log.info("%s adapters: %s", ev.model, ev.explanation)
        # Commands follow the folded holdings: until our event is folded, only what the
        # state still calls for is re-sent.
        desired = [self._fence(state, cmd) for cmd in adapter_commands(state)]
        new, again = self.commands.sync(desired, now, wall, keep_new=not (waiting or events))
        for cmd, send in [(x, "first") for x in new] + [(x, "reissue") for x in again]:
            await self.ctx.publish(cmd)
            ADAPTER_COMMANDS.labels(send).inc()
        due = self.commands.next_due()
        return Result(requeue_after=max(0.01, due - now) if due is not None else None)

    def _fence(self, state: ClusterState, cmd: c.SetShardAdapters) -> c.SetShardAdapters:
        node = state.nodes.get(cmd.node)
        boot = node.boot_id if node is not None else ""
        return msgspec.structs.replace(cmd, term=self.ctx.term, boot_id=boot)
