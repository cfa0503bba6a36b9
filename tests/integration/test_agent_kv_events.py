"""The agent relays its engines' KV events: a sim it launches gets --kv-events-config, its
events reach the bus with canonical hashes, and a snapshot request is answered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import httpx

from llmgw import bus, kvblocks, subjects
from llmgw import contracts as c
from llmgw.kvblocks import byte_tokens

from . import test_agent_lifecycle as life
from .test_agent_lifecycle import S, agent_config, running_agent, start_cmd, status

watch = life.watch  # the fixture

PROMPT = "The same long prompt, block after block, for the prefix cache. " * 8


@contextlib.asynccontextmanager
async def agent_on(cfg, *, keep_engines: bool = False):
    """An agent on `cfg`'s state dir, registered: yields (agent, its run task). On leaving
    it stops; its engines keep running (to be adopted by the next) only if `keep_engines`
    and the body did not fail."""
    from llmgw.agent import engines
    from llmgw.agent.agent import Agent
    from llmgw.agent.inventory import discover
    from llmgw.agent.state import StateDir

    sd = StateDir(Path(cfg.state_dir)).open()
    inv = discover(cfg.node_id, cfg.fake_gpus, "127.0.0.1")
    agent = Agent(cfg, cfg.node_id, inv, sd, engines.detect(cfg))
    task = asyncio.create_task(agent.run())
    failed = True
    try:
        await asyncio.wait_for(agent.registered.wait(), 20)
        yield agent, task
        failed = False
    finally:
        agent.stop()
        await asyncio.wait_for(task, 20)
        sd.close()
        if failed or not keep_engines:
            life.kill_engines(agent)


async def test_a_launched_engines_kv_events_reach_the_bus_and_snapshots_answer(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    events = []

    async def on_msg(msg) -> None:
        events.append(msg)

    sub = await nats.subscribe(subjects.KV_EVENTS_ALL, cb=on_msg)
    cfg = agent_config("n-kv", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        await bus.publish(js, start_cmd("n-kv", "kv"))
        ready = await watch.wait_for(status("kv", S.READY))
        argv = agent.shards["kv"].rec.argv
        assert "--kv-events-config" in argv
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(
                f"{ready.url}/v1/completions",
                json={"model": "model-kv", "prompt": PROMPT, "max_tokens": 2},
            )
            r.raise_for_status()
        # The sim's default block is 16 tokens of 4 bytes: the prompt's full blocks, hashed
        # as any router hashes this prompt.
        expected = kvblocks.prompt_hashes(byte_tokens(PROMPT.encode()), 16, 1000)
        relayed: list[int] = []
        for _ in range(400):
            relayed = [
                h
                for m in events
                for op in c.decode(m.data, c.KvEvents).ops
                if op.op is c.KvOp.STORED
                for h in op.hashes
            ]
            if len(relayed) >= len(expected):
                break
            await nats.flush()
            await asyncio.sleep(0.05)
        assert relayed[: len(expected)] == expected
        # The same prompt under a cache_salt: the engine caches it apart, and its blocks
        # reach the bus as the salted prompt hashes (salt in the first block's extra keys),
        # none of them a block of the unsalted prompt.
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(
                f"{ready.url}/v1/completions",
                json={"model": "model-kv", "prompt": PROMPT, "max_tokens": 2,
                      "cache_salt": "tenant-a"},
            )  # fmt: skip
            r.raise_for_status()
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        salted = kvblocks.prompt_hashes(
            byte_tokens(PROMPT.encode()), 16, 1000, first_extra=kvblocks.salt_extra("tenant-a")
        )
        for _ in range(400):
            relayed = [
                h
                for m in events
                for op in c.decode(m.data, c.KvEvents).ops
                if op.op is c.KvOp.STORED
                for h in op.hashes
            ]
            if len(relayed) >= len(expected) + len(salted):
                break
            await nats.flush()
            await asyncio.sleep(0.05)
        assert relayed[len(expected) : len(expected) + len(salted)] == salted
        assert not set(salted) & set(expected)
        line = next(
            ln
            for ln in agent.metrics.text().decode().splitlines()
            if ln.startswith("llmgw_agent_kv_event_batches_published_total ")
        )
        assert float(line.split()[1]) >= 1
        batch = c.decode(events[0].data, c.KvEvents)
        assert (batch.node, batch.shard_id, batch.url) == ("n-kv", "kv", ready.url)
        reply = await nats.request(
            subjects.kv_snapshot("n-kv", "kv"),
            c.encode(c.KvSnapshotRequest(node="n-kv", shard_id="kv")),
            timeout=5,
        )
        snap = c.decode(reply.data, c.KvSnapshot)
        assert set(expected) <= set(snap.hashes) and snap.epoch == batch.epoch
        assert snap.seq >= c.decode(events[-1].data, c.KvEvents).seq_last
        # Stopping the engine closes its relay.
        await bus.publish(js, c.StopShard(key="stop-kv", node="n-kv", shard_id="kv"))
        await watch.wait_for(status("kv", S.STOPPED))
        for _ in range(100):
            if "kv" not in agent.kv_relays.relays:
                break
            await asyncio.sleep(0.05)
        assert "kv" not in agent.kv_relays.relays
    await sub.unsubscribe()


async def test_a_restarted_agent_connects_its_relay_to_the_adopted_engine_again(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    cfg = agent_config("n-kv2", nats_url, tmp_path / "state")
    async with agent_on(cfg, keep_engines=True) as (first, _):
        await bus.publish(js, start_cmd("n-kv2", "kv2"))
        ready = await watch.wait_for(status("kv2", S.READY))
        endpoint = first.shards["kv2"].rec.kv_events_endpoint
        assert endpoint

    async with agent_on(cfg) as (second, _):
        relay = second.kv_relays.relays["kv2"]
        assert relay.endpoint == endpoint and relay.url == ready.url
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(100):  # the relay's ZMQ socket joins the engine's on its own
                r = await client.post(
                    f"{ready.url}/v1/completions",
                    json={"model": "model-kv2", "prompt": PROMPT + str(_), "max_tokens": 1},
                )
                r.raise_for_status()
                if relay.blocks.hashes():
                    break
                await asyncio.sleep(0.1)
        assert relay.blocks.hashes(), "no KV events reached the reconnected relay"


async def test_a_restarted_agent_gets_back_the_blocks_its_engine_stored_before_and_meanwhile(
    nats, nats_url, watch, tmp_path
):
    """The engine's replay socket (its endpoint in the shard record) rebuilds the adopted
    engine's block set: what it stored before the agent stopped and while it was away."""
    js = nats.jetstream()
    cfg = agent_config("n-kv4", nats_url, tmp_path / "state")
    before, meanwhile = PROMPT, PROMPT.replace("same", "other")

    async def complete(url: str, prompt: str) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(
                f"{url}/v1/completions",
                json={"model": "model-kv4", "prompt": prompt, "max_tokens": 1},
            )
            r.raise_for_status()

    def hashes(prompt: str) -> set[int]:
        return set(kvblocks.prompt_hashes(byte_tokens(prompt.encode()), 16, 1000))

    async with agent_on(cfg, keep_engines=True) as (first, _):
        await bus.publish(js, start_cmd("n-kv4", "kv4"))
        ready = await watch.wait_for(status("kv4", S.READY))
        rec = first.shards["kv4"].rec
        assert rec.kv_replay_endpoint
        assert f'"replay_endpoint":"{rec.kv_replay_endpoint}"' in " ".join(rec.argv)
        await complete(ready.url, before)
        relay = first.kv_relays.relays["kv4"]
        for _ in range(400):
            if hashes(before) <= set(relay.blocks.hashes()):
                break
            await asyncio.sleep(0.05)
    await complete(ready.url, meanwhile)  # no relay listens

    async with agent_on(cfg) as (second, _):
        relay = second.kv_relays.relays["kv4"]
        assert relay.replay_endpoint == rec.kv_replay_endpoint
        expected = hashes(before) | hashes(meanwhile)
        for _ in range(400):  # no request reaches the engine now: only a replay tells
            if expected <= set(relay.blocks.hashes()):
                break
            await asyncio.sleep(0.05)
        reply = await nats.request(
            subjects.kv_snapshot("n-kv4", "kv4"),
            c.encode(c.KvSnapshotRequest(node="n-kv4", shard_id="kv4")),
            timeout=5,
        )
        snap = c.decode(reply.data, c.KvSnapshot)
        assert expected <= set(snap.hashes), "the routers' snapshot misses the engine's blocks"
        assert second.metrics.kv_replayed._value.get() >= 1


