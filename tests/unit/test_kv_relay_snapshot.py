"""The relay's snapshot: consistent with the batches around it, and truncated to whole
prefixes when the set does not fit in one message."""

from __future__ import annotations

import asyncio

from llmgw import contracts as c
from llmgw import kvblocks, kvwire
from llmgw.agent.kvrelay import EngineRelay

BS = 4


def stored_frames(seq: int, chain: list[bytes], tokens: list[int], parent=None) -> list[bytes]:
    ev = kvwire.BlockStored(
        block_hashes=chain,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    return kvwire.frames("kv", seq, kvwire.encode_batch(0.0, [ev]))


def relay(publish) -> EngineRelay:
    # A long flush delay: the test decides when batches go out. No engine binds its
    # endpoint: the test hands it the batches.
    return EngineRelay("n1", "s1", publish=publish, endpoint="inproc://none", flush_seconds=3600)


async def test_no_published_batch_straddles_a_snapshot():
    published: list[c.KvEvents] = []
    r = None

    async def publish(subject: str, data: bytes) -> None:
        published.append(c.decode(data, c.KvEvents))
        if len(published) == 1:
            # The engine's next batch arrives while the pending one is on its way.
            r.receive(stored_frames(1, [b"b1"], [5, 6, 7, 8], parent=b"b0"))
        await asyncio.sleep(0)

    r = relay(publish)
    try:
        r.receive(stored_frames(0, [b"b0"], [1, 2, 3, 4]))
        snap = await r.snapshot(1 << 20)
        r.receive(stored_frames(2, [b"b2"], [9, 10, 11, 12], parent=b"b1"))
        await r.flush()
        assert len(published) == 2
        for batch in published:
            # Either wholly in the snapshot or wholly after it: a router that applies the
            # snapshot then this batch sees no gap and no overlap, so it never refetches.
            assert batch.seq_last <= snap.seq or batch.seq_first > snap.seq, (batch, snap.seq)
        assert len(snap.hashes) == snap.seq + 1  # one block per batch up to its seq
    finally:
        await r.close()


async def test_a_truncated_snapshot_keeps_whole_prefixes_from_their_roots():
    async def publish(subject: str, data: bytes) -> None:
        pass

    r = relay(publish)
    try:
        first = list(range(1, 41))  # a 10-block chain
        second = list(range(100, 140))  # another, stored later
        r.receive(stored_frames(0, [b"a%d" % i for i in range(10)], first))
        r.receive(stored_frames(1, [b"b%d" % i for i in range(10)], second))
        snap = await r.snapshot(2048 + 5 * 20)  # room for 5 hashes
        assert snap.truncated and len(snap.hashes) == 5
        # The first prompt's leading 5 blocks are all there: it still matches 5 blocks.
        assert snap.hashes == kvblocks.prompt_hashes(first, BS, 5)
    finally:
        await r.close()
