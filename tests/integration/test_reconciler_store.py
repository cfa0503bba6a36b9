"""The fold into Postgres on real NATS: exactly once, dead letters, fencing, replay equivalence.

The consumer here is the reconciler's own (Folder + a durable pull consumer
with AckPolicy.ALL); the service loop around it is exercised with real
processes in tests/e2e/test_reconciler_failover.py.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from nats.js import api as jsapi
from sqlalchemy import func, select, text

from llmgw import bus, procs
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.audit import rebuild, verify
from llmgw.reconciler.intake.batch import Entry, Folder
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState
from llmgw.reconciler.store import store
from llmgw.reconciler.store import tables as t

S = c.ShardState


def gpu(i: int) -> c.GpuInfo:
    return c.GpuInfo(uuid=f"GPU-{i}", index=i, name="H200", memory_bytes=141 << 30)


def registered(node: str) -> c.NodeRegistered:
    return c.NodeRegistered(node=node, gpus={f"GPU-{i}": gpu(i) for i in range(2)})


def status(state: S, shard: str = "m-r1-s0", node: str = "a") -> c.ShardStatus:
    return c.ShardStatus(
        node=node, shard_id=shard, model="m", replica_id="m-r1", state=state, url="http://e:1"
    )


async def consumer(js, name: str = "test-fold", ack_wait: float = 30.0):
    return await bus.ensure_pull_consumer(
        js, s.EVENTS_STREAM, name, s.EVENTS_ALL,
        ack_policy=jsapi.AckPolicy.ALL, ack_wait=ack_wait,
    )  # fmt: skip


def entries(msgs) -> list[Entry]:
    return [Entry(m.metadata.sequence.stream, m.subject, m.data) for m in msgs]


async def count(engine, table) -> int:
    async with engine.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(table))).scalar_one()


async def test_redelivery_after_a_crash_between_commit_and_ack_changes_nothing(js, engine):
    await bus.provision(js)
    for node in ("a", "b", "c"):
        await bus.publish(js, registered(node))
    await bus.publish(js, c.ModelDeclared(name="m"))
    psub = await consumer(js, ack_wait=1.0)
    msgs = await psub.fetch(10, timeout=2)
    assert len(msgs) == 4
    first = Folder(engine, await store.load_state(engine))
    result = await first.fold_batch(entries(msgs))
    assert result.folded == 4 and result.last_seq == 4
    # "Crash": committed, never acknowledged. A restarted reconciler loads the state
    # from Postgres; the broker redelivers the same messages once ack_wait expires.
    restarted = Folder(engine, await store.load_state(engine))
    assert restarted.state.last_seq == 4 and set(restarted.state.nodes) == {"a", "b", "c"}
    again = await psub.fetch(10, timeout=5)
    assert [m.metadata.sequence.stream for m in again] == [1, 2, 3, 4]
    assert all(m.metadata.num_delivered == 2 for m in again)
    result = await restarted.fold_batch(entries(again))
    await again[-1].ack_sync()
    assert (result.folded, result.skipped, result.dead) == (0, 4, 0)
    assert await count(engine, t.ArchivedEvent) == 4
    async with engine.connect() as conn:
        assert await store.read_position(conn) == 4
    # Acknowledged now (AckPolicy.ALL: the last covers all): nothing left to redeliver.
    info = await js.consumer_info(s.EVENTS_STREAM, "test-fold")
    assert (info.num_ack_pending, info.num_pending) == (0, 0)


async def test_duplicated_publishes_are_folded_once(js, engine):
    await bus.provision(js)
    ready = status(S.READY)
    await bus.publish(js, registered("a"))
    await bus.publish(js, ready)
    await bus.publish(js, ready)  # a retried publish inside the duplicate window
    assert (await js.stream_info(s.EVENTS_STREAM)).state.last_seq == 2
    await bus.publish(js, status(S.STOPPED))
    # The same event again after the window (a different Nats-Msg-Id reaches the log):
    # folding it would resurrect a stopped shard as ready.
    await js.publish(s.subject_for(ready), c.encode(ready), headers={"Nats-Msg-Id": "late"})
    psub = await consumer(js)
    folder = Folder(engine, await store.load_state(engine))
    result = await folder.fold_batch(entries(await psub.fetch(10, timeout=2)))
    assert (result.folded, result.dead, result.last_seq) == (3, 1, 4)
    assert folder.state.shards["m-r1-s0"].state == S.STOPPED
    async with engine.connect() as conn:
        dead = (await conn.execute(select(t.DeadLetter.seq, t.DeadLetter.reason))).all()
        shard_state = (await conn.execute(select(t.Shard.state))).scalar_one()
    assert dead == [(4, f"duplicate: event id {ready.id} was folded at seq 2")]
    assert shard_state == "stopped"


async def test_bad_events_are_dead_lettered_while_good_ones_keep_folding(js, engine):
    await bus.provision(js)
    bad = {
        "garbage": (s.agent_event("a", "registered"), b"{not json"),
        "future": (
            s.catalog_event("model", "x"),
            c.encode(c.ModelDeclared(name="x", v=c.SCHEMA_VERSION + 1)),
        ),
        "heartbeat": (s.agent_event("a", "hb"), c.encode(c.Heartbeat(node="a"))),
        "impostor": (s.agent_event("a", "registered"), c.encode(registered("b"))),
    }
    good = iter([registered("a"), c.ModelDeclared(name="m"), status(S.READY)])
    # Interleaved: good, bad, good, bad, good, bad, bad.
    for subject, raw in bad.values():
        if (ev := next(good, None)) is not None:
            await bus.publish(js, ev)
        await js.publish(subject, raw)
    psub = await consumer(js)
    folder = Folder(engine, await store.load_state(engine))
    msgs = await psub.fetch(20, timeout=2)
    result = await folder.fold_batch(entries(msgs))
    assert (result.folded, result.dead, result.last_seq) == (3, 4, 7)
    assert set(folder.state.nodes) == {"a"} and set(folder.state.models) == {"m"}
    assert folder.state.shards["m-r1-s0"].state == S.READY
    async with engine.connect() as conn:
        q = select(t.DeadLetter.__table__).order_by(t.DeadLetter.seq)
        dead = {r.seq: (r.subject, r.raw, r.reason) for r in (await conn.execute(q)).all()}
        assert await store.read_position(conn) == 7
    reasons = [reason for _, _, reason in dead.values()]
    assert reasons[0].startswith("malformed: JSON is malformed")
    assert reasons[1] == "malformed: schema version 2 is newer than supported (1)"
    assert reasons[2] == "not an event: node.heartbeat does not belong in the event log"
    assert reasons[3] == "subject llmgw.evt.agent.a.registered does not belong to node 'b'"
    assert [raw for _, raw, _ in dead.values()] == [raw for _, raw in bad.values()]
    # The fold goes on after them.
    await bus.publish(js, c.TenantDeclared(name="t", band="hi"))
    result = await folder.fold_batch(entries(await psub.fetch(20, timeout=2)))
    assert result.folded == 1 and "t" in folder.state.tenants


async def test_an_event_the_fold_crashes_on_is_dead_lettered_and_the_state_reloaded(
    js, engine, monkeypatch
):
    await bus.provision(js)
    real = fold._HANDLERS[c.TenantDeclared]

    def half_then_crash(state, seq, ev):
        if ev.name == "poison":
            state.tenants[ev.name] = ev  # a half-applied change the reload must discard
            raise KeyError("bug")
        return real(state, seq, ev)

    monkeypatch.setitem(fold._HANDLERS, c.TenantDeclared, half_then_crash)
    for name in ("t1", "poison", "t2"):
        await bus.publish(js, c.TenantDeclared(name=name, band="hi"))
    psub = await consumer(js)
    folder = Folder(engine, await store.load_state(engine))
    live = folder.state
    result = await folder.fold_batch(entries(await psub.fetch(10, timeout=2)))
    assert (result.folded, result.dead, result.last_seq) == (2, 1, 3)
    assert folder.state is live  # reloaded in place: the actor's reference stays valid
    assert set(live.tenants) == {"t1", "t2"}
    async with engine.connect() as conn:
        (reason,) = (await conn.execute(select(t.DeadLetter.reason))).scalars()
        names = set((await conn.execute(select(t.Tenant.name))).scalars())
    assert reason == "fold failed: KeyError: 'bug'" and names == {"t1", "t2"}


async def test_a_second_writer_from_the_same_position_is_fenced(js, engine):
    await bus.provision(js)
    await bus.publish(js, registered("a"))
    msgs = entries(await (await consumer(js)).fetch(1, timeout=2))
    one = Folder(engine, await store.load_state(engine))
    two = Folder(engine, await store.load_state(engine))
    await one.fold_batch(msgs)
    await bus.publish(js, registered("b"))
    later = entries(await (await consumer(js, "other")).fetch(2, timeout=2))
    with pytest.raises(store.Fenced):
        await two.fold_batch(later)
    assert await count(engine, t.ArchivedEvent) == 1


async def test_replaying_the_archive_reproduces_the_projection(js, engine, database_url):
    await bus.provision(js)
    evs: list[c.Message] = [
        c.BandsDeclared(bands=[c.Band(name="hi", ceiling=2.0)]),
        c.ModelDeclared(name="m", replicas=2),
        c.TenantDeclared(name="t", band="hi"),
        registered("a"),
        registered("b"),
        c.PlacementDecided(
            model="m", replica_id="m-r1", based_on_seq=5,
            assignments=[c.ShardAssignment(shard_id="m-r1-s0", shard_index=0, node="a", gpus=["GPU-0"])],
            verdicts=[c.NodeVerdict(node="a", fits=True, reason="ok"),
                      c.NodeVerdict(node="b", fits=False, reason="label fabric=ib missing")],
        ),
        c.PlacementFailed(model="m", replica_id="m-r2", based_on_seq=6, explanation="no room",
                          verdict_groups=[c.VerdictGroup(fits=False, kind="no free GPU", count=2,
                                                         nodes=["a", "b"], reason="0 free GPUs",
                                                         same=True, digest="d")]),
        status(S.READY),
        c.NodeLost(node="a", last_seen=1.0),
        c.ModelRemoved(name="m"),
        c.TenantRemoved(name="t"),
    ]  # fmt: skip
    for ev in evs:
        await bus.publish(js, ev)
    await js.publish(s.agent_event("a", "x"), b"junk")
    psub = await consumer(js)
    folder = Folder(engine, await store.load_state(engine))
    for size in (3, 4, 100):  # several transactions
        await folder.fold_batch(entries(await psub.fetch(size, timeout=2)))
    assert folder.state.last_seq == len(evs) + 1
    report = await verify.verify(engine)
    assert report.differences == [] and report.events == len(evs)
    # The live state equals a fresh fold of the same events.
    fresh = ClusterState()
    for seq, ev in enumerate(evs, 1):
        fold.apply(fresh, seq, ev)
    loaded = await store.load_state(engine)
    fresh.last_seq = loaded.last_seq
    assert loaded.copy() == fresh.copy()

    # A projection that drifted from the log is reported, and the CLI exits 1.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE shards SET state = 'ready' WHERE shard_id = 'm-r1-s0'"))
        await conn.execute(text("DELETE FROM placement_decisions WHERE outcome = 'failed'"))
    res = await asyncio.to_thread(
        subprocess.run,
        procs.llmgw_argv("audit", "verify", "--database-url", database_url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "shards m-r1-s0: state: table 'ready' != replay 'failed'" in res.stdout
    assert "placement_decisions 7: missing from the table (replay has it)" in res.stdout
    assert "FAIL: 2 difference(s)" in res.stdout
    # Rebuilding the projection from the archive repairs it.
    done = await rebuild.rebuild(engine)
    assert done.events == len(evs)
    assert (await verify.verify(engine)).differences == []
