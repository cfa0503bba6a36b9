"""The SetShardAdapters key through the real reconciler (NATS, Postgres fold, leadership).

A replica whose engine is slow to load its adapter keeps one command while decisions
change another replica: a new key would be sent at once as a new command, and the
agent would start its retries of the load over. A replica asked for a set it held
before (A, then B, then A) gets a new key each time, or the agent answers the old key
without loading anything.

A router's demand summary (published as a router would) says which adapters have
requests waiting; the agent reports what its engine holds as an agent would. Commands
are counted as the node's subject delivers them; re-issues are pushed past the test
by the actor's command back-off, so each count is of commands sent as new.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from llmgw import bus
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.catalog import apply
from tests.integration.test_control_loop import (
    DEADLINE,
    FAST,
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
    replicas: 2
    profile: {engine: sim, max_loras: 1, max_lora_rank: 8}
adapters:
  - {name: a, base: m, source: /lora/a}
  - {name: b, base: m, source: /lora/b}
  - {name: c, base: m, source: /lora/c}
"""
# No re-issue within the test: every command counted was sent as new.
SLOW_RETRY = msgspec.structs.replace(FAST, command_retry_initial=120.0, command_retry_max=120.0)


@contextlib.asynccontextmanager
async def router_waiting(nc, waiting: dict[str, int]):
    """A router whose admission holds `waiting[adapter]` requests (the dict as it is
    at each summary, five a second), with no arrivals counted: no adapter has demand."""

    async def publish() -> None:
        while True:
            adapters = {a: c.AdapterDemand(waiting=n) for a, n in waiting.items()}
            summary = c.DemandSummary(
                router_id="r1", models={"m": c.ModelDemand(adapters=adapters)}
            )
            await nc.publish(s.subject_for(summary), c.encode(summary))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(publish())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=5)


def sets_sent(agent: SimAgent, shard: str) -> list[c.SetShardAdapters]:
    return [x for x in agent.received if isinstance(x, c.SetShardAdapters) and x.shard_id == shard]


async def sent(
    agent: SimAgent, shard: str, names: list[str], after: c.SetShardAdapters | None = None
) -> c.SetShardAdapters:
    """The first command to `shard` asking for `names` (after the command `after`)."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + DEADLINE
    while True:
        cmds = sets_sent(agent, shard)
        if after is not None:
            cmds = cmds[[x.id for x in cmds].index(after.id) + 1 :]
        got = [x for x in cmds if [a.name for a in x.adapters] == names]
        if got:
            return got[0]
        if loop.time() > stop_at:
            raise AssertionError(f"timed out waiting for {shard} to be told to hold {names}")
        await asyncio.sleep(0.05)


async def test_a_decision_for_one_replica_sends_nothing_new_to_another_and_a_b_a_gets_three_keys(
    nats, database_url, tmp_path
):
    js = nats.jetstream()
    agent = SimAgent(js, nats, "node-a", n_gpus=2)
    (tmp_path / "catalog.yaml").write_text(CATALOG)
    waiting: dict[str, int] = {}
    async with real_reconciler(nats, database_url, SLOW_RETRY):
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
            assert code == 0, out
            rec = await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 2, "m ready")
            urls = {e.replica_id: e.url for e in rec.endpoints}

            async def holds(replica: str, adapters: list[str], cmd: c.SetShardAdapters) -> None:
                await bus.publish(
                    js,
                    c.ShardStatus(
                        node="node-a",
                        shard_id=f"{replica}-s0",
                        model="m",
                        replica_id=replica,
                        state=c.ShardState.READY,
                        url=urls[replica],
                        adapters=adapters,
                        command_key=cmd.key,
                    ),
                )

            async with router_waiting(nats, waiting):
                # One decision: a (the longer queue) on m-r1, b on m-r2. b's engine never
                # loads it, so its requests keep waiting.
                waiting.update(a=3, b=2)
                first_a = await sent(agent, "m-r1-s0", ["a"])
                slow_b = await sent(agent, "m-r2-s0", ["b"])
                await holds("m-r1", ["a"], first_a)
                del waiting["a"]

                # c's queue takes m-r1's slot (a expects nothing; b expects its 2 waiting,
                # not fewer than c's 2): a decision that changes m-r1 only.
                waiting["c"] = 2
                then_c = await sent(agent, "m-r1-s0", ["c"], after=first_a)
                await holds("m-r1", ["c"], then_c)
                del waiting["c"]

                # a again, where m-r1 held it before.
                waiting["a"] = 2
                again_a = await sent(agent, "m-r1-s0", ["a"], after=then_c)
                await holds("m-r1", ["a"], again_a)

            assert len({first_a.key, then_c.key, again_a.key}) == 3
            assert again_a.adapters == first_a.adapters
            # m-r2 was told once, whatever m-r1's two decisions after it.
            assert [x.key for x in sets_sent(agent, "m-r2-s0")] == [slow_b.key]
        finally:
            await agent.stop()
