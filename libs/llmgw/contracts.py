"""The message contract: every message exchanged over NATS, as msgspec Structs.

This module is the single description of the wire format. JSON Schemas and the
AsyncAPI document in schemas/ are generated from it (`llmgw schemas export`),
never edited by hand.

Every top-level message carries a type tag (`type`), a schema version (`v`),
a unique id (`id`, also used as the JetStream `Nats-Msg-Id` for dedupe) and a
timestamp (`ts`, Unix seconds). `decode()` turns bytes into the right class or
raises `ContractError`; it never raises anything else, so a consumer can catch
one exception, dead-letter the message and carry on.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any, ClassVar, TypeVar, Union

import msgspec

SCHEMA_VERSION = 1


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> float:
    return time.time()


class ContractError(ValueError):
    """Bytes that are not a valid message of a known type (and why)."""

    def __init__(self, reason: str, raw: bytes = b""):
        super().__init__(reason)
        self.reason = reason
        self.raw = raw


class Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    """Base of every message: type tag, schema version, id, timestamp."""

    v: int = SCHEMA_VERSION
    id: str = msgspec.field(default_factory=new_id)
    ts: float = msgspec.field(default_factory=now)

    # Set on each concrete class: who publishes it and what it is for (AsyncAPI).
    publisher: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # Events only: the kind token of their subject (llmgw.evt.<channel>.<kind>...).
    subject_kind: ClassVar[str] = ""


# ---------------------------------------------------------------- inventory


class GpuInfo(msgspec.Struct, kw_only=True):
    """One GPU as NVML reports it. Keyed by UUID: NVML indices change across reboots."""

    uuid: str
    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str = ""
    compute_capability: str = ""
    nvlink_peers: list[str] = msgspec.field(default_factory=list)
    mig_mode: bool | None = None
    # How this GPU reaches each other GPU on the node (by UUID), in `nvidia-smi topo -m`
    # words: NV (NVLink), PIX, PXB, PHB, NODE, SYS. Empty where NVML cannot tell.
    topology: dict[str, str] = msgspec.field(default_factory=dict)


class HostInfo(msgspec.Struct, kw_only=True):
    hostname: str = ""
    cpu_count: int = 0
    memory_bytes: int = 0
    driver_version: str = ""
    cuda_version: str = ""
    os: str = ""
    # The address engines on this node are reachable at (routers dial it).
    address: str = "127.0.0.1"
    fake_gpus: bool = False


class ShardState(str, enum.Enum):
    PENDING = "pending"
    VALIDATING = "validating"
    LAUNCHING = "launching"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


TERMINAL_SHARD_STATES = frozenset({ShardState.STOPPED, ShardState.FAILED})


class ServingProfile(msgspec.Struct, kw_only=True):
    """How to run one replica of a model: engine, resources, placement constraints."""

    engine: str = "sim"  # vllm | sglang | sim
    model_ref: str = ""  # the engine's model id or path
    gpus_per_shard: int = 1  # tensor parallel size
    min_gpu_memory_bytes: int = 0
    shards_per_replica: int = 1  # >1: one replica spans several nodes (multi-node)
    selector: dict[str, str] = msgspec.field(default_factory=dict)
    engine_args: list[str] = msgspec.field(default_factory=list)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None  # vLLM/SGLang share of GPU memory to use
    # LoRA adapter slots per engine (vLLM --max-loras); 0: the replicas serve no adapter.
    max_loras: int = 0
    max_lora_rank: int = 16  # the largest adapter rank the engine accepts (--max-lora-rank)


class ShardInfo(msgspec.Struct, kw_only=True):
    """A shard an agent runs: what registration and heartbeats report."""

    shard_id: str
    model: str
    replica_id: str
    shard_index: int = 0
    state: ShardState = ShardState.PENDING
    url: str = ""
    port: int = 0
    gpus: list[str] = msgspec.field(default_factory=list)  # GPU UUIDs
    pid: int | None = None


# ---------------------------------------------------------------- agent events


class NodeRegistered(Message, kw_only=True, tag="node.registered"):
    publisher: ClassVar[str] = "agent"
    subject_kind: ClassVar[str] = "registered"
    summary: ClassVar[str] = (
        "An agent (re)connected: its full inventory, labels and running shards."
    )

    node: str
    agent_version: str = ""
    gpus: dict[str, GpuInfo] = msgspec.field(default_factory=dict)  # by UUID
    host: HostInfo = msgspec.field(default_factory=HostInfo)
    labels: dict[str, str] = msgspec.field(default_factory=dict)  # fabric=..., zone=...
    engines: list[str] = msgspec.field(default_factory=list)  # engines this node can run
    shards: list[ShardInfo] = msgspec.field(default_factory=list)
    boot_id: str = ""  # changes on every agent process start


class Heartbeat(Message, kw_only=True, tag="node.heartbeat"):
    publisher: ClassVar[str] = "agent"
    summary: ClassVar[str] = "The agent is alive; the latest per node is kept."

    node: str
    boot_id: str = ""
    seq: int = 0
    shards: dict[str, ShardState] = msgspec.field(default_factory=dict)


class ShardStatus(Message, kw_only=True, tag="shard.status"):
    publisher: ClassVar[str] = "agent"
    subject_kind: ClassVar[str] = "shard"
    summary: ClassVar[str] = (
        "A shard moved to a new state (with exit code and output tail on failure)."
    )

    node: str
    shard_id: str
    model: str
    replica_id: str
    shard_index: int = 0
    state: ShardState
    url: str = ""
    port: int = 0
    gpus: list[str] = msgspec.field(default_factory=list)
    command_key: str = ""  # the command this transition answers, if any
    reason: str = ""
    exit_code: int | None = None
    output_tail: list[str] = msgspec.field(default_factory=list)
    max_running: int | None = None  # capacity hint for routers
    # The LoRA adapters the engine holds now (None: the agent does not report them, e.g.
    # a profile without adapter slots), and the engine's answer to each failed load.
    adapters: list[str] | None = None
    adapter_errors: dict[str, str] = msgspec.field(default_factory=dict)


# ---------------------------------------------------------------- catalog events


# The scheduling plugins a router has (llmgw.router.scheduling.pipeline FILTERS, SCORERS,
# PICKERS), which a model's `scheduling` may name: the catalog refuses any other at apply.
FILTER_NAMES = ("serves_model", "ready", "circuit", "adapter")
SCORER_NAMES = ("queue", "kv", "inflight", "prefix", "kv_prefix", "session", "lora_affinity")
PICKER_NAMES = ("max_score", "p2c", "weighted_random")


class SchedulingSpec(msgspec.Struct, kw_only=True):
    """The router's scheduling pipeline for one model: filters, weighted scorers, picker."""

    filters: list[str] = msgspec.field(default_factory=lambda: ["serves_model", "ready", "circuit"])
    # By default only signals that differ between routers or are exact: this router's own
    # requests in flight, and what the engines' KV events say they hold. `queue` and `kv`
    # read a load sample every router shares and that is up to `stale_after` old, so they
    # send every router's near-ties the same way until the next sample (docs/router.md).
    scorers: dict[str, float] = msgspec.field(
        default_factory=lambda: {"inflight": 1.0, "kv_prefix": 6.0}
    )
    picker: str = "max_score"  # max_score | p2c | weighted_random
    session_header: str = "x-session-id"
    # The model's tokenizer (a tokenizer.json, or a directory with one and its
    # tokenizer_config.json) for the kv_prefix scorer on vLLM and SGLang endpoints; "" = none.
    tokenizer: str = ""


