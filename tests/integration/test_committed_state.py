"""The controllers act on committed, caught-up state only.

The fold changes the state in memory before its transaction commits; a
controller that decided in that window would act on events that may yet be
rolled back. And a new leader must not decide before its fold has read the log
as it stood when the term began (controller-runtime's WaitForCacheSync).
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import msgspec

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.controllers.manager import ActorConfig, Manager
from llmgw.reconciler.intake.batch import Entry, Folder
from llmgw.reconciler.store import schema, store

CFG = ActorConfig(resync_interval=0.1, liveness_tick=0.1, unreachable_after=60, lost_after=120)
# Long enough for many resync periods of the actor: what it would decide, it decides by then.
WINDOW = 2.0


def registered() -> Entry:
    gpu = c.GpuInfo(uuid="G0", index=0, name="H200", memory_bytes=1 << 30)
    ev = c.NodeRegistered(node="a", gpus={"G0": gpu}, engines=["sim"])
    return Entry(1, s.subject_for(ev), c.encode(ev))


def declared(seq: int, name: str = "m") -> Entry:
    ev = c.ModelDeclared(name=name, profile=c.ServingProfile(engine="sim"))
    return Entry(seq, s.subject_for(ev), c.encode(ev))


class Decisions:
    def __init__(self) -> None:
        self.seen: list[c.PlacementDecided] = []

    async def start(self, nc) -> Decisions:
        async def on_msg(msg) -> None:
            ev = c.decode(msg.data)
            if isinstance(ev, c.PlacementDecided):
                self.seen.append(ev)

        self.sub = await nc.subscribe("llmgw.evt.control.placement.>", cb=on_msg)
        return self

    async def wait(self, timeout: float = 15.0) -> c.PlacementDecided:
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + timeout
        while not self.seen:
            assert loop.time() < stop_at, "no placement decided"
            await asyncio.sleep(0.05)
        return self.seen[0]


async def test_no_decision_on_a_batch_whose_commit_has_not_happened(nats, engine, database_url):
    js = nats.jetstream()
    await bus.provision(js)
    decisions = await Decisions().start(nats)
    folder = Folder(engine, await store.load_state(engine))
    await folder.fold_batch([registered()])
    actor = Manager(CFG)
    await actor.start(nats, js, folder.state, gate=folder.gate)
    lock = await asyncpg.connect(schema.asyncpg_dsn(database_url))
    fold: asyncio.Task | None = None
    try:
        # The next commit waits on this lock: the batch is folded in memory, not committed.
        tx = lock.transaction()
        await tx.start()
        await lock.execute("SELECT * FROM consumer_positions FOR UPDATE")
        fold = asyncio.create_task(folder.fold_batch([declared(2)]))
        while "m" not in folder.state.models:
            await asyncio.sleep(0.01)
        await asyncio.sleep(WINDOW)
        assert decisions.seen == []  # nothing decided on what might still roll back
        await tx.rollback()
        result = await fold
        await actor.on_state_changed(folder.state, result.changes)
        decided = await decisions.wait()
        assert decided.model == "m" and decided.based_on_seq == 2
    finally:
        if fold is not None and not fold.done():
            fold.cancel()
        with contextlib.suppress(Exception):
            await lock.close()
        await actor.stop()


async def test_a_new_leader_decides_nothing_until_its_fold_reaches_the_term_start(nats, engine):
    js = nats.jetstream()
    await bus.provision(js)
    decisions = await Decisions().start(nats)
    folder = Folder(engine, await store.load_state(engine))
    await folder.fold_batch([registered(), declared(2)])
    # The log held more when the term began (seq 4): a removal the fold has not read yet.
    actor = Manager(CFG)
    await actor.start(nats, js, folder.state, gate=folder.gate, synced_seq=4)
    try:
        await asyncio.sleep(WINDOW)
        assert decisions.seen == []  # m may be gone already: do not place it
        removed = c.ModelRemoved(name="m")
        result = await folder.fold_batch(
            [declared(3, "n"), Entry(4, s.subject_for(removed), c.encode(removed))]
        )
        await actor.on_state_changed(folder.state, result.changes)
        decided = await decisions.wait()
        assert decided.model == "n"
        assert msgspec.structs.asdict(decided)["based_on_seq"] == 4
    finally:
        await actor.stop()
