"""The relay repairs gaps in an engine's KV events from the engine's replay socket.

The engine is the simulator's publisher (llmgw.simengine.kvevents), which binds a ROUTER
and answers replay requests as vLLM's does, in this process; the relay is the agent's
(llmgw.agent.kvrelay) without a bus: what it would publish is collected. Losses between
engine and relay are made by a relay that skips some live batches, or that only starts
listening after the engine has stored blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from llmgw import contracts as c
from llmgw import kvblocks, kvwire
from llmgw.agent.kvrelay import BlockSet, EngineRelay, KvRelays
from llmgw.agent.launch import LaunchContext, kv_events_args, sglang_kv_events_args
from llmgw.config import ConfigError
from llmgw.dev.servers import free_port
from llmgw.kvblocks import byte_tokens
from llmgw.simengine import kvevents, tokens
from llmgw.simengine.engine import Request

BS = 4  # tokens per block: 16 prompt bytes
N = 10  # blocks in the prompt, one engine batch each
PROMPT = b"".join(f"block {i:02d} of ten".encode()[:16].ljust(16, b".") for i in range(N))
EXPECTED = kvblocks.prompt_hashes(byte_tokens(PROMPT), BS, N)
REQ = Request(
    prompt_tokens=N * BS + 1,  # one more token: all N blocks are full prompt blocks
    max_output=1,
    prompt=PROMPT,
    block_hashes=tokens.block_hashes(PROMPT, BS),
)


# The engines' sockets, as the agent's are: ipc:// in a directory of its own.
SOCKETS = Path(tempfile.mkdtemp(prefix="kvrr"))


def ipc() -> str:
    """A fresh ipc:// endpoint."""
    return f"ipc://{SOCKETS}/{uuid.uuid4().hex[:8]}"


async def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout}s")


class Harness:
    """One engine publisher and one relay on ipc sockets, with the relay's output collected."""

    def __init__(self, *, buffer_steps: int = 10_000, answers: bool = True, timeout: float = 10):
        self.ctx = zmq.asyncio.Context()
        self.published: list[c.KvEvents] = []
        self.replay_endpoint = ipc()
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": ipc(),
            # `answers=False`: an engine without a replay socket where the relay asks.
            "replay_endpoint": self.replay_endpoint if answers else None,
            "buffer_steps": buffer_steps,
            "topic": "kv",
        }
        # The engine binds its sockets first, as an engine the agent adopts has: the relay
        # joins at once instead of at its next reconnect (a tenth of a second later).
        self.engine = kvevents.Publisher(kvevents.parse_config(json.dumps(cfg)), BS)
        self.relay = EngineRelay(
            "n1",
            "s1",
            publish=self._publish,
            endpoint=cfg["endpoint"],
            replay_endpoint=self.replay_endpoint,
            replay_timeout=timeout,
            context=self.ctx,
        )
        self.drop: set[int] = set()  # live batches the relay does not get
        live = self.relay.receive

        def lossy(parts: list[bytes]) -> None:
            if int.from_bytes(parts[1], "big") not in self.drop:
                live(parts)

        self.relay.receive = lossy  # type: ignore[method-assign]

    async def _publish(self, subject: str, data: bytes) -> None:
        self.published.append(c.decode(data, c.KvEvents))

    async def joined(self) -> None:
        """PUB/SUB join asynchronously: one batch (seq 0, a block of another prompt)
        that the relay got live, so what follows is not lost to the join."""
        other = b"x" * 16 * 2
        req = Request(prompt_tokens=9, max_output=1, prompt=other,
                      block_hashes=tokens.block_hashes(other, BS))  # fmt: skip
        self.relay.start()
        deadline = time.monotonic() + 20
        while self.relay.last_seq < 0 or self.relay.replaying:
            assert time.monotonic() < deadline, "the relay never heard the engine"
            if self.relay.last_seq < 0 and not self.relay.replaying:
                self.engine.stored(req, [0])
                self.engine.flush()
            await asyncio.sleep(0.02)

    def store(self, i: int) -> None:
        """Block i of the prompt becomes cached: one engine batch."""
        self.engine.stored(REQ, [i])
        self.engine.flush()

    def stored_on_bus(self) -> list[int]:
        return [h for b in self.published for op in b.ops if op.op is c.KvOp.STORED
                for h in op.hashes]  # fmt: skip

    async def close(self) -> None:
        await self.relay.close()
        self.engine.close()
        self.ctx.term()


