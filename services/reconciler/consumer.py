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

# Fetches that keep failing (not empty fetches) for this long end the loop. Long
# enough to ride out a JetStream cluster electing a new stream leader (5-10 s).
FETCH_ERROR_GRACE = 20.0

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
    """Run until cancelled, or until fetching has failed for FETCH_ERROR_GRACE seconds."""
    loop = asyncio.get_running_loop()
    failing_since: float | None = None

    def fetch() -> asyncio.Task:
        return asyncio.create_task(psub.fetch(batch_size, timeout=fetch_wait), name="fold-fetch")

    pending = fetch()
    try:
        while True:
            try:
                msgs = await pending
            except TimeoutError:  # nothing new (nats' TimeoutError subclasses the builtin)
                failing_since = None
                pending = fetch()
                if on_idle is not None:
                    on_idle()
                continue
            except Exception as exc:
                if failing_since is None:
                    failing_since = loop.time()
                elif loop.time() - failing_since > FETCH_ERROR_GRACE:
                    raise
                log.warning("fetch from the event log failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                pending = fetch()
                continue
            failing_since = None
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
