"""Replica controller: place, retire and adopt replicas; send the commands that carry it out.

Watches: every kind that placement or commands read (nodes, shards,
replicas, models, failures). Resync: `resync_interval`, and sooner when a
command is due again or a held model's back-off ends (`requeue_after`).

One pass:
  1. if its own control events of an earlier pass are not folded yet, decide
     nothing new (it would decide twice on the same gap): only re-issue the
     commands still outstanding;
  2. otherwise `reconcile.decide` over the committed state (pure), publish the
     control events, stamped with this term;
  3. if it published none, bring the commands in line with what the state
     calls for (`reconcile.commands`, plus a stop for every engine a node's
     heartbeat reports that the log no longer gives it) and send what is new,
     changed or due again. Every command carries the term and the node's boot
     id; a command no longer called for is forgotten, never re-sent.
"""

from __future__ import annotations

import logging
import time

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from llmgw import contracts as c
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.controllers.replicas.backoff import ReplacementBackoff
from llmgw.reconciler.controllers.replicas.commands import CommandTracker
from llmgw.reconciler.controllers.runtime import Context, Controller, Heard, Result
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.ids import command_key
from llmgw.reconciler.state.model import ClusterState, Liveness

log = logging.getLogger(__name__)

PLACEMENTS = Counter("llmgw_reconciler_placements_total", "Placement events published", ["outcome"])
RETIREMENTS = Counter("llmgw_reconciler_replicas_retired_total", "Replicas retired")
COMMANDS = Counter("llmgw_reconciler_commands_total", "Commands sent to agents", ["kind", "send"])
DECIDE_SECONDS = Histogram(
    "llmgw_reconciler_decide_seconds",
    "Time to compute one reconcile plan (pure)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
OUTSTANDING = Gauge("llmgw_reconciler_commands_outstanding", "Commands not yet answered")


def orphan_stops(
    state: ClusterState,
    heard: dict[str, Heard],
    timings: reconcile.CommandTimings,
    *,
    term: int = 0,
) -> list[c.Message]:
    """Stops for engines a node reports running that the log does not give that node.

    A node declared lost and back without registering again still runs the
    shards the log marked failed (and replaced): like a kubelet killing pods no
    longer bound to it, they are stopped. Only for an alive node whose
    registration of this very boot is folded, so a shard it has just reported
    at registration is known, not an orphan.
    """
    out: list[c.Message] = []
    for node in sorted(heard):
        hb = heard[node]
        view = state.nodes.get(node)
        if view is None or view.liveness != Liveness.ALIVE or view.boot_id != hb.boot_id:
            continue
        for sid in sorted(hb.shards):
            if hb.shards[sid] in c.TERMINAL_SHARD_STATES:
                continue
            known = state.shards.get(sid)
            if known is not None and known.node == node and not known.terminal:
                continue
            out.append(
                c.StopShard(
                    # Its own key: the shard id may be another node's shard as well.
                    key=command_key(sid, f"stop-orphan@{node}"),
                    node=node,
                    shard_id=sid,
                    grace_seconds=timings.stop_grace,
                    term=term,
                    boot_id=hb.boot_id,
                )
            )
    return out


class ReplicaController(Controller):
    name = "replicas"
    watches = frozenset({ch.NODE, ch.SHARD, ch.REPLICA, ch.MODEL, ch.FAILURE, ch.SCALED})

    def __init__(self, ctx: Context, cfg):
        super().__init__(ctx)
        self.cfg = cfg
        self.resync = cfg.resync_interval
        self.clock = ctx.clock
        self.monotonic = ctx.monotonic
        self.commands = CommandTracker(cfg.command_retry_initial, cfg.command_retry_max)
        self.backoff = ReplacementBackoff(cfg.replace_backoff_initial, cfg.replace_backoff_max)
        self.timings = reconcile.CommandTimings(cfg.drain_deadline, cfg.stop_grace)
        self._awaiting_seq = 0  # our newest published control event's stream seq
        self._awaiting_since = 0.0
        self._warned_wait = False
        self._failed_at: dict[str, float] = {}

    async def stop(self) -> None:
        self.commands.clear()
        OUTSTANDING.set(0)

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        # `now` measures (retries, back-off, waits); `ts` only stamps what is published.
        now, ts = self.monotonic(), self.clock()
        self.backoff.observe(state, {ch.Change(ch.SHARD, k) for k in changes.keys(ch.SHARD)}, now)
        if self._waiting_for_fold(state, now):
            # Nothing new until our events are folded, and nothing re-sent that the
            # committed state no longer calls for.
            _, again = self.commands.sync(self._desired(state), now, ts, keep_new=False)
            await self._send(again, reissue=True)
            return self._requeue(now)
        t0 = time.perf_counter()
        plan = reconcile.decide(
            state,
            ts=ts,
            timings=self.timings,
            max_placements=self.cfg.max_placements_per_round,
            hold=self.backoff.held(now),
        )
        desired = self._desired(state, plan.commands)
        DECIDE_SECONDS.observe(time.perf_counter() - t0)
        events = [ev for ev in plan.events if not self._too_soon(state, ev, now)]
        for ev in events:
            seq = await self.ctx.publish(ev)
            if seq > self._awaiting_seq:
                self._awaiting_seq, self._awaiting_since = seq, self.monotonic()
            self._count(ev)
        # Commands follow from the state once these events are folded; until then only
        # what is still called for is re-sent (the tracker forgets the rest).
        new, again = self.commands.sync(desired, now, ts, keep_new=not events)
        await self._send(new, reissue=False)
        await self._send(again, reissue=True)
        return self._requeue(now)

    def _desired(
        self, state: ClusterState, planned: list[c.Message] | None = None
    ) -> list[c.Message]:
        if planned is None:
            planned = reconcile.commands(state, timings=self.timings)
        out = [self._fence(state, cmd) for cmd in planned]
        return out + orphan_stops(state, self.ctx.heard, self.timings, term=self.ctx.term)

    def _fence(self, state: ClusterState, cmd: c.Message) -> c.Message:
        node = state.nodes.get(cmd.node)  # type: ignore[attr-defined]
        boot = node.boot_id if node is not None else ""
        return msgspec.structs.replace(cmd, term=self.ctx.term, boot_id=boot)  # type: ignore[call-arg]

    def _requeue(self, now: float) -> Result:
        due = [t for t in (self.commands.next_due(), self.backoff.next_release(now)) if t]
        return Result(requeue_after=max(0.01, min(due) - now) if due else None)

    def _waiting_for_fold(self, state: ClusterState, now: float) -> bool:
        if state.last_seq >= self._awaiting_seq:
            self._warned_wait = False
            return False
        if now - self._awaiting_since > self.cfg.fold_wait_timeout and not self._warned_wait:
            # Deciding anyway would decide twice on the same gap: keep waiting, say so.
            log.warning(
                "fold still at seq %d, our events went up to %d: waiting for it",
                state.last_seq,
                self._awaiting_seq,
            )
            self._warned_wait = True
        return True

    def _too_soon(self, state: ClusterState, ev: c.Message, now: float) -> bool:
        """A restated failure within the interval: skipped (placement never reads failures)."""
        if not isinstance(ev, c.PlacementFailed) or ev.replica_id not in state.failures:
            return False
        last = self._failed_at.get(ev.replica_id)
        return last is not None and now - last < self.cfg.failure_restate_interval

    def _count(self, ev: c.Message) -> None:
        if isinstance(ev, c.PlacementDecided):
            PLACEMENTS.labels("adopted" if ev.adopted else "decided").inc()
            log.info("%s", ev.explanation)
        elif isinstance(ev, c.PlacementFailed):
            self._failed_at[ev.replica_id] = self.monotonic()
            PLACEMENTS.labels("failed").inc()
            log.warning("%s", ev.explanation)
        elif isinstance(ev, c.ReplicaRetired):
            RETIREMENTS.inc()
            log.info("retired %s: %s", ev.replica_id, ev.reason)

    async def _send(self, cmds: list[c.Message], *, reissue: bool) -> None:
        for cmd in cmds:
            await self.ctx.publish(cmd)
            COMMANDS.labels(type(cmd).__name__, "reissue" if reissue else "first").inc()
        OUTSTANDING.set(len(self.commands.outstanding))
