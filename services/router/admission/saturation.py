"""The saturation detector: one number per pool (the endpoints serving a model).

    saturation = min(1, max(queued / (queue_threshold * endpoints),
                            mean KV use / kv_threshold))

over the pool's ready endpoints, where

    queued = own - capacity / routers  +  sum over endpoints of others' waiting

- `own` is this router's work for the pool, which never lags: requests admission
  granted that have not finished (dispatched or not: between admission and
  dispatch a request is invisible to every other count), or the endpoints'
  in-flight counts if higher (endpoints shared with other models).
- `capacity` is what the engines run at once: the larger of an endpoint's
  `max_running` hint and what was learned from the running counts scraped from it
  (vLLM's metrics do not say max-num-seqs; see `endpoints.capacity.Learned`, the
  one learned value the kv_prefix scorer's affinity limit reads too), and
  `assumed_capacity` while neither is known. In-flight work up to capacity is
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

from collections.abc import Sequence
from typing import Any

from llmgw.contracts import EndpointState
from llmgw.router.endpoints.capacity import BatchCapacities

READY = EndpointState.READY


class Pool:
    __slots__ = ("name", "endpoints", "active", "cold", "adapter", "arrived")

    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoints: Sequence[Any] = ()  # the latest route's endpoints
        self.active = 0  # granted by admission and not yet finished
        # Scaled to zero with requests waiting for its first replica: nothing flows
        # until an endpoint is ready (saturation 0 would let them through to a 503).
        self.cold = False
        # A LoRA adapter's pool (its endpoints hold the adapter): cold while none does.
        self.adapter = False
        # An adapter's requests that arrived since the demand summary took the count.
        self.arrived = 0


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
        batches: BatchCapacities | None = None,
    ) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.stale_after = stale_after
        self.assumed_capacity = assumed_capacity
        self.routers = routers
        self.pools: dict[str, Pool] = {}
        # The router's learned capacities, fed by its view (shared with the scorers), or
        # this detector's own, which it then feeds and prunes itself.
        self.owns_batches = batches is None
        self.batches = batches or BatchCapacities(
            stale_after=stale_after, relearn_after=relearn_after
        )
        # endpoint id -> (sample time, this router's in-flight there when first seen)
        self._own_at_sample: dict[str, tuple[float, float]] = {}

    def pool(self, model: str) -> Pool:
        pool = self.pools.get(model)
        if pool is None:
            pool = self.pools[model] = Pool(model)
        return pool

    @property
    def learned(self) -> dict:
        """Endpoint id -> what its samples taught (`endpoints.capacity.Learned`)."""
        return self.batches.learned

    def forget_gone(self) -> None:
        """Drop what was learned of endpoints no pool routes to any more: every rolling
        update brings new endpoint ids, and a long-lived router must not keep them all."""
        live = {ep.id for pool in self.pools.values() for ep in pool.endpoints}
        for gone in self._own_at_sample.keys() - live:
            del self._own_at_sample[gone]
        if self.owns_batches:  # shared ones are pruned by their owner, on view changes
            self.batches.keep_only(live)

    def capacity(self, ep: Any) -> int:
        return self.batches.of(ep) or self.assumed_capacity

    def observed(self, ep: Any) -> None:
        """A sample just landed for `ep`: note this router's in-flight count there now
        (and learn its capacity from it, when the capacities are this detector's own)."""
        load = ep.load
        self._own_at_sample[ep.id] = (load.at, ep.inflight)
        if self.owns_batches:
            self.batches.observed(ep)

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
