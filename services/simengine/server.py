"""Serving a SimApp with uvicorn (httptools, uvloop), and the process lifecycle around it.

We bind the listening socket ourselves, after any startup delay, so the port stays closed while
the simulated engine "loads" and `--port 0` yields a known port. Signals are ours too: SIGTERM
or SIGINT stops accepting, lets in-flight requests finish for up to `drain_seconds`, aborts the
rest, and the process exits 0 (uvicorn's own handling would re-raise the signal after draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable

import uvicorn

from llmgw.simengine.app import SimApp
from llmgw.simengine.config import SimConfig

log = logging.getLogger(__name__)

READY_PREFIX = "llmgw sim-engine listening on "


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        # Signals are handled by serve() below, through the event loop.
        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), backlog=4096)


def uvicorn_server(app: SimApp, cfg: SimConfig) -> uvicorn.Server:
    ucfg = uvicorn.Config(
        app,
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        server_header=False,
        timeout_graceful_shutdown=cfg.drain_seconds,
        timeout_keep_alive=30,
    )
    return _Server(ucfg)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(
    cfg: SimConfig,
    *,
    app: SimApp | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
) -> int:
    """Run one simulator until `stop` is set or SIGTERM/SIGINT arrives; returns the exit status."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        if cfg.startup_seconds:
            log.info("simulating model load for %.1fs; port stays closed", cfg.startup_seconds)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.startup_seconds)
            if stop.is_set():
                return 0
        sock = bind(cfg.host, cfg.port)
        server = uvicorn_server(app or SimApp(cfg), cfg)
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="simengine-serve")
        stopping = asyncio.create_task(stop.wait(), name="simengine-stop")
        try:
            while not server.started and not serving.done():
                await asyncio.sleep(0.01)
            if server.started:
                url = url_of(sock)
                log.info("listening on %s (model %s)", url, ", ".join(cfg.served_names))
                if on_ready is not None:
                    on_ready(url)
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                log.info("stopping: no new connections; draining in-flight requests")
                server.should_exit = True
            await serving
        finally:
            stopping.cancel()
        return 0 if server.started else 1
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def print_ready(url: str) -> None:
    """The one line on stdout: test harnesses read it to learn the URL (e.g. with --port 0)."""
    sys.stdout.write(f"{READY_PREFIX}{url}\n")
    sys.stdout.flush()
