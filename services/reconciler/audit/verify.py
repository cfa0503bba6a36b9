"""`llmgw audit verify`: replaying the archive from seq 1 must give exactly the live tables.

The archive, the projection tables and the placement history are read in one
REPEATABLE READ snapshot (a running leader may keep folding meanwhile). The
archive is folded into an empty in-memory state with the same pure fold the
leader uses; its rows are compared with the live rows table by table, key by
key, column by column. Any difference means the projection drifted from the
log (a bug, or a hand edit), and the command exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from llmgw import contracts as c
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import migrate as migrate_cli
from llmgw.reconciler.store import rows, schema, store
from llmgw.reconciler.store import tables as t

CHUNK = 5000
SHOWN = 50  # differences printed before "... and N more"


@dataclass
class Report:
    events: int = 0
    position: int = 0
    differences: list[str] = field(default_factory=list)


async def replay_archive(
    conn: AsyncConnection, report: Report
) -> tuple[ClusterState, list[rows.Row]]:
    """Fold every archived event, in sequence order, into a fresh state."""
    state = ClusterState()
    decisions: list[rows.Row] = []
    archive = t.ArchivedEvent.__table__
    after = 0
    while True:
        q = (
            select(archive.c.seq, archive.c.payload)
            .where(archive.c.seq > after)
            .order_by(archive.c.seq)
            .limit(CHUNK)
        )
        chunk = (await conn.execute(q)).all()
        if not chunk:
            return state, decisions
        for seq, payload in chunk:
            report.events += 1
            try:
                event = c.decode(payload)
            except c.ContractError as exc:
                report.differences.append(f"event_archive seq {seq}: cannot be decoded: {exc}")
                continue
            fold.apply(state, seq, event)
            row = rows.decision_row(seq, event)
            if row is not None:
                decisions.append(row)
        after = chunk[-1][0]


def compare_table(name: str, live: dict[Any, dict], expected: dict[Any, dict]) -> list[str]:
    out = []
    for key in sorted(set(live) | set(expected), key=str):
        if key not in live:
            out.append(f"{name} {key}: missing from the table (replay has it)")
        elif key not in expected:
            out.append(f"{name} {key}: in the table but not in the replay")
        else:
            a, b = live[key], expected[key]
            for col in sorted(set(a) | set(b)):
                if a.get(col) != b.get(col):
                    out.append(
                        f"{name} {key}: {col}: table {a.get(col)!r} != replay {b.get(col)!r}"
                    )
    return out


def _by_pk(table, table_rows: list[dict]) -> dict[Any, dict]:
    pk = [col.name for col in table.primary_key.columns]
    if len(pk) == 1:
        return {row[pk[0]]: row for row in table_rows}
    return {tuple(row[n] for n in pk): row for row in table_rows}


async def verify(engine: AsyncEngine) -> Report:
    report = Report()
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            report.position = await store.read_position(conn) or 0
            live = await store.read_state_rows(conn)
            decisions_table = t.PlacementDecision.__table__
            live_decisions = [
                dict(r) for r in (await conn.execute(select(decisions_table))).mappings()
            ]
            state, decisions = await replay_archive(conn, report)
    if state.last_seq > report.position:
        report.differences.append(
            f"consumer_positions: at {report.position}, but the archive reaches {state.last_seq}"
        )
    expected = rows.all_rows(state)
    for table in rows.STATE_TABLES:
        report.differences += compare_table(
            table.name,
            _by_pk(table, live[table.name]),
            _by_pk(table, list(expected[table.name].values())),
        )
    report.differences += compare_table(
        decisions_table.name,
        _by_pk(decisions_table, live_decisions),
        _by_pk(decisions_table, decisions),
    )
    return report


def configure(parser: argparse.ArgumentParser) -> None:
    migrate_cli.add_database_url(parser)


def run(args: argparse.Namespace) -> int:
    url = migrate_cli.database_url(args)
    try:
        report = asyncio.run(schema.at_head(url, verify))
    except schema.SchemaError as exc:
        print(f"llmgw audit verify: {exc}", file=sys.stderr)
        return 1
    except (OSError, OperationalError, DBAPIError) as exc:
        print(f"llmgw audit verify: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    for line in report.differences[:SHOWN]:
        print(line)
    if len(report.differences) > SHOWN:
        print(f"... and {len(report.differences) - SHOWN} more")
    if report.differences:
        print(
            f"FAIL: {len(report.differences)} difference(s) between the projection and a replay "
            f"of {report.events} archived events"
        )
        return 1
    print(
        f"OK: replaying {report.events} archived events (position {report.position}) "
        "reproduces every projection table"
    )
    return 0
