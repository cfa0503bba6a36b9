"""Autoscaling end to end: routers' demand reaches the leader, which scales a model.

One cluster of real processes (NATS, Postgres, a reconciler, an agent launching
sim engines, a router). A model declared with `autoscale: {min: 0, max: 2}`
starts with no replica; its first request waits in the router's admission
while the autoscaler starts one (ModelScaled from_zero) and then succeeds; load
beyond its capacity scales it to 2; idleness takes it back to 0. `llmgw explain`
shows each decision and `llmgw audit replay` re-derives them from the log.
"""

from __future__ import annotations

import openai
import pytest

from tests.e2e import clusterkit as ck

pytestmark = pytest.mark.e2e

AUTO = {
    "name": "auto",
    "autoscale": {
        "min": 0,
        "max": 2,
        "target": 0.5,
        "scale_up_after_seconds": 2,
        "scale_down_after_seconds": 6,
        "tolerance": 0.2,
    },
    "profile": {
        "engine": "sim",
        "model_ref": "sim/auto",
        "gpus_per_shard": 1,
        "max_num_seqs": 2,
        "engine_args": ["--itl-ms", "20", "--ttft-ms", "20"],
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ck.start_cluster(
        tmp_path_factory.mktemp("autoscale"),
        routers=1,
        agents=1,
        reconcilers=1,
        gpus="5x80GiB",  # 3 for the demo models, 2 for `auto` at its max
        env={"LLMGW_ACTOR__DRAIN_DEADLINE": "5"},
    )
    try:
        catalog = ck.demo_catalog(c)
        catalog["models"].append(AUTO)
        ck.apply_catalog(c, catalog)
        yield c
    finally:
        c.stop()


def explain(cluster) -> str:
    res = ck.cli(cluster, "explain", "auto", "--api", cluster.info["api_url"])
    assert res.returncode == 0, res.stderr
    return res.stdout


def ready(cluster) -> int:
    return len(ck.ready_endpoints(cluster, "auto"))


def test_a_first_request_waits_for_a_replica_and_succeeds(cluster):
    assert "auto: 0 replica(s) wanted" in ck.wait(
        lambda: (out := explain(cluster)) and "0 replica(s) wanted" in out and out,
        30,
        "the autoscaled model in the catalog",
    )
    assert ready(cluster) == 0
    client = openai.OpenAI(
        base_url=cluster.info["routers"][0],
        api_key=cluster.info["api_key"],
        max_retries=0,
        timeout=60,
    )
    resp = client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert resp.choices[0].message.content
    out = explain(cluster)
    assert "scaled 0 → 1" in out and "waiting and no replica" in out, out


def test_load_beyond_capacity_scales_up_to_max(cluster):
    with ck.Traffic(
        cluster.info["routers"], cluster.info["api_key"], "auto", concurrency=8, max_tokens=16
    ) as traffic:
        ck.wait(lambda: ready(cluster) == 2, 60, "a second ready replica of auto")
    assert traffic.failures == [], traffic.failures[:5]
    assert traffic.ok > 0
    out = explain(cluster)
    assert "scaled 1 → 2" in out and "over target 0.5" in out, out


def test_idle_scales_back_to_zero_by_draining(cluster):
    out = ck.wait(
        lambda: (text := explain(cluster)) and "auto: 0 replica(s) wanted" in text and text,
        90,
        "the autoscaler to take the idle model back to 0",
    )
    assert "→ 0" in out and "under 0.40" in out, out
    ck.wait(lambda: ready(cluster) == 0, 60, "auto's replicas to drain and stop")


def test_audit_replay_rederives_every_scaling_decision(cluster):
    res = ck.cli(cluster, "audit", "replay", "--api", cluster.info["api_url"], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "scaling decision(s) checked against the rule, 0 differ" in res.stdout, res.stdout
    res = ck.cli(cluster, "audit", "verify", "--database-url", cluster.info["database_url"])
    assert res.returncode == 0, res.stdout + res.stderr
