"""Chained block hashes and the per-endpoint LRU index."""

from llmgw.router.scheduling.prefix import PrefixIndex, block_hashes


def test_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ():
    a = block_hashes(b"x" * 256 + b"y" * 256, 256, 10)
    b = block_hashes(b"z" * 256 + b"y" * 256, 256, 10)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes(b"x" * 256 + b"y" * 256 + b"tail", 256, 10) == a  # partial block ignored
    assert block_hashes(b"short", 256, 10) == []
    assert len(block_hashes(b"x" * 2560, 256, 4)) == 4


def test_match_counts_the_leading_blocks_seen():
    idx = PrefixIndex(capacity=100)
    seen = block_hashes(bytes(range(256)) * 6, 256, 100)
    idx.insert(seen[:4])
    assert idx.match(seen) == 4
    assert idx.match(seen[:3]) == 3
    assert idx.match(block_hashes(b"q" * 1024, 256, 100)) == 0
    idx.insert(seen)
    assert idx.match(seen) == 6


def test_least_recently_used_blocks_are_evicted_first():
    idx = PrefixIndex(capacity=4)
    old = block_hashes(b"o" * 512, 256, 10)
    new = block_hashes(b"n" * 512, 256, 10)
    idx.insert(old)
    idx.insert(new)
    assert len(idx) == 4
    idx.insert(old)  # refreshed
    idx.insert(block_hashes(b"z" * 512, 256, 10))
    assert idx.match(old) == 2 and idx.match(new) == 0
