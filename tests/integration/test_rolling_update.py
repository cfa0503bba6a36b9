"""A rolling update on real NATS and Postgres: what routers and operators see while it runs.

The real reconciler (Postgres fold, operator API) drives simulated agents that take
a moment to load a shard, so the roll is slow enough to be watched: every revision
of the model's router record is collected while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib

from llmgw import bus, projection
from llmgw import contracts as c
from llmgw.opcli import apiclient, explain
from llmgw.reconciler.state.model import profile_digest
from tests.integration.test_control_loop import (
    DEADLINE,
    SimAgent,
    real_reconciler,
    wait_kv,
)

S = c.ShardState
OLD = c.ServingProfile(engine="sim", max_model_len=4096)
NEW = c.ServingProfile(engine="sim", max_model_len=8192, engine_args=["--enable-prefix-caching"])


def ready_replicas(rec: c.ModelEndpoints | None) -> set[str]:
    # By replica, not URL: a new shard may get the port an old one just gave up.
    eps = rec.endpoints if rec else []
    return {e.replica_id for e in eps if e.state == c.EndpointState.READY}


async def api_until(api: str, path: str, pred, what: str):
    """Poll the operator API (it reads Postgres) until `pred(answer)` holds."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + DEADLINE
    while True:
        got = await asyncio.to_thread(apiclient.get_json, api, path)
        if pred(got):
            return got
        if loop.time() > stop_at:
            raise AssertionError(f"the operator API never showed {what}; last: {got}")
        await asyncio.sleep(0.05)


async def test_a_changed_profile_rolls_replicas_without_losing_a_ready_endpoint(nats, database_url):
    js = nats.jetstream()
    agents = [SimAgent(js, nats, f"node-{x}", n_gpus=2, load_seconds=0.4) for x in "ab"]
    async with real_reconciler(nats, database_url) as api:
        revisions: list[c.ModelEndpoints | None] = []
        watcher = None
        try:
            for a in agents:
                await a.start()
            await bus.publish(js, c.ModelDeclared(name="m", replicas=2, profile=OLD))
            await wait_kv(js, "m", lambda r: len(ready_replicas(r)) == 2, "two ready replicas")

            # Every revision of the router record from here on (the first is the current one).
            kv = await js.key_value(projection.ENDPOINTS_BUCKET)
            watcher = await kv.watch(projection.model_key("m"))

            async def collect() -> None:
                async for entry in watcher:
                    if entry is not None:
                        revisions.append(c.decode(entry.value) if entry.value else None)

            collecting = asyncio.create_task(collect())
            archived = await asyncio.to_thread(apiclient.get_json, api, "/api/status")
            since = archived["last_archived_seq"]
            before = await asyncio.to_thread(apiclient.get_json, api, "/api/replicas")
            old_ids = {r["replica_id"] for r in before if r["model"] == "m" and not r["retired"]}
            await bus.publish(js, c.ModelDeclared(name="m", replicas=2, profile=NEW))

            # Operators see the roll while it runs: the old replicas marked outdated.
            mid = await api_until(
                api,
                "/api/explain/m",
                lambda d: any(r["outdated"] for r in d["replicas"]),
                "an outdated replica",
            )
            assert mid["profile_digest"] == profile_digest(NEW)
            text = "\n".join(explain.render(mid))  # what `llmgw explain m` printed then
            assert "rolling update in progress: " in text and "(OUTDATED: " in text, text

            # Done: two replicas, both with the new profile, nothing of the old ones left.
            # (Not the old two still active with none retired yet: that is the roll's start,
            # and an API read can see it after explain already shows them outdated.)
            def finished(reps: list[dict]) -> bool:
                active = [r for r in reps if r["model"] == "m" and not r["retired"]]
                gone = all(
                    sh["state"] == "stopped" for r in reps if r["retired"] for sh in r["shards"]
                )
                fresh = not old_ids & {r["replica_id"] for r in active}
                ready = all(r["state"] == "ready" for r in active)
                return len(active) == 2 and fresh and ready and gone

            reps = await api_until(api, "/api/replicas", finished, "the roll finished")
            await wait_kv(js, "m", lambda r: r and len(r.endpoints) == 2, "only the new endpoints")
            await asyncio.sleep(0.2)  # any late revision is collected too
            events = await asyncio.to_thread(
                apiclient.get_json, api, f"/api/events?from_seq={since + 1}"
            )
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
        finally:
            if watcher is not None:
                await watcher.stop()
            for a in agents:
                await a.stop()

    active = {r["replica_id"]: r for r in reps if not r["retired"]}
    retired = {r["replica_id"]: r for r in reps if r["retired"]}
    assert sorted(active) == ["m-r3", "m-r4"] and sorted(retired) == ["m-r1", "m-r2"]
    assert {r["profile_digest"] for r in active.values()} == {profile_digest(NEW)}
    assert not any(r["outdated"] for r in reps)

    # Routers always had two ready replicas to send to, and saw each old one drain first.
    assert revisions and min(len(ready_replicas(r)) for r in revisions) >= 2, revisions
    assert max(len(r.endpoints) for r in revisions if r) == 3  # the surge was visible
    for rid in ("m-r1", "m-r2"):
        states = [e.state for r in revisions if r for e in r.endpoints if e.replica_id == rid]
        assert c.EndpointState.DRAINING in states
        assert states[-1] == c.EndpointState.DRAINING  # never ready again once draining

    # The engines were started with the new profile; the old shards drained, never
    # stopped outright (the agent stops a drained shard itself).
    received = [x for a in agents for x in a.received]
    for rid in ("m-r3", "m-r4"):
        starts = [x for x in received if isinstance(x, c.StartShard) and x.replica_id == rid]
        assert starts and all(x.profile == NEW for x in starts)
    for rid in ("m-r1", "m-r2"):
        kinds = [type(x).__name__ for x in received if x.shard_id == f"{rid}-s0"]
        assert list(dict.fromkeys(kinds)) == ["StartShard", "DrainShard"], kinds

    # The event log tells the story, in order.
    story = []
    for e in events:
        ev = e["event"]
        if e["type"] in ("control.placement.decided", "control.replica.retired"):
            story.append((e["type"].rsplit(".", 1)[1], ev["replica_id"], ev.get("reason", "")))
        elif e["type"] == "shard.status" and ev["state"] in ("ready", "draining", "stopped"):
            story.append((ev["state"], ev["replica_id"], ""))
        elif e["type"] == "control.placement.failed":
            story.append(("failed", ev["replica_id"], ev["explanation"]))
    rolled = "rolling update: profile changed since {} was placed"
    assert story == [
        ("decided", "m-r3", ""),
        ("ready", "m-r3", ""),
        ("retired", "m-r2", rolled.format("m-r2")),
        ("decided", "m-r4", ""),
        ("draining", "m-r2", ""),
        ("stopped", "m-r2", ""),
        ("ready", "m-r4", ""),
        ("retired", "m-r1", rolled.format("m-r1")),
        ("draining", "m-r1", ""),
        ("stopped", "m-r1", ""),
    ], story
