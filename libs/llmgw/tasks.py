"""Ending a task its owner started."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it has ended; its cancellation is not re-raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def cancel_until_done(
    tasks: list[asyncio.Task], *, timeout: float, every: float = 0.1
) -> set[asyncio.Task]:
    """Cancel `tasks` and wait until they have ended, cancelling again while one goes on;
    those still running after `timeout` are returned. Their results and exceptions stay
    on the tasks.

    Once is not always enough: a cancel that lands as a reply arrives can be swallowed
    (Python 3.11's wait_for, inside nats-py's requests, returns the reply instead), and
    a loop that awaited it carries on as if nothing happened."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + timeout
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < stop_at:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(
            pending, timeout=max(0.0, min(every, stop_at - loop.time()))
        )
    return pending
