"""A pull subscription that loses one fetch's response in transit, and a fold run on it.

The server delivers the fetch's messages (they wait unacknowledged until ack_wait) but
the client never sees them, as during a JetStream election. Shared by the fold tests
that guard against losing those events.
"""

from __future__ import annotations

import asyncio

from nats.js import api as jsapi

from llmgw import bus
from llmgw import subjects as s
from llmgw.reconciler.intake import consumer
from llmgw.reconciler.intake.batch import Folder
from llmgw.reconciler.store import store

from .test_reconciler_store import registered


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


async def fold_ten_losing_fetch(
    js, engine, durable: str, lose: int
) -> tuple[LosesFetch, Folder, list[int]]:
    """Ten registrations folded in batches of 3 through a consumer whose fetch number
    `lose` is lost: (the lossy subscription, the folder, every start seq subscribed at)."""
    await bus.provision(js)
    for i in range(10):
        await bus.publish(js, registered(f"n{i}"))
    resubscribed: list[int] = []

    async def subscribe(start_seq: int):
        resubscribed.append(start_seq)
        return await bus.ensure_pull_consumer(
            js, s.EVENTS_STREAM, durable, s.EVENTS_ALL,
            ack_policy=jsapi.AckPolicy.ALL, ack_wait=30.0,
            start_seq=start_seq, recreate=True,
        )  # fmt: skip

    first = LosesFetch(await subscribe(1), lose=lose)
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
    return first, folder, resubscribed
