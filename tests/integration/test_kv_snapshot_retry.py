"""A router whose snapshot request goes unanswered asks again on its own timer, on real
NATS: an idle engine (no further events) still ends up indexed, and what arrived while
it waited is replayed on top of the snapshot."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.engines import ENGINES
from llmgw.router.kvcache.feed import KvEventFeed
from llmgw.router.kvcache.index import BlockIndex

from ..unit.test_router_kvfeed import view_with

WAIT = 30.0


async def wait_for(predicate, what: str) -> None:
    began = time.monotonic()
    while time.monotonic() - began < WAIT:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {WAIT}s")


def blocks_of(index: BlockIndex, ep_id: str) -> set[int]:
    st = index.endpoints.get(ep_id)
    if st is None or not st.synced:
        return set()
    bit = 1 << st.slot
    return {h for h, m in index.blocks.items() if m & bit}


async def test_an_unanswered_snapshot_request_is_retried_without_further_events(nats, nats_url):
    agent = await bus.connect(nats_url, name="agent-n1")
    asked: list[c.KvSnapshotRequest] = []
    answer = asyncio.Event()

    async def on_request(msg) -> None:
        asked.append(c.decode(msg.data, c.KvSnapshotRequest))
        if answer.is_set():  # until then, the agent is too busy to answer
            snap = c.KvSnapshot(node="n1", shard_id="e1", epoch="ep", seq=4, block_size=4,
                                hashes=[1, 2])  # fmt: skip
            await msg.respond(c.encode(snap))

    await agent.subscribe(subjects.kv_snapshot("n1", "e1"), cb=on_request)
    await agent.flush()
    index = BlockIndex()
    feed = KvEventFeed(
        view_with("n1"), index, nats, request_timeout=2.0, retry_seconds=0.2, max_retry_seconds=1.0
    )
    try:
        await feed.start()  # the endpoint is in the projection: its snapshot is asked for
        await wait_for(lambda: asked, "a first snapshot request")
        # The engine's one batch after the snapshot the agent will send, then silence.
        after = c.KvEvents(node="n1", shard_id="e1", epoch="ep", seq_first=5, seq_last=5,
                           block_size=4, ops=[c.KvBlockOp(op=c.KvOp.STORED, hashes=[3])])  # fmt: skip
        await agent.publish(subjects.kv_events("n1", "e1"), c.encode(after))
        await agent.flush()
        await wait_for(lambda: index.endpoints["e1"].buffered, "the batch buffered")
        answer.set()
        await wait_for(lambda: index.has_events("e1"), "the idle engine indexed")
        assert blocks_of(index, "e1") == {1, 2, 3}
        assert len(asked) >= 2 and not feed._tasks
    finally:
        await feed.stop()
        await bus.close_quietly(agent)


async def test_stopping_the_feed_cancels_its_retries(nats, nats_url):
    index = BlockIndex()
    feed = KvEventFeed(view_with("n1"), index, nats, request_timeout=0.2, retry_seconds=0.2)
    await feed.start()  # nobody answers for n1
    await wait_for(lambda: "e1" in feed._failed_at, "a failed request")
    task = feed._tasks["e1"]  # still trying, on its timer
    await feed.stop()
    assert task.done() and not feed._tasks and not index.has_events("e1")


@pytest.mark.parametrize("engine", sorted(n for n, t in ENGINES.items() if t.kv_events))
async def test_an_idle_endpoint_of_every_relayed_engine_is_indexed_when_it_appears(
    nats, nats_url, engine
):
    # SGLang's events were relayed long before the feed asked its agent for a snapshot:
    # an idle SGLang engine stayed unindexed until its first event.
    agent = await bus.connect(nats_url, name="agent-n1")

    async def on_request(msg) -> None:
        snap = c.KvSnapshot(node="n1", shard_id="e1", epoch="ep", seq=0, block_size=16,
                            hashes=[7, 8])  # fmt: skip
        await msg.respond(c.encode(snap))

    await agent.subscribe(subjects.kv_snapshot("n1", "e1"), cb=on_request)
    await agent.flush()
    index = BlockIndex()
    feed = KvEventFeed(view_with("n1", engine=engine), index, nats, request_timeout=2.0)
    try:
        await feed.start()  # no event will come: the snapshot alone must index it
        await wait_for(lambda: index.has_events("e1"), f"the idle {engine} endpoint indexed")
        assert blocks_of(index, "e1") == {7, 8}
    finally:
        await feed.stop()
        await bus.close_quietly(agent)
