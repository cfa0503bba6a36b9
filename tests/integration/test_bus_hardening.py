"""Hostile events on the real bus: the reconciler's fold dead-letters them with a reason and
goes on; what is too big never enters the log at all.

One reconciler (the real service, in process) folds LLMGW_EVENTS into a fresh database
while the test publishes, on the subjects an agent may use, forged events (a node claiming
another node's id in the payload), malformed ones (every way bytes can fail the contract),
absurd-but-decodable ones (values Postgres cannot store, megabyte payloads), and messages over
the streams' size limits. A good event published after each group must be folded: the fold
never stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import msgspec
import pytest
from nats.errors import MaxPayloadError
from nats.js.errors import BadRequestError

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev.servers import free_port
from llmgw.reconciler.config import FoldConfig, LeaderConfig, ReconcilerConfig
from llmgw.reconciler.service import Reconciler


def registered(node: str, **kw) -> c.NodeRegistered:
    gpu = c.GpuInfo(uuid=f"GPU-{node}", index=0, name="H200", memory_bytes=141 << 30)
    return c.NodeRegistered(node=node, gpus={gpu.uuid: gpu}, engines=["sim"], **kw)


def raw_event(node: str, **fields) -> bytes:
    """A NodeRegistered as JSON with fields replaced, typed or not."""
    body = msgspec.to_builtins(registered(node))
    body.update(fields)
    return msgspec.json.encode(body)


class Folding:
    """The reconciler's operator API, read as the test goes."""

    def __init__(self, base: str):
        self.http = httpx.AsyncClient(base_url=base, timeout=5)

    async def get(self, path: str):
        return (await self.http.get(path)).json()

    async def until_folded(self, seq: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if (await self.get("/api/status"))["folded_seq"] >= seq:
                    return
            assert time.monotonic() < deadline, f"the fold did not reach seq {seq}"
            await asyncio.sleep(0.1)

    async def dead_letters(self) -> dict[int, dict]:
        return {d["seq"]: d for d in await self.get("/api/dead-letters?limit=1000")}

    async def archived(self, seq: int) -> dict | None:
        rows = await self.get(f"/api/events?from_seq={seq}&to_seq={seq}")
        return rows[0] if rows else None


@pytest.fixture
async def reconciler(nats, nats_url, database_url):
    """A leading reconciler on a fresh database; yields its operator API client."""
    from llmgw.reconciler.store import schema

    engine = schema.make_engine(database_url)
    await schema.upgrade(engine)
    await engine.dispose()
    port = free_port()
    cfg = ReconcilerConfig(
        id="hardening",
        nats_url=nats_url,
        database_url=database_url,
        admin_listen=f"127.0.0.1:{port}",
        api_auth="none",  # loopback; these tests read the API, they are not about access
        fold=FoldConfig(batch_size=20, fetch_wait_seconds=0.1),
        leader=LeaderConfig(retry_interval_seconds=0.2, check_interval_seconds=0.5),
    )
    rec = Reconciler(cfg)
    task = asyncio.create_task(rec.run())
    api = Folding(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 20
        while True:
            assert not task.done(), f"reconciler exited: {task.result()}"
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if (await api.get("/readyz")).get("role") == "leader":
                    break
            assert time.monotonic() < deadline, "the reconciler did not lead"
            await asyncio.sleep(0.1)
        yield api
    finally:
        rec.stop.set()
        # The reconciler bounds its actor's stop at 15 s; the rest of its shutdown comes on top.
        await asyncio.wait_for(task, 45)
        await api.http.aclose()


async def publish_raw(js, subject: str, data: bytes) -> int:
    return (await js.publish(subject, data)).seq


async def test_forged_malformed_and_absurd_events_are_dead_lettered_and_the_fold_goes_on(
    nats, reconciler
):
    js = nats.jetstream()
    api = reconciler
    a_reg = s.agent_event("node-a", "registered")
    expect_dead: dict[int, str] = {}  # seq -> a phrase its reason must contain
    expect_folded: list[int] = []

    async def checkpoint(node: str) -> int:
        """A good event after a bad group: folded, so the fold went on past them."""
        seq = (await bus.publish(js, registered(node))).seq
        await api.until_folded(seq)
        archived = await api.archived(seq)
        assert archived is not None and archived["event"]["node"] == node
        return seq

    # -- forged: node-a's subject (all its certificate may publish on) claiming node-b.
    forged = registered("node-b")
    seq = (await bus.publish(js, forged, subject=a_reg)).seq
    expect_dead[seq] = "does not belong to node 'node-b'"
    status = c.ShardStatus(
        node="node-b", shard_id="x-r0-s0", model="x", replica_id="x-r0", state=c.ShardState.READY
    )
    seq = (await bus.publish(js, status, subject=s.agent_event("node-a", "shard"))).seq
    expect_dead[seq] = "does not belong to node 'node-b'"
    await checkpoint("node-a")

    # -- malformed: every way bytes can fail the contract.
    nested = b"[" * 50_000 + b"]" * 50_000
    malformed = {
        b"not json": "malformed",
        b"": "malformed",
        b"[1, 2, 3]": "malformed",
        b'{"type": "node.registered"}': "missing required field `node`",
        b'{"type": "node.exploded", "node": "node-a"}': "'node.exploded'",
        raw_event("node-a", gpus="all of them"): "at `$.gpus`",
        raw_event("node-a", v=99): "schema version 99",
        b'{"type": "node.registered", "node": "node-a"}}}': "trailing characters",
        c.encode(c.Heartbeat(node="node-a")): "not an event",  # where only events belong
        # Unknown fields are skipped for forward compatibility, but not without bound.
        b'{"type": "node.registered", "node": "node-a", "x": ' + nested + b"}": "recursion",
    }
    for data, phrase in malformed.items():
        seq = await publish_raw(js, a_reg, data)
        expect_dead[seq] = phrase
    # Decodable oddities: an unknown field nested 50 deep, a string full of brackets.
    for extra in ({"future": json.loads("[" * 50 + "]" * 50)}, {"future": "[" * 100_000}):
        seq = await publish_raw(js, a_reg, raw_event("node-a", **extra))
        expect_folded.append(seq)
    await checkpoint("node-a")

    # -- absurd but decodable: values the contract allows and Postgres cannot store are
    # dead-lettered with the database's reason; merely huge ones are folded. One node
    # each, so no later event overwrites what an earlier one wrote.
    status_of = msgspec.to_builtins(status)
    absurd = {
        "n-nul-label": (raw_event("n-nul-label", labels={"zone": "z\u00001"}), "Unicode escape"),
        "n-nul-text": (raw_event("n-nul-text", boot_id="\x00"), "refused by the database"),
        "n-range": (
            msgspec.json.encode({**status_of, "node": "n-range", "port": 10**15}),
            "out of int32 range",
        ),
        "n-labels": (
            raw_event("n-labels", labels={f"k{i}": "v" * 80 for i in range(9000)}),  # ~850 KB
            None,
        ),
        "n-tail": (
            msgspec.json.encode({**status_of, "node": "n-tail", "output_tail": ["x" * 999] * 900}),
            None,
        ),
    }
    for node, (data, phrase) in absurd.items():
        seq = await publish_raw(js, s.agent_event(node, "x"), data)
        if phrase is None:
            expect_folded.append(seq)
        else:
            expect_dead[seq] = phrase
    await checkpoint("node-a")

    # -- oversized: refused at publish time, so it never reaches the log or the fold.
    before = (await js.stream_info(s.EVENTS_STREAM)).state.last_seq
    with pytest.raises(MaxPayloadError):  # over the server's max_payload: the client refuses
        await js.publish(a_reg, b"x" * (2 * 1024 * 1024))
    # The stream's own limit: LLMGW_HEARTBEATS takes at most 256 KiB per message.
    big_hb = c.Heartbeat(node="node-a", boot_id="b" * (300 * 1024))
    with pytest.raises(BadRequestError) as refused:
        await bus.publish(js, big_hb)
    assert "maximum" in str(refused.value.description).lower()
    assert (await js.stream_info(s.EVENTS_STREAM)).state.last_seq == before
    assert (await js.stream_info(s.HEARTBEATS_STREAM)).state.messages == 0
    last = await checkpoint("node-a")

    dead = await api.dead_letters()
    for seq, phrase in expect_dead.items():
        assert seq in dead, f"seq {seq} ({phrase}) was not dead-lettered"
        assert phrase in dead[seq]["reason"], dead[seq]
        assert await api.archived(seq) is None
    for seq in expect_folded:
        assert seq not in dead, dead.get(seq)
        assert await api.archived(seq) is not None
    assert (await api.get("/api/status"))["folded_seq"] == last
    nodes = {n["node"] for n in await api.get("/api/nodes")}
    # node-b never came to exist through node-a's subject; the refused ones left no trace.
    assert nodes == {"node-a", "n-labels"}
    labels = next(n for n in await api.get("/api/nodes") if n["node"] == "n-labels")["labels"]
    assert len(labels) == 9000
