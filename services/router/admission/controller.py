"""The admission controller: the pure core that decides *when* a request may proceed.

Order for each request: authenticate -> quotas (429) -> flow now or queue
(503 when the band's queue is full) -> granted, or expired (504), or cancelled
-> released when the response ends, with the actual token usage. Where a
request goes is the scheduler's business: a granted request counts against its
pool from the grant to its release, dispatched or not.

Queues are per pool and band. When capacity frees (a request is released, a
tick passes and metrics have moved), bands are served in strict priority: a
band flows while the pool's saturation is below its ceiling, and ceilings
never increase down the list, so once one band is held every band below it is
too. Within a band, tenants take turns (queues.py).

No I/O and no asyncio here: time comes from an injected clock and a waiting
request is woken through the callback on its ticket, so every decision is
tested with a fake clock. gate.py is the asyncio shell around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from llmgw import contracts
from llmgw.router.endpoints.capacity import BatchCapacities

from .config import DEFAULT_BANDS, AdmissionSettings
from .errors import AdmissionRejected
from .queues import BandQueue
from .saturation import READY, Detector, Pool
from .tenants import Directory, Tenant, TenantSpec

QUEUED, GRANTED, DONE, REJECTED = "queued", "granted", "done", "rejected"

# Seconds a client is told to wait when its adapter was not loaded within its queue TTL:
# placement acts on the routers' next demand summaries, about a second apart.
ADAPTER_RETRY_AFTER = 5


def no_replica(model: str, why: str, retry_after: int) -> AdmissionRejected:
    return AdmissionRejected(
        "no_replica",
        f"Model {model!r} has no replica running and none can be started now: {why}",
        retry_after=retry_after,
    )


class Metrics:
    """Hooks the controller reports through; metrics.py has the real ones."""

    def admitted(self, band: str, tenant: str, waited: float | None) -> None:
        """waited is None for a request that flowed at once."""

    def rejected(self, band: str, tenant: str, reason: str) -> None:
        pass

    def cancelled(self, band: str, tenant: str) -> None:
        pass


class Ticket:
    """One request's passage through admission; also the router's Grant (`release`)."""

    __slots__ = (
        "controller",
        "tenant",
        "tenant_name",
        "pool",
        "band",
        "tokens",
        "quota_sec",
        "created",
        "deadline",
        "state",
        "error",
        "wake",
    )

    def __init__(
        self, controller: Controller, tenant: Tenant, pool: Pool | None, tokens: int, now: float
    ) -> None:
        self.controller = controller
        self.tenant = tenant
        self.tenant_name = tenant.name
        self.pool = pool  # None: a stored response's call, which holds no pool capacity
        self.band = tenant.band
        self.tokens = tokens  # estimate counted against tpm until the actual usage is known
        self.quota_sec = 0
        self.created = now
        self.deadline = now
        self.state = GRANTED
        self.error: AdmissionRejected | None = None
        self.wake: Callable[[Ticket], None] | None = None  # called when a queued ticket resolves

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The x-ratelimit-* headers of this tenant's quotas, as OpenAI sends them."""
        return self.tenant.quotas.headers(self.controller.clock())

    def release(self, usage: Any = None) -> None:
        """The response ended; `usage` (prompt_tokens, completion_tokens) when known."""
        actual = None if usage is None else usage.prompt_tokens + usage.completion_tokens
        self.controller.finish(self, actual)


