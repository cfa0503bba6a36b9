"""KV events end to end on real NATS: simulator processes publish over ZMQ, the agent's
relay puts them on the bus, and two routers (control-plane mode, each its own NATS
connection) fold them into the same index and make the same picks.

The projection is written to KV by hand (as the reconciler would); the relay is the
agent's own component (llmgw.agent.kvrelay), attached to its own connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec

from llmgw import bus, projection, subjects
from llmgw import contracts as c
from llmgw.agent import kvsockets
from llmgw.agent.kvrelay import EngineRelay, KvRelays
from llmgw.agent.launch import LaunchContext, kv_events_args
from llmgw.dev.routerkit import running_router
from llmgw.dev.simkit import start_sim
from llmgw.router import config as rc
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.prefix import block_hashes

MODEL = "m"
NODE = "n1"
SYSTEM = "You are the support assistant of tenant {t}. Answer briefly and politely. " * 12


def messages(tenant: int, turns: int) -> list[dict]:
    out = [{"role": "system", "content": SYSTEM.format(t=tenant)}]
    for i in range(turns):
        out.append({"role": "user", "content": f"question {i} of tenant {tenant} " * 4})
        if i < turns - 1:
            out.append({"role": "assistant", "content": f"answer {i} " * 6})
    return out


def relay_flag(relay: EngineRelay) -> str:
    """The `--kv-events-config` the agent gives the relay's engine."""
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="", command=[],
        kv_events_endpoint=relay.endpoint, kv_replay_endpoint=relay.replay_endpoint,
    )  # fmt: skip
    return kv_events_args(ctx)[1]


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    """A directory for the engines' KV event sockets, as the agent's state dir has."""
    with tempfile.TemporaryDirectory(prefix="kv") as d:
        yield kvsockets.prepare(Path(d) / kvsockets.DIR_NAME)


async def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout}s")


@contextlib.asynccontextmanager
async def fleet(nats_url: str, n: int = 2):
    """n simulators whose KV events reach the bus through a relay on its own connection."""
    nc = await bus.connect(nats_url, name="agent-n1")
    sockets = contextlib.ExitStack()
    relays = KvRelays(NODE, sockets.enter_context(socket_dir()))
    await relays.attach(nc)
    sims = []
    try:
        for i in range(n):
            relay = relays.open(f"shard-{i}")
            sim = await asyncio.to_thread(
                start_sim,
                model=MODEL,
                block_size=16,
                kv_blocks=4096,
                kv_events_config=relay_flag(relay),
            )
            relay.url = sim.url
            sims.append(sim)
        yield relays, sims
    finally:
        for sim in sims:
            await asyncio.to_thread(sim.stop)
        await relays.stop()
        await bus.close_quietly(nc)
        sockets.close()


def record(sims) -> c.ModelEndpoints:
    return c.ModelEndpoints(
        model=MODEL,
        endpoints=[
            c.Endpoint(id=f"shard-{i}", url=s.url, node=NODE, engine="sim")
            for i, s in enumerate(sims)
        ],
        scheduling=c.SchedulingSpec(scorers={"kv_prefix": 3.0, "queue": 1.0, "inflight": 1.0}),
    )


async def put_model(js, rec: c.ModelEndpoints) -> None:
    bucket, key = projection.key_of(rec).target
    await (await js.key_value(bucket)).put(key, projection.encode(rec))


def pick(router, msgs: list[dict]) -> str:
    """What this router's pipeline picks for a chat with these messages."""
    route = router.service.view.route(MODEL)
    raw = msgspec.json.encode(msgs)
    ctx = sc.Context(time.time(), MODEL, prefix=block_hashes(raw, 256, 128), key=7)
    return route.pipeline.pick(route.endpoints, ctx).id


def index_of(router):
    return router.service.kv_index


def blocks_of(index, ep_id: str) -> set[int]:
    st = index.endpoints.get(ep_id)
    if st is None:
        return set()
    bit = 1 << st.slot
    return {h for h, m in index.blocks.items() if m & bit}


def config(nats_url: str, router_id: str) -> rc.RouterConfig:
    return rc.RouterConfig(nats_url=nats_url, router_id=router_id)


async def send(http: httpx.AsyncClient, url: str, msgs: list[dict]) -> httpx.Response:
    r = await http.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2}
    )
    r.raise_for_status()
    return r


