"""How long the agent's KV relay takes to rebuild an engine's block set from a full replay
buffer, as when a restarted agent adopts a busy engine.

    .venv/bin/python tests/bench/bench_kv_replay.py [--batches 10000]

An engine process (the simulator's publisher, which answers replay requests as vLLM's
does, from a thread) sends `--batches` batches (vLLM's default buffer is 10,000), each
one BlockStored of 4 blocks of 16 tokens chained on the previous batch's last block,
while no relay listens. A relay then binds and asks for the whole buffer
(llmgw.agent.kvrelay, `engine_running=True`); the time is from that moment until every
batch is applied. The engine's ROUTER drops replies past its high-water mark (1,000)
when the relay reads slowly; the relay asks again from the hole, so the rounds it
needed are printed too.

Target: the whole default buffer within the relay's replay deadline (5 s), with no gap
left: past the deadline the relay gives up and the set misses the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
import time

import zmq.asyncio

from llmgw import kvwire
from llmgw.agent.kvrelay import EngineRelay

BS = 16
PER_BATCH = 4


def engine(endpoint: str, replay_endpoint: str, batches: int, ready, stop) -> None:
    from llmgw.simengine import kvevents

    cfg = kvevents.parse_config(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "buffer_steps": batches,
                "topic": "kv",
            }
        )
    )
    pub = kvevents.Publisher(cfg, BS)
    parent = None
    for b in range(batches):
        hashes = [b * PER_BATCH + i + 1 for i in range(PER_BATCH)]
        tokens = [(b * 7919 + i) % 50_000 for i in range(PER_BATCH * BS)]
        pub._pending.append(
            kvwire.BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )  # fmt: skip
        )
        pub.flush()
        parent = hashes[-1]
    ready.set()
    stop.wait(120)
    pub.close()


async def measure(batches: int) -> tuple[float, EngineRelay]:
    ctx = zmq.asyncio.Context()
    sockets = tempfile.mkdtemp(prefix="kv")  # the engine binds both, as for the agent
    endpoint, replay_endpoint = f"ipc://{sockets}/e.ev", f"ipc://{sockets}/e.rp"
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    proc = spawn.Process(target=engine, args=(endpoint, replay_endpoint, batches, ready, stop))
    proc.start()
    try:
        await asyncio.to_thread(ready.wait, 120)

        async def publish(subject: str, data: bytes) -> None:
            pass

        relay = EngineRelay(
            "n1", "s1", publish=publish, endpoint=endpoint, context=ctx,
            replay_endpoint=replay_endpoint,
        )  # fmt: skip
        began = time.perf_counter()
        relay.start(engine_running=True)
        while relay.replaying:
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - began
        await relay.close()
        return elapsed, relay
    finally:
        stop.set()
        proc.join(30)
        ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=10_000)
    args = ap.parse_args()
    elapsed, relay = asyncio.run(measure(args.batches))
    whole = relay.last_seq == args.batches - 1 and relay.engine_gaps == 0
    blocks = len(relay.blocks.hashes())
    print(
        f"replayed {relay.replayed} of {args.batches} batches ({blocks} blocks) in "
        f"{elapsed:.2f} s, {relay.replays} request(s), gaps left {relay.engine_gaps}"
    )
    ok = whole and elapsed <= relay.replay_timeout and blocks == args.batches * PER_BATCH
    print(f"target: whole buffer within {relay.replay_timeout:.0f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
