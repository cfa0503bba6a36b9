"""The admin listener: /metrics, /healthz, /readyz and /debug/endpoints.

It runs on its own port so that scrapes and probes never queue behind client
traffic. One process: it reads the service directly (`LocalStats`). Several
workers: it runs in the parent and merges the workers' snapshots
(`MergedStats`, see snapshots.py).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw.router.http import snapshots
from llmgw.router.metrics import RouterMetrics

# A worker whose snapshot is older than this no longer makes the parent ready.
SNAPSHOT_FRESH_SECONDS = 5.0


class Stats(Protocol):
    def metrics_text(self) -> bytes: ...

    def readiness(self) -> tuple[bool, str]: ...

    def endpoints(self) -> dict[str, Any]: ...


class _Collect:
    """Adapts a `collect()` callable to prometheus_client's registry."""

    def __init__(self, collect):
        self.collect = collect


def _exposition(collect) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collect(collect))
    return generate_latest(registry)


class LocalStats:
    def __init__(self, service, listening: Callable[[], bool] | None = None):
        self.service = service
        # The service reports started from the public server's lifespan, which uvicorn
        # runs before it binds and listens: until `listening()` holds, connections to
        # the public port are refused, so readiness waits for it too.
        self.listening = listening

    def metrics_text(self) -> bytes:
        svc = self.service
        svc.metrics.refresh_endpoints(svc.view.endpoints.values(), time.monotonic())
        return _exposition(svc.metrics.registry.collect)

    def readiness(self) -> tuple[bool, str]:
        if self.listening is not None and not self.listening():
            return False, "the public port is not listening yet"
        return self.service.readiness()

    def endpoints(self) -> dict[str, Any]:
        return {"workers": 1, "endpoints": self.service.describe_endpoints()}


def accepts_connections(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something listens on host:port (a wildcard host is probed on loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MergedStats:
    def __init__(self, directory: Path, workers: int, public: tuple[str, int] | None = None):
        self.directory = directory
        self.workers = workers
        # uvicorn's supervisor binds the public socket but only a worker's server
        # calls listen(), after the worker's lifespan has already reported ready:
        # until then connections are refused, so readiness probes the port too.
        self.public = public
        self.metrics = RouterMetrics()  # the series definitions; values come from snapshots

    def metrics_text(self) -> bytes:
        snaps = snapshots.read_all(self.directory)
        every = [s.metrics for s, _ in snaps]
        live = [s.metrics for s, alive in snaps if alive]
        return _exposition(lambda: self.metrics.registry.merged(every, live))

    def readiness(self) -> tuple[bool, str]:
        now = time.time()
        fresh = [
            s
            for s, alive in snapshots.read_all(self.directory)
            if alive and now - s.written_at < SNAPSHOT_FRESH_SECONDS
        ]
        ready = sum(1 for s in fresh if s.ready)
        if ready and self.public is not None and not accepts_connections(*self.public):
            return False, "the public port does not accept connections yet"
        if ready:
            return True, f"{ready} of {self.workers} workers ready"
        if not fresh:
            return False, "no worker has reported yet"
        return False, "no worker knows a ready endpoint"

    def endpoints(self) -> dict[str, Any]:
        merged: dict[str, dict[str, Any]] = {}
        live = [s for s, alive in snapshots.read_all(self.directory) if alive]
        for snap in live:
            for ep in snap.endpoints:
                cur = merged.get(ep["id"])
                if cur is None:
                    cur = merged[ep["id"]] = {
                        **ep,
                        "inflight": 0,
                        "prefilling": 0,
                        "per_worker": [],
                    }
                elif ep["load_age_s"] is not None and (
                    cur["load_age_s"] is None or ep["load_age_s"] < cur["load_age_s"]
                ):
                    # The freshest sample any worker holds.
                    for key in ("load", "load_age_s", "stale", "scrape_error"):
                        cur[key] = ep[key]
                cur["inflight"] += ep["inflight"]
                cur["prefilling"] += ep["prefilling"]
                cur["per_worker"].append(
                    {
                        "pid": snap.pid,
                        "inflight": ep["inflight"],
                        "prefilling": ep["prefilling"],
                        "circuit": ep["circuit"],
                    }
                )
        for cur in merged.values():
            # The circuit as the worst worker sees it; each worker's is listed.
            order = {"closed": 0, "half_open": 1, "open": 2}
            cur["circuit"] = max(
                (w["circuit"] for w in cur["per_worker"]),
                key=lambda c: order.get(c["state"], 0),
            )
        return {"workers": len(live), "endpoints": list(merged.values())}


def admin_app(stats: Stats) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(stats.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, why = stats.readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "detail": why},
            status_code=200 if ready else 503,
        )

    async def debug_endpoints(request: Request) -> Response:
        return JSONResponse(stats.endpoints())

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/debug/endpoints", debug_endpoints),
        ]
    )
