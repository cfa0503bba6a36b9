"""The leader's loop over the log: fetch a batch, fold and commit it, acknowledge, report.

While one batch is folded and committed, the next fetch is already in flight:
NATS round trips and Postgres commits overlap instead of adding up. Order is
kept: batches are folded one after another, each acknowledged (AckPolicy.ALL:
its last message covers it) only after its transaction committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from .folder import BatchResult, Entry, Folder

log = logging.getLogger(__name__)

# A fetch that fails this many times in a row (not an empty fetch) ends the loop.
MAX_FETCH_ERRORS = 5

OnBatch = Callable[[BatchResult, int], Awaitable[None]]  # (result, messages still pending)
OnIdle = Callable[[], None]


async def consume(
    psub,
    folder: Folder,
    *,
    batch_size: int,
    fetch_wait: float,
    on_batch: OnBatch,
    on_idle: OnIdle | None = None,
) -> None:
    """Run until cancelled, or until fetching fails MAX_FETCH_ERRORS times in a row."""
    errors = 0

    def fetch() -> asyncio.Task:
        return asyncio.create_task(psub.fetch(batch_size, timeout=fetch_wait), name="fold-fetch")

    pending = fetch()
    try:
        while True:
            try:
                msgs = await pending
            except TimeoutError:  # nothing new (nats' TimeoutError subclasses the builtin)
                errors = 0
                pending = fetch()
                if on_idle is not None:
                    on_idle()
                continue
            except Exception as exc:
                errors += 1
                if errors >= MAX_FETCH_ERRORS:
                    raise
                log.warning("fetch from the event log failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                pending = fetch()
                continue
            errors = 0
            pending = fetch()  # the next batch travels while this one commits
            if not msgs:
                continue
            entries = [Entry(m.metadata.sequence.stream, m.subject, m.data) for m in msgs]
            result = await folder.fold_batch(entries)
            await msgs[-1].ack()
            await on_batch(result, msgs[-1].metadata.num_pending)
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
