"""The precise prefix scorer: the share of a prompt each engine holds per its KV events.

It reads the router's KV event index (`llmgw.router.kvcache`) for endpoints whose
engines publish events, and falls back to the approximate guess (`prefix`) for the
rest, limited by how busy the warm engine is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw.contracts import SchedulingSpec
from llmgw.kvblocks import EVENTS_WITHOUT_EXTRA_KEYS, LazyPromptHashes, salt_extra, token_count
from llmgw.router.kvcache.tokens import TOKENIZERS, tokens_for
from llmgw.router.scheduling.scorers import StatelessScorer

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Settings


# Weight of the latest request in an endpoint's average of uncached prompt tokens.
_UNCACHED_WEIGHT = 0.2


class CachedPrefixScorer(StatelessScorer):
    """The share of the prompt's blocks the endpoint actually holds, from engine KV events.

    For an endpoint whose engine sends events (the router's BlockIndex is synced for
    it) the prompt is tokenized as that engine does (prompttokens) and its blocks
    hashed as the relay hashes them (kvblocks); for one that sends none, the
    approximate guess of PrefixScorer stands in, and every pick still feeds that guess.

    Load-aware affinity: an endpoint with more than `affinity_max_pending` requests
    pending (its queue from a fresh load sample, or this router's in-flight requests
    beyond its batch capacity, declared or learned: read, never written, here), or with more than
    `affinity_max_pending_tokens` uncached prompt tokens estimated queued there, scores
    0 here, so load alone decides until it drains.
    """

    name = "kv_prefix"
    learns = True

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.index = settings.kv_index
        self.max_pending = settings.affinity_max_pending
        self.max_pending_tokens = settings.affinity_max_pending_tokens
        self.max_blocks = settings.kv_max_blocks
        self.batches = settings.batches
        self.tokenizer = ""

    def configure(self, spec: SchedulingSpec) -> None:
        self.tokenizer = spec.tokenizer
        # Loaded in a thread now, so no request waits for it (approximate until then).
        TOKENIZERS.want(spec.tokenizer)

    def pending(self, ep: EndpointRuntime, now: float) -> int:
        """Requests waiting at the engine: its queue from a fresh load sample, or this
        router's in flight beyond the engine's batch capacity, whichever is larger.

        The capacity is the one admission reads (`endpoints.capacity`): the catalog's
        `max_running` or the one learned from load samples, whichever is larger. So a
        burst onto the warm engine is limited between samples too, not only by a sample
        a few hundred milliseconds old."""
        load = ep.load
        waiting = load.waiting if load is not None and load.at >= now - self.stale_after else 0
        batches = self.batches
        cap = batches.of(ep) if batches is not None else ep.spec.max_running
        beyond = ep.inflight - cap if cap else 0
        return max(waiting, beyond)

    def overlaps(self, cands: Sequence[EndpointRuntime], ctx: Context) -> list[float | None] | None:
        """Per candidate: the cached share from events, or None where there are none;
        None (nothing allocated) when no candidate has events.

        Hashes are computed while matching and only as far as some candidate holds the
        prompt (a cold prompt costs one small chunk), and kept on the context with the
        token ids, so a retry of the request recomputes nothing.
        """
        index = self.index
        if index is None or not index.endpoints:
            return None
        sizes = None
        for i, ep in enumerate(cands):
            bs = index.block_size(ep.id)
            if bs:
                if sizes is None:
                    sizes = [0] * len(cands)
                sizes[i] = bs
        if sizes is None:
            return None
        out: list[float | None] = [None] * len(cands)
        prompt = getattr(ctx.prefix, "prompt", None)
        if prompt is None:
            return out
        memo = ctx.kv
        if memo is None:
            memo = ctx.kv = {}
        groups: dict[tuple[str, int], list[int]] = {}
        for i, bs in enumerate(sizes):
            if not bs:
                continue
            engine = cands[i].spec.engine
            if ctx.salt and engine in EVENTS_WITHOUT_EXTRA_KEYS:
                continue  # its events cannot tell salted blocks: the approximate guess
            if engine not in memo:
                memo[engine] = tokens_for(engine, self.tokenizer, prompt)
            if memo[engine] is not None:
                groups.setdefault((engine, bs), []).append(i)
        for key, members in groups.items():
            hashes = memo.get(key)
            if hashes is None:
                hashes = memo[key] = LazyPromptHashes(
                    memo[key[0]], key[1], self.max_blocks, first_extra=salt_extra(ctx.salt)
                )
            n = len(hashes)
            if not n:
                for i in members:
                    out[i] = 0.0
                continue
            found = index.match(hashes, [cands[i].id for i in members])
            held = memo.setdefault("held", {})
            for i in members:
                ep_id = cands[i].id
                out[i] = found.get(ep_id, 0) / n
                held[ep_id] = found.get(ep_id, 0) * key[1]  # tokens cached there
        return out

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        overlaps = self.overlaps(cands, ctx)
        approx = None  # the approximate hashes, made only if some candidate needs them
        n = 0
        now = ctx.now
        for i, ep in enumerate(cands):
            share = overlaps[i] if overlaps is not None else None
            if share is None:
                if approx is None:
                    approx = ctx.prefix
                    n = len(approx)
                share = ep.prefix.match(approx) / n if n else 0.0
            if share and self.too_busy(ep, now):
                share = 0.0
            out[i] = share

    def too_busy(self, ep: EndpointRuntime, now: float) -> bool:
        """Past the affinity limit: too many requests pending, or too many uncached
        prompt tokens queued (pending requests x the uncached tokens of this router's
        requests there, a moving average)."""
        pending = self.pending(ep, now)
        if pending > self.max_pending:
            return True
        cap = self.max_pending_tokens
        return bool(cap) and pending * ep.uncached_tokens > cap

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None:
        memo = ctx.kv
        if memo is not None:
            held = memo.get("held", {}).get(ep.id)
            tokens = memo.get(ep.spec.engine)
            if held is not None and tokens is not None:
                uncached = max(0, token_count(tokens) - held)
                ep.uncached_tokens += _UNCACHED_WEIGHT * (uncached - ep.uncached_tokens)
        # The guess is fed only for engines without events: it stands in for them alone,
        # and hashing it for every request would cost what the lazy match saves.
        if ctx.prefix and not (self.index is not None and self.index.block_size(ep.id)):
            ep.prefix.insert(ctx.prefix)
