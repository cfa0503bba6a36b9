"""A node declared lost that comes back: its orphan engines are stopped, not left holding
GPUs; and a NodeLost decided before the node registered again never applies."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.intake.batch import Entry, Folder
from llmgw.reconciler.state.model import Liveness
from llmgw.reconciler.store import store
from tests.integration.test_control_loop import (
    Cluster,
    Leader,
    SimAgent,
    ready_urls,
    wait_kv,
)

S = c.ShardState


@pytest.fixture
async def cluster(nats):
    async with (await Cluster.provisioned(nats)).running() as cl:
        yield cl


class ReportingAgent(SimAgent):
    """A SimAgent whose heartbeats list the shards it runs, as a real agent's do."""

    async def _heartbeat(self) -> None:
        n = 0
        while not self._stopping:
            if self.alive:
                n += 1
                hb = c.Heartbeat(
                    node=self.name, seq=n, shards={sid: S.READY for sid in self.running}
                )
                with contextlib.suppress(Exception):
                    await self.js.publish(s.heartbeat(self.name), c.encode(hb), timeout=0.5)
            await asyncio.sleep(0.1)


async def until(what: str, pred, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + timeout
    while not pred():
        assert loop.time() < stop_at, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_lost_node_back_without_registering_has_its_orphan_engines_stopped(cluster):
    leader: Leader = cluster.leader
    js = cluster.js
    a = ReportingAgent(js, cluster.nc, "node-a")
    b = ReportingAgent(js, cluster.nc, "node-b")
    for agent in (a, b):
        cluster.agents.append(agent)
        await agent.start()
    await leader.until("two nodes", lambda st: len(st.nodes) == 2)
    await bus.publish(js, c.ModelDeclared(name="m", profile=c.ServingProfile(engine="sim")))
    await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "one ready endpoint")
    assert leader.state.replicas["m-r1"].assignments[0].node == "node-a"

    # node-a goes silent (a partition): lost, its replica replaced on node-b.
    a.kill()
    await leader.until("lost", lambda st: st.nodes["node-a"].liveness == Liveness.LOST)
    await wait_kv(
        js,
        "m",
        lambda r: r and [e.node for e in r.endpoints] == ["node-b"] and ready_urls(r),
        "the replacement on node-b",
    )
    assert "m-r1-s0" in a.running  # the engine never stopped: it was only cut off

    # The partition heals: heartbeats again, no registration (the agent never restarted).
    a.alive = True
    await leader.until("recovered", lambda st: st.nodes["node-a"].liveness == Liveness.ALIVE)
    await until("the orphan engine stopped", lambda: not a.running)
    stops = [x for x in a.received if isinstance(x, c.StopShard)]
    assert [x.shard_id for x in stops][:1] == ["m-r1-s0"]
    rec = await wait_kv(js, "m", lambda r: r and len(r.endpoints) == 1, "one endpoint")
    assert [e.node for e in rec.endpoints] == ["node-b"]


def raw(tag: str, **fields) -> bytes:
    """An event as the wire carries it."""
    return json.dumps({"type": tag, "v": 1, "id": f"{tag}-{fields}", "ts": 1.0, **fields}).encode()


async def test_a_node_lost_decided_before_the_node_registered_again_does_not_apply(engine):
    gpus = {"G0": {"uuid": "G0", "index": 0, "name": "H200", "memory_bytes": 1 << 30}}
    shard = {"shard_id": "m-r1-s0", "model": "m", "replica_id": "m-r1", "state": "ready",
             "gpus": ["G0"], "url": "http://a:1"}  # fmt: skip
    folder = Folder(engine, await store.load_state(engine))
    entries = [
        Entry(1, s.agent_event("a", "registered"), raw("node.registered", node="a", gpus=gpus)),
        # The leader saw silence as of seq 1 and decided the node lost...
        # ...but the node registered again (seq 2) before that decision reached the log.
        Entry(
            2,
            s.agent_event("a", "registered"),
            raw("node.registered", node="a", gpus=gpus, shards=[shard], boot_id="b2"),
        ),
        Entry(
            3,
            s.control_event("node", "a"),
            raw("control.node.lost", node="a", last_seen=0.5, based_on_seq=1),
        ),
    ]
    result = await folder.fold_batch(entries)
    assert result.dead == 1
    state = await store.load_state(engine)
    assert state.nodes["a"].liveness == Liveness.ALIVE
    assert state.shards["m-r1-s0"].state == S.READY
