"""vLLM's probes on the public port: /health, /ping and /version.

Clients built for vLLM check the API port itself before sending load (guidellm
stops when /health fails), so a router in front of vLLM answers them as vLLM
does: /health an empty 200, or an empty 503 when it cannot serve (vLLM: its
engine is dead; here: the router's readiness, as /readyz on the admin port
reports it), /ping the same for GET and POST (SageMaker's probe), /version
`{"version": ...}` with llmgw's version. They ask for no API key: they say
only whether the router can route, which any request would show.

They are Starlette routes, behind the hot paths' exact match, so chat requests
never look at them.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw import __version__


def routes(readiness: Callable[[], tuple[bool, str]]) -> list[Route]:
    async def health(request: Request) -> Response:
        return Response(status_code=200 if readiness()[0] else 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
    ]
