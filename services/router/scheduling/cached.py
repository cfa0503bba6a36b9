"""The precise prefix scorer: the share of a prompt each engine holds per its KV events.

It reads the router's KV event index (`llmgw.router.kvcache`) for endpoints whose
engines publish events, and falls back to the approximate guess (`prefix`) for the
rest, limited by how busy the warm engine is, both absolutely and against the
least-loaded candidate: a cache only counts where the prefill it saves pays for the
requests queued in front (on a fleet where nothing evicts, affinity alone piled work
onto the warm engines and lost to round robin).
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
# Bytes per token in the approximate guess (its 256-byte blocks are 64 pseudo-tokens).
_BYTES_PER_TOKEN = 4


def worth_their_load(
    loads: Sequence[int],
    cached: Sequence[float],
    tokens_per_request: float,
    queued: Sequence[float] | None = None,
) -> list[bool]:
    """Per candidate: whether the prompt tokens it holds pay for the requests it has,
    i.e. whether it is among the cheapest by `load x tokens_per_request + queued - cached`.

    An estimate of time to first token in prefill tokens: each request already there is
    worth `tokens_per_request` of waiting, each prompt token queued there for prefill
    (`queued`, weighed by the caller; none if None) one, each cached token one of
    prefill saved. So the least-loaded candidate qualifies unless another holds enough
    more of the prompt to make up for its extra requests, or its own queued prefill
    outweighs that, and equally loaded candidates are told apart by their caches and
    queued prefill alone."""
    if queued is None:
        queued = [0.0] * len(loads)
    costs = [
        tokens_per_request * n + q - held for n, q, held in zip(loads, queued, cached, strict=True)
    ]
    best = min(costs)
    return [cost <= best for cost in costs]


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

    Relative to the other candidates (`worth_their_load`): an endpoint whose extra
    requests over the least-loaded candidate cost more, at
    `prefix.affinity_tokens_per_request` prefill tokens each, than the extra prompt
    tokens it holds saves, scores 0 too. Its load there is this router's requests in
    flight: a load sample is up to `stale_after` old and every router reads the same
    one, so between samples they would all pile onto the engine it shows least loaded
    (measured on two vLLM engines); each router balancing its own share balances the sum.
    The prefill this router has queued there counts too: its streamed requests still
    waiting for their first event and its prefill legs (`prefilling`) x the uncached
    tokens of its requests there, at `prefix.affinity_queued_prefill` per token. That
    average is learned from KV events only, so the term is 0 for engines without them.
    """

    name = "kv_prefix"
    learns = True
    needs_prompt_blocks = True  # the prompt's bytes, and the guess for engines without events

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.indexer = settings.indexer
        self.max_pending = settings.prefix.affinity_max_pending
        self.max_pending_tokens = settings.prefix.affinity_max_pending_tokens
        self.tokens_per_request = settings.prefix.affinity_tokens_per_request
        self.queued_prefill = settings.prefix.affinity_queued_prefill
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
            work = ctx.kv = PromptWork(ctx.adapter, ctx.body, prompt, ctx.api == "responses")
        held = indexer.overlaps(prompt, ctx.salt, self.tokenizer, cands, sizes, work)
        return [None if h is None else h[0] / h[1] if h[1] else 0.0 for h in held]

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        overlaps = self.overlaps(cands, ctx)
        held = ctx.kv.held if ctx.kv is not None else {}
        cached = [0.0] * len(cands)  # prompt tokens each holds (approximate: bytes / 4)
        approx = None  # the approximate hashes, made only if some candidate needs them
        n = 0
        now = ctx.now
        for i, ep in enumerate(cands):
            share = overlaps[i] if overlaps is not None else None
            if share is None:
                if approx is None:
                    approx = ctx.prefix
                    n = len(approx)
                matched = ep.prefix_index.match(approx) if n else 0
                share = matched / n if n else 0.0
                cached[i] = matched * approx.block / _BYTES_PER_TOKEN
            else:
                cached[i] = held.get(ep.id, 0)
            if share and self.too_busy(ep, now):
                share = cached[i] = 0.0
            out[i] = share
        if self.tokens_per_request and any(out):
            loads = [ep.inflight for ep in cands]
            w = self.queued_prefill
            queued = [w * ep.prefilling * ep.uncached_tokens for ep in cands] if w else None
            for i, worth in enumerate(
                worth_their_load(loads, cached, self.tokens_per_request, queued)
            ):
                if not worth:
                    out[i] = 0.0

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
