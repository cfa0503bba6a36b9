"""Which engine command lines get KV events: SGLang only with pages of 16 tokens or more,
and no engine with data parallelism (its ranks offset the endpoint's port, which ipc has not)."""

from __future__ import annotations

import pytest

from llmgw import contracts as c
from llmgw.agent import launch
from llmgw.agent.launch import LaunchContext

RELAY = "tcp://127.0.0.1:9"
REPLAY = "tcp://127.0.0.1:10"


def argv(engine: str, engine_args: list[str]) -> list[str]:
    cmd = c.StartShard(
        key="k", node="n", shard_id="s", model="m", replica_id="r", gpus=[],
        profile=c.ServingProfile(engine=engine, model_ref="org/m", gpus_per_shard=1,
                                 engine_args=engine_args),
    )  # fmt: skip
    ctx = LaunchContext(
        port=8000, gpu_indices=[0], bind_host="h", command=[engine],
        kv_events_endpoint=RELAY, kv_replay_endpoint=REPLAY,
    )  # fmt: skip
    return launch.ADAPTERS[engine].build(cmd, ctx).argv


def has_events(engine: str, engine_args: list[str]) -> bool:
    return "--kv-events-config" in argv(engine, engine_args)


@pytest.mark.parametrize(
    "engine_args, on",
    [
        ([], False),  # SGLang's default page size, 1: an event per token
        (["--page-size", "8"], False),
        (["--page-size=8"], False),
        (["--page-size", "16"], True),
        (["--page-size=64"], True),
        (["--page-size", "64", "--page-size=1"], False),  # argparse: the last one wins
        (["--page-size", "lots"], False),
    ],
)
def test_sglang_gets_kv_events_only_with_pages_of_16_tokens_or_more(engine_args, on):
    assert has_events("sglang", engine_args) is on
    assert (launch.kv_events_off_reason(_profile("sglang", engine_args)) == "") is on


@pytest.mark.parametrize(
    "engine_args",
    [
        ["--data-parallel-size", "2"],
        ["--data-parallel-size=4"],
        ["-dp", "2"],
        ["-dp=2"],
        ["--data-parallel-size", "1", "-dp", "2"],
    ],
)
def test_vllm_with_data_parallel_ranks_gets_no_kv_events(engine_args):
    a = argv("vllm", engine_args)
    assert "--kv-events-config" not in a
    assert not any(REPLAY in x for x in a)  # nor a replay endpoint (offset by rank too)
    assert "data parallel" in launch.kv_events_off_reason(_profile("vllm", engine_args))


@pytest.mark.parametrize("engine_args", [[], ["-dp", "1"], ["--data-parallel-size=1"]])
def test_vllm_without_data_parallelism_keeps_its_kv_events(engine_args):
    a = argv("vllm", engine_args)
    assert RELAY in a[a.index("--kv-events-config") + 1]


@pytest.mark.parametrize(
    "engine_args",
    [
        ["--page-size", "16", "--dp-size", "2", "--enable-dp-attention"],
        ["--page-size", "16", "--dp", "2", "--enable-dp-attention"],
        ["--page-size=16", "--dp-size=4"],
    ],
)
def test_sglang_with_data_parallel_ranks_gets_no_kv_events(engine_args):
    assert not has_events("sglang", engine_args)
    assert "data parallel" in launch.kv_events_off_reason(_profile("sglang", engine_args))


def test_the_simulator_is_unaffected():
    assert has_events("sim", [])


def _profile(engine: str, engine_args: list[str]) -> c.ServingProfile:
    return c.ServingProfile(engine=engine, model_ref="org/m", gpus_per_shard=1,
                            engine_args=engine_args)  # fmt: skip
