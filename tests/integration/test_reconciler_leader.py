"""Leader election on a Postgres advisory lock: one holder; a dead connection hands it over."""

from __future__ import annotations

import asyncio

import asyncpg

from llmgw.reconciler import leader
from llmgw.reconciler.store import schema


async def test_one_leader_at_a_time_and_a_lost_connection_stops_the_leader_at_once(
    database_url,
):
    dsn = schema.asyncpg_dsn(database_url)
    stop = asyncio.Event()
    first = await leader.acquire(dsn, stop, retry_interval=0.1, check_interval=0.2)
    assert first is not None
    second = asyncio.create_task(leader.acquire(dsn, stop, retry_interval=0.1, check_interval=0.2))
    try:
        done, _ = await asyncio.wait({second}, timeout=0.6)
        assert not done, "a second process got the lock while the first held it"
        # The first leader's database session dies (server restart, network cut, kill).
        admin = await asyncpg.connect(dsn)
        try:
            pid = first.conn.get_server_pid()
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        await asyncio.wait_for(first.lost.wait(), timeout=5)
        taken = await asyncio.wait_for(second, timeout=5)
        assert taken is not None and not taken.lost.is_set()
        await taken.release()
    finally:
        stop.set()
        await first.release()
        if not second.done():
            second.cancel()


async def test_a_waiting_standby_returns_none_when_stopped(database_url):
    dsn = schema.asyncpg_dsn(database_url)
    holder = await leader.acquire(dsn, asyncio.Event())
    stop = asyncio.Event()
    waiting = asyncio.create_task(leader.acquire(dsn, stop, retry_interval=0.1))
    await asyncio.sleep(0.3)
    stop.set()
    assert await asyncio.wait_for(waiting, timeout=3) is None
    await holder.release()
