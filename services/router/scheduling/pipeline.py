"""Where a request goes: filters, then weighted scorers, then a picker.

Each unit is small, named and behind one interface, and a model's pipeline is
assembled from its `contracts.SchedulingSpec` (names and weights). Pure: the
caller passes the time, and there is no random source. Where a picker needs
chance (ties, p2c's two candidates, weighted_random's draw) it reads the
request's key, a hash of its bytes (`request_key`): two routers with the same
view pick the same endpoint for the same request, and tests drive every
decision.

Filters drop endpoints that must not get the request. Scorers rate each
remaining endpoint in 0..1 (higher is better); the pipeline sums them with the
model's weights and the picker chooses. Scorers that learn from decisions
(prefix, session) see the chosen endpoint through `picked`.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from llmgw.contracts import EndpointState, SchedulingSpec
from llmgw.kvblocks import EVENTS_WITHOUT_EXTRA_KEYS, LazyPromptHashes, salt_extra, token_count
from llmgw.router.kvcache.tokens import TOKENIZERS, tokens_for
from llmgw.router.relay.circuit import CLOSED

if TYPE_CHECKING:
    from llmgw.router.endpoints.view import EndpointRuntime


@dataclass(frozen=True, slots=True)
class Settings:
    stale_after: float = 1.0  # seconds after which scraped load no longer counts
    session_capacity: int = 65536  # sessions remembered per model
    # The router's index of engines' KV events (kvindex.BlockIndex); None: no events.
    kv_index: Any = None
    # Cache affinity holds while the warm engine has at most this many requests pending
    # (waiting in its queue, or in flight from this router beyond its batch capacity).
    affinity_max_pending: int = 4
    # ... and while the uncached prompt tokens queued there are at most this many (0: no
    # token limit): pending requests x the uncached tokens of this router's requests there.
    affinity_max_pending_tokens: int = 8192
    kv_max_blocks: int = 512  # prompt blocks hashed per request, at most


class Context:
    """What the pipeline knows about one request."""

    __slots__ = ("now", "model", "prefix", "session", "exclude", "key", "kv", "salt")

    def __init__(
        self,
        now: float,
        model: str,
        prefix: list[int] | None = None,
        session: str | None = None,
        exclude: Sequence[str] = (),
        key: int = 0,
    ):
        self.now = now
        self.model = model
        self.prefix = prefix or []  # chained block hashes of the prompt
        self.session = session
        self.exclude = exclude  # endpoint ids already tried for this request
        self.key = key  # request_key(body): the pickers' only source of chance
        # kv_prefix's work on this prompt, kept for the request's retries: token ids by
        # engine kind, lazily computed block hashes by (engine kind, block size).
        self.kv: dict | None = None
        # The request's cache_salt: engines key its first block by it, so must kv_prefix.
        self.salt: str | None = None


# Bytes hashed from each end of a body: O(1) for any size, and the end is where
# requests that share a long system prompt differ.
_KEY_EDGE = 2048


def request_key(body: bytes) -> int:
    """A 32-bit hash of the request, the same in every router process (unlike `hash`)."""
    if len(body) <= 2 * _KEY_EDGE:
        return zlib.crc32(body)
    key = zlib.crc32(body[-_KEY_EDGE:], zlib.crc32(body[:_KEY_EDGE]))
    return zlib.crc32(len(body).to_bytes(8, "little"), key)


def _unit(key: int) -> float:
    """The key as a number in [0, 1), its bits mixed so nearby keys land far apart
    (murmur3's finaliser: CRCs of bodies that differ in one byte differ in few bits)."""
    h = key & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return (h ^ (h >> 16)) / 4294967296.0


# ------------------------------------------------------------------ interfaces


class Filter(Protocol):
    name: ClassVar[str]

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        """The candidates that may get the request (a whole list at a time: one
        comprehension is much cheaper per request than a call per endpoint)."""


class Scorer(Protocol):
    name: ClassVar[str]
    learns: ClassVar[bool]  # wants `picked` calls

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        """Write each candidate's score (0..1, higher is better) into `out`."""

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None: ...


class Picker(Protocol):
    name: ClassVar[str]

    def pick(self, totals: Sequence[float], key: int) -> int: ...


# ------------------------------------------------------------------ filters


class ServesModel:
    name = "serves_model"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        model = ctx.model
        return [ep for ep in cands if model in ep.models]


class Ready:
    """Ready and not draining: a draining engine finishes what it has, takes nothing new."""

    name = "ready"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        ready = EndpointState.READY
        return [ep for ep in cands if ep.state is ready]


class CircuitClosed:
    """Circuit not open; after the cool-down, one probe may pass."""

    name = "circuit"

    def __init__(self, settings: Settings):
        pass

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        now = ctx.now
        return [ep for ep in cands if ep.circuit.state is CLOSED or ep.circuit.allows(now)]


# ------------------------------------------------------------------ scorers


class _Stateless:
    learns = False

    def __init__(self, settings: Settings):
        self.stale_after = settings.stale_after

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None:
        pass


def _min_max(values: list[float | None], out: list[float]) -> None:
    """Lower is better; unknown (None) scores 0. Relative, so small gaps still separate."""
    known = [v for v in values if v is not None]
    if not known:
        return
    lo, hi = min(known), max(known)
    span = hi - lo
    for i, v in enumerate(values):
        if v is None:
            out[i] = 0.0
        elif span == 0:
            out[i] = 1.0
        else:
            out[i] = (hi - v) / span


class QueueScorer(_Stateless):
    """Fewer requests waiting in the engine's queue is better (stale load scores 0)."""

    name = "queue"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        limit = ctx.now - self.stale_after
        values: list[float | None] = []
        for ep in cands:
            load = ep.load
            values.append(load.waiting if load is not None and load.at >= limit else None)
        _min_max(values, out)


class KvScorer(_Stateless):
    """More free KV cache is better (stale load scores 0)."""

    name = "kv"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        limit = ctx.now - self.stale_after
        for i, ep in enumerate(cands):
            load = ep.load
            out[i] = 1.0 - load.kv_usage if load is not None and load.at >= limit else 0.0


class InflightScorer(_Stateless):
    """Fewer requests this router has in flight there is better: the signal that never lags."""

    name = "inflight"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        _min_max([ep.inflight for ep in cands], out)


class PrefixScorer(_Stateless):
    """The share of the prompt's leading blocks this router already sent to the endpoint."""

    name = "prefix"
    learns = True

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        hashes = ctx.prefix
        if not hashes:
            return
        n = len(hashes)
        for i, ep in enumerate(cands):
            out[i] = ep.prefix.match(hashes) / n

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None:
        if ctx.prefix:
            ep.prefix.insert(ctx.prefix)


# Weight of the latest request in an endpoint's average of uncached prompt tokens.
_UNCACHED_WEIGHT = 0.2


class CachedPrefixScorer(_Stateless):
    """The share of the prompt's blocks the endpoint actually holds, from engine KV events.

    For an endpoint whose engine sends events (the router's BlockIndex is synced for
    it) the prompt is tokenized as that engine does (prompttokens) and its blocks
    hashed as the relay hashes them (kvblocks); for one that sends none, the
    approximate guess of PrefixScorer stands in, and every pick still feeds that guess.

    Load-aware affinity: an endpoint with more than `affinity_max_pending` requests
    pending (its queue from a fresh load sample, or this router's in-flight requests
    beyond its batch capacity, declared or learned), or with more than
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
        self.tokenizer = ""

    def configure(self, spec: SchedulingSpec) -> None:
        self.tokenizer = spec.tokenizer
        # Loaded in a thread now, so no request waits for it (approximate until then).
        TOKENIZERS.want(spec.tokenizer)

    def pending(self, ep: EndpointRuntime, now: float) -> int:
        """Requests waiting at the engine: its queue from a fresh load sample, or this
        router's in flight beyond the engine's batch capacity, whichever is larger.

        The capacity is the catalog's `max_running`, else the one learned from load
        samples: the largest running batch seen while requests queued (the batch was
        full then). So a burst onto the warm engine is limited between samples too,
        not only by a sample a few hundred milliseconds old."""
        load = ep.load
        waiting = 0
        if load is not None:
            if load.waiting > 0 and load.running > ep.batch_capacity:
                ep.batch_capacity = load.running
            if load.at >= now - self.stale_after:
                waiting = load.waiting
        cap = ep.spec.max_running or ep.batch_capacity
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


class SessionScorer:
    """Requests with the same session header go where that session went last."""

    name = "session"
    learns = True

    def __init__(self, settings: Settings):
        self.capacity = settings.session_capacity
        self.last: OrderedDict[str, str] = OrderedDict()  # session -> endpoint id

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        if ctx.session is None:
            return
        target = self.last.get(ctx.session)
        if target is None:
            return
        for i, ep in enumerate(cands):
            if ep.id == target:
                out[i] = 1.0

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None:
        if ctx.session is None:
            return
        last = self.last
        last[ctx.session] = ep.id
        last.move_to_end(ctx.session)
        if len(last) > self.capacity:
            last.popitem(last=False)


# ------------------------------------------------------------------ pickers


class MaxScore:
    """The highest total; ties broken by the request key, so equal endpoints share the
    load across distinct requests (and a repeated request goes where it went)."""

    name = "max_score"

    def pick(self, totals: Sequence[float], key: int) -> int:
        best = max(totals)
        ties = [i for i, t in enumerate(totals) if t >= best - 1e-9]
        return ties[0] if len(ties) == 1 else ties[int(_unit(key) * len(ties))]


class PowerOfTwo:
    """The better of two candidates drawn from the request key: never piles onto one
    endpoint under bursts of distinct requests."""

    name = "p2c"

    def pick(self, totals: Sequence[float], key: int) -> int:
        n = len(totals)
        if n == 1:
            return 0
        u = _unit(key) * n
        a = int(u)
        b = (a + 1 + int((u - a) * (n - 1))) % n  # any other index, from the rest of the draw
        return a if totals[a] >= totals[b] else b


class WeightedRandom:
    """Chance proportional to the total score (uniform when every total is zero)."""

    name = "weighted_random"

    def pick(self, totals: Sequence[float], key: int) -> int:
        weights = [t if t > 0 else 0.0 for t in totals]
        total = sum(weights)
        if total <= 0:
            return int(_unit(key) * len(totals))
        r = _unit(key) * total
        for i, w in enumerate(weights):
            r -= w
            if r < 0:
                return i
        return len(totals) - 1


FILTERS: dict[str, Callable[[Settings], Filter]] = {
    f.name: f for f in (ServesModel, Ready, CircuitClosed)
}
SCORERS: dict[str, Callable[[Settings], Scorer]] = {
    s.name: s
    for s in (
        QueueScorer,
        KvScorer,
        InflightScorer,
        PrefixScorer,
        CachedPrefixScorer,
        SessionScorer,
    )
}
PICKERS: dict[str, Callable[[], Picker]] = {
    p.name: p for p in (MaxScore, PowerOfTwo, WeightedRandom)
}


# ------------------------------------------------------------------ the pipeline


class Observer(Protocol):
    """Where filter drops and the chosen endpoint's scores are counted (metrics)."""

    def dropped(self, model: str, filter_name: str, count: int) -> None: ...

    def scored(self, model: str, scorer_name: str, value: float) -> None: ...


class Pipeline:
    def __init__(
        self,
        spec: SchedulingSpec,
        settings: Settings | None = None,
        *,
        observer: Observer | None = None,
    ):
        settings = settings or Settings()
        self.spec = spec
        self.filters = [FILTERS[name](settings) for name in spec.filters]
        # Weight 0 turns a scorer off without removing it from the file.
        self.scorers = [
            (SCORERS[name](settings), weight) for name, weight in spec.scorers.items() if weight > 0
        ]
        for scorer, _ in self.scorers:
            configure = getattr(scorer, "configure", None)
            if configure is not None:
                configure(spec)
        self.picker = PICKERS[spec.picker]()
        self.learners = [s for s, _ in self.scorers if s.learns]
        self.uses_prefix = any(s.name in ("prefix", "kv_prefix") for s, _ in self.scorers)
        self.session_header = spec.session_header.lower().encode()
        self.uses_session = any(s.name == "session" for s, _ in self.scorers)
        self.observer = observer

    def pick(self, endpoints: Sequence[EndpointRuntime], ctx: Context) -> EndpointRuntime | None:
        """The endpoint for this request, or None when every one was filtered out.

        With one candidate left there is nothing to decide: it is taken without
        scoring (so scorer metrics describe real choices), and the scorers that
        learn still see it.
        """
        exclude = ctx.exclude
        cands = [ep for ep in endpoints if ep.id not in exclude] if exclude else list(endpoints)
        observer = self.observer
        for f in self.filters:
            kept = f.select(cands, ctx)
            if len(kept) != len(cands) and observer is not None:
                observer.dropped(ctx.model, f.name, len(cands) - len(kept))
            cands = kept
            if not cands:
                return None
        n = len(cands)
        if n == 1:
            chosen = cands[0]
        else:
            totals = [0.0] * n
            per_scorer = []
            for scorer, weight in self.scorers:
                vals = [0.0] * n
                scorer.score(cands, ctx, vals)
                per_scorer.append(vals)
                for i in range(n):
                    totals[i] += weight * vals[i]
            idx = self.picker.pick(totals, ctx.key)
            chosen = cands[idx]
            if observer is not None:
                for (scorer, _), vals in zip(self.scorers, per_scorer, strict=True):
                    observer.scored(ctx.model, scorer.name, vals[idx])
        for scorer in self.learners:
            scorer.picked(chosen, ctx)
        return chosen
