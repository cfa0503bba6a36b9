"""The saturation detector: one number per pool (the endpoints serving a model).

    saturation = min(1, max(queued / (queue_threshold * endpoints),
                            mean KV use / kv_threshold))

over the pool's ready endpoints, where

    queued = own - capacity / routers  +  sum over endpoints of others' waiting

- `own` is this router's work for the pool, which never lags: requests admission
  granted that have not finished (dispatched or not: between admission and
  dispatch a request is invisible to every other count), or the endpoints'
  in-flight counts if higher (endpoints shared with other models).
- `capacity` is what the engines run at once: an endpoint's `max_running` hint
  when declared, else what was learned from the running counts scraped from it
  (vLLM's metrics do not say max-num-seqs; see `Learned`), and
  `assumed_capacity` until the first scrape. In-flight work up to capacity is
  running, not queued.
- `others' waiting` is the part of an endpoint's scraped waiting count that this
  router's own requests do not explain: the waiting count minus this router's
  requests there that were not running when the sample was taken (in-flight as
  the sample landed, minus the engine's running count). It is the engine-wide view (other routers'
  traffic), an interval late. Taking this router's own part from the live count
  instead keeps a sample from holding traffic back after the queue it saw has
  drained, and from counting requests that were merely arriving between two
  engine steps as a queue.

A sample older than `stale_after` is ignored, so a pool whose scrapes fail is
judged by the router's view alone rather than by a frozen number. Saturation is
clamped to 1, so a band ceiling above 1 is never held back.

With several routers (or worker processes) behind a load balancer each gets its
share of the traffic, so each counts capacity / routers against its own work.

Endpoints are read duck-typed (the router's EndpointRuntime): `id`, `state`,
`inflight`, `load` (waiting, running, kv_usage, at; or None) and `spec`
(`max_running`, `url`, `replica_id`). The cost is O(endpoints in the pool) per
evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llmgw.contracts import EndpointState

log = logging.getLogger(__name__)

READY = EndpointState.READY


class Pool:
    __slots__ = ("name", "endpoints", "active", "cold")

    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoints: Sequence[Any] = ()  # the latest route's endpoints
        self.active = 0  # granted by admission and not yet finished
        # Scaled to zero with requests waiting for its first replica: nothing flows
        # until an endpoint is ready (saturation 0 would let them through to a 503).
        self.cold = False


class Learned:
    """One endpoint's batch capacity as learned from its samples, one sample at a time.

    - It rises to any running count above it (the engine ran that many at once).
    - It falls only on evidence: for `relearn_after` seconds of consecutive samples
      (none more than `stale_after` apart) the engine had requests waiting and never
      ran as many as learned. It then falls to the most the engine ran in that time,
      which is what it runs now (restarted with a smaller max-num-seqs, or a smaller
      engine behind the same id). A single sample caught between two engine steps
      (a request finished, the next not yet scheduled) does not count: any sample
      at the learned value, or with no queue, ends the stretch.
    - A new url or replica behind the same id is a new engine: learning starts over.

    Why it cannot oscillate with the saturation gate: admission lets an engine see
    its capacity plus the queue allowance, so an engine at its real batch size B
    shows running == B (a learned value of B is then confirmed, not lowered) with
    some waiting, and it can never show more than B (the value never rises above
    B). Lowering needs seconds of evidence and rising needs a larger batch, so the
    value moves only when what the engine can run moves.
    """

    __slots__ = ("spec", "url", "replica", "value", "short_since", "short_peak", "last_at")

    def __init__(self, spec: Any) -> None:
        self.spec = spec  # the spec last checked (identity: re-checked only when replaced)
        self.url = spec.url
        self.replica = spec.replica_id
        self.value = 0  # 0: nothing learned yet
        self.short_since: float | None = None  # start of the current short-and-queued stretch
        self.short_peak = 0  # most running seen in that stretch
        self.last_at = 0.0  # its latest sample

    def same_engine(self, spec: Any) -> bool:
        self.spec = spec
        return spec.url == self.url and spec.replica_id == self.replica


class Detector:
    def __init__(
        self,
        *,
        queue_threshold: float = 5.0,
        kv_threshold: float = 0.8,
        stale_after: float = 1.0,
        assumed_capacity: int = 1,
        relearn_after: float = 5.0,
        routers: int = 1,
    ) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.stale_after = stale_after
        self.assumed_capacity = assumed_capacity
        self.relearn_after = relearn_after  # 0: the learned capacity never falls
        self.routers = routers
        self.pools: dict[str, Pool] = {}
        self.learned: dict[str, Learned] = {}  # endpoint id -> what its samples taught
        # endpoint id -> (sample time, this router's in-flight there when first seen)
        self._own_at_sample: dict[str, tuple[float, float]] = {}

    def pool(self, model: str) -> Pool:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = Pool(model)
        return pool

    def _learned(self, ep: Any) -> Learned:
        entry = self.learned.get(ep.id)
        spec = ep.spec
        if entry is None or (entry.spec is not spec and not entry.same_engine(spec)):
            if entry is not None and entry.value:
                log.info(
                    "endpoint %s is a new engine (url or replica changed): "
                    "its capacity is learned afresh",
                    ep.id,
                )
            entry = self.learned[ep.id] = Learned(spec)
        return entry

    def forget_gone(self) -> None:
        """Drop what was learned of endpoints no pool routes to any more: every rolling
        update brings new endpoint ids, and a long-lived router must not keep them all."""
        live = {ep.id for pool in self.pools.values() for ep in pool.endpoints}
        for table in (self.learned, self._own_at_sample):
            for gone in table.keys() - live:
                del table[gone]

    def capacity(self, ep: Any) -> int:
        learned = self._learned(ep).value
        hint = ep.spec.max_running
        if hint:
            return max(hint, learned)
        return learned or self.assumed_capacity

    def observed(self, ep: Any) -> None:
        """A sample just landed for `ep`: note this router's in-flight count there now,
        and learn its capacity from it."""
        load = ep.load
        self._own_at_sample[ep.id] = (load.at, ep.inflight)
        self.learn(ep, self._learned(ep), load)

    def learn(self, ep: Any, entry: Learned, load: Any) -> None:
        """One sample's lesson (see `Learned`)."""
        running = int(load.running)
        if running > entry.value:
            entry.value = running
            entry.short_since = None
            return
        if running == entry.value or load.waiting <= 0 or self.relearn_after <= 0:
            entry.short_since = None  # at the learned batch, or nothing waiting
            return
        at = load.at
        if entry.short_since is None or at - entry.last_at > self.stale_after:
            entry.short_since = at
            entry.short_peak = running
        elif running > entry.short_peak:
            entry.short_peak = running
        entry.last_at = at
        if at - entry.short_since >= self.relearn_after:
            if entry.short_peak == 0:
                # Queued yet running nothing: a stalled engine (hung, preempting), not a
                # smaller one. Learning 0 would leave it a capacity of 1 to climb back from.
                entry.short_since = None
                return
            log.info(
                "endpoint %s: learned capacity %d -> %d (requests waited there for %.1fs "
                "while it ran at most %d)",
                ep.id,
                entry.value,
                entry.short_peak,
                at - entry.short_since,
                entry.short_peak,
            )
            entry.value = entry.short_peak
            entry.short_since = None

    def others_waiting(self, ep: Any, load: Any) -> float:
        """The endpoint's scraped waiting count beyond what this router's requests explain."""
        seen = self._own_at_sample.get(ep.id)
        if seen is None or seen[0] != load.at:
            # A sample nobody reported through `observed`: read the in-flight count now.
            seen = self._own_at_sample[ep.id] = (load.at, ep.inflight)
        # Of this router's requests at the engine then, those not running were waiting
        # (or just arriving); only waiting beyond them is someone else's.
        ours = seen[1] - load.running
        others = load.waiting - (ours if ours > 0 else 0)
        return others if others > 0 else 0.0

    def saturation(self, pool: Pool, now: float) -> float:
        sat = self.unclamped(pool, now)
        return sat if sat < 1.0 else 1.0

    def unclamped(self, pool: Pool, now: float) -> float:
        """Saturation before clamping to 1: how far past the healthy limit the pool is
        (the autoscaler's record of it; admission needs only the clamped value)."""
        n = 0
        in_flight = 0
        capacity = 0.0
        others = 0.0
        kv_sum = 0.0
        oldest_fresh = now - self.stale_after
        routers = self.routers
        for ep in pool.endpoints:
            if ep.state is not READY:
                continue
            n += 1
            in_flight += ep.inflight
            capacity += self.capacity(ep) / routers
            load = ep.load
            if load is not None and load.at >= oldest_fresh:
                others += self.others_waiting(ep, load)
                kv_sum += load.kv_usage
        if not n:
            # Nothing to protect: let the request through so the router answers at once.
            return 0.0
        own = max(pool.active, in_flight) - capacity
        queued = (own if own > 0 else 0.0) + others
        return max(queued / (self.queue_threshold * n), kv_sum / n / self.kv_threshold)
