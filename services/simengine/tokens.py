"""Deterministic stand-ins for a tokenizer, a chat template and a model's output.

Prompt tokens: the UTF-8 bytes of the rendered prompt, 4 bytes per token, rounded up (token-id
prompts are packed as 4-byte integers, so they count exactly one token each). Prefix-cache
block hashes are chained over those bytes, one full block of `block_size` tokens at a time, so
two prompts share cached blocks exactly when they share a byte prefix of whole blocks.

Output tokens: one token per piece. Lorem pieces are words drawn from a fixed list; echo
pieces are the echoed text cut into runs of at least 4 bytes on character boundaries.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from llmgw.chatprompt import pack_token_ids, render_chat

__all__ = ["pack_token_ids", "render_chat"]

BYTES_PER_TOKEN = 4

LOREM_WORDS = tuple(
    (
        "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
        "incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud "
        "exercitation ullamco laboris nisi aliquip ex ea commodo consequat duis aute irure "
        "in reprehenderit voluptate velit esse cillum fugiat nulla pariatur excepteur sint "
        "occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est"
    ).split()
)
_SPACED_WORDS = tuple(" " + w for w in LOREM_WORDS)


def count_tokens(prompt: bytes) -> int:
    return -(-len(prompt) // BYTES_PER_TOKEN)


def salt_seed(cache_salt: str | None, lora_name: str | None = None) -> int:
    """The chain's seed for a request's blocks: a salt keys its first block, as in vLLM,
    so a salted prefix is shared only with requests of the same salt; a LoRA adapter keys
    every block in vLLM, so blocks computed under it match only its own requests."""
    seed = hash(("cache_salt", cache_salt)) if cache_salt else 0
    return hash(("lora", lora_name, seed)) if lora_name else seed


def block_hashes(prompt: bytes, block_size: int, seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks: block i's hash covers blocks 0..i.

    Python's hash() is salted per process, which is fine: the cache lives in one process.
    """
    span = block_size * BYTES_PER_TOKEN
    out = []
    h = seed
    for start in range(0, len(prompt) - span + 1, span):
        h = hash((h, prompt[start : start + span]))
        out.append(h)
    return tuple(out)


def echo_pieces(text: str) -> list[str]:
    if text.isascii():
        return [text[i : i + BYTES_PER_TOKEN] for i in range(0, len(text), BYTES_PER_TOKEN)]
    pieces: list[str] = []
    cur: list[str] = []
    size = 0
    for ch in text:
        cur.append(ch)
        size += len(ch.encode())
        if size >= BYTES_PER_TOKEN:
            pieces.append("".join(cur))
            cur, size = [], 0
    if cur:
        pieces.append("".join(cur))
    return pieces


def lorem_pieces(n: int, rng: random.Random) -> list[str]:
    if n <= 0:
        return []
    pieces = rng.choices(_SPACED_WORDS, k=n)
    pieces[0] = pieces[0][1:]
    return pieces


def cut_at_stop(pieces: list[str], stops: Sequence[str]) -> list[str] | None:
    """The pieces before the earliest stop string (which is not emitted), or None if none occurs."""
    text = "".join(pieces)
    found = [i for s in stops if s and (i := text.find(s)) >= 0]
    if not found:
        return None
    cut = min(found)
    out: list[str] = []
    pos = 0
    for piece in pieces:
        if pos + len(piece) >= cut:
            if cut > pos:
                out.append(piece[: cut - pos])
            break
        out.append(piece)
        pos += len(piece)
    return out
