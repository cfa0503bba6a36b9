"""The control loop on real NATS: decisions, commands, agents answering, liveness, KV.

A small in-test leader folds LLMGW_EVENTS into a ClusterState and drives the
Manager exactly as the reconciler's leader loop does (start, on_state_changed
after each batch, stop). Agents are simulated in-process: they heartbeat,
answer commands with shard-status events, and can be "killed" (heartbeats
stop, commands go unanswered). Timings are scaled down (a node is lost after two
seconds) so the whole file runs in a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import re
import sys
from collections.abc import AsyncIterator, Callable

import pytest

from llmgw import bus, projection
from llmgw import contracts as c
from llmgw import subjects as s
from llmgw.reconciler.audit import replay_cli
from llmgw.reconciler.controllers.manager import ActorConfig, Manager
from llmgw.reconciler.controllers.replicas.placement import Fit
from llmgw.reconciler.state import fold
from llmgw.reconciler.state.model import ClusterState, Liveness

S = c.ShardState
FAST = ActorConfig(
    # Heartbeats every 0.1 s come back through NATS into this same event loop: a loop
    # stalled for half the grace on a loaded box must not make a live node unreachable.
    unreachable_after=1.0,
    lost_after=2.0,
    liveness_tick=0.1,
    command_retry_initial=0.3,
    command_retry_max=1.0,
    resync_interval=0.3,
    fold_wait_timeout=5.0,
    failure_restate_interval=0.5,
)
DEADLINE = 15.0


class Leader:
    """Fold the event stream into a state and tell the actor, batch by batch."""

    def __init__(self, nc, js, actor: Manager):
        self.nc, self.js, self.actor = nc, js, actor
        self.state = ClusterState()
        self.events: list[tuple[int, c.Message]] = []
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._sub = await self.js.subscribe(s.EVENTS_ALL, ordered_consumer=True)
        await self.actor.start(self.nc, self.js, self.state)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            msg = await self._sub.next_msg(timeout=None)
            batch = [msg]
            while self._sub.pending_msgs:
                batch.append(await self._sub.next_msg())
            changes: set = set()
            for m in batch:
                ev = c.decode(m.data)
                self.events.append((m.metadata.sequence.stream, ev))
                changes |= fold.apply(self.state, m.metadata.sequence.stream, ev)
            await self.actor.on_state_changed(self.state, changes)
            self.changed.set()

    async def stop(self) -> None:
        await self.actor.stop()
        if self._task:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5)  # bounded: see SimAgent._heartbeat
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def until(self, what: str, pred: Callable[[ClusterState], object]) -> object:
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + DEADLINE
        while True:
            got = pred(self.state)
            if got:
                return got
            if loop.time() > stop_at:
                raise AssertionError(f"timed out waiting for {what}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=0.2)

    def of(self, kind: type) -> list:
        return [ev for _, ev in self.events if isinstance(ev, kind)]


class SimAgent:
    """A node: registers, heartbeats, and answers commands like an agent would."""

    def __init__(
        self,
        js,
        nc,
        name: str,
        n_gpus: int = 1,
        labels=None,
        drop_first_start=False,
        load_seconds: float = 0.0,
    ):
        self.js, self.nc, self.name = js, nc, name
        self.n_gpus, self.labels = n_gpus, labels or {}
        # How long a started shard stays loading: a window in which a test can look
        # at the cluster mid-change (this node answers nothing else meanwhile).
        self.load_seconds = load_seconds
        self.received: list[c.Message] = []
        self.running: dict[str, c.StartShard] = {}
        self.drop_first_start = drop_first_start
        self.alive = True
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(s.commands(self.name), cb=self._on_command)
        await bus.publish(
            self.js,
            c.NodeRegistered(
                node=self.name,
                engines=["sim"],
                labels=self.labels,
                gpus={
                    f"{self.name}-g{i}": c.GpuInfo(
                        uuid=f"{self.name}-g{i}", index=i, name="sim", memory_bytes=80 << 30
                    )
                    for i in range(self.n_gpus)
                },
            ),
        )
        self._tasks.append(asyncio.create_task(self._heartbeat()))

    async def _heartbeat(self) -> None:
        n = 0
        # A flag as well as the cancel: Python 3.11's wait_for (inside nats-py's request)
        # can swallow a cancel that lands as the reply arrives, and this loop would go on.
        while not self._stopping:
            if self.alive:
                n += 1
                # An agent keeps heartbeating through a bus outage: a failed publish
                # is just a missed beat.
                with contextlib.suppress(Exception):
                    await self.js.publish(
                        s.heartbeat(self.name),
                        c.encode(c.Heartbeat(node=self.name, seq=n)),
                        timeout=0.5,
                    )
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        self.alive = False

    async def _status(self, cmd, state: S, **kw) -> None:
        start = self.running.get(cmd.shard_id)
        await bus.publish(
            self.js,
            c.ShardStatus(
                node=self.name,
                shard_id=cmd.shard_id,
                model=start.model if start else "",
                replica_id=start.replica_id if start else "",
                state=state,
                command_key=cmd.key,
                **kw,
            ),
        )

    async def _on_command(self, msg) -> None:
        if not self.alive:
            return
        cmd = c.decode(msg.data)
        self.received.append(cmd)
        if isinstance(cmd, c.StartShard):
            if self.drop_first_start:
                self.drop_first_start = False
                return  # lost: the reconciler must re-issue it
            if cmd.shard_id in self.running:
                return  # same key again: already done
            self.running[cmd.shard_id] = cmd
            await self._status(cmd, S.LOADING, gpus=cmd.gpus)
            await asyncio.sleep(self.load_seconds)
            port = 9000 + len(self.running)
            await self._status(
                cmd, S.READY, url=f"http://{self.name}:{port}", port=port, max_running=8
            )
        elif isinstance(cmd, c.DrainShard):
            await self._status(cmd, S.DRAINING)
            await self._status(cmd, S.STOPPED)
            self.running.pop(cmd.shard_id, None)
        elif isinstance(cmd, c.StopShard):
            await self._status(cmd, S.STOPPED)
            self.running.pop(cmd.shard_id, None)

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


class Cluster:
    def __init__(self, nc, js, actor: ActorConfig = FAST):
        self.nc, self.js = nc, js
        self.agents: list[SimAgent] = []
        self.leader = Leader(nc, js, Manager(actor))

    @classmethod
    async def provisioned(cls, nc, actor: ActorConfig = FAST) -> Cluster:
        js = nc.jetstream()
        await bus.provision(js)
        return cls(nc, js, actor)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Cluster]:
        """The leader started; on leaving, the leader and every agent stopped."""
        await self.leader.start()
        try:
            yield self
        finally:
            await self.leader.stop()
            for a in self.agents:
                await a.stop()

    async def add(self, name: str, **kw) -> SimAgent:
        agent = SimAgent(self.js, self.nc, name, **kw)
        self.agents.append(agent)
        await agent.start()
        return agent

    def commands(self) -> list[tuple[str, str]]:
        return [(type(x).__name__, x.shard_id) for ag in self.agents for x in ag.received]


@pytest.fixture
async def cluster(nats):
    async with (await Cluster.provisioned(nats)).running() as cl:
        yield cl


async def kv_record(js, model: str) -> c.ModelEndpoints | None:
    bucket, key = projection.Key.model(model).target
    try:
        entry = await (await js.key_value(bucket)).get(key)
    except Exception:
        return None
    return projection.decode(bucket, key, entry.value) if entry.value else None


async def wait_kv(js, model: str, pred, what: str):
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + DEADLINE
    while loop.time() < stop_at:
        rec = await kv_record(js, model)
        if pred(rec):
            return rec
        await asyncio.sleep(0.05)
    raise AssertionError(f"KV never showed {what}; last: {await kv_record(js, model)}")


def ready_urls(rec) -> list[str]:
    return sorted(e.url for e in rec.endpoints if e.state == c.EndpointState.READY) if rec else []


async def test_declare_place_start_ready_then_node_lost_and_replaced(cluster):
    leader, add, js = cluster.leader, cluster.add, cluster.js
    a = await add("node-a", drop_first_start=True)
    await add("node-b")
    await leader.until("two nodes", lambda st: len(st.nodes) == 2)
    await bus.publish(
        js, c.ModelDeclared(name="m", aliases=["mm"], profile=c.ServingProfile(engine="sim"))
    )
    rec = await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "one ready endpoint")
    assert rec.aliases == ["mm"] and rec.endpoints[0].max_running == 8
    first = leader.state.replicas["m-r1"].assignments[0].node
    assert first == "node-a"  # equal nodes: the node id decides
    starts = [x for x in a.received if isinstance(x, c.StartShard)]
    # node-a dropped the first start: it came again, same key, new message id.
    assert len(starts) >= 2 and {x.key for x in starts} == {"m-r1-s0:start"}
    assert starts[0].id != starts[1].id
    agent = a

    agent.kill()
    await leader.until("unreachable", lambda st: st.nodes[first].liveness == Liveness.UNREACHABLE)
    await leader.until("lost", lambda st: st.nodes[first].liveness == Liveness.LOST)
    other = "node-b"
    rec = await wait_kv(
        js,
        "m",
        lambda r: r and [e.node for e in r.endpoints] == [other] and ready_urls(r),
        "the replacement on the other node",
    )
    assert rec.endpoints[0].replica_id == "m-r2"
    retired = leader.of(c.ReplicaRetired)
    assert [(r.replica_id, r.reason) for r in retired] == [
        ("m-r1", "shard m-r1-s0 failed: node lost; replaced")
    ]
    kinds = [type(ev).__name__ for ev in leader.of((c.NodeUnreachable, c.NodeLost))]
    assert kinds == ["NodeUnreachable", "NodeLost"]


async def test_no_capacity_explains_each_node_and_scale_down_drains_first(cluster):
    leader, add, js = cluster.leader, cluster.add, cluster.js
    await add("node-a", n_gpus=2)
    await add("node-b", n_gpus=1)
    await leader.until("two nodes", lambda st: len(st.nodes) == 2)
    await bus.publish(
        js, c.ModelDeclared(name="big", profile=c.ServingProfile(engine="sim", gpus_per_shard=4))
    )
    failed = await leader.until("a failure", lambda st: st.failures.get("big-r1"))
    assert {v.node: v.reason for v in failed.verdicts} == {
        "node-a": "2 free GPUs of 2, needs 4",
        "node-b": "1 free GPU of 1, needs 4",
    }
    await asyncio.sleep(FAST.resync_interval * 3)
    assert len(leader.of(c.PlacementFailed)) == 1  # the same failure is not repeated

    await bus.publish(js, c.ModelDeclared(name="m", replicas=3, profile=c.ServingProfile()))
    await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 3, "three ready endpoints")
    await bus.publish(js, c.ModelDeclared(name="m", replicas=1, profile=c.ServingProfile()))
    await wait_kv(js, "m", lambda r: r and len(r.endpoints) == 1, "one endpoint left")
    retired = {r.replica_id for r in leader.of(c.ReplicaRetired)}
    assert retired == {"m-r2", "m-r3"}  # the newest go first
    # Each retired ready shard was drained, and none was stopped outright.
    cmds = cluster.commands()
    for rid in retired:
        assert ("DrainShard", f"{rid}-s0") in cmds
        assert ("StopShard", f"{rid}-s0") not in cmds

    await bus.publish(js, c.ModelRemoved(name="m"))
    await wait_kv(js, "m", lambda r: r is None, "the key deleted")
    await leader.until(
        "all m shards stopped",
        lambda st: all(sh.terminal for sh in st.shards.values() if sh.model == "m"),
    )

    # The log the actor wrote replays to the same decisions, read back from the stream
    # by the CLI; a placement rule changed in code shows up as a difference.
    args = argparse.Namespace(
        from_seq=0,
        to_seq=None,
        explain=None,
        strict=True,
        verbose=False,
        database_url=None,
        api=None,
        nats=cluster.nc.connected_url.geturl(),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await asyncio.to_thread(replay_cli.run, args) == 0
    # (The count is read from the output: the actor may restate big's failure meanwhile.)
    checked = re.search(r"(\d+) decisions checked, 0 differ", out.getvalue())
    assert checked and int(checked[1]) >= 5
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fit, "rank", property(lambda f: (f.model_shards, -len(f.free), f.node)))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert await asyncio.to_thread(replay_cli.run, args) == 1
    assert "DIFFERS" in out.getvalue()


async def test_new_leader_rebuilds_liveness_and_projection(cluster, nats):
    leader, add, js = cluster.leader, cluster.add, cluster.js
    await add("node-a")
    dead = await add("node-b")
    await leader.until("two nodes", lambda st: len(st.nodes) == 2)
    await bus.publish(js, c.TenantDeclared(name="acme", band="gold"))
    await bus.publish(js, c.BandsDeclared(bands=[c.Band(name="gold")]))
    await bus.publish(js, c.ModelDeclared(name="m", replicas=2, profile=c.ServingProfile()))
    await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 2, "two ready endpoints")
    bucket, key = projection.Key.tenant("acme").target
    raw = (await (await js.key_value(bucket)).get(key)).value
    assert projection.decode(bucket, key, raw).band == "gold"

    await leader.actor.stop()  # leadership lost
    dead.kill()
    await asyncio.sleep(FAST.lost_after + 0.3)  # silence no leader was watching
    successor = Manager(FAST)
    leader.actor = successor
    await successor.start(nats, js, leader.state)
    assert successor.projection.writes == 0  # the buckets already matched the state
    # The stored heartbeat is remembered for reports, never taken as a live one.
    assert "node-b" in successor.liveness.last_wall
    assert "node-b" not in successor.liveness.last_seen
    # Grace first: nothing happens at once; then node-b's silence counts from the start.
    await asyncio.sleep(0.3)
    assert leader.state.nodes["node-b"].liveness == Liveness.ALIVE
    await leader.until("lost", lambda st: st.nodes["node-b"].liveness == Liveness.LOST)
    assert leader.state.nodes["node-a"].liveness == Liveness.ALIVE


@contextlib.asynccontextmanager
async def real_reconciler(nats, database_url: str, actor: ActorConfig = FAST) -> AsyncIterator[str]:
    """The part-1 reconciler (Postgres fold, leadership, operator API) driving the actor
    with `actor`'s timings; yields its operator API's URL."""
    from llmgw.dev import servers as localservers
    from llmgw.reconciler.config import FoldConfig, LeaderConfig, ReconcilerConfig
    from llmgw.reconciler.service import Reconciler
    from llmgw.reconciler.store import schema

    engine = schema.make_engine(database_url)
    await schema.upgrade(engine)
    await engine.dispose()
    await bus.provision(nats.jetstream())
    port = localservers.free_port()
    cfg = ReconcilerConfig(
        nats_url=nats.connected_url.geturl(),
        database_url=database_url,
        admin_listen=f"127.0.0.1:{port}",
        api_auth="none",  # loopback; the tests read the API, they are not about access
        actor=actor,
        fold=FoldConfig(fetch_wait_seconds=0.1),
        leader=LeaderConfig(retry_interval_seconds=0.2, check_interval_seconds=0.2),
    )
    rec = Reconciler(cfg)
    task = asyncio.create_task(rec.run())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        rec.stop.set()
        # The reconciler bounds its actor's stop at 15 s; the rest of its shutdown comes on top.
        await asyncio.wait_for(task, timeout=45)


# explain's --api-ca/--api-cert/--api-key, unset, as the parser would give them.
NO_TLS = {"api_ca": None, "api_cert": None, "api_key": None}


def cli(module, **kw) -> tuple[int, str]:
    """Run an operator command module as `llmgw` would; its exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.run(argparse.Namespace(**kw))
    return code, out.getvalue()


