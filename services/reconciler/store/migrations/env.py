"""Alembic environment: async SQLAlchemy over asyncpg.

`llmgw migrate` (see ../schema.py) builds the Alembic Config in code and
passes an open connection in `config.attributes["connection"]`, so no
alembic.ini is needed and the migrations run inside the caller's transaction
(under an advisory lock: several processes may migrate at once). Run through
the `alembic` command instead (to author a revision), the URL comes from
`sqlalchemy.url` or LLMGW_DATABASE_URL.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import pool
from sqlalchemy.ext.asyncio import create_async_engine

from llmgw.reconciler.store.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = (
        config.attributes.get("database_url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("LLMGW_DATABASE_URL")
    )
    if not url:
        raise SystemExit("no database URL: set LLMGW_DATABASE_URL or sqlalchemy.url")
    return url


def _configure(**kwargs) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run_on)
    finally:
        await engine.dispose()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
    else:
        asyncio.run(_run_async())


if context.is_offline_mode():
    run_offline()
else:
    run_online()
