"""The LoRA controller shell: one decision per change of demand, recorded with what it was
decided on, then the commands that carry it out, fenced with the term and boot id."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmgw import contracts as c
from llmgw.reconciler.controllers.lora import placement
from llmgw.reconciler.controllers.lora.controller import LoraController
from llmgw.reconciler.controllers.manager import ActorConfig
from llmgw.reconciler.controllers.replicas import plan as reconcile
from llmgw.reconciler.controllers.runtime import Context
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.changes import ChangeSet

from ._cluster import Log, model, node, status


class Msg:
    def __init__(self, summary: c.DemandSummary):
        self.subject = f"llmgw.demand.{summary.router_id}"
        self.data = c.encode(summary)


@dataclass
class RecordingContext(Context):
    """Published control events fold only when the test says so; commands are kept."""

    published: list[c.Message] = field(default_factory=list)

    async def publish(self, ev: c.Message) -> int:
        self.published.append(ev)
        return self.state.last_seq + len(self.published)


async def test_waiting_demand_is_placed_once_then_commanded_once_folded():
    log = Log().append(node("a", 1), model("m", replicas=1, max_loras=2))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", c.ShardState.READY))
    log.append(c.AdapterDeclared(name="sql", base="m", source="/l/sql"))
    clock = {"mono": 10.0}
    ctx = RecordingContext(
        nc=None, js=None, term=3, gate=None, clock=lambda: 5000.0,
        monotonic=lambda: clock["mono"], state=log.state,
    )  # fmt: skip
    ctl = LoraController(ctx, ActorConfig())
    demand = c.ModelDemand(adapters={"sql": c.AdapterDemand(requests=1, waiting=2)})
    await ctx.demand.on_summary(Msg(c.DemandSummary(router_id="r1", models={"m": demand})))

    await ctl.reconcile(log.state, ChangeSet())
    (placed,) = ctx.published
    assert isinstance(placed, c.AdaptersPlaced)
    assert placed.holdings == {"m-r1": ["sql"]} and placed.waiting == ["sql"]
    assert placed.queued == {"sql": 2} and placed.based_on_seq == log.state.last_seq
    assert placed.ts == 5000.0

    # Not folded yet: nothing decided again, nothing commanded.
    clock["mono"] += 1
    await ctl.reconcile(log.state, ChangeSet())
    assert len(ctx.published) == 1

    seq = log.state.last_seq + 1
    fold.apply(log.state, seq, placed)
    clock["mono"] += 1
    await ctl.reconcile(log.state, ChangeSet())
    (cmd,) = ctx.published[1:]
    assert isinstance(cmd, c.SetShardAdapters) and cmd.shard_id == "m-r1-s0"
    assert (cmd.term, cmd.boot_id) == (3, log.state.nodes["a"].boot_id)
    assert [a.name for a in cmd.adapters] == ["sql"]


async def test_a_summary_with_requests_waiting_for_an_unheld_adapter_wakes_it_at_once():
    log = Log().append(node("a", 1), model("m", replicas=1, max_loras=2))
    log.append(c.AdapterDeclared(name="sql", base="m", source="/l/sql"))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["sql"]}))
    ctx = RecordingContext(nc=None, js=None, term=1, gate=None, clock=lambda: 0.0, state=log.state)
    ctl = LoraController(ctx, ActorConfig())
    woken = []
    ctl.wake_now = lambda: woken.append(True)
    ctx.demand.listeners.append(ctl._heard)

    def asking(adapter: str, waiting: int) -> Msg:
        ad = c.AdapterDemand(requests=1, waiting=waiting)
        return Msg(
            c.DemandSummary(router_id="r1", models={"m": c.ModelDemand(adapters={adapter: ad})})
        )

    await ctx.demand.on_summary(asking("sql", 3))  # held already: its tick will do
    await ctx.demand.on_summary(asking("chat", 0))  # nothing waiting
    assert woken == []
    await ctx.demand.on_summary(asking("chat", 1))
    assert woken == [True]


async def test_a_queue_outwaited_by_busier_incumbents_takes_a_slot_once_it_has_waited_long():
    # bench_lora: a rare adapter's 2 waiting requests could not outweigh any incumbent
    # expecting 2 or more in the horizon, and waited until admission's 30 s limit.
    log = Log().append(node("a", 1), model("m", replicas=1, max_loras=1))
    log.append(*reconcile.decide(log.state).events)
    log.append(status(log.state, "m-r1-s0", c.ShardState.READY))
    for name in ("chat", "sql"):
        log.append(c.AdapterDeclared(name=name, base="m", source=f"/l/{name}"))
    log.append(c.AdaptersPlaced(model="m", holdings={"m-r1": ["chat"]}, ts=0.0))
    clock = {"mono": 0.0}
    ctx = RecordingContext(
        nc=None, js=None, term=1, gate=None, clock=lambda: 5000.0 + clock["mono"],
        monotonic=lambda: clock["mono"], state=log.state,
    )  # fmt: skip
    ctl = LoraController(ctx, ActorConfig())
    ctx.demand.listeners.append(ctl._heard)

    async def at(mono: float, chat_requests: int = 0, sql_waiting: int = 2) -> None:
        clock["mono"] = mono
        ads = {
            "chat": c.AdapterDemand(requests=chat_requests),
            "sql": c.AdapterDemand(waiting=sql_waiting),
        }
        summary = c.DemandSummary(router_id="r1", models={"m": c.ModelDemand(adapters=ads)})
        await ctx.demand.on_summary(Msg(summary))
        await ctl.reconcile(log.state, ChangeSet())

    await at(0.0, sql_waiting=0)
    await at(10.0, chat_requests=100)  # chat: about 2 requests/s, 12 in a 6 s horizon
    await at(16.0)  # sql has waited 6 s: chat expects more than 2 in the horizon
    await at(24.0)  # 14 s

    def decisions() -> list[c.AdaptersPlaced]:
        return [x for x in ctx.published if isinstance(x, c.AdaptersPlaced)]

    assert decisions() == []
    await at(25.5)  # 15.5 s: past max_wait, weighed over no horizon: chat expects none
    (placed,) = decisions()
    assert placed.holdings == {"m-r1": ["sql"]} and placed.waited == {"sql": 15.5}
    assert placed.policy == placement.POLICY
    # Replay re-derives it from what it recorded; without the wait, it would not.
    assert placement.check(log.state, placed) == []
    assert placement.check(log.state, msgspec.structs.replace(placed, waited={})) != []
