"""The agent under mutual TLS with the generated per-identity permissions: everything it does
(registration, heartbeats, its command consumer, shard status, load samples) is allowed, and
nothing it does is refused."""

from __future__ import annotations

import asyncio
import logging

from llmgw import bus, certs, natsconfig, subjects, tlsconfig
from llmgw import contracts as c
from llmgw.dev import servers as localservers
from tests.integration.test_agent_lifecycle import (
    Watch,
    agent_config,
    last_heartbeat,
    last_registration,
    running_agent,
    start_cmd,
    status,
)

S = c.ShardState


async def test_agent_works_within_its_mtls_permissions(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="llmgw.bus")
    cert_dir = tmp_path / "certs"
    certs.init(cert_dir, ["node-a"], routers=0)
    port = localservers.free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        natsconfig.render(
            certs.read_identities(cert_dir),
            str(cert_dir),
            port=port,
            store_dir=str(tmp_path / "js"),
        )
    )
    server = localservers.ConfiguredNatsServer(
        tmp_path / "server", port=port, config_file=conf
    ).start()
    try:
        # The reconciler provisions and commands; it may read everything.
        rc = await bus.connect(
            server.url,
            "reconciler",
            **tlsconfig.nats_options(tlsconfig.from_certs_dir(cert_dir, "reconciler")),
        )
        js = rc.jetstream()
        await bus.provision(js)
        watch = await Watch().start(rc, "llmgw.evt.agent.>", subjects.LOAD_ALL)
        cfg = agent_config("node-a", server.url, tmp_path / "state")
        cfg.nats_tls = tlsconfig.from_certs_dir(cert_dir, "agent-node-a")
        async with running_agent(cfg) as agent:
            reg = await last_registration(js, "node-a")
            assert reg.boot_id == agent.boot_id and len(reg.gpus) == 4
            await bus.publish(js, start_cmd("node-a", "m1", gpus=["GPU-fake-node-a-0"]))
            await watch.wait_for(status("m1", S.READY))
            await watch.wait_for(lambda m: isinstance(m, c.LoadSample) and m.shard_id == "m1")
            await bus.publish(js, c.StopShard(key="stop-m1", node="node-a", shard_id="m1"))
            await watch.wait_for(status("m1", S.STOPPED, "stop-m1"))
            assert (await last_heartbeat(js, "node-a")).boot_id == agent.boot_id
            await asyncio.sleep(0.3)
        await bus.close_quietly(rc)
    finally:
        server.stop()
    refused = [r.getMessage() for r in caplog.records if "violation" in r.getMessage().lower()]
    assert refused == []
