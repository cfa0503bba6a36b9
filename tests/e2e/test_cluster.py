"""The mission end to end: a whole cluster of real processes over real sockets.

One cluster (what `llmgw dev` runs: NATS, Postgres, two reconcilers, two
agents launching sim engines, two routers) serves every test in this module,
in order, each one a fault or change an operator lives through. Traffic runs
through both routers with the official openai SDK (retries off) during each
fault, and the tests assert that no request failed.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from llmgw.agent import procs as engine_procs
from llmgw.agent.state import StateDir
from tests.e2e import clusterkit as ck
from tests.unit.test_agent_telemetry import samples, value

pytestmark = pytest.mark.e2e

# Short liveness timings so a killed agent becomes lost within seconds; yet a node
# must survive the NATS restart below: the leader judges no silence while its own
# connection is down, but counts it from its reconnect, so each agent must reconnect
# and heartbeat within unreachable_after of that, or its replicas are moved.
ENV = {
    "LLMGW_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "LLMGW_ACTOR__UNREACHABLE_AFTER": "3",
    "LLMGW_ACTOR__LOST_AFTER": "8",
    "LLMGW_ACTOR__COMMAND_RETRY_INITIAL": "0.5",
    "LLMGW_ACTOR__REPLACE_BACKOFF_INITIAL": "0.5",
    "LLMGW_ACTOR__DRAIN_DEADLINE": "10",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ck.start_cluster(tmp_path_factory.mktemp("cluster"), env=ENV)
    try:
        yield c
    finally:
        c.stop()


def client(cluster, i: int = 0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=cluster.info["routers"][i],
        api_key=cluster.info["api_key"],
        max_retries=0,
        timeout=20,
    )


def engine_records(cluster, agent: str | None = None) -> list:
    """What the agents recorded about the engines they launched."""
    out = []
    for name in (agent,) if agent else ("agent-1", "agent-2"):
        out += StateDir(ck.Path(cluster.info["data_dir"]) / name).load_all()
    return out


def wait_router_urls(cluster, model: str, expected: set[str], timeout: float = 30) -> None:
    """Until every router would send `model` to exactly these engine URLs."""

    def converged():
        return all(
            ck.router_endpoint_urls(a, model) == expected for a in cluster.info["router_admin"]
        )

    ck.wait(converged, timeout, f"routers to converge on {len(expected)} endpoints of {model}")


def ready_urls(cluster, model: str) -> set[str]:
    return {e["url"].rstrip("/") for e in ck.ready_endpoints(cluster, model)}


def test_cluster_json_says_where_everything_is(cluster):
    info = json.loads((ck.Path(cluster.info["data_dir"]) / "cluster.json").read_text())
    assert len(info["routers"]) == 2 and all(u.endswith("/v1") for u in info["routers"])
    assert info["api_key"] and info["nats_url"].startswith("nats://")
    assert info["database_url"] and info["api_url"].startswith("http://")
    assert {"agent-1", "agent-2", "reconciler-1", "reconciler-2", "router-1", "router-2"} <= set(
        info["processes"]
    )
    for pid in info["processes"].values():
        os.kill(pid, 0)  # every process it names is alive
    # Each agent's admin listener: ready, and together they run the demo's three shards.
    ready = 0.0
    for base in info["agent_admin"]:
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
        page = samples(httpx.get(f"{base}/metrics", timeout=5).text)
        ready += value(page, "llmgw_agent_shards", state="ready") or 0
    assert len(info["agent_admin"]) == 2 and ready == 3


def test_declared_models_are_served_through_both_routers(cluster):
    for i in (0, 1):
        c = client(cluster, i)
        names = {m.id for m in c.models.list().data}
        assert {"demo-chat", "demo-small", "demo-chat-latest"} <= names
        resp = c.chat.completions.create(
            model="demo-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert resp.choices[0].message.content and resp.usage.completion_tokens == 5
        chunks = list(
            c.chat.completions.create(
                model="demo-chat-latest",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[-1].usage.completion_tokens == 5
        comp = c.completions.create(model="demo-small", prompt="once upon", max_tokens=3)
        assert comp.choices[0].text
    # Replicas of one model spread over both nodes.
    nodes = {e["node"] for e in ck.ready_endpoints(cluster, "demo-chat")}
    assert nodes == {"node-1", "node-2"}


def test_a_request_without_a_key_is_refused(cluster):
    c = openai.OpenAI(base_url=cluster.info["routers"][0], api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(
            model="demo-chat", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def test_scale_up_and_down_under_traffic_drains_before_stop(cluster):
    catalog = ck.demo_catalog(cluster)
    with ck.Traffic(
        cluster.info["routers"], cluster.info["api_key"], "demo-chat", concurrency=6
    ) as traffic:
        catalog["models"][0]["replicas"] = 3
        ck.apply_catalog(cluster, catalog)
        ck.wait(
            lambda: len(ready_urls(cluster, "demo-chat")) == 3, 60, "a third replica to be ready"
        )
        wait_router_urls(cluster, "demo-chat", ready_urls(cluster, "demo-chat"))
        time.sleep(1)
        catalog["models"][0]["replicas"] = 1
        ck.apply_catalog(cluster, catalog)
        ck.wait(lambda: len(ready_urls(cluster, "demo-chat")) == 1, 60, "scale down to one replica")
        wait_router_urls(cluster, "demo-chat", ready_urls(cluster, "demo-chat"))
        time.sleep(1)
    assert traffic.ok > 20
    assert traffic.failures == [], traffic.failures[:5]
    # Scale-down drained before it stopped: the log shows draining, then stopped, per retired shard.
    res = ck.cli(cluster, "events", "export", "--from-seq", "1", "--api", cluster.info["api_url"])
    assert res.returncode == 0, res.stderr
    states: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        ev = json.loads(line)
        payload = ev.get("event") or ev
        if payload.get("type") == "shard.status" and payload.get("model") == "demo-chat":
            states.setdefault(payload["shard_id"], []).append(payload["state"])
    stopped = [sid for sid, seq in states.items() if "stopped" in seq]
    assert len(stopped) >= 2
    for sid in stopped:
        seq = states[sid]
        assert "draining" in seq and seq.index("draining") < seq.index("stopped"), (sid, seq)
    catalog["models"][0]["replicas"] = 2
    ck.apply_catalog(cluster, catalog)
    ck.wait(lambda: len(ready_urls(cluster, "demo-chat")) == 2, 60, "back to two replicas")


def test_an_engine_that_crashes_is_reported_with_its_output_and_replaced(cluster):
    rec = next(
        r for r in engine_records(cluster) if r.model == "demo-small" and r.state.value == "ready"
    )
    assert engine_procs.is_alive(rec.pid, rec.proc_start, rec.kernel_boot_id)
    os.killpg(rec.pid, signal.SIGKILL)

    def failed_status():
        res = ck.cli(
            cluster, "events", "export", "--from-seq", "1", "--api", cluster.info["api_url"]
        )
        for line in res.stdout.splitlines():
            p = json.loads(line)
            p = p.get("event") or p
            if (
                p.get("type") == "shard.status"
                and p.get("shard_id") == rec.shard_id
                and p.get("state") == "failed"
            ):
                return p
        return None

    failed = ck.wait(failed_status, 30, "the crash to be reported")
    assert failed["exit_code"] == -9 and failed["output_tail"]
    ck.wait(
        lambda: {e["shard_id"] for e in ck.ready_endpoints(cluster, "demo-small")} - {rec.shard_id},
        60,
        "a replacement engine",
    )
    c = client(cluster)
    ck.wait(
        lambda: c.chat.completions.create(
            model="demo-small", messages=[{"role": "user", "content": "x"}], max_tokens=2
        ),
        30,
        "demo-small served again",
    )


def test_killing_the_leader_reconciler_under_traffic_fails_no_request(cluster):
    leader = ck.wait(lambda: ck.leader_api(cluster), 10, "a leader")
    name = "reconciler-1" if leader == cluster.info["api_urls"][0] else "reconciler-2"
    survivor = [u for u in cluster.info["api_urls"] if u != leader][0]
    with ck.Traffic(
        cluster.info["routers"], cluster.info["api_key"], "demo-chat", concurrency=4
    ) as traffic:
        time.sleep(0.5)
        cluster.group.children[name].kill9()
        ck.wait(lambda: ck.leader_api(cluster) == survivor, 20, "the standby to lead")
        cluster.info["api_url"] = survivor
        # The new leader acts: a change still goes all the way through.
        catalog = ck.demo_catalog(cluster)
        catalog["models"][1]["replicas"] = 2
        ck.apply_catalog(cluster, catalog)
        ck.wait(lambda: len(ready_urls(cluster, "demo-small")) == 2, 60, "the new leader to place")
        time.sleep(1)
    assert traffic.ok > 10 and traffic.failures == [], traffic.failures[:5]
    res = ck.cli(cluster, "audit", "verify", "--database-url", cluster.info["database_url"])
    assert res.returncode == 0, res.stdout + res.stderr


def test_restarting_nats_under_traffic_routers_keep_serving_and_reconnect(cluster):
    with ck.Traffic(
        cluster.info["routers"], cluster.info["api_key"], "demo-chat", concurrency=4
    ) as traffic:
        time.sleep(0.5)
        cluster.nats.stop()
        time.sleep(2)  # routers serve from their last view while the bus is down
        cluster.nats.start()
        time.sleep(1)
    assert traffic.ok > 10 and traffic.failures == [], traffic.failures[:5]
    # Everyone reconnected: a catalog change reaches both routers.
    catalog = ck.demo_catalog(cluster)
    catalog["models"][1]["replicas"] = 1
    ck.apply_catalog(cluster, catalog)
    ck.wait(lambda: len(ready_urls(cluster, "demo-small")) == 1, 60, "scale down after the restart")
    wait_router_urls(cluster, "demo-small", ready_urls(cluster, "demo-small"))


def test_killing_an_agent_moves_its_replicas_and_explain_says_why(cluster):
    # Which node runs what depends on the faults before (the NATS restart can outlast the
    # short liveness timings here, so a node may have been lost and emptied): kill a node
    # that serves demo-chat now, node-2 when it does.
    ck.wait(lambda: len(ready_urls(cluster, "demo-chat")) == 2, 60, "two demo-chat replicas")
    serving = {e["node"] for e in ck.ready_endpoints(cluster, "demo-chat")}
    dead, alive = ("node-2", "node-1") if "node-2" in serving else ("node-1", "node-2")
    agent = f"agent-{dead.removeprefix('node-')}"
    victims = [r for r in engine_records(cluster, agent) if r.state.value == "ready"]
    assert victims, f"{agent} runs no engine"
    cluster.group.children[agent].kill9()
    # Its engines keep answering: they belong to the node, not to the agent process.
    for rec in victims:
        assert httpx.get(f"{rec.url}/health", timeout=10).status_code == 200

    def node_lost():
        return any(
            n.get("node") == dead and n.get("liveness") == "lost"
            for n in ck._list(ck.api(cluster, "/api/nodes"))
        )

    ck.wait(node_lost, 30, f"{dead} to be lost")
    ck.wait(
        lambda: (
            {e["node"] for e in ck.ready_endpoints(cluster, "demo-chat")} == {alive}
            and len(ck.ready_endpoints(cluster, "demo-chat")) == 2
        ),
        60,
        f"demo-chat re-placed on {alive}",
    )
    res = ck.cli(cluster, "explain", "demo-chat", "--api", cluster.info["api_url"])
    assert res.returncode == 0, res.stderr
    assert dead in res.stdout and "lost" in res.stdout
    wait_router_urls(cluster, "demo-chat", ready_urls(cluster, "demo-chat"))
    c = client(cluster, 1)
    assert c.chat.completions.create(
        model="demo-chat", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )


def test_audit_replay_over_the_whole_run_shows_no_difference(cluster):
    res = ck.cli(cluster, "audit", "replay", "--api", cluster.info["api_url"], timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    res = ck.cli(cluster, "audit", "verify", "--database-url", cluster.info["database_url"])
    assert res.returncode == 0, res.stdout + res.stderr