async def test_a_data_parallel_engine_gets_no_relay_and_the_agent_says_why(
    nats, nats_url, watch, tmp_path, caplog
):
    """Its DP ranks would publish to the endpoint's port + rank, which ipc has not."""
    caplog.set_level(logging.WARNING, logger="llmgw.agent")
    fake = tmp_path / "fake-vllm"  # an engine that only waits: the command line is the point
    fake.write_text("#!/bin/sh\nexec sleep 120\n")
    fake.chmod(0o755)
    js = nats.jetstream()
    cfg = agent_config("n-dp", nats_url, tmp_path / "state", vllm_command=[str(fake)])
    async with running_agent(cfg) as agent:
        await bus.publish(js, start_cmd("n-dp", "dp", engine="vllm", engine_args=["-dp", "2"]))
        await bus.publish(js, start_cmd("n-dp", "one", engine="vllm", gpus=["GPU-fake-n-dp-1"]))
        for shard_id in ("dp", "one"):
            await watch.wait_for(status(shard_id, S.LOADING))
        assert "--kv-events-config" not in agent.shards["dp"].rec.argv
        assert "dp" not in agent.kv_relays.relays and not agent.shards["dp"].rec.kv_events_endpoint
        # Without data parallelism the same engine keeps its events.
        assert "--kv-events-config" in agent.shards["one"].rec.argv
        assert "one" in agent.kv_relays.relays
    said = [r.getMessage() for r in caplog.records if "KV events are off" in r.getMessage()]
    assert len(said) == 1 and "shard dp" in said[0] and "data parallel size 2" in said[0]
