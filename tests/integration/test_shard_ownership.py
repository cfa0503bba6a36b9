"""One node's agent cannot claim another node's shard: the status is dead-lettered, and the
routers' projection keeps pointing at the node that runs it."""

from __future__ import annotations

import json

from sqlalchemy import select

from llmgw import subjects as s
from llmgw.reconciler.controllers.projection import records as projection_kv
from llmgw.reconciler.intake.batch import Entry, Folder
from llmgw.reconciler.store import store
from llmgw.reconciler.store.tables import DeadLetter

GPUS = {"G0": {"uuid": "G0", "index": 0, "name": "H200", "memory_bytes": 1 << 30}}


def raw(tag: str, ident: str, **fields) -> bytes:
    return json.dumps({"type": tag, "v": 1, "id": ident, "ts": 1.0, **fields}).encode()


def status(node: str, ident: str, url: str) -> tuple[str, bytes]:
    return (
        s.agent_event(node, "shard"),
        raw(
            "shard.status", ident, node=node, shard_id="m-r1-s0", model="m", replica_id="m-r1",
            state="ready", url=url, gpus=["G0"],
        ),
    )  # fmt: skip


async def test_a_status_from_another_node_for_a_shard_is_dead_lettered(engine):
    events = [
        (s.agent_event("a", "registered"), raw("node.registered", "ra", node="a", gpus=GPUS)),
        (s.agent_event("evil", "registered"), raw("node.registered", "re", node="evil")),
        (s.catalog_event("model", "m"), raw("catalog.model.declared", "dm", name="m")),
        (
            s.control_event("placement", "m-r1"),
            raw(
                "control.placement.decided",
                "pd",
                model="m",
                replica_id="m-r1",
                based_on_seq=3,
                assignments=[
                    {"shard_id": "m-r1-s0", "shard_index": 0, "node": "a", "gpus": ["G0"]}
                ],
            ),  # fmt: skip
        ),
        status("a", "s1", "http://a:9000"),
        # On its own subject (permissions allow it), about a shard of node a.
        status("evil", "s2", "http://evil:6666"),
    ]
    folder = Folder(engine, await store.load_state(engine))
    await folder.fold_batch([Entry(i + 1, subj, data) for i, (subj, data) in enumerate(events)])
    async with engine.connect() as conn:
        dead = (await conn.execute(select(DeadLetter.seq, DeadLetter.reason))).all()
    assert [(seq, reason.split(":")[0]) for seq, reason in dead] == [(6, "refused")]
    assert "belongs to node a" in dead[0][1]
    state = await store.load_state(engine)
    shard = state.shards["m-r1-s0"]
    assert (shard.node, shard.url) == ("a", "http://a:9000")
    record = projection_kv.model_record(state, "m")
    assert [(e.node, e.url) for e in record.endpoints] == [("a", "http://a:9000")]
