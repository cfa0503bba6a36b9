"""A fetch lost in transit must not lose events.

During a JetStream election a pull request's response can vanish after the
server delivered its messages: they sit unacknowledged until ack_wait while the
next fetch brings later ones. Folded as they come, the later ones would move the
fold's position past the lost ones (which it then ignores as redeliveries) and
AckPolicy.ALL would acknowledge them: gone from the projection and the archive.
The consumer loop notices the gap and reads again from the fold's position.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.js import api as jsapi

from llmgw import bus
from llmgw import subjects as s
from llmgw.reconciler import consumer, store
from llmgw.reconciler import tables as t
from llmgw.reconciler.folder import Folder

from .test_reconciler_store import count, registered


class LosesOneFetch:
    """A real pull subscription whose second fetch reaches the server (the messages
    are delivered to us) but whose response never arrives."""

    def __init__(self, psub):
        self.psub, self.calls, self.lost = psub, 0, []

    async def fetch(self, batch: int, timeout: float):
        self.calls += 1
        msgs = await self.psub.fetch(batch, timeout=timeout)
        if self.calls == 2:
            self.lost = [m.metadata.sequence.stream for m in msgs]
            raise TimeoutError  # what the client sees when the response is lost
        return msgs

    async def unsubscribe(self):
        await self.psub.unsubscribe()


async def test_a_lost_fetch_is_read_again_before_later_events(js, engine):
    await bus.provision(js)
    for i in range(10):
        await bus.publish(js, registered(f"n{i}"))
    resubscribed: list[int] = []

    async def subscribe(start_seq: int):
        resubscribed.append(start_seq)
        return await bus.ensure_pull_consumer(
            js, s.EVENTS_STREAM, "gap-fold", s.EVENTS_ALL,
            ack_policy=jsapi.AckPolicy.ALL, ack_wait=30.0,
            start_seq=start_seq, recreate=True,
        )  # fmt: skip

    first = LosesOneFetch(await subscribe(1))
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
    assert first.lost == [4, 5, 6]  # delivered by the server, never seen by the fold
    assert set(folder.state.nodes) == {f"n{i}" for i in range(10)}
    assert await count(engine, t.ArchivedEvent) == 10
    assert await count(engine, t.DeadLetter) == 0
    assert folder.state.last_seq == 10
    assert resubscribed == [1, 4]  # read again from the fold's position + 1


@pytest.mark.parametrize(
    ("seqs", "folded", "fresh", "gap"),
    [
        ([4, 5, 6], 3, False, None),  # continues the fold
        ([7, 8, 9], 3, False, 4),  # 4..6 went missing
        ([2, 3, 4, 5], 3, False, None),  # redeliveries first, then new ones in order
        ([4, 6], 3, False, 5),  # a hole inside the batch
        ([9, 10], 3, True, None),  # a fresh consumer's first delivery: 4..8 do not exist
        ([9, 11], 3, True, 10),
        ([1, 2, 3], 3, False, None),  # nothing new
    ],
)
def test_first_gap(seqs, folded, fresh, gap):
    assert consumer.first_gap(seqs, folded, fresh) == gap
