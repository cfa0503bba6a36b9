"""The demand per adapter the placement weighs: routers' counts, smoothed over time. Pure.

Each router's summary says, per base model and adapter, how many requests arrived since
its previous summary and how many wait in admission because no replica holds the
adapter. The placement must not follow every second's noise (a slot reshuffled on a
burst is a load now and another when the burst ends), so requests per second are
smoothed with an exponentially weighted moving average (half-life `HALF_LIFE`). Requests
waiting are kept apart, as a count: the placement weighs a queue against the requests an
incumbent would see over a horizon (placement.py). Added to the rate, a tail adapter's
queue outweighed a popular adapter's requests per second and evicted it.

Arrivals are counted from every summary as it is heard (`heard`), not from the latest
per router when a decision reads them: a router sends a summary at once when a request
starts waiting (up to ten a second), and each one replaced the one before it, so the
arrivals of a summary replaced before a decision read it went uncounted (bench_lora: the
most used adapter's rate levelled at 8-9.5 requests/s against the 11.7 sent). Requests
waiting are a level, not a count of news: they are read from each router's latest summary.

How long a queue has waited (`QueueAges`) is what lets it outbid incumbents in the end
(placement.py, `max_wait`): routers say how many requests wait, not since when, so the
leader counts from when it first heard of the queue until it is empty again. All of a
queue's requests are served together once the adapter is loaded, so that is its oldest
request's wait, give or take a summary's delay (a request turned away at admission's
limit leaves it counting from the first: an overstatement, which only serves it sooner).
A new leader starts counting anew.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from llmgw import contracts as c

HALF_LIFE = 30.0  # seconds for an old rate to weigh half
V = TypeVar("V")


class DemandSmoother:
    def __init__(self, half_life: float = HALF_LIFE):
        self.half_life = half_life
        self.rates: dict[tuple[str, str], float] = {}  # (base model, adapter) -> requests/s
        self._arrived: dict[tuple[str, str], int] = {}  # heard since the last update
        self._at: float | None = None  # monotonic time of the last update

    def heard(self, summary: c.DemandSummary) -> None:
        """One router's summary, as it arrives: its arrivals count once, here."""
        for model, md in summary.models.items():
            for adapter, ad in md.adapters.items():
                if ad.requests:
                    key = (model, adapter)
                    self._arrived[key] = self._arrived.get(key, 0) + ad.requests

    def update(
        self, summaries: Iterable[c.DemandSummary], now: float
    ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]]]:
        """(base model -> adapter -> requests/s, base model -> adapter -> requests waiting),
        from the arrivals heard since the last update and the routers' latest `summaries`."""
        arrived, self._arrived = self._arrived, {}
        waiting: dict[tuple[str, str], int] = {}
        for sm in summaries:
            for model, md in sm.models.items():
                for adapter, ad in md.adapters.items():
                    key = (model, adapter)
                    waiting[key] = waiting.get(key, 0) + ad.waiting
        dt = now - self._at if self._at is not None else 0.0
        if dt > 0:
            alpha = 1.0 - 0.5 ** (dt / self.half_life)
            for key in set(self.rates) | set(arrived):
                rate = arrived.get(key, 0) / dt
                self.rates[key] = self.rates.get(key, 0.0) + alpha * (
                    rate - self.rates.get(key, 0.0)
                )
        if dt > 0 or self._at is None:
            self._at = now
        return _by_model({k: v for k, v in self.rates.items() if v > 1e-6}), _by_model(
            {k: n for k, n in waiting.items() if n > 0}
        )


def _by_model(values: dict[tuple[str, str], V]) -> dict[str, dict[str, V]]:
    out: dict[str, dict[str, V]] = {}
    for (model, adapter), value in values.items():
        out.setdefault(model, {})[adapter] = value
    return out


class QueueAges:
    """Since when each queue has been waiting, on the monotonic clock."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str], float] = {}

    def update(self, queued: dict[str, dict[str, int]], now: float) -> dict[str, dict[str, float]]:
        """(base model -> adapter -> seconds its queue has waited), for the queues in
        `queued` (as DemandSmoother.update gives them); an emptied queue is forgotten."""
        keys = {(model, a) for model, qs in queued.items() for a, n in qs.items() if n > 0}
        self._since = {key: self._since.get(key, now) for key in keys}
        return _by_model({key: now - since for key, since in self._since.items()})
