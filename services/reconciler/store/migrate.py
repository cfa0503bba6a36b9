"""`llmgw migrate`: bring the database schema to the latest revision (or down, for tests)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from sqlalchemy.exc import DBAPIError, OperationalError

from llmgw.reconciler.store import schema


def add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        help=f"PostgreSQL URL (default: $LLMGW_DATABASE_URL, else {schema.DEFAULT_DATABASE_URL})",
    )


def database_url(args: argparse.Namespace) -> str:
    return args.database_url or os.environ.get("LLMGW_DATABASE_URL") or schema.DEFAULT_DATABASE_URL


def configure(parser: argparse.ArgumentParser) -> None:
    add_database_url(parser)
    parser.add_argument(
        "--downgrade",
        metavar="REVISION",
        help="migrate down to REVISION instead ('base' drops every llmgw table)",
    )


async def _main(url: str, downgrade_to: str | None) -> str | None:
    engine = schema.make_engine(url, pool_size=1)
    try:
        if downgrade_to:
            await schema.downgrade(engine, downgrade_to)
        else:
            await schema.upgrade(engine)
        async with engine.connect() as conn:
            return await schema.current_revision(conn)
    finally:
        await engine.dispose()


def run(args: argparse.Namespace) -> int:
    url = database_url(args)
    try:
        current = asyncio.run(_main(url, args.downgrade))
    except (OSError, OperationalError, DBAPIError) as exc:
        print(f"llmgw migrate: cannot migrate {url}: {exc}", file=sys.stderr)
        return 1
    print(f"schema at {current or 'base (empty)'}")
    return 0
