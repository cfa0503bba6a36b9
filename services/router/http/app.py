"""The public ASGI app of a router process: the proxy's paths, /v1/models, the OpenAPI
document, vLLM's probes and the error answers, for a `service.RouterService` that it
starts and stops.

`HotPaths` answers the proxy's paths before Starlette's middleware (see its docstring);
the rest goes through Starlette.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmgw.router.http import openapi, probes
from llmgw.router.http.cors import Cors
from llmgw.router.http.errors import RouterError, error_body
from llmgw.router.request import body as rq
from llmgw.router.request.kinds import RESPONSES_PREFIX

if TYPE_CHECKING:
    from llmgw.router.service import RouterService


def public_app(
    service: RouterService,
    *,
    lifespan: bool = True,
    snapshot_dir: Path | None = None,
    tune_gc: bool = False,
) -> HotPaths:
    """The public app of a router process: the proxy's paths, /v1/models, the OpenAPI
    document and vLLM's probes (probes.py), with the service started and stopped by
    its lifespan."""
    engine_models = service.engine_models

    def authenticate(request: Request) -> tuple[Any, Response | None]:
        """The caller (None without tenants), or the refusal to answer."""
        try:
            return service.proxy.gate.authenticate(dict(request.scope["headers"])), None
        except RouterError as err:
            # The error's own body: an admission refusal carries OpenAI's type and code
            # (a bad key is invalid_request_error / invalid_api_key, as on chat).
            return None, _error_response(err.status, err.reason, err.body(), err.headers)

    async def list_models(request: Request) -> Response:
        who, refused = authenticate(request)
        if refused is not None:
            return refused
        view = service.view
        # Adapters too, but only those the caller may use: a name must not leak.
        names = view.models() + [(a.name, None) for a in view.adapters() if a.allows(who)]
        data = await engine_models.describe(service.proxy.session, names, view.resolve)
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        who, refused = authenticate(request)
        if refused is not None:
            return refused
        name = request.path_params["model"]
        canonical = service.view.resolve(name)
        if canonical is None or not canonical.allows(who):
            return _error(404, "model_not_found", f"The model '{name}' does not exist", request)
        root = canonical.name if canonical.name != name else None
        data = await engine_models.describe(
            service.proxy.session, [(name, root)], service.view.resolve
        )
        return JSONResponse(data[0])

    @contextlib.asynccontextmanager
    async def run(app: Starlette):
        await service.start(snapshot_dir)
        if tune_gc:
            tune_collector()
        try:
            yield
        finally:
            await service.stop()

    hot = {path: service.proxy.endpoint(kind) for path, kind in rq.PATHS.items()}
    routes = [Route(path, ep, methods=["POST"]) for path, ep in hot.items()]
    routes.append(Route("/v1/models", list_models, methods=["GET"]))
    routes.append(Route("/v1/models/{model:path}", get_model, methods=["GET"]))
    routes.append(Route("/openapi.json", openapi.endpoint, methods=["GET"]))
    routes.extend(probes.routes(service.readiness))
    app = Starlette(
        routes=routes,
        lifespan=run if lifespan else None,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    cors = Cors(service.config.cors) if service.config.cors.allow_origins else None
    return HotPaths(app, hot, service.proxy.stored_responses(), service.proxy.new_rid, cors)


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
) -> Response:
    return _error_response(status, reason, error_body(status, reason, message))


def _error_response(
    status: int, reason: str, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> Response:
    headers = {"x-llmgw-reason": reason}
    for name, value in extra or ():
        headers[name.decode()] = value.decode("latin-1")
    return Response(body, status_code=status, media_type="application/json", headers=headers)


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