async def test_batches_lost_before_the_relay_are_replayed_in_order():
    h = Harness()
    try:
        await h.joined()
        first = h.engine.seq
        h.drop = {first + 2, first + 3, first + 4}  # blocks 2..4 never reach the relay live
        for i in range(N):
            h.store(i)
            await asyncio.sleep(0)
        await wait_for(lambda: h.relay.last_seq == first + N - 1 and not h.relay.replaying)
        # Blocks 2..4 and every block chained on them (5..9) are known: without replay
        # they were lost, and 5..9 orphaned (their parent unknown).
        assert set(EXPECTED) <= set(h.relay.blocks.hashes())
        assert h.relay.engine_gaps == 0 and h.relay.blocks.orphans == 0
        assert h.relay.replayed >= 3  # the reply also carries later batches, received live
        await h.relay.flush()
        # On the bus: in the engine's order, with no gap a router would resync for.
        assert h.stored_on_bus()[-N:] == EXPECTED
        seqs = [(b.seq_first, b.seq_last) for b in h.published]
        assert all(b[0] == a[1] + 1 for a, b in zip(seqs, seqs[1:], strict=False)), seqs
        assert seqs[-1][1] == first + N - 1
    finally:
        await h.close()


async def test_a_relay_attaching_to_a_running_engine_rebuilds_its_set_from_the_buffer():
    h = Harness()
    try:
        for i in range(N):  # stored before the relay listens: lost to its PUB/SUB socket
            h.store(i)
        h.relay.start(engine_running=True)  # as the agent does for an adopted engine
        await wait_for(lambda: h.relay.last_seq == N - 1 and not h.relay.replaying)
        assert sorted(h.relay.blocks.hashes()) == sorted(EXPECTED)
        assert h.relay.replayed == N and h.relay.engine_gaps == 0
        await h.relay.flush()
        assert h.stored_on_bus() == EXPECTED
        # It goes on with live batches after the replayed ones.
        more = PROMPT + b"and one more blk"
        req = Request(prompt_tokens=(N + 1) * BS + 1, max_output=1, prompt=more,
                      block_hashes=tokens.block_hashes(more, BS))  # fmt: skip
        h.engine.stored(req, [N])
        h.engine.flush()
        await wait_for(lambda: h.relay.last_seq == N)
        assert kvblocks.prompt_hashes(byte_tokens(more), BS, N + 1)[-1] in h.relay.blocks.hashes()
    finally:
        await h.close()


async def test_a_gap_the_engine_no_longer_buffers_is_counted_and_the_rest_applied():
    h = Harness(buffer_steps=2)
    try:
        await h.joined()
        first = h.engine.seq
        h.drop = {first + 1, first + 2, first + 3}
        for i in range(N):
            h.store(i)
        await wait_for(lambda: h.relay.last_seq == first + N - 1 and not h.relay.replaying)
        # The buffer held only the last two batches: 1..3 are gone for good, as before
        # replay existed (counted, and the blocks after them orphaned); the live batches
        # 4..7 held back meanwhile still count.
        assert h.relay.engine_gaps == 1
        assert h.relay.last_seq == first + N - 1
        assert EXPECTED[0] in h.relay.blocks.hashes()
        assert not set(EXPECTED[1:]) & set(h.relay.blocks.hashes())
    finally:
        await h.close()


async def test_an_engine_that_does_not_answer_leaves_the_relay_as_it_was_without_replay():
    h = Harness(answers=False, timeout=0.5)
    try:
        await h.joined()
        first = h.engine.seq
        h.drop = {first + 2}
        for i in range(N):
            h.store(i)
        await wait_for(lambda: h.relay.last_seq == first + N - 1 and not h.relay.replaying)
        assert h.relay.engine_gaps == 1 and h.relay.replayed == 0
        assert set(EXPECTED[:2]) <= set(h.relay.blocks.hashes())
    finally:
        await h.close()


