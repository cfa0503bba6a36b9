"""The agent as a real process: killed and restarted, engines keep serving and are re-adopted;
SIGTERM leaves engines running; a node without GPUs refuses to start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import bus
from llmgw import contracts as c
from llmgw.agent import procs
from llmgw.agent.state import StateDir
from llmgw.dev import servers as localservers
from tests.integration.test_agent_lifecycle import (
    WAIT,
    Watch,
    complete,
    eventually,
    last_registration,
    start_cmd,
    status,
)

S = c.ShardState


class AgentProcess:
    def __init__(
        self, node: str, nats_url: str, state_dir: Path, log: Path, base_port: int, admin_port: int
    ):
        self.argv = [
            sys.executable, "-m", "llmgw.cli", "agent",
            "--node-id", node,
            "--nats", nats_url,
            "--fake-gpus", "2x80GiB",
            "--state-dir", str(state_dir),
            "--engine-port-range", f"{base_port}-{base_port + 20}",
            "--heartbeat-interval", "0.2",
            "--admin-listen", f"127.0.0.1:{admin_port}",
        ]  # fmt: skip
        self.env = {**os.environ, "LLMGW_READY_POLL_SECONDS": "0.05"}
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def engine_pids(state_dir: Path) -> dict[str, int]:
    return {r.shard_id: r.pid for r in StateDir(state_dir).load_all() if r.pid}


async def test_agent_killed_and_restarted_keeps_and_readopts_engines(nats, nats_url, tmp_path):
    js = nats.jetstream()
    await bus.provision(js)
    watch = await Watch().start(nats, "llmgw.evt.agent.>")
    state_dir = tmp_path / "state"
    # One admin port for all three: each agent must release it for the next.
    admin_port = localservers.free_port()
    agents = [
        AgentProcess(
            "n-proc",
            nats_url,
            state_dir,
            tmp_path / "agent.log",
            localservers.free_port(),
            admin_port,
        )
        for _ in range(3)
    ]
    try:
        first = agents[0].start()
        reg_a = await eventually(
            lambda: _registration_or_none(js), lambda m: m is not None, timeout=WAIT
        )
        await bus.publish(js, start_cmd("n-proc", "keep", gpus=["GPU-fake-n-proc-0"]))
        await bus.publish(js, start_cmd("n-proc", "dies", gpus=["GPU-fake-n-proc-1"]))
        keep = await watch.wait_for(status("keep", S.READY))
        await watch.wait_for(status("dies", S.READY))
        pids = engine_pids(state_dir)

        first.kill()  # SIGKILL: no chance to clean up
        await complete(keep.url, "model-keep")  # the engine serves on without its agent
        os.kill(pids["dies"], signal.SIGKILL)  # and another engine dies while no agent watches

        agents[1].start()
        reg_b = await eventually(
            lambda: last_registration(js, "n-proc"), lambda m: m.boot_id != reg_a.boot_id
        )
        assert [(s.shard_id, s.state, s.pid, s.url) for s in reg_b.shards] == [
            ("keep", S.READY, pids["keep"], keep.url)
        ]
        failed = await watch.wait_for(status("dies", S.FAILED))
        assert "exited while the agent was not running" in failed.reason

        # Re-adopted means supervised: a repeated start is answered, not launched again...
        seen = len(watch.messages)
        await bus.publish(js, start_cmd("n-proc", "keep", gpus=["GPU-fake-n-proc-0"]))
        await watch.wait_for(status("keep", S.READY, "start-keep"), after=seen)
        assert engine_pids(state_dir)["keep"] == pids["keep"]

        # A second agent on the same state dir refuses to start.
        clash = await asyncio.to_thread(
            subprocess.run, agents[2].argv, env=agents[2].env, capture_output=True, timeout=60
        )
        assert clash.returncode == 1 and b"in use by another agent" in clash.stderr

        # SIGTERM: the agent exits cleanly and leaves its engines serving.
        agents[1].proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agents[1].proc.wait, WAIT) == 0
        await complete(keep.url, "model-keep")

        # ...and the next agent takes them back and can stop them.
        agents[2].start()
        reg_c = await eventually(
            lambda: last_registration(js, "n-proc"),
            lambda m: m.boot_id not in (reg_a.boot_id, reg_b.boot_id),
        )
        assert [s.shard_id for s in reg_c.shards] == ["keep"]
        await bus.publish(js, c.StopShard(key="stop-keep", node="n-proc", shard_id="keep"))
        await watch.wait_for(status("keep", S.STOPPED, "stop-keep"))
        assert procs.process_start(pids["keep"]) is None
    finally:
        for agent in agents:
            agent.kill()
        for pid in engine_pids(state_dir).values():
            procs.signal_group(pid, signal.SIGKILL)


async def _registration_or_none(js):
    with contextlib.suppress(Exception):
        return await last_registration(js, "n-proc")
    return None


def _nvml_present() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    return True


@pytest.mark.skipif(_nvml_present(), reason="this machine has an NVIDIA driver")
def test_a_node_without_gpus_refuses_to_start(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "llmgw.cli", "agent", "--node-id", "n-none",
         "--nats", "nats://127.0.0.1:1", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert res.returncode == 1
    assert "refusing to start" in res.stderr and "--fake-gpus 8x80GiB" in res.stderr
