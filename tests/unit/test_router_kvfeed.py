"""The router's KV event feed believes a batch only from the node its endpoint runs on."""

from __future__ import annotations

import asyncio

from llmgw import contracts as c
from llmgw import projection, subjects
from llmgw.router.controlplane.feeds import EndpointFeed
from llmgw.router.controlplane.watch import Entry
from llmgw.router.endpoints.view import EndpointView
from llmgw.router.kvcache.feed import KvEventFeed
from llmgw.router.kvcache.index import BlockIndex


class SnapshotAsker:
    """Stands in for the NATS connection: records which snapshot subjects were asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def request(self, subject: str, data: bytes, timeout: float):
        self.asked.append(subject)
        raise TimeoutError("no relay in this test")


def view_with(endpoint_node: str, engine: str = "sim") -> EndpointView:
    view = EndpointView()
    rec = c.ModelEndpoints(
        model="m",
        endpoints=[c.Endpoint(id="e1", url="http://e1", node=endpoint_node, engine=engine)],
    )
    key = projection.model_key("m")
    EndpointFeed(view).snapshot({key: Entry(key=key, value=c.encode(rec), written_at=0.0)})
    return view


def batch(node: str, *hashes: int) -> bytes:
    return c.encode(
        c.KvEvents(
            node=node,
            shard_id="e1",
            epoch="ep",
            seq_first=0,
            seq_last=0,
            block_size=4,
            ops=[c.KvBlockOp(op=c.KvOp.STORED, hashes=list(hashes))],
        )
    )


async def test_a_batch_from_another_nodes_subject_or_naming_another_node_is_dropped():
    index = BlockIndex()
    nc = SnapshotAsker()
    feed = KvEventFeed(view_with("n1"), index, nc, request_timeout=0.1, retry_seconds=60)
    # Node n2's agent publishes on its own subject, claiming n1's engine.
    assert feed.handle(batch("n1", 11, 12), subjects.kv_events("n2", "e1")) == "foreign"
    # ... or names itself in the payload but publishes on n1's subject.
    assert feed.handle(batch("n2", 11, 12), subjects.kv_events("n1", "e1")) == "foreign"
    await asyncio.sleep(0)
    assert nc.asked == [] and "e1" not in index.endpoints
    # The endpoint's own node is believed, and its snapshot is asked of that node.
    assert feed.handle(batch("n1", 11, 12), subjects.kv_events("n1", "e1")) == "resync"
    for _ in range(1000):
        if nc.asked:
            break
        await asyncio.sleep(0.01)
    await feed.stop()
    assert nc.asked == [subjects.kv_snapshot("n1", "e1")]
