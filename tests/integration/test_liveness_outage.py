"""A NATS outage longer than `lost_after` loses no node.

Every heartbeat stops at once when the bus goes away, including the ones the
leader would hear; judged by silence alone, the whole fleet would be lost and
every replica moved the moment the bus returned. The leader instead judges no
silence while its own connection is down and counts it from the reconnect.
"""

from __future__ import annotations

import asyncio

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev.servers import NatsServer

from .test_control_loop import FAST, Cluster


async def test_a_bus_outage_longer_than_lost_after_loses_no_node(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    try:
        await outage_story(server)
    finally:
        server.stop()


async def outage_story(server: NatsServer) -> None:
    nc = await bus.connect(server.url, name="outage-test")
    cl = Cluster(nc, nc.jetstream())
    try:
        await bus.provision(cl.js)
        await cl.leader.start()
        await cl.add("n1")
        await cl.add("n2")
        await cl.leader.until("both nodes registered", lambda st: len(st.nodes) == 2)
        await asyncio.sleep(FAST.unreachable_after)  # heartbeats flowing, nothing judged yet

        server.stop()
        await asyncio.sleep(2 * FAST.lost_after)  # silence twice as long as lost_after
        server.start()
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 20
        while not nc.is_connected:
            assert loop.time() < stop_at, "client never reconnected"
            await asyncio.sleep(0.05)
        # Give a wrong verdict every chance to be published: past unreachable_after
        # after the reconnect, with the nodes heartbeating again.
        await asyncio.sleep(FAST.unreachable_after + 1.0)

        info = await cl.js.stream_info(s.EVENTS_STREAM)
        events = [
            c.decode(m.data)
            async for m in bus.read_range(cl.js, s.EVENTS_ALL, 1, info.state.last_seq)
        ]
        judged = [type(e).__name__ for e in events if isinstance(e, c.NodeUnreachable | c.NodeLost)]
        assert judged == []
        assert sum(isinstance(e, c.NodeRegistered) for e in events) == 2
    finally:
        await cl.leader.stop()
        for a in cl.agents:
            await a.stop()
        await bus.close_quietly(nc)
