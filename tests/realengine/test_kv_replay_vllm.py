"""Real vLLM's KV event replay socket, asked by the agent's relay: batches lost between the
engine and the relay come back, and a relay connected again (an agent restart adopting the
engine) rebuilds the block set from the engine's buffer, blocks stored while it was away
included. One vLLM (the tiny random model), launched with the flags the agent writes.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import pytest

from llmgw import contracts as c
from llmgw import kvblocks, subjects
from llmgw.agent import kvsockets
from llmgw.agent.kvrelay import EngineRelay, KvRelays
from llmgw.agent.launch import LaunchContext, kv_events_args
from llmgw.router.kvcache.tokens import HfTokens
from tests.realengine import test_sim_parity as parity_test
from tests.realengine.test_sim_parity import MODEL, _started, launch_vllm

tiny = parity_test.tiny  # the fixture: the tiny model, built once per module

pytestmark = pytest.mark.real_engine


def prompt(name: str) -> str:
    # Distinct from the first byte, so each prompt's blocks are its own (vLLM's CPU blocks
    # are 128 tokens; this is a few of them with the tiny model's byte-level tokenizer).
    return f"{name}: the quick brown fox jumps over the lazy dog, again and again. " * 6


async def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


async def test_vllm_replays_kv_events_the_relay_missed(nats, tiny, vllm_python, tmp_path):
    relays = KvRelays("n-real", kvsockets.prepare(tmp_path / kvsockets.DIR_NAME))
    await relays.attach(nats)
    relay = relays.open("v0")
    dropping = False
    dropped = 0

    def tap(r: EngineRelay) -> None:
        live = r.receive

        def lossy(parts: list[bytes]) -> None:
            nonlocal dropped
            if dropping:
                dropped += 1
            else:
                live(parts)

        r.receive = lossy  # type: ignore[method-assign]

    tap(relay)
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="", command=[],
        kv_events_endpoint=relay.endpoint, kv_replay_endpoint=relay.replay_endpoint,
    )  # fmt: skip
    flags = kv_events_args(ctx)
    vllm = await asyncio.to_thread(
        lambda: _started(launch_vllm(vllm_python, tiny, tmp_path / "vllm.log", *flags))
    )
    tokenizer = HfTokens(str(tiny))

    def hashes(text: str, block_size: int) -> set[int]:
        tokens = tokenizer.tokens(msgspec.json.encode(text))
        return set(kvblocks.prompt_hashes(tokens, block_size, len(tokens) // block_size))

    try:
        relay.url = vllm.url
        async with httpx.AsyncClient(timeout=120) as http:

            async def complete(text: str) -> None:
                r = await http.post(
                    f"{vllm.url}/v1/completions",
                    json={"model": MODEL, "prompt": text, "max_tokens": 1},
                )
                r.raise_for_status()

            await complete(prompt("first"))
            await wait_for(lambda: relay.blocks.block_size > 0, what="vLLM's first BlockStored")
            bs = relay.blocks.block_size
            await wait_for(lambda: hashes(prompt("first"), bs) <= set(relay.blocks.hashes()))

            # 1. The link drops what the engine sends while it prefills a prompt.
            dropping = True
            await complete(prompt("lost"))
            await wait_for(lambda: dropped >= 1, what="a lost batch")
            dropping = False
            await complete(prompt("after"))  # its batch shows the gap
            lost = hashes(prompt("lost"), bs)
            await wait_for(lambda: lost <= set(relay.blocks.hashes()), what="lost blocks back")
            assert relay.engine_gaps == 0 and relay.replayed >= 1
            everything = set(relay.blocks.hashes())

            # 2. The relay goes and comes back to its sockets while the engine stores more.
            endpoints = relay.endpoint, relay.replay_endpoint
            await relays.close("v0")
            await complete(prompt("meanwhile"))
            relay = relays.open("v0", endpoints, engine_running=True)
            relay.url = vllm.url
            expected = everything | hashes(prompt("meanwhile"), bs)
            await wait_for(lambda: expected <= set(relay.blocks.hashes()), what="set rebuilt")
            assert relay.engine_gaps == 0
            reply = await nats.request(
                subjects.kv_snapshot("n-real", "v0"),
                c.encode(c.KvSnapshotRequest(node="n-real", shard_id="v0")),
                timeout=10,
            )
            snap = c.decode(reply.data, c.KvSnapshot)
            assert expected <= set(snap.hashes)
            print(
                f"\nvLLM block size {bs}: {dropped} batches dropped and replayed, "
                f"{relay.replayed} batches replayed on re-attach, {len(expected)} blocks"
            )
    finally:
        await asyncio.to_thread(vllm.stop)
        await relays.stop()