async def test_a_reply_with_a_hole_is_asked_for_again():
    """vLLM's ROUTER drops replies past its high-water mark when the relay reads slowly:
    an engine that loses one batch of its first reply."""
    ctx = zmq.asyncio.Context()
    replay = ipc()
    router = ctx.socket(zmq.ROUTER)
    router.bind(replay)
    published: list[c.KvEvents] = []

    async def publish(subject: str, data: bytes) -> None:
        published.append(c.decode(data, c.KvEvents))

    relay = EngineRelay("n1", "s1", publish=publish, context=ctx, endpoint=ipc(),
                        replay_endpoint=replay)  # fmt: skip
    batches = []
    parent = None
    for i in range(N):
        ev = kvwire.BlockStored(
            block_hashes=[i + 1], parent_block_hash=parent,
            token_ids=byte_tokens(PROMPT[i * 16 : (i + 1) * 16]),
            block_size=BS, lora_id=None, medium=None, lora_name=None,
        )  # fmt: skip
        parent = i + 1
        batches.append(kvwire.encode_batch(0.0, [ev]))
    asked: list[int] = []

    async def engine() -> None:
        while True:
            peer, _, start = await router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for seq in range(int.from_bytes(start, "big"), N):
                if len(asked) == 1 and seq == 4:
                    continue  # dropped at the high-water mark
                await router.send_multipart([peer, *kvwire.replay_reply(b"kv", seq, batches[seq])])
            await router.send_multipart([peer, *kvwire.replay_end()])

    serving = asyncio.create_task(engine())
    try:
        relay.start(engine_running=True)
        await wait_for(lambda: relay.last_seq == N - 1 and not relay.replaying)
        assert asked == [0, 4]
        assert sorted(relay.blocks.hashes()) == sorted(EXPECTED)
        assert relay.engine_gaps == 0 and relay.replayed == N
    finally:
        serving.cancel()
        await relay.close()
        router.close(0)
        ctx.term()


def test_the_block_set_is_unchanged_by_replayed_events_it_already_applied():
    h = tokens.block_hashes(PROMPT, BS)
    events = [
        kvwire.Stored([h[0], h[1]], None, byte_tokens(PROMPT[:32]), BS),
        kvwire.Stored([h[2]], h[1], byte_tokens(PROMPT[32:48]), BS),
        kvwire.Removed([h[1]]),
        kvwire.Stored([h[1]], h[0], byte_tokens(PROMPT[16:32]), BS),
    ]
    blocks = BlockSet()
    blocks.apply(events)
    once = dict(blocks.canon)
    blocks.apply(events)
    assert blocks.canon == once
    assert set(once.values()) == set(EXPECTED[:3])


def test_the_simulator_accepts_vllms_replay_keys():
    cfg = kvevents.parse_config(
        '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:1",'
        '"replay_endpoint":"tcp://127.0.0.1:2","buffer_steps":5,"max_queue_size":9}'
    )
    assert cfg.replay_endpoint == "tcp://127.0.0.1:2" and cfg.buffer_steps == 5
    with pytest.raises(ConfigError, match="buffer_steps"):
        kvevents.parse_config('{"enable_kv_cache_events":true,"buffer_steps":0}')


def test_a_replay_endpoint_the_simulator_cannot_bind_fails_its_start_naming_the_field():
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = kvevents.parse_config(
            '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:1",'
            f'"replay_endpoint":"tcp://127.0.0.1:{port}"}}'
        )
        with pytest.raises(ConfigError, match="replay_endpoint"):
            kvevents.Publisher(cfg, BS)
    finally:
        taken.close(0)
        ctx.term()


def test_the_adapter_gives_the_engine_its_replay_endpoint_in_vllms_keys():
    ctx = LaunchContext(
        port=1, gpu_indices=[], bind_host="h", command=["x"],
        kv_events_endpoint="tcp://127.0.0.1:9", kv_replay_endpoint="tcp://127.0.0.1:61234",
    )  # fmt: skip
    flag, value = kv_events_args(ctx)
    assert flag == "--kv-events-config"
    cfg = json.loads(value)
    assert cfg["replay_endpoint"] == "tcp://127.0.0.1:61234"
    assert cfg["endpoint"] == "tcp://127.0.0.1:9"
    assert kvevents.parse_config(value).replay_endpoint == "tcp://127.0.0.1:61234"
    # SGLang's flag: its KVEventsConfig has the same replay keys.
    flag, value = sglang_kv_events_args(ctx)
    assert json.loads(value)["replay_endpoint"] == "tcp://127.0.0.1:61234"


def test_replies_read_in_vllms_form_and_sglangs_which_has_no_topic():
    payload = kvwire.encode_batch(1.0, [kvwire.AllBlocksCleared()])
    seq = (5).to_bytes(8, "big")
    vllm = kvwire.parse_replay(kvwire.replay_reply(b"kv", 5, payload))
    sglang = kvwire.parse_replay([b"", seq, payload])
    assert kvwire.parse_frames(vllm)[0] == kvwire.parse_frames(sglang)[0] == 5
    assert kvwire.parse_replay(kvwire.replay_end()) is None
    assert kvwire.parse_replay([b"", kvwire.END_SEQ, b""]) is None  # SGLang's end marker
    assert kvwire.parse_replay([b"", b"", seq, payload]) == [b"", seq, payload]  # no topic


