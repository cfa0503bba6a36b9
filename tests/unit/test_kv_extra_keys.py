"""Blocks keyed by more than their tokens: vLLM's extra keys (multimodal items, cache_salt,
LoRA) in KV events, the canonical hashes the relay makes of them, the router's salted prompt
hashes, the simulator's salted cache; and SGLang's events and flag."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from llmgw import contracts as c
from llmgw import kvblocks, kvwire
from llmgw.agent import launch
from llmgw.agent.kvrelay import BlockSet
from llmgw.agent.launch import LaunchContext
from llmgw.engines import ENGINES
from llmgw.kvblocks import prompt_hashes, salt_extra
from llmgw.router.kvcache.index import BlockIndex
from llmgw.router.kvcache.indexer import Indexer
from llmgw.router.request import body as rq
from llmgw.router.scheduling import pipeline as sc
from llmgw.router.scheduling.cached import CachedPrefixScorer
from llmgw.router.scheduling.prefix import PrefixIndex, block_hashes
from llmgw.simengine import kvevents, tokens
from llmgw.simengine.engine import Engine, EngineParams, Request
from llmgw.simengine.protocol import ApiError, Limits, RequestParser

from .test_router_kvindex import NOW, chat, endpoint, pipeline, synced

BS = 4
TOKS = list(range(100, 112))  # three blocks of 4


def stored_hashes(*events: kvwire.Event, blocks: BlockSet | None = None) -> list[int]:
    blocks = blocks or BlockSet()
    return [h for op in blocks.apply(list(events)) for h in op.hashes]


def vllm_stored(block_hashes, token_ids, extra_keys=None, lora_name=None, parent=None) -> bytes:
    """A batch as vLLM 0.32 encodes it (kvwire's encoder mirrors its Structs)."""
    return kvwire.encode_batch(
        1.0,
        [
            kvwire.BlockStored(
                block_hashes=block_hashes,
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=lora_name,
                extra_keys=extra_keys,
            )
        ],
    )


def decode(payload: bytes) -> list[kvwire.Event]:
    return kvwire.parse_frames([b"kv", (0).to_bytes(8, "big"), payload])[2]


# ------------------------------------------------------------------ the wire


def test_extra_keys_are_decoded_per_block_and_a_malformed_list_spoils_only_its_store():
    # vLLM publishes each key untagged: an image as [mm_identifier, offset], a salt bare.
    (ev,) = decode(vllm_stored([1, 2, 3], TOKS, [[["img-a", 0]], [["img-a", 0]], None]))
    assert ev.extra_keys == [[["img-a", 0]], [["img-a", 0]], None] and not ev.unusable
    (ev,) = decode(vllm_stored([1, 2, 3], TOKS, [None, None, None]))  # vLLM's plain blocks
    assert ev.extra_keys is None
    for bad in ([["s"]], "salt", [["s"], 5, None]):  # one entry per block, lists or null
        payload = msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None,
                    "token_ids": TOKS, "block_size": BS, "extra_keys": bad},
                   {"type": "BlockRemoved", "block_hashes": [7]}]]
        )  # fmt: skip
        stored, removed = decode(payload)
        assert "extra_keys" in stored.unusable
        assert removed == kvwire.Removed([7])
        # Read as plain tokens, a salted block would match unsalted prompts: not indexed.
        assert stored_hashes(stored) == []


async def test_a_malformed_store_keeps_the_rest_of_its_batch():
    """One bad `extra_keys` list must not lose the batch's evictions: the relay would keep
    crediting evicted blocks, and the batch's number would read as a gap."""
    from llmgw.agent.kvrelay import EngineRelay

    relay = EngineRelay("n1", "s1", publish=None, endpoint="inproc://none", flush_seconds=3600)
    try:

        def stored(hashes, tokens, parent=None, extra_keys=None):
            return kvwire.BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                block_size=BS, lora_id=None, medium=None, lora_name=None,
                extra_keys=extra_keys,
            )  # fmt: skip

        relay.receive(kvwire.frames("kv", 0, kvwire.encode_batch(0.0, [stored([1, 2], TOKS[:8])])))
        batch = [
            kvwire.BlockRemoved(block_hashes=[2], medium=None),
            stored([3, 4], TOKS[4:12], parent=1, extra_keys=[["salt"]]),  # one entry, two blocks
            stored([5], TOKS[4:8], parent=1),
        ]
        relay.receive(kvwire.frames("kv", 1, kvwire.encode_batch(0.0, batch)))
        relay.receive(
            kvwire.frames("kv", 2, kvwire.encode_batch(0.0, [stored([6], TOKS[8:12], 5)]))
        )
        expected = prompt_hashes(TOKS, BS, 9)
        # Block 2 evicted, block 5 (= the second block again) stored, 6 chained on it; the
        # malformed store's blocks are not credited, and a block chained on them is an orphan.
        assert sorted(relay.blocks.hashes()) == sorted(expected)
        assert relay.malformed == 1
        assert relay.last_seq == 2 and relay.engine_gaps == 0
        relay.receive(kvwire.frames("kv", 3, kvwire.encode_batch(0.0, [stored([9], TOKS[:4], 3)])))
        assert relay.blocks.orphans == 1 and relay.engine_gaps == 0
    finally:
        await relay.close()


