"""Router presence: announce this router, count the live ones, no coordination.

Each router puts a RouterPresence under `subjects.router_key(router_id)` in the
`llmgw-routers` bucket every TTL/3 (the bucket's max age is the TTL; 10 s when
it has none) and deletes it when it stops. Every router watches the bucket
and counts a router as live while its latest put is younger than the TTL.
The count divides the tenants' quotas and the engines' capacity in admission.

Routers are counted by their key, never by the router id inside the record:
NATS lets each router identity write only its own key (llmgw.natsconfig), but
what it writes there is its own choice, so a record naming another router must
not merge the two (which would shrink the count and grow every share).

Expiry in a KV bucket is silent (no delete marker reaches a watcher), so the
count does not rely on it: each router ages the entries it saw itself, from
the server's timestamp on each write. A router that dies therefore leaves the
count within one TTL (plus one tick), and a new router enters it as soon as
its first put reaches the others (milliseconds).

While NATS is unreachable nothing can be seen, so the count stays where it was
instead of ageing every peer out (which would let each router admit the whole
global quota). After reconnecting it does not fall below its value before the
outage for one TTL: the time every live router needs to put itself again.

On the same ticks (about once a second) the router publishes its demand
summary (admission/demand.py) on core NATS, `subjects.demand(router_id)`, for
the reconciler's autoscaler. It is not persisted: a summary missed is replaced
by the next one, and the leader forgets a router whose summaries stop. When a
request starts waiting for a LoRA adapter no replica holds (`demand_soon`), a
summary goes out at once, at most one per DEMAND_SOON_GAP: the leader places the
adapter as soon as a summary says so, and the request waits for it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

from llmgw import contracts as c
from llmgw import subjects
from llmgw.router.controlplane.watch import BucketWatcher, Entry
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0
# A burst of requests starting to wait is one summary, not one each.
DEMAND_SOON_GAP = 0.1


class LiveRouters:
    """The pure count: router key -> when last seen (monotonic), aged by the TTL."""

    def __init__(self, self_key: str, ttl: float = DEFAULT_TTL):
        self.self_key = self_key
        self.ttl = ttl
        self.last_seen: dict[str, float] = {}
        self.connected = True
        self._frozen = 1  # the count while disconnected
        self._floor = 1
        self._floor_until = float("-inf")

    def seen(self, key: str, at: float) -> None:
        if at > self.last_seen.get(key, float("-inf")):
            self.last_seen[key] = at

    def gone(self, key: str) -> None:
        self.last_seen.pop(key, None)

    def replace(self, seen: dict[str, float]) -> None:
        self.last_seen = dict(seen)

    def count(self, now: float) -> int:
        if not self.connected:
            return self._frozen
        oldest = now - self.ttl
        live = {key for key, at in self.last_seen.items() if at >= oldest}
        live.add(self.self_key)  # this router is live, whether or not its put got through
        n = len(live)
        if now < self._floor_until and n < self._floor:
            return self._floor
        return n

    def disconnected(self, now: float) -> None:
        if self.connected:
            self._frozen = self.count(now)
            self.connected = False

    def reconnected(self, now: float) -> None:
        if not self.connected:
            self.connected = True
            self._floor = self._frozen
            self._floor_until = now + self.ttl


class Presence:
    """Announces `router_id` and reports the live count through `on_count(n)` as it changes."""

    def __init__(
        self,
        nc: NATS,
        router_id: str,
        on_count: Callable[[int], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        demand: Callable[[], c.DemandSummary] | None = None,
        urgent_demand: Callable[[], c.DemandSummary] | None = None,
    ):
        self.nc = nc
        self.router_id = router_id
        self.key = subjects.router_key(router_id)
        self.subject = subjects.router_presence(router_id)
        self.on_count = on_count
        self.demand = demand
        self.urgent_demand = urgent_demand or demand  # what demand_soon publishes
        self.demand_subject = subjects.demand(router_id)
        self._demand_failing = False
        self.clock = clock
        self.wall = wall
        self.live = LiveRouters(self.key)
        self.started_at = wall()
        self.reported = 0
        self.watcher = BucketWatcher(
            nc,
            subjects.ROUTERS_BUCKET,
            on_snapshot=self._snapshot,
            on_put=self._put,
            on_delete=self._delete,
        )
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._soon_task: asyncio.Task | None = None
        self._demand_due = asyncio.Event()

    # ------------------------------------------------------------ watch side

    def _at(self, entry: Entry) -> float:
        """When the entry was written, on this router's monotonic clock (never in the future)."""
        age = max(0.0, self.wall() - entry.written_at)
        return self.clock() - age

    def _snapshot(self, entries: dict[str, Entry]) -> None:
        self.live.replace({key: self._at(e) for key, e in entries.items()})
        self._report()

    def _put(self, entry: Entry) -> None:
        self.live.seen(entry.key, self._at(entry))
        self._report()

    def _delete(self, key: str) -> None:
        self.live.gone(key)
        self._report()

    def _report(self) -> None:
        n = self.live.count(self.clock())
        if n != self.reported:
            log.info("live routers: %d", n)
            self.reported = n
            self.on_count(n)

    # ------------------------------------------------------------ connection events

    def disconnected(self) -> None:
        self.live.disconnected(self.clock())

    def reconnected(self) -> None:
        self.live.reconnected(self.clock())
        self.watcher.restart()
        self._wake.set()  # announce at once: peers may have aged us out

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._report()
        self.watcher.start()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._announce(), name="presence")
        self._soon_task = loop.create_task(self._demand_when_due(), name="presence-demand")

    def demand_soon(self) -> None:
        """Publish the demand summary now rather than on the next tick."""
        self._demand_due.set()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        await cancel_and_wait(self._soon_task)
        self._task = self._soon_task = None
        await self.watcher.stop()
        if self.nc.is_connected:
            # Leave the count at once, so the others' shares grow without waiting a TTL.
            with contextlib.suppress(Exception):
                await self.nc.jetstream().publish(
                    self.subject, b"", headers={"KV-Operation": "DEL"}, timeout=1.0
                )

    async def _announce(self) -> None:
        record = c.RouterPresence(router_id=self.router_id, started_at=self.started_at)
        payload = c.encode(record)
        js = self.nc.jetstream()
        failing = False
        while True:
            await self.watcher.snapshot_done.wait()  # the bucket exists
            info = self.watcher.info
            ttl = (info.config.max_age if info is not None else None) or DEFAULT_TTL
            self.live.ttl = ttl
            if self.nc.is_connected:
                try:
                    await js.publish(self.subject, payload, timeout=min(2.0, ttl / 3))
                    if failing:
                        log.info("presence announced again")
                    failing = False
                except Exception as exc:
                    if not failing:
                        log.warning("presence not announced: %s", exc)
                    failing = True
            self._report()  # peers age out on this tick too
            await self._publish_demand()
            self._wake.clear()
            tick = min(ttl / 3, 1.0)
            for _ in range(max(1, round(ttl / 3 / tick))):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), tick)
                if self._wake.is_set():
                    break
                self._report()
                await self._publish_demand()

    async def _demand_when_due(self) -> None:
        while True:
            await self._demand_due.wait()
            self._demand_due.clear()
            await self._publish_demand(self.urgent_demand)
            await asyncio.sleep(DEMAND_SOON_GAP)

    async def _publish_demand(self, make: Callable[[], c.DemandSummary] | None = None) -> None:
        make = make or self.demand
        if make is None or not self.nc.is_connected:
            return
        try:
            await self.nc.publish(self.demand_subject, c.encode(make()))
            self._demand_failing = False
        except Exception as exc:  # the next tick sends a fresh one
            if not self._demand_failing:
                log.warning("demand summary not published: %s", exc)
            self._demand_failing = True
