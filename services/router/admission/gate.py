"""The router's admission gate: the asyncio shell around the controller.

It implements the router's Gate seam (seam.py): `authenticate` runs on the
headers before the body is read, `admit` after the request is parsed and its
model resolved, before scheduling, and returns the ticket as the grant the
proxy releases with the engine's usage when the response ends.

A request that flows at once never awaits anything and allocates no future.
Only a queued one waits; the proxy cancels the waiting task the moment its
client disconnects, and the cancellation takes the ticket out of the queue.
One timer, armed only while something is queued, expires TTLs and re-checks
saturation as scraped metrics move or age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from llmgw import contracts
from llmgw.router.endpoints.capacity import BatchCapacities

from .config import AdmissionSettings
from .controller import QUEUED, Controller, Metrics, Ticket, no_replica
from .metrics import AdmissionMetrics
from .saturation import READY
from .tenants import Tenant, TenantSpec

log = logging.getLogger(__name__)

# Seconds a client is told to wait when no replica of its model can be placed: the
# control plane restates such a failure about this often.
UNPLACEABLE_RETRY_AFTER = 10


def estimate_tokens(body_bytes: int, max_tokens: int | None, default_max_tokens: int) -> int:
    """Prompt at ~4 bytes a token (the whole body, so a slight overestimate) plus the
    completion allowance: O(1), and the actual usage corrects it when the response ends."""
    return body_bytes // 4 + (max_tokens if max_tokens and max_tokens > 0 else default_max_tokens)


class AdmissionGate:
    def __init__(
        self,
        settings: AdmissionSettings,
        bands: Sequence[contracts.Band] = (),
        tenants: Sequence[TenantSpec] = (),
        *,
        stale_after: float = 1.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet: bool = False,
        batches: BatchCapacities | None = None,
    ) -> None:
        self.settings = settings
        self.controller = Controller(
            settings,
            bands,
            tenants,
            stale_after=stale_after,
            clock=clock,
            metrics=metrics,
            batches=batches,
        )
        self._timer: asyncio.TimerHandle | None = None
        self._was_open = self.controller.open
        # The router's current route of a model (view.route): a request that waited for
        # a model's first replica is dispatched to the endpoints it waited for.
        self.route_of: Callable[[str], Any] = lambda _model: None
        self.scale_from_zero = False  # some model may wait for its first replica here
        self.workers = 1  # worker processes of this router, each with its own gate
        if self.controller.open and not quiet:
            log.warning(
                "no tenants configured: every request is served as one anonymous tenant "
                "without an API key; configure tenants to require keys"
            )

    @property
    def active(self) -> bool:
        """False when the gate has nothing to do: no tenants (so no keys, no quotas) and
        no band that can be held back (admission off, or every ceiling above 1)."""
        c = self.controller
        if not c.open:
            return True
        if self.settings.enabled and self.scale_from_zero:
            return True
        return self.settings.enabled and any(b.ceiling <= 1.0 for b in c.bands)

    def authenticate(self, headers: dict[bytes, bytes]) -> Tenant:
        """The tenant of a request's Authorization header, or a 401 AdmissionRejected."""
        auth = headers.get(b"authorization")
        return self.controller.authenticate(None if auth is None else auth.decode("latin-1"))

    async def admit(self, request: Any, route: Any, tenant: Tenant) -> Ticket:
        """Check quotas, then flow or wait. Raises AdmissionRejected (429, 503, 504; 401
        when the tenant went away after `authenticate`); cancelling the wait takes the
        request out of its queue."""
        tokens = estimate_tokens(
            len(request.body), request.max_tokens, self.settings.default_max_tokens
        )
        cold = self.settings.enabled and _cold(route)
        if cold and route.unplaceable:
            c = self.controller
            band = c.bands[min(tenant.band, len(c.bands) - 1)].name
            c.metrics.rejected(band, tenant.name, "no_replica")
            raise no_replica(route.name, route.unplaceable, UNPLACEABLE_RETRY_AFTER)
        ticket = self.controller.admit(
            tenant,
            route.name,
            route.endpoints,
            tokens,
            cold=cold,
            adapter=bool(getattr(route, "adapter_of", "")),  # duck-typed routes (tests) lack it
        )
        if ticket.state == QUEUED:
            await self.wait(ticket)
        return ticket

    async def admit_stored(self, tenant: Tenant) -> Ticket:
        """A call about a stored response: quotas only (Controller.admit_stored)."""
        return self.controller.admit_stored(tenant)

    async def wait(self, ticket: Ticket) -> None:
        """Until a queued ticket is granted; raises its 504 if it expires first."""
        self._arm()
        resolved = asyncio.get_running_loop().create_future()
        ticket.wake = lambda _t: resolved.done() or resolved.set_result(None)
        try:
            await resolved
        except BaseException:
            # Cancelled (the client went away): leave the queue, or give back a grant
            # that raced in just before the cancellation.
            self.controller.finish(ticket)
            raise
        finally:
            ticket.wake = None
        if ticket.error is not None:
            raise ticket.error

    def set_tenants(self, tenants: Sequence[TenantSpec]) -> None:
        """A new tenant set (config reload or the control plane's TenantRecords)."""
        self.controller.set_tenants(tenants)
        self._report_directory()

    def set_bands(self, bands: Sequence[contracts.Band]) -> None:
        """New bands (the control plane's BandsRecord); see Controller.set_bands."""
        if self.controller.set_bands(bands):
            log.info("admission bands now %s", [b.name for b in self.controller.bands])
            self._report_directory()
            self._arm()

    def _report_directory(self) -> None:
        d = self.controller.directory
        if d.open and not self._was_open:
            log.warning(
                "no tenants are declared any more: every request is served as one anonymous "
                "tenant without an API key"
            )
        self._was_open = d.open
        for name in d.unknown_band:
            log.warning(
                "tenant %r names a band that is not declared: it is served in the lowest band, %r",
                name,
                self.controller.bands[-1].name,
            )
        wanted = self.settings.anonymous_tenant
        if wanted and d.anonymous is None and not d.open:
            log.warning(
                "admission.anonymous_tenant = %r names no declared tenant: requests without a "
                "key get 401 until it is declared",
                wanted,
            )

    def set_routers(self, live: int) -> None:
        """How many routers are live (the presence bucket); each has `workers` processes."""
        self.controller.set_routers(live * self.workers)

    def endpoints_changed(self, endpoints_of: Callable[[str], Sequence[Any]]) -> None:
        self.controller.endpoints_changed(endpoints_of)
        for model, pool in self.controller.detector.pools.items():
            route = self.route_of(model) if pool.cold else None
            if route is not None and route.unplaceable:
                n = self.controller.reject_cold(model, route.unplaceable, UNPLACEABLE_RETRY_AFTER)
                log.warning(
                    "%d request(s) for %s gave up waiting for a replica: %s",
                    n,
                    model,
                    route.unplaceable,
                )

    def routes_changed(self, scale_from_zero: bool) -> None:
        """Whether some model is autoscaled from zero now (the gate must then be on)."""
        self.scale_from_zero = scale_from_zero

    def observed(self, endpoint: Any) -> None:
        """The router's scraper stored a new load sample for `endpoint`."""
        self.controller.observed(endpoint)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        if self._timer is not None or not self.controller.queued:
            return
        delay = self.settings.tick_seconds
        deadline = self.controller.next_deadline()
        if deadline is not None:
            delay = min(delay, deadline - self.controller.clock())
        self._timer = asyncio.get_running_loop().call_later(max(delay, 0.001), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self.controller.tick()
        except Exception:  # a bug here must not strand every queued request
            log.exception("admission tick failed")
        self._arm()


def _cold(route: Any) -> bool:
    """Scaled to zero: the model may get a replica, but none is ready now."""
    if not getattr(route, "scale_from_zero", False):  # duck-typed routes (tests) lack it
        return False
    return not any(ep.state is READY for ep in route.endpoints)


def control_plane_gate(
    config: Any,
    metrics: AdmissionMetrics | None = None,
    batches: BatchCapacities | None = None,
) -> AdmissionGate:
    """The gate of a router in control-plane mode: always built, since tenants and bands
    arrive later; the router skips it while it is not `active`. `batches`: the router's
    learned batch capacities, which the gate reads and its view feeds."""
    gate = AdmissionGate(
        config.admission,
        stale_after=config.scrape.stale_after_seconds,
        metrics=metrics,
        quiet=True,
        batches=batches,
    )
    gate.workers = config.workers
    gate.set_routers(1)
    if metrics is not None:
        metrics.controller = gate.controller
    return gate


def from_router_config(
    config: Any,
    metrics: AdmissionMetrics | None = None,
    batches: BatchCapacities | None = None,
) -> AdmissionGate | None:
    """The gate a router process runs with (`config` is its RouterConfig), or None when
    admission has nothing to do there (see `active`): the router then skips it."""
    gate = AdmissionGate(
        config.admission,
        config.bands,
        config.tenants,
        stale_after=config.scrape.stale_after_seconds,
        metrics=metrics,
        batches=batches,
    )
    if not gate.active:
        return None
    # Each worker process keeps its own counters and sees its share of the traffic.
    gate.workers = config.workers
    gate.set_routers(config.admission.routers)
    if metrics is not None:
        metrics.controller = gate.controller
    return gate