# ------------------------------------------------------------------ the relay's canonical hashes


def test_multimodal_blocks_never_match_text_blocks_or_another_image():
    plain = stored_hashes(*decode(vllm_stored([1, 2, 3], TOKS)))
    assert plain == prompt_hashes(TOKS, BS, 9)  # what a router computes for the text
    # The same placeholder token ids under two different images, the image in block 1.
    img_a = stored_hashes(*decode(vllm_stored([4, 5, 6], TOKS, [None, [["img-a", 2]], None])))
    img_b = stored_hashes(*decode(vllm_stored([7, 8, 9], TOKS, [None, [["img-b", 2]], None])))
    assert img_a[0] == img_b[0] == plain[0]  # the text before the image still matches
    assert len({img_a[1], img_b[1], plain[1]}) == 3  # the image block: three distinct blocks
    assert len({img_a[2], img_b[2], plain[2]}) == 3  # and every block chained after it
    # The same image at another offset in the block is another block, as in vLLM.
    moved = stored_hashes(*decode(vllm_stored([10, 11, 12], TOKS, [None, [["img-a", 0]], None])))
    assert moved[1] != img_a[1]


def test_a_salted_prefix_matches_only_prompts_hashed_with_the_same_salt():
    salted = stored_hashes(*decode(vllm_stored([1, 2, 3], TOKS, [["tenant-a"], None, None])))
    assert salted == prompt_hashes(TOKS, BS, 9, first_extra=salt_extra("tenant-a"))
    assert not set(salted) & set(prompt_hashes(TOKS, BS, 9))  # not the unsalted prompt
    other = prompt_hashes(TOKS, BS, 9, first_extra=salt_extra("tenant-b"))
    assert not set(salted) & set(other)  # nor another tenant's
    # A salted chain continues across events (the next event's parent is a salted block).
    blocks = BlockSet()
    stored_hashes(*decode(vllm_stored([1], TOKS[:4], [["tenant-a"]])), blocks=blocks)
    rest = stored_hashes(*decode(vllm_stored([2, 3], TOKS[4:], parent=1)), blocks=blocks)
    assert rest == salted[1:]


def test_lora_blocks_keep_their_root_and_a_salt_under_lora_still_counts():
    root = kvblocks.root_for("adapter-x")
    lora = [["adapter-x"]] * 3
    hashes = stored_hashes(*decode(vllm_stored([1, 2, 3], TOKS, lora, lora_name="adapter-x")))
    assert hashes == prompt_hashes(TOKS, BS, 9, root=root)
    keys = [["adapter-x", "tenant-a"], ["adapter-x"], ["adapter-x"]]
    salted = stored_hashes(*decode(vllm_stored([1, 2, 3], TOKS, keys, lora_name="adapter-x")))
    assert salted == prompt_hashes(TOKS, BS, 9, root=root, first_extra=salt_extra("tenant-a"))


def test_prompt_hashes_and_the_lazy_hashes_agree_with_a_salt():
    lazy = kvblocks.LazyPromptHashes(TOKS, BS, 9, first_extra=salt_extra("s"))
    assert lazy.upto(1) + [] == prompt_hashes(TOKS, BS, 1, first_extra=salt_extra("s"))
    assert list(lazy) == prompt_hashes(TOKS, BS, 9, first_extra=salt_extra("s"))
    assert salt_extra(None) is None and salt_extra("") is None


# ------------------------------------------------------------------ the router


def test_the_router_reads_cache_salt_and_leaves_bad_ones_to_the_engine():
    def salt(value: Any) -> str | None:
        body = (
            {"model": "m", "prompt": "p"} if value is ... else {"model": "m", "cache_salt": value}
        )
        return rq.parse("completions", msgspec.json.encode(body)).cache_salt

    assert salt("tenant-a") == "tenant-a"
    assert salt(...) is None and salt(None) is None and salt("") is None and salt(5) is None


