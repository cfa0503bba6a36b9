"""The acting half of the reconciler leader: decisions, liveness, commands, projection.

The leader loop (part 1: the folding consumer that holds leadership) drives an
`Actor` through three calls:

    actor = Actor(ActorConfig())
    await actor.start(nc, js, state)              # on becoming leader
    await actor.on_state_changed(state, changes)  # after each folded + committed batch
    await actor.stop()                            # on losing leadership, or at shutdown

`state` is the live `ClusterState` the fold mutates; `changes` is the union of
what `fold.apply()` returned for the batch. The actor never mutates `state`.
It owns its background tasks (heartbeat watcher, liveness ticker, command
re-issue, the reconcile loop) and cancels them in `stop()`, which returns
within a bounded time.

Everything the actor decides goes back into the log as an event published with
`bus.publish` (placement decided / failed, replica retired, node unreachable /
lost / recovered); the fold then applies it like any other event, so the state
only ever comes from the log. Commands (start / stop / drain shard) go to
`subjects.commands(node)`. The KV projection for routers is written from the
state after every change.

`on_state_changed` is cheap: it wakes the reconcile loop and returns, so a slow
NATS round trip never stalls the fold. The loop computes every decision with a
pure function over the state (no await in between, so the state it reads is one
consistent snapshot), then does the I/O. After publishing control events it
waits until the fold has caught up with them before deciding again, so it
never decides twice on the same gap.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from llmgw import config

from .fold import Change
from .state import ClusterState

log = logging.getLogger(__name__)


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


class Actor:
    """Acts on the folded state while this process is the leader."""

    def __init__(self, cfg: ActorConfig | None = None):
        self.cfg = cfg or ActorConfig()
        self._tasks: list[asyncio.Task] = []

    async def start(self, nc: NATS, js: JetStreamContext, state: ClusterState) -> None:
        log.info("acting as leader from seq %d", state.last_seq)

    async def on_state_changed(self, state: ClusterState, changes: set[Change]) -> None:
        pass

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
