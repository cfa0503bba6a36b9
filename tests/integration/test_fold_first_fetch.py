"""A fresh consumer's first fetch lost in transit must not lose events either.

A new consumer's first delivery may start past the fold's position (the events
in between expired or were deleted), so its first batch is not held to
position + 1. But if that first fetch's response is lost (the server delivered
seqs 1..3, the client never saw them), the second fetch brings 4..6: folded as
a "first delivery", they would move the position past 1..3 and AckPolicy.ALL
would acknowledge them, gone for good. The delivery's consumer sequence (1 on a
new consumer's first message, never skipping) tells the two apart.
"""

from __future__ import annotations

import asyncio

from nats.js import api as jsapi

from llmgw import bus
from llmgw import subjects as s
from llmgw.reconciler import consumer, store
from llmgw.reconciler import tables as t
from llmgw.reconciler.folder import Folder

from .test_reconciler_store import count, registered


class LosesFetch:
    """A real pull subscription whose fetch number `lose` reaches the server (the
    messages are delivered to us) but whose response never arrives."""

    def __init__(self, psub, lose: int):
        self.psub, self.lose, self.calls, self.lost = psub, lose, 0, []

    async def fetch(self, batch: int, timeout: float):
        self.calls += 1
        msgs = await self.psub.fetch(batch, timeout=timeout)
        if self.calls == self.lose:
            self.lost = [m.metadata.sequence.stream for m in msgs]
            raise TimeoutError  # what the client sees when the response is lost
        return msgs

    async def unsubscribe(self):
        await self.psub.unsubscribe()


async def test_a_fresh_consumers_lost_first_fetch_is_read_again(js, engine):
    await bus.provision(js)
    for i in range(10):
        await bus.publish(js, registered(f"n{i}"))
    resubscribed: list[int] = []

    async def subscribe(start_seq: int):
        resubscribed.append(start_seq)
        return await bus.ensure_pull_consumer(
            js, s.EVENTS_STREAM, "first-fetch-fold", s.EVENTS_ALL,
            ack_policy=jsapi.AckPolicy.ALL, ack_wait=30.0,
            start_seq=start_seq, recreate=True,
        )  # fmt: skip

    first = LosesFetch(await subscribe(1), lose=1)
    folder = Folder(engine, await store.load_state(engine))
    done = asyncio.Event()

    async def on_batch(result, pending: int) -> None:
        if result.last_seq >= 10:
            done.set()

    loop = asyncio.create_task(
        consumer.consume(
            first,
            folder,
            batch_size=3,
            fetch_wait=0.5,
            on_batch=on_batch,
            resubscribe=subscribe,
        )  # fmt: skip
    )
    try:
        await asyncio.wait_for(done.wait(), timeout=20)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await first.unsubscribe()
    assert first.lost == [1, 2, 3]  # delivered by the server, never seen by the fold
    assert set(folder.state.nodes) == {f"n{i}" for i in range(10)}
    assert await count(engine, t.ArchivedEvent) == 10
    assert await count(engine, t.DeadLetter) == 0
    assert resubscribed == [1, 1]  # read again from the fold's position + 1
