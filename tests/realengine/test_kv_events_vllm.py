"""Real vLLM's KV events through the agent's relay to the bus, and the router's prompt hashes
matching them: the path that precise prefix routing relies on, on a real engine.

One vLLM (the tiny random model) publishes to a relay (llmgw.agent.kvrelay) connected as
the agent connects it, over ipc:// sockets; the raw ZMQ messages are also compared with what the simulator sends.
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
from llmgw.router.kvcache.tokens import HfTokens, engine_prompt
from tests.realengine import test_sim_parity as parity_test
from tests.realengine.test_sim_parity import MODEL, _started, launch_vllm

tiny = parity_test.tiny  # the fixture: the tiny model, built once per module

pytestmark = pytest.mark.real_engine

PROMPT = "The quick brown fox jumps over the lazy dog, again and again. " * 12
# vLLM >= 0.10 sends each event as a map in its Struct's field order; so does the sim.
STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
]


def agent_flags(relay: EngineRelay) -> list[str]:
    """The `--kv-events-config` the agent gives the relay's engine."""
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="", command=[],
        kv_events_endpoint=relay.endpoint, kv_replay_endpoint=relay.replay_endpoint,
    )  # fmt: skip
    return kv_events_args(ctx)


async def test_vllm_kv_events_reach_the_bus_with_the_hashes_routers_compute(
    nats,
    tiny,
    vllm_python,
    tmp_path,
):
    relays = KvRelays("n-real", kvsockets.prepare(tmp_path / kvsockets.DIR_NAME))
    await relays.attach(nats)
    relay = relays.open("v0")
    raw: list[list[bytes]] = []
    receive = relay.receive

    def record(parts: list[bytes]) -> None:
        raw.append(parts)
        receive(parts)

    relay.receive = record  # type: ignore[method-assign]
    events: list = []

    async def on_msg(msg) -> None:
        events.append(c.decode(msg.data, c.KvEvents))

    sub = await nats.subscribe(subjects.kv_events("n-real", "v0"), cb=on_msg)
    flags = agent_flags(relay)
    python = vllm_python
    vllm = await asyncio.to_thread(
        lambda: _started(launch_vllm(python, tiny, tmp_path / "vllm.log", *flags))
    )
    try:
        relay.url = vllm.url
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(
                f"{vllm.url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
            )
            r.raise_for_status()
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not relay.blocks.hashes():
            await asyncio.sleep(0.05)
        block_size = relay.blocks.block_size
        assert block_size > 0, "no BlockStored from vLLM reached the relay"

        # The router's view of the prompt: the model's own tokenizer, as vLLM tokenizes it.
        router_tokens = HfTokens(str(tiny))
        tokens = router_tokens.tokens(msgspec.json.encode(PROMPT))
        assert len(tokens) == prompt_tokens
        # Chats too: the template from chat_template.jinja (where transformers saves it),
        # and each turn after the first tokenized from the one before (splice.py), id for
        # id as vLLM's /tokenize renders and tokenizes them.
        messages = [{"role": "system", "content": "Answer briefly.\n" + PROMPT}]
        async with httpx.AsyncClient(timeout=60) as http:
            for turn in range(3):
                messages.append({"role": "user", "content": f"Question {turn}: and then?"})
                r = await http.post(
                    f"{vllm.url}/tokenize",
                    json={"model": MODEL, "messages": messages, "add_generation_prompt": True},
                )
                r.raise_for_status()
                assert router_tokens.tokens(msgspec.json.encode(messages)) == r.json()["tokens"]
                messages.append({"role": "assistant", "content": f"Answer {turn}."})
        assert router_tokens.chat_ids.__self__.spliced >= 2
        expected = kvblocks.prompt_hashes(tokens, block_size, prompt_tokens // block_size)
        assert expected and set(expected) <= set(relay.blocks.hashes())

        # Responses requests: the router's ids of the messages vLLM builds of them
        # (instructions first, a string input as a user message) are the engine's, so
        # the blocks vLLM stores for them are the blocks the router hashes.
        turns = [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Again?"},
        ]
        async with httpx.AsyncClient(timeout=60) as http:
            for shape in (
                {"instructions": "Answer briefly.", "input": PROMPT},
                {"input": turns},
                {"instructions": "Be kind.", "input": turns},
            ):
                body = {"model": MODEL, "max_output_tokens": 2, **shape}
                r = await http.post(f"{vllm.url}/v1/responses", json=body)
                r.raise_for_status()
                rendered = engine_prompt(
                    msgspec.json.encode(body), msgspec.json.encode(shape["input"]), True
                )
                assert rendered is not None, shape
                ids = router_tokens.tokens(rendered)
                assert ids is not None and len(ids) == r.json()["usage"]["input_tokens"], shape
                want = set(kvblocks.prompt_hashes(ids, block_size, len(ids) // block_size))
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not want <= set(relay.blocks.hashes()):
                    await asyncio.sleep(0.05)
                assert want and want <= set(relay.blocks.hashes()), shape

        # On the bus: in order, with the engine's sequence numbers.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not events:
            await asyncio.sleep(0.05)
        assert events and events[0].node == "n-real" and events[0].url == vllm.url
        stored = [h for e in events for op in e.ops if op.op is c.KvOp.STORED for h in op.hashes]
        assert set(expected) <= set(stored)
        reply = await nats.request(
            subjects.kv_snapshot("n-real", "v0"),
            c.encode(c.KvSnapshotRequest(node="n-real", shard_id="v0")),
            timeout=10,
        )
        snap = c.decode(reply.data, c.KvSnapshot)
        assert set(expected) <= set(snap.hashes) and snap.block_size == block_size

        # Field by field, vLLM's frames look like the simulator's.
        topic, seq, payload = raw[0]
        assert topic == b"kv" and len(seq) == 8
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch[0], float) and isinstance(batch[1], list)
        first = next(e for p in raw for e in msgspec.msgpack.decode(p[2])[1]
                     if e["type"] == "BlockStored")  # fmt: skip
        assert list(first)[: len(STORED_KEYS)] == STORED_KEYS
        print(f"\nvLLM block size {block_size}, {len(raw)} ZMQ batches, "
              f"extra BlockStored keys: {list(first)[len(STORED_KEYS):]}")  # fmt: skip
    finally:
        await asyncio.to_thread(vllm.stop)
        await sub.unsubscribe()
        await relays.stop()


async def test_a_salted_prompt_on_vllm_is_indexed_apart_from_the_unsalted_one(
    nats, tiny, vllm_python, tmp_path
):
    """vLLM keys a salted request's first block by its cache_salt (and says so in the
    event's extra keys): the index must not credit the engine with the unsalted prompt,
    and must credit it with the salted repeat, as the engine's own cache hits do."""
    from llmgw.router.kvcache.index import BlockIndex
    from llmgw.router.kvcache.indexer import Indexer
    from llmgw.router.kvcache.tokens import TOKENIZERS
    from llmgw.router.request import body as rq
    from llmgw.router.scheduling import pipeline as sc
    from llmgw.router.scheduling.cached import CachedPrefixScorer
    from llmgw.router.scheduling.prefix import block_hashes
    from tests.unit.test_router_kvindex import endpoint

    relays = KvRelays("n-salt", kvsockets.prepare(tmp_path / kvsockets.DIR_NAME))
    await relays.attach(nats)
    relay = relays.open("v0")
    flags = agent_flags(relay)
    vllm = await asyncio.to_thread(
        lambda: _started(launch_vllm(vllm_python, tiny, tmp_path / "vllm.log", *flags))
    )
    salted_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "cache_salt": "tenant-a"}
    plain_body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    try:
        relay.url = vllm.url
        async with httpx.AsyncClient(timeout=60) as http:

            async def complete(body) -> None:
                (await http.post(f"{vllm.url}/v1/completions", json=body)).raise_for_status()

            async def cache_hits() -> float:
                text = (await http.get(f"{vllm.url}/metrics")).text
                return sum(
                    float(line.split()[-1])
                    for line in text.splitlines()
                    if line.startswith("vllm:prefix_cache_hits_total")
                )

            await complete(salted_body)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not relay.blocks.hashes():
                await asyncio.sleep(0.05)
            assert relay.blocks.block_size > 0, "no BlockStored from vLLM reached the relay"

            # The router's index, fed the relay's snapshot as a router is.
            reply = await nats.request(
                subjects.kv_snapshot("n-salt", "v0"),
                c.encode(c.KvSnapshotRequest(node="n-salt", shard_id="v0")),
                timeout=10,
            )
            snap = c.decode(reply.data, c.KvSnapshot)
            index = BlockIndex()
            first = c.KvEvents(node="n-salt", shard_id="v0", epoch=snap.epoch,
                               seq_first=snap.seq, seq_last=snap.seq,
                               block_size=snap.block_size, ops=[])  # fmt: skip
            assert index.offer("v0", first)
            index.snapshot("v0", snap)

            # The router's kv_prefix scorer, from the request bodies as a router gets them.
            assert TOKENIZERS.wait(str(tiny), 60) is not None
            scorer = CachedPrefixScorer(sc.Settings(indexer=Indexer(index)))
            scorer.configure(c.SchedulingSpec(tokenizer=str(tiny)))
            eps = [endpoint("v0", engine="vllm")]

            def share(body) -> float:
                req = rq.parse("completions", msgspec.json.encode(body))
                ctx = sc.Context(time.time(), MODEL, prefix=block_hashes(req.prompt, 256, 128))
                ctx.salt = req.cache_salt
                return scorer.overlaps(eps, ctx)[0]

            assert share(plain_body) == 0.0  # the old relay and router said 1.0 here
            assert share({**plain_body, "cache_salt": "tenant-b"}) == 0.0
            assert share(salted_body) > 0.9

            # The engine agrees: the unsalted prompt misses its cache, the salted repeat hits.
            before = await cache_hits()
            await complete(plain_body)
            after_plain = await cache_hits()
            await complete(salted_body)
            after_salted = await cache_hits()
            assert after_plain == before and after_salted > after_plain
            print(f"\nvLLM block size {snap.block_size}, salted share {share(salted_body):.2f}, "
                  f"cache hits {before:.0f} -> {after_plain:.0f} (plain) "
                  f"-> {after_salted:.0f} (salted repeat)")  # fmt: skip
    finally:
        await asyncio.to_thread(vllm.stop)
        await relays.stop()
