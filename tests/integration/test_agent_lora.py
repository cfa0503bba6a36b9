"""The agent keeps a real simulator's LoRA adapters at the set the leader asks for: over
real NATS, through the engine's runtime API, reported in shard status and load samples;
a bad path's failure carries the engine's answer; a relaunched engine gets the set again;
a shard without slots says it cannot hold any; a command of another boot is dropped; a
restarted agent reads what an adopted engine holds instead of loading it again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.agent import engines
from llmgw.agent.agent import Agent
from llmgw.agent.inventory import discover
from llmgw.agent.state import StateDir

from .test_agent_lifecycle import (
    WAIT,
    Watch,
    agent_config,
    kill_engines,
    running_agent,
    start_cmd,
    status,
)

S = c.ShardState


@pytest.fixture
async def watch(nats) -> AsyncIterator[Watch]:
    await bus.provision(nats.jetstream())
    yield await Watch().start(nats, "llmgw.evt.agent.>", subjects.LOAD_ALL)


def set_adapters(node: str, shard_id: str, key: str, boot_id: str, **sources: str):
    return c.SetShardAdapters(
        key=key,
        node=node,
        shard_id=shard_id,
        adapters=[c.AdapterSource(name=n, source=s) for n, s in sources.items()],
        boot_id=boot_id,
    )


def held(shard_id: str, adapters: list[str]):
    return lambda m: (
        isinstance(m, c.ShardStatus) and m.shard_id == shard_id and m.adapters == adapters
    )


async def complete(url: str, model: str, max_tokens: int = 2) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": max_tokens},
        )


async def test_the_agent_loads_unloads_and_reports_adapters(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    for name in ("a1", "a2"):
        (tmp_path / name).mkdir()
    cfg = agent_config("n-lora", nats_url, tmp_path / "state", adapter_backoff_seconds=0.05)
    async with running_agent(cfg) as agent:
        start = start_cmd("n-lora", "l", max_loras=2, engine_args=["--itl-ms", "20"])
        await bus.publish(js, start)
        ready = await watch.wait_for(status("l", S.READY))
        assert ready.adapters == []  # a new engine with slots holds none, and says so

        boot = agent.boot_id
        first = set_adapters(
            "n-lora", "l", "ad-1", boot, a1=str(tmp_path / "a1"), a2=str(tmp_path / "a2")
        )
        await bus.publish(js, first)
        both = await watch.wait_for(held("l", ["a1", "a2"]))
        assert both.state == S.READY and both.adapter_errors == {}
        assert (await complete(ready.url, "a1")).status_code == 200

        # The whole set again, smaller and with a bad path: a1 goes, bad fails with the
        # engine's answer after the retries, a2 stays.
        seen = len(watch.messages)
        second = set_adapters("n-lora", "l", "ad-2", boot, a2=str(tmp_path / "a2"), bad="/nope/x")
        await bus.publish(js, second)
        failed = await watch.wait_for(
            lambda m: held("l", ["a2"])(m) and "bad" in m.adapter_errors, after=seen
        )
        assert failed.adapter_errors == {
            "bad": "HTTP 404: Loading lora bad failed: No adapter found for /nope/x"
        }
        assert (await complete(ready.url, "a1")).status_code == 404

        # Load samples name the adapter of a running request.
        seen = len(watch.messages)
        task = asyncio.create_task(complete(ready.url, "a2", max_tokens=40))
        sample = await watch.wait_for(
            lambda m: isinstance(m, c.LoadSample) and m.running_adapters == ["a2"], after=seen
        )
        assert sample.shard_id == "l"
        assert (await task).status_code == 200

        # A command of an earlier boot is dropped: nothing is unloaded.
        stale = set_adapters("n-lora", "l", "ad-stale", "an-earlier-boot")
        await bus.publish(js, stale)

        # A relaunched engine holds nothing; the agent loads the last set into it again.
        await bus.publish(js, c.StopShard(key="stop-l", node="n-lora", shard_id="l"))
        stopped = await watch.wait_for(status("l", S.STOPPED, "stop-l"))
        assert stopped.adapters == []  # a stopped engine holds nothing
        # The stale command changed nothing.
        assert [a.name for a in agent.shards["l"].rec.desired_adapters] == ["a2", "bad"]
        seen = len(watch.messages)
        await bus.publish(js, start_cmd("n-lora", "l", key="start-l-2", max_loras=2))
        again = await watch.wait_for(status("l", S.READY, "start-l-2"), after=seen)
        assert again.adapters == []
        await watch.wait_for(held("l", ["a2"]), after=seen, timeout=WAIT)
        ops = agent.metrics.text().decode()
        assert 'llmgw_agent_adapter_operations_total{op="load",outcome="failed"}' in ops


async def test_a_shard_without_slots_says_it_holds_no_adapter(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config("n-noslot", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        await bus.publish(js, start_cmd("n-noslot", "p"))
        ready = await watch.wait_for(status("p", S.READY))
        assert ready.adapters is None  # no slots: nothing to report
        cmd = set_adapters("n-noslot", "p", "ad-p", agent.boot_id, a1=str(tmp_path))
        await bus.publish(js, cmd)
        answer = await watch.wait_for(status("p", S.READY, "ad-p"))
        assert "profile.max_loras is 0" in answer.adapter_errors["a1"]


async def sim_loads(url: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        page = (await client.get(f"{url}/metrics")).text
    return float(
        next(ln for ln in page.splitlines() if ln.startswith("llmgw_sim_lora_loads_total")).split()[
            1
        ]
    )


async def test_a_restarted_agent_reads_the_adopted_engines_adapters_instead_of_reloading(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    for name in ("a1", "a2"):
        (tmp_path / name).mkdir()
    cfg = agent_config("n-lora-re", nats_url, tmp_path / "state")
    # The first agent process, stopped as SIGTERM stops it: its engine keeps serving.
    state = StateDir(tmp_path / "state").open()
    first = Agent(
        cfg,
        cfg.node_id,
        discover(cfg.node_id, cfg.fake_gpus, "127.0.0.1"),
        state,
        engines.detect(cfg),
    )
    task = asyncio.create_task(first.run())
    try:
        await asyncio.wait_for(first.registered.wait(), WAIT)
        await bus.publish(js, start_cmd("n-lora-re", "r", max_loras=2))
        ready = await watch.wait_for(status("r", S.READY))
        await bus.publish(
            js, set_adapters("n-lora-re", "r", "ad-r1", first.boot_id, a1=str(tmp_path / "a1"))
        )
        await watch.wait_for(held("r", ["a1"]))
        first.stop()
        await asyncio.wait_for(task, WAIT)
        state.close()
        assert await sim_loads(ready.url) == 1

        async with running_agent(cfg) as second:
            seen = len(watch.messages)
            cmd = set_adapters(
                "n-lora-re",
                "r",
                "ad-r2",
                second.boot_id,
                a1=str(tmp_path / "a1"),
                a2=str(tmp_path / "a2"),
            )
            await bus.publish(js, cmd)
            await watch.wait_for(held("r", ["a1", "a2"]), after=seen)
            assert await sim_loads(ready.url) == 2  # a2 only: a1 was read from the engine
    finally:
        kill_engines(first)  # should the test fail before the second agent took them
