"""The agent's /metrics page: valid Prometheus text, gauges read from the live snapshot,
counters with bounded labels; validation refusals name the check that refused."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmgw import contracts as c
from llmgw.agent.telemetry import AgentMetrics, Live
from llmgw.agent.validate import GiB, NodeFacts, check

S = c.ShardState


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page (parsed by prometheus_client: invalid text raises)."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: dict, metric: str, /, **labels: str) -> float | None:
    """The sum of the samples of `metric` whose labels include `labels`; None when there is none."""
    found = [v for (n, ls), v in page.items() if n == metric and set(labels.items()) <= ls]
    return sum(found) if found else None


GPUS = {
    f"GPU-fake-n1-{i}": c.GpuInfo(
        uuid=f"GPU-fake-n1-{i}", index=i, name="H100", memory_bytes=80 * GiB
    )
    for i in range(2)
}


def live(**kw) -> Live:
    values = dict(
        node="n1",
        version="1.2.3",
        shards=[("llama", S.READY), ("llama", S.LOADING), ("qwen", S.FAILED)],
        nats_connected=True,
        registered=True,
        outbox=2,
        heartbeat_age=0.4,
        gpus=GPUS,
        host=c.HostInfo(fake_gpus=True),
    )
    values.update(kw)
    return Live(**values)


def test_gauges_come_from_the_live_snapshot():
    current = live()
    metrics = AgentMetrics(lambda: current)
    page = samples(metrics.text())
    assert value(page, "llmgw_agent_shards", model="llama", state="ready") == 1
    assert value(page, "llmgw_agent_shards", model="llama", state="loading") == 1
    # Every state of a model this node runs has a series, so rates and alerts see zeros.
    assert value(page, "llmgw_agent_shards", model="llama", state="failed") == 0
    assert value(page, "llmgw_agent_shards", model="qwen", state="failed") == 1
    assert value(page, "llmgw_agent_shards") == 3
    assert value(page, "llmgw_agent_nats_connected") == 1
    assert value(page, "llmgw_agent_registered") == 1
    assert value(page, "llmgw_agent_outbox_messages") == 2
    assert value(page, "llmgw_agent_heartbeat_age_seconds") == 0.4
    assert value(page, "llmgw_agent_gpus", node="n1") == 2
    assert value(page, "llmgw_agent_gpu_info", node="n1", index="1", name="H100") == 1
    assert value(page, "llmgw_agent_gpu_memory_bytes", uuid="GPU-fake-n1-0") == 80 * GiB
    assert value(page, "llmgw_agent_node_info", node="n1", version="1.2.3", fake_gpus="true") == 1

    # Read at every scrape: a change shows at once, and no heartbeat yet means no age series.
    current = live(shards=[], nats_connected=False, registered=False, heartbeat_age=None)
    page = samples(metrics.text())
    assert value(page, "llmgw_agent_shards") is None
    assert value(page, "llmgw_agent_nats_connected") == 0
    assert value(page, "llmgw_agent_registered") == 0
    assert value(page, "llmgw_agent_heartbeat_age_seconds") is None


def test_counters_are_labelled_and_each_agent_has_its_own():
    a, b = AgentMetrics(live), AgentMetrics(live)
    a.commands_received.labels("start").inc()
    a.commands_applied.labels("start", "launch").inc()
    a.commands_rejected.labels("unknown", "malformed").inc()
    a.engine_exits.labels("crashed").inc(2)
    a.publish_failures.labels("heartbeat").inc()
    page = samples(a.text())
    assert value(page, "llmgw_agent_commands_received_total", kind="start") == 1
    assert value(page, "llmgw_agent_commands_applied_total", kind="start", action="launch") == 1
    assert (
        value(page, "llmgw_agent_commands_rejected_total", kind="unknown", reason="malformed") == 1
    )
    assert value(page, "llmgw_agent_engine_exits_total", reason="crashed") == 2
    assert value(page, "llmgw_agent_publish_failures_total", what="heartbeat") == 1
    assert value(samples(b.text()), "llmgw_agent_commands_received_total") is None


def test_validation_refusals_name_their_check():
    def start(**profile) -> c.StartShard:
        prof = {"engine": "vllm", "model_ref": "org/m", "gpus_per_shard": 1, **profile}
        return c.StartShard(
            key="k",
            node="n1",
            shard_id="s",
            model="m",
            replica_id="r",
            profile=c.ServingProfile(**prof),
            gpus=["GPU-fake-n1-0"],
        )

    facts = NodeFacts(node="n1", gpus=GPUS)
    cases = {
        "unknown_engine": start(engine="tgi"),
        "gpu_assignment": start(gpus_per_shard=2),
        "gpu_memory": start(min_gpu_memory_bytes=141 * GiB),
        "profile_range": start(max_num_seqs=0),
    }
    for name, cmd in cases.items():
        refusal = check(cmd, facts)
        assert refusal is not None and refusal.check == name, (name, refusal)
    held = check(start(), NodeFacts(node="n1", gpus=GPUS, gpu_holders={"GPU-fake-n1-0": "x"}))
    assert held.check == "gpu_in_use" and "in use by shard x" in held