async def test_through_the_real_reconciler_explain_and_replay_from_the_archive(nats, database_url):
    """The part-1 reconciler (Postgres fold, leadership) drives the actor; the CLI reads it."""
    from llmgw.opcli import explain

    js = nats.jetstream()
    agents = [SimAgent(js, nats, "node-a", n_gpus=2), SimAgent(js, nats, "node-b")]
    async with real_reconciler(nats, database_url) as api:
        try:
            for a in agents:
                await a.start()
            await bus.publish(
                js, c.ModelDeclared(name="m", aliases=["chat"], profile=c.ServingProfile())
            )
            await bus.publish(
                js,
                c.ModelDeclared(name="big", profile=c.ServingProfile(gpus_per_shard=4)),
            )
            await wait_kv(js, "m", lambda r: len(ready_urls(r)) == 1, "m ready via the reconciler")

            loop = asyncio.get_running_loop()
            stop_at = loop.time() + DEADLINE
            while True:  # the API reads Postgres, which the fold commits just before acting
                code, text = await asyncio.to_thread(
                    cli,
                    explain,
                    model="big",
                    output="table",
                    all=False,
                    api=api,
                    token=None,
                    **NO_TLS,
                )
                # The first failure saw node-b free; m then took it, and the restated failure
                # (at most every failure_restate_interval) says so.
                if code == 0 and "node-b  0 free" in text or loop.time() > stop_at:
                    break
                await asyncio.sleep(0.1)
            assert "big-r1" in text and "NOT PLACED" in text
            assert "- node-a  2 free GPUs of 2, needs 4" in text
            assert "- node-b  0 free GPUs of 1, needs 4" in text  # m took it
            code, text = await asyncio.to_thread(
                cli, explain, model="m", output="table", all=False, api=api, token=None, **NO_TLS
            )
            assert code == 0 and "m-r1" in text and "placed: shard 0 on node-b (node-b-g0)" in text
            assert "now: ready" in text
            code, _ = await asyncio.to_thread(
                cli, explain, model="nope", output="table", all=False, api=api, token=None, **NO_TLS
            )
            assert code == 1
            # An alias, as clients name the model, explains the model it names.
            code, text = await asyncio.to_thread(
                cli, explain, model="chat", output="table", all=False, api=api, token=None, **NO_TLS
            )
            assert code == 0 and "chat is an alias of m" in text and "m-r1" in text, text

            common = dict(from_seq=0, to_seq=None, explain=None, strict=True, verbose=False)
            code, text = await asyncio.to_thread(
                cli,
                replay_cli,
                database_url=None,
                api=api,
                nats=None,
                token=None,
                **NO_TLS,
                **common,
            )
            assert code == 0 and "decisions checked, 0 differ" in text
            code, text = await asyncio.to_thread(
                cli, replay_cli, database_url=database_url, api=None, nats=None, **common
            )
            assert code == 0 and "the event archive" in text and ", 0 differ" in text
            # The same through the console script, as an operator runs it.
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "llmgw.cli",
                "audit",
                "replay",
                "--api",
                api,
                stdout=asyncio.subprocess.PIPE,
            )
            stdout, _ = await asyncio.wait_for(proc.communicate(), DEADLINE)
            assert proc.returncode == 0 and b", 0 differ" in stdout
            code, text = await asyncio.to_thread(
                cli, explain, model="big", output="json", all=False, api=api, token=None, **NO_TLS
            )
            seq = json.loads(text)["decisions"][0]["seq"]
            code, text = await asyncio.to_thread(
                cli,
                replay_cli,
                database_url=None,
                api=api,
                nats=None,
                token=None,
                **NO_TLS,
                **{**common, "explain": seq},
            )
            assert code == 0 and f"seq {seq}: failure to place for big-r1 of big" in text
            assert "  node-a: alive since" in text and "2/2 GPUs free" in text
        finally:
            for a in agents:
                await a.stop()
