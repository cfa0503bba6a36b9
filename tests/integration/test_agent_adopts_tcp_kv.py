"""An engine launched by an agent from before ipc KV sockets is adopted, and said to be exposed.

Such an engine's record names loopback TCP ports (`kv_events_port`, `kv_replay_port`),
which today's record has no field for: decoding drops them, and the engine's replay
socket stays reachable by any local user until the engine is relaunched. The new
agent adopts it (its model serves on) and warns, naming the shard and what to do.
"""

from __future__ import annotations

import json
import signal

from llmgw import bus
from llmgw import contracts as c
from llmgw.agent import procs
from llmgw.dev import servers as localservers
from tests.integration.test_agent_lifecycle import WAIT, Watch, eventually, start_cmd, status
from tests.integration.test_agent_restarts import AgentProcess, engine_pids


async def test_an_engine_with_loopback_kv_ports_is_adopted_with_a_warning(nats, nats_url, tmp_path):
    js = nats.jetstream()
    await bus.provision(js)
    watch = await Watch().start(nats, "llmgw.evt.agent.>")
    state_dir = tmp_path / "state"
    log = tmp_path / "agent.log"
    admin_port = localservers.free_port()
    agents = [
        AgentProcess("n-old", nats_url, state_dir, log, localservers.free_port(), admin_port)
        for _ in range(2)
    ]
    try:
        agents[0].start()
        await bus.publish(js, start_cmd("n-old", "old", gpus=["GPU-fake-n-old-0"]))
        await watch.wait_for(status("old", c.ShardState.READY))
        agents[0].kill()

        # The record as the agent before ipc KV sockets wrote it.
        path = state_dir / "shards" / "old.json"
        record = json.loads(path.read_text())
        record.pop("kv_events_endpoint", None)
        record.pop("kv_replay_endpoint", None)
        path.write_text(json.dumps({**record, "kv_events_port": 20481, "kv_replay_port": 20482}))

        agents[1].start()
        said = await eventually(
            lambda: _read(log), lambda text: "shard old" in text and "20482" in text, WAIT
        )
        (line,) = [json.loads(ln) for ln in said.splitlines() if "20482" in ln]
        assert line["level"] == "warning"
        assert "any local user" in line["msg"] and "drain and relaunch" in line["msg"]
        assert engine_pids(state_dir)["old"]  # adopted, not failed: the model serves on
    finally:
        for agent in agents:
            agent.kill()
        for pid in engine_pids(state_dir).values():
            procs.signal_group(pid, signal.SIGKILL)


async def _read(path) -> str:
    return path.read_text() if path.exists() else ""
