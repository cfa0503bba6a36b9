"""Fencing: leader terms, and a fold that refuses what an old or confused leader writes.

Events are fed to the reconciler's Folder as the wire carries them (JSON), over
real Postgres; the router side is its pure KV feed.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.intake.batch import Entry, Folder
from llmgw.reconciler.store import store
from llmgw.reconciler.store.tables import DeadLetter
from llmgw.router.controlplane.feeds import EndpointFeed
from llmgw.router.controlplane.watch import Entry as KvEntry
from llmgw.router.endpoints.view import EndpointView

GPUS = {
    f"G{i}": {"uuid": f"G{i}", "index": i, "name": "H200", "memory_bytes": 1 << 30}
    for i in range(2)
}


def raw(tag: str, ident: str, **fields) -> bytes:
    return json.dumps({"type": tag, "v": 1, "id": ident, "ts": 1.0, **fields}).encode()


def decided(replica: str, gpu: str, *, term: int, ident: str = "") -> bytes:
    return raw(
        "control.placement.decided",
        ident or f"decided-{replica}-{term}-{gpu}",
        model="m",
        replica_id=replica,
        based_on_seq=2,
        term=term,
        assignments=[{"shard_id": f"{replica}-s0", "shard_index": 0, "node": "a", "gpus": [gpu]}],
    )


def term_started(term: int) -> bytes:
    return raw("control.term.started", f"term-{term}", term=term, leader=f"r{term}")


def catalog() -> list[tuple[str, bytes]]:
    return [
        (s.agent_event("a", "registered"), raw("node.registered", "reg-a", node="a", gpus=GPUS)),
        (s.catalog_event("model", "m"), raw("catalog.model.declared", "decl-m", name="m")),
    ]


async def fold(engine, events: list[tuple[str, bytes]]) -> list[str]:
    """Fold the events from seq 1; the dead-letter reasons, in seq order."""
    folder = Folder(engine, await store.load_state(engine))
    await folder.fold_batch([Entry(i + 1, subj, data) for i, (subj, data) in enumerate(events)])
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(DeadLetter.seq, DeadLetter.reason).order_by(DeadLetter.seq)
        )
        return [f"{seq}: {reason}" for seq, reason in rows]


async def test_each_lock_holder_takes_a_newer_term(engine):
    terms = [await store.next_term(engine, holder) for holder in ("ra", "rb", "ra")]
    assert terms == [1, 2, 3]


async def test_a_deposed_leaders_late_decision_is_dead_lettered(engine):
    events = catalog() + [
        (s.control_event("term", "1"), term_started(1)),
        (s.control_event("placement", "m-r1"), decided("m-r1", "G0", term=1)),
        (s.control_event("term", "2"), term_started(2)),  # a new leader took over
        # The old leader, cut off, still publishes a decision of its own.
        (s.control_event("placement", "m-r2"), decided("m-r2", "G1", term=1)),
    ]
    dead = await fold(engine, events)
    assert len(dead) == 1 and dead[0].startswith("6: refused: from leader term 1")
    state = await store.load_state(engine)
    assert set(state.replicas) == {"m-r1"}
    assert state.term == 2  # committed with the position: the next term starts fenced


async def test_a_decision_that_books_a_held_gpu_or_a_placed_replica_is_dead_lettered(engine):
    events = catalog() + [
        (s.control_event("placement", "m-r1"), decided("m-r1", "G0", term=1)),
        # Two leaders' plans for the same gap: the second books G0 again...
        (s.control_event("placement", "m-r2"), decided("m-r2", "G0", term=1)),
        # ...or places a replica id that is already placed, on another GPU.
        (s.control_event("placement", "m-r1"), decided("m-r1", "G1", term=1, ident="other")),
    ]
    dead = await fold(engine, events)
    assert [d.split(": ", 2)[2][:40] for d in dead] == [
        "shard m-r2-s0: GPU G0 on a is held by sh",
        "replica m-r1 is already placed",
    ]
    state = await store.load_state(engine)
    assert set(state.replicas) == {"m-r1"}
    assert state.shards["m-r1-s0"].gpus == ["G0"]


def endpoints(term: int, seq: int, url: str) -> KvEntry:
    rec = c.ModelEndpoints(
        model="m", endpoints=[c.Endpoint(id="e", url=url)], based_on_seq=seq, term=term
    )
    return KvEntry("m", c.encode(rec), 0.0)


@pytest.mark.parametrize(
    ("late", "kept"),
    [((1, 90), "http://new"), ((2, 40), "http://new"), ((2, 60), "http://newer")],
)
def test_routers_skip_a_record_of_an_older_term_or_position(late, kept):
    feed = EndpointFeed(EndpointView())
    feed.snapshot({"m": endpoints(2, 50, "http://new")})
    term, seq = late
    feed.put(endpoints(term, seq, "http://newer" if (term, seq) > (2, 50) else "http://old"))
    assert [e.url for e in feed.records["m"].endpoints] == [kept]
