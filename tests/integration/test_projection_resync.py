"""The routers' KV projection heals: a late foreign write or a deleted key is rewritten by
the leader's periodic resync, and a deposed leader's write never replaces a newer one."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import bus, projection
from llmgw import contracts as c
from llmgw.reconciler.state.model import ClusterState
from tests.integration.test_control_loop import FAST, Cluster, ready_urls, wait_kv

RESYNC = msgspec.structs.replace(FAST, projection_resync_interval=0.5)


@pytest.fixture
async def cluster(nats):
    async with (await Cluster.provisioned(nats, RESYNC)).running() as cl:
        yield cl


async def test_a_late_foreign_write_and_a_deleted_key_are_repaired(cluster):
    js = cluster.js
    await cluster.add("node-a")
    await cluster.leader.until("a node", lambda st: len(st.nodes) == 1)
    await bus.publish(js, c.ModelDeclared(name="m", profile=c.ServingProfile(engine="sim")))
    good = await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "one ready endpoint")
    kv = await js.key_value(projection.ENDPOINTS_BUCKET)

    # An old leader's put lands late: it points routers at an engine long gone.
    stale = msgspec.structs.replace(
        good, endpoints=[c.Endpoint(id="m-r0-s0", url="http://gone:1")], id=c.new_id()
    )
    await kv.put(projection.model_key("m"), c.encode(stale))
    await wait_kv(js, "m", lambda r: r and ready_urls(r) == ready_urls(good), "the repair")

    # The key vanishes (a bucket recreated empty, an operator's mistake).
    await kv.delete(projection.model_key("m"))
    await wait_kv(js, "m", lambda r: r and ready_urls(r) == ready_urls(good), "the rewrite")


async def test_a_deposed_leader_never_overwrites_a_newer_leaders_record(nats):
    from llmgw.reconciler.controllers.projection.records import model_record
    from llmgw.reconciler.controllers.projection.writer import KvProjection, Superseded

    js = nats.jetstream()
    await bus.provision(js)
    state = ClusterState(last_seq=10, term=1)
    state.models["m"] = c.ModelDeclared(name="m", aliases=["old"])
    deposed = KvProjection(js, term=1)
    await deposed.load()
    await deposed.sync_all(state)

    newer = ClusterState(last_seq=20, term=2)
    newer.models["m"] = c.ModelDeclared(name="m", aliases=["new"])
    leader = KvProjection(js, term=2)
    await leader.load()
    await leader.sync_all(newer)

    # The deposed leader, still folding its own view, writes the key again.
    state.models["m"] = c.ModelDeclared(name="m", aliases=["older still"])
    with pytest.raises(Superseded):
        await deposed.sync_all(state)
    kv = await js.key_value(projection.ENDPOINTS_BUCKET)
    held = c.decode((await kv.get(projection.model_key("m"))).value)
    assert held.aliases == ["new"] and held.term == model_record(newer, "m").term == 2
