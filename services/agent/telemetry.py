"""The agent's own Prometheus series (`llmgw_agent_*`), served on its admin listener.

Counters are bumped where things happen (agent.py); gauges about the present
(shards by state, the NATS session, the inventory) are read from a `Live`
snapshot at scrape time, so they can never drift from what the agent holds.
Every label is bounded: kinds, reasons and check names are fixed sets, models
and GPUs are what this node runs and has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from llmgw import contracts as c

# Command kinds as labels; "unknown" for a message that did not decode.
COMMAND_KINDS: dict[type, str] = {
    c.StartShard: "start",
    c.StopShard: "stop",
    c.DrainShard: "drain",
    c.SetShardAdapters: "adapters",
}


@dataclass(frozen=True)
class Live:
    """What the agent holds right now, as the scrape sees it."""

    node: str
    version: str
    shards: list[tuple[str, c.ShardState]]  # (model, state) of every shard the agent knows
    nats_connected: bool
    registered: bool
    outbox: int  # shard status / registration messages not yet stored by JetStream
    heartbeat_age: float | None  # seconds since the last acknowledged heartbeat; None: none yet
    gpus: Mapping[str, c.GpuInfo]
    host: c.HostInfo


def live_families(live: Live) -> Iterator[Metric]:
    shards = GaugeMetricFamily(
        "llmgw_agent_shards",
        "Shards this agent knows, by model and state (finished ones until they are pruned)",
        labels=["model", "state"],
    )
    counts: dict[tuple[str, str], int] = {}
    for model, state in live.shards:
        for s in c.ShardState:  # every state of a model this node runs, zeros included
            counts.setdefault((model, s.value), 0)
        counts[(model, state.value)] += 1
    for (model, state), n in sorted(counts.items()):
        shards.add_metric([model, state], n)
    yield shards

    yield GaugeMetricFamily(
        "llmgw_agent_nats_connected", "1 while the NATS connection is up", int(live.nats_connected)
    )
    yield GaugeMetricFamily(
        "llmgw_agent_registered",
        "1 once the control plane acknowledged this connection's registration",
        int(live.registered),
    )
    yield GaugeMetricFamily(
        "llmgw_agent_outbox_messages",
        "Shard status and registration messages waiting to be stored by JetStream",
        live.outbox,
    )
    if live.heartbeat_age is not None:
        yield GaugeMetricFamily(
            "llmgw_agent_heartbeat_age_seconds",
            "Seconds since the last heartbeat JetStream acknowledged",
            live.heartbeat_age,
        )

    node = GaugeMetricFamily(
        "llmgw_agent_node_info",
        "This node: id, agent version, driver and CUDA versions, fake GPUs or not",
        labels=["node", "version", "driver_version", "cuda_version", "fake_gpus"],
    )
    h = live.host
    node.add_metric(
        [live.node, live.version, h.driver_version, h.cuda_version, str(h.fake_gpus).lower()], 1
    )
    yield node
    count = GaugeMetricFamily("llmgw_agent_gpus", "GPUs in this node's inventory", labels=["node"])
    count.add_metric([live.node], len(live.gpus))
    yield count
    info = GaugeMetricFamily(
        "llmgw_agent_gpu_info", "One series per GPU", labels=["node", "uuid", "index", "name"]
    )
    memory = GaugeMetricFamily(
        "llmgw_agent_gpu_memory_bytes", "Total memory of each GPU", labels=["node", "uuid"]
    )
    for gpu in sorted(live.gpus.values(), key=lambda g: g.index):
        info.add_metric([live.node, gpu.uuid, str(gpu.index), gpu.name], 1)
        memory.add_metric([live.node, gpu.uuid], gpu.memory_bytes)
    yield info
    yield memory


class _LiveCollector:
    def __init__(self, snapshot: Callable[[], Live]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from live_families(self.snapshot())


class AgentMetrics:
    """One agent's series, in a registry of its own (tests run several agents in a process)."""

    def __init__(self, snapshot: Callable[[], Live]):
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.commands_received = Counter(
            "llmgw_agent_commands_received_total",
            "Commands pulled from this node's consumer, by kind",
            ["kind"],
            registry=r,
        )
        self.commands_applied = Counter(
            "llmgw_agent_commands_applied_total",
            "Commands handled, by kind and what was done (answer: a repeat, nothing changed)",
            ["kind", "action"],
            registry=r,
        )
        self.commands_rejected = Counter(
            "llmgw_agent_commands_rejected_total",
            "Commands not applied, by kind and reason "
            "(malformed, wrong_node, stale_boot, stale_term, invalid, no_free_port, spawn_error, error)",
            ["kind", "reason"],
            registry=r,
        )
        self.validation_refusals = Counter(
            "llmgw_agent_validation_refusals_total",
            "StartShard commands refused before launch, by the check that refused",
            ["check"],
            registry=r,
        )
        self.engine_exits = Counter(
            "llmgw_agent_engine_exits_total",
            "Engines that ended, by reason (stopped when asked; the others are failures)",
            ["reason"],
            registry=r,
        )
        self.heartbeats = Counter(
            "llmgw_agent_heartbeats_published_total",
            "Heartbeats JetStream acknowledged",
            [],
            registry=r,
        )
        self.load_samples = Counter(
            "llmgw_agent_load_samples_published_total",
            "Load samples published (core NATS)",
            [],
            registry=r,
        )
        self.kv_batches = Counter(
            "llmgw_agent_kv_event_batches_published_total",
            "Engines' KV event batches relayed to the bus (core NATS)",
            [],
            registry=r,
        )
        self.kv_engine_gaps = Counter(
            "llmgw_agent_kv_engine_gaps_total",
            "Gaps in an engine's KV event sequence the relay could not repair by replay "
            "(events lost before it)",
            [],
            registry=r,
        )
        self.kv_replayed = Counter(
            "llmgw_agent_kv_engine_batches_replayed_total",
            "Engines' KV event batches the relay missed and got again from the engine's "
            "replay socket",
            [],
            registry=r,
        )
        self.kv_replay_failures = Counter(
            "llmgw_agent_kv_replay_failures_total",
            "KV event replay requests the engine did not answer in full by the deadline",
            [],
            registry=r,
        )
        self.publish_failures = Counter(
            "llmgw_agent_publish_failures_total",
            "Failed publishes, by what (status and registration are retried; "
            "heartbeats and load samples are not)",
            ["what"],
            registry=r,
        )
        self.adapter_ops = Counter(
            "llmgw_agent_adapter_operations_total",
            "Calls to engines' runtime LoRA API, by op (load, unload) and outcome "
            "(ok, retried: failed and tried again, failed: the last try failed)",
            ["op", "outcome"],
            registry=r,
        )
        self.reconnects = Counter(
            "llmgw_agent_nats_reconnects_total", "NATS reconnections", [], registry=r
        )
        r.register(_LiveCollector(snapshot))

    def text(self) -> bytes:
        return generate_latest(self.registry)
