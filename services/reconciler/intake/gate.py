"""A gate that is open while the shared state equals what Postgres has committed.

The fold changes the state in memory and then commits; between the two, the
state holds events that may yet be rolled back (a refused value, a lost
connection). Controllers read the state only after `wait_open()`, and compute
their decisions without awaiting anything in between, so what they read is
one committed snapshot. Single event loop: no lock is needed beyond this.
"""

from __future__ import annotations

import asyncio


class CommitGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()
