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


class PromptBlocks(list):
    """Block hashes that keep the prompt they were cut from: the precise scorer
    (kv_prefix) tokenizes that prompt the way each engine does."""

    __slots__ = ("prompt",)

    def __init__(self, prompt: bytes):
        super().__init__()
        self.prompt = prompt


def block_hashes(data: bytes, block: int, max_blocks: int) -> list[int]:
    """Chained hashes of the full `block`-byte blocks of `data` (at most max_blocks)."""
    n = min(len(data) // block, max_blocks)
    out = PromptBlocks(data)
    h = 0
    for i in range(0, n * block, block):
        h = hash((h, data[i : i + block]))
        out.append(h)
    return out


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
