"""One learned batch capacity per endpoint: how many requests its engine runs at once.

vLLM's metrics do not say max-num-seqs, and a catalog's `max_running` hint is optional,
so the router learns each engine's batch size from the running counts in its load
samples. Two readers need the same number: admission's saturation detector (work up to
capacity is running, not queued) and the kv_prefix scorer's affinity limit (in flight
beyond capacity is waiting). One `BatchCapacities` learns it, fed by the view's `on_load`
listener as each sample lands, so the two can never disagree on whether an engine is
full, and no reader writes it.

Endpoints are read duck-typed (the router's EndpointRuntime): `id`, `load` (waiting,
running, at) and `spec` (`max_running`, `url`, `replica_id`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


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


class BatchCapacities:
    """What each endpoint's samples taught about its batch size (see `Learned`)."""

    def __init__(self, *, stale_after: float = 1.0, relearn_after: float = 5.0) -> None:
        self.stale_after = stale_after
        self.relearn_after = relearn_after  # 0: a learned capacity never falls
        self.learned: dict[str, Learned] = {}  # endpoint id -> what its samples taught

    def of(self, ep: Any) -> int:
        """The engine's batch capacity: the larger of the catalog's `max_running` hint
        and what was learned; 0 while neither is known."""
        entry = self.learned.get(ep.id)
        spec = ep.spec
        # Read only: a new engine behind the id has learned nothing yet; `observed`
        # starts its entry afresh with its first sample.
        same = entry is not None and (
            entry.spec is spec or (spec.url == entry.url and spec.replica_id == entry.replica)
        )
        learned = entry.value if same else 0
        hint = spec.max_running
        return max(hint, learned) if hint else learned

    def entry(self, ep: Any) -> Learned:
        """The endpoint's entry, made afresh for an endpoint not seen or a new engine."""
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

    def observed(self, ep: Any) -> None:
        """A sample just landed for `ep` (the view's `on_load` listener): learn from it."""
        self.learn(ep, self.entry(ep), ep.load)

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

    def keep_only(self, live: Iterable[str]) -> None:
        """Forget endpoints no longer routed to: every rolling update brings new endpoint
        ids, and a long-lived router must not keep them all."""
        for gone in self.learned.keys() - set(live):
            del self.learned[gone]
