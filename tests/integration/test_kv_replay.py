"""Engine KV events lost before the agent's relay come back from the engine's replay socket,
so a router's index holds blocks it would otherwise miss.

A simulator process publishes over ZMQ with a replay endpoint (vLLM's `replay_endpoint`), the
agent's relay puts its events on real NATS, and a router (control-plane mode) folds them.
What the relay would hold had it lost nothing is a second block set fed every live batch the
engine sent, the lost ones included: the router must end up with exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from llmgw import bus, kvblocks, kvwire
from llmgw.agent.kvrelay import BlockSet, EngineRelay, KvRelays
from llmgw.dev.routerkit import running_router
from llmgw.dev.simkit import start_sim
from llmgw.kvblocks import byte_tokens

from .test_kv_events import (
    NODE,
    blocks_of,
    config,
    index_of,
    messages,
    put_model,
    record,
    relay_flag,
    send,
    socket_dir,
    wait_for,
)


class Tap:
    """Every live batch the relay's socket got, into a reference set; those in `dropping`
    mode never reach the relay (lost between engine and relay)."""

    def __init__(self, relay: EngineRelay):
        self.reference = BlockSet()
        self.dropping = False
        self.dropped = 0
        self.attach(relay)

    def attach(self, relay: EngineRelay) -> None:
        live = relay.receive

        def tap(parts: list[bytes]) -> None:
            _, _, events = kvwire.parse_frames(parts)
            self.reference.apply(events)
            if self.dropping:
                self.dropped += 1
            else:
                live(parts)

        relay.receive = tap  # type: ignore[method-assign]


@contextlib.asynccontextmanager
async def engine_and_router(nats):
    js = nats.jetstream()
    await bus.provision(js)
    url = nats.connected_url.geturl()
    nc = await bus.connect(url, name="agent-n1")
    sockets = contextlib.ExitStack()
    relays = KvRelays(NODE, sockets.enter_context(socket_dir()))
    await relays.attach(nc)
    sim = None
    try:
        relay = relays.open("shard-0")
        tap = Tap(relay)
        sim = await asyncio.to_thread(
            start_sim, model="m", block_size=16, kv_blocks=4096, kv_events_config=relay_flag(relay)
        )
        relay.url = sim.url
        async with running_router(config(url, "r1")) as router:
            await put_model(js, record([sim]))
            yield relays, tap, sim, router
    finally:
        if sim is not None:
            await asyncio.to_thread(sim.stop)
        await relays.stop()
        await bus.close_quietly(nc)
        sockets.close()


async def test_batches_lost_between_engine_and_relay_reach_the_router_by_replay(nats):
    async with (
        engine_and_router(nats) as (relays, tap, sim, router),
        httpx.AsyncClient(timeout=20) as http,
    ):
        relay = relays.relays["shard-0"]
        await send(http, sim.url, messages(1, 1))
        await wait_for(lambda: relay.blocks.hashes(), what="first events")
        await wait_for(lambda: index_of(router).has_events("shard-0"), what="router synced")
        # The link drops everything for two conversations' worth of prefills.
        tap.dropping = True
        await send(http, sim.url, messages(2, 2))
        await send(http, sim.url, messages(3, 1))
        await wait_for(lambda: tap.dropped >= 2, what="lost batches")
        tap.dropping = False
        # The next batch shows the gap: the relay asks the engine for what it missed.
        await send(http, sim.url, messages(2, 3))

        # Compared as they stand: the request's last batch may still be on its way to both.
        def reference() -> set[int]:
            return set(tap.reference.hashes())

        await wait_for(lambda: set(relay.blocks.hashes()) == reference(), what="relay repaired")
        await wait_for(
            lambda: blocks_of(index_of(router), "shard-0") == reference(), what="router index"
        )
        assert relay.engine_gaps == 0 and relay.replayed >= tap.dropped
        assert index_of(router).gaps == 0  # the bus saw no gap either: no snapshot needed


async def test_a_relay_bound_again_rebuilds_what_the_engine_stored_before_and_meanwhile(nats):
    async with (
        engine_and_router(nats) as (relays, _, sim, router),
        httpx.AsyncClient(timeout=20) as http,
    ):
        relay = relays.relays["shard-0"]
        before, meanwhile = prompt("before"), prompt("meanwhile")
        await complete(http, sim.url, before)
        await wait_for(lambda: set(hashes(before)) <= set(relay.blocks.hashes()), what="events")
        # In sync first: a router whose snapshot request is still out when the relay goes
        # gets no answer, and retries only on the engine's next event after a pause.
        await wait_for(
            lambda: set(hashes(before)) <= blocks_of(index_of(router), "shard-0"), what="synced"
        )
        endpoints = relay.endpoint, relay.replay_endpoint
        # The relay goes (an agent restart) while the engine keeps storing blocks.
        await relays.close("shard-0")
        await complete(http, sim.url, meanwhile)
        # Connected again to its sockets, as a restarted agent adopting the engine does.
        # Nothing reaches the engine after this, so no live event tells the relay anything.
        relay = relays.open("shard-0", endpoints, engine_running=True)
        relay.url = sim.url
        expected = set(hashes(before)) | set(hashes(meanwhile))
        await wait_for(lambda: expected <= set(relay.blocks.hashes()), what="relay rebuilt")
        await wait_for(
            lambda: expected <= blocks_of(index_of(router), "shard-0"), what="router index"
        )
        assert relay.engine_gaps == 0 and relay.blocks.orphans == 0


def prompt(when: str) -> str:
    return f"A long prompt, stored {when} the relay went away, block after block of it. " * 6


def hashes(prompt: str) -> list[int]:
    """The canonical hashes of a completion prompt's full blocks in the simulator (4 bytes
    a token, 16 tokens a block), as any router computes them."""
    return kvblocks.prompt_hashes(byte_tokens(prompt.encode()), 16, 1000)


async def complete(http: httpx.AsyncClient, url: str, prompt: str) -> None:
    r = await http.post(
        url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}
    )
    r.raise_for_status()
