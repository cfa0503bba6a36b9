"""Pool autoscaling through `llmgw apply` and the real reconciler (Postgres fold,
operator API) on real NATS: a disaggregated sim model whose pools both autoscale, with
routers' demand summaries (published on the real subject, as a router's presence ticks
do) showing the decode pool loaded and the prefill pool light. The decode pool scales
up and its new replicas are placed; the prefill pool stays put; explain shows each
pool's bounds and last scaling from Postgres; replay re-derives the decision."""

from __future__ import annotations

import asyncio

from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.opcli import explain
from llmgw.reconciler.audit import replay_cli, verify
from llmgw.reconciler.store import schema
from tests.integration.test_control_loop import NO_TLS, SimAgent, cli, real_reconciler, wait_kv
from tests.integration.test_reconciler_apply import apply
from tests.integration.test_rolling_update import api_until

CATALOG = """
models:
  - name: m
    profile: {engine: sim}
    disaggregation:
      prefill: {autoscale: {min: 1, max: 2, target: 0.5, scale_up_after_seconds: 0.5}}
      decode: {autoscale: {min: 1, max: 3, target: 0.5, scale_up_after_seconds: 0.5}}
      connector: {kind: ExampleConnector, shared_path: /tmp/llmgw-kv}
"""
SLOTS = 8  # the simulated agents report max_running=8


async def table_differences(database_url: str) -> list[str]:
    """What `llmgw audit verify` finds between the state tables and a replay of the log."""
    engine = schema.make_engine(database_url)
    try:
        return (await verify.verify(engine)).differences
    finally:
        await engine.dispose()


def ready_roles(rec: c.ModelEndpoints | None) -> list[str]:
    return sorted(
        e.role for e in (rec.endpoints if rec else []) if e.state == c.EndpointState.READY
    )


async def publish_demand(nc, stop: asyncio.Event) -> None:
    """Two routers, each seeing half the load: the one decode replica has 12 requests on
    8 slots (load 1.5, three times the target), the prefill replica 2 (load 0.25)."""
    while not stop.is_set():
        for i in range(2):
            pools = {
                "prefill": c.PoolDemand(in_flight=1, capacity=SLOTS, ready=1),
                "decode": c.PoolDemand(in_flight=6, capacity=SLOTS, ready=1),
            }
            demand = c.ModelDemand(in_flight=7, capacity=2 * SLOTS, ready=2, pools=pools)
            summary = c.DemandSummary(router_id=f"r{i}", models={"m": demand})
            await nc.publish(s.subject_for(summary), c.encode(summary))
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


async def test_the_loaded_decode_pool_scales_up_and_the_prefill_pool_stays(
    nats, nats_url, database_url, tmp_path
):
    js = nats.jetstream()
    agents = [SimAgent(js, nats, f"node-{x}", n_gpus=2) for x in "ab"]
    async with real_reconciler(nats, database_url) as api:
        stop = asyncio.Event()
        routers: asyncio.Task | None = None
        try:
            for a in agents:
                await a.start()
            assert await apply(tmp_path, CATALOG, nats_url) == 0
            # Each autoscaled pool starts at its min.
            await wait_kv(js, "m", lambda r: ready_roles(r) == ["decode", "prefill"], "1 + 1")

            routers = asyncio.create_task(publish_demand(nats, stop))
            rec = await wait_kv(
                js,
                "m",
                lambda r: ready_roles(r) == ["decode", "decode", "decode", "prefill"],
                "three decode replicas ready",
            )
            data = await api_until(
                api,
                "/api/explain/m",
                lambda d: [p["desired_replicas"] for p in d["pools"]] == [1, 3],
                "the decode pool at 3 in Postgres",
            )
            (scaled,) = data["scaling"]
            assert (scaled["role"], scaled["from_replicas"], scaled["to_replicas"]) == (
                "decode",
                1,
                3,
            )
            assert scaled["signals"]["in_flight"] == 12 and scaled["signals"]["capacity"] == SLOTS
            prefill, decode = data["pools"]
            assert (
                prefill["last_scaling"] is None and decode["last_scaling"]["seq"] == scaled["seq"]
            )
            # Placement added decode replicas only: no second prefill replica was started.
            starts = sorted(
                x.replica_id for a in agents for x in a.received if isinstance(x, c.StartShard)
            )
            assert starts == ["m-decode-r1", "m-decode-r2", "m-decode-r3", "m-prefill-r1"]
            assert {e.replica_id for e in rec.endpoints} == set(starts)

            code, text = await asyncio.to_thread(
                cli, explain, model="m", output="table", all=False, api=api, token=None, **NO_TLS
            )
            assert code == 0, text
            assert "  decode   3 wanted, 3 placed, 3 ready" in text, text
            assert "  prefill  1 wanted, 1 placed, 1 ready" in text, text
            assert text.count("autoscaled: 1 to") == 2, text
            assert f"seq {scaled['seq']}: decode pool scaled 1 → 3" in text, text

            common = dict(from_seq=0, to_seq=None, explain=None, strict=True, verbose=True)
            code, text = await asyncio.to_thread(
                cli, replay_cli, database_url=database_url, api=None, nats=None, **common
            )
            assert code == 0, text
            assert "m decode pool scaled 1 → 3: same" in text, text
            assert await table_differences(database_url) == []  # (model, role) rows verify

            # The decode pool gets a fixed count again: its scaling row goes, the pool
            # follows the catalog's count, and the tables still match a replay.
            stop.set()
            await asyncio.wait_for(routers, 5)
            fixed = CATALOG.replace(
                "decode: {autoscale: {min: 1, max: 3, target: 0.5, scale_up_after_seconds: 0.5}}",
                "decode: {replicas: 2}",
            )
            assert await apply(tmp_path, fixed, nats_url) == 0
            data = await api_until(
                api,
                "/api/explain/m",
                lambda d: [p["desired_replicas"] for p in d["pools"]] == [1, 2],
                "the decode pool back to the catalog's 2",
            )
            assert data["pools"][1]["autoscale"] is None
            assert await table_differences(database_url) == []
        finally:
            stop.set()
            if routers is not None and not routers.done():
                await asyncio.wait_for(routers, 5)
            for a in agents:
                await a.stop()
