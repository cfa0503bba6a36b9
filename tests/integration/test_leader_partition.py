"""A leader cut off from Postgres must not keep the lock for hours.

The advisory lock lives as long as Postgres thinks its session does. A network
path that freezes (here: a TCP proxy that stops forwarding and closes nothing)
leaves the server's end of the connection healthy, so with default settings
the lock stays held until TCP keepalive gives up, two hours on, and no
reconciler leads meanwhile. The lock's session carries a server-side silence
limit (idle_session_timeout and TCP timeouts), and the cut-off leader steps
down on its own before that limit frees the lock for a standby.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import make_url

from llmgw import bus
from llmgw.reconciler.config import LeaderConfig

from . import inproc
from .tcpfreeze import FreezableProxy
from .test_reconciler_store import registered
from .test_stream_identity import folded_nodes


async def test_a_standby_leads_when_the_leaders_path_to_postgres_freezes(
    nats, database_url, engine
):
    js = nats.jetstream()
    await bus.provision(js)
    url = make_url(database_url)
    proxy = FreezableProxy(url.host or "127.0.0.1", url.port or 5432)
    await proxy.start()
    leader_cfg = LeaderConfig(
        retry_interval_seconds=0.2, check_interval_seconds=0.5, session_timeout_seconds=3.0
    )
    nats_url = nats.connected_url.geturl()
    cut_off = inproc.config(
        nats_url,
        url.set(port=proxy.port).render_as_string(hide_password=False),
        id="cut-off",
        leader=leader_cfg,
    )
    standby = inproc.config(nats_url, database_url, id="standby", leader=leader_cfg)
    async with inproc.running(cut_off) as a:
        try:
            await inproc.until("the first reconciler to lead", lambda: a.role.name == "leader")
            async with inproc.running(standby) as b:
                await inproc.until("the second to stand by", lambda: b.role.name == "standby")
                roles: list[tuple[str, str]] = []  # (a, b) at each change

                async def watch() -> None:
                    while True:
                        now = (a.role.name, b.role.name)
                        if not roles or roles[-1] != now:
                            roles.append(now)
                        await asyncio.sleep(0.02)

                watcher = asyncio.create_task(watch())
                proxy.freeze()
                try:
                    await inproc.until(
                        "the standby to lead", lambda: b.role.name == "leader", deadline=60
                    )
                finally:
                    watcher.cancel()
                # The cut-off leader stopped leading before the standby started: never two.
                assert not any(ra == "leader" and rb == "leader" for ra, rb in roles), roles
                # And the new leader folds.
                await bus.publish(js, registered("after-the-cut"))
                await inproc.until("the new leader to fold", lambda: _has(engine, "after-the-cut"))
        finally:
            await proxy.close()  # the cut-off one notices, and shuts down promptly


async def _has(engine, node: str) -> bool:
    return node in await folded_nodes(engine)
