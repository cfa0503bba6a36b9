"""Running the router: one process, or a parent with N worker processes.

One worker: the public and admin servers share one uvloop event loop; SIGTERM
or SIGINT stops new connections, lets requests in flight finish (up to
shutdown_grace_seconds), then stops the admin listener and exits 0.

N workers: uvicorn's supervisor (which needs an import string, hence
`service.worker_app`) binds the public socket and runs the workers, restarting any
that dies; the parent itself serves the admin listener from a thread, merging
the workers' snapshots. SIGTERM reaches the supervisor, which stops the workers
(each drains like a single process), then the admin listener stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from llmgw.config import host_port
from llmgw.router.config import RouterConfig
from llmgw.router.http.admin import LocalStats, MergedStats, admin_app
from llmgw.router.http.app import public_app
from llmgw.router.http.cork import CorkedHttpToolsProtocol
from llmgw.router.service import CONFIG_ENV, SNAPSHOT_ENV, RouterService, encode_config

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


_COMMON = {
    "loop": "uvloop",
    # httptools, with a bound on request heads and one write per loop turn
    "http": CorkedHttpToolsProtocol,
    "log_config": None,
    "access_log": False,
    "server_header": False,
    "proxy_headers": False,  # nothing reads the client address; the rewrite is per request
}


def _uvicorn_config(app, listen: str, default_port: int, **kw) -> uvicorn.Config:
    host, port = host_port(listen, default_port)
    return uvicorn.Config(app, host=host, port=port, **{**_COMMON, **kw})


def public_config(app, config: RouterConfig, **kw) -> uvicorn.Config:
    return _uvicorn_config(
        app,
        config.listen,
        8080,
        lifespan="on",
        timeout_graceful_shutdown=config.shutdown_grace_seconds,
        **kw,
    )


def admin_config(app, config: RouterConfig) -> uvicorn.Config:
    return _uvicorn_config(app, config.admin_listen, 9090, lifespan="off")


async def serve_single(config: RouterConfig) -> None:
    service = RouterService(config)
    public = _Server(public_config(public_app(service, tune_gc=True), config))
    stats = LocalStats(service, listening=lambda: public.started)
    admin = _Server(admin_config(admin_app(stats), config))

    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        if public.should_exit:
            public.force_exit = True  # a second signal: stop waiting for streams
        public.should_exit = True
        log.info("signal %s: draining", signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    admin_task = loop.create_task(admin.serve())
    try:
        await public.serve()
    finally:
        admin.should_exit = True
        await admin_task
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def serve_workers(config: RouterConfig) -> int:
    snapshot_dir = Path(tempfile.mkdtemp(prefix="llmgw-router-"))
    os.environ[CONFIG_ENV] = encode_config(config)
    os.environ[SNAPSHOT_ENV] = str(snapshot_dir)
    host, port = host_port(config.listen, 8080)
    stats = MergedStats(snapshot_dir, config.workers, public=(host, port))
    admin = _Server(admin_config(admin_app(stats), config))
    thread = threading.Thread(target=admin.run, name="router-admin", daemon=True)
    thread.start()
    try:
        uvicorn.run(
            "llmgw.router.service:worker_app",
            factory=True,
            workers=config.workers,
            host=host,
            port=port,
            lifespan="on",
            timeout_graceful_shutdown=config.shutdown_grace_seconds,
            **_COMMON,
        )
    finally:
        admin.should_exit = True
        thread.join(timeout=10)
        shutil.rmtree(snapshot_dir, ignore_errors=True)
    return 0
