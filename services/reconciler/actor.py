"""The acting half of the reconciler leader: decisions, liveness, commands, projection.

The leader loop (the folding consumer that holds leadership) drives an `Actor`
through three calls:

    actor = Actor(ActorConfig())
    await actor.start(nc, js, state)              # on becoming leader
    await actor.on_state_changed(state, changes)  # after each folded + committed batch
    await actor.stop()                            # on losing leadership, or at shutdown

`state` is the live `ClusterState` the fold mutates; `changes` is the union of
what `fold.apply()` returned for the batch. The actor never mutates `state`.
It owns its background tasks (heartbeat watcher, liveness ticker, the
reconcile loop that also re-issues commands) and cancels them in `stop()`,
which returns within a bounded time.

Everything the actor decides goes back into the log as an event published with
`bus.publish` (placement decided / failed, replica retired, node unreachable /
lost / recovered); the fold then applies it like any other event, so the state
only ever comes from the log. Commands (start / stop / drain shard) go to
`subjects.commands(node)`. The KV projection for routers is written from the
state after every change.

`on_state_changed` is cheap: it wakes the reconcile loop and returns, so a slow
NATS round trip never stalls the fold. The loop computes every decision with a
pure function over the state (no await in between, so what it reads is one
consistent snapshot), then does the I/O. After publishing control events it
waits until the fold has caught up with them before deciding again, so it
never decides twice on the same gap; their message ids are deterministic, so
even a second leader deciding the same thing is deduplicated by the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from prometheus_client import Counter, Gauge, Histogram

from llmgw import bus, config
from llmgw import contracts as c
from llmgw import subjects as s

from . import reconcile
from .autoscaler import AutoscaleController
from .backoff import ReplacementBackoff
from .commands import CommandTracker
from .fold import Change
from .liveness import LivenessTracker
from .projection_kv import KvProjection
from .state import ClusterState, Liveness

log = logging.getLogger(__name__)

PLACEMENTS = Counter("llmgw_reconciler_placements_total", "Placement events published", ["outcome"])
RETIREMENTS = Counter("llmgw_reconciler_replicas_retired_total", "Replicas retired")
LIVENESS_EVENTS = Counter(
    "llmgw_reconciler_liveness_transitions_total", "Node liveness transitions", ["to"]
)
COMMANDS = Counter("llmgw_reconciler_commands_total", "Commands sent to agents", ["kind", "send"])
KV_WRITES = Counter("llmgw_reconciler_kv_writes_total", "Projection keys written or deleted")
DECIDE_SECONDS = Histogram(
    "llmgw_reconciler_decide_seconds",
    "Time to compute one reconcile plan (pure)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
OUTSTANDING = Gauge("llmgw_reconciler_commands_outstanding", "Commands not yet answered")
NODES = Gauge("llmgw_reconciler_nodes", "Nodes by liveness", ["liveness"])


class ActorConfig(config.ConfigStruct, kw_only=True):
    """Timings of the acting leader (seconds). A section of the reconciler's config."""

    unreachable_after: float = 10.0  # no heartbeat this long: node unreachable
    lost_after: float = 30.0  # no heartbeat this long: node lost, its shards count as gone
    liveness_tick: float = 0.5  # how often silence is checked
    command_retry_initial: float = 2.0  # first re-issue of an unanswered command
    command_retry_max: float = 30.0  # backoff cap
    resync_interval: float = 2.0  # level-triggered reconcile even without changes
    fold_wait_timeout: float = 30.0  # give up waiting for our own events to be folded
    drain_deadline: float = 60.0  # DrainShard.deadline_seconds
    stop_grace: float = 10.0  # StopShard.grace_seconds
    heartbeat_rebuild_timeout: float = 10.0  # reading the latest heartbeats at leader start
    # A replica that still cannot be placed gets its changed verdicts restated at most this
    # often: in a busy fleet the free-GPU counts in them change with every shard.
    failure_restate_interval: float = 10.0
    # Placement attempts per plan: a large catalog change is decided in short plans, so
    # the event loop (and with it heartbeat intake) never stalls for long.
    max_placements_per_round: int = 50
    # A liveness tick this late means the loop stalled and heartbeats may sit unread:
    # silence is then counted from the end of the stall, not from the last heartbeat.
    stall_grace_after: float = 2.0
    # A model whose shards fail on live nodes waits this long (doubling per failure, up
    # to the cap) before its next placement; a ready shard resets it.
    replace_backoff_initial: float = 5.0
    replace_backoff_max: float = 300.0


