"""The agent against real NATS and real sim-engine processes: register, start, load, drain, stop,
crash, invalid profiles, and a NATS restart under it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from llmgw import bus, subjects
from llmgw import contracts as c
from llmgw.agent import engines, procs
from llmgw.agent.agent import Agent
from llmgw.agent.config import AgentConfig
from llmgw.agent.inventory import discover
from llmgw.agent.state import StateDir
from llmgw.dev import servers as localservers

S = c.ShardState
WAIT = 20.0  # generous deadlines: a shared 2-core machine


class Watch:
    """Collects every message on some subjects (core NATS), and waits for one that matches."""

    def __init__(self) -> None:
        self.messages: list = []
        self._changed = asyncio.Condition()
        self._subs: list = []

    async def start(self, nc, *subjects_: str) -> Watch:
        async def on_msg(msg) -> None:
            self.messages.append(c.decode(msg.data))
            async with self._changed:
                self._changed.notify_all()

        for subject in subjects_:
            self._subs.append(await nc.subscribe(subject, cb=on_msg))
        return self

    async def wait_for(self, pred: Callable, timeout: float = WAIT, after: int = 0):
        async def find():
            async with self._changed:
                while True:
                    for m in self.messages[after:]:
                        if pred(m):
                            return m
                    await self._changed.wait()

        try:
            return await asyncio.wait_for(find(), timeout)
        except TimeoutError:
            seen = "\n  ".join(repr(m)[:300] for m in self.messages[after:][-15:])
            raise AssertionError(
                f"no matching message within {timeout}s; last seen:\n  {seen}"
            ) from None

    def statuses(self, shard_id: str) -> list[c.ShardStatus]:
        return [m for m in self.messages if isinstance(m, c.ShardStatus) and m.shard_id == shard_id]

    def states(self, shard_id: str) -> list[c.ShardState]:
        return [m.state for m in self.statuses(shard_id)]


def status(shard_id: str, state: c.ShardState, key: str | None = None) -> Callable:
    return lambda m: (
        isinstance(m, c.ShardStatus)
        and m.shard_id == shard_id
        and m.state == state
        and (key is None or m.command_key == key)
    )


def agent_config(node: str, nats_url: str, state_dir: Path, **kw) -> AgentConfig:
    base = localservers.free_port()
    values = dict(
        node_id=node,
        nats=nats_url,
        labels={"fabric": "ib-a", "zone": "z1"},
        fake_gpus="4x80GiB",
        engine_port_range=f"{base}-{base + 40}",
        state_dir=str(state_dir),
        heartbeat_interval_seconds=0.2,
        load_interval_seconds=0.1,
        ready_poll_seconds=0.05,
        drain_settle_seconds=0.3,
        admin_listen="",  # several agents share a process; test_agent_admin covers the listener
    )
    values.update(kw)
    return AgentConfig(**values)


@contextlib.asynccontextmanager
async def running_agent(cfg: AgentConfig) -> AsyncIterator[Agent]:
    """An in-process agent; on exit it stops, and every engine it launched is killed."""
    sd = StateDir(Path(cfg.state_dir)).open()
    agent = Agent(
        cfg, cfg.node_id, discover(cfg.node_id, cfg.fake_gpus, "127.0.0.1"), sd, engines.detect(cfg)
    )
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), WAIT)
        yield agent
    finally:
        agent.stop()
        await asyncio.wait_for(task, WAIT)
        sd.close()
        kill_engines(agent)


def kill_engines(agent: Agent) -> None:
    for shard in agent.shards.values():
        if shard.rec.pid is not None:
            procs.signal_group(shard.rec.pid, signal.SIGKILL)
        if shard.proc is not None:
            with contextlib.suppress(Exception):
                shard.proc.wait(5)


def start_cmd(node: str, shard_id: str, *, key: str | None = None, gpus=None, **profile):
    prof = dict(engine="sim", gpus_per_shard=1, max_num_seqs=4)
    prof.update(profile)
    return c.StartShard(
        key=key or f"start-{shard_id}",
        node=node,
        shard_id=shard_id,
        model=f"model-{shard_id}",
        replica_id=f"rep-{shard_id}",
        profile=c.ServingProfile(**prof),
        gpus=gpus if gpus is not None else [f"GPU-fake-{node}-0"],
    )


async def complete(url: str, model: str, max_tokens: int = 8) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": "hello there", "max_tokens": max_tokens},
        )
    resp.raise_for_status()
    return resp.json()


def engine_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.fixture
async def watch(nats) -> AsyncIterator[Watch]:
    await bus.provision(nats.jetstream())
    yield await Watch().start(nats, "llmgw.evt.agent.>", subjects.LOAD_ALL)


# ---------------------------------------------------------------- tests


async def test_register_start_heartbeat_and_repeated_start(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config("n-life", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        reg = await watch.wait_for(lambda m: isinstance(m, c.NodeRegistered))
        assert reg.node == "n-life" and reg.boot_id == agent.boot_id
        assert sorted(reg.gpus) == [f"GPU-fake-n-life-{i}" for i in range(4)]
        assert reg.labels == {"fabric": "ib-a", "zone": "z1"} and "sim" in reg.engines
        assert reg.host.fake_gpus and reg.shards == []

        cmd = start_cmd("n-life", "a", gpus=["GPU-fake-n-life-2"])
        await bus.publish(js, cmd)
        ready = await watch.wait_for(status("a", S.READY))
        assert watch.states("a") == [S.LAUNCHING, S.LOADING, S.READY]
        assert all(m.command_key == cmd.key for m in watch.statuses("a"))
        assert ready.url.startswith("http://127.0.0.1:") and ready.max_running == 4
        assert ready.gpus == ["GPU-fake-n-life-2"]
        body = await complete(ready.url, "model-a")
        assert body["choices"][0]["text"]
        pid = agent.shards["a"].rec.pid
        env = engine_env(pid)
        assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

        # Heartbeats: the latest per node is kept in its stream, listing the shard.
        hb = await eventually(
            lambda: last_heartbeat(js, "n-life"), lambda h: h.shards == {"a": S.READY}
        )
        assert hb.boot_id == agent.boot_id and hb.seq >= 1
        await eventually(lambda: last_heartbeat(js, "n-life"), lambda h: h.seq > hb.seq)

        # The reconciler re-issues a command it has not seen answered: same key, and a new key.
        seen = len(watch.messages)
        await bus.publish(js, c.StartShard(**{**_fields(cmd), "id": c.new_id()}))
        await bus.publish(js, c.StartShard(**{**_fields(cmd), "id": c.new_id(), "key": "k2"}))
        await watch.wait_for(status("a", S.READY, "k2"), after=seen)
        assert [m.command_key for m in watch.statuses("a")[-2:]] == [cmd.key, "k2"]
        assert S.LAUNCHING not in [m.state for m in watch.messages[seen:] if hasattr(m, "state")]
        assert agent.shards["a"].rec.pid == pid and procs.process_start(pid) is not None


async def last_heartbeat(js, node: str) -> c.Heartbeat:
    msg = await js.get_last_msg(subjects.HEARTBEATS_STREAM, subjects.heartbeat(node))
    return c.decode(msg.data, c.Heartbeat)


async def last_registration(js, node: str) -> c.NodeRegistered:
    msg = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.agent_event(node, "registered"))
    return c.decode(msg.data, c.NodeRegistered)


async def eventually(get, pred, timeout: float = WAIT):
    """Poll `await get()` until `pred` holds for its value; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await get()
        if pred(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still {value!r} after {timeout}s")
        await asyncio.sleep(0.05)


def _fields(msg) -> dict:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}


