"""An admin HTTP listener (/metrics, probes) run as a task of a service's own event loop.

The service owns SIGTERM, so uvicorn installs no signal handlers. The socket is
bound here, before uvicorn starts, so an address in use is a clear `ListenError`
at start instead of uvicorn's `sys.exit` inside a task.

With `tls` (an `llmgw.tlsconfig.AdminTLS` that is set) the listener speaks
HTTPS and completes no handshake without a client certificate its CA signed:
every path, probes included, is then behind the certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from starlette.applications import Starlette

from llmgw import tlsconfig


class ListenError(OSError):
    """The admin address cannot be listened on (in use, not local, not permitted)."""


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the service owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ListenError(
            exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


class AdminServer:
    def __init__(self, app: Starlette, host: str, port: int, tls: tlsconfig.AdminTLS | None = None):
        self.host, self.port = host, port
        ssl_options = tlsconfig.admin_server_options(tls) if tls else {}
        self.scheme = "https" if ssl_options else "http"
        self.server = QuietServer(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", access_log=False, **ssl_options
            )
        )
        self.task: asyncio.Task | None = None

    async def start(self, timeout: float = 10.0) -> None:
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]  # the real one when asked for port 0
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]), name="admin-server")
        try:
            async with asyncio.timeout(timeout):
                while not self.server.started:
                    if self.task.done():
                        self.task.result()
                        raise RuntimeError("admin listener exited before it started")
                    await asyncio.sleep(0.02)
        except BaseException:
            # The caller gets no server to stop: end the task and free the port here,
            # or a failed start leaves a listening socket and a task nobody owns.
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
            sock.close()
            self.task = None
            raise

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.task, timeout=5)
        except (TimeoutError, asyncio.CancelledError, Exception):
            self.task.cancel()
