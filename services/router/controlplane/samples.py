"""Agents' load samples (core NATS `llmgw.load.<node>`) into the endpoint view.

An agent scrapes each of its engines a few times a second and publishes what
it read; every router subscribes to all of them, so an engine's /metrics is
read once per interval for the whole fleet instead of once per router.

A sample names its shard (the replica's serving shard: the view finds its
endpoint by it, `EndpointView.by_shard`) and its URL; the shard id is tried
first, then the URL. Its age is measured from its arrival, not from its
`sampled_at`: the agent's clock is another machine's, and core NATS either
delivers within milliseconds or not at all. The arrival time also marks the endpoint as fed
(`pushed_at`), which tells the fallback scraper to leave it alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from llmgw import contracts as c
from llmgw.router.endpoints.load import Load
from llmgw.router.endpoints.view import EndpointRuntime, EndpointView

log = logging.getLogger(__name__)

SOURCE = "agent"


class SampleFeed:
    def __init__(self, view: EndpointView, clock: Callable[[], float] = time.monotonic):
        self.view = view
        self.clock = clock
        self.malformed = 0

    def endpoint_for(self, sample: c.LoadSample) -> EndpointRuntime | None:
        return self.view.endpoint_of(sample.shard_id, sample.url)

    def handle(self, raw: bytes) -> str:
        """One message from `llmgw.load.*`: "applied", "unknown" (no such endpoint) or
        "malformed"."""
        try:
            sample = c.decode(raw, c.LoadSample)
        except c.ContractError as exc:
            self.malformed += 1
            if self.malformed == 1 or self.malformed % 1000 == 0:
                log.warning("skipped malformed load samples (%d so far): %s", self.malformed, exc)
            return "malformed"
        ep = self.endpoint_for(sample)
        if ep is None:
            return "unknown"
        now = self.clock()
        ep.pushed_at = now
        self.view.update_load(
            ep.id,
            Load(
                waiting=sample.waiting,
                running=sample.running,
                kv_usage=min(max(sample.kv_usage, 0.0), 1.0),
                at=now,
                source=SOURCE,
                running_adapters=frozenset(sample.running_adapters),
                waiting_adapters=frozenset(sample.waiting_adapters),
            ),
        )
        return "applied"