def numbered_batches(n: int = N) -> list[bytes]:
    """The prompt's blocks as `n` engine batches, one block each, chained."""
    out = []
    parent = None
    for i in range(n):
        ev = kvwire.BlockStored(
            block_hashes=[i + 1], parent_block_hash=parent,
            token_ids=byte_tokens(PROMPT[i * 16 : (i + 1) * 16]),
            block_size=BS, lora_id=None, medium=None, lora_name=None,
        )  # fmt: skip
        parent = i + 1
        out.append(kvwire.encode_batch(0.0, [ev]))
    return out


class ScriptedEngine:
    """A replay socket, served in this loop: each request is recorded, and
    `reply(round, seq)` says whether that batch of the reply is sent (False: dropped, as
    vLLM's ROUTER drops past its high-water mark); `end(round)` whether END is. `hold`
    keeps every reply back until set."""

    def __init__(self, ctx, batches: list[bytes], *, reply=None, end=None):
        self.endpoint = ipc()
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.endpoint)
        self.batches = batches
        self.asked: list[int] = []
        self.reply = reply or (lambda rnd, seq: True)
        self.end = end or (lambda rnd: True)
        self.hold = asyncio.Event()
        self.hold.set()
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            peer, _, start = await self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            rnd = len(self.asked)
            await self.hold.wait()
            for seq in range(int.from_bytes(start, "big"), len(self.batches)):
                if self.reply(rnd, seq):
                    frames = kvwire.replay_reply(b"kv", seq, self.batches[seq])
                    await self.router.send_multipart([peer, *frames])
            if self.end(rnd):
                await self.router.send_multipart([peer, *kvwire.replay_end()])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.router.close(0)


async def test_a_reply_whose_tail_and_end_marker_are_dropped_is_asked_for_again():
    """vLLM sends a reply in one burst and its ROUTER drops silently past 1,000 queued
    messages: here the last two batches and the end marker of the first reply. The relay
    must not wait out its deadline and then count the batches as lost: the engine still
    holds them."""
    ctx = zmq.asyncio.Context()
    engine = ScriptedEngine(
        ctx, numbered_batches(),
        reply=lambda rnd, seq: rnd > 1 or seq < N - 2, end=lambda rnd: rnd > 1,
    )  # fmt: skip
    relay = EngineRelay("n1", "s1", publish=_discard, context=ctx, replay_timeout=30,
                        replay_endpoint=engine.endpoint, endpoint=ipc())  # fmt: skip
    try:
        relay.start(engine_running=True)
        await wait_for(lambda: not relay.replaying, timeout=60)
        assert engine.asked == [0, N - 2]
        assert relay.last_seq == N - 1 and relay.engine_gaps == 0 and relay.replayed == N
        assert sorted(relay.blocks.hashes()) == sorted(EXPECTED)
    finally:
        await relay.close()
        await engine.close()
        ctx.term()


async def _discard(subject: str, data: bytes) -> None:
    pass


