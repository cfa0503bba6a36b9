"""Engines' KV events from the bus into the router's BlockIndex (kvindex.py).

Subscribes to `llmgw.kv.>` (core NATS); each `KvEvents` names its shard, the
replica's serving shard (`EndpointView.by_shard` finds its endpoint; its URL is
the fallback, as for load samples).
When the index asks for it (a first batch, a gap, a new epoch) the feed requests
that engine's snapshot from its agent (`llmgw.kvsnap.<node>.<shard>`, request/reply
with a deadline) and replays what arrived meanwhile. Endpoints that appear in the
projection get a snapshot request too, so an idle engine's cache is known before
its next event; endpoints that leave it have their blocks dropped.

One task per endpoint being synced, owned here and cancelled on stop or when the
endpoint leaves; it asks again after a failed or timed-out request on its own timer
(`retry_seconds`, doubling up to `max_retry_seconds`), not at the engine's next event:
an idle engine may send none for hours. Batches that arrive meanwhile stay buffered
in the index and are replayed on top of the snapshot that finally comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from llmgw import contracts as c
from llmgw import projection, subjects
from llmgw.engines import ENGINES
from llmgw.router.endpoints.view import EndpointRuntime, EndpointView
from llmgw.router.kvcache.index import BlockIndex

log = logging.getLogger(__name__)

# The engines whose events agents relay: their endpoints' snapshots are asked for.
_RELAYED_ENGINES = frozenset(name for name, t in ENGINES.items() if t.kv_events)


class KvEventFeed:
    def __init__(
        self,
        view: EndpointView,
        index: BlockIndex,
        nc,
        *,
        request_timeout: float = 2.0,
        retry_seconds: float = 5.0,
        max_retry_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        metrics=None,
    ):
        self.view = view
        self.index = index
        self.nc = nc
        self.request_timeout = request_timeout
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.clock = clock
        self.metrics = metrics  # RouterMetrics, or None
        self.malformed = 0
        self.unknown = 0
        self.foreign = 0  # batches whose subject, payload and endpoint disagree on the node
        self._tasks: dict[str, asyncio.Task] = {}
        # Per endpoint whose last request failed: (when, how long to wait before the next).
        self._failed_at: dict[str, tuple[float, float]] = {}
        self._sub = None
        self._sweeper: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self._on_msg)
        self.view.subscribe(self.endpoints_changed)
        self.endpoints_changed()

    async def stop(self) -> None:
        self._stopped = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        tasks = list(self._tasks.values())
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the projection ------------------------------------------------------------------

    def endpoints_changed(self) -> None:
        endpoints = self.view.endpoints
        for ep_id in [e for e in self.index.endpoints if e not in endpoints]:
            self.index.drop(ep_id)
            self._failed_at.pop(ep_id, None)
            task = self._tasks.pop(ep_id, None)
            if task is not None:
                task.cancel()
        if self._stopped:
            return
        self._maybe_sweep()
        for ep in endpoints.values():
            if (
                ep.spec.engine in _RELAYED_ENGINES
                and ep.spec.node
                and ep.id not in self.index.endpoints
                and self.index.resync(ep.id)
            ):
                self._fetch(ep.spec.node, ep.id)

    # -- events --------------------------------------------------------------------------

    def endpoint_for(self, batch: c.KvEvents) -> EndpointRuntime | None:
        return self.view.endpoint_of(batch.shard_id, batch.url)

    async def _on_msg(self, msg) -> None:
        result = self.handle(msg.data, msg.subject)
        if self.metrics is not None:
            self.metrics.kv_events.inc((result,))
            self.metrics.kv_index_blocks.set((), float(len(self.index)))

    def handle(self, raw: bytes, subject: str) -> str:
        """One `KvEvents` message: "applied", "resync", "unknown", "foreign" or "malformed".

        A batch counts only when the node of the subject it came on, the node it names
        and the node of the endpoint it names agree: the subject is what NATS
        permissions tie to a node's agent, so one node cannot write another's blocks.
        """
        try:
            batch = c.decode(raw, c.KvEvents)
        except c.ContractError as exc:
            self.malformed += 1
            if self.malformed == 1 or self.malformed % 1000 == 0:
                log.warning("skipped malformed KV events (%d so far): %s", self.malformed, exc)
            return "malformed"
        ep = self.endpoint_for(batch)
        if ep is None:
            self.unknown += 1
            return "unknown"
        node = ep.spec.node
        if not node or batch.node != node or subjects.node_of_subject(subject) != node:
            self.foreign += 1
            if self.foreign == 1 or self.foreign % 1000 == 0:
                log.warning(
                    "dropped KV events for %s (on node %r) sent as node %r on %s",
                    ep.id,
                    node,
                    batch.node,
                    subject,
                )
            return "foreign"
        if self.index.offer(ep.id, batch):
            self._fetch(node, ep.id)
            return "resync"
        self._maybe_sweep()  # a batch may have cleared the engine's blocks
        return "applied"

    def _maybe_sweep(self) -> None:
        if self.index.needs_sweep and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Forgotten blocks out of the index, a chunk per turn of the event loop."""
        while not self.index.sweep(20_000):
            await asyncio.sleep(0)

    # -- snapshots -----------------------------------------------------------------------

    def _fetch(self, node: str, endpoint_id: str) -> None:
        if endpoint_id in self._tasks or self._stopped:
            return
        self._tasks[endpoint_id] = asyncio.ensure_future(self._sync(node, endpoint_id))

    def _retry_delay(self, endpoint_id: str) -> float:
        failed = self._failed_at.get(endpoint_id)
        if failed is None:
            return 0.0
        at, wait = failed
        return max(0.0, at + wait - self.clock())

    async def _sync(self, node: str, endpoint_id: str) -> None:
        """Snapshots until one applies cleanly (or the endpoint leaves); every wait bounded."""
        try:
            while not self._stopped and endpoint_id in self.view.endpoints:
                delay = self._retry_delay(endpoint_id)
                if delay:
                    await asyncio.sleep(delay)
                    if endpoint_id not in self.view.endpoints:
                        return
                snap = await self._request(node, endpoint_id)
                if endpoint_id not in self.view.endpoints:
                    return
                if snap is None:
                    _, wait = self._failed_at.get(endpoint_id, (0.0, 0.0))
                    wait = min(max(wait * 2, self.retry_seconds), self.max_retry_seconds)
                    self._failed_at[endpoint_id] = (self.clock(), wait)
                    self.index.snapshot_failed(endpoint_id)
                    self._maybe_sweep()
                    continue
                self._failed_at.pop(endpoint_id, None)
                if snap.truncated:
                    log.warning(
                        "KV snapshot of %s was truncated to %d blocks",
                        endpoint_id,
                        len(snap.hashes),
                    )
                again = self.index.snapshot(endpoint_id, snap)
                self._maybe_sweep()
                if not again:
                    return
        finally:
            if self._tasks.get(endpoint_id) is asyncio.current_task():
                del self._tasks[endpoint_id]

    async def _request(self, node: str, endpoint_id: str) -> c.KvSnapshot | None:
        """The agent's snapshot of this engine, or None (within `request_timeout`)."""
        shard_id = projection.serving_shard(endpoint_id)
        req = c.KvSnapshotRequest(node=node, shard_id=shard_id)
        try:
            reply = await self.nc.request(
                subjects.kv_snapshot(node, shard_id), c.encode(req), timeout=self.request_timeout
            )
            snap = c.decode(reply.data, c.KvSnapshot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # No relay for it (an engine without events), or the agent is away or slow.
            log.debug("no KV snapshot for %s on %s: %s", endpoint_id, node, exc)
            if self.metrics is not None:
                self.metrics.kv_snapshots.inc(("failed",))
            return None
        if self.metrics is not None:
            self.metrics.kv_snapshots.inc(("ok",))
        return snap
