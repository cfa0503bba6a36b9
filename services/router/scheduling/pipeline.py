"""Where a request goes: filters, then weighted scorers, then a picker.

Each unit is small, named and behind one interface (the plugins live in `filters`,
`scorers`, `prefix`, `cached` and `pickers`; their names in the registries here). A
`Profile` is one run of them, and a model's `Pipeline` holds its profiles (one by
default; see `profiles`), assembled from its `contracts.SchedulingSpec` (names and
weights). The caller passes the time, and there is no random source. Where a
picker needs chance (p2c's two candidates, weighted_random's draw) it reads the
request's key, a hash of its bytes (`request_key`): two routers with the same
view pick the same endpoint for the same request, and tests drive every
decision. max_score's ties go in turn (pickers.MaxScore).

Filters drop endpoints that must not get the request. Scorers rate each
remaining endpoint in 0..1 (higher is better); the pipeline sums them with the
model's weights and the picker chooses. Scorers that learn from decisions
(prefix, session) see the chosen endpoint through `picked`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from llmgw.contracts import DisaggregationSpec, SchedulingSpec
from llmgw.router.scheduling.cached import CachedPrefixScorer
from llmgw.router.scheduling.filters import CircuitClosed, Ready, ServesModel
from llmgw.router.scheduling.lora import HoldsAdapter, LoraAffinityScorer
from llmgw.router.scheduling.pickers import MaxScore, PowerOfTwo, WeightedRandom
from llmgw.router.scheduling.prefix import (
    NO_PROMPT,
    PrefixConfig,
    PrefixScorer,
    PromptBlocks,
    block_hashes,
)
from llmgw.router.scheduling.profiles import (
    DECODE,
    DEFAULT,
    PREFILL,
    Disaggregated,
    ProfileHandler,
    SingleProfile,
    decode_spec,
)
from llmgw.router.scheduling.scorers import (
    InflightScorer,
    KvScorer,
    QueueScorer,
    SessionScorer,
)

if TYPE_CHECKING:
    from llmgw.router.endpoints.capacity import BatchCapacities
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.kvcache.indexer import Indexer, PromptWork


@dataclass(frozen=True, slots=True)
class Settings:
    """What every model's pipeline is built from: each plugin reads its own config
    section, and the data the router produces for the plugins that need it."""

    stale_after: float = 1.0  # seconds after which scraped load no longer counts
    session_capacity: int = 65536  # sessions remembered per model
    prefix: PrefixConfig = field(default_factory=PrefixConfig)  # the config's `prefix:`
    # What engines hold per their KV events (control-plane mode); None: no events.
    indexer: Indexer | None = None
    # Each endpoint's batch capacity, learned from its load samples (shared with
    # admission); None: only the catalog's `max_running` hints.
    batches: BatchCapacities | None = None


class Context:
    """What the pipeline knows about one request."""

    __slots__ = (
        "now",
        "model",
        "prefix",
        "session",
        "exclude",
        "_key",
        "body",
        "kv",
        "salt",
        "adapter",
        "api",
    )

    def __init__(
        self,
        now: float,
        model: str,
        prefix: PromptBlocks | None = None,
        session: str | None = None,
        exclude: Sequence[str] = (),
        key: int | None = None,
        salt: str | None = None,
        body: bytes = b"",
        api: str = "",
    ):
        self.now = now
        self.model = model
        # The prompt, and its chained block hashes (computed on first use); empty when
        # no scorer of the model reads it, or the request has no prompt.
        self.prefix = prefix if prefix is not None else NO_PROMPT
        self.session = session
        self.exclude = exclude  # endpoint ids already tried for this request
        self._key = key
        self.body = body  # the request's bytes, hashed into `key` only when read
        # The KV indexer's work on this prompt (token ids, block hashes, what each
        # engine held), kept for the request's retries.
        self.kv: PromptWork | None = None
        # The request's cache_salt: engines key its first block by it, so must kv_prefix.
        self.salt = salt
        # The LoRA adapter the request names (its route's name), None for a base model.
        self.adapter: str | None = None
        # The request's API (kinds.ApiKind.name: "chat", "responses", ...), "" if unknown.
        self.api = api

    @property
    def key(self) -> int:
        """request_key(body), the source of chance for the pickers that need one
        (`needs_key`), hashed on first read: max_score, the default, never reads it."""
        if self._key is None:
            self._key = request_key(self.body)
        return self._key

    def for_leg(self) -> Context:
        """The same request for another leg (P/D's prefill): its own tried endpoints."""
        leg = Context(
            self.now,
            self.model,
            self.prefix,
            self.session,
            [],
            self._key,
            self.salt,
            self.body,
            self.api,
        )
        leg.adapter = self.adapter
        return leg


# Bytes hashed from each end of a body: O(1) for any size, and the end is where
# requests that share a long system prompt differ.
_KEY_EDGE = 2048


def request_key(body: bytes) -> int:
    """A 32-bit hash of the request, the same in every router process (unlike `hash`)."""
    if len(body) <= 2 * _KEY_EDGE:
        return zlib.crc32(body)
    key = zlib.crc32(body[-_KEY_EDGE:], zlib.crc32(body[:_KEY_EDGE]))
    return zlib.crc32(len(body).to_bytes(8, "little"), key)


# ------------------------------------------------------------------ interfaces


class Filter(Protocol):
    name: ClassVar[str]

    def select(self, cands: list[EndpointRuntime], ctx: Context) -> list[EndpointRuntime]:
        """The candidates that may get the request (a whole list at a time: one
        comprehension is much cheaper per request than a call per endpoint)."""


class Scorer(Protocol):
    name: ClassVar[str]
    learns: ClassVar[bool]  # wants `picked` calls
    # What it reads from the request, so the pipeline prepares only what some scorer
    # needs: the prompt's blocks (`Context.prefix`), the session header (`.session`).
    needs_prompt_blocks: ClassVar[bool]
    needs_session: ClassVar[bool]

    def configure(self, spec: SchedulingSpec) -> None:
        """The model's scheduling section is known (e.g. its tokenizer)."""

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        """Write each candidate's score (0..1, higher is better) into `out`."""

    def picked(self, ep: EndpointRuntime, ctx: Context) -> None: ...


class Picker(Protocol):
    name: ClassVar[str]
    needs_key: ClassVar[bool]  # reads the request key (else it is never hashed)

    def pick(self, totals: Sequence[float], key: int) -> int: ...


FILTERS: dict[str, Callable[[Settings], Filter]] = {
    f.name: f for f in (ServesModel, Ready, CircuitClosed, HoldsAdapter)
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
        LoraAffinityScorer,
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


class Profile:
    """One run of filters, weighted scorers and a picker, built from a scheduling section."""

    def __init__(self, spec: SchedulingSpec, settings: Settings, observer: Observer | None):
        self.filters = [FILTERS[name](settings) for name in spec.filters]
        # Weight 0 turns a scorer off without removing it from the file.
        self.scorers = [
            (SCORERS[name](settings), weight) for name, weight in spec.scorers.items() if weight > 0
        ]
        for scorer, _ in self.scorers:
            scorer.configure(spec)
        self.picker = PICKERS[spec.picker]()
        self.learners = [s for s, _ in self.scorers if s.learns]
        self.needs_prompt_blocks = any(s.needs_prompt_blocks for s, _ in self.scorers)
        self.needs_session = any(s.needs_session for s, _ in self.scorers)
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
            idx = self.picker.pick(totals, ctx.key if self.picker.needs_key else 0)
            chosen = cands[idx]
            if observer is not None:
                for (scorer, _), vals in zip(self.scorers, per_scorer, strict=True):
                    observer.scored(ctx.model, scorer.name, vals[idx])
        for scorer in self.learners:
            scorer.picked(chosen, ctx)
        return chosen


class Pipeline:
    """A model route's scheduling: its profiles, and the handler that runs them.

    Built from the route's scheduling section: one profile, `default`, run for every
    request by `profiles.SingleProfile`; a disaggregated model's (`disaggregation`
    set) has the `prefill` and `decode` profiles instead, run by
    `profiles.Disaggregated`. What the request path prepares for the scorers (the
    prompt's blocks, the session) is what some profile's scorers declare they need.
    """

    def __init__(
        self,
        spec: SchedulingSpec,
        settings: Settings | None = None,
        *,
        observer: Observer | None = None,
        disaggregation: DisaggregationSpec | None = None,
    ):
        settings = settings or Settings()
        self.spec = spec
        self.disaggregation = disaggregation
        self.profiles: dict[str, Profile]
        self.handler: ProfileHandler
        if disaggregation is None:
            self.profiles = {DEFAULT: Profile(spec, settings, observer)}
            self.handler = SingleProfile()
        else:
            self.profiles = {
                PREFILL: Profile(spec, settings, observer),
                DECODE: Profile(decode_spec(spec), settings, observer),
            }
            self.handler = Disaggregated()
        profiles = self.profiles.values()
        self.needs_prompt_blocks = any(p.needs_prompt_blocks for p in profiles)
        self.needs_session = any(p.needs_session for p in profiles)
        self.session_header = spec.session_header.lower().encode()
        self.block_bytes = settings.prefix.block_bytes
        self.max_blocks = settings.prefix.max_blocks

    def prompt_blocks(self, prompt: bytes, cache_salt: str | None) -> PromptBlocks:
        """The request's prompt as the prefix scorers read it (`Context.prefix`), cut
        into blocks as this router's `prefix` section says (hashed on first use)."""
        return block_hashes(prompt, self.block_bytes, self.max_blocks, cache_salt)

    def pick(self, endpoints: Sequence[EndpointRuntime], ctx: Context) -> EndpointRuntime | None:
        """The endpoint for this request, or None when every one was filtered out."""
        return self.handler.pick(self.profiles, endpoints, ctx)

    def pick_prefill(
        self, endpoints: Sequence[EndpointRuntime], ctx: Context
    ) -> EndpointRuntime | None:
        """A disaggregated model's endpoint for a request's prefill leg (relay/disagg.py),
        or None when no prefill endpoint can take it."""
        assert isinstance(self.handler, Disaggregated)
        return self.handler.pick_prefill(self.profiles, endpoints, ctx)
