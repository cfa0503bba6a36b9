"""The admin listener: /metrics, /healthz, /readyz and the operator JSON API.

Readiness is about serving reads, which leader and standby both do from
Postgres: 200 for either (the body says which), 503 when the database cannot
be reached. Errors use the OpenAI error shape, like every llmgw HTTP surface.

The probes and /metrics stay open (kubelets and Prometheus carry no token);
every /api/ route names the role it needs (`auth`), and a request without it
gets 401 (with `WWW-Authenticate: Bearer`) or 403.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmgw.reconciler import metrics as m
from llmgw.reconciler.api import auth
from llmgw.reconciler.api import read as readapi

log = logging.getLogger(__name__)

DB_TIMEOUT = 5.0


@dataclass
class Role:
    """What this process is doing now; the service updates it, the listener reports it."""

    id: str
    name: str = "starting"  # starting | standby | leader | stopping
    # Why this process cannot lead, for an operator to act on ("" when nothing is wrong).
    problem: str = ""


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error(
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSON:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSON(body, status, headers=headers)


def denied(why: auth.Denied) -> JSON:
    if why.status == 401:
        return error(
            401, why.message, "invalid_request_error", why.code, {"WWW-Authenticate": "Bearer"}
        )
    return error(why.status, why.message, "permission_error", why.code)


def _int_param(request: Request, name: str, default: int | None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name}={raw!r}: expected an integer") from None


def build_app(engine: AsyncEngine, role: Role, authorizer: auth.Authorizer) -> Starlette:
    async def read(fn: Callable[[AsyncConnection], Awaitable[Any]]) -> JSON:
        try:
            async with asyncio.timeout(DB_TIMEOUT), engine.connect() as conn:
                return JSON(await fn(conn))
        except Exception as exc:  # any database failure: the read side says so, stays up
            log.warning("operator API read failed: %s", exc)
            return error(503, f"database unavailable: {exc}", "service_unavailable")

    async def metrics(request: Request) -> Response:
        m.LEADER.set(1 if role.name == "leader" else 0)
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSON({"status": "ok", "role": role.name, "id": role.id})

    async def readyz(request: Request) -> Response:
        try:
            async with asyncio.timeout(DB_TIMEOUT), engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as exc:
            return JSON({"ready": False, "role": role.name, "id": role.id, "error": str(exc)}, 503)
        return JSON({"ready": True, "role": role.name, "id": role.id})

    async def status(request: Request) -> Response:
        async def _status(conn: AsyncConnection) -> dict[str, Any]:
            return {
                "role": role.name,
                "id": role.id,
                "problem": role.problem,
                **await readapi.status(conn),
            }

        return await read(_status)

    def listing(fn: Callable[[AsyncConnection], Awaitable[Any]]):
        async def endpoint(request: Request) -> Response:
            return await read(fn)

        return endpoint

    async def events(request: Request) -> Response:
        try:
            from_seq = _int_param(request, "from_seq", 1)
            to_seq = _int_param(request, "to_seq", None)
            limit = _int_param(request, "limit", 1000)
        except ValueError as exc:
            return error(400, str(exc), "invalid_request_error")
        return await read(lambda conn: readapi.events(conn, from_seq or 1, to_seq, limit or 1000))

    async def dead_letters(request: Request) -> Response:
        try:
            limit = _int_param(request, "limit", 100)
        except ValueError as exc:
            return error(400, str(exc), "invalid_request_error")
        return await read(lambda conn: readapi.dead_letters(conn, limit or 100))

    async def explain(request: Request) -> Response:
        model = request.path_params["model"]
        response = await read(lambda conn: readapi.explain(conn, model))
        if response.status_code == 200 and response.body == b"null":
            return error(404, f"model {model!r} is not in the catalog or the log", "not_found")
        return response

    async def not_found(request: Request, exc: Exception) -> Response:
        return error(404, f"no such endpoint: {request.url.path}", "not_found")

    def needs(needed: str, endpoint: Callable[[Request], Awaitable[Response]]):
        async def guarded(request: Request) -> Response:
            why = authorizer.check(request.headers.get("authorization"), needed)
            return denied(why) if why is not None else await endpoint(request)

        return guarded

    routes = [
        Route("/metrics", metrics),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/api/status", needs(auth.READ, status)),
        Route("/api/nodes", needs(auth.READ, listing(readapi.nodes))),
        Route("/api/models", needs(auth.READ, listing(readapi.models))),
        Route("/api/replicas", needs(auth.READ, listing(readapi.replicas))),
        Route("/api/endpoints", needs(auth.READ, listing(readapi.endpoints))),
        Route("/api/adapters", needs(auth.READ, listing(readapi.adapters))),
        # Bands are the admission classes routers enforce (ceilings, queues): how the
        # cluster behaves, with no tenant or credential in them.
        Route("/api/bands", needs(auth.READ, listing(readapi.bands))),
        # The log carries the catalog's declarations as published (tenant key hashes,
        # plain upstream headers; secret header values never travel in events), so a
        # read token sees those here: docs/security.md says so.
        Route("/api/events", needs(auth.READ, events)),
        Route("/api/dead-letters", needs(auth.READ, dead_letters)),
        Route("/api/explain/{model:path}", needs(auth.READ, explain)),
        # Who the tenants are and what they may use; the catalog adds key hashes
        # and upstream headers.
        Route("/api/tenants", needs(auth.ADMIN, listing(readapi.tenants))),
        Route("/api/catalog", needs(auth.ADMIN, listing(readapi.catalog))),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found})
