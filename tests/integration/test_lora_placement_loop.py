"""LoRA adapters through the real reconciler (NATS, Postgres fold, leadership, operator API).

`llmgw apply` declares a base model with two adapter slots and two adapters; a router's
demand summary (published as a router would, on its own subject) says requests for one of
them wait in admission; the leader places it, records AdaptersPlaced, and sends the
node's agent the whole set its engine should hold; the agent's report that the engine
holds it lands in the routers' projection. `llmgw explain` shows it by the adapter's
name, `llmgw get adapters` lists where each is placed and held, and `llmgw audit replay`
re-derives the placement from the archive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.opcli import explain, get
from llmgw.reconciler.audit import replay_cli
from llmgw.reconciler.catalog import apply
from tests.integration.test_control_loop import (
    DEADLINE,
    NO_TLS,
    SimAgent,
    cli,
    ready_urls,
    real_reconciler,
    wait_kv,
)

CATALOG = """
models:
  - name: m
    profile: {engine: sim, max_loras: 2, max_lora_rank: 8}
adapters:
  - {name: sql, base: m, source: /lora/sql}
  - {name: chat, base: m, source: /lora/chat}
"""


@contextlib.asynccontextmanager
async def router_asking(nc, adapter: str):
    """A router whose admission holds requests for `adapter`: a summary a second."""

    async def publish() -> None:
        while True:
            demand = c.AdapterDemand(requests=2, waiting=1)
            summary = c.DemandSummary(
                router_id="r1", models={"m": c.ModelDemand(adapters={adapter: demand})}
            )
            await nc.publish(s.subject_for(summary), c.encode(summary))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(publish())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=5)


async def until(what: str, pred):
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + DEADLINE
    while not (got := pred()):
        if loop.time() > stop_at:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
    return got


async def test_demand_places_an_adapter_the_agent_loads_it_and_routers_see_it(
    nats, database_url, tmp_path
):
    js = nats.jetstream()
    agent = SimAgent(js, nats, "node-a")
    (tmp_path / "catalog.yaml").write_text(CATALOG)
    async with real_reconciler(nats, database_url) as api:
        try:
            await agent.start()
            code, out = await asyncio.to_thread(
                cli,
                apply,
                file=str(tmp_path / "catalog.yaml"),
                nats=nats.connected_url.geturl(),
                dry_run=False,
                api=None,
                token=None,
                **NO_TLS,
            )
            assert code == 0 and "adapter sql: declared" in out, out
            rec = await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "m ready")
            assert [a.name for a in rec.adapters] == ["chat", "sql"]
            assert [(e.max_loras, e.adapters) for e in rec.endpoints] == [(2, [])]

            async with router_asking(nats, "sql"):
                cmds = await until(
                    "the engine told to load sql",
                    lambda: [x for x in agent.received if isinstance(x, c.SetShardAdapters)],
                )
            cmd = cmds[0]
            assert (cmd.node, cmd.shard_id) == ("node-a", "m-r1-s0")
            assert cmd.adapters == [c.AdapterSource(name="sql", source="/lora/sql")]
            assert cmd.term >= 1  # fenced like every command

            # The agent loads it and reports what the engine holds, in the same state.
            await bus.publish(
                js,
                c.ShardStatus(
                    node="node-a",
                    shard_id="m-r1-s0",
                    model="m",
                    replica_id="m-r1",
                    state=c.ShardState.READY,
                    url=rec.endpoints[0].url,
                    adapters=["sql"],
                    command_key=cmd.key,
                ),
            )
            rec = await wait_kv(
                js, "m", lambda r: r and [e.adapters for e in r.endpoints] == [["sql"]], "held"
            )
            assert rec.endpoints[0].state == c.EndpointState.READY  # the lifecycle untouched

            loop = asyncio.get_running_loop()
            stop_at = loop.time() + DEADLINE
            while True:  # the API reads Postgres, which the fold commits just before acting
                code, text = await asyncio.to_thread(
                    cli, explain, model="sql", output="table", all=False, api=api, token=None,
                    **NO_TLS,
                )  # fmt: skip
                if "held on m-r1" in text or loop.time() > stop_at:
                    break
                await asyncio.sleep(0.1)
            assert code == 0 and "sql is an adapter of m" in text, text
            assert "sql   placed on m-r1; held on m-r1" in text, text
            assert "sql loaded on m-r1: requests waiting and held nowhere" in text, text
            code, text = await asyncio.to_thread(
                cli, get, kind="adapters", output="json", api=api, token=None, **NO_TLS
            )
            listed = {a["name"]: a for a in json.loads(text)}
            assert (listed["sql"]["placed_on"], listed["sql"]["held_on"]) == (["m-r1"], ["m-r1"])
            assert (listed["chat"]["placed_on"], listed["chat"]["held_on"]) == ([], [])

            code, text = await asyncio.to_thread(
                cli,
                replay_cli,
                database_url=database_url,
                api=None,
                nats=None,
                from_seq=0,
                to_seq=None,
                explain=None,
                strict=True,
                verbose=False,
            )
            assert code == 0 and "1 adapter placement(s) re-derived, 0 differ" in text, text
        finally:
            await agent.stop()
