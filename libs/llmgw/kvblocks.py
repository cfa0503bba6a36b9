"""Canonical prompt-block hashes: what routers index and what they compute for a prompt.

Engines hash their blocks their own way (vLLM: sha256 over a random per-process
seed, unless PYTHONHASHSEED is pinned), so no router can recompute an engine's
hashes. KV events carry each stored block's token ids instead; the agent's relay
maps every engine hash to a canonical one, chained over token ids exactly as the
engine chains its own (block i's hash covers blocks 0..i), and routers hash a
prompt's token ids the same way. Two processes on any machine agree: the hash is
blake2b, not Python's salted `hash`.

Some blocks are keyed by more than their tokens: vLLM folds "extra keys" into a
block's hash (a multimodal item's hash and offset on every block the item's
placeholder tokens cover, the request's `cache_salt` on its first block, prompt
embedding digests), and KV events carry them per block. Such a block's canonical
hash covers its extra keys too (`chain_extra`, in a hash domain of its own), so it
never equals a plain-token block's: an image's placeholder tokens do not match a
text prompt or another image, a salted prefix matches only requests with the same
salt. A LoRA adapter's name, also an extra key in vLLM, is the chain's root instead
(`root_for`), so a LoRA block with no other extra key hashes as before.

Canonical hashes are 63-bit non-negative ints, so they survive JSON anywhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgspec

from llmgw.engines import ENGINES

ROOT = 0
_MASK = (1 << 63) - 1


def root_for(lora_name: str | None) -> int:
    """The chain's start: blocks computed under a LoRA adapter never match the base model's."""
    if not lora_name:
        return ROOT
    return int.from_bytes(blake2b(b"lora:" + lora_name.encode(), digest_size=8).digest()) & _MASK


_extra_encode = msgspec.msgpack.Encoder().encode
# blake2b's personalisation: a block hashed with extra keys lives in another hash domain.
_EXTRA = b"llmgw-extra-keys"


def extra_bytes(keys: Sequence[Any] | None) -> bytes | None:
    """One block's extra keys as hashed (msgpack: self-delimiting, the same bytes for the
    same values in any process); None for a block without any."""
    if not keys:
        return None
    return _extra_encode(list(keys))


# Engines whose KV events carry no extra keys: their blocks are never stored under a
# salt, so a salted request cannot be scored by their events.
EVENTS_WITHOUT_EXTRA_KEYS = frozenset(
    name for name, t in ENGINES.items() if not t.events_carry_extra_keys
)


def salt_extra(cache_salt: str | None) -> bytes | None:
    """The extra keys of a request's first block under `cache_salt` (vLLM: the salt alone,
    when the request has no LoRA adapter and no multimodal item in that block)."""
    return extra_bytes([cache_salt]) if cache_salt else None


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as what is hashed: little-endian uint32s."""
    a = array("I", tokens)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def chain_bytes(parent: int, block: bytes) -> int:
    """The canonical hash of one block (its token_bytes) after the block hashed `parent`."""
    h = blake2b(parent.to_bytes(8, "little") + block, digest_size=8)
    return int.from_bytes(h.digest(), "little") & _MASK


def chain_extra(parent: int, block: bytes, extra: bytes | None) -> int:
    """chain_bytes for a block with extra keys (extra_bytes); without any, chain_bytes."""
    if extra is None:
        return chain_bytes(parent, block)
    h = blake2b(parent.to_bytes(8, "little") + block + extra, digest_size=8, person=_EXTRA)
    return int.from_bytes(h.digest(), "little") & _MASK


def chain(parent: int, tokens: Sequence[int]) -> int:
    return chain_bytes(parent, token_bytes(tokens))


def prompt_hashes(
    tokens: bytes | Sequence[int],
    block_size: int,
    max_blocks: int,
    root: int = ROOT,
    first_extra: bytes | None = None,
) -> list[int]:
    """Canonical hashes of the full blocks of a prompt (at most max_blocks); `tokens` are
    token ids or their token_bytes (cheaper: the hot path hashes byte slices);
    `first_extra` the first block's extra keys (salt_extra).

    Only full blocks count, as in vLLM, and the block holding the last prompt token is
    recomputed anyway, but an engine can still hold it from an earlier, longer prompt.
    """
    return LazyPromptHashes(tokens, block_size, max_blocks, root, first_extra).upto(max_blocks)


class LazyPromptHashes:
    """prompt_hashes, computed only as far as a reader iterates (a match stops at the
    first block no engine holds, so a cold prompt costs one hash, not hundreds) and
    kept: a second reader (a retry of the same request) reuses what was computed."""

    __slots__ = ("_data", "_span", "_n", "_done", "_h", "_first_extra")

    def __init__(
        self,
        tokens: bytes | Sequence[int],
        block_size: int,
        max_blocks: int,
        root: int = ROOT,
        first_extra: bytes | None = None,
    ):
        self._data = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
        self._span = 4 * block_size
        self._n = min(len(self._data) // self._span, max_blocks)
        self._done: list[int] = []
        self._h = root
        self._first_extra = first_extra

    def __len__(self) -> int:
        """The number of full blocks (at most max_blocks), without hashing any."""
        return self._n

    def upto(self, k: int) -> list[int]:
        """The hashes computed so far, extended to the first k blocks (or all there are)."""
        done = self._done
        k = min(k, self._n)
        if len(done) < k:
            data, span = self._data, self._span
            h = self._h
            start = len(done) * span
            if not done and self._first_extra is not None:
                h = chain_extra(h, data[:span], self._first_extra)
                done.append(h)
                start = span
            for i in range(start, k * span, span):
                h = (
                    int.from_bytes(
                        blake2b(
                            h.to_bytes(8, "little") + data[i : i + span], digest_size=8
                        ).digest(),
                        "little",
                    )
                    & _MASK
                )  # chain_bytes, inlined: this loop is the router's hot path
                done.append(h)
            self._h = h
        return done

    def __iter__(self):
        return iter(self.upto(self._n))


def token_count(tokens: bytes | Sequence[int]) -> int:
    return len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)


def sim_token_bytes(prompt: bytes) -> bytes:
    """token_bytes(byte_tokens(prompt)), without making the ints."""
    pad = -len(prompt) % 4
    if sys.byteorder == "little":
        return prompt + b"\0" * pad
    return token_bytes(byte_tokens(prompt))


def byte_tokens(prompt: bytes) -> list[int]:
    """The simulator's token ids: its prompt bytes, 4 per token (little-endian uint32), the
    last one zero-padded. Token-id prompts, which the simulator packs 4 bytes per id, come
    back as the same ids."""
    pad = -len(prompt) % 4
    a = array("I")
    a.frombytes(prompt + b"\0" * pad)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()
