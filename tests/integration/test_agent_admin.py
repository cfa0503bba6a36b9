"""`llmgw agent` as a real process with its admin listener: /metrics shows a sim shard ready and
its commands counted, /readyz follows the NATS connection, SIGTERM closes the port."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import httpx

from llmgw import bus
from llmgw import contracts as c
from llmgw.agent import procs
from llmgw.dev import servers as localservers
from tests.integration.test_agent_lifecycle import WAIT, Watch, start_cmd, status
from tests.integration.test_agent_restarts import AgentProcess, engine_pids
from tests.unit.test_agent_telemetry import samples, value

S = c.ShardState
NODE = "n-admin"


async def wait_ready(client: httpx.AsyncClient, want: int) -> dict:
    """Poll /readyz until it answers `want`; its JSON body."""
    async with asyncio.timeout(WAIT):
        while True:
            try:
                r = await client.get("/readyz")
                if r.status_code == want:
                    return r.json()
            except httpx.TransportError:
                pass  # the listener is not up yet
            await asyncio.sleep(0.05)


async def test_agent_admin_metrics_and_readiness(tmp_path):
    server = localservers.NatsServer(tmp_path / "nats").start()
    admin_port = localservers.free_port()
    state_dir = tmp_path / "state"
    agent = AgentProcess(
        NODE, server.url, state_dir, tmp_path / "agent.log", localservers.free_port(), admin_port
    )
    nc = None
    try:
        nc = await bus.connect(server.url, name="test")
        js = nc.jetstream()
        await bus.provision(js)
        watch = await Watch().start(nc, "llmgw.evt.agent.>")
        agent.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", timeout=5) as http:
            body = await wait_ready(http, 200)
            assert body == {"status": "ready", "detail": "connected to NATS and registered"}
            assert (await http.get("/healthz")).status_code == 200

            await bus.publish(js, start_cmd(NODE, "a"))
            await watch.wait_for(status("a", S.READY))
            seen = len(watch.messages)
            await bus.publish(js, start_cmd(NODE, "a"))  # a repeat: answered, not launched
            await watch.wait_for(status("a", S.READY), after=seen)
            await bus.publish(js, start_cmd(NODE, "bad", gpus=[f"GPU-fake-{NODE}-9"]))
            await watch.wait_for(status("bad", S.FAILED))

            async def scrape() -> dict:
                r = await http.get("/metrics")
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/plain; version=")
                return samples(r.text)  # prometheus_client's parser: invalid text raises

            page = await scrape()
            assert value(page, "llmgw_agent_shards", model="model-a", state="ready") == 1
            assert value(page, "llmgw_agent_shards", model="model-bad", state="failed") == 1
            assert value(page, "llmgw_agent_commands_received_total", kind="start") == 3
            applied = "llmgw_agent_commands_applied_total"
            assert value(page, applied, kind="start", action="launch") == 1
            assert value(page, applied, kind="start", action="answer") == 1
            assert (
                value(page, "llmgw_agent_commands_rejected_total", kind="start", reason="invalid")
                == 1
            )
            assert value(page, "llmgw_agent_validation_refusals_total", check="gpu_unknown") == 1
            assert value(page, "llmgw_agent_nats_connected") == 1
            assert value(page, "llmgw_agent_registered") == 1
            assert value(page, "llmgw_agent_heartbeats_published_total") >= 1
            assert value(page, "llmgw_agent_heartbeat_age_seconds") < WAIT
            assert value(page, "llmgw_agent_gpus", node=NODE) == 2
            assert value(page, "llmgw_agent_gpu_info", node=NODE, index="1") == 1

            # NATS goes away: not ready, with the reason; back: ready again, one reconnect.
            await asyncio.to_thread(server.stop)
            body = await wait_ready(http, 503)
            assert body == {"status": "not ready", "detail": "not connected to NATS"}
            assert (await http.get("/healthz")).status_code == 200
            assert value(await scrape(), "llmgw_agent_nats_connected") == 0
            await asyncio.to_thread(server.start)
            await wait_ready(http, 200)
            page = await scrape()
            assert value(page, "llmgw_agent_nats_connected") == 1
            assert value(page, "llmgw_agent_nats_reconnects_total") >= 1

        # SIGTERM: a clean exit that releases the admin port.
        agent.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent.proc.wait, WAIT) == 0
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", admin_port)) != 0
    finally:
        agent.kill()
        for pid in engine_pids(state_dir).values():
            procs.signal_group(pid, signal.SIGKILL)
        await bus.close_quietly(nc)
        server.stop()


def test_an_admin_address_in_use_refuses_to_start(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "llmgw.cli", "agent", "--node-id", "n-clash",
             "--nats", "nats://127.0.0.1:1", "--fake-gpus", "1x80GiB",
             "--state-dir", str(tmp_path), "--admin-listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert f"admin_listen: cannot listen on 127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr
