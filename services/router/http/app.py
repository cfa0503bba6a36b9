"""Assembles one router process: view, source, scraper, proxy, and the two apps.

The source is the config file (router-only mode) or, with `nats_url`, the
control plane (controlplane.py), which also feeds admission its tenants, bands
and the live router count.

`RouterService` owns every long-lived piece and starts and stops them in
order. `worker_app` is the factory uvicorn imports in each worker process when
the router runs with several workers (uvicorn needs an import string then);
the parent hands the resolved config over in an environment variable, so
every worker runs exactly what the parent validated.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmgw import logs
from llmgw.router.admission.gate import control_plane_gate, from_router_config
from llmgw.router.config import RouterConfig, projection, resolve_router_id
from llmgw.router.endpoints.scraper import Scraper
from llmgw.router.endpoints.view import EndpointSource, EndpointView, StaticSource, ViewSettings
from llmgw.router.http import openapi, snapshots
from llmgw.router.http.cors import Cors
from llmgw.router.http.errors import RouterError, error_body
from llmgw.router.http.models import EngineModels
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.metrics import RouterMetrics
from llmgw.router.request import body as rq
from llmgw.router.request import handler as px
from llmgw.router.request.kinds import RESPONSES_PREFIX
from llmgw.router.scheduling import pipeline as scheduling

if TYPE_CHECKING:
    from llmgw.router.admission.seam import Gate

CONFIG_ENV = "LLMGW_ROUTER_RESOLVED_CONFIG"
SNAPSHOT_ENV = "LLMGW_ROUTER_SNAPSHOT_DIR"


class RouterService:
    def __init__(
        self,
        config: RouterConfig,
        *,
        source: EndpointSource | None = None,
        gate: Gate | None = None,
    ):
        if config.nats_url:
            config = resolve_router_id(config)
        self.config = config
        self.metrics = RouterMetrics()
        self.view = EndpointView(
            ViewSettings(
                circuit_failures=config.circuit.failures,
                circuit_cooldown=config.circuit.cooldown_seconds,
                prefix_capacity=config.prefix.capacity_blocks,
                scheduling=scheduling.Settings(
                    stale_after=config.scrape.stale_after_seconds,
                    # Engines' KV events arrive over the bus, so only with a control plane.
                    kv_index=BlockIndex(config.prefix.index_max_blocks)
                    if config.nats_url
                    else None,
                    affinity_max_pending=config.prefix.affinity_max_pending,
                    affinity_max_pending_tokens=config.prefix.affinity_max_pending_tokens,
                ),
            ),
            observer=self.metrics,
        )
        self.admission = None
        if source is None and config.nats_url:
            # Tenants and bands arrive later: the gate always exists, and the proxy uses
            # it only while it has something to do (_install_gate).
            from llmgw.router.controlplane.source import ControlPlaneSource

            self.admission = control_plane_gate(config, self.metrics.admission)
            source = ControlPlaneSource(
                config, self.admission, self.metrics, on_gate_change=self._install_gate
            )
        elif gate is None:
            gate = self.admission = from_router_config(config, self.metrics.admission)
        self.source = source or StaticSource(projection(config))
        if self.admission is not None:
            self.admission.route_of = self.view.route
            self.view.on_load(self.admission.observed)
            self.view.subscribe(self._endpoints_changed)
        self.proxy = px.Proxy(
            self.view,
            self.metrics,
            px.Settings(
                max_body_bytes=config.max_body_bytes,
                body_read_seconds=config.body_read_timeout_seconds,
                attempts_per_model=config.retry.attempts_per_model,
                prefix_block_bytes=config.prefix.block_bytes,
                prefix_max_blocks=config.prefix.max_blocks,
                pool_limit=config.upstream.pool_limit,
                keepalive_seconds=config.upstream.keepalive_seconds,
                access_log=config.access_log,
            ),
            gate,
        )
        self._install_gate()
        self.scraper = (
            Scraper(
                self.view,
                self.metrics,
                config.scrape,
                fallback_only=bool(config.nats_url) and config.scrape.fallback_only,
            )
            if config.scrape.enabled
            else None
        )
        self.started = False
        self._writer: snapshots.Writer | None = None
        self.engine_models = EngineModels()

    async def start(self, snapshot_dir: Path | None = None) -> None:
        await self.proxy.start()
        await self.source.start(self.view)
        if self.scraper is not None:
            await self.scraper.start()
        self.started = True
        if snapshot_dir is not None:
            self._writer = snapshots.Writer(snapshot_dir, self.snapshot)
            self._writer.start()

    async def stop(self) -> None:
        self.started = False
        if self._writer is not None:
            await self._writer.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        await self.source.stop()
        await self.proxy.stop()
        if self.admission is not None:
            self.admission.close()

    def _endpoints_changed(self) -> None:
        def endpoints_of(model: str):
            route = self.view.route(model)
            return route.endpoints if route is not None else ()

        self.admission.endpoints_changed(endpoints_of)
        cold = any(r.scale_from_zero for m, _ in self.view.models() if (r := self.view.route(m)))
        if cold != self.admission.scale_from_zero:
            self.admission.routes_changed(cold)
            self._install_gate()

    def _install_gate(self) -> None:
        """Control-plane mode: admission in the request path only while it can act."""
        if self.config.nats_url and self.admission is not None:
            self.proxy.set_gate(self.admission if self.admission.active else None)

    def readiness(self) -> tuple[bool, str]:
        if not self.started:
            return False, "starting"
        if not self.view.ready():
            return False, "no ready endpoint known"
        return True, "ok"

    def describe_endpoints(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        stale = self.config.scrape.stale_after_seconds
        out = [ep.describe(now, stale) for ep in self.view.endpoints.values()]
        index = self.view.settings.scheduling.kv_index
        if index is not None:
            for ep in out:
                st = index.endpoints.get(ep["id"])
                # Blocks the engine holds per its KV events; null: no events (approximate).
                ep["kv_events_blocks"] = st.count if st is not None and st.synced else None
        return out

    def snapshot(self) -> snapshots.Snapshot:
        self.metrics.refresh_endpoints(self.view.endpoints.values(), time.monotonic())
        return snapshots.Snapshot(
            pid=os.getpid(),
            written_at=time.time(),
            ready=self.readiness()[0],
            metrics=self.metrics.registry.snapshot(),
            endpoints=self.describe_endpoints(),
        )

    # ------------------------------------------------------------ the public app

    def public_app(
        self,
        *,
        lifespan: bool = True,
        snapshot_dir: Path | None = None,
        tune_gc: bool = False,
    ) -> HotPaths:
        engine_models = self.engine_models

        def authenticate(request: Request) -> Response | None:
            try:
                self.proxy.gate.authenticate(dict(request.scope["headers"]))
            except RouterError as err:
                return _error(err.status, err.reason, err.message, request, err.headers)
            return None

        async def list_models(request: Request) -> Response:
            refused = authenticate(request)
            if refused is not None:
                return refused
            data = await engine_models.describe(
                self.proxy.session, self.view.models(), self.view.resolve
            )
            return JSONResponse({"object": "list", "data": data})

        async def get_model(request: Request) -> Response:
            refused = authenticate(request)
            if refused is not None:
                return refused
            name = request.path_params["model"]
            canonical = self.view.resolve(name)
            if canonical is None:
                return _error(404, "model_not_found", f"The model '{name}' does not exist", request)
            root = canonical.name if canonical.name != name else None
            data = await engine_models.describe(
                self.proxy.session, [(name, root)], self.view.resolve
            )
            return JSONResponse(data[0])

        @contextlib.asynccontextmanager
        async def run(app: Starlette):
            await self.start(snapshot_dir)
            if tune_gc:
                tune_collector()
            try:
                yield
            finally:
                await self.stop()

        hot = {path: self.proxy.endpoint(kind) for path, kind in rq.PATHS.items()}
        routes = [Route(path, ep, methods=["POST"]) for path, ep in hot.items()]
        routes.append(Route("/v1/models", list_models, methods=["GET"]))
        routes.append(Route("/v1/models/{model:path}", get_model, methods=["GET"]))
        routes.append(Route("/openapi.json", openapi.endpoint, methods=["GET"]))
        app = Starlette(
            routes=routes,
            lifespan=run if lifespan else None,
            exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        )
        cors = Cors(self.config.cors) if self.config.cors.allow_origins else None
        return HotPaths(app, hot, self.proxy.stored_responses(), self.proxy.new_rid, cors)


class HotPaths:
    """The Starlette app, with the proxy's paths answered before its middleware.

    The proxy endpoints are mounted in Starlette like any route, but Starlette's
    error and exception middleware wrap every ASGI send of every request in two
    more Python coroutines, which a streamed answer pays per event; the proxy
    handles its own errors, so an exact path match (or a stored response's path)
    skips them. Everything else (lifespan, /v1/models, 404s) goes through
    Starlette, with an `x-request-id` added to its answers when it has none.
    With CORS on, a preflight is answered here and allowed origins get their
    headers on every answer.
    """

    def __init__(
        self,
        app: Starlette,
        hot: dict[str, Any],
        stored: Any = None,
        new_rid: Any = None,
        cors: Cors | None = None,
    ):
        self.app = app
        self.hot = hot
        self.stored = stored
        self.new_rid = new_rid
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cors = self.cors
        if cors is not None:
            origin = _header(scope, b"origin")
            if origin is not None and cors.allowed(origin):
                if scope["method"] == "OPTIONS":
                    requested = _header(scope, b"access-control-request-method")
                    if requested is not None:
                        await _preflight(
                            _with_request_id(scope, send, self.new_rid), cors, origin, scope
                        )
                        return
                send = cors.wrap(origin, send)
        path = scope["path"]
        endpoint = self.hot.get(path)
        if endpoint is not None:
            await endpoint(scope, receive, send)
            return
        if (
            self.stored is not None
            and path.startswith(RESPONSES_PREFIX)
            and len(path) > len(RESPONSES_PREFIX)
        ):
            await self.stored(scope, receive, send)
            return
        await self.app(scope, receive, _with_request_id(scope, send, self.new_rid))


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def _preflight(send, cors: Cors, origin: bytes, scope) -> None:
    requested = _header(scope, b"access-control-request-headers")
    await send(
        {
            "type": "http.response.start",
            "status": 204,
            "headers": cors.preflight_headers(origin, requested),
        }
    )
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _with_request_id(scope, send, new_rid):
    """`send` that puts an x-request-id on the answer: the client's, or a new one."""
    rid = _header(scope, b"x-request-id") or (new_rid() if new_rid is not None else None)
    if rid is None:
        return send

    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(k == b"x-request-id" for k, _ in headers):
                headers.append((b"x-request-id", rid))
                message = {**message, "headers": headers}
        await send(message)

    return send_with_id


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    message = {
        404: f"no such endpoint: {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    return _error(exc.status_code, reason, message, request)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # Starlette logs the traceback; the client gets no stack trace.
    return _error(500, "internal_error", "internal error", request)


def _error(
    status: int,
    reason: str,
    message: str,
    request: Request,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> Response:
    headers = {"x-llmgw-reason": reason}
    for name, value in extra or ():
        headers[name.decode()] = value.decode("latin-1")
    return Response(
        error_body(status, reason, message),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# Objects allocated between two young-generation collections. Python's default
# (700) means a collection every request or two, and each one walks every young
# object of the requests in flight: measured, it cost a fifth of the router's CPU.
GC_YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """For a router process, once started: fewer, larger young collections, and the
    objects built at startup moved out of the collector's sight for good."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 50, 100)


def encode_config(config: RouterConfig) -> str:
    return msgspec.json.encode(config).decode()


def worker_app() -> HotPaths:
    """The factory each worker process calls (`--workers N`)."""
    config = msgspec.json.decode(os.environ[CONFIG_ENV].encode(), type=RouterConfig)
    logs.setup("router", config.log_level)
    snapshot_dir = os.environ.get(SNAPSHOT_ENV)
    service = RouterService(config)
    return service.public_app(
        snapshot_dir=Path(snapshot_dir) if snapshot_dir else None, tune_gc=True
    )