async def test_load_samples_reflect_load_then_drain_waits_for_requests(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    cfg = agent_config("n-load", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        cmd = start_cmd("n-load", "b", engine_args=["--itl-ms", "25"])
        await bus.publish(js, cmd)
        ready = await watch.wait_for(status("b", S.READY))
        idle = await watch.wait_for(lambda m: isinstance(m, c.LoadSample) and m.shard_id == "b")
        assert idle.running == 0 and idle.url == ready.url and idle.model == "model-b"
        assert idle.block_size == 16 and idle.num_blocks > 0

        # Three requests of 40 tokens at 25 ms per step keep the engine busy for about a second.
        seen = len(watch.messages)
        busy = [asyncio.create_task(complete(ready.url, "model-b", 40)) for _ in range(3)]
        sample = await watch.wait_for(
            lambda m: isinstance(m, c.LoadSample) and m.running == 3, after=seen
        )
        assert sample.kv_usage > 0 and sample.sampled_at > 0

        # Drain with requests in flight: draining at once, stopped only after they finished.
        drain = c.DrainShard(key="drain-b", node="n-load", shard_id="b", deadline_seconds=30)
        await bus.publish(js, drain)
        await watch.wait_for(status("b", S.DRAINING, "drain-b"))
        assert not any(t.done() for t in busy)
        results = await asyncio.gather(*busy)
        finished_at = time.time()
        assert all(r["usage"]["completion_tokens"] == 40 for r in results)
        stopped = await watch.wait_for(status("b", S.STOPPED, "drain-b"))
        assert stopped.ts >= finished_at - 0.5
        assert watch.states("b")[-2:] == [S.DRAINING, S.STOPPED]
        assert procs.process_start(agent.shards["b"].rec.pid) is None


async def test_stop_and_drain_deadline(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config("n-stop", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        await bus.publish(js, start_cmd("n-stop", "c"))
        await bus.publish(
            js,
            start_cmd(
                "n-stop",
                "d",
                gpus=["GPU-fake-n-stop-1"],
                engine_args=["--itl-ms", "50", "--drain-seconds", "0.2"],
            ),
        )
        await watch.wait_for(status("c", S.READY))
        ready_d = await watch.wait_for(status("d", S.READY))

        await bus.publish(
            js, c.StopShard(key="stop-c", node="n-stop", shard_id="c", grace_seconds=5)
        )
        await watch.wait_for(status("c", S.STOPPED, "stop-c"))
        assert procs.process_start(agent.shards["c"].rec.pid) is None
        # Stopping an unknown shard, or a stopped one again, is answered, not an error.
        await bus.publish(js, c.StopShard(key="stop-x", node="n-stop", shard_id="x"))
        await watch.wait_for(status("x", S.STOPPED, "stop-x"))

        # A request far longer than the drain deadline (400 tokens at 50 ms): the deadline wins
        # and the engine is stopped under it (the simulator aborts in-flight work on SIGTERM).
        long = asyncio.create_task(complete(ready_d.url, "model-d", 400))
        await watch.wait_for(
            lambda m: isinstance(m, c.LoadSample) and m.shard_id == "d" and m.running == 1
        )
        await bus.publish(
            js, c.DrainShard(key="drain-d", node="n-stop", shard_id="d", deadline_seconds=1)
        )
        await watch.wait_for(status("d", S.STOPPED, "drain-d"))
        try:
            cut = await long
        except httpx.HTTPError:
            pass
        else:
            assert cut["usage"]["completion_tokens"] < 400
        # The freed GPU can be used again by a new shard.
        await bus.publish(js, start_cmd("n-stop", "e", gpus=["GPU-fake-n-stop-1"]))
        await watch.wait_for(status("e", S.READY))


async def test_crashes_report_failed_with_exit_code_and_output_tail(
    nats, nats_url, watch, tmp_path
):
    js = nats.jetstream()
    cfg = agent_config("n-crash", nats_url, tmp_path / "state")
    async with running_agent(cfg) as agent:
        # Dies while loading: the simulator rejects an unknown flag.
        await bus.publish(js, start_cmd("n-crash", "f", engine_args=["--no-such-flag"]))
        failed = await watch.wait_for(status("f", S.FAILED))
        assert failed.exit_code == 2 and "while loading" in failed.reason
        assert any("--no-such-flag" in line for line in failed.output_tail)
        assert failed.command_key == "start-f"

        # Dies while serving: the engine is killed under the agent; it is not restarted.
        await bus.publish(js, start_cmd("n-crash", "g", gpus=["GPU-fake-n-crash-1"]))
        await watch.wait_for(status("g", S.READY))
        os.kill(agent.shards["g"].rec.pid, signal.SIGKILL)
        failed = await watch.wait_for(status("g", S.FAILED))
        assert failed.exit_code == -signal.SIGKILL and "killed by SIGKILL" in failed.reason
        assert failed.output_tail  # the engine's own log lines
        await asyncio.sleep(0.5)
        assert watch.states("g") == [S.LAUNCHING, S.LOADING, S.READY, S.FAILED]


async def test_invalid_profiles_fail_fast_with_the_reason(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config("n-bad", nats_url, tmp_path / "state", vllm_command=["/nonexistent/vllm"])
    async with running_agent(cfg):
        cases = {
            "tp": (start_cmd("n-bad", "tp", gpus_per_shard=2), "tensor parallel size"),
            "gpu": (start_cmd("n-bad", "gpu", gpus=["GPU-nope"]), "GPU GPU-nope does not exist"),
            "mem": (
                start_cmd("n-bad", "mem", min_gpu_memory_bytes=141 << 30),
                "the profile needs 141.0 GiB",
            ),
            "vllm": (start_cmd("n-bad", "vllm", engine="vllm"), "engine vllm is not installed"),
            "path": (
                start_cmd("n-bad", "path", model_ref="/no/such/model"),
                "model path /no/such/model does not exist",
            ),
        }
        for cmd, _ in cases.values():
            await bus.publish(js, cmd)
        for shard_id, (cmd, reason) in cases.items():
            failed = await watch.wait_for(status(shard_id, S.FAILED))
            assert reason in failed.reason and failed.command_key == cmd.key
            assert watch.states(shard_id) == [S.FAILED]  # nothing was launched

        # A GPU in use by another shard.
        await bus.publish(js, start_cmd("n-bad", "h1", gpus=["GPU-fake-n-bad-3"]))
        await bus.publish(js, start_cmd("n-bad", "h2", gpus=["GPU-fake-n-bad-3"]))
        failed = await watch.wait_for(status("h2", S.FAILED))
        assert "GPU GPU-fake-n-bad-3 (index 3) is in use by shard h1" in failed.reason

        # A malformed command is dead-lettered; the consumer keeps going.
        await js.publish(subjects.commands("n-bad"), b'{"type": "cmd.shard.start", "key": 1}')
        await bus.publish(js, start_cmd("n-bad", "ok", gpus=["GPU-fake-n-bad-1"]))
        await watch.wait_for(status("ok", S.READY))


async def test_nats_restart_under_the_agent(tmp_path):
    server = localservers.NatsServer(tmp_path / "nats").start()
    try:
        nc = await bus.connect(server.url, name="test")
        js = nc.jetstream()
        await bus.provision(js)
        watch = await Watch().start(nc, "llmgw.evt.agent.>")
        cfg = agent_config("n-re", server.url, tmp_path / "state")
        async with running_agent(cfg) as agent:
            await bus.publish(js, start_cmd("n-re", "r"))
            ready = await watch.wait_for(status("r", S.READY))
            first = await last_registration(js, "n-re")

            await asyncio.to_thread(server.restart)
            # Engines keep serving while the control plane's bus is away and back.
            await complete(ready.url, "model-r")
            # Read from the stream, as the reconciler does: the agent may re-register before
            # this test's own client has reconnected.
            again = await eventually(
                lambda: last_registration(js, "n-re"), lambda m: m.id != first.id
            )
            assert again.boot_id == agent.boot_id == first.boot_id
            assert [(s.shard_id, s.state) for s in again.shards] == [("r", S.READY)]
            # Commands still arrive through the node's durable consumer.
            await bus.publish(js, c.StopShard(key="stop-r", node="n-re", shard_id="r"))
            await watch.wait_for(status("r", S.STOPPED, "stop-r"))
            hb = await eventually(lambda: last_heartbeat(js, "n-re"), lambda h: h.shards == {})
            assert hb.boot_id == agent.boot_id
        await bus.close_quietly(nc)
    finally:
        server.stop()


async def test_lost_streams_are_recreated_and_the_consumer_rebound(nats, nats_url, watch, tmp_path):
    js = nats.jetstream()
    cfg = agent_config("n-lost", nats_url, tmp_path / "state")
    async with running_agent(cfg):
        # A NATS that lost its storage: the commands stream and the node's consumer are gone.
        await js.delete_stream(subjects.COMMANDS_STREAM)
        await eventually(lambda: _stream_exists(js, subjects.COMMANDS_STREAM), bool)
        await bus.publish(js, start_cmd("n-lost", "after"))
        await watch.wait_for(status("after", S.READY))


async def _stream_exists(js, name: str) -> bool:
    try:
        await js.stream_info(name)
    except Exception:
        return False
    return True
