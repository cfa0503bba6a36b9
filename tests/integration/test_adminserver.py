"""The shared admin listener (adminserver.py): a start that fails leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from starlette.applications import Starlette

from llmgw import adminserver


def _stuck_app() -> Starlette:
    """An app whose startup never finishes, so the listener never reports started."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.Event().wait()
        yield

    return Starlette(lifespan=lifespan)


async def test_a_start_that_times_out_frees_the_port_and_leaves_no_task():
    server = adminserver.AdminServer(_stuck_app(), "127.0.0.1", 0)
    with pytest.raises(TimeoutError):
        await server.start(timeout=0.3)
    port = server.port
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "admin-server"]
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more
    await server.stop()  # nothing to stop: a no-op, not an error


async def test_a_started_listener_serves_and_stops():
    server = adminserver.AdminServer(Starlette(), "127.0.0.1", 0)
    await server.start()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) == 0
    await server.stop()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0
