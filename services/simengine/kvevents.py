"""KV cache events over ZMQ, as vLLM publishes them (`--kv-events-config`).

The simulator's block pool reports what it stores and evicts; this module turns
that into vLLM's wire format (llmgw.kvwire) on a ZMQ PUB socket. As in vLLM the
socket connects to a non-wildcard TCP endpoint (the subscriber, e.g. the agent's
relay, binds) and binds a wildcard one (`tcp://*:PORT`) or an ipc/inproc one.

Events collected while the event loop runs one callback go out as one batch, the
way vLLM sends one batch per engine step. Token ids are the simulator's (4 prompt
bytes per token, llmgw.kvblocks.byte_tokens), so a router that renders a request as
the simulator does computes the same block hashes from them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
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
    """vLLM's KVEventsConfig keys; the replay endpoint is accepted and ignored."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
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
        # vLLM's extra keys: the salt on the request's first block, nothing on the others.
        extra = (
            [[req.cache_salt]] + [None] * (len(run) - 1) if req.cache_salt and not first else None
        )
        self._add(
            kvwire.BlockStored(
                block_hashes=[req.block_hashes[i] for i in run],
                parent_block_hash=req.block_hashes[first - 1] if first else None,
                token_ids=byte_tokens(req.prompt[first * span : (last + 1) * span]),
                block_size=self.block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
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
            # sees a gap in the sequence.
            self.dropped += 1
        self.seq += 1

    def close(self) -> None:
        self.flush()
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
    log.info("publishing KV cache events to %s (topic %r)", cfg.endpoint, cfg.topic)
    return pub
