"""Scorers that rate endpoints by their load (queue, free KV cache, this router's
in-flight requests) or by where a session went last.

Each writes a score in 0..1 per candidate, higher is better; the pipeline sums them
with the model's weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.contracts import SchedulingSpec
    from llmgw.router.endpoints.view import EndpointRuntime
    from llmgw.router.scheduling.pipeline import Context, Settings


class StatelessScorer:
    learns = False
    needs_prompt_blocks = False
    needs_session = False

    def __init__(self, settings: Settings):
        self.stale_after = settings.stale_after

    def configure(self, spec: SchedulingSpec) -> None:
        pass

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


class QueueScorer(StatelessScorer):
    """Fewer requests waiting in the engine's queue is better (stale load scores 0)."""

    name = "queue"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        limit = ctx.now - self.stale_after
        values: list[float | None] = []
        for ep in cands:
            load = ep.load
            values.append(load.waiting if load is not None and load.at >= limit else None)
        _min_max(values, out)


class KvScorer(StatelessScorer):
    """More free KV cache is better (stale load scores 0)."""

    name = "kv"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        limit = ctx.now - self.stale_after
        for i, ep in enumerate(cands):
            load = ep.load
            out[i] = 1.0 - load.kv_usage if load is not None and load.at >= limit else 0.0


class InflightScorer(StatelessScorer):
    """Fewer requests this router has in flight there is better: the signal that never lags."""

    name = "inflight"

    def score(self, cands: Sequence[EndpointRuntime], ctx: Context, out: list[float]) -> None:
        _min_max([ep.inflight for ep in cands], out)


class SessionScorer:
    """Requests with the same session header go where that session went last."""

    name = "session"
    learns = True
    needs_prompt_blocks = False
    needs_session = True

    def __init__(self, settings: Settings):
        self.capacity = settings.session_capacity
        self.last: OrderedDict[str, str] = OrderedDict()  # session -> endpoint id

    def configure(self, spec: SchedulingSpec) -> None:
        pass

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
