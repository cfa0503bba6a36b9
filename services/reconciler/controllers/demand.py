"""The routers' demand summaries as the leader hears them: the latest per router process.

Routers publish a DemandSummary about once a second on core NATS (`llmgw.demand.<router>`).
Two controllers read them: the autoscaler (demand per model) and the LoRA placement
(demand per adapter). One subscription keeps them for both, so the two decide on the
same summaries and a forged or malformed one is refused once. Summaries are not
persisted: each decision records the values it was made on.

Arrival is stamped on the leader's monotonic clock (a wall-clock step must not make a
fresh summary look an hour old); `fresh(now, ttl)` forgets what is older than `ttl`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from nats.aio.msg import Msg
from prometheus_client import Counter

from llmgw import contracts as c
from llmgw import subjects as s

log = logging.getLogger(__name__)

SUMMARIES = Counter(
    "llmgw_reconciler_demand_summaries_total", "Router demand summaries received", ["result"]
)


class DemandIntake:
    def __init__(self, monotonic: Callable[[], float]):
        self.monotonic = monotonic
        # (router id, worker process) -> (arrival (monotonic), latest summary)
        self.latest: dict[tuple[str, int], tuple[float, c.DemandSummary]] = {}
        self._sub = None
        self._users = 0
        # Called with each accepted summary, after it is kept (a controller that wants to
        # act on some summaries at once, not on its next tick).
        self.listeners: list[Callable[[c.DemandSummary], None]] = []

    async def attach(self, nc) -> None:
        """A controller starts reading: the first one subscribes."""
        self._users += 1
        if self._sub is None:
            self._sub = await nc.subscribe(s.DEMAND_ALL, cb=self.on_summary)

    async def detach(self) -> None:
        """A controller stops reading: the last one unsubscribes."""
        self._users = max(0, self._users - 1)
        if self._users == 0 and self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def on_summary(self, msg: Msg) -> None:
        """One router's summary, as its subscription hands it over: the latest per router."""
        try:
            summary = c.decode(msg.data, c.DemandSummary)
        except c.ContractError as exc:
            SUMMARIES.labels("malformed").inc()
            log.warning("dropped a malformed demand summary on %s: %s", msg.subject, exc.reason)
            return
        if msg.subject != s.demand(summary.router_id):
            # The bus lets a router publish only on its own subject (nats-config), so a
            # summary naming another router is a forgery or a misconfigured router:
            # counting it would let one router steer every model's scale.
            SUMMARIES.labels("misaddressed").inc()
            log.warning(
                "dropped a demand summary for router %r that arrived on %s",
                summary.router_id,
                msg.subject,
            )
            return
        SUMMARIES.labels("ok").inc()
        self.latest[(summary.router_id, summary.process)] = (self.monotonic(), summary)
        for listener in list(self.listeners):
            listener(summary)

    def fresh(self, now: float, ttl: float) -> list[c.DemandSummary]:
        """The summaries younger than `ttl` at monotonic `now` (older ones are forgotten),
        in router order: the order replay re-combines recorded inputs in (float sums
        depend on their order)."""
        for key in [k for k, (at, _) in self.latest.items() if now - at > ttl]:
            del self.latest[key]
        ordered = sorted(self.latest.values(), key=lambda x: (x[1].router_id, x[1].process))
        return [sm for _, sm in ordered]
