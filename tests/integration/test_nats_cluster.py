"""The event log on a real distributed bus: a 3-node JetStream cluster on loopback loses
the node that leads LLMGW_EVENTS under traffic.

Three nats-server processes form the cluster; streams and buckets are provisioned
with three replicas, as every process is told (LLMGW_BUS__REPLICAS=3). A `llmgw
reconciler` process folds the log into a fresh database while the test publishes
events in windows. A third of the way in, the stream's leader is killed with SIGKILL.
Publishes fail until the other two elect a leader (seconds); `bus.publish` retries
them with the same Nats-Msg-Id. In the end every published event is in the archive
exactly once, nothing was dead-lettered as a duplicate, the stream holds no more
messages than the archive, and the fold went on past the kill without the reconciler
giving up its leadership (its fetches ride out the election).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmgw import bus, procs
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev import servers as localservers
from llmgw.reconciler.store import schema

pytestmark = pytest.mark.e2e

EVENTS = 900
WINDOW = 15
CONFIG = """
leader: {retry_interval_seconds: 0.2, check_interval_seconds: 0.5}
fold: {batch_size: 100, fetch_wait_seconds: 0.2}
api_auth: none  # loopback; this test reads the API, it is not about access
"""


def registration(i: int) -> c.NodeRegistered:
    node = f"n{i % 30}"
    gpu = c.GpuInfo(uuid=f"GPU-{node}", index=0, name="H200", memory_bytes=141 << 30)
    return c.NodeRegistered(node=node, gpus={gpu.uuid: gpu}, labels={"round": str(i)})


class Api:
    def __init__(self, base: str):
        self.http = httpx.AsyncClient(base_url=base, timeout=5)

    async def get(self, path: str, default=None):
        try:
            return (await self.http.get(path)).json()
        except (httpx.HTTPError, ValueError):
            return default

    async def folded(self) -> int:
        return (await self.get("/api/status", {})).get("folded_seq", -1)

    async def folded_at_least(self, seq: int) -> bool:
        return await self.folded() >= seq

    async def archive(self, last: int) -> list[dict]:
        """The archived events up to `last` (dead-lettered sequences are not in it)."""
        rows: list[dict] = []
        while True:
            after = rows[-1]["seq"] if rows else 0
            page = await self.get(f"/api/events?from_seq={after + 1}&limit=1000", [])
            rows += [row for row in page if row["seq"] <= last]
            if not page or page[-1]["seq"] >= last:
                return rows


async def until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.1)


async def stream_leader(js) -> str | None:
    try:
        info = await js.stream_info(s.EVENTS_STREAM)
    except Exception:  # no leader right now: the API request times out or is refused
        return None
    return info.cluster.leader if info.cluster else None


async def test_killing_the_stream_leader_loses_and_doubles_nothing(tmp_path, database_url):
    cluster = localservers.NatsCluster(tmp_path / "nats", 3).start()
    group = procs.Group()
    nc = None
    engine = schema.make_engine(database_url)
    try:
        await schema.upgrade(engine)
        nc = await bus.connect(cluster.url, "test", wait_for_server=False)
        js = nc.jetstream()
        await bus.provision(js, bus.BusConfig(replicas=3))
        cfg = tmp_path / "reconciler.yaml"
        cfg.write_text(CONFIG)
        port = localservers.free_port()
        group.start(
            "reconciler",
            procs.llmgw_argv(
                "reconciler", "--config", str(cfg), "--nats", cluster.url,
                "--database-url", database_url, "--admin-listen", f"127.0.0.1:{port}",
                "--id", "r1",
            ),
            env={"LLMGW_BUS__REPLICAS": "3"},
        )  # fmt: skip
        api = Api(f"http://127.0.0.1:{port}")

        async def leading():
            return (await api.get("/readyz", {})).get("role") == "leader"

        await until(leading, 30, "the reconciler to lead")
        info = await js.stream_info(s.EVENTS_STREAM)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2

        published = [registration(i) for i in range(EVENTS)]
        kill_at = EVENTS // 3
        under_way = asyncio.Event()

        async def publish_all():
            for start in range(0, EVENTS, WINDOW):
                if start == kill_at:
                    await under_way.wait()  # the rest goes out across the kill
                window = published[start : start + WINDOW]
                await asyncio.gather(*(bus.publish(js, ev, deadline=60) for ev in window))

        publisher = asyncio.create_task(publish_all())
        await until(lambda: api.folded_at_least(kill_at), 60, "the first third folded")
        leader = await stream_leader(js)
        assert leader in cluster.names
        under_way.set()
        await asyncio.sleep(0.05)  # a few windows in flight
        cluster.kill(cluster.index_of(leader))
        killed_at = time.monotonic()

        async def new_leader():
            now = await stream_leader(js)
            return now if now not in (None, leader) else None

        moved_to = await until(new_leader, 30, "a new stream leader")
        elected_after = time.monotonic() - killed_at
        await asyncio.wait_for(publisher, 120)

        async def caught_up():
            last = (await js.stream_info(s.EVENTS_STREAM)).state.last_seq
            return last if await api.folded() == last else None

        last = await until(caught_up, 60, "the fold to reach the end of the stream")
        print(
            f"stream leader {leader} killed; {moved_to} leads after {elected_after:.1f}s; "
            f"folded {kill_at} before the kill, {last} in the end"
        )
        assert last >= EVENTS  # the fold went on after the leader moved

        archive = await api.archive(last)
        dead = await api.get("/api/dead-letters?limit=1000", [])
        # Every sequence is archived or dead-lettered, exactly once (the two interleave).
        seqs = [row["seq"] for row in archive] + [d["seq"] for d in dead]
        assert sorted(seqs) == list(range(1, last + 1)), dead
        assert not [d for d in dead if "duplicate" in d["reason"]], dead
        counts: dict[str, int] = {}
        for row in archive:
            counts[row["id"]] = counts.get(row["id"], 0) + 1
        assert all(counts.get(ev.id) == 1 for ev in published), "an event was lost or doubled"
        # The reconciler rode out the election: it kept leading, no term ended.
        assert (await api.get("/readyz", {})).get("role") == "leader"
        assert "stepping down" not in group.children["reconciler"].output()
        await api.http.aclose()
    finally:
        group.stop(grace=10)
        await bus.close_quietly(nc)
        await engine.dispose()
        cluster.stop()


def test_dev_cluster_on_three_nats_nodes_keeps_serving_when_the_leader_node_dies(tmp_path):
    """`llmgw dev --nats-cluster 3`: routers keep serving through the KV projection while
    the node leading LLMGW_EVENTS dies, and the control loop works on the two left."""
    from tests.e2e import clusterkit as ck

    cluster = ck.start_cluster(tmp_path / "dev", routers=1, agents=1, reconcilers=1, nats_cluster=3)
    try:
        info = cluster.info
        assert len(info["nats_url"].split(",")) == 3 and info["nats_replicas"] == 3
        assert isinstance(cluster.nats, localservers.NatsCluster)

        async def leader_of_events() -> tuple[str, int]:
            nc = await bus.connect(info["nats_url"], "test", wait_for_server=False)
            try:
                stream = await nc.jetstream().stream_info(s.EVENTS_STREAM)
                return stream.cluster.leader, stream.config.num_replicas
            finally:
                await bus.close_quietly(nc)

        leader, replicas = asyncio.run(leader_of_events())
        assert replicas == 3
        with ck.Traffic(info["routers"], info["api_key"], "demo-chat", concurrency=4) as traffic:
            time.sleep(0.5)
            cluster.nats.kill(cluster.nats.index_of(leader))
            ck.wait(
                lambda: asyncio.run(leader_of_events())[0] not in (None, leader),
                30,
                "a new stream leader",
            )
            time.sleep(1)
        assert traffic.ok > 10 and traffic.failures == [], traffic.failures[:5]
        # The control loop runs on the two nodes left: a scale-up reaches the router.
        catalog = ck.demo_catalog(cluster)
        catalog["models"][1]["replicas"] = 2
        ck.apply_catalog(cluster, catalog)
        ck.wait(lambda: len(ck.ready_endpoints(cluster, "demo-small")) == 2, 60, "a scale-up")
        urls = {ep["url"] for ep in ck.ready_endpoints(cluster, "demo-small")}
        ck.wait(
            lambda: ck.router_endpoint_urls(info["router_admin"][0], "demo-small") == urls,
            30,
            "the router to see both replicas",
        )
    finally:
        cluster.stop()