def test_a_salted_request_goes_where_its_salt_is_cached_and_an_unsalted_one_does_not():
    system = "You are a careful assistant. " * 20
    turn1 = chat(system, "q")
    ids = kvblocks.byte_tokens(tokens.render_chat([("system", system), ("user", "q")]))
    index = BlockIndex()
    # Engine "salted" holds the prompt under tenant-a's salt; "plain" holds nothing.
    synced(index, "salted", *prompt_hashes(ids, BS, 10_000, first_extra=salt_extra("tenant-a")))
    synced(index, "plain")
    eps = [endpoint("plain"), endpoint("salted")]

    def share(salt: str | None) -> list[float | None]:
        ctx = sc.Context(NOW, "m", prefix=block_hashes(turn1, 256, 128), key=1)
        ctx.salt = salt
        return CachedPrefixScorer(sc.Settings(indexer=Indexer(index))).overlaps(eps, ctx)

    assert share("tenant-a")[1] > 0.9
    assert share(None) == [0.0, 0.0]  # the old code: 1.0 for "salted", a wrong affinity
    assert share("tenant-b") == [0.0, 0.0]
    ctx = sc.Context(NOW, "m", prefix=block_hashes(turn1, 256, 128), key=1)
    ctx.salt = "tenant-a"
    assert pipeline(index).pick(eps, ctx).id == "salted"


def test_the_approximate_guess_keeps_salted_prefixes_apart_too():
    prompt = chat("You are a careful assistant. " * 20, "q")
    lru = PrefixIndex(1000)
    lru.insert(block_hashes(prompt, 256, 128, cache_salt="tenant-a"))
    assert lru.match(block_hashes(prompt, 256, 128, cache_salt="tenant-a")) > 0
    assert lru.match(block_hashes(prompt, 256, 128)) == 0
    assert lru.match(block_hashes(prompt, 256, 128, cache_salt="tenant-b")) == 0


# ------------------------------------------------------------------ the simulator


def _run(engine: Engine, req: Request) -> Request:
    engine.add(req, 0.0)
    t = 0.0
    for _ in range(1000):
        engine.step(t)
        if req.finished:
            return req
        due = engine.next_step_at()
        t = t if due is None else max(t, due)
    raise AssertionError("request did not finish")


def test_the_simulator_shares_a_salted_prefix_only_with_the_same_salt():
    engine = Engine(EngineParams(num_blocks=64, block_size=BS, max_num_seqs=1))
    prompt = b"P" * 64  # 16 tokens: 4 blocks

    def run(salt: str | None) -> int:
        hashes = tokens.block_hashes(prompt, BS, tokens.salt_seed(salt))
        req = Request(16, 1, prompt=prompt, block_hashes=hashes, cache_salt=salt)
        return _run(engine, req).cached_tokens

    assert run(None) == 0
    assert run("tenant-a") == 0  # not the unsalted blocks
    assert run("tenant-b") == 0
    assert run("tenant-a") > 0 and run(None) > 0


def test_the_simulator_validates_cache_salt_as_vllm_does():
    parser = RequestParser(Limits(frozenset({"m"}), 10_000, "lorem", 4))
    job = parser.completion(b'{"model":"m","prompt":"hi","cache_salt":"tenant-a"}')
    assert job.cache_salt == "tenant-a"
    for bad in ('""', '"a/b"', '"' + "x" * 129 + '"', "5"):
        with pytest.raises(ApiError) as err:
            parser.chat(b'{"model":"m","messages":[{"role":"user","content":"x"}],'
                        b'"cache_salt":' + bad.encode() + b"}")  # fmt: skip
        assert err.value.status == 400 and err.value.param == "cache_salt"


def test_the_simulators_salted_events_carry_the_salt_on_the_first_block_only():
    sent: list = []
    pub = kvevents.Publisher.__new__(kvevents.Publisher)
    pub.block_size = BS
    pub._add = sent.append  # type: ignore[method-assign]
    prompt = b"P" * 48
    req = Request(12, 1, prompt=prompt, block_hashes=tokens.block_hashes(prompt, BS, 7),
                  cache_salt="tenant-a")  # fmt: skip
    pub.stored(req, [0, 1, 2])
    pub.stored(req, [2])  # a later run: no first block, no salt
    assert sent[0].extra_keys == [["tenant-a"], None, None]
    assert sent[1].extra_keys is None
    # Through the wire and the relay: the hashes a router computes with the salt.
    events = decode(kvwire.encode_batch(1.0, sent[:1]))
    ids = kvblocks.byte_tokens(prompt)
    assert stored_hashes(*events) == prompt_hashes(ids, BS, 3, first_extra=salt_extra("tenant-a"))


