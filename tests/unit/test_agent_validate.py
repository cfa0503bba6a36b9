"""Validation before launch: every failure names its reason; a good profile passes."""

import pytest

from llmgw import contracts as c
from llmgw.agent.validate import GiB, NodeFacts, check

GPUS = {
    f"GPU-{i}": c.GpuInfo(uuid=f"GPU-{i}", index=i, name="H100", memory_bytes=80 * GiB)
    for i in range(4)
}


def start(gpus=("GPU-0", "GPU-1"), **profile_kw) -> c.StartShard:
    profile = {"engine": "vllm", "model_ref": "org/model", "gpus_per_shard": 2, **profile_kw}
    return c.StartShard(
        key="k",
        node="n1",
        shard_id="s1",
        model="m",
        replica_id="r",
        profile=c.ServingProfile(**profile),
        gpus=list(gpus),
    )


def facts(**kw) -> NodeFacts:
    return NodeFacts(node="n1", gpus=GPUS, **kw)


def test_a_good_profile_passes():
    assert check(start(min_gpu_memory_bytes=80 * GiB), facts()) is None


@pytest.mark.parametrize(
    ("cmd", "node", "reason"),
    [
        (start(engine="tgi"), facts(), "unknown engine 'tgi'"),
        (
            start(),
            facts(engine_missing=lambda e: "vllm not found (not on PATH or not executable)"),
            "engine vllm is not installed on this node: vllm not found",
        ),
        (start(gpus=["GPU-0"]), facts(), "1 GPU(s) assigned but the tensor parallel size"),
        (start(gpus=["GPU-0", "GPU-0"]), facts(), "the same GPU is assigned twice"),
        (start(gpus=["GPU-0", "GPU-9"]), facts(), "GPU GPU-9 does not exist on node n1"),
        (
            start(),
            facts(gpu_holders={"GPU-1": "other-shard"}),
            "GPU GPU-1 (index 1) is in use by shard other-shard",
        ),
        (
            start(),
            facts(process_count=lambda u: 2 if u == "GPU-0" else 0),
            "GPU GPU-0 (index 0) is busy: 2 compute process(es)",
        ),
        (
            start(min_gpu_memory_bytes=141 * GiB),
            facts(),
            "GPU GPU-0 (index 0) has 80.0 GiB, the profile needs 141.0 GiB per GPU",
        ),
        (
            start(min_gpu_memory_bytes=40 * GiB),
            facts(free_memory=lambda u: 10 * GiB),
            "has only 10.0 GiB free, the profile needs 40.0 GiB",
        ),
        (
            start(model_ref="/models/missing"),
            facts(path_exists=lambda p: False),
            "model path /models/missing does not exist on node n1",
        ),
        (start(max_num_seqs=0), facts(), "profile.max_num_seqs must be positive"),
        (start(gpu_memory_utilization=1.5), facts(), "gpu_memory_utilization must be in (0, 1]"),
        (start(gpus_per_shard=0, gpus=[]), facts(), "gpus_per_shard must be at least 1"),
    ],
)
def test_each_invalid_profile_fails_with_its_reason(cmd, node, reason):
    got = check(cmd, node)
    assert got is not None and reason in got


def test_a_shard_may_keep_its_own_gpus():
    assert check(start(), facts(gpu_holders={"GPU-0": "s1"})) is None


def test_model_name_stands_in_for_an_empty_model_ref():
    cmd = start(model_ref="")
    assert check(cmd, facts()) is None
    cmd.model = ""
    assert "no model reference" in check(cmd, facts())


def test_multi_node_needs_rendezvous():
    cmd = start()
    cmd.nnodes, cmd.node_rank = 2, 1
    assert "needs master_addr" in check(cmd, facts())
    cmd.master_addr = "10.0.0.1"
    assert check(cmd, facts()) is None
    cmd.node_rank = 2
    assert "node_rank 2 is outside 0..1" in check(cmd, facts())
    cmd.node_rank = 1
    cmd.profile.engine = "sglang"
    assert "needs master_port" in check(cmd, facts())


def test_adapter_slots_on_an_engine_the_agent_cannot_load_adapters_into_are_refused():
    refusal = check(start(engine="sglang", max_loras=2), facts())
    assert refusal is not None and refusal.check == "lora_unsupported"
    assert "profile.max_loras" in refusal and "sglang" in refusal
    assert check(start(engine="vllm", max_loras=2), facts()) is None


def test_negative_adapter_slots_are_refused_naming_the_field():
    refusal = check(start(max_loras=-1), facts())
    assert refusal is not None and refusal.check == "profile_range"
    assert "profile.max_loras" in refusal


def pd_start(role="prefill", engine="vllm", shared_path="/shared/kv") -> c.StartShard:
    cmd = start(engine=engine)
    cmd.role = role
    cmd.connector = c.ConnectorSpec(shared_path=shared_path)
    return cmd


def test_a_prefill_or_decode_shard_on_an_engine_with_a_connector_passes():
    for role in c.PD_ROLES:
        for engine in ("vllm", "sim"):
            assert check(pd_start(role, engine), facts()) is None


def test_a_role_on_an_engine_without_the_pd_trait_is_refused_before_launch():
    refusal = check(pd_start("decode", "sglang"), facts())
    assert refusal is not None and refusal.check == "pd_unsupported"
    assert refusal == (
        "a decode shard needs an engine that serves disaggregated prefill/decode "
        "(vllm, sim); sglang does not"
    )


def test_an_unknown_role_is_refused_naming_the_roles():
    refusal = check(pd_start("both"), facts())
    assert refusal is not None and refusal.check == "pd_role"
    assert "role must be one of prefill, decode (or none), got 'both'" in refusal


def test_a_vllm_role_without_a_connector_is_refused():
    cmd = pd_start()
    cmd.connector = None
    refusal = check(cmd, facts())
    assert refusal is not None and "a prefill shard needs a connector" in refusal


def test_the_connector_folder_must_be_absolute():
    refusal = check(pd_start(shared_path="kv"), facts())
    assert refusal is not None and refusal.check == "pd_connector"
    assert "shared_path must be absolute, got 'kv'" in refusal


def test_a_connector_folder_the_engine_could_not_write_is_refused_with_why():
    asked = []

    def unwritable(path):
        asked.append(path)
        return "Read-only file system"

    refusal = check(pd_start(), facts(folder_unwritable=unwritable))
    assert asked == ["/shared/kv"]
    assert refusal is not None and refusal.check == "pd_connector"
    assert refusal == (
        "the connector's shared folder /shared/kv is not writable on node n1: Read-only file system"
    )


def test_the_simulators_folder_is_not_probed():
    # The simulator reads no folder: an unwritable one must not stop it.
    assert check(pd_start(engine="sim"), facts(folder_unwritable=lambda p: "no")) is None


def test_the_missing_trait_is_the_reason_even_where_the_engine_is_not_installed():
    # Installing SGLang would not mend it: that reason must not hide this one.
    refusal = check(pd_start("prefill", "sglang"), facts(engine_missing=lambda e: "not found"))
    assert refusal is not None and refusal.check == "pd_unsupported"
