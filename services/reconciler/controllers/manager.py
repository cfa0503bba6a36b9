"""The acting half of the reconciler leader: a manager of small controllers.

The leader loop (the folding consumer that holds leadership) drives a
`Manager` through three calls:

    actor = Manager(ActorConfig())
    await actor.start(nc, js, state, term=term, gate=gate, synced_seq=seq)
    await actor.on_state_changed(state, changes)  # after each folded + committed batch
    await actor.stop()                            # on losing leadership, or at shutdown

`state` is the live `ClusterState` the fold mutates; `gate` (gate.py) is open
while it holds only committed events; `synced_seq` is how far the fold must
get before anyone acts (the term's own TermStarted event: everything logged
before this leader began). `changes` is what the batch changed.

The manager itself decides nothing. It runs one `Runner` (runtime.py) per
controller, each level-triggered with its own wake, resync period and
back-off:

  - liveness (liveness/controller.py): heartbeats in; node unreachable / lost /
    recovered out;
  - replicas (replicas/controller.py): placement, retirement, adoption, and
    the commands that carry them out;
  - projection (projection/controller.py): the routers' KV buckets;
  - autoscale (autoscale/controller.py): routers' demand in, ModelScaled out;
  - lora (lora/controller.py): routers' demand per adapter in, AdaptersPlaced and
    the SetShardAdapters that carry it out.

A failure in one (a KV write refused) backs that one off; the others go on.
Every control event goes back into the log and the fold applies it like any
other, so the state only ever comes from the log. To add a controller, write
a `Controller` subclass and add its factory to `CONTROLLERS` (or pass
`controllers=` to `Manager`): see docs/reconciler.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from llmgw import config
from llmgw.reconciler.controllers.autoscale.controller import AutoscaleController
from llmgw.reconciler.controllers.liveness.controller import LivenessController
from llmgw.reconciler.controllers.liveness.tracker import LivenessTracker
from llmgw.reconciler.controllers.lora.controller import LoraController
from llmgw.reconciler.controllers.projection.controller import ProjectionController
from llmgw.reconciler.controllers.projection.writer import KvProjection
from llmgw.reconciler.controllers.replicas.controller import ReplicaController
from llmgw.reconciler.controllers.runtime import Context, Controller, Runner
from llmgw.reconciler.intake.gate import CommitGate
from llmgw.reconciler.state.changes import Change, ChangeSet
from llmgw.reconciler.state.model import ClusterState

log = logging.getLogger(__name__)


class ActorConfig(config.ConfigStruct, kw_only=True):
    """Timings of the acting leader (seconds). A section of the reconciler's config."""

    unreachable_after: float = 10.0  # no heartbeat this long: node unreachable
    lost_after: float = 30.0  # no heartbeat this long: node lost, its shards count as gone
    liveness_tick: float = 0.5  # how often silence is checked
    command_retry_initial: float = 2.0  # first re-issue of an unanswered command
    command_retry_max: float = 30.0  # backoff cap
    resync_interval: float = 2.0  # level-triggered reconcile even without changes
    # Our own events not folded after this long: say so (decisions keep waiting for them).
    fold_wait_timeout: float = 30.0
    # How often the KV projection is re-read and whatever drifted rewritten.
    projection_resync_interval: float = 30.0
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
    # How often the autoscaler evaluates the routers' demand summaries.
    autoscale_tick: float = 1.0
    # How often the LoRA placement weighs the demand per adapter (docs/reconciler.md).
    lora_tick: float = 1.0


ControllerFactory = Callable[[Context, ActorConfig], Controller]

# The controllers every leader runs, in start order.
CONTROLLERS: tuple[ControllerFactory, ...] = (
    LivenessController,
    ReplicaController,
    ProjectionController,
    AutoscaleController,
    LoraController,
)


class Manager:
    """The controller manager: runs the controllers while this process is the leader."""

    def __init__(
        self,
        cfg: ActorConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        controllers: tuple[ControllerFactory, ...] | None = None,
    ):
        self.cfg = cfg or ActorConfig()
        self.clock = clock  # wall clock: stamps events and commands, never measures time
        self.monotonic = monotonic  # measures: silence, retries, back-off, waits
        self.factories = CONTROLLERS if controllers is None else controllers
        self.ctx: Context | None = None
        self.controllers: list[Controller] = []
        self.runners: list[Runner] = []
        self._tasks: list[asyncio.Task] = []

    def controller(self, name: str) -> Controller | None:
        return next((c for c in self.controllers if c.name == name), None)

    @property
    def projection(self) -> KvProjection | None:
        ctl = self.controller("projection")
        return ctl.projection if isinstance(ctl, ProjectionController) else None

    @property
    def liveness(self) -> LivenessTracker | None:
        ctl = self.controller("liveness")
        return ctl.tracker if isinstance(ctl, LivenessController) else None

    async def start(
        self,
        nc: NATS,
        js: JetStreamContext,
        state: ClusterState,
        *,
        term: int = 0,
        gate: CommitGate | None = None,
        synced_seq: int = 0,
    ) -> None:
        log.info("acting as leader (term %d) from seq %d", term, state.last_seq)
        self.ctx = Context(
            nc=nc,
            js=js,
            term=term,
            gate=gate or CommitGate(),
            clock=self.clock,
            monotonic=self.monotonic,
            synced_seq=synced_seq,
            state=state,
        )
        self.controllers = [make(self.ctx, self.cfg) for make in self.factories]
        try:
            for ctl in self.controllers:
                await ctl.start()
        except BaseException:
            await self._stop_controllers()
            raise
        self.runners = [Runner(ctl) for ctl in self.controllers]
        self._tasks = [
            asyncio.create_task(r.run(), name=f"controller-{r.controller.name}")
            for r in self.runners
        ]

    async def on_state_changed(self, state: ClusterState, changes: Iterable[Change]) -> None:
        """A batch was folded and committed: tell the controllers that watch what changed.

        `changes` is what the fold reported for the batch; it is typed here, once.
        """
        if self.ctx is None:
            return
        self.ctx.folded(state)
        batch = ChangeSet(changes)
        for runner in self.runners:
            runner.offer(batch)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await self._stop_controllers()
        log.info("stopped acting")

    async def _stop_controllers(self) -> None:
        for ctl in reversed(self.controllers):
            try:
                await asyncio.wait_for(ctl.stop(), timeout=5.0)
            except Exception:
                log.exception("%s controller did not stop cleanly", ctl.name)
