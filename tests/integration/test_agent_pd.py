"""Prefill/decode shards through a real agent on real NATS: the engine a role needs, the
connector on its command line (kept when it is started again), the shared folder made,
and the shard statuses that say why a role or a folder was refused.

vLLM here is a stand-in process (`sh -c 'sleep 600'` takes vLLM's command line as its
arguments): what is checked is the command line the engine was started with, read back
from /proc. tests/realengine/test_pd_vllm.py runs the real one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw import bus, subjects
from llmgw import contracts as c

from .test_agent_lifecycle import Watch, agent_config, running_agent, start_cmd, status

S = c.ShardState
NODE = "n-pd"
FAKE_VLLM = ["sh", "-c", "sleep 600", "vllm"]


@pytest.fixture
async def watch(nats) -> AsyncIterator[Watch]:
    await bus.provision(nats.jetstream())
    yield await Watch().start(nats, "llmgw.evt.agent.>", subjects.LOAD_ALL)


def pd_cmd(shard_id: str, role: str, shared: Path, gpu: int, engine="vllm", key=None):
    cmd = start_cmd(NODE, shard_id, key=key, gpus=[f"GPU-fake-{NODE}-{gpu}"], engine=engine)
    cmd.role = role
    cmd.connector = c.ConnectorSpec(shared_path=str(shared), extra={"n": 1})
    return cmd


def running_kv_config(pid: int) -> dict:
    """The --kv-transfer-config of the process as it runs."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


async def test_a_vllm_role_runs_with_the_connector_and_keeps_it_when_started_again(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    shared = tmp_path / "shared" / "kv"
    cfg = agent_config(NODE, nats_url, tmp_path / "state", vllm_command=FAKE_VLLM)
    async with running_agent(cfg) as agent:
        await bus.publish(js, pd_cmd("d", "decode", shared, 0))
        await watch.wait_for(status("d", S.LOADING))
        assert shared.is_dir() and list(shared.iterdir()) == []  # made, the probe gone
        expected = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": str(shared), "n": 1},
        }
        assert running_kv_config(agent.shards["d"].rec.pid) == expected

        await bus.publish(js, c.StopShard(key="stop-d", node=NODE, shard_id="d"))
        await watch.wait_for(status("d", S.STOPPED))
        seen = len(watch.messages)
        await bus.publish(js, pd_cmd("d", "decode", shared, 0, key="start-d-again"))
        await watch.wait_for(status("d", S.LOADING, "start-d-again"), after=seen)
        assert running_kv_config(agent.shards["d"].rec.pid) == expected


async def test_a_role_the_engine_cannot_serve_or_a_folder_it_cannot_write_fails_before_launch(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    (tmp_path / "file").write_text("")
    cfg = agent_config(NODE, nats_url, tmp_path / "state", vllm_command=FAKE_VLLM)
    async with running_agent(cfg) as agent:
        cases = {
            "sglang": (
                pd_cmd("sglang", "prefill", tmp_path / "kv", 0, engine="sglang"),
                "a prefill shard needs an engine that serves disaggregated prefill/decode "
                "(vllm, sim); sglang does not",
            ),
            "folder": (
                pd_cmd("folder", "prefill", tmp_path / "file" / "kv", 1),
                f"the connector's shared folder {tmp_path}/file/kv is not writable on node "
                f"{NODE}: Not a directory",
            ),
        }
        for cmd, _ in cases.values():
            await bus.publish(js, cmd)
        for shard_id, (cmd, reason) in cases.items():
            failed = await watch.wait_for(status(shard_id, S.FAILED))
            assert failed.reason == reason and failed.command_key == cmd.key
            assert watch.states(shard_id) == [S.FAILED]  # nothing was launched
        refusals = agent.metrics.validation_refusals
        assert refusals.labels("pd_unsupported")._value.get() == 1
        assert refusals.labels("pd_connector")._value.get() == 1


async def test_a_simulator_role_serves_with_no_connector_flag(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config(NODE, nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        await bus.publish(js, pd_cmd("s", "prefill", tmp_path / "kv", 0, engine="sim"))
        await watch.wait_for(status("s", S.READY))
        assert "--kv-transfer-config" not in agent.shards["s"].rec.argv
        assert not (tmp_path / "kv").exists()  # it reads no folder: none is made for it
