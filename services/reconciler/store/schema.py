"""Database engine and schema version: connect, migrate, and refuse to run on an old schema.

The Alembic Config is built in code with `script_location` pointing at the
`migrations` folder inside this package, so `llmgw migrate` works the same
from a checkout and from an installed wheel, with no alembic.ini to find.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

# Serialises concurrent `llmgw migrate` runs (any constant distinct from the leader lock).
MIGRATION_LOCK_ID = 0x6C6C6D67_6D696772

DEFAULT_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/llmgw"

_json_encoder = msgspec.json.Encoder()

T = TypeVar("T")


class SchemaError(RuntimeError):
    """The database schema is not the one this code needs."""


def script_location() -> Path:
    return Path(__file__).resolve().parent / "migrations"


def normalize_url(url: str) -> str:
    """Accept postgresql:// and postgres:// too; SQLAlchemy needs the asyncpg driver named."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    return url


def asyncpg_dsn(url: str) -> str:
    """The same database as a plain DSN for asyncpg.connect()."""
    return (
        make_url(normalize_url(url))
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


def make_engine(url: str, **kwargs) -> AsyncEngine:
    """An async engine whose JSON columns go through msgspec (faster than json)."""
    kwargs.setdefault("pool_size", 5)
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(
        normalize_url(url),
        json_serializer=lambda obj: _json_encoder.encode(obj).decode(),
        json_deserializer=msgspec.json.decode,
        **kwargs,
    )


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migrations found"
    return head


def _run(sync_conn, action: str, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = sync_conn
    getattr(command, action)(cfg, revision)


async def _migrate(engine: AsyncEngine, action: str, revision: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_ID})
        await conn.run_sync(_run, action, revision)


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    await _migrate(engine, "upgrade", revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    await _migrate(engine, "downgrade", revision)


async def current_revision(conn: AsyncConnection) -> str | None:
    def _current(sync_conn) -> str | None:
        return MigrationContext.configure(sync_conn).get_current_revision()

    return await conn.run_sync(_current)


async def require_head(engine: AsyncEngine) -> None:
    """Raise SchemaError, saying what to run, unless the schema is at the latest revision."""
    async with engine.connect() as conn:
        current = await current_revision(conn)
    head = head_revision()
    if current != head:
        shown = current or "empty (no llmgw tables)"
        raise SchemaError(
            f"database schema is at {shown}, this reconciler needs {head}: "
            "run `llmgw migrate --database-url URL` first"
        )


async def at_head(url: str, work: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """`work(engine)` on a one-connection engine for `url` once the schema is at head
    (the audit commands), the engine disposed after."""
    engine = make_engine(url, pool_size=1)
    try:
        await require_head(engine)
        return await work(engine)
    finally:
        await engine.dispose()