# ------------------------------------------------------------------ SGLang


class _SglEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _SglBlockStored(_SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _SglBlockRemoved(_SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SglBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


def test_sglang_shaped_events_decode_and_chain_like_vllms():
    # As sglang.srt.disaggregation.kv_events encodes them (array-like tagged Structs) and
    # RadixCache._record_store_event fills them: one page per event, signed 64-bit hashes,
    # each page's parent the page before it, the first page of a prompt parentless.
    pages = [TOKS[i : i + BS] for i in range(0, len(TOKS), BS)]
    hashes = [-(2**63) + 5, 2**63 - 7, -42]
    events = [
        _SglBlockStored([hashes[i]], hashes[i - 1] if i else None, page, BS, None, "GPU")
        for i, page in enumerate(pages)
    ]
    payload = msgspec.msgpack.encode(_SglBatch(2.0, [*events, _SglBlockRemoved([-42], "GPU")], 0))
    seq, ts, decoded = kvwire.parse_frames([b"kv", (3).to_bytes(8, "big"), payload])
    assert (seq, ts) == (3, 2.0)
    blocks = BlockSet()
    ops = blocks.apply(decoded)
    expected = prompt_hashes(TOKS, BS, 9)
    assert [h for op in ops if op.op is c.KvOp.STORED for h in op.hashes] == expected
    assert ops[-1] == c.KvBlockOp(op=c.KvOp.REMOVED, hashes=[expected[2]])
    assert blocks.block_size == BS


def test_the_sglang_adapter_points_its_publisher_at_the_relay():
    cmd = c.StartShard(
        key="k", node="n", shard_id="s", model="m", replica_id="r", gpus=[],
        profile=c.ServingProfile(engine="sglang", model_ref="org/m", gpus_per_shard=1,
                                 engine_args=["--page-size", "16"]),
    )  # fmt: skip
    base = dict(port=8000, gpu_indices=[0], bind_host="h", command=["sglang"])
    argv = launch.sglang(cmd, LaunchContext(**base, kv_events_endpoint="tcp://127.0.0.1:9")).argv
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    # SGLang's KVEventsConfig: publisher defaults to "null"; a non-wildcard TCP endpoint
    # makes its PUB connect to the relay, which binds.
    assert config == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:9", "topic": "kv"}
    assert argv[-2:] == ["--page-size", "16"]  # the operator's own flags come last
    assert "--kv-events-config" not in launch.sglang(cmd, LaunchContext(**base)).argv
    assert ENGINES["sglang"].kv_events


def test_an_sglang_endpoint_is_scored_from_its_events_with_the_catalogs_tokenizer(tmp_path):
    from llmgw.router.kvcache.tokens import TOKENIZERS

    from .test_router_tokenizer_load import write_tokenizer

    write_tokenizer(tmp_path)
    assert TOKENIZERS.wait(str(tmp_path), 30) is not None
    raw = msgspec.json.encode("hello world again hello world world again again")
    ids = TOKENIZERS.loaded[str(tmp_path)].tokens(raw)
    assert len(ids) == 8  # two pages of 4
    # SGLang's events for that prompt, one page each, through the relay's block set.
    pages = [ids[:4], ids[4:]]
    events = [_SglBlockStored([-1], None, pages[0], BS, None), _SglBlockStored([7], -1, pages[1], BS, None)]  # fmt: skip
    payload = msgspec.msgpack.encode(_SglBatch(1.0, events))
    held = [h for op in BlockSet().apply(decode(payload)) for h in op.hashes]
    index = BlockIndex()
    synced(index, "sg", *held)
    scorer = CachedPrefixScorer(sc.Settings(indexer=Indexer(index)))
    scorer.configure(c.SchedulingSpec(tokenizer=str(tmp_path)))
    eps = [endpoint("sg", engine="sglang")]

    def share(salt: str | None) -> float | None:
        ctx = sc.Context(NOW, "m", key=1)
        ctx.prefix = block_hashes(raw, 256, 128)  # as the proxy sets it: shorter than a block
        ctx.salt = salt
        return scorer.overlaps(eps, ctx)[0]

    assert share(None) == 1.0
    # SGLang's events say nothing of a salt: a salted request is not scored by them (None:
    # the approximate scorer, salted too, decides for it instead).
    assert share("tenant-a") is None


def _scorer_holding(tmp_path, messages: list[dict]):
    """A kv_prefix scorer with a test tokenizer, and a vLLM endpoint whose events say it
    holds every whole block of `messages` as a chat."""
    from llmgw.router.kvcache.tokens import TOKENIZERS

    from .test_router_tokenizer_load import write_tokenizer

    write_tokenizer(tmp_path)
    assert TOKENIZERS.wait(str(tmp_path), 30) is not None
    ids = TOKENIZERS.loaded[str(tmp_path)].tokens(msgspec.json.encode(messages))
    index = BlockIndex()
    synced(index, "v", *prompt_hashes(ids, BS, len(ids) // BS))
    scorer = CachedPrefixScorer(sc.Settings(indexer=Indexer(index)))
    scorer.configure(c.SchedulingSpec(tokenizer=str(tmp_path)))
    return scorer, [endpoint("v", engine="vllm")]


def test_a_chat_with_tools_is_not_scored_from_ids_rendered_without_them(tmp_path):
    # vLLM renders a chat's tools (and documents, a request's own template, template
    # kwargs) into the prompt; the router renders the messages alone, so its ids would
    # miss the engine's blocks. Such a chat gets None: the approximate guess decides.
    messages = [{"role": "user", "content": "hello world again hello world world again"}]
    raw = msgspec.json.encode(messages)
    scorer, eps = _scorer_holding(tmp_path, messages)

    def share(body: dict) -> float | None:
        ctx = sc.Context(NOW, "m", key=1, body=msgspec.json.encode(body))
        ctx.prefix = block_hashes(raw, 256, 128)
        return scorer.overlaps(eps, ctx)[0]

    assert share({"model": "m", "messages": messages}) == 1.0
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for field, value in {
        "tools": [tool],
        "documents": [{"title": "t", "text": "x"}],
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_special_tokens": True,
        "reasoning_effort": "high",
    }.items():
        assert share({"model": "m", "messages": messages, field: value}) is None, field
    # A message that talks about "tools" is still scored from its ids.
    talk = [*messages, {"role": "user", "content": 'use the "tools" key'}]
    assert share({"model": "m", "messages": talk}) == 1.0


def test_a_responses_request_is_scored_from_the_messages_vllm_builds_of_it(tmp_path):
    # vLLM renders a Responses request from its `instructions` (a system message first)
    # and its input (a string as a user message); from a previous response's turns, or
    # items other than plain messages, it renders what the router cannot see or build:
    # those are scored by the approximate guess.
    text = "hello world again hello world world again"
    messages = [{"role": "user", "content": text}]
    scorer, eps = _scorer_holding(tmp_path, messages)

    def share(body: dict) -> float | None:
        api = "responses" if "input" in body else "chat"
        raw = msgspec.json.encode(body["input" if api == "responses" else "messages"])
        ctx = sc.Context(NOW, "m", key=1, body=msgspec.json.encode(body), api=api)
        ctx.prefix = block_hashes(raw, 256, 128)  # the prompt field, as the proxy cuts it
        return scorer.overlaps(eps, ctx)[0]

    assert share({"model": "m", "messages": messages}) == 1.0
    # The same conversation as a Responses request, its input a string or the messages.
    assert share({"model": "m", "input": text}) == 1.0
    assert share({"model": "m", "input": messages}) == 1.0
    assert share({"model": "m", "input": [{"type": "message", **messages[0]}]}) == 1.0
    # Instructions come first, as a system message: other ids, none of them held.
    assert share({"model": "m", "input": text, "instructions": "be brief"}) == 0.0
    # Told by the API, not by the body: a key named "messages" changes nothing.
    tagged = {"model": "m", "input": text, "metadata": {"messages": "1"}}
    assert share({**tagged, "instructions": "be brief"}) == 0.0
    assert share(tagged) == 1.0
    # What the router cannot build: the approximate guess decides (None).
    for extra in (
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"reasoning": {"effort": "high"}},  # template arguments
    ):
        assert share({"model": "m", "input": text, **extra}) is None, extra
    parts = [{"role": "user", "content": [{"type": "input_text", "text": text}]}]
    assert share({"model": "m", "input": parts}) is None
    call = {"type": "function_call_output", "call_id": "c1", "output": "4"}
    assert share({"model": "m", "input": [*messages, call]}) is None
    # Nonsense is not an error here (the engine answers it): no ids, the guess decides.
    for odd in ([{"role": ["user"], "content": text}], [{"role": "user", "content": 3}], 7):
        assert share({"model": "m", "input": odd}) is None, odd
    # A chat message that quotes the word is still a chat.
    talk = [{"role": "user", "content": 'the "input" field'}]
    assert share({"model": "m", "messages": talk}) is not None
