"""Liveness controller: heartbeats in, node unreachable / lost / recovered events out.

Watches: node changes (a registration is a sign of life as good as a
heartbeat). Resync: every `liveness_tick`, since silence is what it judges.
The judging itself is `LivenessTracker` (liveness.py); this controller feeds
it heartbeats as they arrive and the stored latest heartbeats at term start,
publishes the transitions it calls for, and keeps the latest heartbeat of
each node (its boot id and shard list) in `Context.heard`, where the replica
controller finds the engines a node runs that the log no longer gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js import api as jsapi
from prometheus_client import Counter, Gauge

from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.controllers.liveness.tracker import LivenessTracker
from llmgw.reconciler.controllers.runtime import Context, Controller, Heard, Result
from llmgw.reconciler.state import changes as ch
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState, Liveness

log = logging.getLogger(__name__)

LIVENESS_EVENTS = Counter(
    "llmgw_reconciler_liveness_transitions_total", "Node liveness transitions", ["to"]
)
NODES = Gauge("llmgw_reconciler_nodes", "Nodes by liveness", ["liveness"])

_heartbeat = msgspec.json.Decoder(c.Heartbeat)


class LivenessController(Controller):
    name = "liveness"
    watches = frozenset({ch.NODE})

    def __init__(self, ctx: Context, cfg):
        super().__init__(ctx)
        self.cfg = cfg
        self.resync = cfg.liveness_tick
        self.clock = ctx.clock  # wall: stamps the events, says when a node was last heard
        self.monotonic = ctx.monotonic  # measures silence: a wall-clock step must not
        self.tracker = LivenessTracker(
            cfg.unreachable_after,
            cfg.lost_after,
            started_at=self.monotonic(),
            pending_timeout=cfg.fold_wait_timeout,
        )
        self._registered = {n: v.registered_seq for n, v in ctx.state.nodes.items()}
        self._sub = None
        self._last_pass: float | None = None  # monotonic

    async def start(self) -> None:
        # Watch first, then read the stored latest: no heartbeat falls between the two.
        self._sub = await self.ctx.nc.subscribe(s.HEARTBEATS_ALL, cb=self._on_heartbeat)
        await self._rebuild_last_seen()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_heartbeat(self, msg: Msg) -> None:
        node = s.node_of_subject(msg.subject)
        if not node:
            return
        now = self.monotonic()
        self.tracker.seen(node, now, self.clock())
        try:
            hb = _heartbeat.decode(msg.data)
        except msgspec.DecodeError:
            return  # still a sign of life; its shard list is not usable
        if hb.node == node:
            self.ctx.heard[node] = Heard(boot_id=hb.boot_id, shards=dict(hb.shards), at=now)

    async def _rebuild_last_seen(self) -> None:
        """Read the newest stored heartbeat of each node: when it was last heard, for reports."""
        js = self.ctx.js
        try:
            info = await js.stream_info(s.HEARTBEATS_STREAM)
        except Exception as exc:  # no stream yet: nothing to rebuild from
            log.warning("cannot read %s: %s", s.HEARTBEATS_STREAM, exc)
            return
        if not info.state.messages:
            return
        sub = await js.subscribe(
            s.HEARTBEATS_ALL,
            ordered_consumer=True,
            deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT,
        )
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + self.cfg.heartbeat_rebuild_timeout
        count = 0
        try:
            while loop.time() < stop_at:
                try:
                    msg = await sub.next_msg(timeout=max(0.1, min(1.0, stop_at - loop.time())))
                except TimeoutError:
                    break
                node = s.node_of_subject(msg.subject)
                if node:
                    # The server's clock: reported, never taken as proof of life.
                    self.tracker.remember(node, msg.metadata.timestamp.timestamp())
                    count += 1
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        log.info("rebuilt last-seen of %d nodes from stored heartbeats", count)

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        now, wall = self.monotonic(), self.clock()
        for name in changes.keys(ch.NODE):
            view = state.nodes.get(name)
            if view is not None and view.registered_seq > self._registered.get(name, 0):
                # A registration is a sign of life as good as a heartbeat.
                self._registered[name] = view.registered_seq
                self.tracker.seen(name, now, wall)
        mono = time.monotonic()
        if self._last_pass is not None:
            late = mono - self._last_pass - self.resync
            if late > self.cfg.stall_grace_after:
                log.warning("event loop stalled %.1fs: counting node silence from now", late)
                self.tracker.grace(now)
        self._last_pass = mono
        nc = self.ctx.nc
        was_deaf = self.tracker.deaf
        if not self.tracker.listening(nc is not None and nc.is_connected, now):
            if not was_deaf:
                log.warning("NATS connection down: node silence is not judged until it returns")
            return Result()
        if was_deaf:
            log.info("NATS connection back: counting node silence from now")
        for ev in self.tracker.check(state, now, wall):
            await self.ctx.publish(ev)
            LIVENESS_EVENTS.labels(type(ev).__name__.removeprefix("Node").lower()).inc()
            log.warning("node %s: %s", ev.node, type(ev).__name__)
        for lv in Liveness:
            NODES.labels(lv.value).set(sum(v.liveness == lv for v in state.nodes.values()))
        return Result()
