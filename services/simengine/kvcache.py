"""A pool of KV-cache blocks with prefix caching, in the manner of vLLM's block manager.

A block is in use while some running request references it. A block whose refcount drops to
zero is free, but if it holds a full prompt block (it has a hash) it stays findable by that
hash until the pool needs it for something else: cached free blocks are evicted least recently
freed first. Plain free blocks (no hash) are handed out before any cached block is evicted,
which keeps reusable prefixes alive a little longer than vLLM's single free queue does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._plain_free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives block 0 first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.on_evict: Callable[[int], None] | None = None  # a cached block's hash is forgotten

    @property
    def free(self) -> int:
        """Blocks that can be handed out now (plain free plus evictable cached)."""
        return len(self._plain_free) + len(self._cached_free)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Blocks holding a reusable prompt block, whether in use or free."""
        return len(self._by_hash)

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of this chain of block hashes."""
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, n: int, hits: Sequence[int] = ()) -> bool:
        """Whether `n` new blocks fit after taking `hits` (which may themselves be free)."""
        reserved = sum(1 for b in hits if self._ref[b] == 0)
        return n <= self.free - reserved

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take references on cached blocks found by match()."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.free:
            raise RuntimeError(f"allocate({n}) with only {self.free} free blocks")
        out = []
        for _ in range(n):
            if self._plain_free:
                b = self._plain_free.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                del self._by_hash[self._hash[b]]
                if self.on_evict is not None:
                    self.on_evict(self._hash[b])
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Last block first, so a chain's tail is evicted before the prefix others may share.
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._plain_free.append(b)
                else:
                    self._cached_free[b] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Make a computed full prompt block findable; a duplicate of a cached one stays plain.
        True when the block became findable now."""
        if self._hash[block] is None and block_hash not in self._by_hash:
            self._hash[block] = block_hash
            self._by_hash[block_hash] = block
            return True
        return False
