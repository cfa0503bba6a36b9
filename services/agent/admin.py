"""The agent's admin listener: /metrics, /healthz (the process answers) and /readyz.

Ready means the control plane can reach this node: connected to NATS and the
registration of this connection acknowledged. Engines serve without the agent,
so a probe failing here says "commands cannot arrive", not "models are down".
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


def build_app(
    metrics_text: Callable[[], bytes], readiness: Callable[[], tuple[bool, str]]
) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, why = readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "detail": why},
            status_code=200 if ready else 503,
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
        ]
    )
