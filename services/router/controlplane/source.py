"""Control-plane mode: the router's view, tenants and peers, fed from NATS.

`ControlPlaneSource` is the view's EndpointSource when the config names a
`nats_url`. It owns one NATS connection and, on it:

  - the tenants bucket watch (bands and tenants into admission),
  - the endpoints bucket watch (models into the view), started once the
    tenants are loaded, so no model is served before its tenants are known,
  - the load samples subscription (`llmgw.load.*`),
  - this router's presence and the live-router count, and its demand summary
    for the autoscaler (admission/demand.py), sent on the presence ticks.

Nothing here talks to other routers or to Postgres, and nothing provisions:
the buckets are the reconciler's (under mTLS a router may not create them),
so the watches wait for them. Starting returns at once; the connection and
the first snapshots happen in the background while /readyz says not ready.

When NATS goes away the router keeps serving from what it holds: the view,
the tenants and the live-router count stay as they were. The client
reconnects by itself; on reconnect every watch restarts with a fresh
snapshot (feeds.py decides what an empty one means) and the presence is
announced at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS

from llmgw import bus, projection, subjects, tlsconfig
from llmgw.router.admission import demand
from llmgw.router.admission.gate import AdmissionGate
from llmgw.router.config import RouterConfig
from llmgw.router.controlplane.feeds import EndpointFeed, TenantFeed
from llmgw.router.controlplane.presence import Presence
from llmgw.router.controlplane.samples import SampleFeed
from llmgw.router.controlplane.watch import BucketWatcher, Entry
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.kvcache.feed import KvEventFeed
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class ControlPlaneSource:
    def __init__(
        self,
        config: RouterConfig,
        gate: AdmissionGate,
        metrics: RouterMetrics,
        *,
        kv_index: BlockIndex | None = None,
        on_gate_change: Callable[[], None] = lambda: None,
    ):
        assert config.nats_url and config.router_id, "control-plane mode needs both"
        self.config = config
        self.gate = gate
        self.metrics = metrics
        self.on_gate_change = on_gate_change
        self.nc: NATS | None = None
        self.view: EndpointView | None = None
        self.endpoints: EndpointFeed | None = None
        self.tenants = TenantFeed(gate, on_change=on_gate_change)
        self.samples: SampleFeed | None = None
        self.presence: Presence | None = None
        self.watchers: list[BucketWatcher] = []  # tenants, then endpoints
        self._samples_sub = None
        self.kv_index = kv_index  # fed from engines' KV events; None: not indexed
        self.kv_events = None  # kvfeed.KvEventFeed, when there is an index to feed
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self, view: EndpointView) -> None:
        self.view = view
        self.endpoints = EndpointFeed(view)
        self.samples = SampleFeed(view)
        self.metrics.nats_connected.set((), 0.0)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="control-plane")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.presence is not None:
            await self.presence.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        for watcher in self.watchers:
            await watcher.stop()
        await bus.close_quietly(self.nc)
        self.nc = None

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    # ------------------------------------------------------------ the background start

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                await self._setup()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. NATS went away between two setup steps
                log.warning("control-plane setup failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _setup(self) -> None:
        """Connect, then start each feed once; a retry skips what already runs."""
        cfg = self.config
        if self.nc is None:
            self.nc = await bus.connect(
                cfg.nats_url,
                f"router-{cfg.router_id}",
                on_reconnect=self._reconnected,
                on_disconnect=self._disconnected,
                **tlsconfig.nats_options(cfg.nats_tls),
            )
            self.metrics.nats_connected.set((), 1.0)
            log.info("connected to NATS at %s", cfg.nats_url, extra={"router_id": cfg.router_id})
        nc = self.nc
        if self._samples_sub is None:
            self._samples_sub = await nc.subscribe(subjects.LOAD_ALL, cb=self._sample)
        index = self.kv_index
        if self.kv_events is None and index is not None:
            self.kv_events = KvEventFeed(self.view, index, nc, metrics=self.metrics)
            await self.kv_events.start()
        if self.presence is None:
            self.presence = Presence(
                nc,
                cfg.router_id,
                self._routers,
                demand=self._demand,
                urgent_demand=functools.partial(self._demand, take_arrivals=False),
            )
            self.presence.start()
            self.gate.controller.on_adapter_wait = self.presence.demand_soon
        if not self.watchers:
            self._watch(projection.TENANTS_BUCKET, self.tenants)
        await self.watchers[0].snapshot_done.wait()
        if len(self.watchers) == 1:
            if self.gate.controller.open:
                log.warning(
                    "no tenants are declared (yet): requests are served as one anonymous "
                    "tenant without an API key until the catalog declares a tenant"
                )
            assert self.endpoints is not None
            self._watch(projection.ENDPOINTS_BUCKET, self.endpoints)

    def _watch(self, bucket: str, feed: EndpointFeed | TenantFeed) -> BucketWatcher:
        counter = self.metrics.projection_updates

        def snapshot(entries: dict[str, Entry]) -> None:
            counter.inc((bucket, "snapshot"))
            feed.snapshot(entries)

        def put(entry: Entry) -> None:
            counter.inc((bucket, "put"))
            feed.put(entry)

        def delete(key: str) -> None:
            counter.inc((bucket, "delete"))
            feed.delete(key)

        assert self.nc is not None
        watcher = BucketWatcher(self.nc, bucket, on_snapshot=snapshot, on_put=put, on_delete=delete)
        watcher.start()
        self.watchers.append(watcher)
        return watcher

    async def _sample(self, msg) -> None:
        assert self.samples is not None
        self.metrics.load_samples.inc((self.samples.handle(msg.data),))

    def _demand(self, take_arrivals: bool = True):
        assert self.view is not None
        return demand.summary(self.config.router_id, self.gate.controller, self.view, take_arrivals)

    def _routers(self, live: int) -> None:
        self.metrics.live_routers.set((), float(live))
        self.gate.set_routers(live)

    async def _disconnected(self) -> None:
        self.metrics.nats_connected.set((), 0.0)
        if self._stopping:
            return
        log.warning("NATS unreachable: serving from the last view until it returns")
        if self.presence is not None:
            self.presence.disconnected()

    async def _reconnected(self) -> None:
        self.metrics.nats_connected.set((), 1.0)
        for watcher in self.watchers:
            watcher.restart()
        if self.presence is not None:
            self.presence.reconnected()
