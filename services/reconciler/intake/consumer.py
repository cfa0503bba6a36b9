"""The leader's loop over the log: fetch a batch, fold and commit it, acknowledge, report.

While one batch is folded and committed, the next fetch is already in flight:
NATS round trips and Postgres commits overlap instead of adding up. Order is
kept: batches are folded one after another, each acknowledged (AckPolicy.ALL:
its last message covers it) only after its transaction committed.

Order is also checked. A fetch whose messages never arrive (its response lost
while a JetStream cluster elects a new consumer leader) leaves them delivered
but unacknowledged: the next fetch brings later ones, and folding those would
skip the lost ones for good (the fold ignores sequences at or below its
position, and AckPolicy.ALL would acknowledge them too). So a batch that does
not continue where the fold stands is not folded: the durable consumer is
recreated at the fold's position + 1 and the missing events come first.

Only a fresh consumer's very first delivery may jump ahead (the events in
between expired or were deleted: the folder records the hole as a dead
letter). "Very first" is told by the delivery's consumer sequence, which a new
consumer starts at 1 and never skips: a batch with consumer sequence 4 on a
fresh consumer means deliveries 1..3 were lost in transit, the same fault as
above, so it is read again rather than trusted to start the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from llmgw.reconciler.intake.batch import BatchResult, Entry, Folder

log = logging.getLogger(__name__)

# Fetches that keep failing (not empty fetches) for this long end the loop. Long
# enough to ride out a JetStream cluster electing a new stream leader (5-10 s).
FETCH_ERROR_GRACE = 20.0

OnBatch = Callable[[BatchResult, int], Awaitable[None]]  # (result, messages still pending)
OnIdle = Callable[[], None]
Resubscribe = Callable[[int], Awaitable[object]]  # start seq -> a fresh pull subscription


def first_gap(seqs: list[int], folded: int, fresh: bool) -> int | None:
    """The sequence missing before the batch's new events, if any; None when they
    continue the fold at `folded` (or, when `fresh`: a new consumer's first delivery,
    consumer sequence 1, start anywhere after it) and follow one another.
    Redeliveries (at or below `folded`) are not new."""
    new = [seq for seq in seqs if seq > folded]
    if not new:
        return None
    expect = new[0] if fresh else folded + 1
    for seq in new:
        if seq != expect:
            return expect
        expect += 1
    return None


async def consume(
    psub,
    folder: Folder,
    *,
    batch_size: int,
    fetch_wait: float,
    on_batch: OnBatch,
    on_idle: OnIdle | None = None,
    resubscribe: Resubscribe,
) -> None:
    """Run until cancelled, or until fetching has failed for FETCH_ERROR_GRACE seconds.

    `psub` must be a consumer created fresh at the fold's position + 1; the caller
    owns it. Consumers made by `resubscribe` (after a gap) are owned here."""
    loop = asyncio.get_running_loop()
    failing_since: float | None = None
    fresh = True  # the next batch is a new consumer's first
    original = psub

    async def release(fetching: asyncio.Task, sub) -> None:
        """End the fetch in flight, and unsubscribe `sub` if it is ours to."""
        fetching.cancel()
        with contextlib.suppress(BaseException):
            await fetching
        if sub is not original:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

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
            # A fresh consumer's first delivery may start past the position only if it
            # really is its first: consumer sequence 1 (an earlier one was lost otherwise).
            first_delivery = fresh and msgs[0].metadata.sequence.consumer == 1
            missing = first_gap([e.seq for e in entries], folder.state.last_seq, first_delivery)
            if missing is not None:
                log.warning(
                    "the event log skipped seq %d (a fetch lost in transit?): reading again "
                    "from %d",
                    missing,
                    folder.state.last_seq + 1,
                )
                await release(pending, psub)
                psub = await resubscribe(folder.state.last_seq + 1)
                fresh = True
                pending = fetch()
                continue
            fresh = False
            result = await folder.fold_batch(entries)
            await msgs[-1].ack()
            await on_batch(result, msgs[-1].metadata.num_pending)
    finally:
        await release(pending, psub)
