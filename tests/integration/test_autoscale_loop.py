"""The autoscaler inside the leader on real NATS: summaries in, ModelScaled out, replicas follow.

Routers are stood in for by a task that publishes DemandSummary messages on the
real subject, as a router's presence ticks do; the leader, its actor and the
simulated agents are the control-loop test's (test_control_loop.py). The node
has two GPUs, so a scale-up to four can only partly be met: placement says why,
the routers' record carries the reason, and the autoscaler does not ask again.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.audit import replay
from llmgw.reconciler.controllers.autoscale.controller import AutoscaleController
from llmgw.reconciler.state.queries import is_ready
from tests.integration.test_control_loop import FAST, Cluster, wait_kv

SPEC = c.AutoscaleSpec(
    min=1,
    max=4,
    target=0.5,
    scale_up_after_seconds=0.5,
    scale_down_after_seconds=2.0,
    tolerance=0.2,
)
SLOTS = 8  # the simulated agents report max_running=8


# The leader's autoscaler evaluating five times a second.
FAST_AUTOSCALE = msgspec.structs.replace(FAST, autoscale_tick=0.2)


@pytest.fixture
async def cluster(nats):
    async with (await Cluster.provisioned(nats, FAST_AUTOSCALE)).running() as cl:
        yield cl


class Routers:
    """Two routers' summaries, each seeing half of `in_flight`, five times a second."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.in_flight = 0
        self._task: asyncio.Task | None = None

    def ready(self) -> int:
        st = self.cluster.leader.state
        return sum(is_ready(st, r) for r in st.active_replicas("m"))

    async def _run(self) -> None:
        nc = self.cluster.nc
        await nc.publish(s.demand("r-bad"), b'{"type": "demand.summary", "models": 3}')
        while True:
            ready = self.ready()
            for i in range(2):
                demand = c.ModelDemand(
                    in_flight=self.in_flight // 2, capacity=ready * SLOTS, ready=ready
                )
                summary = c.DemandSummary(router_id=f"r{i}", models={"m": demand})
                await nc.publish(s.subject_for(summary), c.encode(summary))
            await asyncio.sleep(0.2)

    def __enter__(self) -> Routers:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()


async def evaluations(autoscaler: AutoscaleController, n: int, timeout: float = 60.0) -> None:
    """Until the autoscaler has made `n` more evaluations (not counting fold waits)."""
    target = autoscaler.ticks + n
    async with asyncio.timeout(timeout):
        while autoscaler.ticks < target:
            await asyncio.sleep(0.05)


async def test_scale_up_beyond_the_free_gpus_then_down_by_draining(cluster):
    leader, js = cluster.leader, cluster.js
    agent = await cluster.add("node-a", n_gpus=2)
    await leader.until("the node", lambda st: "node-a" in st.nodes)
    await bus.publish(js, c.ModelDeclared(name="m", profile=c.ServingProfile(), autoscale=SPEC))
    await leader.until(
        "m-r1 ready", lambda st: "m-r1" in st.replicas and is_ready(st, st.replicas["m-r1"])
    )

    with Routers(cluster) as routers:
        routers.in_flight = 16  # load 2.0 on one replica of 8 slots: four times the target
        await leader.until("a scale-up", lambda st: st.desired_replicas("m") == 4)
        (up,) = leader.of(c.ModelScaled)
        assert (up.rule, up.from_replicas, up.to_replicas) == ("scale_up", 1, 4)
        assert (up.signals.in_flight, up.signals.capacity, up.signals.routers) == (16, 8, 2)
        assert "load 2.00 over target 0.5" in up.explanation
        # What each router said is recorded with it (the malformed summary is not).
        assert [(i.router_id, i.demand.in_flight) for i in up.inputs] == [("r0", 8), ("r1", 8)]

        # One more replica fits on the second GPU; the third cannot be placed.
        await leader.until(
            "m-r2 ready", lambda st: "m-r2" in st.replicas and is_ready(st, st.replicas["m-r2"])
        )
        failed = await leader.until("a failure to place m-r3", lambda st: st.failures.get("m-r3"))
        assert "0 of 1 node fit" in failed.explanation
        assert [v.reason for v in failed.verdicts] == ["0 free GPUs of 2, needs 1"]
        rec = await wait_kv(js, "m", lambda r: r is not None and r.unplaceable, "the reason")
        assert rec.unplaceable == failed.explanation
        # Demand stays high, but with 2 of 4 replicas ready the autoscaler does not ask again:
        # ten evaluations (each on live summaries, each past scale_up_after) decide nothing.
        autoscaler = leader.actor.controller("autoscale")
        assert autoscaler.resync == FAST_AUTOSCALE.autoscale_tick  # the fast one
        await evaluations(autoscaler, 10)
        assert len(leader.of(c.ModelScaled)) == 1

        routers.in_flight = 2  # 2 of 16 slots: under the low mark of 0.4
        await leader.until("a scale-down", lambda st: st.desired_replicas("m") == 1)
        down = leader.of(c.ModelScaled)[-1]
        assert (down.rule, down.from_replicas, down.to_replicas) == ("scale_down", 4, 1)
        # The cool-down held, measured on the leader's monotonic clock.
        assert down.since_last_change_seconds is not None
        assert down.since_last_change_seconds >= SPEC.scale_down_after_seconds

    # The newest ready replica drains before it stops; the older one keeps serving.
    await leader.until("m-r2 retired", lambda st: st.replicas["m-r2"].retired)
    await leader.until(
        "m-r2 stopped", lambda st: st.shards["m-r2-s0"].state == c.ShardState.STOPPED
    )
    drains = [x.shard_id for x in agent.received if isinstance(x, c.DrainShard)]
    assert drains == ["m-r2-s0"]
    rec = await wait_kv(js, "m", lambda r: r is not None and not r.unplaceable, "no reason left")
    assert [e.replica_id for e in rec.endpoints if e.state == c.EndpointState.READY] == ["m-r1"]

    # Audit replay re-derives both decisions from what the log recorded, the combined
    # signals from the routers' recorded inputs included.
    result = replay.replay(leader.events)
    assert len(result.scaling) == 2 and result.differing() == []
