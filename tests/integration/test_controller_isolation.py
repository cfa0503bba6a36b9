"""Controllers fail alone: with the routers' KV bucket gone (every projection write fails),
placement and commands go on, and the projection is written again once the bucket is back."""

from __future__ import annotations

import pytest

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from tests.integration.test_control_loop import Cluster, ready_urls, wait_kv


@pytest.fixture
async def cluster(nats):
    async with (await Cluster.provisioned(nats)).running() as cl:
        yield cl


async def test_a_failing_kv_write_does_not_hold_placement_or_commands_back(cluster):
    js, leader = cluster.js, cluster.leader
    agent = await cluster.add("node-a", n_gpus=2)
    await leader.until("a node", lambda st: len(st.nodes) == 1)
    await bus.publish(js, c.ModelDeclared(name="m", profile=c.ServingProfile(engine="sim")))
    await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "m ready")

    await js.delete_key_value(s.ENDPOINTS_BUCKET)  # every endpoint write fails from now on
    await bus.publish(js, c.ModelDeclared(name="n", profile=c.ServingProfile(engine="sim")))
    await leader.until("n placed", lambda st: any(r.model == "n" for r in st.replicas.values()))
    await leader.until(
        "n's shard ready",
        lambda st: any(sh.model == "n" and sh.state == c.ShardState.READY
                       for sh in st.shards.values()),
    )  # fmt: skip
    assert any(isinstance(x, c.StartShard) and x.model == "n" for x in agent.received)

    await bus.provision(js)  # the bucket is back (empty): the projection fills it again
    await wait_kv(js, "n", lambda r: len(ready_urls(r)) == 1, "n in the projection")
    await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "m in the projection again")