class _PendingDealer:
    """A DEALER whose replies the test hands over, so a reply can land in the same loop
    iteration as the cancellation of the replay that asked for it."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future] = []

    def setsockopt(self, *args) -> None:
        pass

    def connect(self, endpoint: str) -> None:
        pass

    async def send_multipart(self, parts) -> None:
        pass

    def recv_multipart(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        return fut

    def close(self, linger=None) -> None:
        pass


class _Context:
    def __init__(self) -> None:
        self.real = zmq.asyncio.Context()
        self.dealer = _PendingDealer()

    def socket(self, kind):
        return self.dealer if kind == zmq.DEALER else self.real.socket(kind)


def _batch(seq: int, h: int) -> list[bytes]:
    ev = kvwire.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=byte_tokens(b"y" * 16),
                            block_size=BS, lora_id=None, medium=None, lora_name=None)  # fmt: skip
    return kvwire.frames("kv", seq, kvwire.encode_batch(0.0, [ev]))


async def test_a_replay_of_the_old_engine_process_never_lands_in_the_new_epoch():
    """The reply of the engine process that is gone arrives in the loop iteration in which
    the new process's first batch starts a new epoch (and cancels the replay)."""
    ctx = _Context()
    relay = EngineRelay("n1", "s1", publish=_discard, context=ctx, replay_timeout=30,
                        replay_endpoint="tcp://127.0.0.1:1", endpoint=ipc())  # fmt: skip
    try:
        relay.start(engine_running=True)  # adopted: asks for the buffer
        await wait_for(lambda: ctx.dealer.pending, what="the replay request")
        relay.receive(_batch(500, 1))  # live batches of the old process, held
        relay.receive(_batch(501, 2))
        ctx.dealer.pending[-1].set_result([b"", *_batch(400, 99)])
        relay.receive(_batch(0, 7))  # a new engine process: new epoch
        epoch = relay.epoch
        for _ in range(20):
            await asyncio.sleep(0)
        relay.receive(_batch(1, 8))
        assert relay.epoch == epoch and relay.last_seq == 1
        canon = relay.blocks.canon
        assert 7 in canon and 8 in canon and 99 not in canon and 1 not in canon
        assert relay.engine_gaps == 0
    finally:
        await relay.close()
        ctx.real.destroy(0)


async def test_replays_wait_their_turn_and_each_deadline_starts_with_it():
    """After an agent restart every adopted engine's relay asks for its whole buffer: at
    most two replays run at once in the agent, and a relay's deadline starts when its turn
    comes, not while it waits."""
    relays = KvRelays("n1", SOCKETS)
    ctx = zmq.asyncio.Context()
    engines = [ScriptedEngine(ctx, numbered_batches()) for _ in range(3)]
    for e in engines[:2]:
        e.hold.clear()  # the first two replies take their time
    try:
        opened = [
            relays.open(f"s{i}", (ipc(), e.endpoint), engine_running=True)
            for i, e in enumerate(engines)
        ]
        for r in opened:
            r.replay_timeout = 30
        await wait_for(lambda: engines[0].asked and engines[1].asked, what="two requests")
        for _ in range(20):
            await asyncio.sleep(0)
        assert opened[2].replays == 0 and opened[2].replaying  # waits, holding live batches
        opened[2].replay_timeout = 0.5  # less than the others' replies take from now on
        await asyncio.sleep(1.0)
        for e in engines[:2]:
            e.hold.set()
        await wait_for(lambda: not any(r.replaying for r in opened), timeout=60)
        for r in opened:
            assert r.last_seq == N - 1 and r.engine_gaps == 0 and r.replayed == N
    finally:
        await relays.stop()
        for e in engines:
            await e.close()
        ctx.term()


async def test_after_a_replay_nobody_answered_the_next_gaps_are_not_held_back():
    relay = EngineRelay("n1", "s1", publish=_discard, replay_timeout=0.3,
                        replay_endpoint=f"tcp://127.0.0.1:{free_port()}", endpoint=ipc())  # fmt: skip
    try:
        relay.receive(_batch(0, 1))
        relay.receive(_batch(2, 2))  # a gap: replay asked, nobody answers
        assert relay.replaying
        await wait_for(lambda: not relay.replaying, what="the replay's end")
        assert relay.last_seq == 2 and relay.engine_gaps == 1 and relay.replays == 1
        relay.receive(_batch(4, 3))  # a gap within the back-off: counted, not replayed
        assert not relay.replaying and relay.last_seq == 4
        assert relay.engine_gaps == 2 and relay.replays == 1
    finally:
        await relay.close()


async def test_a_gap_left_by_a_batch_the_relay_could_not_read_is_not_replayed():
    """The engine would replay the same bytes: asking for them again is pointless."""
    relay = EngineRelay("n1", "s1", publish=_discard, replay_timeout=30,
                        replay_endpoint=f"tcp://127.0.0.1:{free_port()}", endpoint=ipc())  # fmt: skip
    try:
        relay.receive(_batch(0, 1))
        relay.receive([b"kv", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        relay.receive(_batch(2, 2))
        assert not relay.replaying and relay.replays == 0 and relay.last_seq == 2
        assert relay.malformed == 1
        relay.receive([b"kv", b"not a sequence number"])  # which batch it was is unknown
        relay.receive(_batch(4, 3))
        assert not relay.replaying and relay.replays == 0 and relay.last_seq == 4
        assert relay.malformed == 2
        assert 2 in relay.blocks.canon and 3 in relay.blocks.canon
    finally:
        await relay.close()