class Actor:
    """Acts on the folded state while this process is the leader."""

    def __init__(
        self,
        cfg: ActorConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg or ActorConfig()
        self.clock = clock  # wall clock: stamps events and commands, never measures time
        self.monotonic = monotonic  # measures: silence, retries, back-off, waits
        self._tasks: list[asyncio.Task] = []
        self._sub = None
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._state = ClusterState()
        self._changes: set[Change] = set()
        self._wake = asyncio.Event()
        self._awaiting_seq = 0  # our newest published control event's stream seq
        self._awaiting_since = 0.0
        self._registered: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self.liveness = LivenessTracker(self.cfg.unreachable_after, self.cfg.lost_after, 0.0)
        self.commands = CommandTracker(self.cfg.command_retry_initial, self.cfg.command_retry_max)
        self.backoff = ReplacementBackoff(
            self.cfg.replace_backoff_initial, self.cfg.replace_backoff_max
        )
        self.projection: KvProjection | None = None
        self.timings = reconcile.CommandTimings(self.cfg.drain_deadline, self.cfg.stop_grace)
        self.autoscaler = AutoscaleController(clock=clock)

    # ------------------------------------------------------------ the seam

    async def start(self, nc: NATS, js: JetStreamContext, state: ClusterState) -> None:
        started = self.monotonic()
        log.info("acting as leader from seq %d", state.last_seq)
        self._nc = nc
        self._js = js
        self._state = state
        self._changes = set()
        self._awaiting_seq = 0
        self._registered = {n: v.registered_seq for n, v in state.nodes.items()}
        self.liveness = LivenessTracker(
            self.cfg.unreachable_after,
            self.cfg.lost_after,
            started_at=started,
            pending_timeout=self.cfg.fold_wait_timeout,
        )
        self.commands.clear()
        # Watch first, then read the stored latest: no heartbeat falls between the two.
        self._sub = await nc.subscribe(s.HEARTBEATS_ALL, cb=self._on_heartbeat)
        await self._rebuild_last_seen(js)
        self.projection = KvProjection(js)
        await self.projection.load()
        await self.projection.sync_all(state)
        self._wake.set()
        self._tasks = [
            asyncio.create_task(self._reconcile_loop(), name="actor-reconcile"),
            asyncio.create_task(self._liveness_loop(), name="actor-liveness"),
            asyncio.create_task(
                self.autoscaler.run(nc, lambda: self._state, self._publish_event),
                name="actor-autoscale",
            ),
        ]

    async def on_state_changed(self, state: ClusterState, changes: set[Change]) -> None:
        self._state = state
        self._changes |= changes
        now = self.monotonic()
        self.backoff.observe(state, changes, now)
        for kind, name in changes:
            view = state.nodes.get(name) if kind == "node" else None
            if view is not None and view.registered_seq > self._registered.get(name, 0):
                # A registration is a sign of life as good as a heartbeat.
                self._registered[name] = view.registered_seq
                self.liveness.seen(name, now, self.clock())
        self._wake.set()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        self.commands.clear()
        OUTSTANDING.set(0)
        log.info("stopped acting")

    # ------------------------------------------------------------ liveness

    async def _on_heartbeat(self, msg: Msg) -> None:
        # The subject names the node: no need to decode a payload per heartbeat.
        node = s.node_of_subject(msg.subject)
        if node:
            self.liveness.seen(node, self.monotonic(), self.clock())

    async def _rebuild_last_seen(self, js: JetStreamContext) -> None:
        """Read the newest stored heartbeat of each node: when it was last heard, for reports."""
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
                    self.liveness.remember(node, msg.metadata.timestamp.timestamp())
                    count += 1
                if msg.metadata.num_pending == 0:
                    break
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        log.info("rebuilt last-seen of %d nodes from stored heartbeats", count)

    async def _liveness_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.cfg.liveness_tick
            await asyncio.sleep(self.cfg.liveness_tick)
            late = loop.time() - due
            if late > self.cfg.stall_grace_after:
                log.warning("event loop stalled %.1fs: counting node silence from now", late)
                self.liveness.grace(self.monotonic())
            connected = self._nc is not None and self._nc.is_connected
            was_deaf = self.liveness.deaf
            if not self.liveness.listening(connected, self.monotonic()):
                if not was_deaf:
                    log.warning("NATS connection down: node silence is not judged until it returns")
                continue
            if was_deaf:
                log.info("NATS connection back: counting node silence from now")
            try:
                state = self._state
                events = self.liveness.check(state, self.monotonic(), self.clock())
                for ev in events:
                    await self._publish_event(ev)
                    LIVENESS_EVENTS.labels(type(ev).__name__.removeprefix("Node").lower()).inc()
                    log.warning("node %s: %s", ev.node, type(ev).__name__)
                for lv in Liveness:
                    NODES.labels(lv.value).set(sum(v.liveness == lv for v in state.nodes.values()))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("liveness check failed; retrying next tick")

    # ------------------------------------------------------------ reconcile

    async def _reconcile_loop(self) -> None:
        while True:
            timeout = self.cfg.resync_interval
            now = self.monotonic()
            for due in (self.commands.next_due(), self.backoff.next_release(now)):
                if due is not None:
                    timeout = max(0.01, min(timeout, due - now))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            self._wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile round failed; retrying")
                await asyncio.sleep(min(1.0, self.cfg.resync_interval))
                self._wake.set()

    def _waiting_for_fold(self, state: ClusterState) -> bool:
        if state.last_seq >= self._awaiting_seq:
            return False
        if self.monotonic() - self._awaiting_since > self.cfg.fold_wait_timeout:
            log.warning(
                "fold still at seq %d, our events went up to %d: deciding anyway",
                state.last_seq,
                self._awaiting_seq,
            )
            return False
        return True

    async def _round(self) -> None:
        state = self._state
        changes, self._changes = self._changes, set()
        if self.projection is not None and changes:
            before = self.projection.writes
            try:
                await self.projection.sync(state, changes)
            except Exception:
                self._changes |= changes  # write them next round
                raise
            finally:
                KV_WRITES.inc(self.projection.writes - before)

        state = self._state
        if self._waiting_for_fold(state):
            await self._send(self.commands.due(self.monotonic(), self.clock()), reissue=True)
            return
        t0 = time.perf_counter()
        plan = reconcile.decide(
            state,
            ts=self.clock(),
            timings=self.timings,
            max_placements=self.cfg.max_placements_per_round,
            hold=self.backoff.held(self.monotonic()),
        )
        DECIDE_SECONDS.observe(time.perf_counter() - t0)
        events = [ev for ev in plan.events if not self._too_soon(state, ev)]
        for ev in events:
            await self._publish_event(ev)
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
        if events:
            # Commands follow from the state once these events are folded.
            await self._send(self.commands.due(self.monotonic(), self.clock()), reissue=True)
            return
        new, again = self.commands.sync(plan.commands, self.monotonic(), self.clock())
        await self._send(new, reissue=False)
        await self._send(again, reissue=True)

    def _too_soon(self, state: ClusterState, ev: c.Message) -> bool:
        """A restated failure within the interval: skipped (placement never reads failures)."""
        if not isinstance(ev, c.PlacementFailed) or ev.replica_id not in state.failures:
            return False
        last = self._failed_at.get(ev.replica_id)
        return last is not None and self.monotonic() - last < self.cfg.failure_restate_interval

    async def _publish_event(self, ev: c.Message) -> int:
        assert self._js is not None
        ack = await bus.publish(self._js, ev)
        if ack.seq > self._awaiting_seq:
            self._awaiting_seq = ack.seq
            self._awaiting_since = self.monotonic()
        return ack.seq

    async def _send(self, cmds: list[c.Message], *, reissue: bool) -> None:
        assert self._js is not None
        for cmd in cmds:
            await bus.publish(self._js, cmd)
            COMMANDS.labels(type(cmd).__name__, "reissue" if reissue else "first").inc()
        OUTSTANDING.set(len(self.commands.outstanding))
