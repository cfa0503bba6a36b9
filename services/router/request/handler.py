"""The hot path: a raw ASGI endpoint that relays OpenAI requests to engines.

Per request: authenticate (headers only, so a request without a valid key
gets 401 whatever its body), read and parse the body, resolve the model, pass
the admission gate, then walk the endpoints and fallbacks (relay/walk.py, pure)
with one upstream attempt each (relay/upstream.py) until one answers or nothing
is left; the client side of all this is one `Exchange` (exchange.py). A declared tenant's
request is rewritten for it before it goes upstream (tenancy.py: its stored
responses' ids, its cache salt). Calls about a stored Responses API answer go
their own way (stored.py). A disaggregated model's request first takes its prefill
leg (relay/disagg.py), then walks the decode endpoints as any request walks.

Reading the request body has its own deadline (`body_read_seconds`, 408):
uvicorn has none, so a client that declares more bytes than it sends would
otherwise hold a connection and a coroutine forever.

Deadlines (per model): connect (the upstream client's), then response headers, first
token, inter-token idle (the watchdog that tells a wedged engine from a slow
one) and total, enforced by the request's Guard (guard.py), which also notices
the client leaving: its task is cancelled, which closes the upstream
connection, so the engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from starlette.types import Receive, Scope, Send

from llmgw import logs
from llmgw.router.endpoints.view import EndpointView, ModelRoute
from llmgw.router.http.errors import RouterError, error_body
from llmgw.router.metrics import RouterMetrics
from llmgw.router.relay import disagg, http1
from llmgw.router.relay.upstream import Upstream
from llmgw.router.relay.walk import TIMEOUT_STATUS, Walk
from llmgw.router.request import body as rq
from llmgw.router.request import kinds, tenancy
from llmgw.router.request.exchange import Exchange, request_id
from llmgw.router.request.guard import ClientGone, DeadlinePassed, Guard
from llmgw.router.request.holder import HOLDER_WAIT_SECONDS, HolderWait
from llmgw.router.request.stored import StoredResponses
from llmgw.router.scheduling.pipeline import Context

if TYPE_CHECKING:
    # The admission package implements the seam; the proxy only calls it.
    from llmgw.router.admission.seam import Gate

log = logging.getLogger(__name__)

# See guard.py: a client that leaves sooner is noticed this long after arrival.
DISCONNECT_WATCH_AFTER = 0.02


@dataclass(frozen=True, slots=True)
class Settings:
    max_body_bytes: int = 8 * 1024 * 1024
    body_read_seconds: float = 30.0
    attempts_per_model: int = 3
    pool_limit: int = 4096
    keepalive_seconds: float = 30.0
    access_log: bool = False


class _OpenGrant:
    __slots__ = ()

    def release(self, usage: rq.Usage | None) -> None:
        pass

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class _OpenGate:
    """No admission: every request proceeds at once (the seam's trivial side)."""

    _grant = _OpenGrant()

    def authenticate(self, headers) -> None:
        return None

    async def admit(self, request, route, who) -> _OpenGrant:
        return self._grant

    async def admit_stored(self, who) -> _OpenGrant:
        return self._grant


class Proxy:
    def __init__(
        self,
        view: EndpointView,
        metrics: RouterMetrics,
        settings: Settings | None = None,
        gate: Gate | None = None,
    ):
        self.view = view
        self.metrics = metrics
        self.settings = settings or Settings()
        self.gate: Gate = gate or _OpenGate()
        self._rid_prefix = secrets.token_hex(6)
        self._rid_seq = itertools.count(1)
        # Two clocks: time.monotonic for measurements (uvloop's loop.time() has
        # millisecond resolution), the loop's own for asyncio deadlines.
        self._time = time.monotonic
        self._ltime = time.monotonic
        self.upstream = Upstream(metrics, self._time)
        self.releases = disagg.Releases(self.upstream)  # KV a gone client left on prefill
        self.holders = HolderWait(view)
        self.stored = StoredResponses(self)
        self.upstream.on_response_id = self.stored.remember

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.upstream.session

    def set_gate(self, gate: Gate | None) -> None:
        """Swap admission in or out; requests already admitted release to their own gate."""
        self.gate = gate or _OpenGate()

    async def start(self) -> None:
        # The relay's own client (relay/http1.py) carries every attempt; aiohttp stays
        # for the other calls to engines (P/D prefill legs, stored responses, models).
        self.upstream.client = http1.Client(
            self.settings.pool_limit, self.settings.keepalive_seconds
        )
        connector = aiohttp.TCPConnector(
            limit=self.settings.pool_limit,
            keepalive_timeout=self.settings.keepalive_seconds,
            ttl_dns_cache=300,
        )
        self.upstream.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,  # bytes are relayed as the engine sent them
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept"),
        )
        self._ltime = asyncio.get_running_loop().time

    async def stop(self) -> None:
        await self.releases.stop()
        if self.upstream.client is not None:
            await self.upstream.client.close()
            self.upstream.client = None
        if self.upstream.session is not None:
            await self.upstream.session.close()
            self.upstream.session = None

    def endpoint(self, kind: str) -> _KindEndpoint:
        return _KindEndpoint(self, kinds.BY_NAME[kind])

    def stored_responses(self) -> StoredResponses:
        return self.stored

    def new_rid(self) -> bytes:
        return f"{self._rid_prefix}{next(self._rid_seq):x}".encode()

    def exchange(self, scope: Scope, receive: Receive, send: Send) -> Exchange:
        t0 = self._time()
        headers = dict(scope["headers"])
        rid = request_id(headers, self.new_rid)
        logs.request_id.set(rid.decode())
        task = asyncio.current_task()
        assert task is not None
        guard = Guard(asyncio.get_running_loop(), task, receive, DISCONNECT_WATCH_AFTER)
        return Exchange(rid, t0, headers, guard, receive, send)

    # ------------------------------------------------------------ per request

    async def handle(self, api: kinds.ApiKind, scope: Scope, receive: Receive, send: Send) -> None:
        ex = self.exchange(scope, receive, send)
        gate = self.gate  # this request's gate, even if another is installed meanwhile
        try:
            with ex.guard:  # a deadline or disconnect that lands between attempts
                if scope["method"] != "POST":
                    raise RouterError(405, "method_not_allowed", f"use POST for {scope['path']}")
                # Before the body: whatever it holds, a request without a valid key gets 401.
                who = gate.authenticate(ex.headers)
                body = await ex.read_body(
                    self.settings.max_body_bytes, self.settings.body_read_seconds
                )
                if body is None:  # the client left while sending
                    ex.status = 499
                    return
                req = rq.parse(api.name, body, ex.headers.get(b"content-type"))
                route = self.view.resolve(req.model)
                # An adapter another tenant's alone reads as one that does not exist.
                if route is None or not route.serves(api.name) or not route.allows(who):
                    raise RouterError(
                        404,
                        "model_not_found",
                        f"The model '{req.model}' does not exist"
                        + ("" if route is None else f" for {scope['path']}"),
                        param="model",
                    )
                ex.model = route.name
                if who is not None and who.owner is not None:
                    # Before admission: a request the tenant binding refuses (another
                    # tenant's previous_response_id, a salt in the router's namespace)
                    # must neither wait in a queue nor spend the tenant's quota.
                    ex.owner = who.owner
                    tenancy.bind(req, who, ex.headers, self.stored.owns)
                version = self.view.version
                grant = await gate.admit(req, route, who)
                if self.view.version != version:
                    # Routes are swapped whole on every change: a request that waited in
                    # admission (for a first ready replica, say) goes by its model's
                    # current route (the admitted model, even if an alias moved meanwhile).
                    route = self.view.route(route.name) or route
                try:
                    ex.extra = grant.headers()
                    await self._dispatch(ex, req, route, scope["path"])
                finally:
                    grant.release(ex.usage)
        except RouterError as err:
            await ex.fail(err, api.stream)
        except ClientGone:
            ex.status = 499
        except DeadlinePassed as passed:
            await ex.fail(
                RouterError(
                    TIMEOUT_STATUS, f"{passed.phase}_timeout", f"{passed.phase} deadline passed"
                ),
                api.stream,
            )
        except Exception:
            log.exception("request failed inside the router")
            await ex.fail(RouterError(500, "internal_error", "internal error"), api.stream)
        finally:
            ex.guard.close()
            self.record(ex)

    def record(self, ex: Exchange) -> None:
        m = self.metrics
        model = ex.model
        m.requests.inc((model, ex.endpoint, str(ex.status)))
        elapsed = self._time() - ex.t0
        m.duration.observe((model,), elapsed)
        usage = ex.usage
        if usage is not None:
            m.prompt_tokens.inc((model,), usage.prompt_tokens)
            m.completion_tokens.inc((model,), usage.completion_tokens)
        if ex.status == 499:
            m.disconnects.inc((model,))
        if self.settings.access_log or ex.status >= 500:
            log.log(
                logging.INFO if ex.status < 500 else logging.WARNING,
                "request done",
                extra={
                    "model": model,
                    "endpoint": ex.endpoint,
                    "status": ex.status,
                    "ms": round(elapsed * 1000, 2),
                },
            )

    async def _dispatch(self, ex: Exchange, req: rq.Parsed, route: ModelRoute, path: str) -> None:
        ex.guard.total_at = self._ltime() + route.deadlines.total
        ctx = Context(
            ex.t0, route.name, exclude=[], salt=req.cache_salt, body=req.body, api=req.api.name
        )
        walk = Walk(
            route,
            self.view.route,
            self.settings.attempts_per_model,
            ctx.exclude,  # type: ignore[arg-type]
            self._prepare(req, ex.headers),
        )
        walk.prepare(ctx, route)
        # The body names the model it goes to: rewritten once per model, not per attempt.
        body = req.body if req.model == route.name else rq.with_model(req, route.name)
        legs = None
        if route.pipeline.disaggregation is not None:
            legs = await self._prefill_leg(ex, req, route, body, path, ctx)
            try:
                return await self._walk(ex, req, route, path, walk, ctx, legs, body)
            except ClientGone:
                if legs is not None and not ex.started:
                    # Gone before the decode leg answered: its KV would be stranded.
                    self.releases.release(legs, ex, route, req, body, path)
                raise
        return await self._walk(ex, req, route, path, walk, ctx, legs, body)

    async def _walk(
        self,
        ex: Exchange,
        req: rq.Parsed,
        route: ModelRoute,
        path: str,
        walk: Walk,
        ctx: Context,
        legs: disagg.Legs | None,
        body: bytes,
    ) -> None:
        """Attempts until one answers the client, or the walk has nothing left."""
        metrics = self.metrics
        attempt = self.upstream.attempt
        ltime = self._ltime
        total_at = ex.guard.total_at
        model = route.name
        while True:
            ctx.now = self._time()
            ep = walk.next(ctx, ltime() >= total_at)
            if ep is None:
                err = walk.outcome()
                held = None
                if err.reason == "adapter_not_loaded" and not ex.started:
                    wait = min(HOLDER_WAIT_SECONDS, total_at - ltime())
                    held = await self.holders.holder(route.name, wait)
                if held is None:
                    raise err
                # A fresh walk on the adapter's new holders; those that refuted it are
                # not among them until the projection lists them again.
                ctx.exclude.clear()
                walk = Walk(held, self.view.route, walk.per_model, ctx.exclude, walk.prepare)
                continue
            current = walk.current
            assert current is not None
            if current.name != model:
                model = current.name
                metrics.fallbacks.inc((route.name, model))
                log.warning("falling back", extra={"model": route.name, "fallback": model})
                body = req.body if req.model == model else rq.with_model(req, model)
            if walk.attempts > 1:
                metrics.retries.inc((route.name,))
            if legs is None or current is not route or walk.resuming:
                failure = await attempt(ex, ep, current, req, body, path)
            else:
                failure = await attempt(ex, ep, current, req, legs.body_for(ep, body), path)
                legs.count(metrics, route, ep, failure)
            if failure is None:
                return
            metrics.upstream_errors.inc((ep.id, failure.kind))
            log.warning(
                "attempt failed: %s",
                failure.detail or failure.message,
                extra={"model": model, "endpoint": ep.id, "kind": failure.kind},
            )
            if not walk.failed(ep, failure):
                raise walk.outcome()
            if failure.resume:
                assert ex.sent is not None
                body = ex.sent.continuation()
                metrics.migrations.inc((route.name,))
                log.warning(
                    "continuing the stream on another endpoint",
                    extra={"model": model, "endpoint": ep.id, "migration": ex.sent.migrations},
                )

    async def _prefill_leg(
        self, ex: Exchange, req: rq.Parsed, route: ModelRoute, body: bytes, path: str, ctx: Context
    ) -> disagg.Legs | None:
        """A disaggregated model's request: its prefill leg, run now; None when the
        request is served whole (relay/disagg.py says when)."""
        why = disagg.skip_reason(route, req)
        if why is not None:
            self.metrics.pd_whole.inc((route.name, why))
            return None
        legs, fallback = await disagg.prefill(
            self.upstream, ex, route, req, body, path, ctx, self.settings.attempts_per_model
        )
        return None if fallback is not None else legs

    def _prepare(self, req: rq.Parsed, headers: dict[bytes, bytes]):
        def prepare(ctx: Context, route: ModelRoute) -> None:
            pipeline = route.pipeline
            ctx.model = route.name
            ctx.adapter = route.name if route.adapter_of else None
            if pipeline.needs_prompt_blocks and not ctx.prefix and req.prompt:
                ctx.prefix = pipeline.prompt_blocks(req.prompt, req.cache_salt)
            session = headers.get(pipeline.session_header) if pipeline.needs_session else None
            ctx.session = session.decode("latin-1") if session is not None else None

        return prepare


class _KindEndpoint:
    """The ASGI app mounted at one of an API kind's POST paths."""

    __slots__ = ("proxy", "api")

    def __init__(self, proxy: Proxy, api: kinds.ApiKind):
        self.proxy = proxy
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.proxy.handle(self.api, scope, receive, send)


__all__ = ["Proxy", "Settings", "error_body"]
