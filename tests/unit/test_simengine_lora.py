"""The simulator's LoRA adapters: vLLM's answers, slots with least-recently-used eviction,
one load per adapter however many requests wait, the on-demand baseline, and KV events
whose canonical hashes start at the adapter's root."""

import asyncio

import pytest

from llmgw import kvblocks, kvwire
from llmgw.agent.kvrelay import BlockSet
from llmgw.simengine import kvevents, tokens
from llmgw.simengine.engine import Request
from llmgw.simengine.lora import Adapters
from llmgw.simengine.protocol import ApiError


def adapters(max_loras=2, **kw) -> Adapters:
    return Adapters("base", max_loras, path_exists=lambda p: p.startswith("/ok"), **kw)


async def test_load_and_unload_answer_as_vllm_does():
    a = adapters()
    assert await a.load("a1", "/ok/1") == "Success: LoRA adapter 'a1' added successfully."
    with pytest.raises(ApiError) as again:
        await a.load("a1", "/ok/2")
    assert again.value.status == 400 and "set 'load_inplace' to True" in again.value.message
    with pytest.raises(ApiError) as bad:
        await a.load("b", "/missing")
    assert bad.value.status == 404 and bad.value.type == "NotFoundError"
    assert bad.value.message == "Loading lora b failed: No adapter found for /missing"
    assert await a.load("a1", "/ok/2", inplace=True)  # in place swaps the path
    assert a.registered == {"a1": "/ok/2"}
    assert a.unload("a1") == "Success: LoRA adapter 'a1' removed successfully."
    with pytest.raises(ApiError) as gone:
        a.unload("a1")
    assert (
        gone.value.status == 404 and gone.value.message == "The lora adapter 'a1' cannot be found."
    )
    assert not a.serves("a1")


async def test_without_slots_loading_is_refused():
    with pytest.raises(ApiError) as err:
        await adapters(max_loras=0).load("a1", "/ok/1")
    assert err.value.status == 400 and "--max-loras" in err.value.message


async def test_slots_evict_the_least_recently_used_and_reloads_are_counted():
    a = adapters(max_loras=2)
    for name in ("a1", "a2"):
        await a.load(name, f"/ok/{name}")
    await a.acquire("a1")  # a1 used last: a2 is the eviction victim
    await a.load("a3", "/ok/a3")
    assert list(a.resident) == ["a1", "a3"] and a.loads == 3 and a.evictions == 1
    assert a.serves("a2")  # still registered: served, after a load from its path
    await a.acquire("a2")
    assert list(a.resident) == ["a3", "a2"] and a.loads == 4


async def test_requests_waiting_for_one_adapter_share_one_load():
    a = adapters(load_seconds=0.05)
    a.registered["a1"] = "/ok/1"
    await asyncio.gather(*(a.acquire("a1") for _ in range(5)))
    assert a.loads == 1


async def test_on_demand_serves_any_name_and_loads_it_on_first_use():
    a = adapters(max_loras=1, on_demand=True)
    assert a.serves("anything")
    await a.acquire("t1")
    await a.acquire("t2")
    await a.acquire("t1")
    assert a.loads == 3 and a.evictions == 2
    with pytest.raises(ApiError) as err:
        await adapters().acquire("undeclared")
    assert err.value.status == 404 and err.value.param == "model"


def test_adapter_blocks_hash_apart_from_the_base_models():
    prompt = b"P" * 64
    plain = tokens.block_hashes(prompt, 4, tokens.salt_seed(None))
    lora = tokens.block_hashes(prompt, 4, tokens.salt_seed(None, "a1"))
    other = tokens.block_hashes(prompt, 4, tokens.salt_seed(None, "a2"))
    assert not set(plain) & set(lora) and not set(lora) & set(other)


def test_adapter_kv_events_carry_its_name_and_relay_to_its_root():
    sent: list = []
    pub = kvevents.Publisher.__new__(kvevents.Publisher)
    pub.block_size = 4
    pub._add = sent.append  # type: ignore[method-assign]
    prompt = b"Q" * 48
    hashes = tokens.block_hashes(prompt, 4, tokens.salt_seed("s", "a1"))
    req = Request(12, 1, prompt=prompt, block_hashes=hashes, cache_salt="s", lora_name="a1")
    pub.stored(req, [0, 1, 2])
    # vLLM's extra keys: the adapter on every block, the salt after it on the first.
    assert sent[0].lora_name == "a1"
    assert sent[0].extra_keys == [["a1", "s"], ["a1"], ["a1"]]
    events = kvwire.parse_frames([b"kv", (0).to_bytes(8, "big"), kvwire.encode_batch(1.0, sent)])[2]
    got = [h for op in BlockSet().apply(events) for h in op.hashes]
    ids = kvblocks.byte_tokens(prompt)
    expected = kvblocks.prompt_hashes(
        ids, 4, 3, root=kvblocks.root_for("a1"), first_extra=kvblocks.salt_extra("s")
    )
    assert got == expected


async def test_an_adapter_of_a_rank_above_the_limit_is_refused_as_vllm_refuses_it(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 32}')
    a = Adapters("base", 2, max_rank=16)
    with pytest.raises(ApiError) as err:
        await a.load("big", str(tmp_path))
    assert err.value.status == 500 and err.value.type == "InternalServerError"
    assert err.value.message == "LoRA rank 32 is greater than max_lora_rank 16."
    assert not a.serves("big")