class Controller:
    def __init__(
        self,
        settings: AdmissionSettings,
        bands: Sequence[contracts.Band] = (),
        tenants: Sequence[TenantSpec] = (),
        *,
        stale_after: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        batches: BatchCapacities | None = None,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self.clock = clock
        self.metrics = metrics or Metrics()
        self._use_bands(bands)
        self.routers = settings.routers
        self.detector = Detector(
            queue_threshold=settings.queue_threshold,
            kv_threshold=settings.kv_threshold,
            stale_after=stale_after,
            assumed_capacity=settings.assumed_capacity,
            relearn_after=settings.capacity_relearn_seconds,
            routers=self.routers,
            batches=batches,
        )
        self.queues: dict[str, list[BandQueue]] = {}  # pool name -> one queue per band
        # Called when a request starts waiting for an adapter no replica holds: the leader
        # places it from the demand summary, so that summary should not wait for its tick.
        self.on_adapter_wait: Callable[[], None] | None = None
        self.queued = 0
        self.directory = Directory([], self.band_index)
        self._tenants: Sequence[TenantSpec] = ()
        self.set_tenants(tenants)

    # ------------------------------------------------------------ configuration

    def _use_bands(self, bands: Sequence[contracts.Band]) -> None:
        self.bands = list(bands) or list(DEFAULT_BANDS)
        self.band_index = {b.name: i for i, b in enumerate(self.bands)}
        self._band_names = [b.name for b in self.bands]
        self._ceilings = [b.ceiling for b in self.bands]

    def set_bands(self, bands: Sequence[contracts.Band]) -> bool:
        """Replace the bands (the control plane's BandsRecord); False when nothing changed.

        Queued requests stay queued, each in the band of the same name, or in the lowest
        band when theirs is gone, with the deadline they already had; tenants are
        re-indexed (a tenant whose band is gone serves in the lowest band). New capacity,
        TTLs and ceilings apply from now on; a band's queue may thus hold more than its new
        capacity until it drains.
        """
        if (list(bands) or list(DEFAULT_BANDS)) == self.bands:
            return False
        old_names = self._band_names
        self._use_bands(bands)
        lowest = len(self.bands) - 1
        for model, queues in self.queues.items():
            moved: list[list[Ticket]] = [[] for _ in self.bands]
            for old, queue in enumerate(queues):
                target = self.band_index.get(old_names[old], lowest)
                moved[target] += queue.expire(float("inf"))  # every ticket, oldest first
            fresh = []
            for band, tickets in enumerate(moved):
                queue = BandQueue()
                # The queue expires by arrival order: keep its deadlines in that order.
                for ticket in sorted(tickets, key=lambda t: t.deadline):
                    ticket.band = band
                    queue.push(ticket)
                fresh.append(queue)
            self.queues[model] = fresh
        self.set_tenants(self._tenants)
        for model in list(self.queues):
            self.pump(model)  # a raised ceiling may release work at once
        return True

    def set_tenants(self, tenants: Sequence[TenantSpec]) -> None:
        """Replace the tenant set; quota usage carries over for tenants that stay."""
        self._tenants = tenants
        self.directory = Directory(
            tenants,
            self.band_index,
            anonymous=self.settings.anonymous_tenant,
            routers=self.routers,
            previous=self.directory,
        )

    @property
    def open(self) -> bool:
        """No tenants configured: every request is the anonymous tenant, no key needed."""
        return self.directory.open

    def set_routers(self, routers: int) -> None:
        """How many routers share the global quotas and the engines' capacity."""
        self.routers = max(1, routers)
        self.detector.routers = self.routers
        self.directory.set_routers(self.routers)

    # ------------------------------------------------------------ the request path

    def authenticate(self, authorization: str | None) -> Tenant:
        try:
            return self.directory.authenticate(authorization)
        except AdmissionRejected as exc:
            self.metrics.rejected("", "", exc.reason)
            raise

    def admit(
        self,
        tenant: Tenant,
        model: str,
        endpoints: Sequence[Any],
        tokens: int,
        *,
        cold: bool = False,
        adapter: bool = False,
    ) -> Ticket:
        """Quotas, then flow or queue. Returns a GRANTED or QUEUED ticket, or raises.

        `tenant` is what `authenticate` returned when the request arrived, before its
        body was read; `endpoints` are the pool's endpoints as the router sees them now.
        `cold`: the model is scaled to zero and a replica is on its way; the request
        queues (up to its band's TTL) until an endpoint is ready. `adapter`: the pool is
        a LoRA adapter's (cold: no replica holds it yet), whose TTL ends in a 503.
        """
        tenant = self._current(tenant)
        now = self.clock()
        band = tenant.band
        band_name = self._band_names[band]
        quota_sec = self._acquire(tenant, band_name, now, tokens)
        pool = self.detector.pool(model)
        pool.endpoints = endpoints
        pool.adapter = adapter
        if adapter:
            pool.arrived += 1
        ticket = Ticket(self, tenant, pool, tokens, now)
        ticket.quota_sec = quota_sec
        if not self.enabled:
            self.metrics.admitted(band_name, tenant.name, None)
            return ticket
        queues = self.queues.get(model)
        if queues is None:
            queues = self.queues[model] = [BandQueue() for _ in self.bands]
        if cold:
            pool.cold = True
        if not pool.cold and self._may_flow(pool, queues, band, now):
            pool.active += 1
            self.metrics.admitted(band_name, tenant.name, None)
            return ticket
        spec = self.bands[band]
        queue = queues[band]
        if queue.depth >= spec.queue_capacity:
            ticket.state = REJECTED
            self._release_quota(ticket, now, 0)
            self.metrics.rejected(band_name, tenant.name, "queue_full")
            raise AdmissionRejected(
                "queue_full",
                f"The {band_name!r} queue for model {model!r} is full "
                f"({spec.queue_capacity} waiting); try again shortly.",
                retry_after=1,
            )
        ticket.state = QUEUED
        ticket.deadline = now + spec.queue_ttl_seconds
        queue.push(ticket)
        self.queued += 1
        if adapter and pool.cold and self.on_adapter_wait is not None:
            self.on_adapter_wait()
        return ticket

    def admit_stored(self, tenant: Tenant) -> Ticket:
        """A call about a stored response: it names no model and costs an engine no
        tokens, so quotas only (requests per minute, concurrency); never queued."""
        tenant = self._current(tenant)
        now = self.clock()
        band_name = self._band_names[tenant.band]
        quota_sec = self._acquire(tenant, band_name, now, 0)
        ticket = Ticket(self, tenant, None, 0, now)
        ticket.quota_sec = quota_sec
        self.metrics.admitted(band_name, tenant.name, None)
        return ticket

    def _current(self, tenant: Tenant) -> Tenant:
        """The tenant as declared now: the tenants may have been replaced since
        `authenticate` (while the body arrived); one no longer declared is refused."""
        current = self.directory.by_name.get(tenant.name)
        if current is None:
            self.metrics.rejected("", "", "invalid_api_key")
            raise AdmissionRejected(
                "invalid_api_key", "The API key was revoked while the request arrived."
            )
        return current

    def _acquire(self, tenant: Tenant, band_name: str, now: float, tokens: int) -> int:
        try:
            return tenant.quotas.acquire(now, tokens)
        except AdmissionRejected as exc:
            self.metrics.rejected(band_name, tenant.name, exc.reason)
            raise

    def _may_flow(self, pool: Pool, queues: list[BandQueue], band: int, now: float) -> bool:
        # Never overtake a queued request of this band or a higher one.
        for q in queues[: band + 1]:
            if q.depth:
                return False
        ceiling = self._ceilings[band]
        return ceiling > 1.0 or self.detector.saturation(pool, now) < ceiling

    def finish(self, ticket: Ticket, actual_tokens: int | None = None) -> None:
        """The request ended (any way): free its capacity, correct its token count.

        Safe to call more than once and in any state; a queued ticket is cancelled.
        """
        state = ticket.state
        if state == QUEUED:
            self.cancel(ticket)
            return
        if state != GRANTED:
            return
        ticket.state = DONE
        self._release_quota(ticket, self.clock(), actual_tokens)
        if self.enabled and ticket.pool is not None:
            ticket.pool.active -= 1
            self.pump(ticket.pool.name)

    def cancel(self, ticket: Ticket) -> None:
        """A queued request whose client left: out of the queue at once, nothing held."""
        if ticket.state != QUEUED:
            return
        self.queues[ticket.pool.name][ticket.band].remove(ticket)
        self.queued -= 1
        ticket.state = REJECTED
        self._release_quota(ticket, self.clock(), 0)
        self.metrics.cancelled(self._band_names[ticket.band], ticket.tenant_name)

    def _release_quota(self, ticket: Ticket, now: float, actual: int | None) -> None:
        ticket.tenant.quotas.release(now, ticket.quota_sec, ticket.tokens, actual)

    # ------------------------------------------------------------ capacity frees

    def observed(self, endpoint: Any) -> None:
        """A load sample just landed for `endpoint` (its `models` name its pools)."""
        self.detector.observed(endpoint)
        if self.queued:
            for model in endpoint.models:
                self.pump(model)

    def endpoints_changed(self, endpoints_of: Callable[[str], Sequence[Any]]) -> None:
        """Routes changed: every pool sees its new endpoint set now, not at its next
        admission, so requests queued for a model that just scaled up can flow."""
        for model, pool in self.detector.pools.items():
            pool.endpoints = endpoints_of(model)
            if pool.cold and any(ep.state is READY for ep in pool.endpoints):
                pool.cold = False  # the first replica is serving: the wait is over
            self.pump(model)
        self.detector.forget_gone()

    def reject_cold(self, model: str, why: str, retry_after: int) -> int:
        """Requests waiting for a replica that cannot be placed: 503 with Retry-After
        now, not a 504 at the end of their TTL. Returns how many."""
        pool = self.detector.pools.get(model)
        queues = self.queues.get(model)
        if pool is None or not pool.cold or queues is None:
            return 0
        pool.cold = False
        now = self.clock()
        n = 0
        for band, queue in enumerate(queues):
            for ticket in queue.expire(float("inf")):
                self.queued -= 1
                ticket.state = REJECTED
                self._release_quota(ticket, now, 0)
                self.metrics.rejected(self._band_names[band], ticket.tenant_name, "no_replica")
                ticket.error = no_replica(model, why, retry_after)
                n += 1
                if ticket.wake is not None:
                    ticket.wake(ticket)
        return n

    def pump(self, model: str) -> int:
        """Grant queued requests of one pool while its saturation allows; returns how many."""
        queues = self.queues.get(model)
        if not self.queued or queues is None:
            return 0
        pool = self.detector.pools[model]
        if pool.cold:
            return 0
        now = self.clock()
        granted = 0
        for band, queue in enumerate(queues):
            ceiling = self._ceilings[band]
            while queue.depth:
                if ceiling <= 1.0 and self.detector.saturation(pool, now) >= ceiling:
                    return granted  # ceilings never increase: every lower band is held too
                ticket: Ticket = queue.pop()  # type: ignore[assignment]
                self.queued -= 1
                pool.active += 1
                ticket.state = GRANTED
                granted += 1
                self.metrics.admitted(
                    self._band_names[band], ticket.tenant_name, now - ticket.created
                )
                if ticket.wake is not None:
                    ticket.wake(ticket)
        return granted

    def tick(self) -> None:
        """Periodic: release what capacity allows (metrics move, age out), then expire TTLs."""
        if not self.queued:
            return
        for model in self.queues:
            self.pump(model)
        now = self.clock()
        for queues in self.queues.values():
            for band, queue in enumerate(queues):
                deadline = queue.next_deadline()
                if deadline is None or deadline > now:
                    continue
                for ticket in queue.expire(now):
                    self._expire(ticket, band, now)  # type: ignore[arg-type]

    def _expire(self, ticket: Ticket, band: int, now: float) -> None:
        self.queued -= 1
        ticket.state = REJECTED
        self._release_quota(ticket, now, 0)
        name = self._band_names[band]
        waited = f"The request waited {now - ticket.created:.1f}s in the {name!r} queue "
        waited += f"(limit {self.bands[band].queue_ttl_seconds:g}s)"
        pool = ticket.pool
        if pool is not None and pool.adapter and pool.cold:
            self.metrics.rejected(name, ticket.tenant_name, "adapter_not_loaded")
            ticket.error = AdmissionRejected(
                "adapter_not_loaded",
                f"{waited} while adapter {pool.name!r} was not loaded on any replica yet.",
                retry_after=ADAPTER_RETRY_AFTER,
            )
        else:
            self.metrics.rejected(name, ticket.tenant_name, "queue_timeout")
            ticket.error = AdmissionRejected(
                "queue_timeout", f"{waited} without capacity freeing up."
            )
        if ticket.wake is not None:
            ticket.wake(ticket)

    def next_deadline(self) -> float | None:
        soonest = None
        for queues in self.queues.values():
            for queue in queues:
                d = queue.next_deadline()
                if d is not None and (soonest is None or d < soonest):
                    soonest = d
        return soonest

    # ------------------------------------------------------------ introspection

    def saturation(self, model: str) -> float:
        return self.detector.saturation(self.detector.pool(model), self.clock())

    def queue_depths(self) -> dict[tuple[str, str], int]:
        """(model, band) -> queued requests."""
        return {
            (model, self._band_names[band]): q.depth
            for model, queues in self.queues.items()
            for band, q in enumerate(queues)
        }
