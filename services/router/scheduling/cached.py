"""The precise prefix scorer: the share of a prompt each engine holds per its KV events.

It reads the router's KV event index (`llmgw.router.kvcache`) for endpoints whose
engines publish events, and falls back to the approximate guess (`prefix`) for the
rest, limited by how busy the warm engine is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw.contracts import SchedulingSpec
from llmgw.kvblocks import token_count
from llmgw.router.kvcache.indexer import PromptWork
from llmgw.router.kvcache.tokens import TOKENIZERS
from llmgw.router.scheduling.scorers import StatelessScorer

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Settings


# Weight of the latest request in an endpoint's average of uncached prompt tokens.
_UNCACHED_WEIGHT = 0.2


class CachedPrefixScorer(StatelessScorer):
    """The share of the prompt's blocks the endpoint actually holds, from engine KV events.

    For an endpoint whose engine sends events, what it holds comes from the router's
    KV indexer (`kvcache.indexer`: tokens, block keys, index lookup), and this scorer
    divides; for one that sends none, the approximate guess of PrefixScorer stands in,
    and every pick still feeds that guess.

    Load-aware affinity: an endpoint with more than `prefix.affinity_max_pending` requests
    pending (its queue from a fresh load sample, or this router's in-flight requests
    beyond its batch capacity, declared or learned: read, never written, here), or with
    more than `prefix.affinity_max_pending_tokens` uncached prompt tokens estimated
    queued there, scores 0 here, so load alone decides until it drains.
    """

    name = "kv_prefix"
    learns = True
    needs_prompt_blocks = True  # the prompt's bytes, and the guess for engines without events

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.indexer = settings.indexer
        self.max_pending = settings.prefix.affinity_max_pending
        self.max_pending_tokens = settings.prefix.affinity_max_pending_tokens
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

        What each engine holds comes from the indexer, which keeps its work on the
        context (`ctx.kv`), so a retry of the request recomputes nothing.
        """
        indexer = self.indexer
        if indexer is None:
            return None
        sizes = indexer.block_sizes(cands)
        if sizes is None:
            return None
        prompt = ctx.prefix.prompt
        if not prompt:
            return [None] * len(cands)
        work = ctx.kv
        if work is None:
            work = ctx.kv = PromptWork(ctx.adapter)
        held = indexer.overlaps(prompt, ctx.salt, self.tokenizer, cands, sizes, work)
        return [None if h is None else h[0] / h[1] if h[1] else 0.0 for h in held]

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
                share = ep.prefix_index.match(approx) / n if n else 0.0
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
        work = ctx.kv
        if work is not None:
            held = work.held.get(ep.id)
            tokens = work.tokens.get(ep.spec.engine)
            if held is not None and tokens is not None:
                uncached = max(0, token_count(tokens) - held)
                ep.uncached_tokens += _UNCACHED_WEIGHT * (uncached - ep.uncached_tokens)
        # The guess is fed only for engines without events: it stands in for them alone,
        # and hashing it for every request would cost what the lazy match saves.
        if ctx.prefix and not (self.indexer is not None and self.indexer.tracks(ep.id)):
            ep.prefix_index.insert(ctx.prefix)