class DeadlineSpec(msgspec.Struct, kw_only=True):
    """Separate deadlines in seconds; idle is the watchdog for a wedged engine."""

    connect: float = 2.0
    headers: float = 30.0
    first_token: float = 60.0
    idle: float = 30.0
    total: float = 600.0


# The API kinds a router relays (llmgw.router.request.kinds), which a model's `api_kinds` may name.
API_KINDS = (
    "chat",
    "completions",
    "embeddings",
    "responses",
    "transcriptions",
    "tokenize",
    "detokenize",
    "rerank",
    "score",
    "pooling",
    "classify",
)


class UpstreamSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Headers a router adds to every request it sends an engine (an engine API key for
    vLLM's --api-key, a routing tag). `secret_headers` name the router's environment
    variable that holds each value, so secrets never travel in events or records."""

    headers: dict[str, str] = msgspec.field(default_factory=dict)
    secret_headers: dict[str, str] = msgspec.field(default_factory=dict)  # header -> env var


AUTOSCALE_SIGNALS = ("load", "queue")  # what an autoscale target can be in


class AutoscaleSpec(msgspec.Struct, kw_only=True):
    """Replicas that follow demand, between `min` and `max` (docs/autoscale.md).

    `signal` is what `target` is in: `load` (requests in flight plus queued in
    admission, over the batch capacity of the ready replicas, summed over every
    router) or `queue` (requests waiting, in admission and in the engines' own
    queues, per ready replica). The count rises when the signal stays above
    `target` for `scale_up_after_seconds` and falls when it stays below
    target * (1 - tolerance) for `scale_down_after_seconds` (which is also the
    cool-down after any change).
    """

    min: int = 1
    max: int = 1
    target: float = 0.8
    scale_up_after_seconds: float = 30.0
    scale_down_after_seconds: float = 120.0
    tolerance: float = 0.2
    signal: str = "load"  # load | queue


class MigrationSpec(msgspec.Struct, kw_only=True):
    """Mid-stream migration (docs/router.md): a stream its engine cut after the first
    byte continues on another replica of the same model, from the prompt plus the text
    already sent, at most `max` times per request. 0 (the default): off, the stream
    ends with an in-band error event as before."""

    max: int = 0


# Disaggregated prefill/decode (docs/disaggregation.md): the role a replica of such a
# model plays. "" is an aggregated replica, which does both.
PD_ROLES = ("prefill", "decode")


class ConnectorSpec(msgspec.Struct, kw_only=True):
    """How prefill engines hand their KV cache to decode engines: a vLLM KV connector.

    `ExampleConnector` (vLLM's own, CPU-capable) writes each prompt's KV blocks under
    `shared_path`, which every prefill and decode node must see as the same folder, and
    finds them again by prompt content. `extra` is passed through as the connector's
    `kv_connector_extra_config` (NixlConnector and others take their settings there).
    """

    kind: str = "ExampleConnector"  # vLLM's kv_connector name
    shared_path: str = ""  # ExampleConnector's shared_storage_path
    extra: dict[str, str | int | float | bool] = msgspec.field(default_factory=dict)


class PoolSpec(msgspec.Struct, kw_only=True):
    """One pool (prefill or decode) of a disaggregated model: its count and profile."""

    replicas: int = 1
    autoscale: AutoscaleSpec | None = None  # set: the pool's count follows its own demand
    profile: ServingProfile | None = None  # None: the model's profile


class DisaggregationSpec(msgspec.Struct, kw_only=True):
    """A model served by separate prefill and decode pools (docs/disaggregation.md).

    A router sends a request's prompt to a prefill engine first (max_tokens 1, asking
    for remote decode), then the request with the returned `kv_transfer_params` to a
    decode engine, which loads the prompt's KV instead of computing it. A prompt shorter
    than `min_prompt_tokens` skips the prefill leg and is served by a decode engine alone.
    """

    prefill: PoolSpec = msgspec.field(default_factory=PoolSpec)
    decode: PoolSpec = msgspec.field(default_factory=PoolSpec)
    connector: ConnectorSpec = msgspec.field(default_factory=ConnectorSpec)
    min_prompt_tokens: int = 0


class ModelDeclared(Message, kw_only=True, tag="catalog.model.declared"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "model"
    summary: ClassVar[str] = "A model is (re)declared in the catalog with its serving profile."

    name: str
    aliases: list[str] = msgspec.field(default_factory=list)
    fallbacks: list[str] = msgspec.field(default_factory=list)
    replicas: int = 1
    profile: ServingProfile = msgspec.field(default_factory=ServingProfile)
    scheduling: SchedulingSpec = msgspec.field(default_factory=SchedulingSpec)
    deadlines: DeadlineSpec = msgspec.field(default_factory=DeadlineSpec)
    upstream: UpstreamSpec = msgspec.field(default_factory=UpstreamSpec)
    owned_by: str = ""  # what GET /v1/models says owns the model
    # The API kinds the model serves (chat, completions, embeddings, responses, rerank,
    # score, tokenize, detokenize, pooling, classify, transcriptions); empty: all.
    api_kinds: list[str] = msgspec.field(default_factory=list)
    # Set: the reconciler's autoscaler decides the count (ModelScaled events) and
    # `replicas` is only where it starts (`autoscale.min`).
    autoscale: AutoscaleSpec | None = None
    migration: MigrationSpec = msgspec.field(default_factory=MigrationSpec)
    # Set: the model is served by a prefill pool and a decode pool instead of
    # `replicas` aggregated replicas (which, with `autoscale`, must then be unset).
    disaggregation: DisaggregationSpec | None = None


class ModelRemoved(Message, kw_only=True, tag="catalog.model.removed"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "model"
    summary: ClassVar[str] = "A model left the catalog: its shards drain and stop."

    name: str


class Quotas(msgspec.Struct, kw_only=True, omit_defaults=True):
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute
    concurrency: int | None = None


# Whose prefix cache a tenant's requests may share (docs/admission.md, "Prefix cache
# isolation"): everyone's; only the tenant's own; only those sent with the same API key.
CACHE_ISOLATION = ("none", "tenant", "key")


class TenantDeclared(Message, kw_only=True, tag="catalog.tenant.declared"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "tenant"
    summary: ClassVar[str] = "A tenant is (re)declared: band, quotas and API key hashes."

    name: str
    band: str
    key_hashes: list[str] = msgspec.field(default_factory=list)  # "sha256:<hex>"
    quotas: Quotas = msgspec.field(default_factory=Quotas)
    cache_isolation: str = "none"  # one of CACHE_ISOLATION


class TenantRemoved(Message, kw_only=True, tag="catalog.tenant.removed"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "tenant"
    summary: ClassVar[str] = "A tenant left the catalog; its keys stop working."

    name: str


class AdapterDeclared(Message, kw_only=True, tag="catalog.adapter.declared"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "adapter"
    summary: ClassVar[str] = (
        "A LoRA adapter is (re)declared on a base model; requests may name it as their model."
    )

    name: str  # what requests put in `model`; unique among models, aliases and adapters
    base: str  # the base model's catalog name
    source: str  # where its engines load it from (vLLM's lora_path, a path on the node)
    tenants: list[str] = msgspec.field(default_factory=list)  # empty: every tenant
    pinned: int = 0  # replicas that hold it whatever the demand


class AdapterRemoved(Message, kw_only=True, tag="catalog.adapter.removed"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "adapter"
    summary: ClassVar[str] = "An adapter left the catalog: engines unload it, requests get 404."

    name: str


class Band(msgspec.Struct, kw_only=True):
    """A priority band: flows while pool saturation is below its ceiling."""

    name: str
    ceiling: float = 1.0  # > 1: never held back; 1.0: flow up to the healthy limit
    queue_capacity: int = 1000
    queue_ttl_seconds: float = 30.0


class BandsDeclared(Message, kw_only=True, tag="catalog.bands.declared"):
    publisher: ClassVar[str] = "operator"
    subject_kind: ClassVar[str] = "bands"
    summary: ClassVar[str] = "The priority bands, highest priority first."

    bands: list[Band]


# ---------------------------------------------------------------- control events


class NodeVerdict(msgspec.Struct, kw_only=True, gc=False):
    """Why a node could or could not take a shard, in words an operator reads."""

    node: str
    fits: bool
    reason: str


class VerdictGroup(msgspec.Struct, kw_only=True):
    """Nodes counted instead of listed (large fleets), all with one kind of reason."""

    fits: bool
    kind: str  # what every node of the group has in common, e.g. "no free GPU"
    count: int
    nodes: list[str]  # the first few of them by node id: examples, not all
    reason: str  # the first example's verdict, word for word
    same: bool = False  # every node of the group has exactly `reason`
    digest: str = ""  # of every member's node id: replay checks membership, not just count


class ShardAssignment(msgspec.Struct, kw_only=True):
    shard_id: str
    shard_index: int
    node: str
    gpus: list[str]  # GPU UUIDs on that node


class PlacementDecided(Message, kw_only=True, tag="control.placement.decided"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "placement"
    summary: ClassVar[str] = "A replica was placed; the explanation covers every candidate node."

    model: str
    replica_id: str
    based_on_seq: int
    assignments: list[ShardAssignment]
    verdicts: list[NodeVerdict] = msgspec.field(default_factory=list)
    # The nodes `verdicts` leaves out, grouped; empty: `verdicts` names every node.
    verdict_groups: list[VerdictGroup] = msgspec.field(default_factory=list)
    explanation: str = ""
    # True when the replica takes over shards a node already runs (a node that came
    # back): the shards keep their state, and replay checks them instead of re-placing.
    adopted: bool = False
    role: str = ""  # prefill | decode for a disaggregated model's pools; "": aggregated
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class PlacementFailed(Message, kw_only=True, tag="control.placement.failed"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "placement"
    summary: ClassVar[str] = "A replica could not be placed; each node's reason is recorded."

    model: str
    replica_id: str
    based_on_seq: int
    role: str = ""  # prefill | decode for a disaggregated model's pools; "": aggregated
    verdicts: list[NodeVerdict] = msgspec.field(default_factory=list)
    # The nodes `verdicts` leaves out, grouped; empty: `verdicts` names every node.
    verdict_groups: list[VerdictGroup] = msgspec.field(default_factory=list)
    explanation: str = ""
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class ReplicaRetired(Message, kw_only=True, tag="control.replica.retired"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "placement"
    summary: ClassVar[str] = (
        "A replica is no longer wanted (scale down, model removed): drain then stop."
    )

    model: str
    replica_id: str
    based_on_seq: int
    reason: str = ""
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class AdapterChange(msgspec.Struct, kw_only=True):
    """One step of an adapter placement: a replica loads or unloads an adapter, and why."""

    adapter: str
    replica_id: str
    action: str  # load | unload
    reason: str = ""


class AdaptersPlaced(Message, kw_only=True, tag="control.adapters.placed"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "adapters"
    summary: ClassVar[str] = (
        "Which replicas of a base model hold which LoRA adapters, from the routers' demand "
        "per adapter; the changes and the demand they were decided on are recorded."
    )

    model: str  # the base model
    # Every replica of the model that holds adapter slots -> the adapters it holds after
    # this decision (the whole set, not a diff: a replayed or missed event heals).
    holdings: dict[str, list[str]] = msgspec.field(default_factory=dict)
    changes: list[AdapterChange] = msgspec.field(default_factory=list)
    # per adapter: requests per second, smoothed (before 2026-12-04: plus requests waiting)
    demand: dict[str, float] = msgspec.field(default_factory=dict)
    based_on_seq: int = 0
    explanation: str = ""
    term: int = 0
    # Adapters with requests held in admission when it was decided (they are placed at
    # once): with `demand`, what replay re-derives the decision from.
    waiting: list[str] = msgspec.field(default_factory=list)
    # How many requests each of those had waiting: what a slot is taken for (placement.py).
    queued: dict[str, int] = msgspec.field(default_factory=dict)
    # The version of the placement rule that decided it (placement.POLICY): replay
    # re-derives only a decision of the rule it runs. 0: recorded before versions were.
    policy: int = 0
    # Seconds each queue's oldest request had waited (as the leader counts it): a queue's
    # claim on a slot grows with it (placement.py, policy 2 on).
    waited: dict[str, float] = msgspec.field(default_factory=dict)


class ScaleSignals(msgspec.Struct, kw_only=True):
    """One model's demand, combined over the live routers' summaries (docs/autoscale.md)."""

    load: float = 0.0  # (in_flight + queued) / capacity; 0 with no demand
    saturation: float = 0.0  # admission's pool saturation, unclamped, mean over routers
    queued: int = 0  # waiting in admission, all bands, all routers
    in_flight: int = 0  # granted and not finished, all routers
    oldest_wait_seconds: float = 0.0
    capacity: int = 0  # batch slots of the ready replicas (learned or declared)
    ready: int = 0  # ready replicas the routers route to
    routers: int = 0  # routers whose summaries were combined
    capacity_declared: bool = True  # every router saw a declared batch size on every replica
    waiting: int = 0  # waiting in the engines' own queues (their load samples)
    queue: float = 0.0  # (queued + waiting) / ready; 0 with no ready replica


class RouterInput(msgspec.Struct, kw_only=True):
    """One router's summary of one model, as the autoscaler combined it."""

    router_id: str
    process: int = 0
    demand: ModelDemand | None = None  # None: that router does not route the model


class ModelScaled(Message, kw_only=True, tag="control.model.scaled"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "scale"
    summary: ClassVar[str] = (
        "The autoscaler changed a model's replica count; the signals and the rule are recorded."
    )

    model: str
    from_replicas: int
    to_replicas: int
    rule: str  # scale_up | scale_down | from_zero
    signals: ScaleSignals = msgspec.field(default_factory=ScaleSignals)
    # How long the rule's condition held before it fired (seconds).
    sustained_seconds: float = 0.0
    based_on_seq: int = 0
    explanation: str = ""
    signal: str = "load"  # what the target was in (AutoscaleSpec.signal)
    # The summaries `signals` were combined from, by router id, at most 64 of
    # them (`signals.routers` says how many there were): replay combines them again.
    # Empty in events written before they were recorded.
    inputs: list[RouterInput] = msgspec.field(default_factory=list)
    # Seconds since the model's previous change, on the leader's monotonic clock (the
    # cool-down); None in older events, where replay compares the events' wall times.
    since_last_change_seconds: float | None = None
    term: int = 0
    # The pool of a disaggregated model whose count changed (prefill | decode); "": the
    # whole model's (and in events from before pools scaled).
    role: str = ""


class NodeUnreachable(Message, kw_only=True, tag="control.node.unreachable"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "node"
    summary: ClassVar[str] = "No heartbeat for unreachable_after seconds."

    node: str
    last_seen: float
    based_on_seq: int = 0
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class NodeLost(Message, kw_only=True, tag="control.node.lost"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "node"
    summary: ClassVar[str] = "No heartbeat for lost_after seconds: its shards count as gone."

    node: str
    last_seen: float
    based_on_seq: int = 0
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class NodeRecovered(Message, kw_only=True, tag="control.node.recovered"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "node"
    summary: ClassVar[str] = "Heartbeats returned from an unreachable or lost node."

    node: str
    based_on_seq: int = 0
    # The leader term that published it (0: before terms existed). The fold refuses a
    # control event of a term older than one it has already folded.
    term: int = 0


class TermStarted(Message, kw_only=True, tag="control.term.started"):
    publisher: ClassVar[str] = "reconciler"
    subject_kind: ClassVar[str] = "term"
    summary: ClassVar[str] = (
        "A reconciler became leader with this term; control events of older terms are refused."
    )

    term: int
    leader: str = ""  # the reconciler id that holds the term
    based_on_seq: int = 0  # the position the new leader loaded


# ---------------------------------------------------------------- commands


class StartShard(Message, kw_only=True, tag="cmd.shard.start"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = "Start one shard of a replica on the given GPUs."

    key: str  # idempotency key: the same key never starts twice
    node: str
    shard_id: str
    model: str
    replica_id: str
    shard_index: int = 0
    profile: ServingProfile
    gpus: list[str]
    served_model_name: str = ""
    # A disaggregated model's pool: the agent launches the engine with the connector
    # as kv_producer (prefill) or kv_consumer (decode). "": aggregated, no connector.
    role: str = ""
    connector: ConnectorSpec | None = None
    # Multi-node replicas: rank and rendezvous for engines that span nodes.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    # Fencing: the leader term that sent it and the node's boot it was meant for (the
    # agent's boot_id as last registered). An agent drops a command of an older term
    # than one it has seen, or for another boot ("" / 0: not fenced, older senders).
    term: int = 0
    boot_id: str = ""


class StopShard(Message, kw_only=True, tag="cmd.shard.stop"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = "Stop a shard: SIGTERM, then SIGKILL after the grace period."

    key: str
    node: str
    shard_id: str
    grace_seconds: float = 10.0
    # Fencing: the leader term that sent it and the node's boot it was meant for (the
    # agent's boot_id as last registered). An agent drops a command of an older term
    # than one it has seen, or for another boot ("" / 0: not fenced, older senders).
    term: int = 0
    boot_id: str = ""


class DrainShard(Message, kw_only=True, tag="cmd.shard.drain"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = "Drain a shard: report draining, wait for running requests, then stop."

    key: str
    node: str
    shard_id: str
    deadline_seconds: float = 60.0
    # Fencing: the leader term that sent it and the node's boot it was meant for (the
    # agent's boot_id as last registered). An agent drops a command of an older term
    # than one it has seen, or for another boot ("" / 0: not fenced, older senders).
    term: int = 0
    boot_id: str = ""


class AdapterSource(msgspec.Struct, kw_only=True):
    name: str
    source: str  # the path the engine loads it from


class SetShardAdapters(Message, kw_only=True, tag="cmd.shard.adapters"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = (
        "The whole set of LoRA adapters a shard's engine should hold: the agent loads what "
        "is missing and unloads the rest, then reports what the engine holds."
    )

    key: str
    node: str
    shard_id: str
    adapters: list[AdapterSource] = msgspec.field(default_factory=list)
    term: int = 0
    boot_id: str = ""


# ---------------------------------------------------------------- data plane


class LoadSample(Message, kw_only=True, tag="load.sample"):
    publisher: ClassVar[str] = "agent"
    summary: ClassVar[str] = (
        "An engine's load, scraped by its agent several times a second (core NATS)."
    )

    node: str
    shard_id: str
    model: str
    url: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    block_size: int = 0
    num_blocks: int = 0
    sampled_at: float = msgspec.field(default_factory=now)
    # From vLLM's vllm:lora_requests_info: adapters of running and of waiting requests.
    running_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_adapters: list[str] = msgspec.field(default_factory=list)


class KvOp(str, enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # every block is gone (hashes empty)


class KvBlockOp(msgspec.Struct, kw_only=True):
    """One change to an engine's cached block set, in engine order."""

    op: KvOp
    hashes: list[int] = msgspec.field(default_factory=list)  # canonical (llmgw.kvblocks)


class KvEvents(Message, kw_only=True, tag="kv.events"):
    publisher: ClassVar[str] = "agent"
    summary: ClassVar[str] = (
        "An engine's KV cache events, relayed in order by its agent with canonical block "
        "hashes (core NATS); seq_first..seq_last are the engine's own batch numbers."
    )

    node: str
    shard_id: str
    url: str = ""
    # Changes whenever the numbering starts over (a new relay or a new engine process).
    epoch: str
    seq_first: int
    seq_last: int
    block_size: int = 0
    ops: list[KvBlockOp] = msgspec.field(default_factory=list)


class KvSnapshotRequest(Message, kw_only=True, tag="kv.snapshot.request"):
    publisher: ClassVar[str] = "router"
    summary: ClassVar[str] = (
        "Request (core NATS request/reply): the engine's whole cached block set, to start "
        "from or to recover after a gap in its KV events."
    )

    node: str
    shard_id: str


class KvSnapshot(Message, kw_only=True, tag="kv.snapshot"):
    publisher: ClassVar[str] = "agent"
    summary: ClassVar[str] = (
        "Reply: an engine's cached blocks as of engine batch `seq` (events up to it included)."
    )

    node: str
    shard_id: str
    url: str = ""
    epoch: str
    seq: int  # -1: no engine batch yet
    block_size: int = 0
    hashes: list[int] = msgspec.field(default_factory=list)
    truncated: bool = False  # more blocks than fit in one message; the rest are left out


class EndpointState(str, enum.Enum):
    READY = "ready"
    DRAINING = "draining"


class Endpoint(msgspec.Struct, kw_only=True):
    id: str
    url: str
    node: str = ""
    replica_id: str = ""
    state: EndpointState = EndpointState.READY
    engine: str = "sim"
    max_running: int | None = None
    upstream: UpstreamSpec = msgspec.field(default_factory=UpstreamSpec)
    max_loras: int = 0  # adapter slots; 0: serves no adapter
    adapters: list[str] = msgspec.field(default_factory=list)  # held now, as its agent reports
    role: str = ""  # prefill | decode (a disaggregated model's pools); "": aggregated


class AdapterRoute(msgspec.Struct, kw_only=True):
    """A declared adapter of the model, as routers see it."""

    name: str
    tenants: list[str] = msgspec.field(default_factory=list)  # empty: every tenant


class ModelEndpoints(Message, kw_only=True, tag="projection.model"):
    """The per-model record routers watch: where to send, and how to decide."""

    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = (
        "Per-model endpoint set with aliases, fallbacks and scheduling settings."
    )

    model: str
    endpoints: list[Endpoint] = msgspec.field(default_factory=list)
    aliases: list[str] = msgspec.field(default_factory=list)
    fallbacks: list[str] = msgspec.field(default_factory=list)
    scheduling: SchedulingSpec = msgspec.field(default_factory=SchedulingSpec)
    deadlines: DeadlineSpec = msgspec.field(default_factory=DeadlineSpec)
    based_on_seq: int = 0
    upstream: UpstreamSpec = msgspec.field(default_factory=UpstreamSpec)
    owned_by: str = ""
    api_kinds: list[str] = msgspec.field(default_factory=list)  # empty: every kind
    max_model_len: int | None = None  # the serving profile's, when it sets one
    # Autoscaled: with no ready endpoint a request waits in admission (up to its band's
    # queue TTL) while a replica starts, instead of failing at once.
    scale_from_zero: bool = False
    # Why the model's next replica cannot be placed now (empty: nothing is failing);
    # a request that would wait for it gets 503 with Retry-After instead.
    unplaceable: str = ""
    # The leader term that wrote it: a router ignores a record of an older term (or of
    # the same term and an older based_on_seq) than the one it holds for the key.
    term: int = 0
    adapters: list[AdapterRoute] = msgspec.field(default_factory=list)  # declared on this base
    migration: MigrationSpec = msgspec.field(default_factory=MigrationSpec)
    # Set: the endpoints carry roles and routers run the two-leg prefill/decode
    # protocol (docs/disaggregation.md); None: every endpoint serves whole requests.
    disaggregation: DisaggregationSpec | None = None


class TenantRecord(Message, kw_only=True, tag="projection.tenant"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = "One tenant as routers see it."

    name: str
    band: str
    key_hashes: list[str] = msgspec.field(default_factory=list)
    quotas: Quotas = msgspec.field(default_factory=Quotas)
    cache_isolation: str = "none"  # one of CACHE_ISOLATION
    # The leader term that wrote it: a router ignores a record of an older term (or of
    # the same term and an older based_on_seq) than the one it holds for the key.
    term: int = 0


class BandsRecord(Message, kw_only=True, tag="projection.bands"):
    publisher: ClassVar[str] = "reconciler"
    summary: ClassVar[str] = "The priority bands as routers see them."

    bands: list[Band] = msgspec.field(default_factory=list)
    # The leader term that wrote it: a router ignores a record of an older term (or of
    # the same term and an older based_on_seq) than the one it holds for the key.
    term: int = 0


class BandDemand(msgspec.Struct, kw_only=True):
    queued: int = 0
    oldest_wait_seconds: float = 0.0


class AdapterDemand(msgspec.Struct, kw_only=True):
    """What one router sees of one adapter's demand."""

    requests: int = 0  # arrived since the router's previous summary
    in_flight: int = 0
    waiting: int = 0  # held in admission because no replica holds the adapter


class PoolDemand(msgspec.Struct, kw_only=True):
    """What one router sees of one pool (prefill | decode) of a disaggregated model: its
    endpoints' share of the model's demand. Admission's queue is the model's, not a pool's
    (a queued request will take the decode leg, and the prefill leg too unless its prompt
    is short), so each pool reads it from ModelDemand.queued."""

    in_flight: int = 0  # requests on this pool's endpoints (prefill legs, or decode legs)
    capacity: int = 0  # batch slots of the pool's ready endpoints
    ready: int = 0  # the pool's ready endpoints
    capacity_declared: bool = True
    waiting: int = 0  # waiting in the pool's engines' own queues


class ModelDemand(msgspec.Struct, kw_only=True):
    """What one router sees of one model's demand right now."""

    in_flight: int = 0  # granted by admission (or dispatched) and not finished
    queued: dict[str, BandDemand] = msgspec.field(default_factory=dict)  # by band
    saturation: float = 0.0  # as admission computes it, before clamping to 1
    capacity: int = 0  # batch slots of the ready endpoints (whole engines, not a share)
    ready: int = 0  # ready endpoints
    # Every ready endpoint declares its batch size (max_running); False: some capacity is
    # only learned, the most the engine has run so far, which says nothing of what it could.
    capacity_declared: bool = True
    waiting: int = 0  # requests the engines' latest fresh load samples show waiting
    adapters: dict[str, AdapterDemand] = msgspec.field(default_factory=dict)  # by adapter
    # A disaggregated model's pools by role (prefill, decode); empty for any other model.
    pools: dict[str, PoolDemand] = msgspec.field(default_factory=dict)


class DemandSummary(Message, kw_only=True, tag="demand.summary"):
    publisher: ClassVar[str] = "router"
    summary: ClassVar[str] = (
        "A router's per-model demand, about once a second (core NATS): the autoscaler's input."
    )

    router_id: str
    # The worker process (pid): the workers of one router share its id but each sees
    # its own requests, so the leader keeps a summary per (router_id, process).
    process: int = 0
    models: dict[str, ModelDemand] = msgspec.field(default_factory=dict)


class RouterPresence(Message, kw_only=True, tag="presence.router"):
    publisher: ClassVar[str] = "router"
    summary: ClassVar[str] = (
        "A live router, kept with a TTL; routers divide global quotas by the count."
    )

    router_id: str
    started_at: float = msgspec.field(default_factory=now)


# ---------------------------------------------------------------- codec

# Which messages travel together, by channel: the one table that the unions below,
# ALL_MESSAGES, subjects.subject_for and the AsyncAPI channels are derived from. A new
# message goes here (and its channel's address into llmgw.subjects), nowhere else.
CHANNELS: dict[str, tuple[type[Message], ...]] = {
    "agentEvents": (NodeRegistered, ShardStatus),
    "catalogEvents": (
        ModelDeclared,
        ModelRemoved,
        TenantDeclared,
        TenantRemoved,
        BandsDeclared,
        AdapterDeclared,
        AdapterRemoved,
    ),
    "controlEvents": (
        PlacementDecided,
        PlacementFailed,
        ReplicaRetired,
        ModelScaled,
        AdaptersPlaced,
        NodeUnreachable,
        NodeLost,
        NodeRecovered,
        TermStarted,
    ),
    "heartbeats": (Heartbeat,),
    "commands": (StartShard, StopShard, DrainShard, SetShardAdapters),
    "loadSamples": (LoadSample,),
    "kvEvents": (KvEvents,),
    "kvSnapshots": (KvSnapshotRequest, KvSnapshot),
    "endpointProjection": (ModelEndpoints,),
    "tenantProjection": (TenantRecord, BandsRecord),
    "routerPresence": (RouterPresence,),
    "demandSummaries": (DemandSummary,),
}


def _union(channel: str) -> Any:
    return Union[CHANNELS[channel]]  # type: ignore[valid-type]


AgentEvent = _union("agentEvents")
CatalogEvent = _union("catalogEvents")
ControlEvent = _union("controlEvents")
Command = _union("commands")

ALL_MESSAGES: tuple[type[Message], ...] = tuple(m for ms in CHANNELS.values() for m in ms)
CHANNEL_OF: dict[type[Message], str] = {m: ch for ch, ms in CHANNELS.items() for m in ms}

AnyMessage = Union[ALL_MESSAGES]  # type: ignore[valid-type]
EventMessage = Union[AgentEvent, CatalogEvent, ControlEvent]

_encoder = msgspec.json.Encoder()
_any_decoder = msgspec.json.Decoder(AnyMessage)
_decoders: dict[Any, msgspec.json.Decoder] = {}

M = TypeVar("M", bound=Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes, kind: Any = None) -> Any:
    """Decode bytes into a message; `kind` narrows the accepted types (a class or Union).

    Raises ContractError for malformed bytes, unknown types, wrong field types,
    or a schema version newer than this code understands.
    """
    if kind is None:
        decoder = _any_decoder
    else:
        decoder = _decoders.get(kind)
        if decoder is None:
            decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        msg = decoder.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError subclasses DecodeError
        raise ContractError(str(exc), raw) from None
    except Exception as exc:  # pragma: no cover - msgspec raises only the above
        raise ContractError(f"undecodable: {exc}", raw) from None
    if msg.v > SCHEMA_VERSION:
        raise ContractError(
            f"schema version {msg.v} is newer than supported ({SCHEMA_VERSION})", raw
        )
    return msg


def type_tag(cls: type[Message]) -> str:
    return cls.__struct_config__.tag  # type: ignore[return-value]
