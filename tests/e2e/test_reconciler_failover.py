"""Two `llmgw reconciler` processes, the leader killed with SIGKILL mid-stream.

The standby takes over, continues from the stored sequence, and in the end
every stream sequence is in the archive or the dead letters exactly once, the
projection equals a replay of the archive, and the operator CLI reads it all.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import asyncpg
import httpx
import pytest
from sqlalchemy import func, select

from llmgw import bus, procs
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.dev.servers import free_port
from llmgw.reconciler.audit import verify
from llmgw.reconciler.store import schema
from llmgw.reconciler.store import tables as t

pytestmark = pytest.mark.e2e

NODES = 40
CONFIG = """
leader: {retry_interval_seconds: 0.2, check_interval_seconds: 0.5}
fold: {batch_size: 50, fetch_wait_seconds: 0.2}
log_level: info
api_auth: none  # loopback; this test reads the API, it is not about access
"""


def node_event(i: int) -> c.NodeRegistered:
    gpus = {
        f"GPU-{i}-{g}": c.GpuInfo(uuid=f"GPU-{i}-{g}", index=g, name="H200", memory_bytes=141 << 30)
        for g in range(8)
    }
    return c.NodeRegistered(
        node=f"n{i}", gpus=gpus, labels={"fabric": "ib", "zone": f"z{i % 3}"}, engines=["sim"]
    )


def shard_event(i: int, state: c.ShardState) -> c.ShardStatus:
    return c.ShardStatus(
        node=f"n{i % NODES}",
        shard_id=f"orphan-r{i}-s0",
        model="orphan",
        replica_id=f"orphan-r{i}",
        state=state,
        url=f"http://10.0.0.{i % 250}:8000",
    )


def role(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()["role"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(pred)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def folded_seq(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5).json()["folded_seq"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        procs.llmgw_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


async def test_leader_killed_standby_takes_over_nothing_lost_nothing_doubled(
    nats, nats_url, database_url, tmp_path
):
    js = nats.jetstream()
    await bus.provision(js)
    engine = schema.make_engine(database_url)
    await schema.upgrade(engine)
    cfg = tmp_path / "reconciler.yaml"
    cfg.write_text(CONFIG)
    ports = {"ra": free_port(), "rb": free_port()}
    group = procs.Group()
    try:
        for rid, port in ports.items():
            group.start(
                rid,
                procs.llmgw_argv(
                    "reconciler", "--config", str(cfg), "--nats", nats_url,
                    "--database-url", database_url, "--admin-listen", f"127.0.0.1:{port}",
                    "--id", rid,
                ),
            )  # fmt: skip

        def one_leader():
            roles = {rid: role(port) for rid, port in ports.items()}
            leaders = [rid for rid, r in roles.items() if r == "leader"]
            return leaders[0] if len(leaders) == 1 and "standby" in roles.values() else None

        leader = await wait_for(one_leader, 30, "one leader and one standby")

        # The leader's lock session dies (database restart, network cut): it stops
        # acting at once, and there is again exactly one leader.
        admin = await asyncpg.connect(schema.asyncpg_dsn(database_url))
        try:
            killed = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = $1",
                f"llmgw-leader:{leader}",
            )
        finally:
            await admin.close()
        assert killed == 1
        await wait_for(
            lambda: "lost the leader lock's connection" in group.children[leader].output(),
            15,
            "the deposed leader to stop acting",
        )
        leader = await wait_for(one_leader, 30, "a leader again")
        standby = next(rid for rid in ports if rid != leader)

        published: list[c.Message] = [
            c.BandsDeclared(bands=[c.Band(name="interactive", ceiling=1.5)]),
            c.ModelDeclared(name="llama", replicas=1),
            c.TenantDeclared(name="acme", band="interactive"),
        ]
        published += [node_event(i) for i in range(NODES)]
        for ev in published:
            await bus.publish(js, ev)
        await js.publish(s.agent_event("n1", "registered"), b"not json")  # one dead letter
        await wait_for(lambda: folded_seq(ports[leader]) >= len(published) + 1, 30, "first fold")
        # The standby serves the same reads from Postgres.
        assert folded_seq(ports[standby]) >= len(published) + 1

        more = [shard_event(i, c.ShardState.LOADING) for i in range(150)]
        more += [shard_event(i, c.ShardState.READY) for i in range(150)]

        async def publish_more():
            for i in range(0, len(more), 10):
                await asyncio.gather(*(bus.publish(js, ev) for ev in more[i : i + 10]))

        publisher = asyncio.create_task(publish_more())
        await wait_for(lambda: folded_seq(ports[leader]) > len(published) + 20, 30, "folding")
        group.children[leader].kill9()
        killed_at = time.monotonic()
        await wait_for(lambda: role(ports[standby]) == "leader", 30, "the standby to lead")
        takeover = time.monotonic() - killed_at
        await publisher
        published += more

        # The new leader catches up with the whole stream, its own actor's events included.
        async def caught_up():
            last = (await js.stream_info(s.EVENTS_STREAM)).state.last_seq
            return last if folded_seq(ports[standby]) == last else None

        deadline = time.monotonic() + 30
        while (last := await caught_up()) is None:
            assert time.monotonic() < deadline, "the new leader did not catch up"
            await asyncio.sleep(0.2)
        print(f"takeover after kill -9: {takeover:.2f}s; stream at seq {last}")
        assert takeover < 15  # "a few seconds"; generous for a loaded 2-core machine

        async with engine.connect() as conn:
            archived = (
                await conn.execute(select(func.count()).select_from(t.ArchivedEvent))
            ).scalar_one()
            dead = (await conn.execute(select(t.DeadLetter.reason))).scalars().all()
            ids = [ev.id for ev in published]
            ours = (
                await conn.execute(select(func.count()).where(t.ArchivedEvent.msg_id.in_(ids)))
            ).scalar_one()
        # Every sequence exactly once: folded (archived) or dead-lettered, never both, none twice.
        assert archived + len(dead) == last
        assert ours == len(published)
        assert len(dead) == 1 and dead[0].startswith("malformed")
        report = await verify.verify(engine)
        assert report.differences == []

        # The read side and the CLI, against the surviving process.
        api = f"http://127.0.0.1:{ports[standby]}"
        res = await asyncio.to_thread(cli, "get", "nodes", "-o", "json", "--api", api)
        assert res.returncode == 0, res.stderr
        nodes = json.loads(res.stdout)
        assert len(nodes) == NODES and nodes[0]["gpus"][0]["name"] == "H200"
        res = await asyncio.to_thread(cli, "get", "endpoints", env={"LLMGW_API_URL": api})
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0].split() == ["MODEL", "SHARD", "STATE", "NODE", "URL"]
        ready = [line for line in lines[1:] if line.startswith("orphan ")]
        assert len(ready) == 150 and all(" ready " in line for line in ready)
        # Each leader term logs a TermStarted first: the catalog starts after those.
        res = await asyncio.to_thread(
            cli, "events", "export", "--from-seq", "1", "--to-seq", "10", "--api", api
        )
        types = [json.loads(line)["type"] for line in res.stdout.splitlines()]
        first = types.index("catalog.bands.declared") + 2  # the seq of the model after them
        res = await asyncio.to_thread(
            cli, "events", "export", "--from-seq", str(first), "--to-seq", str(first + 2),
            "--api", api,
        )  # fmt: skip
        seqs = [first, first + 1, first + 2]
        assert [json.loads(line)["seq"] for line in res.stdout.splitlines()] == seqs
        assert json.loads(res.stdout.splitlines()[0])["event"]["name"] == "llama"
        res = await asyncio.to_thread(cli, "get", "models", "--api", "http://127.0.0.1:1")
        assert res.returncode == 1 and "cannot reach the operator API" in res.stderr

        # SIGTERM: the leader stops acting and exits cleanly.
        assert group.children[standby].stop(grace=15) == 0
    finally:
        group.stop(grace=5)
        await engine.dispose()
