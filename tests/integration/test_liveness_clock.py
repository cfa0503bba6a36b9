"""A wall-clock step must not decide liveness, and a stored heartbeat must not prove life.

An NTP step (or a VM resumed, or `date -s`) moves the wall clock by any amount
at once. Measured on it, a step forward larger than lost_after declared every
node lost in one tick, and a step back kept a dead node "alive" for as long as
the step. Silence is measured on a monotonic clock now; the wall clock only
stamps events. The same for the newest stored heartbeat a new leader reads: it
was stamped by the NATS server's clock, and a server clock ahead of ours made
a dead node "recover" at a leader change.

Command re-issue, replacement back-off and the fold wait are timers too: a
step back used to hold every unanswered command's re-issue for the length of
the step.

Real NATS, the real actor; the wall clock is the actor's injected `clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.controllers.manager import Manager
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState, Liveness

from .test_control_loop import FAST, Leader, SimAgent

# FAST's timings with more room: "the live node never went unreachable" must not hinge
# on a loaded box delivering every heartbeat within a second.
ROOMY = msgspec.structs.replace(FAST, unreachable_after=2.0, lost_after=3.0)


class SteppableClock:
    """The wall clock as the actor reads it, which a test can step."""

    def __init__(self, offset: float = 0.0):
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
async def test_a_wall_clock_step_neither_loses_the_fleet_nor_keeps_a_dead_node(nats, step):
    js = nats.jetstream()
    await bus.provision(js)
    wall = SteppableClock()
    leader = Leader(nats, js, Manager(ROOMY, clock=wall))
    agents = [SimAgent(js, nats, "live"), SimAgent(js, nats, "dies")]
    await leader.start()
    try:
        for agent in agents:
            await agent.start()
        await leader.until("two nodes", lambda st: len(st.nodes) == 2)
        wall.offset = step
        await asyncio.sleep(3 * ROOMY.liveness_tick)  # a few ticks on the stepped clock
        agents[1].kill()
        await leader.until("the silent node lost", lambda st: _lost(st, "dies"))
        # Only the silent node moved; the one heartbeating all along never did.
        assert [ev.node for ev in leader.of(c.NodeUnreachable)] == ["dies"]
        assert [ev.node for ev in leader.of(c.NodeLost)] == ["dies"]
        assert leader.state.nodes["live"].liveness == Liveness.ALIVE
        # Events carry the wall time they were decided at, step included.
        lost = leader.of(c.NodeLost)[0]
        assert abs(lost.ts - wall()) < 60
    finally:
        await leader.stop()
        for agent in agents:
            await agent.stop()


async def test_a_stored_heartbeat_from_a_clock_ahead_does_not_recover_a_lost_node(nats):
    js = nats.jetstream()
    await bus.provision(js)
    # Both nodes were lost under the previous leader. "a-dead" is gone, but its last
    # heartbeat is still stored; "b-back" heartbeats live again.
    for node in ("a-dead", "b-back"):
        await bus.publish(js, c.NodeRegistered(node=node))
        await js.publish(s.heartbeat(node), c.encode(c.Heartbeat(node=node, seq=1)))
        await bus.publish(js, c.NodeLost(node=node, last_seen=time.time(), based_on_seq=1))
    state = await _fold_all(js)
    assert {n: v.liveness for n, v in state.nodes.items()} == {
        "a-dead": Liveness.LOST,
        "b-back": Liveness.LOST,
    }

    published: list[c.Message] = []

    async def on_event(msg) -> None:
        published.append(c.decode(msg.data))

    watch = await nats.subscribe(s.EVENTS_ALL, cb=on_event)
    # The new leader's wall clock is a minute behind the NATS server's: the stored
    # heartbeat looks a minute younger than now.
    actor = Manager(ROOMY, clock=SteppableClock(-60.0))
    back = SimAgent(js, nats, "b-back")
    await actor.start(nats, js, state)
    try:
        back._tasks.append(asyncio.create_task(back._heartbeat()))  # heartbeats only
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 15
        while not any(isinstance(ev, c.NodeRecovered) and ev.node == "b-back" for ev in published):
            assert loop.time() < stop_at, "timed out waiting for b-back to recover"
            await asyncio.sleep(0.05)
        # Both are judged in the same tick, a-dead first: its recovery would be here.
        assert [ev.node for ev in published if isinstance(ev, c.NodeRecovered)] == ["b-back"]
        assert "a-dead" in actor.liveness.last_wall  # remembered, for reports
    finally:
        await actor.stop()
        await back.stop()
        with contextlib.suppress(Exception):
            await watch.unsubscribe()


async def test_a_lost_command_is_reissued_after_the_wall_clock_steps_back(nats):
    js = nats.jetstream()
    await bus.provision(js)
    wall = SteppableClock()
    leader = Leader(nats, js, Manager(ROOMY, clock=wall))
    agent = SimAgent(js, nats, "node", drop_first_start=True)  # the first StartShard is lost
    await leader.start()
    try:
        await agent.start()
        await leader.until("the node", lambda st: "node" in st.nodes)
        await bus.publish(js, c.ModelDeclared(name="m", profile=c.ServingProfile()))
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + 15
        while not agent.received:
            assert loop.time() < stop_at, "timed out waiting for the first StartShard"
            await asyncio.sleep(0.02)
        wall.offset = -3600.0  # before its re-issue is due
        await leader.until("m ready", lambda st: _ready(st, "m"))
        starts = [cmd for cmd in agent.received if isinstance(cmd, c.StartShard)]
        assert len(starts) >= 2 and starts[0].key == starts[1].key  # the same command again
    finally:
        await leader.stop()
        await agent.stop()


def _ready(state: ClusterState, model: str) -> bool:
    return any(sh.model == model and sh.state == c.ShardState.READY for sh in state.shards.values())


async def _fold_all(js) -> ClusterState:
    state = ClusterState()
    info = await js.stream_info(s.EVENTS_STREAM)
    async for msg in bus.read_range(js, s.EVENTS_ALL, 1, info.state.last_seq):
        fold.apply(state, msg.metadata.sequence.stream, c.decode(msg.data))
    return state


def _lost(state: ClusterState, node: str) -> bool:
    return state.nodes[node].liveness == Liveness.LOST
