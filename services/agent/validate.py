"""Checks a StartShard before anything launches, so a bad profile fails in milliseconds
with a reason an operator can act on, not after minutes of model loading.

Pure: the facts about the node (inventory, GPUs held by shards, live NVML readings,
which engines and paths exist) are passed in.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llmgw import contracts as c
from llmgw.engines import ENGINES

from .launch import ADAPTERS, model_ref

GiB = 1 << 30


@dataclass(frozen=True)
class NodeFacts:
    node: str
    gpus: Mapping[str, c.GpuInfo]  # inventory by UUID
    gpu_holders: Mapping[str, str] = field(default_factory=dict)  # UUID -> shard id using it
    # Where NVML can tell (None otherwise): free memory and foreign compute processes per GPU.
    free_memory: Callable[[str], int | None] = lambda uuid: None
    process_count: Callable[[str], int | None] = lambda uuid: None
    # None when the engine can run here, else why not.
    engine_missing: Callable[[str], str | None] = lambda engine: None
    path_exists: Callable[[str], bool] = lambda path: True
    # None when an engine can write KV into this folder (made if missing), else why not.
    folder_unwritable: Callable[[str], str | None] = lambda path: None


class Refusal(str):
    """The reason an operator reads, tagged with the check that gave it: `check` is a short,
    bounded name (a metric label), the text is free."""

    check: str

    def __new__(cls, check: str, message: str) -> Refusal:
        self = super().__new__(cls, message)
        self.check = check
        return self


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~"))


def _adapter_slots_refusal(p: c.ServingProfile) -> Refusal | None:
    if p.max_loras < 0 or p.max_lora_rank < 1:
        return Refusal(
            "profile_range",
            f"profile.max_loras must be >= 0 and profile.max_lora_rank >= 1, got "
            f"{p.max_loras} and {p.max_lora_rank}",
        )
    if p.max_loras and ENGINES[p.engine].runtime_lora is None:
        return Refusal(
            "lora_unsupported",
            f"profile.max_loras is {p.max_loras} but the agent cannot load adapters into "
            f"{p.engine} engines at run time (vllm and sim can)",
        )
    return None


def _pd_role_refusal(cmd: c.StartShard) -> Refusal | None:
    """A prefill or decode shard needs an engine that takes part in disaggregation:
    checked before whether the engine is installed, as no install would mend it."""
    if not cmd.role:
        return None
    if cmd.role not in c.PD_ROLES:
        return Refusal(
            "pd_role", f"role must be one of {', '.join(c.PD_ROLES)} (or none), got {cmd.role!r}"
        )
    if ENGINES[cmd.profile.engine].pd_connector is None:
        able = ", ".join(n for n, t in ENGINES.items() if t.pd_connector)
        return Refusal(
            "pd_unsupported",
            f"a {cmd.role} shard needs an engine that serves disaggregated prefill/decode "
            f"({able}); {cmd.profile.engine} does not",
        )
    return None


def _connector_refusal(cmd: c.StartShard, facts: NodeFacts) -> Refusal | None:
    """An engine launched with the connector needs one, and a shared folder it can write."""
    trait = ENGINES[cmd.profile.engine].pd_connector
    if not cmd.role or trait is None or not trait.launch_flags:
        return None
    if cmd.connector is None:
        return Refusal("pd_connector", f"a {cmd.role} shard needs a connector, none was given")
    path = cmd.connector.shared_path
    if path and not posixpath.isabs(path):
        # The engine runs in the agent's state folder and expands no "~": a relative path
        # would name another folder there than on the other engines' nodes.
        return Refusal(
            "pd_connector", f"the connector's shared_path must be absolute, got {path!r}"
        )
    why = facts.folder_unwritable(path) if path else None
    if why:
        return Refusal(
            "pd_connector",
            f"the connector's shared folder {path} is not writable on node {facts.node}: {why}",
        )
    return None


def check(cmd: c.StartShard, facts: NodeFacts) -> Refusal | None:
    """None when the shard may launch, else the first reason it may not."""
    p = cmd.profile
    if p.engine not in ADAPTERS:
        return Refusal(
            "unknown_engine",
            f"unknown engine {p.engine!r} (this agent runs: {', '.join(sorted(ADAPTERS))})",
        )
    role = _pd_role_refusal(cmd)
    if role is not None:
        return role
    missing = facts.engine_missing(p.engine)
    if missing:
        return Refusal(
            "engine_missing", f"engine {p.engine} is not installed on this node: {missing}"
        )
    if p.gpus_per_shard < 1:
        return Refusal(
            "gpu_assignment", f"profile.gpus_per_shard must be at least 1, got {p.gpus_per_shard}"
        )
    if len(set(cmd.gpus)) != len(cmd.gpus):
        return Refusal("gpu_assignment", f"the same GPU is assigned twice: {cmd.gpus}")
    if len(cmd.gpus) != p.gpus_per_shard:
        return Refusal(
            "gpu_assignment",
            f"{len(cmd.gpus)} GPU(s) assigned but the tensor parallel size "
            f"(profile.gpus_per_shard) is {p.gpus_per_shard}",
        )
    for uuid in cmd.gpus:
        gpu = facts.gpus.get(uuid)
        if gpu is None:
            return Refusal("gpu_unknown", f"GPU {uuid} does not exist on node {facts.node}")
        holder = facts.gpu_holders.get(uuid)
        if holder is not None and holder != cmd.shard_id:
            return Refusal(
                "gpu_in_use", f"GPU {uuid} (index {gpu.index}) is in use by shard {holder}"
            )
        procs = facts.process_count(uuid)
        if procs:
            return Refusal(
                "gpu_busy",
                f"GPU {uuid} (index {gpu.index}) is busy: {procs} compute process(es) run on it",
            )
        need = p.min_gpu_memory_bytes
        if need and gpu.memory_bytes < need:
            return Refusal(
                "gpu_memory",
                f"GPU {uuid} (index {gpu.index}) has {_gib(gpu.memory_bytes)}, "
                f"the profile needs {_gib(need)} per GPU",
            )
        free = facts.free_memory(uuid)
        if need and free is not None and free < need:
            return Refusal(
                "gpu_memory",
                f"GPU {uuid} (index {gpu.index}) has only {_gib(free)} free, "
                f"the profile needs {_gib(need)} per GPU",
            )
    ref = model_ref(cmd)
    if not ref.strip():
        return Refusal(
            "model_ref", "no model reference: profile.model_ref and the model name are both empty"
        )
    if _looks_like_path(ref) and not facts.path_exists(ref):
        return Refusal("model_ref", f"model path {ref} does not exist on node {facts.node}")
    for name in ("max_model_len", "max_num_seqs"):
        value = getattr(p, name)
        if value is not None and value < 1:
            return Refusal("profile_range", f"profile.{name} must be positive, got {value}")
    gmu = p.gpu_memory_utilization
    if gmu is not None and not 0 < gmu <= 1:
        return Refusal(
            "profile_range", f"profile.gpu_memory_utilization must be in (0, 1], got {gmu}"
        )
    slots = _adapter_slots_refusal(p)
    if slots is not None:
        return slots
    folder = _connector_refusal(cmd, facts)
    if folder is not None:
        return folder
    if cmd.nnodes > 1:
        if not 0 <= cmd.node_rank < cmd.nnodes:
            return Refusal(
                "multi_node", f"node_rank {cmd.node_rank} is outside 0..{cmd.nnodes - 1}"
            )
        if not cmd.master_addr:
            return Refusal(
                "multi_node",
                f"a {cmd.nnodes}-node replica needs master_addr (the rank-0 node's address)",
            )
        if p.engine == "sglang" and not cmd.master_port:
            return Refusal(
                "multi_node", "a multi-node SGLang replica needs master_port (for --dist-init-addr)"
            )
    return None
