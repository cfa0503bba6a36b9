"""`llmgw audit rebuild`: rewrite every projection table from the event archive.

For when `llmgw audit verify` finds drift (a hand edit, a bug since fixed), or
after a migration that adds a projection: fold the archive from seq 1 and
replace the state tables and the placement history in one transaction. The
consumer position is left alone (dead letters above the archive's last
sequence stay skipped). It holds the leader lock while it works, so it refuses
to run beside a leading reconciler, and no reconciler starts leading meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import asyncpg
from sqlalchemy import delete, insert, text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.reconciler import leader
from llmgw.reconciler.audit.verify import Report, replay_archive
from llmgw.reconciler.store import migrate as migrate_cli
from llmgw.reconciler.store import rows, schema
from llmgw.reconciler.store import tables as t

_CHUNK = 1000


class Busy(RuntimeError):
    pass


@dataclass
class Rebuilt:
    events: int
    rows: int
    seconds: float


async def rebuild(engine: AsyncEngine, lock_id: int = leader.DEFAULT_LOCK_ID) -> Rebuilt:
    started = time.perf_counter()
    async with engine.begin() as conn:
        got = (
            await conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": lock_id})
        ).scalar_one()
        if not got:
            raise Busy("a reconciler is leading: stop every reconciler first")
        report = Report()
        state, decisions = await replay_archive(conn, report)
        if report.differences:
            raise RuntimeError("; ".join(report.differences[:5]))
        written = 0
        expected = rows.all_rows(state)
        targets = [(tbl, list(expected[tbl.name].values())) for tbl in rows.STATE_TABLES]
        targets.append((t.PlacementDecision.__table__, decisions))
        for table, table_rows in targets:
            await conn.execute(delete(table))
            for i in range(0, len(table_rows), _CHUNK):
                await conn.execute(insert(table), table_rows[i : i + _CHUNK])
            written += len(table_rows)
    return Rebuilt(report.events, written, time.perf_counter() - started)


def configure(parser: argparse.ArgumentParser) -> None:
    migrate_cli.add_database_url(parser)


def run(args: argparse.Namespace) -> int:
    url = migrate_cli.database_url(args)
    try:
        done = asyncio.run(schema.at_head(url, rebuild))
    except (Busy, schema.SchemaError) as exc:
        print(f"llmgw audit rebuild: {exc}", file=sys.stderr)
        return 1
    except (OSError, OperationalError, DBAPIError, asyncpg.PostgresError) as exc:
        print(f"llmgw audit rebuild: cannot rebuild {url}: {exc}", file=sys.stderr)
        return 1
    print(f"rebuilt {done.rows} rows from {done.events} archived events in {done.seconds:.2f}s")
    return 0
