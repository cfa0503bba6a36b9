"""A recreated event stream must not be folded from the old position.

If NATS loses its storage, the stream is created again (any service provisions
it) and its sequences restart at 1. A database that folded up to seq 3 of the
old stream would read the new one from seq 4 on: the new stream's first three
events (re-registrations, say) skipped without a word, the rest folded onto a
state from another history. The position records the stream's identity (its
creation time); a leader that finds another one refuses to fold and says what
an operator must do.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from llmgw import bus
from llmgw import subjects as s
from llmgw.reconciler.store import store, streamid
from llmgw.reconciler.store import tables as t

from . import inproc
from .test_reconciler_store import registered


async def folded_nodes(engine) -> set[str]:
    async with engine.connect() as conn:
        return set((await conn.execute(select(t.Node.node))).scalars())


async def position(engine) -> int:
    async with engine.connect() as conn:
        return await store.read_position(conn) or 0


async def test_a_recreated_stream_is_refused_with_what_to_do(nats, database_url, engine):
    js = nats.jetstream()
    await bus.provision(js)
    cfg = inproc.config(nats.connected_url.geturl(), database_url, id="rec-1")
    for i in range(3):
        await bus.publish(js, registered(f"old-{i}"))
    async with inproc.running(cfg):
        await inproc.until("the old stream folded", lambda: _folded(engine, OLD))
    before = await position(engine)

    # NATS loses its storage: the stream is created again, the fleet re-registers.
    await js.delete_stream(s.EVENTS_STREAM)
    await bus.provision(js)
    for i in range(6):
        await bus.publish(js, registered(f"new-{i}"))

    async with inproc.running(cfg) as rec:
        status = await inproc.until(
            "the leader to refuse the new stream (or fold it)",
            lambda: _refused_or_moved(rec, before),
        )
        assert await position(engine) == before  # nothing of the new stream was folded ...
        assert await folded_nodes(engine) == OLD  # ... nor skipped
        assert "created again" in status["problem"]
        assert "llmgw migrate --downgrade base" in status["problem"]  # what to do
        assert status["role"] == "standby"


async def test_a_stream_recreated_under_a_running_leader_is_refused_too(nats, database_url, engine):
    js = nats.jetstream()
    await bus.provision(js)
    cfg = inproc.config(nats.connected_url.geturl(), database_url, id="rec-1")
    for i in range(3):
        await bus.publish(js, registered(f"old-{i}"))
    async with inproc.running(cfg) as rec:
        await inproc.until("the old stream folded", lambda: _folded(engine, OLD))
        before = await position(engine)
        await js.delete_stream(s.EVENTS_STREAM)
        await bus.provision(js)
        for i in range(6):
            await bus.publish(js, registered(f"new-{i}"))
        # The leader's consumer went with the old stream: its fetches fail until the
        # fold gives up (consumer.FETCH_ERROR_GRACE) and the next term checks the stream.
        status = await inproc.until(
            "the leader to refuse the new stream (or fold it)",
            lambda: _refused_or_moved(rec, before),
            deadline=90,
        )
        assert await position(engine) == before
        assert await folded_nodes(engine) == OLD
        assert "created again" in status["problem"]


async def test_the_same_stream_is_folded_on_across_terms_and_restarts(nats, database_url, engine):
    js = nats.jetstream()
    await bus.provision(js)
    cfg = inproc.config(nats.connected_url.geturl(), database_url, id="rec-1")
    await bus.publish(js, registered("a"))
    async with inproc.running(cfg):
        await inproc.until("a folded", lambda: _folded(engine, {"a"}))
    await bus.provision(js)  # an update of the stream's config keeps its identity
    await bus.publish(js, registered("b"))
    async with inproc.running(cfg) as rec:
        await inproc.until("b folded", lambda: _folded(engine, {"a", "b"}))
        assert (await inproc.api_get(rec, "/api/status"))["problem"] == ""
    async with engine.connect() as conn:
        stored = (await conn.execute(select(t.ConsumerPosition.stream_created))).scalar_one()
    assert stored == streamid.identity(await js.stream_info(s.EVENTS_STREAM)) != ""


OLD = {"old-0", "old-1", "old-2"}


async def _folded(engine, nodes: set[str]) -> bool:
    return await folded_nodes(engine) == nodes


async def _refused_or_moved(rec, before: int):
    status = await inproc.api_get(rec, "/api/status")
    if status.get("problem") or status.get("folded_seq", 0) > before:
        return status
    return None


@pytest.mark.parametrize(
    ("stored", "current", "position", "last", "record"),
    [
        ("", "T1", 0, 0, True),  # nothing folded: record
        ("T0", "T1", 0, 5, True),  # nothing folded: any stream is ours
        ("T1", "T1", 7, 9, False),  # the same stream
        ("", "T1", 7, 9, True),  # folded before identities were recorded: record now
        ("T0", "T1", 7, 9, None),  # another stream
        ("T1", "T1", 7, 5, None),  # ends before the position: not the one folded
    ],
)
def test_judge(stored, current, position, last, record):
    if record is None:
        with pytest.raises(streamid.StreamMismatch):
            streamid.judge(stored=stored, current=current, position=position, stream_last_seq=last)
    else:
        assert (
            streamid.judge(stored=stored, current=current, position=position, stream_last_seq=last)
            is record
        )
