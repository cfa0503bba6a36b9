"""Which engine holds which prompt block: an index fed only by engines' KV events.

Agents relay each engine's KV cache events with canonical block hashes
(llmgw.kvblocks) and the engine's own batch numbers; every router folds the same
stream into the same index, so every router sees the same caches. Pure: the feed
(kvfeed.py) does the I/O.

One dict maps a block hash to a bit mask of the endpoints holding it (a slot per
endpoint), so matching a prompt costs one lookup per prompt block whatever the
number of endpoints. Memory is bounded by `max_blocks` distinct hashes (stores
beyond it are dropped and counted); measured at about 90 bytes per block
(tests/bench/bench_prefix_routing.py prints it).

Forgetting all of one endpoint's blocks (a snapshot, a clear, a removed endpoint)
would be a scan of the whole index, seconds per million blocks on a busy machine,
stalling the router. Instead the endpoint moves to a fresh slot at once and its old
slot is retired: matching only ever looks at live slots, and `sweep` clears retired
bits in bounded chunks that the feed runs between other work (the dict is set aside
whole and its entries moved back a chunk at a time; lookups read both meanwhile);
a retired slot is reused only once swept.

Per endpoint the index follows the relay's numbering: a batch must continue where
the last one ended, in the same epoch. Anything else (a first batch, a restarted
relay or engine, a lost batch) makes it ask for a snapshot; batches that arrive
meanwhile are kept and replayed on top of it. Until an endpoint has been synced
once it "has no events", and schedulers fall back to their approximate guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmgw import contracts as c

_MAX_BUFFERED = 4096  # batches kept while a snapshot is awaited
# Blocks hashed before the first lookups of a lazily hashed prompt: a cold prompt
# usually misses within the first few (after the chat template's shared opening).
_FIRST_CHUNK = 4


@dataclass(slots=True)
class EndpointBlocks:
    slot: int
    epoch: str = ""
    seq: int = -1
    block_size: int = 0
    count: int = 0
    synced: bool = False
    resyncing: bool = False
    buffered: list[c.KvEvents] = field(default_factory=list)


class BlockIndex:
    def __init__(self, max_blocks: int = 4_000_000):
        self.max_blocks = max_blocks
        self.blocks: dict[int, int] = {}
        self.endpoints: dict[str, EndpointBlocks] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._retired = 0  # bit mask of slots whose blocks are still to be swept
        self._sweeping = 0  # the part of it the sweep under way clears
        # While a sweep runs: the entries it has not reached yet (lookups fall back to
        # them; an entry that is written moves to `blocks`, its swept bits cleared).
        self._old: dict[int, int] = {}
        self.dropped_stores = 0
        self.gaps = 0
        self.snapshots = 0

    # -- reading -------------------------------------------------------------------------

    def has_events(self, endpoint_id: str) -> bool:
        st = self.endpoints.get(endpoint_id)
        return st is not None and st.synced

    def block_size(self, endpoint_id: str) -> int:
        st = self.endpoints.get(endpoint_id)
        return st.block_size if st is not None and st.synced else 0

    def match(self, hashes: Sequence[int], endpoint_ids: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of `hashes` each endpoint holds (synced ones only).

        `hashes` may be a kvblocks.LazyPromptHashes: then blocks are hashed in chunks
        that grow as long as some endpoint still holds every block so far, so a prompt
        no engine holds costs one chunk of hashing, not the whole prompt."""
        slots = {}
        for ep_id in endpoint_ids:
            st = self.endpoints.get(ep_id)
            if st is not None and st.synced:
                slots[ep_id] = 1 << st.slot
        out = dict.fromkeys(slots, 0)
        alive = 0
        for bit in slots.values():
            alive |= bit
        blocks, old = self.blocks, self._old
        upto = getattr(hashes, "upto", None)
        total = len(hashes)
        n = 0
        want = _FIRST_CHUNK
        while n < total:
            if upto is None:
                chunk, end = hashes, total
            else:
                chunk = upto(want)
                end = len(chunk)
                want *= 4
            for i in range(n, end):
                m = blocks.get(chunk[i])
                if m is None:
                    m = old.get(chunk[i], 0) if old else 0
                m &= alive
                if m != alive:
                    for ep_id, bit in slots.items():
                        if alive & bit and not m & bit:
                            out[ep_id] = i
                    alive = m
                    if not alive:
                        return out
            n = end
        for ep_id, bit in slots.items():
            if alive & bit:
                out[ep_id] = n
        return out

    def __len__(self) -> int:
        return len(self.blocks) + len(self._old)

    # -- events --------------------------------------------------------------------------

    def _new_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def _state(self, endpoint_id: str) -> EndpointBlocks:
        st = self.endpoints.get(endpoint_id)
        if st is None:
            st = self.endpoints[endpoint_id] = EndpointBlocks(slot=self._new_slot())
        return st

    def offer(self, endpoint_id: str, batch: c.KvEvents) -> bool:
        """Apply one relayed batch; True when the caller must fetch a snapshot."""
        st = self._state(endpoint_id)
        if st.resyncing:
            if len(st.buffered) < _MAX_BUFFERED:
                st.buffered.append(batch)
            return False
        if st.synced and batch.epoch == st.epoch:
            if batch.seq_last <= st.seq:
                return False  # already applied (a snapshot covered it)
            if batch.seq_first == st.seq + 1:
                self._apply(st, batch)
                return False
        if st.synced:
            self.gaps += 1
        st.resyncing = True
        st.buffered = [batch]
        return True

    def resync(self, endpoint_id: str) -> bool:
        """Start a resync without a batch (a router starting, an endpoint appearing); False
        when one is already under way."""
        st = self._state(endpoint_id)
        if st.resyncing:
            return False
        st.resyncing = True
        st.buffered = []
        return True

    def snapshot(self, endpoint_id: str, snap: c.KvSnapshot) -> bool:
        """Start over from a snapshot and replay what arrived meanwhile; True when the
        replay found another gap (fetch again)."""
        st = self._state(endpoint_id)
        self._clear(st)
        bit = 1 << st.slot
        blocks = self.blocks
        for h in snap.hashes:
            self._store(blocks, st, bit, h)
        st.epoch, st.seq, st.block_size = snap.epoch, snap.seq, snap.block_size
        st.synced = True
        st.resyncing = False
        self.snapshots += 1
        buffered, st.buffered = st.buffered, []
        for batch in buffered:
            if batch.epoch != st.epoch:
                continue  # older or newer numbering: the next batch decides
            if batch.seq_last <= st.seq:
                continue
            if batch.seq_first != st.seq + 1:
                self.gaps += 1
                st.resyncing = True
                st.buffered = [b for b in buffered if b.seq_last > st.seq]
                return True
            self._apply(st, batch)
        return False

    def snapshot_failed(self, endpoint_id: str) -> None:
        """No snapshot came (no relay answers, or not in time): forget the endpoint's
        blocks (schedulers guess for it meanwhile) but stay resyncing, buffering batches
        for the feed's next try, which replays those that follow its snapshot."""
        st = self.endpoints.get(endpoint_id)
        if st is None:
            return
        self._clear(st)
        st.synced = False

    def drop(self, endpoint_id: str) -> None:
        """The endpoint left the projection: its blocks go, its slot is reused."""
        st = self.endpoints.pop(endpoint_id, None)
        if st is not None:
            if st.count:
                self._retired |= 1 << st.slot
            else:
                self._free_slots.append(st.slot)

    def _apply(self, st: EndpointBlocks, batch: c.KvEvents) -> None:
        blocks = self.blocks
        if batch.block_size:
            st.block_size = batch.block_size
        for op in batch.ops:
            bit = 1 << st.slot  # a clear moves the endpoint to a new slot
            if op.op is c.KvOp.STORED:
                for h in op.hashes:
                    self._store(blocks, st, bit, h)
            elif op.op is c.KvOp.REMOVED:
                for h in op.hashes:
                    m = blocks.get(h)
                    if m is None:
                        m = self._migrate(blocks, h)
                    if m & bit:
                        st.count -= 1
                        m &= ~bit
                        if m:
                            blocks[h] = m
                        else:
                            del blocks[h]
            else:
                self._clear(st)
        st.seq = batch.seq_last

    def _migrate(self, blocks: dict[int, int], h: int) -> int:
        """An entry the running sweep has not reached, moved to `blocks` with the swept
        slots' bits cleared (0, and not moved, when there is none)."""
        m = self._old.pop(h, None) if self._old else None
        if m is None:
            return 0
        m &= ~self._sweeping
        if m:
            blocks[h] = m
        return m

    def _store(self, blocks: dict[int, int], st: EndpointBlocks, bit: int, h: int) -> None:
        m = blocks.get(h)
        if m is None and self._old:
            m = self._migrate(blocks, h) or None
        if m is None:
            if len(blocks) + len(self._old) >= self.max_blocks:
                self.dropped_stores += 1
                return
            blocks[h] = bit
            st.count += 1
        elif not m & bit:
            blocks[h] = m | bit
            st.count += 1

    def _clear(self, st: EndpointBlocks) -> None:
        """Every block of one endpoint out, at once: it moves to a fresh slot."""
        if not st.count:
            return
        self._retired |= 1 << st.slot
        st.slot = self._new_slot()
        st.count = 0

    @property
    def needs_sweep(self) -> bool:
        return bool(self._retired or self._sweeping)

    def sweep(self, budget: int = 50_000) -> bool:
        """Clear retired slots' bits from up to `budget` entries; True when none are left.

        A sweep starts by setting the whole dict aside (O(1)) and a fresh one in its
        place; each call moves up to `budget` entries back, their retired bits cleared.
        No call costs more than its budget, however large the index."""
        if not self._sweeping:
            if not self._retired:
                return True
            self._sweeping, self._retired = self._retired, 0
            self._old, self.blocks = self.blocks, {}
        keep = ~self._sweeping
        old, blocks = self._old, self.blocks
        for _ in range(min(budget, len(old))):
            h, m = old.popitem()
            m &= keep
            if m:
                n = blocks.get(h)
                blocks[h] = m if n is None else n | m
        if old:
            return False
        # Slots retired meanwhile were never given out again, so entries written since
        # the sweep began cannot hold the swept slots' bits.
        sweeping = self._sweeping
        self._free_slots.extend(i for i in range(self._next_slot) if sweeping >> i & 1)
        self._sweeping = 0
        return not self._retired
