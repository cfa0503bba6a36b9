"""Agent benchmark: how fast it answers, launches, re-registers and samples load.

    .venv/bin/python tests/bench/bench_agent.py

Starts its own nats-server and an in-process agent with fake GPUs launching real sim
engines, then measures, from the control plane's side of NATS:
  - a StartShard that fails validation -> `failed` status (target p99 <= 50 ms)
  - a StartShard -> `ready` for a sim engine (process start + /health; reported, no target)
  - a NATS restart -> a fresh NodeRegistered in the stream (target <= 3 s after the server is back)
  - load samples per engine per second at the default interval (target >= 3/s)
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmgw import bus, subjects  # noqa: E402
from llmgw import contracts as c  # noqa: E402
from llmgw.agent import engines, procs  # noqa: E402
from llmgw.agent.agent import Agent  # noqa: E402
from llmgw.agent.config import AgentConfig  # noqa: E402
from llmgw.agent.inventory import discover  # noqa: E402
from llmgw.agent.state import StateDir  # noqa: E402
from llmgw.dev import servers as localservers  # noqa: E402

S = c.ShardState
NODE = "bench-node"


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-agent-"))
    server = localservers.NatsServer(tmp / "nats").start()
    results: list[tuple[str, str, bool]] = []
    agent = None
    sd = None
    task = None
    try:
        nc = await bus.connect(server.url, name="bench")
        js = nc.jetstream()
        await bus.provision(js)
        statuses: asyncio.Queue = asyncio.Queue()
        samples: list[c.LoadSample] = []

        async def on_status(msg) -> None:
            await statuses.put((time.perf_counter(), c.decode(msg.data)))

        async def on_load(msg) -> None:
            samples.append(c.decode(msg.data))

        await nc.subscribe(subjects.agent_event(NODE, "shard"), cb=on_status)
        await nc.subscribe(subjects.load(NODE), cb=on_load)

        base = localservers.free_port()
        cfg = AgentConfig(
            node_id=NODE,
            nats=server.url,
            fake_gpus="8x80GiB",
            engine_port_range=f"{base}-{base + 50}",
            state_dir=str(tmp / "state"),
            admin_listen="",
        )
        sd = StateDir(tmp / "state").open()
        agent = Agent(
            cfg, NODE, discover(NODE, cfg.fake_gpus, "127.0.0.1"), sd, engines.detect(cfg)
        )
        task = asyncio.create_task(agent.run())
        await asyncio.wait_for(agent.registered.wait(), 20)

        async def until(pred, timeout=30.0):
            deadline = time.perf_counter() + timeout
            while True:
                at, msg = await asyncio.wait_for(statuses.get(), deadline - time.perf_counter())
                if pred(msg):
                    return at, msg

        def start(shard: str, **profile) -> c.StartShard:
            return c.StartShard(
                key=f"k-{shard}",
                node=NODE,
                shard_id=shard,
                model="m",
                replica_id=f"r-{shard}",
                profile=c.ServingProfile(engine="sim", **profile),
                gpus=[f"GPU-fake-{NODE}-0"],
            )

        # 1. Validation failures, answered.
        lat = []
        for i in range(200):
            cmd = start(f"bad-{i}", gpus_per_shard=2)
            t0 = time.perf_counter()
            await bus.publish(js, cmd)
            at, _ = await until(lambda m, s=cmd.shard_id: m.shard_id == s and m.state == S.FAILED)
            lat.append((at - t0) * 1000)
        p50, p99 = statistics.median(lat), pct(lat, 0.99)
        results.append(
            ("invalid StartShard -> failed", f"p50 {p50:.1f} ms, p99 {p99:.1f} ms", p99 <= 50)
        )

        # 2. Launch to ready.
        ready = []
        for i in range(3):
            cmd = start(f"ok-{i}")
            cmd.gpus = [f"GPU-fake-{NODE}-{i}"]
            t0 = time.perf_counter()
            await bus.publish(js, cmd)
            at, _ = await until(lambda m, s=cmd.shard_id: m.shard_id == s and m.state == S.READY)
            ready.append(at - t0)
        results.append(
            ("StartShard -> ready (sim engine)", f"median {statistics.median(ready):.2f} s", True)
        )

        # 3. Load samples per engine per second.
        samples.clear()
        await asyncio.sleep(3.0)
        per_engine = len(samples) / 3 / 3.0
        results.append(("load samples per engine", f"{per_engine:.1f}/s", per_engine >= 3))

        # 4. Re-registration after a NATS restart.
        before = await js.get_last_msg(
            subjects.EVENTS_STREAM, subjects.agent_event(NODE, "registered")
        )
        await asyncio.to_thread(server.restart)
        back = time.perf_counter()
        while True:
            try:
                last = await js.get_last_msg(
                    subjects.EVENTS_STREAM, subjects.agent_event(NODE, "registered")
                )
                if last.seq != before.seq:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.02)
        took = time.perf_counter() - back
        results.append(("NATS restart -> re-registered", f"{took:.2f} s", took <= 3))
        await bus.close_quietly(nc)
    finally:
        if agent is not None:
            agent.stop()
            await asyncio.wait_for(task, 20)
            for shard in agent.shards.values():
                if shard.rec.pid:
                    procs.signal_group(shard.rec.pid, signal.SIGKILL)
        if sd is not None:
            sd.close()
        server.stop()
    ok = True
    for name, figure, passed in results:
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}  {name:36} {figure}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
