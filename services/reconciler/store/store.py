"""Postgres I/O for the fold: load the state, commit a batch together with the position.

A batch is committed in ONE transaction: its archive rows, placement history,
dead letters, the changed state rows, and the new consumer position. The
position update is a compare-and-set on the position this leader loaded, so
two processes that both believe they lead can never both commit the same
sequence (the advisory lock keeps that from happening; this fence makes it
harmless if it ever does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import Text, and_, any_, bindparam, delete, insert, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from llmgw import subjects
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import rows as r
from llmgw.reconciler.store import tables as t

POSITION_NAME = "reconciler"

_position = t.ConsumerPosition.__table__
_archive = t.ArchivedEvent.__table__
_decisions = t.PlacementDecision.__table__
_dead = t.DeadLetter.__table__
_terms = t.LeaderTerm.__table__
_TABLES = {tbl.name: tbl for tbl in r.STATE_TABLES}
_PROJECTION_OF = {p.table.name: p for p in r.PROJECTIONS.values()}
# asyncpg allows 32767 bind parameters per statement.
_CHUNK = 1000


_KNOWN_IDS = select(_archive.c.msg_id, _archive.c.seq).where(
    _archive.c.msg_id == any_(bindparam("ids", type_=ARRAY(Text)))
)
_ARCHIVE_COLUMNS = [col.name for col in _archive.columns]


class Fenced(RuntimeError):
    """Another process moved the consumer position: this one must stop acting."""


@dataclass
class BatchWrites:
    first_seq: int  # the position the batch starts from (expected in the table)
    last_seq: int  # the position after the batch
    state: r.Writes
    term: int = 0  # the newest leader term folded after the batch
    archive: list[r.Row] = field(default_factory=list)
    decisions: list[r.Row] = field(default_factory=list)
    dead_letters: list[r.Row] = field(default_factory=list)


async def read_position(conn: AsyncConnection, name: str = POSITION_NAME) -> int | None:
    res = await conn.execute(select(_position.c.last_seq).where(_position.c.name == name))
    return res.scalar_one_or_none()


async def ensure_position(conn: AsyncConnection, name: str = POSITION_NAME) -> int:
    await conn.execute(
        pg_insert(_position)
        .values(name=name, stream=subjects.EVENTS_STREAM, last_seq=0, updated_at=time.time())
        .on_conflict_do_nothing(index_elements=["name"])
    )
    return await read_position(conn, name) or 0


async def read_state_rows(conn: AsyncConnection) -> dict[str, list[r.Row]]:
    out: dict[str, list[r.Row]] = {}
    for tbl in r.STATE_TABLES:
        res = await conn.execute(select(tbl))
        out[tbl.name] = [dict(row) for row in res.mappings()]
    return out


async def load_state(engine: AsyncEngine, name: str = POSITION_NAME) -> ClusterState:
    """The folded state as the projection tables hold it, at the stored position.

    One REPEATABLE READ snapshot, so the rows and the position agree.
    """
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            position = await ensure_position(conn, name)
            term = await read_folded_term(conn, name)
            rows = await read_state_rows(conn)
    state = r.state_from_rows(rows, position)
    state.term = term
    return state


async def read_folded_term(conn: AsyncConnection, name: str = POSITION_NAME) -> int:
    res = await conn.execute(select(_position.c.term).where(_position.c.name == name))
    return res.scalar_one_or_none() or 0


async def next_term(engine: AsyncEngine, holder: str, now: float | None = None) -> int:
    """Take the next leader term (call it holding the leader lock): 1, 2, 3, ...

    Terms only grow, whoever holds the lock, so anything stamped with a term says
    which leader produced it and whether a newer one has taken over since.
    """
    stmt = pg_insert(_terms).values(
        name=POSITION_NAME, term=1, holder=holder, started_at=now or time.time()
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["name"],
        set_={
            "term": _terms.c.term + 1,
            "holder": stmt.excluded.holder,
            "started_at": stmt.excluded.started_at,
        },
    ).returning(_terms.c.term)
    async with engine.begin() as conn:
        return (await conn.execute(stmt)).scalar_one()


async def known_ids(conn: AsyncConnection, ids: Sequence[str]) -> dict[str, int]:
    """Event ids already in the archive, with the sequence they were folded at."""
    if not ids:
        return {}
    # = ANY(array): one cached statement whatever the batch size (IN (...) recompiles).
    res = await conn.execute(_KNOWN_IDS, {"ids": list(ids)})
    return {msg_id: seq for msg_id, seq in res.all()}


def _upsert(table):
    stmt = pg_insert(table)
    pk = [col.name for col in table.primary_key.columns]
    return stmt.on_conflict_do_update(
        index_elements=pk,
        set_={col.name: stmt.excluded[col.name] for col in table.columns if col.name not in pk},
    )


async def _insert_many(conn: AsyncConnection, stmt, rows: list[r.Row]) -> None:
    for i in range(0, len(rows), _CHUNK):
        await conn.execute(stmt, rows[i : i + _CHUNK])


async def write_batch(conn: AsyncConnection, batch: BatchWrites, name: str = POSITION_NAME) -> None:
    """All of a batch's writes, inside the caller's transaction; raises Fenced on a lost race."""
    res = await conn.execute(
        update(_position)
        .where(_position.c.name == name, _position.c.last_seq == batch.first_seq)
        .values(last_seq=batch.last_seq, term=batch.term, updated_at=time.time())
    )
    if res.rowcount != 1:
        raise Fenced(
            f"consumer position is no longer {batch.first_seq}: another reconciler is folding"
        )
    if batch.archive:
        # COPY: the archive is most of a batch's bytes; in the same transaction.
        raw = (await conn.get_raw_connection()).driver_connection
        await raw.copy_records_to_table(
            _archive.name,
            records=[tuple(row[col] for col in _ARCHIVE_COLUMNS) for row in batch.archive],
            columns=_ARCHIVE_COLUMNS,
        )
    if batch.decisions:
        await _insert_many(conn, insert(_decisions), batch.decisions)
    if batch.dead_letters:
        await _insert_many(conn, insert(_dead), batch.dead_letters)
    for table_name, keys in batch.state.deletes.items():
        tbl = _TABLES[table_name]
        proj = _PROJECTION_OF[table_name]
        if len(tbl.primary_key.columns) == 1:
            pk = next(iter(tbl.primary_key.columns))
            await conn.execute(delete(tbl).where(pk.in_(keys)))
            continue
        for key in keys:  # a composite key: rare deletes (a model or pool stops scaling)
            cols = proj.primary_key(key)
            await conn.execute(delete(tbl).where(and_(*(tbl.c[n] == v for n, v in cols.items()))))
    for table_name, rows in batch.state.upserts.items():
        await _insert_many(conn, _upsert(_TABLES[table_name]), rows)
    if batch.state.bands is not None:
        await conn.execute(delete(r.BANDS_TABLE))
        if batch.state.bands:
            await conn.execute(insert(r.BANDS_TABLE), batch.state.bands)
