"""vLLM's KV cache event wire format (ZMQ), shared by the simulator and the agent's relay.

vLLM's `ZmqEventPublisher` sends each batch as three frames: the topic, an 8-byte
big-endian sequence number, and a msgpack `KVEventBatch`, an array
`[ts, [event, ...], data_parallel_rank]`. Events are msgpack maps tagged by
`type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) with vLLM's field
order; vLLM releases before 0.10 sent each event as a tagged array instead
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`),
and `decode_batch` reads both. SGLang's publisher (`sglang.srt.disaggregation.
kv_events`) still sends that array form, one page per `BlockStored`, with signed
64-bit int hashes, a trailing `medium`, and no LoRA name or extra keys; the same
decoder reads it. Block hashes are the engine's own (bytes for vLLM's sha256
hashes, ints for the builtin hash and SGLang's): opaque here, only compared for
equality.

vLLM's `BlockStored.extra_keys` holds, per block, the values besides token ids
that its block hash covers, untagged: the LoRA name (every block, when
`lora_name` is set), `[mm_identifier, offset]` pairs for multimodal items, the
`cache_salt` string (a request's first block only), prompt-embedding digests
(bytes); None for a block with none. `Stored.extra_keys` is that list (or None).

The encoder mirrors vLLM's msgspec Structs field for field so the simulator's
bytes are vLLM's bytes (a unit test pins them against bytes a real vLLM 0.32
produced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = bytes | int


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> bytes:
    return _encoder.encode(_Batch(ts=ts, events=events))


def frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


class WireError(ValueError):
    """A message that is not a vLLM KV event batch (the relay counts and skips it)."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    # Per block (as block_hashes): its extra keys, or None; None for none at all.
    extra_keys: list[list[Any] | None] | None = None
    # Why these blocks cannot be hashed ("" when they can): a malformed `extra_keys`
    # spoils one store, not the batch around it (its removals must still count).
    unusable: str = ""


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def parse_frames(parts: list[bytes]) -> tuple[int, float, list[Event]]:
    """(sequence, timestamp, events) of one ZMQ message; raises WireError."""
    if len(parts) != 3 or len(parts[1]) != 8:
        raise WireError(f"expected 3 frames (topic, 8-byte seq, payload), got {len(parts)}")
    seq = int.from_bytes(parts[1], "big", signed=True)
    ts, events = decode_batch(parts[2])
    return seq, ts, events


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("payload is not a [ts, [events], ...] batch")
    ts = raw[0] if isinstance(raw[0], int | float) else 0.0
    return float(ts), [_event(e) for e in raw[1]]


def _hashes(value: Any) -> list[BlockHash]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise WireError("block_hashes must be a list of bytes or ints")
    return value


def _extra_keys(get, n: int) -> list[list[Any] | None] | None:
    """The per-block extra keys, all-None lists as None; a malformed list is a WireError,
    not ignored: a salted or multimodal block read as plain tokens is a wrong match.
    `_event` turns that error into an unusable store, not a lost batch."""
    keys = get("extra_keys")
    if keys is None:
        return None
    if not isinstance(keys, list) or len(keys) != n:
        raise WireError("extra_keys must be a list with one entry per block hash")
    if not all(k is None or isinstance(k, list) for k in keys):
        raise WireError("each extra_keys entry must be a list or null")
    return keys if any(keys) else None


def _event(e: Any) -> Event:
    if isinstance(e, dict):
        kind = e.get("type")
        get = e.get
    elif isinstance(e, list) and e and isinstance(e[0], str):
        kind = e[0]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
            "BlockRemoved": ("block_hashes",),
        }.get(kind, ())
        fields = dict(zip(names, e[1:], strict=False))
        get = fields.get
    else:
        raise WireError(f"an event must be a tagged map or array, not {type(e).__name__}")
    if kind == "BlockStored":
        tokens = get("token_ids")
        size = get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
            raise WireError("BlockStored needs token_ids (a list) and a positive block_size")
        parent = get("parent_block_hash")
        if parent is not None and not isinstance(parent, bytes | int):
            raise WireError("parent_block_hash must be bytes, an int or null")
        lora = get("lora_name")
        hashes = _hashes(get("block_hashes"))
        try:
            extra = _extra_keys(get, len(hashes))
        except WireError as exc:
            return Stored(hashes, parent, tokens, size, lora or None, None, str(exc))
        return Stored(hashes, parent, tokens, size, lora or None, extra)
    if kind == "BlockRemoved":
        return Removed(_hashes(get("block_hashes")))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise WireError(f"unknown event type {kind!r}")


# -- replay (vLLM's `replay_endpoint`, a ROUTER socket the engine binds) -----------------
#
# A subscriber that saw a gap asks for the batches it missed: it sends, from a DEALER,
# an empty delimiter frame and the first sequence number it wants (8 bytes, big-endian).
# The engine answers with every batch still in its buffer (`buffer_steps` of them) from
# that number on, each as `[b"", topic, seq, payload]`, then `[b"", b"", END_SEQ, b""]`.
# A batch no longer buffered is simply absent: the first one answered is later than asked.
# SGLang's copy of that publisher leaves the topic out: `[b"", seq, payload]`, then
# `[b"", END_SEQ, b""]`; `parse_replay` reads both.

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_request(start: int) -> list[bytes]:
    """A DEALER's request for the batches from `start` on."""
    return [b"", start.to_bytes(8, "big")]


def replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One buffered batch as the engine's ROUTER sends it (without the peer's identity)."""
    return [b"", topic, seq.to_bytes(8, "big"), payload]


def replay_end() -> list[bytes]:
    return [b"", b"", END_SEQ, b""]


def parse_replay(parts: list[bytes]) -> list[bytes] | None:
    """A reply frame set as `parse_frames` reads it, or None for the end marker."""
    if parts and parts[0] == b"":
        parts = parts[1:]
    if len(parts) == 3 and parts[1] == END_SEQ:
        return None
    if len(parts) == 2:  # SGLang's: no topic
        return None if parts[0] == END_SEQ else [b"", *parts]
    return parts
