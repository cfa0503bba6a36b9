"""The autoscale controller measures on a monotonic clock; a wall-clock step moves nothing.

An NTP step (or `date -s`, or a VM resumed) moves the wall clock by any amount at
once. Measured on it, a step back held a scale-up for as long as the step (the
condition "had held" a negative time) and a step forward restarted every
condition's timing (the last summary looked an hour old). The controller is
driven tick by tick with two clocks the test moves: the monotonic one a second
per tick, the wall one the same plus a step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest

from llmgw import contracts as c
from llmgw.reconciler.controllers.autoscale import rule as autoscale
from llmgw.reconciler.controllers.autoscale.controller import AutoscaleController
from llmgw.reconciler.controllers.manager import ActorConfig
from llmgw.reconciler.controllers.runtime import Context
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.changes import ChangeSet
from llmgw.reconciler.state.model import ClusterState

SPEC = c.AutoscaleSpec(
    min=1, max=6, target=0.8, scale_up_after_seconds=10, scale_down_after_seconds=30
)
SLOTS = 8


class Clocks:
    def __init__(self):
        self.mono = 50.0
        self.step = 0.0

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return 1_800_000_000.0 + self.mono + self.step


class Msg:
    """A summary as the leader's NATS subscription hands it over."""

    def __init__(self, summary: c.DemandSummary):
        self.subject = "llmgw.demand.r1"
        self.data = c.encode(summary)


@dataclass
class FoldingContext(Context):
    """A leader's context whose published events fold at once, as the actor's do."""

    fired: list[c.ModelScaled] = field(default_factory=list)

    async def publish(self, ev: c.Message) -> int:
        assert isinstance(ev, c.ModelScaled)
        self.fired.append(ev)
        seq = self.state.last_seq + 1
        fold.apply(self.state, seq, ev)
        return seq


class Leader:
    """The controller over a folded state, on the two clocks the test moves."""

    def __init__(self, clocks: Clocks, state: ClusterState | None = None):
        self.clocks = clocks
        self.state = state or ClusterState()
        if state is None:
            fold.apply(self.state, 1, c.ModelDeclared(name="m", replicas=1, autoscale=SPEC))
        ctx = FoldingContext(
            nc=None,
            js=None,
            term=1,
            gate=None,
            clock=clocks.wall,
            monotonic=clocks.monotonic,
            state=self.state,
        )
        self.fired = ctx.fired
        self.ctl = AutoscaleController(ctx, ActorConfig())

    async def run(self, seconds: int, in_flight: int) -> None:
        """A second per tick: a router's summary arrives, then the controller evaluates."""
        for _ in range(seconds):
            self.clocks.mono += 1
            ready = self.state.desired_replicas("m")
            demand = c.ModelDemand(in_flight=in_flight, capacity=ready * SLOTS, ready=ready)
            summary = c.DemandSummary(router_id="r1", models={"m": demand})
            await self.ctl.demand.on_summary(Msg(summary))  # stamped by the leader's clock
            await self.ctl.reconcile(self.state, ChangeSet())


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
async def test_a_wall_clock_step_neither_holds_nor_restarts_a_scale_up(step):
    clocks = Clocks()
    leader = Leader(clocks)
    await leader.run(5, in_flight=16)  # load 2.0 over target 0.8, held 4 s
    clocks.step = step
    await leader.run(5, in_flight=16)  # held 9 s
    assert not leader.fired
    await leader.run(1, in_flight=16)  # held 10 s: it fires, as without the step
    (ev,) = leader.fired
    assert (ev.rule, ev.to_replicas, ev.sustained_seconds) == ("scale_up", 3, 10)
    assert abs(ev.ts - clocks.wall()) < 1e-6  # stamped with the wall time, step included


@pytest.mark.parametrize("step", [3600.0, -3600.0], ids=["forward", "back"])
async def test_a_wall_clock_step_does_not_shorten_or_stretch_the_cool_down(step):
    # A change made by an earlier leader 10 s ago (by the wall clock at takeover): this
    # controller places it on its monotonic clock once; the step afterwards moves nothing.
    clocks = Clocks()
    state = ClusterState()
    fold.apply(state, 1, c.ModelDeclared(name="m", replicas=1, autoscale=SPEC))
    earlier = c.ModelScaled(
        id="scaled-1",
        ts=clocks.wall() - 10,
        model="m",
        from_replicas=1,
        to_replicas=4,
        rule="scale_up",
    )
    fold.apply(state, 2, earlier)
    before = copy.deepcopy(state)
    leader = Leader(clocks, state)
    await leader.run(1, in_flight=0)  # first sight of the earlier change
    clocks.step = step
    # Idle: the scale-down condition must hold 30 s, and the cool-down ends 30 s after
    # the change (20 s from now): both end within the next 30 s, not sooner, not later.
    await leader.run(29, in_flight=0)
    assert not leader.fired
    await leader.run(1, in_flight=0)
    (ev,) = leader.fired
    assert (ev.rule, ev.from_replicas, ev.to_replicas) == ("scale_down", 4, 1)
    assert ev.since_last_change_seconds == pytest.approx(41)
    assert autoscale.check(before, ev) == []  # replay agrees, wall step or not


def test_the_leader_hands_its_autoscaler_both_of_its_clocks():
    clocks = Clocks()
    ctx = Context(
        nc=None, js=None, term=1, gate=None, clock=clocks.wall, monotonic=clocks.monotonic
    )
    autoscaler = AutoscaleController(ctx, ActorConfig())
    assert autoscaler.clock == clocks.wall
    assert autoscaler.monotonic == clocks.monotonic


async def test_a_summary_naming_another_router_than_its_subject_is_dropped():
    # The bus lets router r1 publish only on llmgw.demand.r1: a summary there that
    # claims to be r2 must not add r2's demand to the autoscaler's sums.
    leader = Leader(Clocks())
    demand = c.ModelDemand(in_flight=1000, capacity=SLOTS, ready=1)
    forged = c.DemandSummary(router_id="r2", models={"m": demand})
    await leader.ctl.demand.on_summary(Msg(forged))
    assert leader.ctl.demand.latest == {}
    honest = c.DemandSummary(router_id="r1", models={"m": demand})
    await leader.ctl.demand.on_summary(Msg(honest))
    assert list(leader.ctl.demand.latest) == [("r1", 0)]
