"""The controller interface and the loop that runs one controller.

Each controller is one small, level-triggered reconciler in the manner of
controller-runtime: it says which kinds of fold change wake it (`watches`),
how often it runs anyway (`resync`), and `reconcile(state, changes)` makes
the world match the committed state a little more and returns a `Result`
(`requeue_after`: run again that soon even without news). It never mutates
the state; what it decides goes back into the log (control events) or out to
agents and routers (commands, KV records).

    class MyController(Controller):
        name = "mine"
        watches = frozenset({changes.MODEL})
        resync = 10.0

        async def reconcile(self, state, changes) -> Result:
            plan = decide_something(state)     # pure, no await before it
            await self.ctx.publish(...)        # then the I/O
            return Result()

`Runner` drives one controller: it waits for a wake (a watched change), a
requeue or the resync period; waits until the cache is synced (the fold has
caught up with the log as of the term's start) and the state is committed
(`CommitGate`); then calls `reconcile` with the changes gathered since the
last call. If `reconcile` raises, the changes are kept for the next call and
the runner backs off exponentially (per controller: a failing KV write never
holds placement back). Controllers are started and stopped together by the
`Manager` (manager.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from llmgw import bus
from llmgw import contracts as c
from llmgw.reconciler.controllers.demand import DemandIntake
from llmgw.reconciler.intake.gate import CommitGate
from llmgw.reconciler.state.changes import ChangeSet, Kind
from llmgw.reconciler.state.model import ClusterState

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What a reconcile pass asks of its runner (controller-runtime's ctrl.Result)."""

    requeue_after: float | None = None  # seconds; None: wait for a change or the resync


@dataclass
class Heard:
    """The latest heartbeat of a node, as the liveness controller heard it."""

    boot_id: str
    shards: dict[str, c.ShardState]
    at: float


@dataclass
class Context:
    """What every controller of one leader term shares."""

    nc: NATS
    js: JetStreamContext
    term: int
    gate: CommitGate
    clock: Callable[[], float]  # wall clock: stamps events and commands, never measures
    monotonic: Callable[[], float] = time.monotonic  # measures: silence, retries, waits
    synced_seq: int = 0  # the fold must reach this seq before anyone acts
    state: ClusterState = field(default_factory=ClusterState)
    # node -> its latest heartbeat (written by the liveness controller, read by others).
    heard: dict[str, Heard] = field(default_factory=dict)
    # The routers' demand summaries (one subscription, read by autoscale and LoRA placement).
    demand: DemandIntake | None = None
    _folded: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.demand is None:
            self.demand = DemandIntake(self.monotonic)

    def synced(self) -> bool:
        return self.state.last_seq >= self.synced_seq

    async def committed(self) -> ClusterState:
        """The state once the cache is synced and holds only committed events.

        Read it before the next await: once you await, the fold may move on.
        """
        while not self.synced():
            self._folded.clear()
            try:
                await asyncio.wait_for(self._folded.wait(), timeout=30.0)
            except TimeoutError:
                log.warning(
                    "the fold is at seq %d, not yet at %d where this term began: waiting",
                    self.state.last_seq,
                    self.synced_seq,
                )
        await self.gate.wait_open()
        return self.state

    def folded(self, state: ClusterState) -> None:
        self.state = state
        self._folded.set()

    async def publish(self, ev: c.Message) -> int:
        """Publish a control event stamped with this term; its stream seq."""
        if hasattr(ev, "term") and ev.term != self.term:  # type: ignore[attr-defined]
            ev = msgspec.structs.replace(ev, term=self.term)  # type: ignore[call-arg]
        ack = await bus.publish(self.js, ev)
        return ack.seq


class Controller:
    """Base class: override `reconcile`; `start` / `stop` for subscriptions."""

    name: str = "controller"
    watches: frozenset[Kind] = frozenset()
    resync: float = 10.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0

    def __init__(self, ctx: Context):
        self.ctx = ctx
        # Runs a pass soon, for news that does not come through the fold (a message it
        # subscribed to); its runner sets it. Before that, news has nobody to wake.
        self.wake_now: Callable[[], None] = lambda: None

    async def start(self) -> None:
        """Set up before the first reconcile (subscribe, read what is there)."""

    async def reconcile(self, state: ClusterState, changes: ChangeSet) -> Result:
        raise NotImplementedError

    async def stop(self) -> None:
        """Undo `start`; called after the runner's task has ended."""


class Runner:
    """Runs one controller until cancelled: wake, resync, back-off."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.pending = ChangeSet()
        self.wake = asyncio.Event()
        self.wake.set()  # the first pass runs as soon as the cache is synced
        controller.wake_now = self.wake.set
        self.failures = 0
        self.passes = 0

    def offer(self, changes: ChangeSet) -> None:
        """Changes from one folded batch: keep those it watches, wake it if any."""
        mine = changes.only(self.controller.watches)
        if mine:
            self.pending.update(mine)
            self.wake.set()

    async def run(self) -> None:
        ctl = self.controller
        delay: float = ctl.resync
        while True:
            if self.failures:
                await asyncio.sleep(delay)  # backing off: news waits too
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, delay))
            self.wake.clear()
            state = await ctl.ctx.committed()
            changes, self.pending = self.pending, ChangeSet()
            started = time.monotonic()
            try:
                result = await ctl.reconcile(state, changes)
            except asyncio.CancelledError:
                self.pending.update(changes)
                raise
            except Exception:
                self.pending.update(changes)  # not done: the next pass sees them again
                self.failures += 1
                delay = min(ctl.backoff_max, ctl.backoff_initial * 2 ** (self.failures - 1))
                log.exception("%s controller failed; retrying in %.1fs", ctl.name, delay)
                continue
            self.failures = 0
            self.passes += 1
            took = time.monotonic() - started
            if took > 1.0:
                log.info("%s controller pass took %.1fs", ctl.name, took)
            delay = ctl.resync
            if result.requeue_after is not None:
                delay = min(delay, result.requeue_after)
