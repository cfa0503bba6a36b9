"""What the agent tells the control plane, delivered in order and never dropped.

Shard status and registrations are the reconciler's only view of this node, so each
stays queued until JetStream has stored it, and they leave in the order they were
written: a `ready` must not overtake the `loading` before it. A failed publish (a
disconnect, a missing stream) is retried with backoff at the head of the queue.
Heartbeats and load samples are not queued here: the next one replaces a lost one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Awaitable, Callable

from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError

from llmgw import bus
from llmgw import contracts as c

from .state import ShardRecord
from .telemetry import AgentMetrics

log = logging.getLogger(__name__)


def status_of(node: str, rec: ShardRecord, command_key: str | None = None) -> c.ShardStatus:
    """The shard's status as its record stands, answering `command_key` (by default the
    latest command it answers)."""
    key = rec.command_key if command_key is None else command_key
    return rec.as_contract(c.ShardStatus, node=node, command_key=key)


class Outbox:
    """The agent's queue of shard status and registrations; `publish` is the task that
    empties it (the agent owns and cancels that task)."""

    def __init__(
        self,
        node: str,
        metrics: AgentMetrics,
        registered: asyncio.Event,
        ensure_streams: Callable[[], Awaitable[None]],
    ):
        self.node = node
        self.metrics = metrics
        self.registered = registered  # set here once a registration is stored
        self.ensure_streams = ensure_streams  # when a publish finds no stream
        self._queue: collections.deque[c.Message] = collections.deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def enqueue(self, msg: c.Message) -> None:
        self._queue.append(msg)
        self._ready.set()

    def emit(self, rec: ShardRecord) -> None:
        """Queue the shard's status as its record now stands."""
        self.enqueue(status_of(self.node, rec))

    async def publish(self, js: JetStreamContext) -> None:
        """Publish the queue in order; a message leaves it only once JetStream stored it."""
        delay = 0.1
        while True:
            if not self._queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            msg = self._queue[0]
            try:
                await bus.publish(js, msg, deadline=5.0)
            except Exception as exc:  # disconnected, stream missing...: keep it and retry
                log.warning("publishing %s failed (%s); retrying", type(msg).__name__, exc)
                what = "registration" if isinstance(msg, c.NodeRegistered) else "status"
                self.metrics.publish_failures.labels(what).inc()
                if isinstance(exc, NoStreamResponseError):
                    await self.ensure_streams()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            self._queue.popleft()
            if isinstance(msg, c.NodeRegistered):
                self.registered.set()
