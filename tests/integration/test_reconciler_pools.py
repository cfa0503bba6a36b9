"""A disaggregated model through `llmgw apply` and the real reconciler (Postgres fold,
operator API) on real NATS: both pools placed on simulated agents, roles in the router
projection and in Postgres, one pool scaled down without touching the other, and a clean
replay."""

from __future__ import annotations

import asyncio

from llmgw import contracts as c
from llmgw.opcli import apiclient, explain
from llmgw.reconciler.audit import replay_cli
from tests.integration.test_control_loop import NO_TLS, SimAgent, cli, real_reconciler, wait_kv
from tests.integration.test_reconciler_apply import apply
from tests.integration.test_rolling_update import api_until

CONNECTOR = c.ConnectorSpec(kind="ExampleConnector", shared_path="/tmp/llmgw-kv")


CATALOG = """
models:
  - name: m
    profile: {engine: sim}
    disaggregation:
      prefill: {replicas: 1}
      decode: {replicas: DECODE, profile: {engine: sim, max_num_seqs: 16}}
      connector: {kind: ExampleConnector, shared_path: /tmp/llmgw-kv}
"""


def catalog(decode: int) -> str:
    return CATALOG.replace("DECODE", str(decode))


def roles(rec: c.ModelEndpoints | None, state: c.EndpointState) -> dict[str, str]:
    """replica id -> role of the record's endpoints in `state`."""
    return {e.replica_id: e.role for e in (rec.endpoints if rec else []) if e.state == state}


READY = c.EndpointState.READY


async def test_both_pools_placed_projected_scaled_apart_and_replayed(
    nats, nats_url, database_url, tmp_path, capsys
):
    js = nats.jetstream()
    agents = [SimAgent(js, nats, f"node-{x}", n_gpus=2) for x in "ab"]
    async with real_reconciler(nats, database_url) as api:
        try:
            for a in agents:
                await a.start()
            assert await apply(tmp_path, catalog(decode=2), nats_url) == 0
            rec = await wait_kv(js, "m", lambda r: len(roles(r, READY)) == 3, "three ready")
            assert roles(rec, READY) == {
                "m-prefill-r1": "prefill",
                "m-decode-r1": "decode",
                "m-decode-r2": "decode",
            }
            assert rec.disaggregation == c.DisaggregationSpec(
                prefill=c.PoolSpec(replicas=1),
                decode=c.PoolSpec(replicas=2, profile=c.ServingProfile(max_num_seqs=16)),
                connector=CONNECTOR,
            )
            decode_ep = next(e for e in rec.endpoints if e.role == "decode")
            assert decode_ep.max_running == 8  # the agent's report wins over the profile's 16

            starts = {
                x.replica_id: x for a in agents for x in a.received if isinstance(x, c.StartShard)
            }
            assert {rid: (s.role, s.connector) for rid, s in starts.items()} == {
                "m-prefill-r1": ("prefill", CONNECTOR),
                "m-decode-r1": ("decode", CONNECTOR),
                "m-decode-r2": ("decode", CONNECTOR),
            }
            assert starts["m-decode-r1"].profile.max_num_seqs == 16
            assert starts["m-prefill-r1"].profile.max_num_seqs is None

            # What operators read comes from Postgres: the role survived the tables.
            reps = await api_until(
                api,
                "/api/replicas",
                lambda rs: sum(r["state"] == "ready" for r in rs) == 3,
                "three ready replicas",
            )
            assert {r["replica_id"]: r["role"] for r in reps} == {
                "m-prefill-r1": "prefill",
                "m-decode-r1": "decode",
                "m-decode-r2": "decode",
            }
            eps = await asyncio.to_thread(apiclient.get_json, api, "/api/endpoints")
            assert {e["shard_id"]: e["role"] for m in eps for e in m["endpoints"]} == {
                "m-prefill-r1-s0": "prefill",
                "m-decode-r1-s0": "decode",
                "m-decode-r2-s0": "decode",
            }
            code, text = await asyncio.to_thread(
                cli, explain, model="m", output="table", all=False, api=api, token=None, **NO_TLS
            )
            assert code == 0, text
            assert "  prefill  1 wanted, 1 placed, 1 ready; engine sim" in text, text
            assert "  decode   2 wanted, 2 placed, 2 ready; engine sim" in text, text
            assert "  connector ExampleConnector, shared path /tmp/llmgw-kv" in text
            assert "m-decode-r2 (decode)  seq " in text

            # The decode pool shrinks; the prefill replica is left as it was.
            capsys.readouterr()
            assert await apply(tmp_path, catalog(decode=1), nats_url) == 0
            assert "model m: changed (disaggregation)" in capsys.readouterr().out
            rec = await wait_kv(
                js,
                "m",
                lambda r: r is not None and len(r.endpoints) == 2,
                "the retired decode replica gone from the record",
            )
            assert roles(rec, READY) == {"m-prefill-r1": "prefill", "m-decode-r1": "decode"}
            drained = [
                x.shard_id for a in agents for x in a.received if isinstance(x, c.DrainShard)
            ]
            assert drained == ["m-decode-r2-s0"]
            stops = [x.shard_id for a in agents for x in a.received if isinstance(x, c.StopShard)]
            assert stops == []

            await api_until(
                api,
                "/api/explain/m",
                lambda d: [p["placed"] for p in d["pools"]] == [1, 1],
                "one replica per pool",
            )
            common = dict(from_seq=0, to_seq=None, explain=None, strict=True, verbose=False)
            code, text = await asyncio.to_thread(
                cli, replay_cli, database_url=database_url, api=None, nats=None, **common
            )
            assert code == 0 and "3 decisions checked, 0 differ" in text, text
            raw = await asyncio.to_thread(apiclient.get_json, api, "/api/explain/m")
            decided = {d["replica_id"]: d["role"] for d in raw["decisions"]}
            assert decided == {
                "m-prefill-r1": "prefill",
                "m-decode-r1": "decode",
                "m-decode-r2": "decode",
            }
        finally:
            for a in agents:
                await a.stop()