async def test_two_routers_fold_the_same_events_and_pick_the_engine_holding_the_prefix(nats):
    js = nats.jetstream()
    await bus.provision(js)
    url = nats.connected_url.geturl()
    async with (
        fleet(url) as (relays, sims),
        running_router(config(url, "r1")) as r1,
        running_router(config(url, "r2")) as r2,
        httpx.AsyncClient(timeout=20) as http,
    ):
        await put_model(js, record(sims))
        routers = (r1, r2)
        await wait_for(
            lambda: all(r.service.view.route(MODEL) for r in routers), what="the projection"
        )
        # Idle engines answer the routers' start-up snapshot requests: synced, and empty.
        await wait_for(
            lambda: all(index_of(r).has_events(f"shard-{i}") for r in routers for i in (0, 1)),
            what="start-up snapshots",
        )
        # Tenant 0's conversation ran on engine 0, tenant 1's on engine 1 (directly).
        await send(http, sims[0].url, messages(0, 1))
        await send(http, sims[1].url, messages(1, 1))
        await wait_for(
            lambda: all(r.blocks.hashes() for r in relays.relays.values()),
            what="the relays hearing both engines",
        )
        warm0 = set(relays.relays["shard-0"].blocks.hashes())
        warm1 = set(relays.relays["shard-1"].blocks.hashes())
        await wait_for(
            lambda: all(
                blocks_of(index_of(r), "shard-0") == warm0
                and blocks_of(index_of(r), "shard-1") == warm1
                for r in routers
            ),
            what="both routers indexing both engines' blocks",
        )
        # Same events, same requests: same picks, and the engine that holds the prefix.
        for tenant in (0, 1):
            for turns in (2, 3):
                picks = {pick(r, messages(tenant, turns)) for r in routers}
                assert picks == {f"shard-{tenant}"}, (tenant, turns, picks)

        # Through the routers' HTTP front: the next turn lands where its prefix is cached,
        # which the engine's own prefix-cache counters show.
        before = sims[1].state()["prefix_cache_hits"]
        for r in routers:
            resp = await send(http, r.url, messages(1, 2))
            assert resp.headers["x-llmgw-endpoint"] == "shard-1"
        assert sims[1].state()["prefix_cache_hits"] > before
        text = (await http.get(r1.admin_url + "/metrics")).text
        assert 'llmgw_router_kv_events_total{result="applied"}' in text
        assert "llmgw_router_kv_index_blocks" in text


async def test_a_router_that_misses_events_recovers_with_a_snapshot(nats):
    js = nats.jetstream()
    await bus.provision(js)
    url = nats.connected_url.geturl()
    async with (
        fleet(url) as (relays, sims),
        running_router(config(url, "r1")) as r1,
        running_router(config(url, "r2")) as r2,
        httpx.AsyncClient(timeout=20) as http,
    ):
        await put_model(js, record(sims))
        await wait_for(
            lambda: all(index_of(r).has_events("shard-0") for r in (r1, r2)), what="synced"
        )
        # Router 2 stops hearing events (as if its messages were lost on the bus).
        feed = r2.service.source.kv_events
        await feed._sub.unsubscribe()
        seq = relays.relays["shard-0"].last_seq
        await send(http, sims[0].url, messages(5, 2))
        await wait_for(lambda: relays.relays["shard-0"].last_seq > seq, what="new engine events")
        engine_blocks = set(relays.relays["shard-0"].blocks.hashes())
        await wait_for(lambda: blocks_of(index_of(r1), "shard-0") == engine_blocks, what="r1")
        assert blocks_of(index_of(r2), "shard-0") != engine_blocks
        snapshots = index_of(r2).snapshots
        # It hears again: the next batch does not follow the last one it applied.
        feed._sub = await feed.nc.subscribe(subjects.KV_EVENTS_ALL, cb=feed._on_msg)
        seq = relays.relays["shard-0"].last_seq
        await send(http, sims[0].url, messages(6, 1))
        await wait_for(lambda: relays.relays["shard-0"].last_seq > seq, what="new engine events")
        engine_blocks = set(relays.relays["shard-0"].blocks.hashes())
        await wait_for(
            lambda: blocks_of(index_of(r2), "shard-0") == engine_blocks,
            what="r2 recovered from a snapshot",
        )
        assert index_of(r2).gaps >= 1 and index_of(r2).snapshots > snapshots
        assert pick(r1, messages(5, 3)) == pick(r2, messages(5, 3)) == "shard-0"

        # The engine leaves the projection: both routers drop its blocks.
        rec = record(sims)
        rec.endpoints = rec.endpoints[1:]
        await put_model(js, rec)
        await wait_for(
            lambda: all(
                "shard-0" not in index_of(r).endpoints and not index_of(r).needs_sweep
                for r in (r1, r2)
            ),
            what="shard-0's blocks dropped",
        )
        assert not (
            set(index_of(r1).blocks) & engine_blocks - set(relays.relays["shard-1"].blocks.hashes())
        )
