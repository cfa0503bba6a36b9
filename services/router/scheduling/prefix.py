"""Approximate prefix matching: chained hashes of prompt blocks, an LRU per endpoint.

Engines reuse the KV blocks of a prompt prefix they have seen. The router cannot
see their caches, so it remembers which prompts it sent where: each block hash
covers its block and every block before it (a chain), so a hit on block k
means the whole prefix up to k matched. The prompt is the request's raw JSON
(`messages` or `prompt`), which shares its leading bytes exactly when the
conversation shares its beginning.

Hashes use Python's `hash`, randomised per process: the index is private to
one worker, so the values never need to agree across processes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw import config as cfg
from llmgw.router.scheduling.scorers import StatelessScorer

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context


class PrefixConfig(cfg.ConfigStruct):
    """The prefix scorers' section of the router config (`prefix:`): each of `prefix`,
    `kv_prefix` and the pipeline's prompt blocks reads its own fields from it."""

    block_bytes: int = 256  # 64 pseudo-tokens of 4 bytes, as llm-d's approximate matcher
    max_blocks: int = 128  # hash at most this many leading blocks of a prompt
    capacity_blocks: int = 16384  # LRU entries per endpoint
    # The kv_prefix scorer: distinct engine blocks indexed from KV events (about 100 bytes
    # each), and the queue past which cache affinity gives way to load.
    index_max_blocks: int = 4_000_000
    affinity_max_pending: int = 4
    # ... and the uncached prompt tokens queued there (estimated), past which it gives
    # way too: about half a second of prefill for a mid-size model on one GPU. 0: off.
    affinity_max_pending_tokens: int = 8192
    # ... and, relative to the least-loaded candidate, the prefill one more request there
    # is worth: a warm engine keeps its affinity only while the prompt tokens it holds
    # beyond that candidate's pay for its extra requests at this rate. 0: off. 128, one
    # vLLM block: at 512 a conversation's next turn left its warm engine whenever that
    # engine had one request more in flight (docs/router.md, "Cache against load").
    affinity_tokens_per_request: int = 128
    # ... plus, per uncached prompt token this router has queued there (estimated: its
    # requests still waiting for their first event x their average uncached tokens),
    # this many tokens. 0: off. 0.5, not 1: measured, 1 also sent turns away from their
    # warm engines at equal load (docs/router.md, "Queued prefill").
    affinity_queued_prefill: float = 0.5


class PromptBlocks:
    """Chained block hashes of a prompt, hashed on first use: a request whose every
    candidate engine sends KV events never needs them (the precise scorer, kv_prefix,
    tokenizes `prompt`, the bytes they are cut from, the way each engine does).

    Truthiness and len() cost no hashing; indexing, iteration and `hashes` do, once.
    """

    __slots__ = ("prompt", "block", "max_blocks", "seed", "_hashes")

    def __init__(self, prompt: bytes, block: int, max_blocks: int, seed: int = 0):
        self.prompt = prompt
        self.block = block
        self.max_blocks = max_blocks
        self.seed = seed  # the chain's start: a request's cache_salt, hashed
        self._hashes: list[int] | None = None

    @property
    def hashes(self) -> list[int]:
        hashes = self._hashes
        if hashes is None:
            data, block = self.prompt, self.block
            hashes = []
            h = self.seed
            for i in range(0, len(self) * block, block):
                h = hash((h, data[i : i + block]))
                hashes.append(h)
            self._hashes = hashes
        return hashes

    def __len__(self) -> int:
        return min(len(self.prompt) // self.block, self.max_blocks) if self.max_blocks > 0 else 0

    def __getitem__(self, i):
        return self.hashes[i]

    def __iter__(self):
        return iter(self.hashes)

    def __eq__(self, other) -> bool:
        if isinstance(other, PromptBlocks):
            other = other.hashes
        return self.hashes == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptBlocks({self.hashes!r})"


# A request whose prompt no scorer reads: no blocks, nothing to hash.
NO_PROMPT = PromptBlocks(b"", 1, 0)


def block_hashes(
    data: bytes, block: int, max_blocks: int, cache_salt: str | None = None
) -> PromptBlocks:
    """Chained hashes of the full `block`-byte blocks of `data` (at most max_blocks),
    computed when first read. A request's cache_salt starts the chain elsewhere: engines
    share a salted prefix only with requests of the same salt, so the guess must too."""
    seed = hash(("cache_salt", cache_salt)) if cache_salt else 0
    return PromptBlocks(data, block, max_blocks, seed)


class PrefixIndex:
    """Block hashes recently sent to one endpoint, least recently used evicted first."""

    __slots__ = ("_lru", "capacity")

    def __init__(self, capacity: int):
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` this endpoint has seen.

        Chained hashes make presence monotone (a prefix is inserted whole and
        refreshed whole), so a binary search needs O(log n) lookups.
        """
        if isinstance(hashes, PromptBlocks):
            hashes = hashes.hashes
        lru = self._lru
        n = len(hashes)
        if not n or hashes[0] not in lru:
            return 0
        if hashes[-1] in lru:
            return n
        lo, hi = 1, n - 1  # hashes[lo-1] present, hashes[hi] absent
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in lru:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, hashes: list[int]) -> None:
        lru = self._lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class PrefixScorer(StatelessScorer):
    """The share of the prompt's leading blocks this router already sent to the endpoint."""

    name = "prefix"
    learns = True
    needs_prompt_blocks = True

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        hashes = ctx.prefix
        if not hashes:
            return
        n = len(hashes)
        for i, ep in enumerate(cands):
            out[i] = ep.prefix_index.match(hashes) / n

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None:
        if ctx.prefix:
            ep.prefix_index.insert(ctx.prefix)
