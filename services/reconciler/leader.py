"""Leader election: a Postgres session advisory lock held on a dedicated connection.

Why this lock: the reconciler already depends on Postgres, the lock is released
by the server the moment the holding session ends (process killed, connection
dropped), and it needs no clock agreement between processes. The holder checks
its connection every `check_interval`; if a check fails or the connection is
reported closed, `Lease.lost` is set and the leader stops acting at once. The
position compare-and-set in store.py fences any write that races a takeover.

"Released the moment the session ends" needs the server to notice the end. A
killed process closes its socket, but a network path that freezes (a
partition, a stuck proxy or NAT entry) closes nothing: with default settings
the server keeps the session, and the lock, until TCP keepalive gives up, two
hours on. So the lock's session is opened with `session_timeout` of silence as
the limit, enforced by the server: `idle_session_timeout` (the leader queries
every `check_interval`, so an idle session means the leader cannot reach it),
`tcp_user_timeout` (unacknowledged data) and keepalives (a dead peer). The
leader steps down sooner than that: a check unanswered within
`check_interval` sets `Lease.lost`. Keep `session_timeout` several
`check_interval`s long (config.validate insists on 3): the old leader then
has stopped acting before the server frees the lock for a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg

log = logging.getLogger(__name__)

# Any constant; every reconciler of one database must use the same.
DEFAULT_LOCK_ID = 0x6C6C6D67_72656331
DEFAULT_SESSION_TIMEOUT = 10.0


def session_settings(holder: str, session_timeout: float) -> dict[str, str]:
    """Server settings of the lock's session: its name, and how soon the server ends it
    once the holder falls silent (see the module docstring)."""
    ms = str(max(1000, int(session_timeout * 1000)))
    probe = max(1, int(session_timeout / 5))
    return {
        "application_name": f"llmgw-leader:{holder}",
        "idle_session_timeout": ms,
        "tcp_user_timeout": ms,
        "tcp_keepalives_idle": str(probe),
        "tcp_keepalives_interval": str(probe),
        "tcp_keepalives_count": "3",
    }


class Lease:
    """Held leadership. `lost` is set when the lock's connection fails."""

    def __init__(self, conn: asyncpg.Connection, lock_id: int, check_interval: float):
        self.conn = conn
        self.lock_id = lock_id
        self.check_interval = check_interval
        self.lost = asyncio.Event()
        self._watch: asyncio.Task | None = None
        conn.add_termination_listener(lambda _conn: self.lost.set())

    def start_watching(self) -> None:
        self._watch = asyncio.create_task(self._watch_loop(), name="leader-lease-watch")

    async def _watch_loop(self) -> None:
        while not self.lost.is_set():
            try:
                await asyncio.wait_for(self.conn.fetchval("SELECT 1"), timeout=self.check_interval)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:
                log.error("leader lock connection failed (%s): stepping down", exc)
                self.lost.set()
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.lost.wait(), timeout=self.check_interval)

    async def release(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        # Closing the session releases the lock; an explicit unlock first lets a
        # standby take over without waiting for the server to notice the close.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.conn.execute("SELECT pg_advisory_unlock($1)", self.lock_id), timeout=2
            )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close(), timeout=2)
        if not self.conn.is_closed():
            self.conn.terminate()


async def acquire(
    dsn: str,
    stop: asyncio.Event,
    *,
    lock_id: int = DEFAULT_LOCK_ID,
    retry_interval: float = 1.0,
    check_interval: float = 1.0,
    holder: str = "",
    session_timeout: float = DEFAULT_SESSION_TIMEOUT,
) -> Lease | None:
    """Wait until this process holds the lock (a Lease), or until `stop` is set (None).

    `holder` names the session in pg_stat_activity (application_name), so an
    operator can see which process leads: `llmgw-leader:<holder>`.
    """
    conn: asyncpg.Connection | None = None
    warned = False
    while not stop.is_set():
        try:
            if conn is None or conn.is_closed():
                conn = await asyncpg.connect(
                    dsn, timeout=5, server_settings=session_settings(holder, session_timeout)
                )
            got = await asyncio.wait_for(
                conn.fetchval("SELECT pg_try_advisory_lock($1)", lock_id), timeout=5
            )
            warned = False
            if got:
                lease = Lease(conn, lock_id, check_interval)
                lease.start_watching()
                return lease
        except (asyncio.CancelledError, KeyboardInterrupt):
            if conn is not None:
                conn.terminate()
            raise
        except Exception as exc:
            if not warned:
                log.warning("cannot try the leader lock (%s); retrying", exc)
                warned = True
            if conn is not None:
                conn.terminate()
                conn = None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=retry_interval)
    if conn is not None:
        with contextlib.suppress(Exception):
            await conn.close(timeout=2)
    return None
