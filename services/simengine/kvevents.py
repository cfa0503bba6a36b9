"""KV cache events over ZMQ, as vLLM publishes them (`--kv-events-config`).

The simulator's block pool reports what it stores and evicts; this module turns
that into vLLM's wire format (llmgw.kvwire) on a ZMQ PUB socket. As in vLLM the
socket connects to a non-wildcard TCP endpoint (the subscriber, e.g. the agent's
relay, binds) and binds a wildcard one (`tcp://*:PORT`) or an ipc/inproc one.

With a `replay_endpoint` it binds a ROUTER socket there, as vLLM does, and answers
replay requests from its last `buffer_steps` batches (llmgw.kvwire has the frames),
served by a thread of its own as vLLM's publisher thread serves them.

Events collected while the event loop runs one callback go out as one batch, the
way vLLM sends one batch per engine step. Token ids are the simulator's (4 prompt
bytes per token, llmgw.kvblocks.byte_tokens), so a router that renders a request as
the simulator does computes the same block hashes from them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from llmgw import kvwire
from llmgw.config import ConfigError
from llmgw.kvblocks import byte_tokens
from llmgw.simengine.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from llmgw.simengine.engine import Engine, Request

log = logging.getLogger(__name__)


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's KVEventsConfig keys (`max_queue_size` is accepted and ignored)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""


def parse_config(raw: str) -> KvEventsConfig | None:
    """The `--kv-events-config` JSON; None when events are off. Raises ConfigError."""
    if not raw:
        return None
    try:
        cfg = msgspec.convert(json.loads(raw), KvEventsConfig)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ConfigError(f"kv_events_config: not a valid KV events config: {exc}") from None
    publisher = cfg.publisher or ("zmq" if cfg.enable_kv_cache_events else "null")
    if publisher not in ("zmq", "null"):
        raise ConfigError(f"kv_events_config.publisher: {publisher!r} is not 'zmq' or 'null'")
    if cfg.buffer_steps < 1:
        raise ConfigError(f"kv_events_config.buffer_steps: {cfg.buffer_steps} is not positive")
    if not cfg.enable_kv_cache_events or publisher == "null":
        return None
    return cfg


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    def __init__(self, cfg: KvEventsConfig, block_size: int):
        self.block_size = block_size
        self.topic = cfg.topic
        self.seq = 0
        self._pending: list = []
        self._scheduled = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if _binds(cfg.endpoint):
            self._sock.bind(cfg.endpoint)
        else:
            self._sock.connect(cfg.endpoint)
        self.dropped = 0
        # Every batch sent, for replay: (seq, payload); appended here, read by the thread.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._buffer_lock = threading.Lock()
        self.replays = 0  # requests answered
        self._running = True
        self._replay = None
        self._thread = None
        if cfg.replay_endpoint:
            # vLLM binds its replay endpoint whatever its form; a port already taken
            # fails the start, as it fails vLLM's.
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(cfg.replay_endpoint)
            except zmq.ZMQError as exc:
                self._replay.close(linger=0)
                self._sock.close(linger=0)
                self._ctx.term()
                raise ConfigError(
                    f"kv_events_config.replay_endpoint: cannot bind {cfg.replay_endpoint}: {exc}"
                ) from None
            self._thread = threading.Thread(
                target=self._serve_replays, name="kv-events-replay", daemon=True
            )
            self._thread.start()

    # -- what the engine reports ----------------------------------------------------

    def stored(self, req: Request, indices: Sequence[int]) -> None:
        """Blocks `indices` of `req`'s prompt became cached; one event per contiguous run."""
        span = self.block_size * BYTES_PER_TOKEN
        run: list[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                self._stored_run(req, run, span)
                run = []
            run.append(i)
        if run:
            self._stored_run(req, run, span)

    def _stored_run(self, req: Request, run: list[int], span: int) -> None:
        first, last = run[0], run[-1]
        # vLLM's extra keys: the adapter's name on every block, then the salt on the
        # request's first block.
        lora = [req.lora_name] if req.lora_name else []
        salted = bool(req.cache_salt) and not first
        extra = None
        if lora or salted:
            extra = [lora + ([req.cache_salt] if salted and i == first else []) for i in run]
            extra = [keys or None for keys in extra]
        self._add(
            kvwire.BlockStored(
                block_hashes=[req.block_hashes[i] for i in run],
                parent_block_hash=req.block_hashes[first - 1] if first else None,
                token_ids=byte_tokens(req.prompt[first * span : (last + 1) * span]),
                block_size=self.block_size,
                lora_id=None,
                medium="GPU",
                lora_name=req.lora_name,
                extra_keys=extra,
            )
        )

    def evicted(self, block_hash: int) -> None:
        self._add(kvwire.BlockRemoved(block_hashes=[block_hash], medium="GPU"))

    def cleared(self) -> None:
        self._add(kvwire.AllBlocksCleared())

    # -- sending --------------------------------------------------------------------

    def _add(self, event) -> None:
        self._pending.append(event)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = kvwire.encode_batch(time.time(), events)
        try:
            self._sock.send_multipart(kvwire.frames(self.topic, self.seq, payload), zmq.NOBLOCK)
        except zmq.Again:
            # Past the high-water mark, as in vLLM: the batch is lost and the subscriber
            # sees a gap in the sequence (and may ask for a replay).
            self.dropped += 1
        with self._buffer_lock:
            self._buffer.append((self.seq, payload))
        self.seq += 1

    # -- replay -----------------------------------------------------------------------

    def _serve_replays(self) -> None:
        sock = self._replay
        while self._running:
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed under us
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big")
            with self._buffer_lock:
                batches = [(seq, p) for seq, p in self._buffer if seq >= start]
            topic = self.topic.encode()
            try:
                # As vLLM: a ROUTER drops what the asker cannot take in (its high-water
                # mark); the asker sees a hole and asks again.
                for seq, payload in batches:
                    sock.send_multipart([peer, *kvwire.replay_reply(topic, seq, payload)])
                sock.send_multipart([peer, *kvwire.replay_end()])
            except zmq.ZMQError:
                return
            self.replays += 1

    def close(self) -> None:
        self.flush()
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def attach(engine: Engine, raw_config: str) -> Publisher | None:
    """Publish `engine`'s KV events as `raw_config` (vLLM's JSON) says; None when off."""
    cfg = parse_config(raw_config)
    if cfg is None:
        return None
    pub = Publisher(cfg, engine.params.block_size)
    engine.kv_events = pub
    engine.pool.on_evict = pub.evicted
    log.info(
        "publishing KV cache events to %s (topic %r, replay %s)",
        cfg.endpoint,
        cfg.topic,
        cfg.replay_endpoint or "off",
    )
    return pub
